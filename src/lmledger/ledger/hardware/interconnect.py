"""The links between GPUs: intra-node (NVLink, PCIe) and inter-node (InfiniBand, RoCE), with their sources,
and what a collective costs on them.

    INTERCONNECTS          key -> Interconnect(name, bytes_per_s one way, scope, source, latency_s)
    resolve_interconnect   a key, or a rate the user gives ("50GB/s", "400Gb/s"), as an Interconnect
    Links                  the intra- and inter-node links of a run, and which one a group's collective crosses
    collective_seconds     one recorded collective on a link: latency + the bytes a ring sends / bandwidth

A collective that stays inside a node runs at the intra-node link (TP's, and DDP/FSDP on one node); one that
crosses nodes runs at the inter-node link of each GPU's NIC (DDP's and FSDP's across nodes). Rates are one
direction's, dense line rate, per GPU: NVLink's datasheet figures are both directions summed, halved here; a
network's are per port (one NIC a GPU, the usual rail-optimised layout). What a collective reaches is lower
(protocol overhead, NCCL's algorithm); on a machine where the backend's group can be timed (gloo here), the
step-time ledger measures the link instead (ledger/timing/steptime/calibrate.collective_model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmledger.errors import UserError

__all__ = [
    "INTERCONNECTS",
    "LATENCY",
    "Interconnect",
    "Links",
    "collective_kind",
    "collective_seconds",
    "communication",
    "default_links",
    "links_for",
    "resolve_interconnect",
    "wire_bytes",
]

GB = 1e9


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: float  # one direction, per GPU
    scope: str  # "intra-node" or "inter-node"
    source: str
    latency_s: float | None = None  # a small message's time (alpha of alpha + bytes / bandwidth); None: LATENCY[scope]
    note: str | None = None  # a user's rate beyond every link of its kind: the likely slip, said beside the answer

    @property
    def alpha_s(self) -> float:
        return LATENCY.get(self.scope, 0.0) if self.latency_s is None else self.latency_s


# A small collective's time, the alpha of alpha-beta: the order of nccl-tests' 8-byte all_reduce on a DGX H100
# inside the node (~10 us) and between nodes over InfiniBand (~20 us). Approximate: NCCL's latency depends on
# its algorithm and protocol, and a step's collectives are mostly large enough for bandwidth to dominate.
LATENCY = {"intra-node": 10e-6, "inter-node": 20e-6}


INTERCONNECTS: dict[str, Interconnect] = {
    # NVIDIA datasheets give NVLink per GPU with both directions summed.
    "nvlink3": Interconnect("NVLink 3 (A100)", 300 * GB, "intra-node",
                            "NVIDIA A100 datasheet: NVLink 600 GB/s (12 links x 50 GB/s, both directions)"),
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM)", 450 * GB, "intra-node",
                            "NVIDIA H100 datasheet: NVLink 900 GB/s (18 links x 50 GB/s, both directions)"),
    "nvlink5": Interconnect("NVLink 5 (B200)", 900 * GB, "intra-node",
                            "NVIDIA Blackwell (DGX B200) datasheet: NVLink 1.8 TB/s per GPU, both directions"),
    "nvlink2": Interconnect("NVLink 2 (V100 SXM2)", 150 * GB, "intra-node",
                            "NVIDIA V100 datasheet: NVLink 300 GB/s (6 links x 50 GB/s, both directions)"),
    "xgmi-mi300": Interconnect("AMD Infinity Fabric (MI300X/MI325X)", 448 * GB, "intra-node",
                               "AMD Instinct MI300X datasheet: 7 links x 128 GB/s = 896 GB/s peer, both directions"),
    # PCI-SIG: 8 GT/s (Gen3), 16 GT/s (Gen4) and 32 GT/s (Gen5) a lane, 128b/130b encoding, x16.
    "pcie3": Interconnect("PCIe 3.0 x16", 15.75 * GB, "intra-node", "PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes, 128b/130b"),
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
    if not key:
        raise UserError(
            f"an empty value names no link: give one of {_keys(scope)}, or a rate such as 50GB/s or 400Gb/s, or leave "
            "the flag out for the GPU's usual link"
        )
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
    note = _beyond_every_link(spec.strip(), value, found.group(3) == "B", scope)
    return Interconnect(spec.strip(), value, scope or "user", "given by the user", note=note)


def _beyond_every_link(spec: str, value: float, in_bytes: bool, scope: str | None) -> str | None:
    """A line for a rate above the fastest link of its kind in the table, or None. Such a rate is almost always a
    slip: a NIC's bits written as bytes (400GB/s for 400Gb/s), or NVLink's datasheet figure, both directions summed,
    where the ledger takes one. The rate is used as given; the line says so beside the answer."""
    kind = [link for link in INTERCONNECTS.values() if link.scope == scope]
    if not kind or value <= (fastest := max(kind, key=lambda link: link.bytes_per_s)).bytes_per_s:
        return None
    if in_bytes and scope == "inter-node":
        guess = f"a network's rate is in bits: did you mean {spec.replace('B/s', 'b/s')} ({value / 8 / GB:.4g} GB/s)?"
    elif in_bytes:
        guess = f"a datasheet's NVLink figure sums both directions, and the ledger takes one: {value / 2 / GB:.4g}GB/s?"
    else:
        guess = "a link newer than the table?"
    return (
        f"{scope} {spec} is {value / GB:.4g} GB/s one way, {value / fastest.bytes_per_s:.3g}x the fastest {scope} link "
        f"known ({fastest.name}, {fastest.bytes_per_s / GB:.4g} GB/s): {guess} (used as given)"
    )


# The usual node of each GPU in the table: its SXM/OAM parts on their own fabric, PCIe cards on the bus (an
# NVLink bridge joins only pairs), and the NIC of its generation's reference system (DGX A100: HDR; DGX H100
# and later: NDR). A guess about the user's cluster, so every answer names it and --intra-node/--inter-node
# replace it.
_NODE_OF = (("a100-pcie", "pcie4", "ib-hdr"), ("a100", "nvlink3", "ib-hdr"), ("v100-pcie", "pcie3", "ib-hdr"),
            ("v100", "nvlink2", "ib-hdr"), ("h100-nvl", "pcie5", "ib-ndr"), ("h200-nvl", "pcie5", "ib-ndr"),
            ("h100", "nvlink4", "ib-ndr"), ("h200", "nvlink4", "ib-ndr"), ("gb200", "nvlink5", "ib-xdr"),
            ("b200", "nvlink5", "ib-ndr"), ("mi3", "xgmi-mi300", "ib-ndr"))  # fmt: skip


def default_links(gpu_key: str, gpus_per_node: int = 8, num_nodes: int = 1) -> Links:
    """The links a run on `gpu_key` (ledger.hardware.gpus) most likely has (_NODE_OF); PCIe 4 and NDR otherwise."""
    intra, inter = next(((a, b) for prefix, a, b in _NODE_OF if gpu_key.startswith(prefix)), ("pcie4", "ib-ndr"))
    return Links(INTERCONNECTS[intra], INTERCONNECTS[inter], gpus_per_node, num_nodes)


def links_for(gpu_key: str | None, intra: str | None, inter: str | None, gpus_per_node: int, num_nodes: int) -> Links:
    """The run's links: the user's --intra-node/--inter-node where given (a key or a rate), else the GPU's
    usual ones (default_links), else NVLink 4 and NDR (an H100 cluster's)."""
    base = default_links(gpu_key or "h100", gpus_per_node, num_nodes)
    return Links(
        resolve_interconnect(intra, "intra-node") if intra else base.intra,
        resolve_interconnect(inter, "inter-node") if inter else base.inter,
        gpus_per_node,
        num_nodes,
    )


def _keys(scope: str | None) -> str:
    return ", ".join(k for k, v in INTERCONNECTS.items() if scope is None or v.scope == scope)


# -- what a collective costs on a link ---------------------------------------------------------------------

# Groups whose ranks are contiguous (TP's inner mesh dimension, HSDP's shard groups, context parallel beside TP as
# torchtitan places it): inside one node while they fit in it. Every other group (data parallel, DDP's world, HSDP's
# replicas) strides across nodes.
_CONTIGUOUS = ("tensor_parallel", "shard", "context_parallel")


@dataclass(frozen=True)
class Links:
    """A run's two links, and the node they are split at: `gpus_per_node` ranks a node, `num_nodes` nodes.
    `context_stride`: the ranks from one member of a context-parallel group to the next, TP's size where TP sits
    inside it (torchtitan's mesh (dp, cp, tp)), so a CP group of c ranks spans c x context_stride."""

    intra: Interconnect
    inter: Interconnect
    gpus_per_node: int = 8
    num_nodes: int = 1
    context_stride: int = 1

    def span(self, group: str, group_size: int) -> int:
        """How many consecutive ranks a contiguous group's members lie within."""
        return group_size * self.context_stride if group == "context_parallel" else group_size

    def for_group(self, group: str, group_size: int) -> Interconnect:
        """The link a collective over `group` (a mesh dimension's name, ops.OpRecord.group) crosses."""
        if self.num_nodes <= 1:
            return self.intra
        if group in _CONTIGUOUS:
            return self.intra if self.span(group, group_size) <= self.gpus_per_node else self.inter
        return self.inter

    def per_node(self, group: str, group_size: int) -> int:
        """How many of a group's members share a node: a contiguous group fills its nodes (a CP group beside TP
        one rank in context_stride), another strides across all of them."""
        if group in _CONTIGUOUS:
            stride = self.context_stride if group == "context_parallel" else 1
            return max(1, min(group_size, self.gpus_per_node // stride))
        return max(1, group_size // max(1, self.num_nodes))

    @staticmethod
    def one(link: Interconnect) -> Links:
        """Every collective on one link (a single rate the user gives, or a measured one)."""
        return Links(link, link)


def collective_kind(name: str) -> str | None:
    """ "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast" or "other" for a collective op's
    name; None for a wait (it moves nothing: the collective it waits on is priced)."""
    lowered = name.lower()
    if "wait" in lowered:
        return None
    for kind, marks in (("reduce_scatter", ("reduce_scatter",)), ("all_gather", ("all_gather", "allgather")),
                        ("all_reduce", ("all_reduce", "allreduce")), ("all_to_all", ("all_to_all", "alltoall")),
                        ("broadcast", ("broadcast",))):  # fmt: skip
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def wire_bytes(kind: str, buffer_bytes: int, group_size: int) -> float:
    """Bytes each rank sends in a ring collective over a `buffer_bytes` tensor (the full, gathered one):
    2(n-1)/n of it for an all-reduce, (n-1)/n for an all-gather, reduce-scatter or all-to-all (nccl-tests
    PERFORMANCE.md's bus-bandwidth factors), all of it for a broadcast or an unknown collective."""
    n = max(1, group_size)
    if n == 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}.get(kind, 1.0)  # fmt: skip
    return factor * buffer_bytes


def collective_seconds(op: object, links: Links, world_size: int) -> tuple[float, Interconnect | None]:
    """(seconds, link) of one recorded collective (an ops.OpRecord of category communication): its link's
    latency plus the bytes a ring sends at its bandwidth. A wait costs nothing (0.0, None)."""
    seconds, link, _ = _priced(op, links, world_size)
    return seconds, link


def _priced(op: object, links: Links, world_size: int) -> tuple[float, Interconnect | None, float]:
    """(seconds, link, bytes sent) of one collective. The tensor a collective moves is its larger side: an
    all-gather's output, a reduce-scatter's input, an all-reduce's buffer. A group the recorder could not name
    is the whole world."""
    kind = collective_kind(op.name)
    if kind is None:
        return 0.0, None, 0.0
    size = op.group_size or world_size
    link = links.for_group(op.group or "world", size)
    sent = wire_bytes(kind, max(op.bytes_read, op.bytes_written), size)
    return (link.alpha_s + sent / link.bytes_per_s if sent else 0.0), link, sent


def communication(ops: object, links: Links, world_size: int) -> dict:
    """A rank's collectives per step on `links`, JSON-ready: the seconds and bytes sent per link and per group
    (mesh dimension), with the links named. Serialised, not overlapped with compute: an upper bound on what
    they add to a step (FSDP2 and DDP overlap most of theirs with backward, TP's sit on the critical path)."""
    by_link: dict[str, dict] = {}
    by_group: dict[str, float] = {}
    for op in ops.ops:
        if op.category != "communication":
            continue
        seconds, link, sent = _priced(op, links, world_size)
        if link is None:
            continue
        row = by_link.setdefault(link.name, {"scope": link.scope, "seconds": 0.0, "collectives": 0, "bytes_sent": 0.0})
        row["seconds"] += seconds
        row["collectives"] += 1
        row["bytes_sent"] += sent
        group = op.group or "world"
        by_group[group] = by_group.get(group, 0.0) + seconds

    def named(link: Interconnect) -> dict:
        return {"name": link.name, "bytes_per_s": link.bytes_per_s, "source": link.source, "note": link.note}

    return {
        "seconds": sum(row["seconds"] for row in by_link.values()),
        "by_link": by_link,
        "by_group": by_group,
        "links": {
            "intra_node": named(links.intra),
            "inter_node": named(links.inter),
            "gpus_per_node": links.gpus_per_node,
            "num_nodes": links.num_nodes,
        },
    }
