"""What a device can do: dense peak FLOP/s per dtype, memory and bandwidth; name resolution; measured peaks.

Units: FLOP/s (int8 rows are integer ops/s), bytes, bytes/s. Every peak is the DENSE datasheet figure:
NVIDIA prints the "with sparsity" (2:4 structured) figure, twice the dense one, first and in bold for
Ampere and later; that figure is never reached by a training matmul, so it never appears here.

Memory is the datasheet's "GB" read as 1e9 bytes, as the CS336 lecture does ("80 GB" H100 -> 80e9). The
physical HBM is GiB-sized (an 80 GB H100 reports ~85e9 bytes to torch), so capacity planning with these
figures is slightly conservative.

Why our own table instead of Lightning's `lightning.fabric.utilities.throughput.get_available_flops`
(checked against Lightning 2.6.6's throughput.py): its H200 entries are keyed "h200 sxm1" / "h200 nvl1",
so the name torch reports for an H200, plain "NVIDIA H200", maps to no entry (warning + None); the H200
bf16/fp16 (2.0e15), tf32 (9.9e14) and int8 (4.0e15) figures are the sparse ones; its "h100 nvl" entry
lists 1978.8e12 bf16 (the dense figure is 835e12); "NVIDIA L40S" falls through its `"l4" in chip` test and
gets the L4's 121e12; there is no B200 and no fp8 column. This module also must not import Lightning.

Unknown devices (the CPU, an unlisted GPU) get a measured peak instead: the median rate of a large
matmul in the requested dtype, labelled "measured".
"""

from __future__ import annotations

import contextlib
import functools
import re
import statistics
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from lmledger.errors import UserError

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_T = 1e12
_P = 1e15
_GB = 1e9  # datasheet gigabyte (see the module docstring)


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    # Dense peak per dtype in FLOP/s (ops/s for int8); None where the datasheet gives no figure for that
    # dtype (the chip lacks it, e.g. bf16 on Volta, fp8 before Ada, or runs it at a negligible rate).
    peak_flops: Mapping[str, float | None]
    memory_bytes: int
    bandwidth_bytes_per_s: float

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "key": self.key,
            "peak_flops": {dtype: self.peak_flops[dtype] for dtype in DTYPES},
            "memory_bytes": self.memory_bytes,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
        }


def _peaks(fp64, fp32, tf32, bf16, fp16, fp8, int8) -> dict[str, float | None]:
    return dict(zip(DTYPES, (fp64, fp32, tf32, bf16, fp16, fp8, int8), strict=True))


# fp64 is the FP64 Tensor Core figure where the chip has one (A100, H100, H200, B200): that is what a
# float64 matmul (cuBLAS DGEMM) runs on; the vector FP64 figure is half of it on those chips.
# Hopper/Ampere/Ada/Blackwell datasheets print tf32, bf16, fp16, fp8 and int8 "with sparsity" as 2x the
# dense figures used here.
_A100_PEAKS = _peaks(19.5 * _T, 19.5 * _T, 156 * _T, 312 * _T, 312 * _T, None, 624 * _T)
_HOPPER_SXM_PEAKS = _peaks(67 * _T, 67 * _T, 494.7 * _T, 989.4 * _T, 989.4 * _T, 1978.9 * _T, 1978.9 * _T)
# The NVL (dual-slot PCIe, 350-400 W) parts: the H100 NVL and H200 NVL datasheets give the same figures.
_HOPPER_NVL_PEAKS = _peaks(60 * _T, 60 * _T, 417.5 * _T, 835 * _T, 835 * _T, 1670 * _T, 1670 * _T)
_V100_SXM2_PEAKS = _peaks(7.8 * _T, 15.7 * _T, None, None, 125 * _T, None, None)
_V100_PCIE_PEAKS = _peaks(7 * _T, 14 * _T, None, None, 112 * _T, None, None)

GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        # NVIDIA A100 Tensor Core GPU datasheet: SXM and PCIe share the peak figures; bandwidth differs.
        GpuSpec("a100-40gb", "NVIDIA A100 SXM4 40GB", _A100_PEAKS, int(40 * _GB), 1555 * _GB),
        GpuSpec("a100-80gb", "NVIDIA A100 SXM4 80GB", _A100_PEAKS, int(80 * _GB), 2039 * _GB),
        GpuSpec("a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", _A100_PEAKS, int(40 * _GB), 1555 * _GB),
        GpuSpec("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", _A100_PEAKS, int(80 * _GB), 1935 * _GB),
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5, PCIe, NVL columns).
        GpuSpec("h100-sxm", "NVIDIA H100 SXM5 80GB", _HOPPER_SXM_PEAKS, int(80 * _GB), 3.35 * _T),
        GpuSpec(
            "h100-pcie",
            "NVIDIA H100 PCIe 80GB",
            _peaks(51 * _T, 51 * _T, 378 * _T, 756 * _T, 756 * _T, 1513 * _T, 1513 * _T),
            int(80 * _GB),
            2.0 * _T,
        ),
        GpuSpec("h100-nvl", "NVIDIA H100 NVL 94GB", _HOPPER_NVL_PEAKS, int(94 * _GB), 3.9 * _T),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns): H100 compute, more and faster HBM3e.
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", _HOPPER_SXM_PEAKS, int(141 * _GB), 4.8 * _T),
        GpuSpec("h200-nvl", "NVIDIA H200 NVL 141GB", _HOPPER_NVL_PEAKS, int(141 * _GB), 4.8 * _T),
        # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU board's figures / 8; sparse tensor figures halved):
        # fp64 296 TF / 8, fp32 600 TF / 8 (REFERENCE.md leaves these two blank), tf32 as REFERENCE.md
        # rounds it (18 PF sparse / 8 / 2 = 1.125 PF), 180 GB (1.44 TB / 8), 8 TB/s.
        GpuSpec(
            "b200",
            "NVIDIA B200 180GB",
            _peaks(37 * _T, 75 * _T, 1.1 * _P, 2.25 * _P, 2.25 * _P, 4.5 * _P, 4.5 * _P),
            int(180 * _GB),
            8 * _T,
        ),
        # NVIDIA L4 Tensor Core GPU datasheet (no FP64 figure).
        GpuSpec(
            "l4",
            "NVIDIA L4 24GB",
            _peaks(None, 30.3 * _T, 60 * _T, 121 * _T, 121 * _T, 242.5 * _T, 242.5 * _T),
            int(24 * _GB),
            300 * _GB,
        ),
        # NVIDIA L40S datasheet (it prints dense and sparse side by side; no FP64 figure).
        GpuSpec(
            "l40s",
            "NVIDIA L40S 48GB",
            _peaks(None, 91.6 * _T, 183 * _T, 362.05 * _T, 362.05 * _T, 733 * _T, 733 * _T),
            int(48 * _GB),
            864 * _GB,
        ),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column. Tensor figures are the ones
        # with FP32 accumulate (what training GEMMs use; GeForce runs them at half the FP16-accumulate rate).
        GpuSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090 24GB",
            _peaks(None, 82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T, 330.3 * _T, 660.6 * _T),
            int(24 * _GB),
            1008 * _GB,
        ),
        # The A10G is AWS's variant of the A10 and has no NVIDIA datasheet of its own; these are the
        # NVIDIA A10 datasheet's figures (as Lightning also uses), so treat A10G MFU as a lower bound.
        GpuSpec(
            "a10g",
            "NVIDIA A10G 24GB",
            _peaks(None, 31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T, None, 250 * _T),
            int(24 * _GB),
            600 * _GB,
        ),
        # NVIDIA Tesla V100 datasheet (SXM2 and PCIe columns). Volta has no sparsity, tf32 or bf16.
        GpuSpec("v100", "NVIDIA Tesla V100 SXM2 16GB", _V100_SXM2_PEAKS, int(16 * _GB), 900 * _GB),
        GpuSpec("v100-32gb", "NVIDIA Tesla V100 SXM2 32GB", _V100_SXM2_PEAKS, int(32 * _GB), 900 * _GB),
        GpuSpec("v100-pcie", "NVIDIA Tesla V100 PCIe 16GB", _V100_PCIE_PEAKS, int(16 * _GB), 900 * _GB),
        GpuSpec("v100-pcie-32gb", "NVIDIA Tesla V100 PCIe 32GB", _V100_PCIE_PEAKS, int(32 * _GB), 900 * _GB),
        # NVIDIA T4 Tensor Core GPU datasheet (fp16 is "mixed precision FP16/FP32"; no FP64 figure).
        GpuSpec(
            "t4",
            "NVIDIA Tesla T4 16GB",
            _peaks(None, 8.1 * _T, None, None, 65 * _T, None, 130 * _T),
            int(16 * _GB),
            320 * _GB,
        ),
    )
}


