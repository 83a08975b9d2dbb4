"""Timing square matmuls: one (size x size) matmul per dtype, and the best rate over a ramp of sizes.

`lmledger bench` (lmledger.bench) and the measured peaks share it: ledger/hardware/cpu.py for the CPU,
ledger/hardware/peak_flops.py for an unlisted GPU. Importing this module does not import torch; the functions do.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from lmledger.ledger.hardware.gpus import dtype_name
from lmledger.ledger.hardware.memory import free_memory
from lmledger.ledger.units import format_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "best_matmul_rate",
    "float32_matmul_precision",
    "matmul_flops",
    "operand_bytes",
    "time_matmul",
    "unsupported_reason",
]


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    return {
        "fp64": torch.float64,
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8": torch.float8_e4m3fn,
    }[dtype]


_TIMED_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


def matmul_flops(m: int, n: int, k: int) -> int:
    """(m x k) @ (k x n): one multiply and one add per output element per k."""
    return 2 * m * n * k


def unsupported_reason(dtype: str, device: torch.device) -> str | None:
    """Why a `dtype` matmul cannot be timed on `device`; None if it can."""
    import torch

    dtype = dtype_name(dtype)
    if dtype not in _TIMED_DTYPES:
        return f"{dtype} matmuls are not benchmarked"
    if device.type == "cpu":
        if dtype in ("tf32", "fp8"):
            return f"{dtype} is a GPU tensor-core format (no CPU kernel worth timing)"
        return None
    if device.type != "cuda":
        return f"device type {device.type!r} is not supported (cpu or cuda)"
    major, minor = torch.cuda.get_device_capability(device)
    if dtype in ("tf32", "bf16") and (major, minor) < (8, 0):
        return f"{dtype} needs sm_80+ (Ampere or later); this GPU is sm_{major}{minor}"
    if dtype == "fp8" and (major, minor) < (8, 9):
        return f"fp8 needs sm_89+ (Ada, Hopper or later; torch._scaled_mm); this GPU is sm_{major}{minor}"
    return None


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """Set torch's float32 matmul precision ("highest" = true fp32, "high" = tf32) for a block."""
    import torch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# Enough operand pairs that the next call's inputs are out of cache: H100/H200 L2 is 50 MB, a server
# CPU's L3 tens of MB. Capped, so tiny sizes do not allocate hundreds of pairs.
_ROTATE_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
_MAX_BUFFERS = 16


def _pairs(dtype: str, size: int, device: torch.device) -> int:
    """Operand pairs rotated (comment above)."""
    return max(2, min(_MAX_BUFFERS, _ROTATE_BYTES[device.type] // (2 * size * size * _torch_dtype(dtype).itemsize)))


def operand_bytes(dtype: str, size: int, device: torch.device) -> int:
    """Bytes a timing of one size holds at its top: the operand pairs, the two fp32 draws a pair is cast from, and
    the output (bf16 for fp8's _scaled_mm, else the operands' dtype)."""
    itemsize = _torch_dtype(dtype).itemsize
    out = 2 if dtype == "fp8" else itemsize
    return size * size * (_pairs(dtype, size, device) * 2 * itemsize + 2 * 4 + out)


def _make_operands(dtype: str, size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    torch_dtype = _torch_dtype(dtype)
    count = _pairs(dtype, size, device)
    pairs = []
    for _ in range(count):
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        if dtype == "fp8":
            # torch._scaled_mm wants the second operand column-major: the transpose of a row-major tensor.
            pairs.append((a.to(torch_dtype), b.to(torch_dtype).t().contiguous().t()))
        else:
            pairs.append((a.to(torch_dtype), b.to(torch_dtype)))
    return pairs


def _matmul_fn(dtype: str, device: torch.device):
    import torch

    if dtype == "fp8":
        one = torch.ones((), device=device, dtype=torch.float32)  # per-tensor scales
        return lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return torch.matmul


def time_matmul(
    dtype: str, size: int, device: torch.device, *, repeats: int, warmup: int, statistic=statistics.median
) -> float:
    """Seconds of one (size x size) @ (size x size) `dtype` matmul on `device`: the median, or `statistic`.

    Inputs rotate among several buffers. CUDA is timed with events, the CPU with perf_counter.
    The fp32 dtype runs at float32 matmul precision "highest" (true fp32). The tf32 dtype runs at "high".
    Raises ValueError where `unsupported_reason` gives one.
    """
    import torch

    dtype = dtype_name(dtype)
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        raise ValueError(reason)
    if dtype == "fp8" and size % 16:
        raise ValueError(f"fp8 matmul sizes must be multiples of 16 (torch._scaled_mm), got {size}")
    needs, free = operand_bytes(dtype, size, device), free_memory(device)
    if needs > free:  # CPU's allocator raised a RuntimeError traceback for --sizes 100000 (40 GB a matrix)
        raise ValueError(f"the operands need {format_bytes(needs)}, over the {format_bytes(free)} free on {device}")
    operands = _make_operands(dtype, size, device)
    matmul = _matmul_fn(dtype, device)
    with float32_matmul_precision("high" if dtype == "tf32" else "highest"), torch.no_grad():
        for i in range(warmup):
            matmul(*operands[i % len(operands)])
        if device.type == "cuda":
            return statistic(_cuda_seconds(matmul, operands, repeats, device))
        seconds = []
        for i in range(repeats):
            a, b = operands[i % len(operands)]
            start = time.perf_counter()
            matmul(a, b)
            seconds.append(time.perf_counter() - start)
        return statistic(seconds)


def _cuda_seconds(matmul, operands, repeats: int, device: torch.device) -> list[float]:
    import torch

    with torch.cuda.device(device):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        torch.cuda.synchronize()
        for i in range(repeats):
            a, b = operands[i % len(operands)]
            starts[i].record()
            matmul(a, b)
            ends[i].record()
        torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]


# A measured peak is the best rate over a ramp of square matmuls. Sizes double from 64 until one call
# takes this long, or to the size cap. The ramp never stops below _MEASURE_MIN_SIZE: on a busy machine
# a small matmul can lose its time slice and look slow. Small sizes can win on a CPU: bf16 without
# native support runs a cache-friendlier path at 64-128 than at 512, and a toy model's matmuls are
# that small. Large ones win on a GPU. Each size keeps its fastest repeat, and the ramp runs several
# times. A peak is a best case; a shared machine only ever makes calls slower.
_MEASURE_TARGET_S = {"cpu": 0.02, "cuda": 0.005}
_MEASURE_MIN_SIZE = {"cpu": 512, "cuda": 4096}
_MEASURE_MAX_SIZE = {"cpu": 2048, "cuda": 8192}


def best_matmul_rate(device: str, dtype: str, rounds: int) -> float:
    """The best FLOP/s of square `dtype` matmuls on `device` over `rounds` ramps of sizes."""
    import torch

    dev = torch.device(device)
    best = 0.0
    for _ in range(rounds):
        size = 64
        while True:
            seconds = time_matmul(dtype, size, dev, repeats=5, warmup=1, statistic=min)
            best = max(best, matmul_flops(size, size, size) / seconds)
            done = seconds >= _MEASURE_TARGET_S[dev.type] and size >= _MEASURE_MIN_SIZE[dev.type]
            if done or size >= _MEASURE_MAX_SIZE[dev.type]:
                break
            size *= 2
    return best
