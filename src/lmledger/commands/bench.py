"""`lmledger bench matmul [--dtypes ...] [--sizes ...] [--plot PNG] [--json]`: see lmledger.bench."""

from __future__ import annotations

from json import dumps
from pathlib import Path

import torch
from rich.table import Table

from lmledger.bench import DEFAULT_DTYPES, DEFAULT_SIZES, MatmulBench, bench_matmul, plot_mfu
from lmledger.commands.argparser import run_command
from lmledger.commands.terminal import console
from lmledger.errors import UserError
from lmledger.ledger.hardware.gpus import dtype_name
from lmledger.ledger.units import tera
from lmledger.precision import local_device

__all__ = ["main"]


def _device(name: str | None) -> torch.device:
    if name is None:
        return local_device("auto")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    return torch.device(name)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--sizes must be comma-separated whole numbers, e.g. 256,512,1024; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"--sizes must be positive whole numbers, got {text!r}")
    return sizes


def _table(bench: MatmulBench) -> Table:
    table = Table(title=f"matmul on {bench.device_name} (median of {bench.repeats}, after {bench.warmup} warm-up)")
    for column in ("dtype", "size", "ms", "TFLOP/s", "peak TFLOP/s", "MFU"):
        table.add_column(column, justify="left" if column == "dtype" else "right")
    for r in bench.results:
        if r.seconds is None:
            table.add_row(r.dtype, str(r.size), "—", "—", "—", r.note)
            continue
        peak = "—" if r.peak is None else f"{tera(r.peak.flops_per_s):.4g} ({r.peak.source})"
        mfu = "—" if r.mfu is None else f"{r.mfu:.3f}"
        table.add_row(r.dtype, str(r.size), f"{r.seconds * 1e3:.3f}", f"{tera(r.flops_per_s):.4g}", peak, mfu)
    return table


def _matmul(
    dtypes: str | None = None,
    sizes: str | None = None,
    repeats: int | None = None,
    device: str | None = None,
    plot: str | None = None,
    json: bool = False,
) -> int:
    """square matmuls: achieved FLOP/s and MFU per dtype and size

    Args:
        dtypes: comma-separated, from fp64,fp32,tf32,bf16,fp16,fp8 (default: fp32,bf16 on CPU; all but fp64
            on CUDA)
        sizes: comma-separated m=n=k (default: 128,256,512 on CPU; 1024..8192 on CUDA)
        repeats: timed repeats, median reported (default 5 on CPU, 20 on CUDA)
        device: cpu or cuda (default: cuda when available)
        plot (PNG): write MFU vs size per dtype to this new PNG file
        json: print one JSON object
    """
    where = _device(device)
    names = [dtype_name(d.strip()) for d in dtypes.split(",")] if dtypes else DEFAULT_DTYPES[where.type]
    sides = _sizes(sizes) if sizes else list(DEFAULT_SIZES[where.type])
    if repeats is not None and repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    png = Path(plot) if plot else None
    if png is not None and png.exists():
        raise UserError(f"--plot {png} already exists: choose a new file name or remove it")

    bench = bench_matmul(names, sides, where, repeats)
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_mfu(bench, png)
    if json:
        print(dumps({**bench.to_json(), "plot": None if png is None else str(png)}))
    else:
        console().print(_table(bench))  # piped: the notes whole rather than cut at 80
        if png is not None:
            print(f"wrote {png}")
    return 0


def main(argv: list[str]) -> int:
    return run_command("lmledger bench", {"matmul": _matmul}, argv, "Benchmarks that relate speed to the peak.")