# ---------------------------------------------------------------------------------------------------
# Name resolution: a key ("h100-sxm", "H100 SXM") or what torch.cuda.get_device_name() reports
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA GeForce RTX 4090", ...).

_VENDOR_WORDS = {"nvidia", "tesla", "geforce"}
_MEMORY_WORD = re.compile(r"\d+gb")
# (model, is PCIe, memory word) -> key, for the parts sold in several memory sizes.
_SIZED_KEYS = {
    ("a100", False, "40gb"): "a100-40gb",
    ("a100", False, "80gb"): "a100-80gb",
    ("a100", True, "40gb"): "a100-pcie-40gb",
    ("a100", True, "80gb"): "a100-pcie-80gb",
    ("v100", False, "16gb"): "v100",
    ("v100", False, "32gb"): "v100-32gb",
    ("v100", True, "16gb"): "v100-pcie",
    ("v100", True, "32gb"): "v100-pcie-32gb",
}


def _words(name: str) -> list[str]:
    words = [w for w in re.split(r"[\s\-_/]+", name.strip().lower()) if w]
    return [w for w in words if w not in _VENDOR_WORDS]


def _key_from_device_name(words: list[str]) -> str | None:
    if not words:
        return None
    model, qualifiers = words[0], set(words[1:])
    sizes = {w for w in qualifiers if _MEMORY_WORD.fullmatch(w)}
    plain = qualifiers <= sizes  # nothing but memory sizes after the model name
    pcie = "pcie" in qualifiers
    if model == "h100":
        if "nvl" in qualifiers:
            return "h100-nvl"
        if pcie or "hbm2e" in qualifiers:
            return "h100-pcie"
        if qualifiers & {"sxm", "sxm5", "hbm3"}:
            return "h100-sxm"
        return None  # plain "H100": the form factor decides the peak, so do not guess
    if model == "h200":
        return "h200-nvl" if "nvl" in qualifiers else "h200"
    if model in ("a100", "v100"):
        # Form factor and memory both matter (bandwidth, capacity); without the size, do not guess.
        size = next(iter(sizes), None) if len(sizes) == 1 else None
        return _SIZED_KEYS.get((model, pcie, size))
    if model == "rtx" and words[1:] == ["4090"]:
        return "rtx-4090"
    if model in ("b200", "l4", "l40s", "a10g", "t4") and plain:
        return model
    return None


def resolve(name: str) -> GpuSpec | None:
    """The spec for a key or a torch device name; warns and returns None for a name we do not know."""
    words = _words(name)
    key = "-".join(words)
    if key not in GPUS:
        key = _key_from_device_name(words)
    if key is None:
        warnings.warn(
            f"no datasheet entry for GPU {name!r}; known keys: {', '.join(GPUS)} (peaks will be measured)",
            stacklevel=2,
        )
        return None
    return GPUS[key]


