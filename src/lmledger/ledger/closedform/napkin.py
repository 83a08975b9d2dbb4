"""Napkin math before a run: how long training takes, the largest model that fits, the largest batch.

The formulas are CS336 lecture 2's (docs/reference.md, "Napkin math"). A model fits when params *
bytes_per_param <= the GPUs' total memory. Activations are ignored.

    training FLOPs = 6 * params * tokens  (forward 2N per token, backward 4N)
    time = FLOPs / (peak * GPUs * MFU)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.hardware.gpus import GpuSpec, datasheet_peak, dtype_name, require_gpu
from lmledger.ledger.units import GB

# Also public, but lazy (module __getattr__, so not listed): OPTIMIZERS.
__all__ = [
    "DEVICE_MEMORY_RANGE",
    "MAX_COUNT",
    "MAX_GPUS",
    "MaxParams",
    "TrainTime",
    "bytes_per_param",
    "device_capacity",
    "device_memory_bytes",
    "largest_within",
    "max_batch",
    "max_params",
    "train_time",
    "training_flops",
]

_SECONDS_PER_DAY = 86_400

# Orders of magnitude beyond any real run (the largest published: ~2e12 params, ~4e13 tokens, ~1e5 GPUs).
# Yet small enough that 6 * N * D and the days stay finite floats.
MAX_COUNT = 1e24
MAX_GPUS = 10_000_000
_MIN_MFU = 1e-6  # below this no run is training; with MAX_COUNT it keeps the days finite


def __getattr__(name: str):
    # ledger.closedform.memory imports torch, and `lmledger plan train-time` must answer without it. So the
    # optimizer names are looked up only when asked for.
    if name == "OPTIMIZERS":
        from lmledger.ledger.closedform import memory

        return memory.OPTIMIZERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bytes_per_param(precision: str = "32-true", optimizer: str = "adamw") -> float:
    """Bytes each parameter costs in training on one GPU: the param, its grad and the optimizer state.

    The conventions are lmledger.ledger.closedform.memory's: one rule for the planner and the running ledger.
    Bytes per element come from ledger.precision_table. AdamW: 32-true and *-mixed 4 + 4 + 2 * 4 = 16,
    *-true 8, 64-true 32.

    Mixed (torch autocast): params, grads and AdamW m, v stay fp32. Autocast's bf16/fp16 weight
    copies live only through a forward pass. They are not counted. Mixed precision buys speed, not
    parameter memory. Frameworks with bf16 params + grads and an fp32 master copy land at 16 too
    (2+2+4+4+4). Megatron-style fp32 grads: 18-20. Transformer Engine's fp8 copies for its matmuls
    are not counted. Optimizer states: adamw two (m, v), sgd with momentum one, none (plain SGD) zero.
    """
    from lmledger.ledger.closedform import memory

    return memory.bytes_per_param(precision, optimizer)


def training_flops(params: float, tokens: float) -> float:
    """6 * N * D: forward 2N FLOPs per token, backward 4N."""
    return 6 * params * tokens


@dataclass(frozen=True)
class TrainTime:
    params: float
    tokens: float
    gpu: str
    num_gpus: int
    mfu: float
    dtype: str
    peak_flops: float  # per GPU, dense datasheet figure
    total_flops: float
    seconds: float

    @property
    def hours(self) -> float:
        return self.seconds / 3600

    @property
    def days(self) -> float:
        return self.seconds / _SECONDS_PER_DAY

    def to_json(self) -> dict:
        return {**asdict(self), "hours": self.hours, "days": self.days}


def _gpu(gpu: str | GpuSpec) -> GpuSpec:
    return gpu if isinstance(gpu, GpuSpec) else require_gpu(gpu)


def _check_num_gpus(num_gpus: int) -> None:
    if not (isinstance(num_gpus, int) or (isinstance(num_gpus, float) and num_gpus.is_integer())) or num_gpus < 1:
        raise UserError(f"--num-gpus must be a whole number >= 1, got {num_gpus}")
    if num_gpus > MAX_GPUS:
        raise UserError(f"--num-gpus {num_gpus} is beyond any cluster: use at most {MAX_GPUS:,}")


def _check_count(flag: str, value: float) -> None:
    """A positive, finite count up to MAX_COUNT (1e400 parses as inf; 1e300 * 1e300 overflows)."""
    if not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value} (e.g. 70e9 or 70B)")
    if not value > 0:
        raise UserError(f"{flag} must be positive, got {value}")
    if value > MAX_COUNT:
        raise UserError(f"{flag} {value:g} is absurdly large: use at most {MAX_COUNT:g}")


def train_time(
    params: float, tokens: float, gpu: str | GpuSpec, num_gpus: int = 1, mfu: float = 0.5, dtype: str = "bf16"
) -> TrainTime:
    """Wall-clock time to train `params` on `tokens` at `mfu` of the GPUs' dense `dtype` peak."""
    _check_count("--params", params)
    _check_count("--tokens", tokens)
    _check_num_gpus(num_gpus)
    if not _MIN_MFU <= mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], got {mfu} (0.5 is good, 0.3-0.4 typical; at least {_MIN_MFU:g})")
    spec = _gpu(gpu)
    dtype = dtype_name(dtype)
    peak = datasheet_peak(spec, dtype)
    if peak is None:
        have = ", ".join(d for d, flops in spec.peak_flops.items() if flops is not None)
        raise UserError(f"{spec.key} has no {dtype} peak: choose --dtype from {have}")
    total = training_flops(params, tokens)
    seconds = total / (peak.flops_per_s * num_gpus * mfu)
    return TrainTime(params, tokens, spec.key, int(num_gpus), mfu, dtype, peak.flops_per_s, total, seconds)


