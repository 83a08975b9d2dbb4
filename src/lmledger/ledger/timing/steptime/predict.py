"""The predicted seconds of one training (optimizer) step, per category, before step 1.

    matmul, attention, other   each op of the dry run (ledger/count/ops.py) replayed on this device (replay.py):
                               the micro-batches' forward and backward, recompute and autocast casts included
    optimizer                  the run's optimizer stepping real tensors of its parameters (calibrate.py),
                               gradient clipping before it; else its recorded ops replayed
    communication              DDP's buckets and FSDP2's collectives at their sizes, by an alpha-beta model
                               measured on gloo ranks here, or a labelled interconnect table; on gloo each FSDP2
                               collective at its measured cost with FSDP2's hooks around it (fsdp2.py)
    data_wait                  the user's loader's batch time, less what worker prefetch overlaps
    host                       per-op overhead (autograd, dispatcher) x ops + checkpointing's overhead x recomputed
                               ops + the model's own Python (its dry run's time outside dispatch, less a
                               Python-light model's per op) + Lightning's loop per batch + DTensor's dispatch x
                               ops on DTensors (TP; the optimizer's under FSDP2 go to the optimizer: dtensor.py)

Ops that cannot be replayed are priced at their roofline bound divided by the efficiency (bound / replayed
time) the replayed ops of their category reached; they are counted, with their share. The categories sum
to `total_s` by construction. A step of k micro-batches is k forward/backward passes, k loop iterations
and data waits, and one optimizer step. No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmledger.ledger.count.ops import (
    ATTENTION,
    COMMUNICATION,
    MATMUL,
    OPTIMIZER,
    OTHER,
    OpRecord,
    OpSummary,
    Outside,
)
from lmledger.ledger.hardware.cpu import OthersBusy
from lmledger.ledger.hardware.interconnect import Links, collective_seconds
from lmledger.ledger.hardware.memory import free_memory
from lmledger.ledger.timing.steptime import calibrate, dtensor, fsdp2, rankwait
from lmledger.ledger.timing.steptime.cache import StepTimeCache, age_s
from lmledger.ledger.timing.steptime.replay import (
    Replayer,
    cold_inputs,
    live_bytes,
    settle_allocator,
    stays_cached,
    storage_sizes,
    usable_cache_bytes,
    why_not_replayed,
)

__all__ = ["CATEGORIES", "NoStepTime", "StepTime", "predict_step_time", "touched_between_steps"]

DATA_WAIT, HOST = "data_wait", "host"
CATEGORIES = (MATMUL, ATTENTION, OTHER, OPTIMIZER, COMMUNICATION, DATA_WAIT, HOST)
# Other processes' share of the CPUs while ops were timed, above which the times are said to be a busy
# machine's: on 2 cores, another process on one of them slows a 2-thread op many-fold (docs/time.md).
BUSY_SHARE = 0.15
BUSY_CALIBRATION = "others busy while timing"  # the cache's record of it
# Cached op times are checked against a short replay once they are an hour old, and dropped when it runs more
# than 10% off them: this VM's tiny.yaml step went from 75 ms to 95-106 ms in under three hours (2026-12-03),
# while the check of a fresh cache read 0.95-1.06 in twenty-four tries that morning (of 2, 3 or 4 rounds).
CHECKED = "op times checked"  # the cache's record of the last check: now over then, and when
CHECK_AFTER_S = 3600.0
DRIFT = 0.10


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's predicted seconds per category (CATEGORIES), and how each was found."""

    seconds: dict[str, float]
    ops: int  # op records of the step
    replayed: int  # of those, priced by their own replay
    fallback: int  # priced at roofline bound / category efficiency
    fallback_s: float
    optimizer_ops: int = 0  # ops of the optimizer step, priced whole by timing the real optimizer (0: replayed)
    collectives: int = 0  # priced by the communication model
    fallback_ops: dict[str, int] = field(default_factory=dict)  # name -> count, with why_not below
    why_not: dict[str, str] = field(default_factory=dict)  # op name -> why it was not replayed
    benchmarked: int = 0  # op signatures timed by this prediction (0: all from the cache)
    busy: float | None = None  # other processes' share of the CPUs while this prediction timed ops (None: none timed)
    distinct: int = 0  # distinct op signatures of the step
    accumulate: int = 1
    tokens: int | None = None  # per optimizer step (all micro-batches), None when the batch has no token ids
    samples: int = 0
    how: dict[str, str] = field(default_factory=dict)  # category -> what it rests on
    notes: tuple[str, ...] = ()
    # Priced on a GPU by the op-time model (ledger/timing/gpu) rather than replayed here: its table key, what the
    # step's overlap hides (category -> seconds of communication or host work under the kernels), and the MFU.
    priced_on: str = ""
    hidden: dict[str, float] = field(default_factory=dict)
    mfu: float | None = None

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def fallback_share(self) -> float:
        return self.fallback_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.total_s if self.tokens and self.total_s > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.total_s if self.samples and self.total_s > 0 else None

    def line(self) -> str:
        """One line: the step, its rate, and what was not replayed (on a GPU: its MFU and what overlap hides)."""
        rate = (
            f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else
            (f", {self.samples_per_s:,.1f} samples/s" if self.samples_per_s else "")
        )  # fmt: skip
        if self.priced_on:
            mfu = f", MFU {self.mfu:.2g}" if self.mfu is not None else ""
            hidden = "; ".join(f"{v * 1e3:.3g} ms of {k} hidden under the kernels" for k, v in self.hidden.items() if v)
            return (f"step time predicted {self.total_s * 1e3:.1f} ms on {self.priced_on}{rate}{mfu} (GPU op model: "
                    f"{self.ops} ops priced{'; ' + hidden if hidden else ''})")  # fmt: skip
        text = f"step time predicted {self.total_s * 1e3:.1f} ms{rate} ({self.replayed} of {self.ops} ops replayed"
        if self.fallback:
            text += f"; {self.fallback} priced at roofline/efficiency, {self.fallback_share:.1%} of the step"
        return text + (")" if not self.benchmarked else f"; {self.benchmarked} op signatures benchmarked now)")

    def to_json(self) -> dict:
        return {
            "total_s": self.total_s, "seconds": dict(self.seconds), "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "ops": self.ops, "replayed": self.replayed,
            "fallback": self.fallback, "fallback_share": self.fallback_share, "optimizer_ops": self.optimizer_ops,
            "collectives": self.collectives, "fallback_ops": dict(self.fallback_ops), "busy": self.busy,
            "benchmarked": self.benchmarked, "distinct": self.distinct, "accumulate": self.accumulate,
            "how": dict(self.how), "notes": list(self.notes), "priced_on": self.priced_on or None,
            "hidden": dict(self.hidden), "mfu": self.mfu,
        }  # fmt: skip


