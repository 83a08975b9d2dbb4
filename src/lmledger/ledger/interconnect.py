"""The links between GPUs: intra-node (NVLink, PCIe) and inter-node (InfiniBand, RoCE), with their sources.

    INTERCONNECTS          key -> Interconnect(name, bytes_per_s one way, scope, source)
    resolve_interconnect   a key, or a rate the user gives ("50GB/s", "400Gb/s"), as an Interconnect

A collective that stays inside a node runs at the intra-node link (TP's, and DDP/FSDP on one node); one that
crosses nodes runs at the inter-node link of each GPU's NIC (DDP's and FSDP's across nodes). Rates are one
direction's, dense line rate, per GPU: NVLink's datasheet figures are both directions summed, halved here; a
network's are per port (one NIC a GPU, the usual rail-optimised layout). What a collective reaches is lower
(protocol overhead, NCCL's algorithm): the time ledger's calibration, not this table, covers that.

To be merged with the step-time ledger's alpha-beta table (ledger/steptime) when both land: this one holds
the bandwidths and their sources, that one the latencies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmledger.errors import UserError

__all__ = ["INTERCONNECTS", "Interconnect", "resolve_interconnect"]

GB = 1e9


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: float  # one direction, per GPU
    scope: str  # "intra-node" or "inter-node"
    source: str


INTERCONNECTS: dict[str, Interconnect] = {
    # NVIDIA datasheets give NVLink per GPU with both directions summed.
    "nvlink3": Interconnect("NVLink 3 (A100)", 300 * GB, "intra-node",
                            "NVIDIA A100 datasheet: NVLink 600 GB/s (12 links x 50 GB/s, both directions)"),
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM)", 450 * GB, "intra-node",
                            "NVIDIA H100 datasheet: NVLink 900 GB/s (18 links x 50 GB/s, both directions)"),
    "nvlink5": Interconnect("NVLink 5 (B200)", 900 * GB, "intra-node",
                            "NVIDIA Blackwell (DGX B200) datasheet: NVLink 1.8 TB/s per GPU, both directions"),
    # PCI-SIG: 16 GT/s (Gen4) and 32 GT/s (Gen5) a lane, 128b/130b encoding, x16.
    "pcie4": Interconnect("PCIe 4.0 x16", 31.5 * GB, "intra-node", "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b"),
    "pcie5": Interconnect("PCIe 5.0 x16", 63.0 * GB, "intra-node", "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b"),
    # InfiniBand per port (IBTA speeds; NVIDIA ConnectX-6 HDR, ConnectX-7 NDR, ConnectX-8 XDR).
    "ib-hdr": Interconnect("InfiniBand HDR 200 Gb/s", 25 * GB, "inter-node",
                           "IBTA HDR: 200 Gb/s a 4x port (NVIDIA ConnectX-6)"),
    "ib-ndr": Interconnect("InfiniBand NDR 400 Gb/s", 50 * GB, "inter-node",
                           "IBTA NDR: 400 Gb/s a 4x port (NVIDIA ConnectX-7, Quantum-2)"),
    "ib-xdr": Interconnect("InfiniBand XDR 800 Gb/s", 100 * GB, "inter-node",
                           "IBTA XDR: 800 Gb/s a 4x port (NVIDIA ConnectX-8, Quantum-X800)"),
    # RoCE v2 runs at the Ethernet port's line rate (IEEE 802.3).
    "roce-100": Interconnect("RoCE 100 GbE", 12.5 * GB, "inter-node", "IEEE 802.3 100 GbE line rate"),
    "roce-200": Interconnect("RoCE 200 GbE", 25 * GB, "inter-node", "IEEE 802.3 200 GbE line rate"),
    "roce-400": Interconnect("RoCE 400 GbE", 50 * GB, "inter-node", "IEEE 802.3 400 GbE line rate"),
}  # fmt: skip

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([GT])([Bb])/s\s*$")


def resolve_interconnect(spec: str, scope: str | None = None) -> Interconnect:
    """A table key ("ib-ndr", "nvlink4") or the user's own rate ("50GB/s", "400Gb/s", "1.8TB/s"), one way per GPU.

    `scope` ("intra-node"/"inter-node"), when given, refuses a key of the other kind (NVLink between nodes).
    """
    key = spec.strip().lower()
    if key in INTERCONNECTS:
        link = INTERCONNECTS[key]
        if scope is not None and link.scope != scope:
            raise UserError(f"interconnect {spec!r} is {link.scope}, not {scope}: choose one of {_keys(scope)}")
        return link
    found = _RATE.match(spec)
    if found is None:
        raise UserError(
            f"unknown interconnect {spec!r}: choose one of {_keys(scope)}, or give a rate such as 50GB/s or 400Gb/s"
        )
    value = float(found.group(1)) * (1e12 if found.group(2) == "T" else 1e9) / (1 if found.group(3) == "B" else 8)
    if not value > 0:
        raise UserError(f"interconnect rate {spec!r} must be above zero")
    return Interconnect(spec.strip(), value, scope or "user", "given by the user")


def _keys(scope: str | None) -> str:
    return ", ".join(k for k, v in INTERCONNECTS.items() if scope is None or v.scope == scope)
