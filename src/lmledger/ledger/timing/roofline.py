"""The roofline bound of a training step: the fastest each op could run on a device, summed per category.

For every op the dry run recorded (ledger/count/ops.py):

    bound = max(FLOPs / peak(op dtype), bytes read and written / memory bandwidth)

This is the Roofline model (Williams, Waterman & Patterson, CACM 2009). An op is limited by its
arithmetic or by the bytes it moves, whichever is slower. Peaks are dense figures
(ledger/hardware/peak_flops.py): the datasheet for a listed GPU, the CPU's spec peak. Bandwidth comes from
ledger/hardware/bandwidth.py. Collectives move their bytes over the interconnect when its bandwidth is given.
Otherwise they are priced at memory bandwidth (a lower bound). Summed per category, the bound is a
step time no implementation of the same ops can beat on that device. A measurement below it is a bug
in the bound (tests/ledger/test_time_ledger.py holds each category).

    ideal          model FLOPs / dense peak: the step if every FLOP ran at peak and nothing else cost time
    roofline MFU   model FLOPs / bound / peak: the highest MFU this model at this shape can reach there

Pure arithmetic over the op records: no torch, no Lightning import (`step_ops` builds a dry run lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lmledger.ledger.count.ops import CATEGORIES, COMMUNICATION, OpRecord, OpSummary
from lmledger.ledger.hardware.interconnect import Interconnect, Links, collective_seconds, default_links
from lmledger.ledger.units import tera

__all__ = [
    "LABELS",
    "CategoryBound",
    "Roofline",
    "TimeRow",
    "device_roofline",
    "diagnosis",
    "format_table",
    "gpu_roofline",
    "op_bounds",
    "peak_dtype",
    "roofline",
    "time_rows",
    "toy_step_ops",
    "with_ddp_allreduce",
    "with_step_collectives",
]

# torch dtype names (OpRecord.dtype) -> the dtype names peaks are keyed by (gpus.DTYPES)
_PEAK_DTYPE = {
    "float64": "fp64",
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2fnuz": "fp8",
}


def peak_dtype(dtype: str, default: str) -> str:
    """The peak's dtype name for an op's torch dtype name; `default` for integer-only ops ("")."""
    return _PEAK_DTYPE.get(dtype, default)


@dataclass(frozen=True)
class CategoryBound:
    seconds: float = 0.0  # sum of the per-op bounds
    compute_seconds: float = 0.0  # of those, what the FLOPs alone take at peak
    memory_seconds: float = 0.0  # what the bytes alone take at bandwidth
    flops: int = 0
    bytes: int = 0
    ops: int = 0
    memory_bound_ops: int = 0  # ops whose bytes, not FLOPs, set their bound


@dataclass(frozen=True)
class Roofline:
    """The step's bound per category (CATEGORIES) on one device."""

    by_category: dict[str, CategoryBound]
    peak_flops_per_s: float  # the dense peak of the run's compute dtype, for ideal and MFU
    peak_dtype: str
    bandwidth_bytes_per_s: float
    device: str  # what the figures are for ("cpu", "h100-sxm", ...)
    peak_source: str = ""
    bandwidth_source: str = ""

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.by_category.values())

    def ideal_seconds(self, model_flops: float) -> float:
        return model_flops / self.peak_flops_per_s

    def mfu(self, model_flops: float) -> float:
        """The roofline MFU: model FLOPs over the bound, against the dense peak."""
        return model_flops / self.seconds / self.peak_flops_per_s if self.seconds > 0 else 0.0


def _op_bound(
    op: OpRecord, peak_for: Callable[[str], float], bandwidth: float, links: Links, world_size: int
) -> tuple[float, float]:
    """(compute seconds, memory or link seconds) of one op; its bound is the larger."""
    if op.category == COMMUNICATION:
        return 0.0, collective_seconds(op, links, world_size)[0]
    compute = op.flops / peak_for(op.dtype) if op.flops else 0.0
    return compute, op.bytes / bandwidth