def require_gpu(name: str) -> GpuSpec:
    """`resolve` for user input: an unknown name is a UserError instead of a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = resolve(name)
    if spec is None:
        raise UserError(f"unknown GPU {name!r}: use a key from `lmledger gpus` ({', '.join(GPUS)})")
    return spec


# ---------------------------------------------------------------------------------------------------
# dtypes and Lightning precision strings

_DTYPE_ALIASES = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32",
    "tfloat32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16",
    "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}  # fmt: skip


def dtype_name(dtype: str | torch.dtype) -> str:
    """Normalize "bfloat16", torch.bfloat16, "BF16" ... to one of DTYPES."""
    text = str(dtype).lower().removeprefix("torch.")
    name = text if text in DTYPES else _DTYPE_ALIASES.get(text)
    if name is None:
        raise UserError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    return name


# Lightning precision string -> the dtype its matmuls run in, i.e. whose peak MFU is measured against.
# "32-true" gives "fp32"; `peak_flops` turns that into tf32 on Ampere+ unless the float32 matmul precision
# is "highest". Transformer Engine runs its Linear layers' matmuls in fp8 (weights stay bf16/fp16).
_PRECISION_COMPUTE_DTYPE = {
    "64-true": "fp64", "64": "fp64",
    "32-true": "fp32", "32": "fp32",
    "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
    "16-mixed": "fp16", "16-true": "fp16", "16": "fp16",
    "transformer-engine": "fp8", "transformer-engine-float16": "fp8",
}  # fmt: skip


def compute_dtype_for_precision(precision: str | int) -> str:
    dtype = _PRECISION_COMPUTE_DTYPE.get(str(precision))
    if dtype is None:
        known = ", ".join(p for p in _PRECISION_COMPUTE_DTYPE if "-" in p)
        raise UserError(f"unknown precision {precision!r}: choose from {known}")
    return dtype


# ---------------------------------------------------------------------------------------------------
# Peaks: datasheet for known GPUs, measured otherwise


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # "datasheet:<key>" or "measured"
    dtype: str  # the dtype whose peak this is (after the tf32 rule)


def datasheet_peak(
    spec: GpuSpec, dtype: str | torch.dtype, *, float32_matmul_precision: str = "highest"
) -> Peak | None:
    """The table's peak for `dtype` on `spec`, None where the datasheet has no figure.

    fp32 matmuls run as tf32 on chips that have tf32 (Ampere and later) unless torch's float32 matmul
    precision is "highest", so the applicable peak for "fp32" is then the tf32 one.
    """
    dtype = dtype_name(dtype)
    if dtype == "fp32" and float32_matmul_precision != "highest" and spec.peak_flops["tf32"] is not None:
        dtype = "tf32"
    flops = spec.peak_flops[dtype]
    return None if flops is None else Peak(flops, f"datasheet:{spec.key}", dtype)


def peak_flops(
    dtype: str | torch.dtype,
    device: str | torch.device | None = None,
    *,
    float32_matmul_precision: str | None = None,
) -> Peak | None:
    """The peak FLOP/s that MFU on `device` in `dtype` is measured against.

    CUDA device listed in GPUS: the datasheet figure. CPU, an unlisted GPU, or a listed GPU whose
    datasheet gives no figure for the dtype: a measured peak (cached per device and dtype in this
    process). None (with a warning) where the dtype cannot run on the device at all, e.g. fp8 on a CPU.
    `float32_matmul_precision` defaults to torch's current setting (it decides fp32 vs tf32).
    """
    dtype = dtype_name(dtype)
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    precision = float32_matmul_precision or torch.get_float32_matmul_precision()
    if device.type == "cuda":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown GPU is fine here: we measure instead
            spec = resolve(torch.cuda.get_device_name(device))
        if spec is not None:
            peak = datasheet_peak(spec, dtype, float32_matmul_precision=precision)
            if peak is not None:
                return peak
        if dtype == "fp32" and precision != "highest" and torch.cuda.get_device_capability(device) >= (8, 0):
            dtype = "tf32"
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        warnings.warn(f"no peak for {dtype} on {device}: {reason}", stacklevel=2)
        return None
    return _measured_peak(str(device), dtype)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# A measured peak is the best rate over a ramp of square matmuls, doubling from 64 until one call
# takes this long (or the size cap), but never stopping below _MEASURE_MIN_SIZE: on a busy machine a
# small matmul can lose its time slice and look slow. Small sizes can win on a CPU (bf16 without
# native support runs a cache-friendlier path at 64-128 than at 512, and a toy model's matmuls are
# that small), large ones win on a GPU. Each size keeps its fastest repeat and the ramp runs twice:
# a peak is a best case, and a shared machine only ever makes calls slower.
_MEASURE_TARGET_S = {"cpu": 0.02, "cuda": 0.005}
_MEASURE_MIN_SIZE = {"cpu": 512, "cuda": 4096}
_MEASURE_MAX_SIZE = {"cpu": 2048, "cuda": 8192}
_MEASURE_ROUNDS = 2


@functools.cache
def _measured_peak(device: str, dtype: str) -> Peak:
    dev = torch.device(device)
    best = 0.0
    for _ in range(_MEASURE_ROUNDS):
        size = 64
        while True:
            seconds = time_matmul(dtype, size, dev, repeats=5, warmup=1, statistic=min)
            best = max(best, matmul_flops(size, size, size) / seconds)
            done = seconds >= _MEASURE_TARGET_S[dev.type] and size >= _MEASURE_MIN_SIZE[dev.type]
            if done or size >= _MEASURE_MAX_SIZE[dev.type]:
                break
            size *= 2
    return Peak(best, "measured", dtype)


# ---------------------------------------------------------------------------------------------------
# Timing one matmul (shared with lmledger.bench)

_TORCH_DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}


def matmul_flops(m: int, n: int, k: int) -> int:
    """(m x k) @ (k x n): one multiply and one add per output element per k."""
    return 2 * m * n * k


def unsupported_reason(dtype: str, device: torch.device) -> str | None:
    """Why a `dtype` matmul cannot be timed on `device`, or None if it can."""
    dtype = dtype_name(dtype)
    if dtype not in _TORCH_DTYPES:
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
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# Enough operand pairs to rotate through that the next call's inputs are not still in cache (H100/H200
# L2 is 50 MB; a server CPU's L3 is tens of MB), capped so tiny sizes do not allocate hundreds of pairs.
_ROTATE_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
_MAX_BUFFERS = 16


def _make_operands(dtype: str, size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch_dtype = _TORCH_DTYPES[dtype]
    pair_bytes = 2 * size * size * torch_dtype.itemsize
    count = max(2, min(_MAX_BUFFERS, _ROTATE_BYTES[device.type] // pair_bytes))
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
    if dtype == "fp8":
        one = torch.ones((), device=device, dtype=torch.float32)  # per-tensor scales
        return lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return torch.matmul


def time_matmul(
    dtype: str, size: int, device: torch.device, *, repeats: int, warmup: int, statistic=statistics.median
) -> float:
    """Median (or `statistic` of the) seconds of one (size x size) @ (size x size) matmul in `dtype` on `device`.

    Inputs rotate among several buffers; CUDA is timed with events, the CPU with perf_counter. fp32 runs
    at float32 matmul precision "highest" (true fp32), tf32 at "high". Raises ValueError where
    `unsupported_reason` gives one.
    """
    dtype = dtype_name(dtype)
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        raise ValueError(reason)
    if dtype == "fp8" and size % 16:
        raise ValueError(f"fp8 matmul sizes must be multiples of 16 (torch._scaled_mm), got {size}")
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
