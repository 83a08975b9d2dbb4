import json

import pytest
import torch

from conftest import run_json
from lmledger import cli
from lmledger.ledger.hardware.dtypes import demonstrations, format_table

# Typed from the format definitions: IEEE 754 binary32 / binary16; bfloat16 (float32's exponent, 7
# mantissa bits); TF32 (NVIDIA A100 whitepaper: 8 exponent, 10 mantissa bits); OCP 8-bit floating point
# specification (OFP8) v1.0 for E4M3 (max 448, min normal 2^-6, min subnormal 2^-9) and E5M2 (max 57,344,
# min normal 2^-14, min subnormal 2^-16); OCP MX v1.0 for E8M0 (2^-127 .. 2^127, no subnormals) and E2M1.
# (bytes, sign, exponent, mantissa, max, eps, smallest normal, smallest subnormal)
DEFINITIONS = {
    "float32": (4, 1, 8, 23, (2 - 2**-23) * 2.0**127, 2**-23, 2.0**-126, 2.0**-149),
    "tf32": (4, 1, 8, 10, (2 - 2**-10) * 2.0**127, 2**-10, 2.0**-126, 2.0**-136),
    "bfloat16": (2, 1, 8, 7, (2 - 2**-7) * 2.0**127, 2**-7, 2.0**-126, 2.0**-133),
    "float16": (2, 1, 5, 10, 65504, 2**-10, 2.0**-14, 2.0**-24),
    "float8_e4m3fn": (1, 1, 4, 3, 448, 2**-3, 2.0**-6, 2.0**-9),
    "float8_e5m2": (1, 1, 5, 2, 57344, 2**-2, 2.0**-14, 2.0**-16),
    "float8_e8m0fnu": (1, 0, 8, 0, 2.0**127, 1, 2.0**-127, None),
    "fp4_e2m1": (0.5, 1, 2, 1, 6, 0.5, 1, 0.5),
}
ROWS = {row.name: row for row in format_table()}


def test_the_lecture_formats_are_all_there():
    assert list(ROWS)[:6] == ["float32", "tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
    assert set(ROWS) <= set(DEFINITIONS)
    assert ("float8_e8m0fnu" in ROWS) == hasattr(torch, "float8_e8m0fnu")
    assert ("fp4_e2m1" in ROWS) == hasattr(torch, "float4_e2m1fn_x2")


@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_matches_its_format_definition(name):
    row = ROWS[name]
    nbytes, sign, exponent, mantissa, largest, eps, normal, subnormal = DEFINITIONS[name]
    assert (row.bytes_per_element, row.sign_bits, row.exponent_bits, row.mantissa_bits) == (
        nbytes,
        sign,
        exponent,
        mantissa,
    )
    assert 8 * row.bytes_per_element >= row.sign_bits + row.exponent_bits + row.mantissa_bits
    assert (row.max, row.eps, row.smallest_normal, row.smallest_subnormal) == (largest, eps, normal, subnormal)


def _round_trip(value: float, dtype: torch.dtype) -> float:
    return torch.tensor([value], dtype=torch.float64).to(dtype).to(torch.float64).item()


@pytest.mark.parametrize("name", [n for n in ROWS if ROWS[n].torch_dtype and n != "fp4_e2m1"])
def test_each_row_holds_when_cast(name):
    # The measured twin of every figure: cast it (and its neighbours) with this torch.
    row, dtype = ROWS[name], getattr(torch, name)
    assert _round_trip(row.max, dtype) == row.max
    assert _round_trip(row.smallest_normal, dtype) == row.smallest_normal
    if row.mantissa_bits:
        assert _round_trip(1 + row.eps, dtype) == 1 + row.eps  # the next value after 1...
        assert _round_trip(1 + row.eps / 4, dtype) == 1  # ...and nothing closer
        assert _round_trip(row.smallest_subnormal, dtype) == row.smallest_subnormal
        assert _round_trip(row.smallest_subnormal / 4, dtype) == 0  # below it: zero
    else:  # e8m0 holds powers of two only
        assert _round_trip(2.0, dtype) == 2 and _round_trip(3.0, dtype) in (2, 4)


def test_the_lecture_demonstrations():
    demo = demonstrations()
    under = demo["underflow"]
    assert under["float16"] == 0  # 1e-8 is below float16's smallest subnormal (~6e-8)
    assert under["bfloat16"] == pytest.approx(1e-8, rel=2**-8)  # float32's exponent range
    e4m3, e5m2 = demo["fp8_overflow"]["float8_e4m3fn"], demo["fp8_overflow"]["float8_e5m2"]
    assert e4m3["clamped_cast"] == [448, -448] and e5m2["clamped_cast"] == [57344, -57344]
    # What a plain cast does, as this torch (2.13) does it: e4m3fn has no infinity and saturates,
    # e5m2 has one and rounds to it.
    assert e4m3["plain_cast"] == [448, -448]
    assert e5m2["plain_cast"] == [float("inf"), float("-inf")]
    sizes = demo["bytes"]
    assert sizes["tensor_4x8_float32"] == 128
    assert sizes["gpt3_matrix_12288x49152"]["float32"] == 2_415_919_104 == 12288 * 49152 * 4
    assert sizes["gpt3_matrix_12288x49152"]["bfloat16"] == 2_415_919_104 // 2


def _no_constants(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_dtypes_json_is_standard_json(capsys):
    capsys.readouterr()
    assert cli.main(["dtypes", "--json"]) == 0
    result = json.loads(capsys.readouterr().out, parse_constant=_no_constants)
    assert [row["name"] for row in result["dtypes"]] == list(ROWS)
    assert result["demonstrations"]["fp8_overflow"]["float8_e5m2"]["plain_cast"] == ["inf", "-inf"]
    assert result["demonstrations"]["bytes"]["gpt3_matrix_12288x49152"]["float32"] == 2_415_919_104
    assert run_json(capsys, "dtypes", "--json")["dtypes"][1]["torch_dtype"] is None  # tf32 has no torch dtype


def test_dtypes_table_prints(capsys):
    assert cli.main(["dtypes"]) == 0
    out = capsys.readouterr().out
    assert "2,415,919,104" in out and "57,344" in out and "65504" in out and "tf32" in out
