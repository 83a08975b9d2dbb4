"""What a device can do: dense peak FLOP/s per dtype, memory and bandwidth; name resolution; CPU peaks.

Units: FLOP/s (int8 rows are integer ops/s), bytes, bytes/s. Every peak is the DENSE datasheet figure:
NVIDIA and AMD print the "with sparsity" (2:4 structured) figure, twice the dense one, first and in bold
for Ampere/CDNA 3 and later; that figure is never reached by a training matmul, so it never appears here.

Memory is the datasheet's "GB" read as 1e9 bytes, as the CS336 lecture does ("80 GB" H100 -> 80e9). The
physical HBM is GiB-sized (an 80 GB H100 reports ~85e9 bytes to torch), so capacity planning with these
figures is slightly conservative.

Why our own table instead of Lightning's `lightning.fabric.utilities.throughput.get_available_flops`
(read in Lightning 2.6.6; canary test_lightning_resolves_no_peak_for_nvidia_h200): its H200 entries are
keyed "h200 sxm1" / "h200 nvl1", so plain "NVIDIA H200" (torch's name for it) maps to nothing; the H200
bf16/fp16 (2.0e15), tf32 (9.9e14) and int8 (4.0e15) figures are the sparse ones; its "h100 nvl" entry
lists 1978.8e12 bf16 (the dense figure is 835e12); "NVIDIA L40S" falls through its `"l4" in chip` test and
gets the L4's 121e12; there is no B200 and no fp8 column. This module also must not import Lightning.

The CPU's peak is a property of the machine, not of the moment: cores x clock x FLOP per cycle of the
widest FMA units its flags report (`cpu_spec_peak`, labelled "spec"). Where the OS does not report enough
for that (or on an unlisted GPU) the peak is measured: the best rate of square matmuls over several tries,
labelled "measured"; on a CPU that measurement is cached on disk per machine (`measured_cpu_peak`).

Importing this module must not import torch (`lmledger plan` and `gpus` answer without it): torch is
imported inside the functions that need a device.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmledger.atomic import DiskWriteError, atomic_write
from lmledger.errors import UserError
from lmledger.ledger import precisions
from lmledger.ledger.units import GB

if TYPE_CHECKING:
    import torch

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_T = 1e12
_P = 1e15


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
_CDNA3_PEAKS = _peaks(163.4 * _T, 163.4 * _T, 653.7 * _T, 1307.4 * _T, 1307.4 * _T, 2614.9 * _T, 2614.9 * _T)

GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        # NVIDIA A100 Tensor Core GPU datasheet: SXM and PCIe share the peak figures; bandwidth differs.
        GpuSpec("a100-40gb", "NVIDIA A100 SXM4 40GB", _A100_PEAKS, int(40 * GB), 1555 * GB),
        GpuSpec("a100-80gb", "NVIDIA A100 SXM4 80GB", _A100_PEAKS, int(80 * GB), 2039 * GB),
        GpuSpec("a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", _A100_PEAKS, int(40 * GB), 1555 * GB),
        GpuSpec("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", _A100_PEAKS, int(80 * GB), 1935 * GB),
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5, PCIe, NVL columns).
        GpuSpec("h100-sxm", "NVIDIA H100 SXM5 80GB", _HOPPER_SXM_PEAKS, int(80 * GB), 3.35 * _T),
        GpuSpec(
            "h100-pcie",
            "NVIDIA H100 PCIe 80GB",
            _peaks(51 * _T, 51 * _T, 378 * _T, 756 * _T, 756 * _T, 1513 * _T, 1513 * _T),
            int(80 * GB),
            2.0 * _T,
        ),
        GpuSpec("h100-nvl", "NVIDIA H100 NVL 94GB", _HOPPER_NVL_PEAKS, int(94 * GB), 3.9 * _T),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns): H100 compute, more and faster HBM3e.
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", _HOPPER_SXM_PEAKS, int(141 * GB), 4.8 * _T),
        GpuSpec("h200-nvl", "NVIDIA H200 NVL 141GB", _HOPPER_NVL_PEAKS, int(141 * GB), 4.8 * _T),
        # Blackwell, per GPU, from NVIDIA's current per-GPU tables ("Individual Blackwell GPU
        # Specifications" on the HGX B200 / GB200 NVL72 product pages, tensor figures "with sparsity",
        # halved here). B200 (HGX, 1000 W): fp64 37 TF, fp32 75 TF, tf32 2.2 PF/2, fp16/bf16 4.5 PF/2,
        # fp8 and int8 9 P/2, 180 GB at 7.7 TB/s. The launch material (GTC 2024) and most third-party pages
        # say 192 GB and 8 TB/s; the HGX B200 board sheet's 62 TB/s for 8 GPUs agrees with 7.7.
        GpuSpec(
            "b200",
            "NVIDIA B200 180GB",
            _peaks(37 * _T, 75 * _T, 1.1 * _P, 2.25 * _P, 2.25 * _P, 4.5 * _P, 4.5 * _P),
            int(180 * GB),
            7.7 * _T,
        ),
        # GB200 (the Grace Blackwell superchip's GPU, up to 1200 W), same NVIDIA table: fp64 40 TF, fp32
        # 80 TF, tf32 2.5 PF/2, fp16/bf16 5 PF/2, fp8 and int8 10 P/2, 186 GB at 8 TB/s.
        GpuSpec(
            "gb200",
            "NVIDIA GB200 186GB",
            _peaks(40 * _T, 80 * _T, 1.25 * _P, 2.5 * _P, 2.5 * _P, 5 * _P, 5 * _P),
            int(186 * GB),
            8 * _T,
        ),
        # Blackwell Ultra. NVIDIA HGX B300 sheet, 8 GPUs: fp64 10 TF, fp32 600 TF, tf32 18 PF*, fp16/bf16
        # 36 PF*, fp8 72 PF*, int8 2 POPS* (* with sparsity): per GPU dense fp64 1.25 TF, fp32 75 TF, tf32
        # 1.125 PF, bf16 2.25 PF, fp8 4.5 PF, int8 0.125 POPS (Blackwell Ultra all but drops int8 and fp64).
        # Memory: NVIDIA's per-GPU table gives 270 GB usable at 7.7 TB/s (the board sheet's "up to 2.3 TB"
        # / 8 is the 288 GB of the announcements).
        GpuSpec(
            "b300",
            "NVIDIA B300 SXM 270GB",
            _peaks(1.25 * _T, 75 * _T, 1.125 * _P, 2.25 * _P, 2.25 * _P, 4.5 * _P, 0.125 * _P),
            int(270 * GB),
            7.7 * _T,
        ),
        # GB300 (NVIDIA GB300 NVL72 page, 72 GPUs: fp16/bf16 360 PF*, fp8 720 PF*, tf32 180 PF*, int8
        # 23 POPS*, 20.1 TB HBM3e at 576 TB/s): per GPU dense bf16 2.5 PF, fp8 5 PF, tf32 1.25 PF, int8
        # 0.16 POPS, 279 GB, 8 TB/s; fp32 80 TF from NVIDIA's per-GPU table. The rack sheet's fp64 is not
        # split per GPU consistently between sources, so it is left out.
        GpuSpec(
            "gb300",
            "NVIDIA GB300 279GB",
            _peaks(None, 80 * _T, 1.25 * _P, 2.5 * _P, 2.5 * _P, 5 * _P, 0.16 * _P),
            int(279 * GB),
            8 * _T,
        ),
        # NVIDIA L4 Tensor Core GPU datasheet (no FP64 figure).
        GpuSpec(
            "l4",
            "NVIDIA L4 24GB",
            _peaks(None, 30.3 * _T, 60 * _T, 121 * _T, 121 * _T, 242.5 * _T, 242.5 * _T),
            int(24 * GB),
            300 * GB,
        ),
        # NVIDIA L40S datasheet (it prints dense and sparse side by side; no FP64 figure).
        GpuSpec(
            "l40s",
            "NVIDIA L40S 48GB",
            _peaks(None, 91.6 * _T, 183 * _T, 362.05 * _T, 362.05 * _T, 733 * _T, 733 * _T),
            int(48 * GB),
            864 * GB,
        ),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column. Tensor figures are the ones
        # with FP32 accumulate (what training GEMMs use; GeForce runs them at half the FP16-accumulate rate).
        GpuSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090 24GB",
            _peaks(None, 82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T, 330.3 * _T, 660.6 * _T),
            int(24 * GB),
            1008 * GB,
        ),
        # NVIDIA A10 Tensor Core GPU datasheet: fp32 31.2 TF, tf32 62.5 TF, bf16/fp16 125 TF, int8 250 TOPS
        # (dense; the sheet prints the sparse 125/250/500 beside them), 24 GB GDDR6 at 600 GB/s.
        GpuSpec(
            "a10",
            "NVIDIA A10 24GB",
            _peaks(None, 31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T, None, 250 * _T),
            int(24 * GB),
            600 * GB,
        ),
        # The A10G is AWS's variant of the A10 and has no NVIDIA datasheet of its own; these are the
        # A10 datasheet's figures (as Lightning also uses), so treat A10G MFU as a lower bound.
        GpuSpec(
            "a10g",
            "NVIDIA A10G 24GB",
            _peaks(None, 31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T, None, 250 * _T),
            int(24 * GB),
            600 * GB,
        ),
        # NVIDIA Tesla V100 datasheet (SXM2 and PCIe columns). Volta has no sparsity, tf32 or bf16.
        GpuSpec("v100", "NVIDIA Tesla V100 SXM2 16GB", _V100_SXM2_PEAKS, int(16 * GB), 900 * GB),
        GpuSpec("v100-32gb", "NVIDIA Tesla V100 SXM2 32GB", _V100_SXM2_PEAKS, int(32 * GB), 900 * GB),
        GpuSpec("v100-pcie", "NVIDIA Tesla V100 PCIe 16GB", _V100_PCIE_PEAKS, int(16 * GB), 900 * GB),
        GpuSpec("v100-pcie-32gb", "NVIDIA Tesla V100 PCIe 32GB", _V100_PCIE_PEAKS, int(32 * GB), 900 * GB),
        # NVIDIA T4 Tensor Core GPU datasheet (fp16 is "mixed precision FP16/FP32"; no FP64 figure).
        GpuSpec(
            "t4",
            "NVIDIA Tesla T4 16GB",
            _peaks(None, 8.1 * _T, None, None, 65 * _T, None, 130 * _T),
            int(16 * GB),
            320 * GB,
        ),
        # AMD Instinct MI300X data sheet (CDNA 3): fp64 matrix 163.4 TF, fp32 matrix 163.4 TF, tf32 653.7 TF,
        # fp16/bf16 1307.4 TF, fp8 2614.9 TF, int8 2614.9 TOPS (dense; the sheet prints sparse figures 2x
        # beside them), 192 GB HBM3 at 5.3 TB/s. ROCm torch reports it as "AMD Instinct MI300X".
        GpuSpec("mi300x", "AMD Instinct MI300X 192GB", _CDNA3_PEAKS, int(192 * GB), 5.3 * _T),
        # AMD Instinct MI325X data sheet: the MI300X's compute, 256 GB HBM3E at 6 TB/s.
        GpuSpec("mi325x", "AMD Instinct MI325X 256GB", _CDNA3_PEAKS, int(256 * GB), 6.0 * _T),
    )
}


# ---------------------------------------------------------------------------------------------------
# Name resolution: a key ("h100-sxm", "H100 SXM") or what torch.cuda.get_device_name() reports
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA GeForce RTX 4090", ...).

# AMD's "Instinct" is a brand word like NVIDIA's "Tesla"; ROCm torch reports e.g. "AMD Instinct MI300X".
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "amd", "instinct"}
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
# Parts sold in one form, with the words their device names may carry besides the model: "NVIDIA B300
# SXM6 AC"; ROCm's "VF" marks an SR-IOV virtual function of the same GPU (cloud VMs). Memory words are
# ignored for these.
_SINGLE_KEYS: dict[str, set[str]] = {
    "b200": {"sxm", "sxm6"},
    "gb200": set(),
    "b300": {"sxm", "sxm6", "ac"},
    "gb300": set(),
    "l4": set(),
    "l40s": set(),
    "a10": set(),
    "a10g": set(),
    "t4": set(),
    "mi300x": {"vf", "oam"},
    "mi325x": {"vf", "oam"},
}


def _words(name: str) -> list[str]:
    words = [w for w in re.split(r"[\s\-_/]+", name.strip().lower()) if w]
    return [w for w in words if w not in _VENDOR_WORDS]


def _size_word(key: str) -> str:
    return f"{round(GPUS[key].memory_bytes / GB)}gb"


def _candidates(words: list[str]) -> list[str]:
    """The keys a name can mean: one (resolved), several (ambiguous) or none (unknown)."""
    if not words:
        return []
    if "-".join(words) in GPUS:
        return ["-".join(words)]
    model, qualifiers = words[0], set(words[1:])
    sizes = {w for w in qualifiers if _MEMORY_WORD.fullmatch(w)}
    other = qualifiers - sizes
    pcie = "pcie" in qualifiers
    if model == "h100":
        if "nvl" in other:
            return ["h100-nvl"]
        if pcie or "hbm2e" in other:
            return ["h100-pcie"]
        if other & {"sxm", "sxm5", "hbm3"}:
            return ["h100-sxm"]
        if other:
            return []
        # Plain "H100": the form factor decides the peak (SXM and PCIe differ by 30%), so do not guess.
        return [k for k in ("h100-sxm", "h100-pcie", "h100-nvl") if not sizes or _size_word(k) in sizes]
    if model == "h200":
        return ["h200-nvl" if "nvl" in qualifiers else "h200"]
    if model in ("a100", "v100"):
        # Memory decides capacity and bandwidth; torch's names always carry it, so a name without it is
        # ambiguous. A name that does not say PCIe is the SXM part, as torch's names are.
        return [
            key
            for (part, is_pcie, size), key in _SIZED_KEYS.items()
            if part == model and is_pcie == pcie and (len(sizes) != 1 or size in sizes)
        ]
    if model == "rtx" and words[1:] == ["4090"]:
        return ["rtx-4090"]
    if model in _SINGLE_KEYS and other <= _SINGLE_KEYS[model]:
        return [model]
    return []


def resolve(name: str) -> GpuSpec | None:
    """The spec for a key or a torch device name; warns and returns None for a name we do not know
    or one that matches several entries."""
    keys = _candidates(_words(name))
    if len(keys) == 1:
        return GPUS[keys[0]]
    if keys:
        message = f"GPU name {name!r} is ambiguous: matches {', '.join(keys)}; pass one of these keys"
    else:
        message = f"no datasheet entry for GPU {name!r}; known keys: {', '.join(GPUS)}"
    warnings.warn(f"{message} (peaks will be measured)", stacklevel=2)
    return None


def require_gpu(name: str) -> GpuSpec:
    """`resolve` for user input: an unknown or ambiguous name is a UserError instead of a warning."""
    keys = _candidates(_words(name))
    if len(keys) == 1:
        return GPUS[keys[0]]
    if keys:
        raise UserError(f"GPU name {name!r} is ambiguous: matches {', '.join(keys)}; pass one of these keys")
    raise UserError(f"unknown GPU {name!r}: use a key from `lmledger gpus` ({', '.join(GPUS)})")


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


def compute_dtype_for_precision(precision: str | int) -> str:
    """The dtype a Lightning precision's matmuls run in, whose peak MFU is measured against (ledger.precisions).
    "fp32" becomes tf32 in `peak_flops` on Ampere+ unless the float32 matmul precision is "highest"."""
    return precisions.precision(precision).compute_dtype


# ---------------------------------------------------------------------------------------------------
# Peaks: datasheet for known GPUs, the CPU's own specifications, measured otherwise


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # "datasheet:<key>", "spec" (the CPU's cores x clock x FLOP/cycle) or "measured"
    dtype: str  # the dtype whose peak this is (after the tf32 rule)
    detail: str = ""  # how a spec or measured peak was obtained, for the ledger's peak line


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

    CUDA device listed in GPUS: the datasheet figure. CPU: `cpu_peak`, its specification
    (`cpu_spec_peak`) or, where the OS reports too little or a matmul beats it, a measurement cached on
    disk per machine (`measured_cpu_peak`). An unlisted GPU, or a listed one whose
    datasheet gives no figure for the dtype: a measured peak (cached per device and dtype in this
    process). None (with a warning) where the dtype cannot run on the device at all, e.g. fp8 on a CPU.
    `float32_matmul_precision` defaults to torch's current setting (it decides fp32 vs tf32).
    """
    import torch

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
    if device.type == "cpu":
        return cpu_peak(dtype)
    return _measured_peak(str(device), dtype)


