"""`lmledger prepare`: tokenize a corpus into DIR/train.bin, DIR/val.bin and DIR/meta.json (lmledger.corpus)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from lmledger.commands.argparser import run_command
from lmledger.corpus import (
    DEFAULT_BPE_VOCAB_SIZE,  # noqa: F401 (quoted in --help through prepare_corpus's docstring)
    DEFAULT_OUT,
    DEFAULT_VAL_FRACTION,
    STDLIB,
    prepare,
    summary,
)


def prepare_corpus(
    source: Sequence[str] = (STDLIB,),
    tokenizer: Literal["bytes", "bpe"] = "bytes",
    vocab_size: int | None = None,
    out: str = DEFAULT_OUT,
    overwrite: bool = False,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> int:
    """Tokenize a corpus into DIR/train.bin, DIR/val.bin and DIR/meta.json (split by file).

    Args:
        source (stdlib|PATH): 'stdlib' (this interpreter's standard-library .py files; the default) and/or
            text files or directories (recursed; binary and non-UTF-8 files are skipped). Use ./stdlib for a
            path of that name.
        tokenizer: default: bytes (vocab 256)
        vocab_size (N): bpe vocabulary size (default {DEFAULT_BPE_VOCAB_SIZE})
        out (DIR): output directory (default {DEFAULT_OUT})
        overwrite: replace data already prepared in DIR
        val_fraction (F): share of files held out for validation (default {DEFAULT_VAL_FRACTION}; at least one
            file)
    """
    started = time.perf_counter()
    meta = prepare(list(source), out, tokenizer, vocab_size, val_fraction, overwrite)
    print(summary(meta, Path(out), time.perf_counter() - started))
    return 0


def main(argv: list[str]) -> int:
    return run_command("lmledger prepare", prepare_corpus, argv)
