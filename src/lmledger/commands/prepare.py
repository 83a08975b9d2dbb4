"""`lmledger prepare`: tokenize a corpus into DIR/train.bin, DIR/val.bin and DIR/meta.json (lmledger.corpus)."""

from __future__ import annotations

import time
from pathlib import Path

from lmledger.commands.argparser import ArgumentParser
from lmledger.corpus import (
    DEFAULT_BPE_VOCAB_SIZE,
    DEFAULT_OUT,
    DEFAULT_VAL_FRACTION,
    STDLIB,
    prepare,
    summary,
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="lmledger prepare",
        description="Tokenize a corpus into DIR/train.bin, DIR/val.bin and DIR/meta.json (split by file).",
    )
    parser.add_argument(
        "--source",
        nargs="+",
        default=[STDLIB],
        metavar="stdlib|PATH",
        help="'stdlib' (this interpreter's standard-library .py files; the default) and/or text files or "
        "directories (recursed; binary and non-UTF-8 files are skipped). Use ./stdlib for a path of that name.",
    )
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes", help="default: bytes (vocab 256)")
    parser.add_argument(
        "--vocab-size", type=int, metavar="N", help=f"bpe vocabulary size (default {DEFAULT_BPE_VOCAB_SIZE})"
    )
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--overwrite", action="store_true", help="replace data already prepared in DIR")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"share of files held out for validation (default {DEFAULT_VAL_FRACTION}; at least one file)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    meta = prepare(args.source, args.out, args.tokenizer, args.vocab_size, args.val_fraction, args.overwrite)
    print(summary(meta, Path(args.out), time.perf_counter() - started))
    return 0