def cpu_peak(dtype: str) -> Peak:
    """The CPU's peak for `dtype`: its spec (cores x clock x FLOP/cycle), unless this machine's own best
    matmul (measured once and cached, `measured_cpu_peak`) beats it, and then that measurement. A peak a
    matmul beats is no peak: a VM's /proc/cpuinfo gives the nominal clock, not the turbo the cores run at
    (2026-12-01, this 2-core Xeon VM: spec 282 GFLOP/s at the reported 2.2 GHz, a square fp32 matmul 390)."""
    spec = cpu_spec_peak(dtype)
    measured = measured_cpu_peak(dtype)
    if spec is not None and spec.flops_per_s >= measured.flops_per_s:
        return spec
    if spec is None:
        return measured
    detail = (
        f"{measured.detail}; above the {spec.flops_per_s / 1e9:.4g} GFLOP/s of the {spec.detail}, so the "
        "OS reports a clock below the one the cores run at"
    )
    return Peak(measured.flops_per_s, "measured", dtype, detail)


def _default_device() -> torch.device:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# The CPU's peak from what the OS reports about it


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo "model name" (or the platform's processor string)
    machine: str  # platform.machine(): x86_64, aarch64, ...
    cores: int  # physical cores this process may run on (affinity mask, capped by a cgroup CPU quota)
    logical_cpus: int  # CPUs in the affinity mask (hyperthreads count twice)
    ghz: float | None  # the highest clock the OS reports; None if it reports none
    clock_source: str  # "cpufreq max" or "cpuinfo MHz"
    flags: frozenset[str]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpuinfo_blocks(text: str) -> dict[int, dict[str, str]]:
    """/proc/cpuinfo as {processor number: {field: value}}."""
    blocks = {}
    for chunk in text.split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            name, sep, value = line.partition(":")
            if sep:
                fields[name.strip()] = value.strip()
        if fields.get("processor", "").isdigit():
            blocks[int(fields["processor"])] = fields
    return blocks


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs a cgroup CPU quota allows (container --cpus), None without a quota."""
    text = _read("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
    if text:
        quota, _, period = text.strip().partition(" ")
    else:  # cgroup v1
        quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        quota_us, period_us = int(str(quota).strip()), int(str(period).strip())
    except ValueError:
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None


@functools.cache
def cpu_info() -> CpuInfo:
    """What the OS reports about the CPUs this process may run on (Linux; elsewhere mostly unknown)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    blocks = _cpuinfo_blocks(_read("/proc/cpuinfo") or "")
    mine = [blocks[cpu] for cpu in allowed if cpu in blocks]
    first = mine[0] if mine else {}
    model = first.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())
    # Hyperthreads share their core's FMA units: count (package, core) pairs, not logical CPUs.
    pairs = set()
    for cpu in allowed:
        block = blocks.get(cpu, {})
        core = block.get("core id") or _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        package = block.get("physical id") or _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        pairs.add((str(package).strip(), str(core).strip()) if core is not None else ("cpu", str(cpu)))
    cores = len(pairs) or len(allowed)
    limit = _cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, limit)
    # The clock: cpufreq's maximum (turbo included: a peak is an upper bound); in VMs without cpufreq,
    # the "cpu MHz" the hypervisor reports (the nominal clock, constant there).
    max_khz = [_read(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq") for cpu in allowed]
    max_khz = [int(k) for k in max_khz if k and k.strip().isdigit()]
    mhz = [float(b["cpu MHz"]) for b in mine if re.fullmatch(r"[0-9.]+", b.get("cpu MHz", ""))]
    if max_khz:
        ghz, clock_source = max(max_khz) / 1e6, "cpufreq max"
    elif mhz:
        ghz, clock_source = max(mhz) / 1e3, "cpuinfo MHz"
    else:
        ghz, clock_source = None, ""
    return CpuInfo(model, platform.machine().lower(), cores, len(allowed), ghz, clock_source, flags)


# FP32 FLOP per cycle per core: (flags needed, FLOP/cycle, what). x86 cores issue two FMA per cycle on
# their widest vectors (Intel since Haswell for 256-bit and Skylake-SP Gold/Platinum for 512-bit, AMD
# since Zen 2 for 256-bit; Intel's optimization manual, AMD's software optimization guides); an FMA is
# 2 FLOP per lane: AVX-512 2 x 16 x 2 = 64, AVX2 2 x 8 x 2 = 32; AVX without FMA issues one 8-wide add
# and one 8-wide multiply (16), SSE2 4 + 4 (8). Parts with a single 512-bit pipe (Xeon Bronze/Silver,
# Zen 4's 2 x 256) reach half, so the spec is an upper bound, as a peak should be.
_X86_FP32 = (
    ({"avx512f"}, 64, "AVX-512, 2 FMA pipes"),
    ({"avx2", "fma"}, 32, "AVX2, 2 FMA pipes"),
    ({"avx"}, 16, "AVX add + mul"),
    ({"sse2"}, 8, "SSE2 add + mul"),
)
# aarch64: 128-bit NEON FMA, 4 fp32 lanes x 2 FLOP x 4 pipes (Arm Neoverse V1/V2, e.g. Grace) = 32; an
# upper bound on 2-pipe cores (Neoverse N1, Cortex-A72).
_ARM_FP32 = 32
# Matrix units: Intel AMX's TMUL does 1024 BF16 (AMX-BF16, Sapphire Rapids on) or FP16 (AMX-FP16,
# Granite Rapids) operations per cycle per core (Intel, "Accelerate AI Workloads with Intel AMX").
# AVX512-BF16's VDPBF16PS and AVX512-FP16's VFMADDPH work on 32 16-bit lanes: 2 pipes x 32 x 2 = 128.
_AMX_FLOP_PER_CYCLE = 1024
_AVX512_16BIT_FLOP_PER_CYCLE = 128


def _flop_per_cycle(info: CpuInfo, dtype: str) -> tuple[int, str] | None:
    """Peak FLOP per cycle per core for `dtype` matmuls on this CPU, and what it rests on."""
    flags = info.flags
    if info.machine in ("x86_64", "amd64", "i386", "i686"):
        fp32 = next(((flop, what) for need, flop, what in _X86_FP32 if need <= flags), None)
    elif info.machine in ("aarch64", "arm64") and "asimd" in flags:
        fp32 = (_ARM_FP32, "NEON, 4 FMA pipes")
    else:
        fp32 = None
    if fp32 is None:
        return None
    if dtype == "fp32":
        return fp32
    if dtype == "fp64":
        return fp32[0] // 2, f"{fp32[1]}, half the fp32 lanes"
    if dtype in ("bf16", "fp16"):
        amx, avx512 = ("amx_bf16", "avx512_bf16") if dtype == "bf16" else ("amx_fp16", "avx512_fp16")
        if amx in flags:
            return _AMX_FLOP_PER_CYCLE, amx.upper().replace("_", "-")
        if avx512 in flags:
            return _AVX512_16BIT_FLOP_PER_CYCLE, f"{avx512.upper().replace('_', '-')}, 2 pipes"
        return fp32[0], f"{fp32[1]}; no native {dtype}, so converted and multiplied as fp32"
    return None  # tf32, fp8, int8: no CPU matmul peak


def cpu_spec_peak(dtype: str, info: CpuInfo | None = None) -> Peak | None:
    """cores x clock x FLOP/cycle for `dtype`: the CPU's peak from its own specifications, or None where
    the OS does not report the clock or the CPU's vector units are not known here."""
    dtype = dtype_name(dtype)
    info = info or cpu_info()
    per_cycle = _flop_per_cycle(info, dtype)
    if info.ghz is None or per_cycle is None:
        return None
    flop, what = per_cycle
    detail = (
        f"spec: {info.cores} core{'s' if info.cores != 1 else ''} x {info.ghz:.3g} GHz ({info.clock_source}) "
        f"x {flop} FLOP/cycle ({what})"
    )
    return Peak(info.cores * info.ghz * 1e9 * flop, "spec", dtype, detail)


# A measured peak is the best rate over a ramp of square matmuls, doubling from 64 until one call
# takes this long (or the size cap), but never stopping below _MEASURE_MIN_SIZE: on a busy machine a
# small matmul can lose its time slice and look slow. Small sizes can win on a CPU (bf16 without
# native support runs a cache-friendlier path at 64-128 than at 512, and a toy model's matmuls are
# that small), large ones win on a GPU. Each size keeps its fastest repeat and the ramp runs several
# times: a peak is a best case, and a shared machine only ever makes calls slower.
_MEASURE_TARGET_S = {"cpu": 0.02, "cuda": 0.005}
_MEASURE_MIN_SIZE = {"cpu": 512, "cuda": 4096}
_MEASURE_MAX_SIZE = {"cpu": 2048, "cuda": 8192}
_MEASURE_ROUNDS = 2  # an unlisted GPU, once per process
CPU_MEASURE_TRIES = 5  # the CPU, once per machine (cached on disk)


def _best_matmul_rate(device: str, dtype: str, rounds: int) -> float:
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


@functools.cache
def _measured_peak(device: str, dtype: str) -> Peak:
    rate = _best_matmul_rate(device, dtype, _MEASURE_ROUNDS)
    return Peak(rate, "measured", dtype, f"fastest square {dtype} matmul, best of {_MEASURE_ROUNDS}")


def cache_dir() -> Path:
    """Where lmledger keeps per-machine measurements: $LMLEDGER_CACHE_DIR, else $XDG_CACHE_HOME/lmledger,
    else ~/.cache/lmledger."""
    if os.environ.get("LMLEDGER_CACHE_DIR"):
        return Path(os.environ["LMLEDGER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmledger"


CPU_PEAKS_FILE = "cpu-peaks.json"


def _cpu_cache_key(dtype: str) -> str:
    import torch

    info = cpu_info()
    threads = torch.get_num_threads()
    return f"{info.model} | {info.logical_cpus} cpus | torch {torch.__version__} | {threads} threads | {dtype}"


def _load_cpu_peaks(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"ignoring unreadable CPU peak cache {path} ({err}); measuring again", stacklevel=3)
        return {}
    return entries if isinstance(entries, dict) else {}


def _save_cpu_peaks(path: Path, entries: dict) -> None:
    try:
        atomic_write(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
    except DiskWriteError as err:
        warnings.warn(f"could not cache the measured CPU peak ({err})", stacklevel=3)


def measured_cpu_peak(dtype: str, *, tries: int = CPU_MEASURE_TRIES, refresh: bool = False) -> Peak:
    """The best rate of square `dtype` matmuls on this CPU over `tries` ramps, measured once per machine
    (CPU model, CPU count, torch version, torch threads) and cached in cache_dir()/cpu-peaks.json with
    when and how; `refresh` measures again."""
    dtype = dtype_name(dtype)
    path = cache_dir() / CPU_PEAKS_FILE
    entries = _load_cpu_peaks(path)
    key = _cpu_cache_key(dtype)
    entry = entries.get(key)
    valid = isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)) and entry["flops_per_s"] > 0
    if refresh or not valid:
        entry = {
            "flops_per_s": _best_matmul_rate("cpu", dtype, tries),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tries": tries,
            "method": "best rate of square matmuls, sizes 64 to 2048 doubling, fastest of 5 repeats each",
        }
        entries[key] = entry
        _save_cpu_peaks(path, entries)
    detail = f"measured {str(entry.get('measured_at', '?'))[:10]}, best of {entry.get('tries', '?')} (cache: {path})"
    return Peak(float(entry["flops_per_s"]), "measured", dtype, detail)


# ---------------------------------------------------------------------------------------------------
# Timing one matmul (shared with lmledger.bench)


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
    """Why a `dtype` matmul cannot be timed on `device`, or None if it can."""
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


# Enough operand pairs to rotate through that the next call's inputs are not still in cache (H100/H200
# L2 is 50 MB; a server CPU's L3 is tens of MB), capped so tiny sizes do not allocate hundreds of pairs.
_ROTATE_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
_MAX_BUFFERS = 16


def _make_operands(dtype: str, size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    torch_dtype = _torch_dtype(dtype)
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
    import torch

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
    import torch

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
