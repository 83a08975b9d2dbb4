"""The measured twin of the roofline: a profiled step's time per category (seconds).

`breakdown(events, ...)` groups the op events `torch.profiler` recorded in one training step. The
groups are the roofline's categories (ledger/count/ops.py), plus what no op accounts for:

    matmul, attention, other   op time outside the optimizer step, by the outermost categorised op
                               around it (aten::linear and the aten::addmm it calls are one matmul; the
                               empty tensors SDPA allocates are attention)
    optimizer                  op time from the step's optimizer marker (set when the forward and
                               backward closure has returned, so clipping is in it) to the end of
                               torch's Optimizer.step record
    communication              collectives (c10d, nccl, gloo records)
    data_wait                  the time in the dataloader's next, measured by the caller's clock
    host                       overhead and idle: the step's wall time minus all of the above
                               (Python, Lightning's loop, autograd's bookkeeping, launch gaps)

On a CPU an op's time is its self CPU time. Children count under their own name, in their parent's
category. On a GPU it is the duration of the kernels it launched. The categories sum to `wall_s` by
construction. `ops_overlap` says how much the ops alone exceed the step, where threads or streams
overlap. Host would be negative there. `events` are `torch.profiler.profile().events()`
(FunctionEvent: name, time_range, cpu_parent, self_cpu_time_total, kernels), or anything shaped alike.
`profile_step(step, device)` profiles one call of a plain training step (`lmledger account --measure`).
Inside a fit, callbacks/timing.py does the same. No Lightning import.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lmledger.ledger.count.ops import CATEGORIES, OPTIMIZER, OTHER, category_of

__all__ = [
    "DATA_WAIT",
    "HOST",
    "MEASURED",
    "OPTIMIZER_MARK",
    "OpEvent",
    "STEP_MARK",
    "Breakdown",
    "breakdown",
    "mean_breakdown",
    "op_events",
    "profile_step",
    "profiler",
    "quiet_native_stderr",
    "start",
    "stop",
]

STEP_MARK = "lmledger#step"  # the record_function around the whole step (callbacks/timing.py)
OPTIMIZER_MARK = "lmledger#optimizer"  # a zero-length record at on_before_optimizer_step
_OPTIMIZER_RECORD = "Optimizer.step#"  # torch.optim's own record_function around step()
DATA_WAIT, HOST = "data_wait", "host"
MEASURED = (*CATEGORIES, DATA_WAIT, HOST)


@dataclass(frozen=True)
class Breakdown:
    """Seconds of one profiled step per category (MEASURED), and the step's wall time."""

    seconds: dict[str, float]
    wall_s: float
    ops_overlap: float = 0.0  # seconds the ops exceed the wall by (0 on a single-threaded CPU step)
    events: int = 0
    top_ops: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # per category, slowest names

    def share(self, category: str) -> float:
        return self.seconds.get(category, 0.0) / self.wall_s if self.wall_s > 0 else 0.0


def _category_chain(event, optimizer_window: tuple[float, float] | None) -> str | None:
    """The category an event's time goes to; None for a record that is not an op (host)."""
    if event.name in (STEP_MARK, OPTIMIZER_MARK):
        return None  # our own markers: their cost is overhead
    start = event.time_range.start
    if optimizer_window is not None and optimizer_window[0] <= start <= optimizer_window[1]:
        return OPTIMIZER
    found, is_op = None, False
    node = event
    while node is not None:  # up to the step: the outermost matmul / attention / collective wins
        name = node.name
        if name.startswith((STEP_MARK, _OPTIMIZER_RECORD)):
            break
        if name.startswith(_OP_PREFIXES):
            is_op = True
            category = category_of(name)
            if category != OTHER:
                found = category
        node = node.cpu_parent
    return found or (OTHER if is_op else None)


_OP_PREFIXES = ("aten::", "c10d::", "_c10d_functional::", "nccl:", "gloo:", "record_param_comms")


def breakdown(events: Iterable, wall_s: float, data_wait_s: float = 0.0, *, device: str = "cpu") -> Breakdown:
    """The step's time per category from its profiler events (module doc).

    `wall_s` includes `data_wait_s`. device "cpu": self CPU time per op; "cuda": kernel time per
    launching op.
    """
    events = list(events)
    marks = [e for e in events if e.name == STEP_MARK]
    window = (marks[0].time_range.start, marks[0].time_range.end) if marks else None
    opt_marks = [e.time_range.start for e in events if e.name == OPTIMIZER_MARK]
    records = [e for e in events if e.name.startswith(_OPTIMIZER_RECORD)]
    optimizer_window = None
    if opt_marks:  # Lightning: optimizer.step(closure) runs forward and backward inside torch's record
        begin = opt_marks[-1]
        ends = [e.time_range.end for e in records if e.time_range.end >= begin]
        optimizer_window = (begin, max(ends) if ends else (window[1] if window else float("inf")))
    elif records:  # a plain loop: the record is the optimizer step alone
        optimizer_window = (records[-1].time_range.start, records[-1].time_range.end)
    totals = {c: 0.0 for c in MEASURED}
    per_name: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    counted = 0
    for event in events:
        if window is not None and not (window[0] <= event.time_range.start <= window[1]):
            continue
        category = _category_chain(event, optimizer_window)
        if category is None:
            continue
        if device == "cuda":
            seconds = sum(k.duration for k in getattr(event, "kernels", ())) / 1e6
        else:
            seconds = event.self_cpu_time_total / 1e6
        if seconds <= 0:
            continue
        counted += 1
        totals[category] += seconds
        per_name[category][event.name] = per_name[category].get(event.name, 0.0) + seconds
    ops = sum(totals[c] for c in CATEGORIES)
    totals[DATA_WAIT] = max(0.0, data_wait_s)
    rest = wall_s - totals[DATA_WAIT] - ops
    totals[HOST] = max(0.0, rest)
    top = {c: sorted(names.items(), key=lambda kv: -kv[1])[:5] for c, names in per_name.items() if names}
    return Breakdown(totals, wall_s, ops_overlap=max(0.0, -rest), events=counted, top_ops=top)