@dataclass(frozen=True)
class NoStepTime:
    """No time prediction, and one line saying why."""

    reason: str


def _links_line(links: Links) -> str:
    """The link(s) collectives were priced on, for the `how` line."""
    said = [f"{link.name}: {link.alpha_s * 1e6:.3g} us + bytes at {link.bytes_per_s / 1e9:.3g} GB/s"
            for link in dict.fromkeys((links.intra, links.inter))]  # fmt: skip
    return "; ".join(said)


def predict_step_time(
    ops: OpSummary,
    device: torch.device | str = "cpu",
    *,
    compute_dtype: str = "fp32",
    optimizer: torch.optim.Optimizer | None = None,
    clip: tuple[str, float] | None = None,
    loop_s: float | None = None,
    loop_how: str = "",
    data: calibrate.DataWait | None = None,
    world_size: int = 1,
    backend: str = "gloo",
    tokens: int | None = None,
    samples: int = 0,
    accumulate: int = 1,
    cache_path: Path | None = None,
    calibrate_collectives: bool = True,
    links: Links | None = None,
    ranks_here: int = 1,
) -> StepTime | NoStepTime:
    """The predicted step (module doc) of a dry run's `ops` on `device`.

    optimizer   the run's optimizer (its class, groups and hyperparameters; tensors are never touched)
    clip        ("norm" | "value", threshold): Lightning's gradient clipping, or None
    loop_s      Lightning's loop per batch, measured (callbacks/steptime.py); None: not counted, and said
    data        the loader's batch time (calibrate.data_wait); None: no wait
    tokens, samples   per micro-batch; the step's are `accumulate` times as many
    links       what a backend that cannot be timed here (nccl) crosses (ledger.hardware.interconnect); default an H100
    node's
    ranks_here  the fit's ranks on this machine, replaying at once as their steps will run: the cache keys its times
                by it (cache.machine_key)
    """
    device = torch.device(device)
    settle_allocator(device)  # before anything is timed, and for the real steps this process runs next
    cache = StepTimeCache(device, cache_path, ranks=ranks_here)
    notes = [cache.note] if cache.note else []
    how: dict[str, str] = {}
    free = free_memory(device)
    others = OthersBusy().start()
    replayer = Replayer(device, cache.ops, max_bytes=free // 2)
    # In the step's order, data flowing op to op, where its live tensors fit in half the free memory;
    # else each op alone, its cold inputs (read from memory in the step) from fresh copies.
    in_sequence = live_bytes(list(ops.ops)) <= free // 2
    if in_sequence:  # first: a cache found stale is forgotten before any of its calibrations is read
        notes += _fill_checked(replayer, list(ops.ops), cache)
        how["replay"] = "each op in the step's order, data flowing op to op; median of rounds after a warm-up"
    else:
        how["replay"] = "each op alone (the step's tensors exceed half the free memory), cold inputs from copies"
    overhead, overhead_how = calibrate.per_op_overhead(device, cache, Replayer(device, cache.ops))
    flushed = not stays_cached(device, touched_between_steps(ops))
    timed_optimizer = calibrate.optimizer_seconds(optimizer, device, clip, cache, flushed=flushed)
    priced = _price_ops(ops, replayer, in_sequence, timed_optimizer is not None, compute_dtype, device)
    if isinstance(priced, str):
        cache.save()
        return NoStepTime(priced)
    seconds, comm_ops = priced.seconds, priced.collectives
    if timed_optimizer is not None:
        seconds[OPTIMIZER] = timed_optimizer[0]
        how[OPTIMIZER] = timed_optimizer[1]
    else:
        seconds[OPTIMIZER] += overhead * sum(1 for op in ops.ops if op.category == OPTIMIZER)
        how[OPTIMIZER] = "its recorded ops replayed, with the per-op overhead"
    if comm_ops:
        crossed, source = calibrate.collective_model(world_size, cache, backend, calibrate_collectives, links)
        along = [calibrate.gloo_seconds(op, world_size, cache) for op in comm_ops] if backend == "gloo" else [None]
        if None not in along:  # gloo's measured points
            seconds[COMMUNICATION] = sum(along)
            how[COMMUNICATION] = (f"{len(comm_ops)} collectives along gloo's all-reduce measured here at 4 KiB..16 "
                                  f"MiB ({source}); none overlapped with compute")  # fmt: skip
            for extra, said in (
                fsdp2.price(comm_ops, world_size, cache, calibrate_collectives),
                rankwait.price(ops, priced.op_seconds, overhead, world_size, cache, calibrate_collectives),
            ):
                seconds[COMMUNICATION] += extra
                how[COMMUNICATION] += said
        else:
            seconds[COMMUNICATION] = sum(collective_seconds(op, crossed, world_size)[0] for op in comm_ops)
            how[COMMUNICATION] = (
                f"{len(comm_ops)} collectives, {_links_line(crossed)} ({source}); none overlapped with compute"
            )
        notes += list(dict.fromkeys(link.note for link in (crossed.intra, crossed.inter) if link.note))

    compute = sum(seconds[c] for c in (MATMUL, ATTENTION, OTHER))
    seconds[HOST], how[HOST] = _host(
        ops, priced.per_op_ops, (overhead, overhead_how), (loop_s, loop_how), accumulate, cache, device
    )
    host_s, optimizer_s, said, dtensor_notes = dtensor.price(ops, cache)
    seconds[HOST] += host_s
    seconds[OPTIMIZER] += optimizer_s
    for category, text in said.items():
        how[category] += text
    notes += dtensor_notes
    if device.type == "cuda":  # the host queues kernels ahead of the GPU: only its excess over their time shows
        host_all, kernels = seconds[HOST], compute + seconds[OPTIMIZER]
        seconds[HOST] = max(0.0, host_all - kernels)
        how[HOST] += (
            f"; on CUDA the host runs ahead of the kernels, so of its {host_all * 1e3:.3g} ms only the excess over "
            f"the kernels' {kernels * 1e3:.3g} ms adds to the step"
        )
    if loop_s is None:
        notes.append(
            "Lightning's loop not counted: not calibrated on this machine yet (a one-device fit or "
            "`lmledger account` calibrates it)"
        )
    if data is not None:
        per_batch_step = (compute + seconds[HOST] + seconds[OPTIMIZER] / accumulate) / accumulate
        seconds[DATA_WAIT] = data.wait(per_batch_step) * accumulate
        how[DATA_WAIT] = data.how
    distinct = len({_key(op) for op in ops.ops})
    busy = others.share() if replayer.benchmarked else None
    if replayer.benchmarked:
        cache.mark()
    notes += _busy_notes(cache, busy)
    cache.save()
    if cache.note and cache.note not in notes:
        notes.append(cache.note)
    return StepTime(
        seconds=seconds, ops=len(ops.ops), replayed=priced.replayed, fallback=priced.fallback,
        fallback_s=priced.fallback_s,
        optimizer_ops=sum(1 for op in ops.ops if op.category == OPTIMIZER) if timed_optimizer is not None else 0,
        collectives=len(comm_ops), fallback_ops=priced.fallback_ops, why_not=priced.why_not,
        benchmarked=replayer.benchmarked, busy=busy, distinct=distinct,
        accumulate=accumulate, tokens=tokens * accumulate if tokens else None, samples=samples * accumulate, how=how,
        notes=tuple(notes),
    )  # fmt: skip


@dataclass
class _Priced:
    """The step's ops priced one by one: replayed, else at a roofline fallback; collectives set aside."""

    seconds: dict[str, float]  # per category (CATEGORIES)
    collectives: list[OpRecord]
    replayed: int = 0
    per_op_ops: int = 0  # ops that pay the per-op overhead: all but the collectives and a timed optimizer's
    fallback: int = 0
    fallback_s: float = 0.0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    why_not: dict[str, str] = field(default_factory=dict)
    op_seconds: dict[int, float] = field(default_factory=dict)  # position in the step -> its compute's seconds


def _price_ops(
    ops: OpSummary,
    replayer: Replayer,
    in_sequence: bool,
    optimizer_timed: bool,
    compute_dtype: str,
    device: torch.device,
) -> _Priced | str:
    """Each op at its replayed time (in the step's order, or alone with its cold inputs), the rest at
    `_fallbacks`; a str says why the step cannot be priced."""
    priced = _Priced(seconds=dict.fromkeys(CATEGORIES, 0.0), collectives=[])
    replayed, unreplayed = [], []
    llc = usable_cache_bytes(device) if not in_sequence else 0  # measured where cold inputs are replayed
    colds = cold_inputs(list(ops.ops), llc) if not in_sequence else [()] * len(ops.ops)
    for i, (op, cold) in enumerate(zip(ops.ops, colds, strict=True)):
        if op.category == OPTIMIZER and optimizer_timed:
            continue
        if op.category == COMMUNICATION:
            priced.collectives.append(op)
            continue
        t = replayer.in_sequence(op) if in_sequence else replayer.seconds(op, cold, llc)
        priced.per_op_ops += 1
        if t is None:
            unreplayed.append(op)
        else:
            replayed.append((op, t))
            priced.seconds[op.category] += t
            priced.op_seconds[i] = t
    if not replayed and unreplayed:
        first = unreplayed[0]
        why = why_not_replayed(first) or replayer.failed.get(_key(first), "its replay failed")
        return f"no op of the step could be replayed on {device.type} (e.g. {first.name}: {why})"
    priced.replayed, priced.fallback = len(replayed), len(unreplayed)
    if unreplayed:
        fallbacks = _fallbacks(replayed, unreplayed, compute_dtype, device)
        if isinstance(fallbacks, str):
            return fallbacks
        for op, t in zip(unreplayed, fallbacks, strict=True):
            priced.seconds[op.category] += t
            priced.fallback_s += t
            priced.fallback_ops[op.name] = priced.fallback_ops.get(op.name, 0) + 1
            priced.why_not[op.name] = why_not_replayed(op) or replayer.failed.get(_key(op), "its replay raised")
    return priced


def _fallbacks(
    replayed: list[tuple[OpRecord, float]], unreplayed: list[OpRecord], compute_dtype: str, device: torch.device
) -> list[float] | str:
    """Each op not replayed at its roofline bound over the efficiency (bound / replayed time) the replayed ops
    of its category reached (all replayed ops' where none of its category was); a str says why not."""
    from lmledger.ledger.timing.roofline import op_bounds

    try:
        bounds = op_bounds([op for op, _ in replayed] + unreplayed, compute_dtype, device)
    except ValueError as err:
        return f"{len(unreplayed)} ops cannot be replayed and have no roofline bound ({err})"
    spent: dict[str, list[float]] = {}
    for (op, t), bound in zip(replayed, bounds, strict=False):
        row = spent.setdefault(op.category, [0.0, 0.0])
        row[0] += bound
        row[1] += t
    everything = [sum(r[0] for r in spent.values()), sum(r[1] for r in spent.values())]
    out = []
    for op, bound in zip(unreplayed, bounds[len(replayed) :], strict=True):
        row = spent.get(op.category) or everything
        out.append(bound / (row[0] / row[1] if row[1] > 0 and row[0] > 0 else 1.0))
    return out


def _host(
    ops: OpSummary,
    per_op_ops: int,
    overhead: tuple[float, str],
    loop: tuple[float | None, str],
    accumulate: int,
    cache: StepTimeCache,
    device: torch.device,
) -> tuple[float, str]:
    """(seconds, how) of the step's host time: the per-op overhead, checkpointing's per recomputed op, the
    model's own Python and Lightning's loop per micro-batch."""
    (per_op, per_op_how), (loop_s, loop_how) = overhead, loop
    seconds = per_op * per_op_ops + (loop_s or 0.0) * accumulate
    how = f"{per_op_ops} ops x {per_op * 1e6:.3g} us per op ({per_op_how})"
    recomputed = sum(1 for op in ops.ops if op.recompute)
    if recomputed:
        extra, extra_how = calibrate.recompute_overhead(device, cache, Replayer(device, cache.ops))
        seconds += extra * recomputed
        how += f" + {recomputed} recomputed ops x {extra * 1e6:.3g} us of checkpointing ({extra_how})"
    if ops.outside is not None:
        python_s, python_how = _model_python(ops.outside, cache)
        seconds += python_s
        how += python_how
    how += f" + Lightning's loop {loop_s * 1e3:.3g} ms x {accumulate} batches ({loop_how})" if loop_s else ""
    return seconds, how


def touched_between_steps(ops: OpSummary) -> int:
    """Bytes of the distinct storages the step's forward and backward read or write: what passes through the caches
    between two optimizer steps (an upper bound: a storage freed and its memory handed to the next counts twice)."""
    return sum(storage_sizes([op for op in ops.ops if op.category != OPTIMIZER]).values())


def _model_python(outside: Outside, cache: StepTimeCache) -> tuple[float, str]:
    """(seconds, how): the model's own Python per step, which replayed ops never run (module calls, HF's
    per-layer bookkeeping): its dry run's time outside dispatch, less what a Python-light model spends there
    per op (the instruments', autograd's and the dispatcher's share, priced per op already)."""
    base, base_how = calibrate.outside_per_dispatch(cache)
    python_s = max(0.0, outside.seconds - base * outside.dispatches)
    how = (
        f" + the model's own Python {python_s * 1e3:.3g} ms (its dry run's forward and backward spent "
        f"{outside.seconds * 1e3:.3g} ms outside dispatch over {outside.dispatches} ops, less "
        f"{base * 1e6:.3g} us per op as a Python-light chain does, {base_how})"
    )
    return python_s, how


def _fill_checked(replayer: Replayer, ops: list[OpRecord], cache: StepTimeCache) -> list[str]:
    """The step's ops timed in sequence (Replayer.fill_sequence), cached times checked against now: a step
    partly cached is replayed whole, which checks its cached part for free; one all cached, by replaying its
    opening ops (Replayer.drift) once the last check is CHECK_AFTER_S old. More than DRIFT off, or taken on a busy
    machine (the busy record) while this one is quiet now, every op time and calibration is forgotten (the machine
    moved, not one model), the step timed again, the calibrations measured again as the prediction reads them, and
    a line says so."""
    found, busy = cache.calibration(CHECKED), cache.calibration(BUSY_CALIBRATION)
    since = (found or cache.entry)["measured_at"][:16]
    was_empty = not cache.ops
    others = OthersBusy().start()
    if not replayer.all_cached(ops):
        ratio = replayer.fill_sequence(ops)
    elif found is None or age_s(found["measured_at"]) >= CHECK_AFTER_S:
        ratio = replayer.drift(ops)
    else:
        return []
    quiet = others.share()
    healed = busy is not None and ratio is not None and quiet is not None and quiet < BUSY_SHARE
    if not healed and (ratio is None or abs(ratio - 1) <= DRIFT):
        if ratio is not None or was_empty:  # compared, or taken now with no other op's there to go stale
            cache.set_calibration(CHECKED, ratio or 1.0, "replayed now over cached, for the step's cached ops")
        return []
    cache.forget()  # calibrations too: the busy record, the optimizer's and the per-op costs were taken as the ops were
    replayer.fill_sequence(ops)  # the step again, on an empty cache (a second replay where it was just replayed: rare)
    cache.set_calibration(CHECKED, 1.0, "every op time of this step taken now, in sequence, the rest forgotten")
    if healed:
        return [
            f"the cache's times were taken while other processes kept {busy['value']:.0%} of the CPUs busy "
            f"({busy['measured_at'][:16]}); the step's ops took {ratio:.2f}x them now, on a quiet machine, so the "
            "cache was dropped and this step timed again"
        ]
    return [
        f"the step's ops took {ratio:.2f}x the times cached for them (held since {since}): this machine no longer "
        "runs as it did, so the cache was dropped and this step timed again"
    ]


def _busy_notes(cache: StepTimeCache, busy: float | None) -> list[str]:
    """One line when the op times this prediction rests on were taken on a busy machine (now, or cached so)."""
    if busy is not None and busy >= BUSY_SHARE:
        found = cache.calibration(BUSY_CALIBRATION)
        if found is None or found["value"] < busy:
            what = "other processes' share of the CPUs while ops were timed (/proc/stat)"
            cache.set_calibration(BUSY_CALIBRATION, busy, what)
    found = cache.calibration(BUSY_CALIBRATION)
    if found is None:
        return []
    return [
        f"other processes kept {found['value']:.0%} of the CPUs busy while op times in the cache were taken "
        f"({found['measured_at'][:16]}): the prediction is of a busy machine; delete {cache.path} to time them again"
    ]


def _key(op: OpRecord) -> str:
    from lmledger.ledger.timing.steptime.replay import op_key

    return op_key(op) if op.signature is not None else op.name
