"""Shape advice: the matmul dimensions of a step that miss the multiples a GPU's tensor cores want.

NVIDIA, "Matrix Multiplication Background User's Guide", Table 1 (Tensor Core requirements). With
cuBLAS >= 11.0 any size runs on tensor cores. They run best when M, N and K are multiples of 16 bytes
of elements (fp16/bf16 8, tf32 4, int8 16). On A100, of 128 bytes (fp16/bf16 64, tf32 32, int8 128).
The guide names A100. We hold Hopper and Blackwell data-centre parts (H100, H200, B200) to the same
128 bytes: their MMA tiles are no smaller. With fp8 (Transformer Engine or torch._scaled_mm) every
dimension must divide by 16. The nanoGPT code (model.py, train.py) pads GPT-2's vocabulary of 50257
to 50304, a multiple of 64. It reports ~25% faster training.

`shape_advice(ops, gpu)` reads the dry run's matmul ops (ledger/count/ops.py) and finds each GEMM's M, K
and N. It returns one Advice per dimension value that misses the multiple. Each gives the padded
value and the FLOPs of the ops it appears in. It also gives the FLOPs and roofline time the padding
adds. Padding
makes the arithmetic a little larger. What it buys is the fast kernel, which the bound cannot see.
Pure: no torch, no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lmledger.ledger.count.ops import MATMUL, OpSummary

__all__ = ["Advice", "advice_text", "shape_advice"]

_ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_WIDE_TILE_GPUS = ("a100", "a800", "h100", "h800", "h200", "h20", "gh200", "b100", "b200", "gb200")


def _preferred_multiple(dtype: str, gpu: str) -> int:
    """The multiple, in elements, a `dtype` ("bfloat16", ...) matmul dimension wants on `gpu` (a key).

    It is 16 bytes of elements, or 128 on A100-class parts. For fp8 it is 16 (Transformer Engine).
    """
    if dtype in _FP8:
        return 16
    align = 128 if gpu.lower().startswith(_WIDE_TILE_GPUS) else 16
    return max(1, align // _ELEMENT_BYTES.get(dtype, 4))


def _gemm_dims(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, int, int] | None:
    """(M, K, N) of a GEMM from its input shapes: the first pair a (..., M, K), b (..., K, N)."""
    mats = [s for s in shapes if len(s) >= 2]
    for a, b in zip(mats, mats[1:], strict=False):
        if a[-1] == b[-2]:
            return a[-2], a[-1], b[-1]
    return None


@dataclass(frozen=True)
class Advice:
    dim: int  # the dimension's size as the kernels see it
    padded: int  # the next multiple
    multiple: int
    dtype: str
    name: str  # what the dimension is, if the caller said ("vocab_size"), else ""
    ops: int  # matmul ops (forward and backward) with this dimension
    flops: int  # their FLOPs
    extra_flops: int  # what padding this dimension adds to them
    extra_seconds: float | None  # the same at the GPU's peak (None without a peak)

    def line(self) -> str:
        what = f"{self.name} = {self.dim}" if self.name else f"dimension {self.dim}"
        share = f"{self.extra_flops / self.flops:+.2%}" if self.flops else ""
        seconds = f", {self.extra_seconds * 1e6:+.3g} us at peak" if self.extra_seconds is not None else ""
        return (
            f"{what} is not a multiple of {self.multiple} ({self.dtype}): pad to {self.padded}; "
            f"{self.ops} matmuls, {self.flops:.3g} FLOPs, padding adds {self.extra_flops:.3g} FLOPs ({share}{seconds})"
        )


def shape_advice(
    ops: OpSummary,
    gpu: str,
    *,
    names: Mapping[int, str] | None = None,
    peak_flops_per_s: float | None = None,
) -> list[Advice]:
    """Every matmul dimension of the step that misses `gpu`'s preferred multiple; largest FLOPs first.

    `names` labels dimension values ({50257: "vocab_size"}). `peak_flops_per_s` prices the extra FLOPs
    in seconds.
    """
    names = names or {}
    found: dict[tuple[int, str], list[int]] = {}  # (dim, dtype) -> [ops, flops, extra flops]
    for op in ops.ops:
        if op.category != MATMUL or not op.flops:
            continue
        dims = _gemm_dims(op.shapes)
        if dims is None:
            continue
        dtype = op.dtype or "float32"
        multiple = _preferred_multiple(dtype, gpu)
        for dim in set(dims):
            if dim % multiple:
                padded = -(-dim // multiple) * multiple
                row = found.setdefault((dim, dtype), [0, 0, 0])
                row[0] += 1
                row[1] += op.flops
                # FLOPs are linear in each of M, K, N: padding one scales them by padded / dim
                row[2] += op.flops * (padded - dim) * dims.count(dim) // dim
    advice = []
    for (dim, dtype), (count, flops, extra) in found.items():
        multiple = _preferred_multiple(dtype, gpu)
        advice.append(
            Advice(
                dim, -(-dim // multiple) * multiple, multiple, dtype, names.get(dim, ""), count, flops, extra,
                extra / peak_flops_per_s if peak_flops_per_s else None,
            )
        )  # fmt: skip
    return sorted(advice, key=lambda a: -a.flops)


def advice_text(
    ops: OpSummary, gpu: str, compute_dtype: str, device_type: str, names: Mapping[int, str] | None = None
) -> str:
    """Shape advice as lines of text; the extra time is priced at `gpu`'s datasheet `compute_dtype` peak.

    A run on a device other than CUDA is told the advice is for that GPU.
    """
    from lmledger.ledger.hardware.gpus import datasheet_peak, require_gpu

    spec = require_gpu(gpu)
    peak = datasheet_peak(spec, compute_dtype)
    advice = shape_advice(ops, spec.key, names=names, peak_flops_per_s=peak.flops_per_s if peak else None)
    where = "" if device_type == "cuda" else f" (this run is on {device_type}: the advice is for {spec.key})"
    if not advice:
        return f"shape advice for {spec.key}: every matmul dimension is a multiple its tensor cores like{where}"
    return f"shape advice for {spec.key}'s tensor cores{where}:\n" + "\n".join(f"  {a.line()}" for a in advice)
