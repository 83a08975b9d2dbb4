"""What an op on DTensors costs beyond its local op, measured once per machine and thread count.

A replay times each op at its local shard (count/ops.py records DTensor ops so). The rank runs it through
DTensor first: sharding propagation, the Python of DTensor's dispatch, and under tensor parallelism the plan's
hooks (from_local, to_local, redistribute) around the module. On this machine's 2-core VM (2026-12-04) that is
about 60 us per forward or backward op and 13 us per optimizer op, against a few us for the local op itself:
20 ms of a TP 2 step of the toy LM, and 5 ms of its optimizer, that the replay did not see (issue 50).

The probe: four feed-forward blocks under torch's own TP plan (ColwiseParallel, RowwiseParallel) on a 2-rank
fake process group, in a process of its own, forward and backward and then AdamW, timed beside the same blocks at
the local shard's width on plain tensors; the difference over the DTensor ops its dry run records. The fake
group's collectives cost nothing: the real ones are priced by the collective model. No Lightning import.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from lmledger.ledger.count.ops import COMMUNICATION, OPTIMIZER, OpSummary
from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.probes import in_own_process

__all__ = ["CALIBRATION", "dtensor_overhead", "price"]

CALIBRATION = "dtensor_dispatch"
_WIDTH, _HIDDEN, _ROWS, _BLOCKS = 64, 128, 8, 4


def dtensor_overhead(cache: StepTimeCache) -> tuple[dict[str, float], str] | None:
    """({"step_s": per forward/backward DTensor op, "optimizer_s": per optimizer DTensor op}, how), measured in a
    process of its own at this process's thread count and cached; None where the probe cannot run."""
    found = cache.calibration(CALIBRATION)
    if found is not None and isinstance(found["value"], dict):
        return found["value"], f"measured {found['measured_at'][:10]} (cache)"
    value = in_own_process(__name__, "_probe()", torch.get_num_threads())
    if value is None:
        return None
    how = (f"torch's TP plan on {_BLOCKS} feed-forward blocks, 2 fake ranks, in a process of its own, beside the "
           "same blocks on plain tensors, per DTensor op")  # fmt: skip
    cache.set_calibration(CALIBRATION, value, how)
    cache.save()
    return value, "measured now"


def price(ops: OpSummary, cache: StepTimeCache) -> tuple[float, float, dict[str, str], list[str]]:
    """(host seconds, optimizer seconds, {category: what to add to its how}, notes): DTensor's own cost for each op
    the rank runs on DTensors, the forward's and backward's on the host, the optimizer's on its step."""
    step_ops = sum(1 for op in ops.ops if op.dtensor and op.category not in (OPTIMIZER, COMMUNICATION))
    optimizer_ops = sum(1 for op in ops.ops if op.dtensor and op.category == OPTIMIZER)
    if not step_ops and not optimizer_ops:
        return 0.0, 0.0, {}, []
    found = dtensor_overhead(cache)
    if found is None:
        return (
            0.0,
            0.0,
            {},
            [f"DTensor's dispatch for {step_ops + optimizer_ops} ops not counted: its probe would not run"],
        )
    value, measured = found
    said = f" + {{}} ops on DTensors x {{:.3g}} us of DTensor's dispatch ({measured})"
    how = {"host": said.format(step_ops, value["step_s"] * 1e6)} if step_ops else {}
    if optimizer_ops:
        how[OPTIMIZER] = said.format(optimizer_ops, value["optimizer_s"] * 1e6)
    return step_ops * value["step_s"], optimizer_ops * value["optimizer_s"], how, []


def _median_s(fn, repeats: int = 31) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _probe() -> dict[str, float]:
    """The probe of the module doc, in this (fresh) process: seconds per DTensor op beyond the plain run."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lmledger.ledger.count.ops import OpRecorder

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,))

    class Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.w1 = nn.Linear(_WIDTH, hidden, bias=False)
            self.w2 = nn.Linear(hidden, _WIDTH, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(torch.relu(self.w1(x)))

    torch.manual_seed(0)
    sharded = nn.Sequential(*[Block(_HIDDEN) for _ in range(_BLOCKS)])
    for block in sharded:
        parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    local = nn.Sequential(*[Block(_HIDDEN // 2) for _ in range(_BLOCKS)])
    x = torch.randn(_ROWS, _WIDTH)
    out = {}
    passes = [lambda m=m: m(x).sum().backward() for m in (sharded, local)]
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (sharded, local)]
    for name, runs in (("step_s", passes), ("optimizer_s", [opt.step for opt in optimizers])):
        recorder = OpRecorder({})
        with recorder:
            runs[0]()
        on_dtensors = sum(1 for r in recorder.records if r.dtensor)
        out[name] = max(0.0, _median_s(runs[0]) - _median_s(runs[1])) / max(1, on_dtensors)
    dist.destroy_process_group()
    return out