def roofline(
    ops: OpSummary,
    peaks: Mapping[str, float | None],
    compute_dtype: str,
    bandwidth_bytes_per_s: float,
    *,
    device: str = "",
    interconnect_bytes_per_s: float | None = None,
    links: Links | None = None,
    peak_source: str = "",
    bandwidth_source: str = "",
) -> Roofline:
    """The bound of the step's `ops` on a device with dense `peaks` {"fp32": FLOP/s, ...} and bandwidth.

    `compute_dtype` is the precision's matmul dtype. Its peak serves ideal and MFU. It also serves ops
    whose dtype has no peak: integer ops, or a dtype the device lacks. Collectives cross `links` (each on
    its group's, ledger.hardware.interconnect), or one link of `interconnect_bytes_per_s`, or, given neither, run
    as memory copies at the device's bandwidth (gloo's ranks on one CPU).
    """
    if not peaks.get(compute_dtype):
        raise ValueError(f"no {compute_dtype} peak given")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError("memory bandwidth must be positive")
    fallback = float(peaks[compute_dtype])

    def peak_for(dtype: str) -> float:
        return float(peaks.get(peak_dtype(dtype, compute_dtype)) or fallback)

    if links is None:
        rate = interconnect_bytes_per_s or bandwidth_bytes_per_s
        links = Links.one(Interconnect("one link", rate, "user", "given", latency_s=0.0))
    world = max((op.group_size for op in ops.ops), default=1) or 1
    rows: dict[str, list[float]] = {c: [0.0, 0.0, 0.0, 0, 0, 0, 0] for c in CATEGORIES}
    for op in ops.ops:
        compute, memory = _op_bound(op, peak_for, bandwidth_bytes_per_s, links, world)
        row = rows[op.category]
        row[0] += max(compute, memory)
        row[1] += compute
        row[2] += memory
        row[3] += op.flops
        row[4] += op.bytes
        row[5] += 1
        row[6] += memory > compute
    return Roofline(
        {c: CategoryBound(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6])) for c, r in rows.items()},
        fallback,
        compute_dtype,
        bandwidth_bytes_per_s,
        device,
        peak_source,
        bandwidth_source,
    )


def device_roofline(
    ops: OpSummary,
    compute_dtype: str,
    device: object,
    interconnect_bytes_per_s: float | None = None,
    links: Links | None = None,
) -> Roofline:
    """The bound on a live device (torch.device, "cpu", "cuda").

    Peaks come from peak_flops.peak_flops, bandwidth from bandwidth.memory_bandwidth. Collectives cross
    `links`, or one link of `interconnect_bytes_per_s`, where given (roofline()).
    """
    peaks, sources, bandwidth = _device_figures(compute_dtype, device)
    name = str(getattr(device, "type", device))
    return roofline(
        ops, peaks, compute_dtype, bandwidth.bytes_per_s, device=name, links=links,
        interconnect_bytes_per_s=interconnect_bytes_per_s, peak_source=sources.get(compute_dtype, ""),
        bandwidth_source=bandwidth.detail or bandwidth.source,
    )  # fmt: skip


def _device_figures(compute_dtype: str, device: object) -> tuple[dict[str, float | None], dict[str, str], object]:
    """(dense peaks by dtype, their sources, memory bandwidth) of a live device."""
    from lmledger.ledger.hardware.bandwidth import memory_bandwidth
    from lmledger.ledger.hardware.gpus import DTYPES, PeakFlops
    from lmledger.ledger.hardware.peak_flops import peak_flops

    peaks: dict[str, float | None] = {}
    sources = {}
    for dtype in DTYPES:  # a dtype the device lacks has a NoPeakFlops: its ops use the compute dtype's peak
        peak = peak_flops(dtype, device) if dtype in ("fp64", "fp32", "bf16", "fp16", compute_dtype) else None
        peaks[dtype] = peak.flops_per_s if isinstance(peak, PeakFlops) else None
        if isinstance(peak, PeakFlops):
            sources[dtype] = peak.detail or peak.source
    if not peaks.get(compute_dtype):
        raise ValueError(f"no {compute_dtype} peak on {device}")
    return peaks, sources, memory_bandwidth(device)


