"""Floating-point formats in numbers, and the CS336 lecture's casts (lecture 2, tensors_memory) run for real.

Each row gives bytes per element and sign/exponent/mantissa bits. Then the largest finite value and
eps (the gap between 1 and the next value). Then the smallest normal and smallest subnormal values.
Rows come from `torch.finfo` where torch has the dtype. Two come from their format definitions, and
say so. TF32 is a tensor-core compute mode: float32 in memory, no torch dtype. FP4 E2M1 is packed two
per byte, with no finfo in torch. The smallest subnormal is smallest_normal * 2**-mantissa_bits.
finfo does not give it. Tests check it, eps and max by casting.

The demonstrations cast real tensors with the installed torch. A value of 1e-8 underflows to 0 in float16
(smallest subnormal 2**-24 ~ 6e-8). Not in bfloat16, which has float32's exponent range. Beyond
fp8's range, a plain `.to()` sits beside a cast after clamping to +-finfo.max. PyTorch saturates
e4m3fn, which has no infinity. It rounds e5m2, which has one, to +-inf past 61,440. Clamping first saturates both,
at +-448 and +-57,344. Last, the bytes of a 4 x 8 float32 tensor. And of GPT-3's 12288 x 49152
feed-forward matrix on the meta device (shape and dtype, no memory).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["FormatRow", "demonstrations", "format_table", "jsonable"]


@dataclass(frozen=True)
class FormatRow:
    name: str
    torch_dtype: str | None  # "torch.bfloat16"; None where torch has no dtype for it (tf32)
    bytes_per_element: float  # 0.5 for fp4
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits (the leading 1 of a normal number is implicit)
    max: float
    eps: float
    smallest_normal: float
    smallest_subnormal: float | None  # None: the format has no subnormals
    source: str

    def to_json(self) -> dict:
        return asdict(self)


# Formats in the lecture's order. e8m0 and fp4 only where this torch has them.
_TORCH_FORMATS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def _from_finfo(name: str) -> FormatRow:
    dtype = getattr(torch, name)
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    sign = 0 if name == "float8_e8m0fnu" else 1  # e8m0: an unsigned power-of-two scale (OCP MX v1.0)
    exponent = info.bits - sign - mantissa
    subnormal = info.smallest_normal * 2.0**-mantissa if mantissa else None
    return FormatRow(
        name,
        str(dtype),
        dtype.itemsize,
        sign,
        exponent,
        mantissa,
        info.max,
        info.eps,
        info.smallest_normal,
        subnormal,
        "torch.finfo",
    )


def _from_definition(
    name: str, torch_dtype: str | None, nbytes: float, exponent: int, mantissa: int, source: str
) -> FormatRow:
    """An IEEE-style binary format with `exponent` and `mantissa` bits.

    Bias 2**(exponent-1) - 1. The all-ones exponent is kept for inf/NaN, unless the format (fp4 e2m1)
    has none.
    """
    bias = 2 ** (exponent - 1) - 1
    top = 2**exponent - 1 if name.startswith("fp4") else 2**exponent - 2  # e2m1 has no inf/NaN codes
    largest = (2 - 2.0**-mantissa) * 2.0 ** (top - bias)
    normal = 2.0 ** (1 - bias)
    return FormatRow(
        name,
        torch_dtype,
        nbytes,
        1,
        exponent,
        mantissa,
        largest,
        2.0**-mantissa,
        normal,
        normal * 2.0**-mantissa,
        source,
    )


def format_table() -> list[FormatRow]:
    rows = [_from_finfo("float32")]
    # NVIDIA A100 whitepaper: TF32 has float32's 8-bit exponent and float16's 10-bit mantissa. Tensors stay
    # float32 (4 bytes) in memory; tensor cores round a matmul's inputs to it.
    rows.append(_from_definition("tf32", None, 4, 8, 10, "format definition (NVIDIA A100 whitepaper)"))
    rows += [_from_finfo(name) for name in _TORCH_FORMATS[1:] if hasattr(torch, name)]
    if hasattr(torch, "float4_e2m1fn_x2"):
        # OCP Microscaling Formats (MX) v1.0, E2M1: max 6, min normal 1, min subnormal 0.5, no inf/NaN.
        rows.append(
            _from_definition(
                "fp4_e2m1", "torch.float4_e2m1fn_x2", 0.5, 2, 1, "format definition (OCP MX v1.0; packed 2 per byte)"
            )
        )
    return rows


def _cast(values: list[float], dtype: torch.dtype, clamp: float | None = None) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float32)
    if clamp is not None:
        tensor = tensor.clamp(-clamp, clamp)
    return tensor.to(dtype).to(torch.float32).tolist()


def _underflow(value: float = 1e-8) -> dict:
    """`value` cast to float16, bfloat16 and float32 and read back."""
    return {
        "value": value,
        **{name: _cast([value], getattr(torch, name))[0] for name in ("float16", "bfloat16", "float32")},
    }


# Probes far outside each fp8 format's range (max 448 and 57,344).
_FP8_PROBES = {"float8_e4m3fn": [1000.0, -1000.0], "float8_e5m2": [100_000.0, -100_000.0]}


def _fp8_overflow() -> dict:
    """Each fp8 format's max, and what values beyond it become: plain cast vs clamped cast."""
    result = {}
    for name, probes in _FP8_PROBES.items():
        dtype = getattr(torch, name)
        largest = torch.finfo(dtype).max
        result[name] = {
            "max": largest,
            "values": probes,
            "plain_cast": _cast(probes, dtype),
            "clamped_cast": _cast(probes, dtype, clamp=largest),
        }
    return result


_GPT3_MATRIX = (12288, 49152)  # GPT-3 175B: d_model 12288, d_ff 4 x 12288 (Brown et al. 2020, table 2.1)


def _tensor_bytes() -> dict:
    """Bytes of the lecture's two tensors: a real 4 x 8 float32 tensor, and GPT-3's feed-forward matrix.

    The matrix is on the meta device: shape and dtype only, no 2.4 GB allocation.
    """
    small = torch.zeros(4, 8, dtype=torch.float32)
    matrix = {
        name: torch.empty(_GPT3_MATRIX, dtype=getattr(torch, name), device="meta").nbytes for name in _TORCH_FORMATS[:4]
    }
    return {"tensor_4x8_float32": small.nbytes, "gpt3_matrix_12288x49152": matrix}


def demonstrations() -> dict:
    return {"underflow": _underflow(), "fp8_overflow": _fp8_overflow(), "bytes": _tensor_bytes()}


def jsonable(value):
    """`value` with each non-finite float as the string "inf", "-inf" or "nan": JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value