def mean_breakdown(samples: list[Breakdown]) -> Breakdown | None:
    """The per-category mean of several profiled steps (None for none)."""
    if not samples:
        return None
    n = len(samples)
    seconds = {c: sum(s.seconds.get(c, 0.0) for s in samples) / n for c in MEASURED}
    top: dict[str, dict[str, float]] = {}
    for s in samples:
        for c, rows in s.top_ops.items():
            for name, t in rows:
                top.setdefault(c, {})[name] = top.setdefault(c, {}).get(name, 0.0) + t / n
    return Breakdown(
        seconds,
        sum(s.wall_s for s in samples) / n,
        ops_overlap=sum(s.ops_overlap for s in samples) / n,
        events=sum(s.events for s in samples) // n,
        top_ops={c: sorted(v.items(), key=lambda kv: -kv[1])[:5] for c, v in top.items()},
    )


def profiler(device: torch.device):
    """An unstarted torch.profiler.profile for one step on `device` (CPU ops; on a GPU, kernels too)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for a moment: kineto prints two lines ("USDT: ... profiler_start",
    "... profiler_stop") per profiled step from C++, at any KINETO_LOG_LEVEL (canary in tests)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start(prof) -> None:
    """prof.start(), without kineto's stderr line."""
    with warnings.catch_warnings(), quiet_native_stderr():
        warnings.simplefilter("ignore")
        prof.start()


def stop(prof) -> None:
    """prof.stop(), without kineto's stderr line."""
    with warnings.catch_warnings(), quiet_native_stderr():
        warnings.simplefilter("ignore")
        prof.stop()


@dataclass(frozen=True)
class _Range:
    start: float  # microseconds, as FunctionEvent.time_range
    end: float


@dataclass
class OpEvent:
    """One CPU record of a profiled step, with the FunctionEvent fields `breakdown` reads."""

    name: str
    time_range: _Range
    self_cpu_time_total: float = 0.0  # microseconds
    cpu_parent: OpEvent | None = None
    kernels: tuple = ()


def op_events(prof, device: torch.device) -> list:
    """A stopped profiler's events for `breakdown`.

    On a CPU, read straight from kineto's records and nested per thread by time. That is what
    prof.events() builds, minus what breakdown never reads. For tiny.yaml's step (2,900 records) it
    took 12 ms where prof.events() took 58-170 ms (2026-12-01, 2-core CPU). A GPU's kernels need
    prof.events()'s linking, so it is used there.
    """
    if device.type != "cpu":
        return prof.events()
    records = [
        e for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CPU and not e.is_async() and not e.is_hidden_event()
    ]  # fmt: skip
    records.sort(key=lambda e: (e.start_thread_id(), e.start_ns(), -e.duration_ns()))
    out: list[OpEvent] = []
    self_ns: list[int] = []  # exact integers: a parent's self time is its duration minus its children's
    stack: list[tuple[int, int, int]] = []  # (index into out, end ns, thread)
    for record in records:
        begin, end, thread = record.start_ns(), record.end_ns(), record.start_thread_id()
        while stack and (stack[-1][2] != thread or stack[-1][1] <= begin):
            stack.pop()
        parent = stack[-1][0] if stack and end <= stack[-1][1] else None
        out.append(
            OpEvent(record.name(), _Range(begin / 1e3, end / 1e3), 0.0, out[parent] if parent is not None else None)
        )
        self_ns.append(end - begin)
        if parent is not None:
            self_ns[parent] -= end - begin
        stack.append((len(out) - 1, end, thread))
    for event, ns in zip(out, self_ns, strict=True):
        event.self_cpu_time_total = ns / 1e3
    return out


def profile_step(step: Callable[..., None], device: torch.device) -> Breakdown:
    """The breakdown of one call `step(phase)`; no data wait (the batch is already there).

    `step` calls `phase("optimizer step")` before its optimizer step, as ledger.predict.measure's does.
    """

    def phase(name: str) -> None:
        if name == "optimizer step":
            with torch.autograd.profiler.record_function(OPTIMIZER_MARK):
                pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profiler(device)
        start(prof)
    try:
        _synchronize(device)
        with torch.autograd.profiler.record_function(STEP_MARK):
            started = time.perf_counter()
            step(phase)
            _synchronize(device)
            wall = time.perf_counter() - started
    finally:
        stop(prof)
    return breakdown(op_events(prof, device), wall, 0.0, device=device.type)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
