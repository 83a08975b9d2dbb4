"""`lmledger plan train-time|max-params ...`: napkin math from lmledger.ledger.planner."""

from __future__ import annotations

import argparse
import json
import re

from rich.console import Console
from rich.table import Table

from lmledger.ledger.hardware import DTYPES
from lmledger.ledger.planner import OPTIMIZERS, PRECISIONS, max_params, train_time

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _count(text: str) -> float:
    """A count such as 70e9, 70B or 15T (k, M, B, T suffixes)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBtT]?)\s*", text)
    try:
        return float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 70e9 or 70B)") from None


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _train_time(args: argparse.Namespace) -> None:
    result = train_time(args.params, args.tokens, args.gpu, args.num_gpus, args.mfu, args.dtype)
    if args.json:
        print(json.dumps(result.to_json()))
        return
    _print_rows(
        "training time (6·N·D / (peak · GPUs · MFU))",
        [
            ("params", f"{result.params:.4g}"),
            ("tokens", f"{result.tokens:.4g}"),
            ("total FLOPs", f"{result.total_flops:.4g}"),
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            (f"peak {result.dtype} per GPU", f"{result.peak_flops / 1e12:g} TFLOP/s (dense)"),
            ("MFU", f"{result.mfu:g}"),
            ("hours", f"{result.hours:,.1f}"),
            ("days", f"{result.days:,.1f}"),
        ],
    )


def _max_params(args: argparse.Namespace) -> None:
    result = max_params(args.gpu, args.num_gpus, args.precision, args.optimizer)
    if args.json:
        print(json.dumps(result.to_json()))
        return
    _print_rows(
        "largest model that fits (activations ignored)",
        [
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            ("memory (all GPUs)", f"{result.capacity_bytes / 1e9:g} GB"),
            ("precision / optimizer", f"{result.precision} / {result.optimizer}"),
            ("bytes per param", f"{result.bytes_per_param:g}"),
            ("max params", f"{result.max_params:,} ({result.max_params / 1e9:.3g}B)"),
        ],
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmledger plan", description="Napkin math (CS336 lecture 2).")
    verbs = parser.add_subparsers(dest="verb", required=True)

    tt = verbs.add_parser("train-time", help="days to train N params on D tokens")
    tt.add_argument("--params", type=_count, required=True, help="parameters, e.g. 70e9 or 70B")
    tt.add_argument("--tokens", type=_count, required=True, help="training tokens, e.g. 15e12 or 15T")
    tt.add_argument("--gpu", required=True, help="a key from `lmledger gpus` or a torch device name")
    tt.add_argument("--num-gpus", type=int, default=1)
    tt.add_argument("--mfu", type=float, required=True, help="model FLOPs utilization in (0, 1], e.g. 0.5")
    tt.add_argument("--dtype", default="bf16", help=f"whose dense peak applies: {', '.join(DTYPES)} (default bf16)")
    tt.add_argument("--json", action="store_true")
    tt.set_defaults(run=_train_time)

    mp = verbs.add_parser("max-params", help="largest model whose params, grads and optimizer state fit")
    mp.add_argument("--gpu", required=True, help="a key from `lmledger gpus` or a torch device name")
    mp.add_argument("--num-gpus", type=int, default=1)
    mp.add_argument("--precision", default="32-true", help=f"one of {', '.join(PRECISIONS)} (default 32-true)")
    mp.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    mp.add_argument("--json", action="store_true")
    mp.set_defaults(run=_max_params)

    args = parser.parse_args(argv)
    args.run(args)
    return 0