def op_bounds(ops: list[OpRecord], compute_dtype: str, device: object) -> list[float]:
    """Each op's roofline bound (seconds) on a live device, in order: what ledger/timing/steptime divides by the
    efficiency its category reached where an op cannot be replayed."""
    peaks, _, bandwidth = _device_figures(compute_dtype, device)
    fallback = float(peaks[compute_dtype])

    def peak_for(dtype: str) -> float:
        return float(peaks.get(peak_dtype(dtype, compute_dtype)) or fallback)

    memory = Links.one(Interconnect("memory", bandwidth.bytes_per_s, "user", "copies", latency_s=0.0))
    world = max((op.group_size for op in ops), default=1) or 1
    return [max(_op_bound(op, peak_for, bandwidth.bytes_per_s, memory, world)) for op in ops]


def gpu_roofline(ops: OpSummary, compute_dtype: str, gpu: str, links: Links | None = None) -> Roofline:
    """The bound on a GPU from its datasheet alone (gpus.GPUS), for planning on a machine without it.

    The ops come from a dry run on this machine. The GPU's kernels may make other temporaries. Collectives
    cross `links` (default: interconnect.default_links, the GPU's NVLink in a node and NDR between nodes).
    """
    from lmledger.ledger.hardware.gpus import datasheet_peak, require_gpu

    spec = require_gpu(gpu)
    peaks: dict[str, float | None] = {}
    for dtype in spec.peak_flops:
        peak = datasheet_peak(spec, dtype)
        peaks[dtype] = peak.flops_per_s if peak else None
    if not peaks.get(compute_dtype):
        from lmledger.errors import UserError

        raise UserError(f"{spec.name} has no dense {compute_dtype} peak in the table: pick another dtype or GPU")
    return roofline(
        ops, peaks, compute_dtype, spec.bandwidth_bytes_per_s, device=spec.key, links=links or default_links(spec.key),
        peak_source=f"datasheet {spec.name}", bandwidth_source=f"datasheet {spec.name}",
    )  # fmt: skip


def with_ddp_allreduce(ops: OpSummary, prediction: object) -> OpSummary:
    """`ops` with DDP's bucket all-reduces added as communication.

    For a per-rank prediction with buckets (ledger.sharding.sharded.ShardedLedger at world size W > 1) that
    records no collective itself. The dry run emulates DDP's Reducer, so its all-reduces are not among
    the ops. Each record holds its bucket; ledger.hardware.interconnect prices the ring's 2(W-1)/W of it.
    """
    buckets, world = getattr(prediction, "buckets", ()), getattr(prediction, "world_size", 1)
    if not buckets or world <= 1 or ops.by_category.get(COMMUNICATION, None) and ops.by_category[COMMUNICATION].ops:
        return ops
    extra = [
        OpRecord("c10d.allreduce_ (DDP bucket, predicted)", "backward", COMMUNICATION, 0, bucket.nbytes, 0,
                 bucket.dtype, group="world", group_size=world)
        for bucket in buckets
    ]  # fmt: skip
    return OpSummary.of([*ops.ops, *extra], ops.outside)


def with_step_collectives(ops: OpSummary, count: int, world_size: int) -> OpSummary:
    """`ops` with `count` one-value all-reduces over the world at the optimizer step added as communication.

    What a fit runs each optimizer step outside its training step, where its ranks must agree: a callback's verdict
    (PreemptionCheckpoint's stop, NonFiniteGuard's skip) or the gradient norm over sharded grads. The dry run does
    not see them; on the 2-core VM's gloo each costs about a millisecond and a half (issue 50).
    """
    if count <= 0 or world_size <= 1:
        return ops
    extra = [OpRecord("c10d.allreduce_ (a per-step decision, predicted)", "optimizer step", COMMUNICATION, 0, 4, 0,
                      "float32", group="world", group_size=world_size)] * count  # fmt: skip
    return OpSummary.of([*ops.ops, *extra], ops.outside)


