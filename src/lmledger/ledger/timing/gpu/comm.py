"""A collective's seconds on the link it crosses, at NCCL's measured bus bandwidth and latency rather than line rate.

    seconds = latency(ring hops) + bytes a ring sends / (line rate x the link's NCCL efficiency)

The link and the ring's bytes are ledger/hardware/interconnect's (the group's link; 2(n-1)/n of the buffer for an
all-reduce, (n-1)/n for an all-gather or reduce-scatter). What NCCL reaches of each link family, and its latency:

    NVLink 3 (A100)   about 230 GB/s all-reduce bus bandwidth of 300 (nccl-tests#149; vTrain's nccl-tests table for
                      8 A100s: 229 GB/s at 1 GB): 0.76. A group of fewer ranks reaches less: the same table measures
                      197 GB/s on 2, 212 on 3, 222 on 4 and 224-227 on 5 to 7 (_NVLINK3_FEWER)
    NVLink 4 (H100)   "an effective NVLink bandwidth of 370GB/s" of the 450 line rate, seen as ring bus bandwidth
                      (sjeaugey, nccl-tests#212): 0.82
    InfiniBand, RoCE  NDR: 46-48 GB/s a NIC of 50 (nccl-tests#290, #267): 0.94; HDR at 86 of 100 over four NICs
                      (nccl-tests#175): 0.86, taken for RoCE too
    PCIe              none found: 0.8 assumed
    latency           vTrain's nccl-tests table for A100s in a node: a 1 MB all-reduce in 44 us on 2 GPUs, 51 on 4,
                      93 on 8, of which the bytes take 4-8: 32 us plus 4 us a ring step (a least-squares line through
                      the three), taken for every link in a node. A step between nodes: 14 us (NCCL's own model,
                      tuning.cc: the network's per-hop latency, Simple protocol), over the nodes a ring crosses
    tree              an all-reduce across nodes may run as NCCL's tree instead, whichever is faster (NCCL picks by
                      its own model, tuning.cc): a chain inside each node and a binary tree between nodes, up and
                      down, at 0.92 of the ring's bandwidth; a ring of hundreds of ranks pays its every step's
                      latency, a tree only its depth

Pure arithmetic: no torch.
"""

from __future__ import annotations

import math

from lmledger.ledger.hardware.interconnect import Interconnect, Links, collective_kind, wire_bytes

__all__ = ["Links", "collective", "nccl_efficiency"]

_BASE_S, _STEP_S, _NODE_STEP_S = 32e-6, 4e-6, 14e-6
_TREE_SHARE = 0.92  # a tree all-reduce's bus bandwidth, of the ring's (NCCL tuning.cc)
_EFFICIENCY = (("NVLink 3", 0.76), ("NVLink 4", 0.82), ("NVLink 5", 0.82), ("NVLink 2", 0.76),
               ("InfiniBand NDR", 0.94), ("InfiniBand XDR", 0.94), ("InfiniBand HDR", 0.86), ("RoCE", 0.86),
               ("PCIe", 0.8))  # fmt: skip
# An A100 node's all-reduce bus bandwidth on n < 8 ranks, GB/s at 1 GB (vTrain's nccl-tests tables, trace/a100/
# AR_GPU{n}_1M_1024M_LUT at f8dda84: measured on the node its published runs ran on); 8 ranks: 229, the 0.76 above.
_NVLINK3_FEWER = {2: 197.3, 3: 211.9, 4: 221.9, 5: 224.5, 6: 227.0, 7: 226.9}


def nccl_efficiency(link: Interconnect, ranks: int | None = None) -> float:
    """The share of the link's line rate NCCL's bus bandwidth reaches (module doc), on a group of `ranks` where that
    is measured to matter; 0.8 for a link not listed."""
    if link.name.startswith("NVLink 3") and ranks in _NVLINK3_FEWER:
        return _NVLINK3_FEWER[ranks] * 1e9 / link.bytes_per_s
    return next((eff for prefix, eff in _EFFICIENCY if link.name.startswith(prefix)), 0.8)


def collective(op: object, links: Links, world_size: int) -> tuple[float, str | None]:
    """(seconds, stream) of one recorded collective; a wait moves nothing: (0.0, None). The stream is the process
    group: one communicator's collectives share its links, so FSDP's all-gathers and reduce-scatters, though issued
    from streams of their own, take turns on the wire."""
    kind = collective_kind(op.name)
    if kind is None:
        return 0.0, None
    if kind == "all_to_all" and op.group == "context_parallel":
        kind = "permute"  # the ring's rotation: all_to_all_single with the whole buffer to the next rank (a send)
    size = op.group_size or world_size
    link = links.for_group(op.group or "world", size)
    sent = wire_bytes(kind, max(op.bytes_read, op.bytes_written), size)
    if not sent:
        return 0.0, op.group or "world"
    rate = link.bytes_per_s * nccl_efficiency(link, size) * _rails(op.group or "world", size, link, links)
    span = links.span(op.group or "world", size)
    nodes = min(size, -(-span // max(1, links.gpus_per_node))) if link.scope == "inter-node" else 1
    seconds = _ring_latency(kind, size, nodes) + sent / rate
    if kind == "all_reduce" and nodes > 1:
        seconds = min(seconds, _tree_latency(size, nodes) + sent / (rate * _TREE_SHARE))
    return seconds, op.group or "world"


def _rails(group: str, size: int, link: Interconnect, links: Links) -> float:
    """How many NICs a group's ring spreads its traffic between nodes over: NCCL runs one ring channel through each
    of a node's NICs, so a group with k ranks in each node crosses at k NICs' rate (4 HDR NICs a node gave 86 GB/s
    bus bandwidth of their 100, nccl-tests#175), capped by the link inside the node. A data-parallel group with one
    rank a node (TP filling the node) has its rank's NIC alone."""
    if link.scope != "inter-node" or links.num_nodes <= 1:
        return 1.0
    local = links.per_node(group, size)
    cap = links.intra.bytes_per_s * nccl_efficiency(links.intra) / (link.bytes_per_s * nccl_efficiency(link))
    return min(float(local), max(1.0, cap))


def _ring_latency(kind: str, size: int, nodes: int) -> float:
    """A ring's fixed cost (module doc): its steps inside nodes and between them."""
    rounds = 2 if kind == "all_reduce" else 1
    return _BASE_S + rounds * (size - nodes) * _STEP_S + rounds * (nodes - 1) * _NODE_STEP_S


def _tree_latency(size: int, nodes: int) -> float:
    """NCCL's tree all-reduce (tuning.cc): up and down a chain of a node's ranks and a binary tree of the nodes."""
    return _BASE_S + 2 * ((max(1, size // nodes) - 1) * _STEP_S + math.ceil(math.log2(nodes)) * _NODE_STEP_S)
