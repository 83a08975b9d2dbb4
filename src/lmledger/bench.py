"""Matmul benchmark: achieved FLOP/s and MFU per dtype and size, against the dense peak.

The peak is the datasheet figure on a listed GPU. Elsewhere (the CPU, an unlisted GPU) it is measured.
Every result says which. Timing itself lives in lmledger.ledger.hardware.matmul.time_matmul: warm-up, rotated
inputs, CUDA events, median. The measured peaks use it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lmledger.ledger.hardware.gpus import PeakFlops, find_gpu
from lmledger.ledger.hardware.matmul import matmul_flops, time_matmul, unsupported_reason
from lmledger.ledger.hardware.peak_flops import NoPeakFlops, peak_flops
from lmledger.ledger.units import tera

__all__ = ["DEFAULT_DTYPES", "DEFAULT_SIZES", "MatmulBench", "bench_matmul", "plot_mfu"]


DEFAULT_DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("fp32", "tf32", "bf16", "fp16", "fp8")}
# CPU sizes stay small: bf16 matmuls without AVX512-BF16/AMX run at ~1 GFLOP/s.
DEFAULT_SIZES = {"cpu": (128, 256, 512), "cuda": (1024, 2048, 4096, 8192)}
_DEFAULT_REPEATS = {"cpu": 5, "cuda": 20}
_WARMUP = {"cpu": 1, "cuda": 5}


@dataclass(frozen=True)
class _MatmulResult:
    dtype: str
    size: int  # m = n = k
    seconds: float | None  # median of the repeats; None when the dtype did not run
    peak: PeakFlops | None
    note: str | None = None  # why it did not run

    @property
    def flops(self) -> int:
        return matmul_flops(self.size, self.size, self.size)

    @property
    def flops_per_s(self) -> float | None:
        return None if self.seconds is None else self.flops / self.seconds

    @property
    def mfu(self) -> float | None:
        if self.flops_per_s is None or self.peak is None:
            return None
        return self.flops_per_s / self.peak.flops_per_s

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "size": self.size,
            "flops": self.flops,
            "seconds": self.seconds,
            "flops_per_s": self.flops_per_s,
            "peak_flops": None if self.peak is None else self.peak.flops_per_s,
            "peak_source": None if self.peak is None else self.peak.source,
            "mfu": self.mfu,
            "note": self.note,
        }


@dataclass(frozen=True)
class MatmulBench:
    device: str
    device_name: str
    repeats: int
    warmup: int
    results: list[_MatmulResult]

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "results": [result.to_json() for result in self.results],
        }


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    spec = find_gpu(name)
    return name if spec is None else f"{name} ({spec.key})"


def _bench_dtype(dtype: str, sizes: list[int], device: torch.device, repeats: int, warmup: int) -> list[_MatmulResult]:
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        return [_MatmulResult(dtype, size, None, None, f"unsupported: {reason}") for size in sizes]
    # "fp32" here means true fp32 (time_matmul runs it at precision "highest"), so its peak is fp32's.
    peak = peak_flops(dtype, device, float32_matmul_precision="highest")
    peak = None if isinstance(peak, NoPeakFlops) else peak  # none left: unsupported dtypes returned above
    results = []
    for size in sizes:
        try:
            seconds = time_matmul(dtype, size, device, repeats=repeats, warmup=warmup)
        except ValueError as err:  # e.g. an fp8 size that is not a multiple of 16
            results.append(_MatmulResult(dtype, size, None, peak, f"skipped: {err}"))
        else:
            results.append(_MatmulResult(dtype, size, seconds, peak))
    return results


def bench_matmul(dtypes: list[str], sizes: list[int], device: torch.device, repeats: int | None = None) -> MatmulBench:
    """Time square matmuls of each size and dtype on `device`, against the peak."""
    repeats = repeats or _DEFAULT_REPEATS[device.type]
    warmup = _WARMUP[device.type]
    results = [result for dtype in dtypes for result in _bench_dtype(dtype, sizes, device, repeats, warmup)]
    return MatmulBench(str(device), _device_name(device), repeats, warmup, results)


def plot_mfu(bench: MatmulBench, path: Path) -> None:
    """MFU vs matrix size, one line per dtype that ran, written as a PNG."""
    # The object-oriented API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for dtype in dict.fromkeys(result.dtype for result in bench.results):
        ran = [r for r in bench.results if r.dtype == dtype and r.mfu is not None]
        if ran:
            label = f"{dtype} (peak {tera(ran[0].peak.flops_per_s):.3g} TFLOP/s, {ran[0].peak.source})"
            axes.plot([r.size for r in ran], [r.mfu for r in ran], marker="o", label=label)
    axes.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axes.set_xscale("log", base=2)
    sizes = sorted({r.size for r in bench.results})
    axes.set_xticks(sizes, labels=[str(size) for size in sizes])
    axes.minorticks_off()
    axes.set_xlabel("matrix size (m = n = k)")
    axes.set_ylabel("MFU (achieved / peak FLOP/s)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"matmul MFU on {bench.device_name}")
    if axes.lines[1:]:  # the first line is the 1.0 guide
        axes.legend(fontsize="small")
    figure.savefig(path, format="png", dpi=120)