@dataclass(frozen=True)
class MaxParams:
    gpu: str
    num_gpus: int
    precision: str
    optimizer: str
    capacity_bytes: int  # all GPUs together
    bytes_per_param: float
    max_params: int

    def to_json(self) -> dict:
        return asdict(self)


def max_params(
    gpu: str | GpuSpec, num_gpus: int = 1, precision: str = "32-true", optimizer: str = "adamw"
) -> MaxParams:
    """The most parameters whose params, grads and optimizer state fit in the GPUs' memory.

    Assumes the state is sharded evenly over the GPUs (FSDP / ZeRO-3). Ignores activations.
    """
    _check_num_gpus(num_gpus)
    spec = _gpu(gpu)
    per_param = bytes_per_param(precision, optimizer)
    capacity = spec.memory_bytes * int(num_gpus)
    return MaxParams(spec.key, int(num_gpus), precision, optimizer, capacity, per_param, int(capacity // per_param))


def largest_within(cost: Callable[[int], object], capacity: int, limit: int) -> tuple[int, int | None] | object:
    """(the largest b in [1, limit] with cost(b) <= capacity, the smallest b above it that is over).

    The one largest-batch search: max_batch, dryrun.largest_batch and sharded.largest_batch_sharded call it.
    (0, 1) when not even b = 1 fits; (limit, None) when `limit` fits. `cost` (bytes, a peak) must not decrease
    with b. It may return a non-number instead (a NotTraced): the search stops and returns that. Each size is
    asked once.

    A peak is close to a line in b, but not exactly one (a dry run's slope from b = 1 to 2 missed tiny.yaml's
    at b = 3,600 by 2%). So each next size is where the line through the two nearest sizes asked crosses the
    capacity (regula falsi), which lands within a size or two of the answer in two or three calls. Where that
    does not close in (a cost far from a line), the distance outward at least doubles, and a bracket not
    halved by an interpolation is bisected next: O(log b) calls on any cost.
    """
    costs: dict[int, object] = {}

    def over(size: int) -> bool | object:  # True / False, or the value that stops the search
        if size not in costs:
            costs[size] = cost(size)
        value = costs[size]
        return bool(value > capacity) if isinstance(value, (int, float)) else value

    def crossing(a: int, b: int) -> int:
        """The largest size the line through sizes a < b puts at or under the capacity."""
        slope = (costs[b] - costs[a]) / (b - a)
        return b + (limit - b if slope <= 0 else int((capacity - costs[b]) // slope))

    first = over(1)
    if first is not False:
        return (0, 1) if first is True else first
    low, high, previous, step = 1, None, None, 1  # low fits; high is over (None: nothing asked is over yet)
    bisect = False
    while low < limit and (high is None or high - low > 1):
        if high is None:  # outward: the line's crossing, or `step` past low where that is nearer (then doubled)
            line = crossing(previous, low) if previous is not None else low + 1
            guess = min(limit, max(low + step, line))
            step = 1 if line > low + step else 2 * step
        elif bisect:
            guess = (low + high) // 2
        else:
            guess = min(high - 1, max(low + 1, crossing(low, high)))
        width = None if high is None else high - low
        verdict = over(guess)
        if verdict not in (True, False):
            return verdict
        if verdict:
            high = guess
        else:
            previous, low = low, guess
        # an interpolation that did not halve the bracket is followed by a bisection
        bisect = width is not None and not bisect and 2 * (high - low) > width
    return (low, high) if high is not None else (limit, None)


def max_batch(bytes_for_batch: Callable[[int], int], capacity_bytes: int, *, limit: int = 2**31) -> int:
    """The largest batch b >= 1 with bytes_for_batch(b) <= capacity_bytes; 0 if not even b = 1 fits.

    `bytes_for_batch` must not decrease with b (largest_within). Stops at `limit` when memory never runs out.
    """
    return largest_within(bytes_for_batch, capacity_bytes, limit)[0]


def device_capacity(gpu: str | None, device_memory_gb: float | None) -> tuple[int, str, str | None]:
    """(bytes one device may use, how to show it, the GPU key or None).

    From exactly one of a GPU's memory or a size in GB: plan max-batch's --gpu and
    --ledger.device_memory_gb.
    """
    if (gpu is None) == (device_memory_gb is None):
        raise UserError(
            "max-batch needs the memory to fit in: --gpu KEY or --ledger.device_memory_gb GB (alias "
            "--device-memory-gb), one of them"
        )
    if gpu is not None:
        spec = require_gpu(gpu)
        return spec.memory_bytes, f"{spec.key} ({spec.memory_bytes / GB:g} GB)", spec.key
    return device_memory_bytes(device_memory_gb), f"{device_memory_gb:g} GB per device", None


# A device's memory in GB, as --ledger.device_memory_gb gives it: at least one byte (1e-12 GB rounds to none, and
# a search for the largest batch under 0 bytes has nothing to search), below an exabyte (1e300 GB overflows).
DEVICE_MEMORY_RANGE = "at least 1e-9 GB (one byte) and below 1e9 GB"


def device_memory_bytes(gb: float, flag: str = "ledger.device_memory_gb") -> int:
    """The bytes `gb` GB (1e9 bytes) of device memory hold; a ConfigError naming `flag` for what is no such size.
    The one check of the fit's --ledger.device_memory_gb and plan max-batch's (its alias --device-memory-gb)."""
    if isinstance(gb, bool) or not isinstance(gb, (int, float)):
        raise ConfigError(f"{flag} must be a number of GB, got {gb!r}")
    if not (math.isfinite(gb) and 1 <= gb * GB < 1e18):
        raise ConfigError(f"{flag} must be {DEVICE_MEMORY_RANGE}, got {gb:g}")
    return round(gb * GB)