def toy_step_ops(
    config: object, batch_size: int, seq_len: int, precision: str = "32-true", optimizer: Callable | None = None
) -> OpSummary:
    """The ops of one ToyLM training step, from a dry run on meta weights (nothing is allocated).

    `optimizer` is a factory params -> optimizer; default fused AdamW, as LitLM on a CPU.
    """
    import torch

    from lmledger.errors import UserError
    from lmledger.ledger.dryrun.engine import NotTraced, dry_run
    from lmledger.model import ToyLM

    with torch.device("meta"):
        model = ToyLM(config)
    batch = tuple(torch.empty(batch_size, seq_len, dtype=torch.long, device="meta") for _ in range(2))
    result = dry_run(
        model, batch, step=lambda m, b: m(*b), optimizer=optimizer or (lambda p: torch.optim.AdamW(p, fused=True)),
        precision=precision, device="cpu",
    )  # fmt: skip
    if isinstance(result, NotTraced):
        raise UserError(f"no roofline: {result.reason}")
    return result.ops


# ---------------------------------------------------------------------------------------------------
# The step-time table: bound beside measured

LABELS = {
    "matmul": "matmul",
    "attention": "attention",
    "other": "other compute",
    "optimizer": "optimizer step",
    "communication": "communication",
    "data_wait": "data wait",
    "host": "host overhead / idle",
}


@dataclass(frozen=True)
class TimeRow:
    label: str
    bound_s: float | None
    measured_s: float | None
    share: float | None  # of the measured step
    efficiency: float | None  # bound / measured
    predicted_s: float | None = None  # ledger/timing/steptime's prediction

    def to_json(self) -> dict:
        return {
            "bound_s": self.bound_s, "predicted_s": self.predicted_s, "measured_s": self.measured_s,
            "share": self.share, "efficiency": self.efficiency,
        }  # fmt: skip


def time_rows(
    bound: Roofline, measured: object | None, model_flops: float, predicted: Mapping[str, float] | None = None
) -> dict[str, TimeRow]:
    """The table's rows by name: "ideal", "bound", "measured", then one per category (LABELS).

    `measured` is a profile.Breakdown, or None for the bound only. `predicted`: ledger/timing/steptime's
    seconds per category (StepTime.seconds), or None; each category row's predicted_s.
    """
    wall = measured.wall_s if measured is not None else None

    def row(label: str, b: float | None, m: float | None, p: float | None = None) -> TimeRow:
        share = m / wall if (m is not None and wall) else None
        eff = b / m if (b is not None and m) else None
        return TimeRow(label, b, m, share, eff, p)

    rows = {
        "ideal": row("ideal (model FLOPs at dense peak)", bound.ideal_seconds(model_flops), None),
        "bound": row("roofline bound", bound.seconds, None),
    }
    rows["measured"] = row("measured", None, wall)
    for name, label in LABELS.items():
        b = bound.by_category[name].seconds if name in bound.by_category else None  # no op waits for data
        m = measured.seconds.get(name) if measured is not None else None
        p = predicted.get(name) if predicted is not None else None
        if name in bound.by_category and not bound.by_category[name].ops and not m and not p:
            continue  # no such ops (communication on one device)
        rows[name] = row(label, b, m, p)
    return rows


def _percent(x: float) -> str:
    """A rate as a percentage, two significant digits below 10% (0.05%, 3.4%, 38%)."""
    return f"{x:.0%}" if x >= 0.1 else f"{100 * x:.2g}%"


