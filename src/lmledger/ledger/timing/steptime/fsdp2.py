"""What an FSDP2 collective costs a rank on gloo beyond the bytes it moves, measured once per machine and world size.

FSDP2 wraps each all-gather and reduce-scatter in Python of its own: the unit's pre-forward and pre-backward
hooks, the copy-in and copy-out, the async work and its wait, and on gloo a reduce-scatter run as an all-reduce.
On this machine's 2-core VM (2026-12-04, 2 ranks) that came to about 1.8 ms per collective at a kilobyte, where
a bare all-reduce of that size took 0.4 ms: 5 ms per fully_shard unit, some 25 ms of tiny.yaml's FSDP2 step the
all-reduce's latency did not price (issue 50).

The probe: a chain of tiny Linear blocks, each its own fully_shard unit, forward and backward on `world_size` real
gloo ranks in processes of their own, beside the same chain unsharded; the difference's growth from 2 to 10
units, over the three collectives each unit runs (two all-gathers, one reduce-scatter). The rank's wait for the
other inside each collective is in it. The bytes are priced apart, by the all-reduce's bandwidth. No Lightning import.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.calibrate import gloo_calibration
from lmledger.ledger.timing.steptime.probes import in_own_process, on_gloo_ranks

__all__ = ["FSDP2_COLLECTIVES", "fsdp2_collective_s", "price"]

# FSDP2's own collectives as the op recorder names them (TP's run as _c10d_functional ops, DDP's as allreduce_).
FSDP2_COLLECTIVES = ("c10d._allgather_base_", "c10d._reduce_scatter_base_")
_UNITS = (2, 10)
_WIDTH = 16


def fsdp2_collective_s(world_size: int, cache: StepTimeCache, measure: bool = True) -> tuple[float, str] | None:
    """(seconds per FSDP2 collective beyond its bytes, how) on `world_size` gloo ranks here, cached; None where not
    cached and `measure` is off (inside a multi-rank fit), or the ranks would not start."""
    name = f"fsdp2_per_collective_w{world_size}"
    found = cache.calibration(name)
    if found is not None:
        return float(found["value"]), f"measured {found['measured_at'][:10]} (cache)"
    if not measure:
        return None
    threads = max(1, (os.cpu_count() or 1) // world_size)
    times = in_own_process(__name__, f"_main({world_size}, {threads})", threads)
    if times is None:
        return None
    (few, many) = _UNITS
    extra = (times[f"fsdp{many}"] - times[f"plain{many}"]) - (times[f"fsdp{few}"] - times[f"plain{few}"])
    value = max(0.0, extra / ((many - few) * 3))
    how = (f"fully_shard units of a tiny chain on {world_size} gloo ranks here, {few} against {many} units beside "
           "the chain unsharded, per collective")  # fmt: skip
    cache.set_calibration(name, value, how, times=times)
    cache.save()
    return value, "measured now"


def price(comm_ops: list, world_size: int, cache: StepTimeCache, measure: bool) -> tuple[float, str]:
    """(seconds to add, how) for a step's collectives on gloo: FSDP2's all-gathers and reduce-scatters at their
    measured cost per collective in place of a bare all-reduce's at the smallest probe size; their bytes stay priced
    along the all-reduce's points (calibrate.gloo_seconds). The difference may be negative: a lone all-reduce after
    compute pays gloo's slow mode now and then (calibrate._PROBE_ROUNDS), where FSDP2's, issued back to back inside
    the step, ran at 1.3-1.6 ms each in six launches (2026-12-05)."""
    fsdp = [op for op in comm_ops if op.name.startswith(FSDP2_COLLECTIVES)]
    found = fsdp2_collective_s(world_size, cache, measure) if fsdp else None
    times = (cache.calibration(gloo_calibration(world_size)) or {}).get("value", {}).get("times")
    if found is None or not times:
        return 0.0, ""
    per, measured = found
    extra = per - min(times.items(), key=lambda item: float(item[0]))[1]
    return len(fsdp) * extra, (
        f"; {len(fsdp)} of them FSDP2's, each {extra * 1e3:+.3g} ms for FSDP2's hooks, copies and wait on gloo "
        f"({measured})"
    )


def _main(world_size: int, threads: int) -> dict[str, float]:
    return on_gloo_ranks(_rank, world_size, threads)


def _rank(rank: int, world_size: int, init_method: str, threads: int, queue) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        x = torch.randn(4, _WIDTH)
        out = {}
        for units in _UNITS:
            for kind in ("plain", "fsdp"):
                torch.manual_seed(0)
                chain = nn.Sequential(*[nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Tanh()) for _ in range(units)])
                if kind == "fsdp":
                    for block in chain:
                        fully_shard(block)
                    fully_shard(chain)
                for _ in range(5):
                    chain(x).sum().backward()
                samples = []
                for _ in range(25):
                    dist.barrier()
                    started = time.perf_counter()
                    chain(x).sum().backward()
                    samples.append(time.perf_counter() - started)
                out[f"{kind}{units}"] = statistics.median(samples)
        dist.barrier()  # no rank leaves while another's FSDP2 work is in flight (gloo aborts the process then)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()
