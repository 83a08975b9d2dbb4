"""`lmledger prepare`: tokenize a corpus into DIR/train.bin, DIR/val.bin and DIR/meta.json (lmledger.corpus)."""

from __future__ import annotations

import contextlib
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
from lmledger.errors import UserError

__all__ = ["main", "prepare_corpus"]


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
    with _locked(Path(out)):
        meta = prepare(list(source), out, tokenizer, vocab_size, val_fraction, overwrite)
    print(summary(meta, Path(out), time.perf_counter() - started))
    return 0


# In --out while a prepare writes there (lmledger.runlock): a second prepare into the same directory at the
# same time is refused; one that comes after finds the data and refuses without --overwrite.
_PREPARE_LOCK = ".prepare.lock"


@contextlib.contextmanager
def _locked(out: Path):
    from lmledger.runlock import DirLock

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    made = [p for p in (*reversed(out.parents), out) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --out {out} ({err.strerror})") from None
    lock = DirLock(out / _PREPARE_LOCK)
    try:
        lock.acquire(
            lambda who: UserError(
                f"{out} is being written by another lmledger prepare ({who}); wait for it, or choose another --out"
            )
        )
        yield
    finally:
        lock.release(remove=lock.created)
        for directory in reversed(made):  # a refused prepare leaves no directory it made (only if empty)
            try:
                directory.rmdir()
            except OSError:
                break


def main(argv: list[str]) -> int:
    return run_command("lmledger prepare", prepare_corpus, argv)