def diagnosis(bound: Roofline, measured: object, model_flops: float) -> str:
    """One line: measured MFU against the roofline's, where most of the gap is, and the data wait."""
    wall = measured.wall_s
    mfu = model_flops / wall / bound.peak_flops_per_s if wall > 0 else 0.0
    gaps = {}
    for name in LABELS:
        b = bound.by_category[name].seconds if name in bound.by_category else 0.0
        gaps[name] = measured.seconds.get(name, 0.0) - b
    worst = max((n for n in gaps if n != "data_wait"), key=gaps.__getitem__)
    share = measured.seconds.get(worst, 0.0) / wall if wall > 0 else 0.0
    if worst == "host":
        where = f"{share:.0%} of the step is host overhead / idle (Python, the training loop, launches), no op at all"
    else:
        cat = bound.by_category[worst]
        what = {"other": "elementwise and other ops", "matmul": "matmuls", "attention": "attention",
                "optimizer": "the optimizer step", "communication": "communication"}[worst]  # fmt: skip
        m = measured.seconds.get(worst, 0.0)
        if cat.memory_seconds >= cat.compute_seconds:
            rate = f"{_percent(cat.memory_seconds / m)} of memory bandwidth" if m else "no measured time"
        else:
            rate = f"{_percent(cat.compute_seconds / m)} of peak FLOP/s" if m else "no measured time"
        where = f"{share:.0%} of the step is in {what} running at {rate}"
    possible = bound.mfu(model_flops)
    return f"MFU {mfu:.2f} of a possible {possible:.2f}: {where}; data wait {measured.share('data_wait'):.0%}"


def format_table(
    bound: Roofline, measured: object | None, model_flops: float | None, predicted: Mapping[str, float] | None = None
) -> str:
    """The step-time table as fixed-width text (also `lmledger account --measure`'s); a `predicted`
    column between bound and measured where ledger/timing/steptime's seconds per category are given."""
    rows = time_rows(bound, measured, model_flops or 0.0, predicted)

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:.3f}"

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:.1%}"

    pcol = f" {'predicted':>10}" if predicted is not None else ""
    head = f"{'step time (ms per step)':<34} {'bound':>10}{pcol} {'measured':>10} {'share':>7} {'bound/measured':>15}"
    lines = [
        f"time ledger on {bound.device}: peak {tera(bound.peak_flops_per_s):.4g} TFLOP/s {bound.peak_dtype} "
        f"({bound.peak_source or 'peak'}), memory {bound.bandwidth_bytes_per_s / 1e9:.4g} GB/s "
        f"({bound.bandwidth_source or 'bandwidth'})",
        head,
        "-" * len(head),
    ]
    shown = dict(rows)
    if predicted is not None:  # the predicted step, between the bound and the measured one
        total = TimeRow("predicted (ops replayed here)", None, None, None, None, sum(predicted.values()))
        shown = {k: v for k, v in rows.items() if k in ("ideal", "bound")} | {"predicted": total}
        shown |= {k: v for k, v in rows.items() if k not in shown}
    for key, row in shown.items():
        pcell = f" {ms(row.predicted_s):>10}" if predicted is not None else ""
        cells = f"{ms(row.bound_s):>10}{pcell} {ms(row.measured_s):>10} {pct(row.share):>7} {pct(row.efficiency):>15}"
        lines.append(f"{row.label:<34} {cells}")
        if key == "measured":
            lines.append("-" * len(head))
    beaten = [k for k, row in rows.items() if k in LABELS and row.efficiency is not None and row.efficiency > 1]
    for name in beaten:
        # A bound a measurement beats is wrong: the figure behind it is too low for this machine.
        cat = bound.by_category[name]
        if cat.compute_seconds >= cat.memory_seconds:
            figure = f"the {bound.peak_dtype} peak ({bound.peak_source or 'peak'})"
            fix = "on a CPU the spec's clock may be the nominal one, below what the cores turbo to"
        else:
            figure = f"the memory bandwidth ({bound.bandwidth_source or 'bandwidth'})"
            fix = (
                "measure it again on a quiet machine: "
                "lmledger.ledger.hardware.bandwidth.measured_cpu_bandwidth(refresh=True)"
            )
        lines.append(f"{LABELS[name]} ran faster than its bound, so {figure} is too low: {fix}")
    if measured is not None and model_flops:
        lines.append(diagnosis(bound, measured, model_flops))
    elif model_flops:
        lines.append(f"roofline MFU {bound.mfu(model_flops):.2f} (an upper bound); no step profiled yet")
    return "\n".join(lines)
