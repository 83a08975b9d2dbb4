"""The peak lookup: the dense peak FLOP/s that MFU divides by, or why there is none.

Where each peak comes from:

    a GPU in the table        its datasheet figure (ledger/hardware/gpus.py)
    the CPU                   its spec or its best measured matmul (ledger/hardware/cpu.py)
    an unlisted GPU, or a     the best square matmul (ledger/hardware/matmul.py), measured once per process
    dtype its datasheet lacks
    a dtype the device        none: a NoPeakFlops says why
    cannot run (fp8 on a CPU)

Importing this module must not import torch.
The functions that need a device import it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmledger.ledger import precision_table
from lmledger.ledger.hardware.cpu import cpu_peak
from lmledger.ledger.hardware.gpus import PeakFlops, datasheet_peak, dtype_name, find_gpu
from lmledger.ledger.hardware.matmul import best_matmul_rate, unsupported_reason

if TYPE_CHECKING:
    import torch

__all__ = ["NoPeakFlops", "compute_dtype_for_precision", "peak_flops"]

_MEASURE_ROUNDS = 2  # ramps of matmuls for an unlisted GPU's peak, once per process


@dataclass(frozen=True)
class NoPeakFlops:
    """No peak for this dtype on this device; `reason` is the line users see."""

    reason: str


def compute_dtype_for_precision(precision: str | int) -> str:
    """The dtype a precision's matmuls run in: MFU uses its peak (ledger.precision_table).

    `peak_flops` turns "fp32" into tf32 on Ampere+, unless float32 matmul precision is "highest".
    """
    return precision_table.precision(precision).compute_dtype


def peak_flops(
    dtype: str | torch.dtype,
    device: str | torch.device | None = None,
    *,
    float32_matmul_precision: str | None = None,
) -> PeakFlops | NoPeakFlops:
    """The peak FLOP/s of `dtype` on `device` for MFU, or a NoPeakFlops where it cannot run.

    The module docstring says which source applies.
    `float32_matmul_precision` defaults to torch's setting; it decides fp32 vs tf32.
    """
    import torch

    dtype = dtype_name(dtype)
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    precision = float32_matmul_precision or torch.get_float32_matmul_precision()
    if device.type == "cuda":
        spec = find_gpu(torch.cuda.get_device_name(device))  # unknown is fine: we measure
        if spec is not None:
            peak = datasheet_peak(spec, dtype, float32_matmul_precision=precision)
            if peak is not None:
                return peak
        if dtype == "fp32" and precision != "highest" and torch.cuda.get_device_capability(device) >= (8, 0):
            dtype = "tf32"
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        return NoPeakFlops(f"no peak for {dtype} on {device}: {reason}")
    if device.type == "cpu":
        return cpu_peak(dtype)
    return _measured_peak(str(device), dtype)


@functools.cache
def _measured_peak(device: str, dtype: str) -> PeakFlops:
    rate = best_matmul_rate(device, dtype, _MEASURE_ROUNDS)
    return PeakFlops(rate, "measured", dtype, f"fastest square {dtype} matmul, best of {_MEASURE_ROUNDS}")


def _default_device() -> torch.device:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
