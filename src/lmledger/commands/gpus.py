"""`lmledger gpus [--resolve NAME] [--json]`: the GPU spec table, or the entry a name maps to."""

from __future__ import annotations

from json import dumps

from rich.table import Table

from lmledger.commands.argparser import run_command
from lmledger.commands.terminal import console
from lmledger.ledger.hardware.gpus import DTYPES, GPUS, GpuSpec, require_gpu
from lmledger.ledger.units import GB, format_bytes, tera

__all__ = ["main"]


def _tera(value: float | None) -> str:
    return "—" if value is None else f"{tera(value):g}"


def _table(specs: list[GpuSpec], title: str) -> Table:
    table = Table(title=title)
    table.add_column("key")
    table.add_column("name")
    for dtype in DTYPES:
        table.add_column(f"{dtype}\nTOP/s" if dtype == "int8" else f"{dtype}\nTFLOP/s", justify="right")
    table.add_column("memory\nGB", justify="right")
    table.add_column("bandwidth\nTB/s", justify="right")
    for spec in specs:
        table.add_row(
            spec.key,
            spec.name,
            *(_tera(spec.peak_flops[dtype]) for dtype in DTYPES),
            f"{spec.memory_bytes / GB:g}",
            f"{tera(spec.bandwidth_bytes_per_s):g}",
        )
    return table


def _entry_table(spec: GpuSpec, title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("key", spec.key)
    table.add_row("name", spec.name)
    for dtype in DTYPES:
        unit = "TOP/s" if dtype == "int8" else "TFLOP/s"
        flops = spec.peak_flops[dtype]
        table.add_row(f"{dtype} (dense)", "—" if flops is None else f"{tera(flops):g} {unit}")
    table.add_row("memory", format_bytes(spec.memory_bytes))
    table.add_row("bandwidth", f"{tera(spec.bandwidth_bytes_per_s):g} TB/s")
    return table


def _gpus(resolve: str | None = None, json: bool = False) -> int:
    """Dense datasheet peaks (never the 'with sparsity' figures), memory and bandwidth per GPU.

    Args:
        resolve (NAME): a key or a torch device name, e.g. "NVIDIA H100 80GB HBM3"
        json: print one JSON object
    """
    if resolve is not None:
        spec = require_gpu(resolve)
        if json:
            print(dumps(spec.to_json()))
        else:
            console().print(_entry_table(spec, f"{resolve} -> {spec.key}"))
        return 0
    if json:
        print(dumps({key: spec.to_json() for key, spec in GPUS.items()}))
    else:
        title = "GPU peaks (dense) — lmledger gpus --resolve NAME for one entry"
        console().print(_table(list(GPUS.values()), title))
    return 0


def main(argv: list[str]) -> int:
    return run_command("lmledger gpus", _gpus, argv)
