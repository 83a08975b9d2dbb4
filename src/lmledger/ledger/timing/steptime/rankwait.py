"""What a collective costs the ranks beyond itself when they come to it from compute: their wait for each other.

Ranks that compute between collectives reach each one apart, and a rank that waited long enough for gloo to stop
spinning must be woken. On this machine's 2-core VM (2026-12-04, two 1-thread gloo ranks) a tiny all-reduce after
1 ms of matmuls cost nothing more than alone; after 2, 3.5, 11 and 36 ms of them, 0.5, 0.8, 1.2 and 0.9 ms more.
TP 2's twenty all-reduces of tiny.yaml come after a few ms of compute each: some 20 ms of its step (issue 50).

The probe, on `world_size` real gloo ranks in processes of their own: segments of matmuls of two lengths, each
followed by a 4-byte all-reduce, timed against the segments alone and the all-reduces alone; the excess per
collective, the ranks' mean. A step's collective pays it at the compute before it since the last one,
interpolated between the two lengths (none below the shorter, the longer's beyond). No Lightning import.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from lmledger.ledger.count.ops import COMMUNICATION, OPTIMIZER, OpSummary
from lmledger.ledger.hardware.interconnect import collective_kind
from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.probes import in_own_process, on_gloo_ranks

__all__ = ["price", "rank_wait", "wait_seconds"]

_MATMULS = (20, 240)  # 128 x 128 matmuls per segment: about 1 and 11 ms at one thread on the VM


def rank_wait(world_size: int, cache: StepTimeCache, measure: bool = True) -> tuple[dict, str] | None:
    """({"points": [[segment_s, wait_s], [segment_s, wait_s]]}, how) on `world_size` gloo ranks here, cached; None
    where not cached and `measure` is off (inside a multi-rank fit), or the ranks would not start."""
    name = f"rank_wait_w{world_size}"
    found = cache.calibration(name)
    if found is not None and isinstance(found["value"], dict):
        return found["value"], f"measured {found['measured_at'][:10]} (cache)"
    if not measure:
        return None
    threads = max(1, (os.cpu_count() or 1) // world_size)
    value = in_own_process(__name__, f"_main({world_size}, {threads})", threads)
    if value is None:
        return None
    how = (f"segments of matmuls, each then a 4-byte all-reduce, on {world_size} gloo ranks here, against the "
           "segments and the all-reduces alone, per collective")  # fmt: skip
    cache.set_calibration(name, value, how)
    cache.save()
    return value, "measured now"


def wait_seconds(segment_s: float, value: dict) -> float:
    """The wait a collective adds after `segment_s` of compute since the last one (module doc)."""
    (short, short_wait), (long, long_wait) = value["points"]
    if segment_s <= short:
        return 0.0 if segment_s < short else short_wait
    if segment_s >= long:
        return long_wait
    return short_wait + (long_wait - short_wait) * (segment_s - short) / (long - short)


def price(
    ops: OpSummary, op_seconds: dict[int, float], per_op: float, world_size: int, cache: StepTimeCache, measure: bool
) -> tuple[float, str]:
    """(seconds to add, how): each collective's wait for the other ranks, by the compute (replayed ops, `op_seconds`
    by position, and `per_op` each) run since the last collective. FSDP2's too: its own probe (fsdp2.py) runs a chain
    with next to no compute between the collectives, so the wait after a layer's compute is not in its figure; with it
    tiny.yaml's FSDP2 step on two ranks went from 17.7% short to 3.7% long (2026-12-05, three fits each)."""
    found = rank_wait(world_size, cache, measure)
    if found is None:
        return 0.0, ""
    value, measured = found
    waits, segment, count = 0.0, 0.0, 0
    for i, op in enumerate(ops.ops):
        if op.category == COMMUNICATION:
            if collective_kind(op.name) is not None:
                waits += wait_seconds(segment, value)
                segment, count = 0.0, count + 1
        elif op.category != OPTIMIZER:
            segment += op_seconds.get(i, 0.0) + per_op
    (short, _), (long, long_wait) = value["points"]
    return waits, (
        f"; {count} collectives' wait for the other ranks, by the compute before each ({long_wait * 1e3:.2g} ms after "
        f"{long * 1e3:.2g} ms of it, none under {short * 1e3:.2g} ms; {measured})"
    )


def _main(world_size: int, threads: int) -> dict:
    return on_gloo_ranks(_rank, world_size, threads)


def _rank(rank: int, world_size: int, init_method: str, threads: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        a, tiny = torch.randn(128, 128), torch.ones(1)

        def per_call(fn, calls: int) -> float:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - started) / calls

        points = []
        for matmuls in _MATMULS:
            compute = lambda n=matmuls: [a @ a for _ in range(n)]  # noqa: E731
            calls = torch.tensor(max(10, int(0.15 / max(per_call(compute, 3), 1e-4))))  # about 0.15 s a measurement
            dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # every rank runs as many collectives
            calls = int(calls)
            rounds = [
                (per_call(compute, calls), per_call(lambda: dist.all_reduce(tiny), calls),
                 per_call(lambda c=compute: (c(), dist.all_reduce(tiny)), calls))
                for _ in range(3)
            ]  # fmt: skip
            segment = statistics.median(alone for alone, _, _ in rounds)
            wait = statistics.median(both - alone - bare for alone, bare, both in rounds)
            points.append([segment, max(0.0, wait)])
        mean = torch.tensor(points, dtype=torch.float64)
        dist.all_reduce(mean)
        if rank == 0:
            queue.put({"points": (mean / world_size).tolist()})
        dist.barrier()
    finally:
        dist.destroy_process_group()
