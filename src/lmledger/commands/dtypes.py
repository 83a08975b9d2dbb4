"""`lmledger dtypes [--json]`: floating-point formats (bytes, bits, range, eps) and the lecture's casts."""

from __future__ import annotations

from json import dumps

from rich.table import Table

from lmledger.commands.argparser import run_command
from lmledger.commands.terminal import console

__all__ = ["main"]


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.6g}"


def _formats_table(rows) -> Table:
    table = Table(title="floating-point formats (torch.finfo where torch has the dtype)")
    for column in ("format", "bytes", "sign", "exp", "mant", "max", "eps", "min normal", "min subnormal", "source"):
        table.add_column(column, justify="left" if column in ("format", "source") else "right")
    for row in rows:
        table.add_row(
            row.name,
            f"{row.bytes_per_element:g}",
            str(row.sign_bits),
            str(row.exponent_bits),
            str(row.mantissa_bits),
            _num(row.max),
            _num(row.eps),
            _num(row.smallest_normal),
            _num(row.smallest_subnormal),
            row.source,
        )
    return table


def _casts_table(demo: dict) -> Table:
    table = Table(title="the lecture's demonstrations, cast on this machine", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    under = demo["underflow"]
    table.add_row(
        f"{under['value']:g} cast and read back",
        f"float16 {under['float16']:g}, bfloat16 {under['bfloat16']:.5g}, float32 {under['float32']:.5g}",
    )
    for name, fp8 in demo["fp8_overflow"].items():
        values = ", ".join(f"{v:g}" for v in fp8["values"])
        table.add_row(
            f"{name} (max {fp8['max']:,g}): {values}",
            f"plain .to(): {', '.join(f'{v:,g}' for v in fp8['plain_cast'])}; "
            f"clamped to ±max first: {', '.join(f'{v:,g}' for v in fp8['clamped_cast'])}",
        )
    sizes = demo["bytes"]
    table.add_row("4 x 8 float32 tensor", f"{sizes['tensor_4x8_float32']:,} bytes")
    matrix = sizes["gpt3_matrix_12288x49152"]
    table.add_row(
        "GPT-3 12288 x 49152 matrix (meta device)", ", ".join(f"{name} {n:,} B" for name, n in matrix.items())
    )
    return table


def _dtypes(json: bool = False) -> int:
    """Bytes, bits, range, eps and smallest values per floating-point format.

    Then the CS336 lecture's casts, run by this torch: underflow, fp8 overflow, tensor sizes.

    Args:
        json: print one JSON object
    """
    from lmledger.ledger.hardware.dtypes import demonstrations, format_table, jsonable

    rows, demo = format_table(), demonstrations()
    if json:
        result = {"dtypes": [row.to_json() for row in rows], "demonstrations": demo}
        print(dumps(jsonable(result), allow_nan=False))
        return 0
    out = console()
    out.print(_formats_table(rows))
    out.print(_casts_table(demo))
    return 0


def main(argv: list[str]) -> int:
    return run_command("lmledger dtypes", _dtypes, argv)
