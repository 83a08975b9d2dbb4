"""The GPU table: dense peak FLOP/s per dtype, memory and bandwidth per part; name resolution.

Units: FLOP/s (int8 rows are integer ops/s), bytes, bytes/s. Every peak is the DENSE datasheet figure.
Since Ampere and CDNA 3, NVIDIA and AMD print the sparse figure first, in bold. That is "with
sparsity" (2:4 structured), twice the dense one. No training matmul reaches it, so it never appears
here.

Memory is the datasheet's "GB" read as 1e9 bytes, as the CS336 lecture does ("80 GB" H100 -> 80e9).
Physical HBM is GiB-sized: an 80 GB H100 reports ~85e9 bytes to torch. Planning with these figures is
slightly conservative.

Why not Lightning's `lightning.fabric.utilities.throughput.get_available_flops`? We read it in
Lightning 2.6.6 (canary test_lightning_resolves_no_peak_for_nvidia_h200). Its H200 keys are
"h200 sxm1" / "h200 nvl1". So "NVIDIA H200", torch's name, maps to nothing. Its H200 bf16/fp16
(2.0e15), tf32 (9.9e14) and int8 (4.0e15) figures are the sparse ones. Its "h100 nvl" lists
1978.8e12 bf16; the dense figure is 835e12. The L40S falls through its `"l4" in chip` test. It gets
the L4's 121e12. It has no B200 and no fp8 column. And this module must not import Lightning.

Also here: DTYPES and dtype_name, the dtype names peaks are keyed by. And PeakFlops, the value every peak
source gives. The sources are this table and the CPU's spec and measurements (ledger/hardware/cpu.py). The
lookup is ledger/hardware/peak_flops.py. Importing this module must not import torch. `lmledger plan` and
`gpus` answer without it.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmledger.errors import UserError
from lmledger.ledger.units import GB

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "GPUS",
    "GpuSpec",
    "PeakFlops",
    "datasheet_peak",
    "dtype_name",
    "find_gpu",
    "require_gpu",
    "resolve",
]

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_T = 1e12
_P = 1e15


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    # Dense peak per dtype in FLOP/s (ops/s for int8). None where the datasheet gives no figure: the chip
    # lacks the dtype (bf16 on Volta, fp8 before Ada) or runs it at a negligible rate.
    peak_flops: Mapping[str, float | None]
    memory_bytes: int
    bandwidth_bytes_per_s: float
    # The chip the GPU op-time model prices kernels on (ledger/timing/gpu): streaming multiprocessors (AMD: compute
    # units), last-level cache, and the architecture its efficiency figures are keyed by. Set from _CHIPS below.
    sms: int | None = None
    l2_bytes: int | None = None
    arch: str | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "key": self.key,
            "peak_flops": {dtype: self.peak_flops[dtype] for dtype in DTYPES},
            "memory_bytes": self.memory_bytes,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "sms": self.sms,
            "l2_bytes": self.l2_bytes,
            "arch": self.arch,
        }


def _peaks(fp64, fp32, tf32, bf16, fp16, fp8, int8) -> dict[str, float | None]:
    return dict(zip(DTYPES, (fp64, fp32, tf32, bf16, fp16, fp8, int8), strict=True))


# fp64 is the FP64 Tensor Core figure where the chip has one (A100, H100, H200, B200). A float64 matmul
# (cuBLAS DGEMM) runs there; vector FP64 is half of it on those chips.
# Hopper/Ampere/Ada/Blackwell datasheets print tf32, bf16, fp16, fp8 and int8 "with sparsity": 2x the
# dense figures used here.
_A100_PEAKS = _peaks(19.5 * _T, 19.5 * _T, 156 * _T, 312 * _T, 312 * _T, None, 624 * _T)
_HOPPER_SXM_PEAKS = _peaks(67 * _T, 67 * _T, 494.7 * _T, 989.4 * _T, 989.4 * _T, 1978.9 * _T, 1978.9 * _T)
# The NVL parts (dual-slot PCIe, 350-400 W): the H100 NVL and H200 NVL datasheets agree.
_HOPPER_NVL_PEAKS = _peaks(60 * _T, 60 * _T, 417.5 * _T, 835 * _T, 835 * _T, 1670 * _T, 1670 * _T)
_HOPPER_500W_PEAKS = {
    dtype: nvl + (sxm - nvl) * (500 - 400) / (700 - 400)
    for (dtype, sxm), nvl in zip(_HOPPER_SXM_PEAKS.items(), _HOPPER_NVL_PEAKS.values(), strict=True)
}
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
        # Meta's Grand Teton H100: the SXM5 die with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit
        # (torchtitan docs/performance.md). No datasheet: "the actual peak TFLOPs should be between SXM and NVL, and we
        # don't know the exact value" (torchtitan, arXiv 2410.06511). Taken on the line between the NVL's peaks at
        # 400 W and the SXM's at 700 W, a third of the way: throughput in proportion to the power limit between them.
        GpuSpec("h100-sxm-500w", "NVIDIA H100 SXM5 96GB HBM2e at 500 W", _HOPPER_500W_PEAKS, int(96 * GB), 2.4 * _T),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns): H100 compute, more and faster HBM3e.
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", _HOPPER_SXM_PEAKS, int(141 * GB), 4.8 * _T),
        GpuSpec("h200-nvl", "NVIDIA H200 NVL 141GB", _HOPPER_NVL_PEAKS, int(141 * GB), 4.8 * _T),
        # Blackwell per GPU: NVIDIA's "Individual Blackwell GPU Specifications" tables on the HGX B200 /
        # GB200 NVL72 pages. Their tensor figures are "with sparsity", halved here.
        # B200 (HGX, 1000 W): fp64 37 TF, fp32 75 TF, tf32 2.2 PF/2, fp16/bf16 4.5 PF/2, fp8 and int8
        # 9 P/2, 180 GB at 7.7 TB/s. GTC 2024 and most third-party pages say 192 GB and 8 TB/s. The HGX
        # B200 board sheet's 62 TB/s for 8 GPUs agrees with 7.7.
        GpuSpec(
            "b200",
            "NVIDIA B200 180GB",
            _peaks(37 * _T, 75 * _T, 1.1 * _P, 2.25 * _P, 2.25 * _P, 4.5 * _P, 4.5 * _P),
            int(180 * GB),
            7.7 * _T,
        ),
        # GB200 (Grace Blackwell's GPU, up to 1200 W), same table: fp64 40 TF, fp32 80 TF, tf32 2.5 PF/2,
        # fp16/bf16 5 PF/2, fp8 and int8 10 P/2, 186 GB at 8 TB/s.
        GpuSpec(
            "gb200",
            "NVIDIA GB200 186GB",
            _peaks(40 * _T, 80 * _T, 1.25 * _P, 2.5 * _P, 2.5 * _P, 5 * _P, 5 * _P),
            int(186 * GB),
            8 * _T,
        ),
        # Blackwell Ultra. NVIDIA HGX B300 sheet, 8 GPUs: fp64 10 TF, fp32 600 TF, tf32 18 PF*, fp16/bf16
        # 36 PF*, fp8 72 PF*, int8 2 POPS* (* with sparsity). Per GPU, dense: fp64 1.25 TF, fp32 75 TF,
        # tf32 1.125 PF, bf16 2.25 PF, fp8 4.5 PF, int8 0.125 POPS. Blackwell Ultra all but drops int8 and
        # fp64. Memory: NVIDIA's per-GPU table gives 270 GB usable at 7.7 TB/s. The board sheet's "up to
        # 2.3 TB" / 8 is the 288 GB of the announcements.
        GpuSpec(
            "b300",
            "NVIDIA B300 SXM 270GB",
            _peaks(1.25 * _T, 75 * _T, 1.125 * _P, 2.25 * _P, 2.25 * _P, 4.5 * _P, 0.125 * _P),
            int(270 * GB),
            7.7 * _T,
        ),
        # GB300. NVIDIA GB300 NVL72 page, 72 GPUs: fp16/bf16 360 PF*, fp8 720 PF*, tf32 180 PF*, int8
        # 23 POPS*, 20.1 TB HBM3e at 576 TB/s. Per GPU, dense: bf16 2.5 PF, fp8 5 PF, tf32 1.25 PF, int8
        # 0.16 POPS, 279 GB, 8 TB/s. fp32 80 TF is from NVIDIA's per-GPU table. Sources split the rack's
        # fp64 per GPU inconsistently, so it is left out.
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
        # NVIDIA L40S datasheet (dense and sparse side by side; no FP64 figure).
        GpuSpec(
            "l40s",
            "NVIDIA L40S 48GB",
            _peaks(None, 91.6 * _T, 183 * _T, 362.05 * _T, 362.05 * _T, 733 * _T, 733 * _T),
            int(48 * GB),
            864 * GB,
        ),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column. Tensor figures are with FP32
        # accumulate, as training GEMMs use. GeForce runs them at half the FP16-accumulate rate.
        GpuSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090 24GB",
            _peaks(None, 82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T, 330.3 * _T, 660.6 * _T),
            int(24 * GB),
            1008 * GB,
        ),
        # NVIDIA A10 Tensor Core GPU datasheet: fp32 31.2 TF, tf32 62.5 TF, bf16/fp16 125 TF, int8 250 TOPS
        # (dense; the sparse 125/250/500 sit beside them), 24 GB GDDR6 at 600 GB/s.
        GpuSpec(
            "a10",
            "NVIDIA A10 24GB",
            _peaks(None, 31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T, None, 250 * _T),
            int(24 * GB),
            600 * GB,
        ),
        # The A10G is AWS's A10 variant, with no NVIDIA datasheet of its own. These are the A10's figures
        # (Lightning uses them too), so treat A10G MFU as a lower bound.
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
        # fp16/bf16 1307.4 TF, fp8 2614.9 TF, int8 2614.9 TOPS (dense; sparse 2x beside them), 192 GB HBM3
        # at 5.3 TB/s. ROCm torch reports it as "AMD Instinct MI300X".
        GpuSpec("mi300x", "AMD Instinct MI300X 192GB", _CDNA3_PEAKS, int(192 * GB), 5.3 * _T),
        # AMD Instinct MI325X data sheet: the MI300X's compute, 256 GB HBM3E at 6 TB/s.
        GpuSpec("mi325x", "AMD Instinct MI325X 256GB", _CDNA3_PEAKS, int(256 * GB), 6.0 * _T),
    )
}


_MB = 1 << 20
# Key prefix -> (SMs, L2 bytes, architecture), the first prefix that matches. Each vendor's architecture whitepaper:
# NVIDIA A100 (GA100): 108 SMs, 40 MB L2. H100 (GH100): 132 SMs on SXM5 and NVL, 114 on PCIe, 50 MB L2. H200: the
# same die with 132 SMs; torch reported 60 MB of L2 on one (this workplace's H200, 2026-10-28). B200: 148 SMs
# (Blackwell whitepaper; its L2 is not stated there; GB200 and Blackwell Ultra are left out, their SM counts not
# found in a primary source). L4 (AD104) 58 SMs, 48 MB; L40S (AD102) 142 SMs, 96 MB; RTX 4090
# 128 SMs, 72 MB (Ada whitepaper). A10/A10G (GA102) 72 SMs, 6 MB. V100 80 SMs, 6 MB. T4 40 SMs, 4 MB. MI300X and
# MI325X: 304 compute units, 256 MB Infinity Cache (AMD CDNA 3 whitepaper).
_CHIPS = (
    ("a100", 108, 40 * _MB, "ampere"), ("h100-pcie", 114, 50 * _MB, "hopper"), ("h100", 132, 50 * _MB, "hopper"),
    ("h200", 132, 60 * _MB, "hopper"), ("b200", 148, None, "blackwell"), ("l40s", 142, 96 * _MB, "ada"),
    ("l4", 58, 48 * _MB, "ada"), ("rtx-4090", 128, 72 * _MB, "ada"), ("a10", 72, 6 * _MB, "ampere"),
    ("v100", 80, 6 * _MB, "volta"), ("t4", 40, 4 * _MB, "turing"), ("mi3", 304, 256 * _MB, "cdna3"),
)  # fmt: skip


def _with_chip(spec: GpuSpec) -> GpuSpec:
    found = next((row for row in _CHIPS if spec.key.startswith(row[0])), None)
    return spec if found is None else dataclasses.replace(spec, sms=found[1], l2_bytes=found[2], arch=found[3])


GPUS = {key: _with_chip(spec) for key, spec in GPUS.items()}


# ---------------------------------------------------------------------------------------------------
# Name resolution: a key ("h100-sxm", "H100 SXM") or what torch.cuda.get_device_name() reports
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA GeForce RTX 4090", ...).

# AMD's "Instinct" is a brand word like NVIDIA's "Tesla" (ROCm torch: "AMD Instinct MI300X").
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
# Parts sold in one form, and the extra words their device names may carry ("NVIDIA B300 SXM6 AC").
# ROCm's "VF" marks an SR-IOV virtual function of the same GPU (cloud VMs). Memory words are ignored.
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
        # Plain "H100": the form factor sets the peak (SXM and PCIe differ by 30%). Do not guess.
        return [k for k in ("h100-sxm", "h100-pcie", "h100-nvl") if not sizes or _size_word(k) in sizes]
    if model == "h200":
        return ["h200-nvl" if "nvl" in qualifiers else "h200"]
    if model in ("a100", "v100"):
        # Memory sets capacity and bandwidth. torch's names always carry it: a name without it is
        # ambiguous. A name that does not say PCIe is the SXM part, as in torch's names.
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


def find_gpu(name: str) -> GpuSpec | None:
    """The spec for a key or torch device name; None, quietly, if unknown or ambiguous."""
    keys = _candidates(_words(name))
    return GPUS[keys[0]] if len(keys) == 1 else None


def resolve(name: str) -> GpuSpec | None:
    """`find_gpu`, warning for an unknown or ambiguous name."""
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
    """`resolve` for user input: an unknown or ambiguous name is a UserError."""
    keys = _candidates(_words(name))
    if len(keys) == 1:
        return GPUS[keys[0]]
    if keys:
        raise UserError(f"GPU name {name!r} is ambiguous: matches {', '.join(keys)}; pass one of these keys")
    raise UserError(f"unknown GPU {name!r}: use a key from `lmledger gpus` ({', '.join(GPUS)})")


# ---------------------------------------------------------------------------------------------------
# dtype names

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


# ---------------------------------------------------------------------------------------------------
# PeakFlops: one dense peak FLOP/s and where it came from. The datasheet's:


@dataclass(frozen=True)
class PeakFlops:
    flops_per_s: float
    source: str  # "datasheet:<key>", "spec" (the CPU's cores x clock x FLOP/cycle) or "measured"
    dtype: str  # the dtype whose peak this is (after the tf32 rule)
    detail: str = ""  # how a spec or measured peak was obtained, for the ledger's peak line


def datasheet_peak(
    spec: GpuSpec, dtype: str | torch.dtype, *, float32_matmul_precision: str = "highest"
) -> PeakFlops | None:
    """The table's peak for `dtype` on `spec`; None where the datasheet has none.

    On Ampere and later, fp32 matmuls run as tf32, unless float32 matmul precision is "highest".
    The peak for "fp32" is then the tf32 one.
    """
    dtype = dtype_name(dtype)
    if dtype == "fp32" and float32_matmul_precision != "highest" and spec.peak_flops["tf32"] is not None:
        dtype = "tf32"
    flops = spec.peak_flops[dtype]
    return None if flops is None else PeakFlops(flops, f"datasheet:{spec.key}", dtype)
