"""The token-file format, and turning a corpus into it (what `lmledger prepare` does).

This module owns the on-disk format; `lmledger.data` reads it. It imports no Lightning and no torch.
So preparing data costs only the work itself.

Format (FORMAT_VERSION 1):

    train.bin, val.bin  every token of the split back to back, as raw little-endian unsigned ints
    meta.json           dtype, vocab_size, token counts, tokenizer, source, the sha256 of each .bin
    tokenizer.json      bpe only: the trained HF `tokenizers` tokenizer

The ints are of the smallest dtype holding the vocabulary: uint8, uint16 or uint32. Documents,
sorted by name, are joined with a separator token.

The meta.json is written last, and removed first on --overwrite. A directory holds prepared data
exactly when it has a meta.json. So a crash part-way leaves a directory the loader rejects, never a mix.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import stat
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lmledger import __version__
from lmledger.atomic import fsync_dir, printable, remove_stale_temps, stage, write_error
from lmledger.errors import UserError
from lmledger.ledger.units import format_mb as _mb

__all__ = [
    "BYTE_SEPARATOR",
    "DEFAULT_BPE_VOCAB_SIZE",
    "DEFAULT_OUT",
    "DEFAULT_VAL_FRACTION",
    "FORMAT_VERSION",
    "MAX_BPE_VOCAB_SIZE",
    "META_FILE",
    "SPLIT_FILES",
    "STDLIB",
    "TOKEN_DTYPES",
    "check_out_dir",
    "list_source_files",
    "prepare",
    "summary",
    "token_dtype",
]

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
_TOKENIZER_FILE = "tokenizer.json"
TOKEN_DTYPES = ("uint8", "uint16", "uint32")

_BYTE_VOCAB_SIZE = 256
# The byte tokenizer has no spare id, so NUL separates documents. Files that contain NUL are not read
# as text (the test git uses to call a file binary). So the separator is unambiguous.
BYTE_SEPARATOR = b"\x00"
_BPE_SEPARATOR = "<|endoftext|>"
DEFAULT_BPE_VOCAB_SIZE = 10_000
# The largest vocabularies in use are about 256k ids (Gemma: 262,144). The HF BPE trainer reserves
# memory per requested id before it reads a byte: 5e9 ids asked it for 283 GB (2026-11-30). 2**20 is
# four times Gemma's. On a 3-file corpus it adds 3 MB of peak RSS over vocab 300 (2026-11-30, 2-core
# CPU, shared).
MAX_BPE_VOCAB_SIZE = 2**20
DEFAULT_OUT = "data/stdlib"
DEFAULT_VAL_FRACTION = 0.01
STDLIB = "stdlib"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids 0 .. vocab_size-1 (little-endian on disk)."""
    for name in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return np.dtype(name).newbyteorder("<")
    raise UserError(f"vocab_size {vocab_size} does not fit in uint32")


@dataclass(frozen=True)
class _Document:
    key: str  # a stable, machine-independent name: decides the split and the order
    text: bytes  # valid UTF-8 without NUL bytes


# ---------------------------------------------------------------------------------------- corpus


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_regular_file(path: Path) -> bool:
    """A regular file, or a link to one. Reading a FIFO, socket or device could block or never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # a dangling link, or gone since the walk listed it


def _walk_files(root: Path, suffix: str | None, skip_dirs: Iterable[str] = ()) -> list[Path]:
    """Regular files under root, without hidden entries and `skip_dirs`. Symlinked dirs are not followed."""
    skip = set(skip_dirs)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and (suffix is None or name.endswith(suffix)) and _is_regular_file(path):
                found.append(path)
    return found


def list_source_files(sources: Sequence[str]) -> tuple[list[tuple[str, Path]], str]:
    """(key, path) of every candidate file, sorted by key; and a line describing the sources."""
    entries: dict[str, Path] = {}
    described = []
    for source in sources:
        if source == STDLIB:
            root = _stdlib_root()
            described.append(f"Python {platform.python_version()} standard library ({root})")
            for path in _walk_files(root, ".py", skip_dirs=("site-packages", "dist-packages", "__pycache__")):
                entries.setdefault(path.relative_to(root).as_posix(), path)
            continue
        path = Path(source)
        if not path.exists():
            raise UserError(f"--source {printable(source)} does not exist; pass 'stdlib' or existing files/directories")
        described.append(printable(source))
        if path.is_dir():
            # Keys start at the directory's own name: they do not depend on where it sits on disk.
            for file in _walk_files(path, None):
                entries.setdefault(f"{path.resolve().name}/{file.relative_to(path).as_posix()}", file)
        elif _is_regular_file(path):
            entries.setdefault(path.name, path)
        else:
            raise UserError(
                f"--source {printable(source)} is not a regular file or a directory (a FIFO, socket or "
                "device would be read forever); pass text files or directories"
            )
    return sorted(entries.items()), "; ".join(described)


def _read_text_file(path: Path) -> bytes | None:
    """The file's bytes if it is non-binary UTF-8 text, else None."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if BYTE_SEPARATOR in data else data


def _val_score(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a document key. The same on every machine and run."""
    # surrogateescape: a file name that is not UTF-8 scores by its raw bytes. UTF-8 names score as before.
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _split_documents(docs: Sequence[_Document], val_fraction: float) -> tuple[list[_Document], list[_Document]]:
    """Split by document: those whose key scores below val_fraction go to val. Both sides are non-empty.

    A single document (one big text file) is cut at a line break. It is the last before its
    (1 - val_fraction) point.
    """
    if len(docs) == 1:
        text = docs[0].text
        cut = text.rfind(b"\n", 0, int(len(text) * (1 - val_fraction))) + 1
        if cut <= 0 or cut >= len(text):
            raise UserError(
                f"the corpus ({printable(docs[0].key)}, {len(text)} bytes) is too small to split into train and val"
            )
        return [_Document(docs[0].key, text[:cut])], [_Document(docs[0].key, text[cut:])]
    scores = np.array([_val_score(d.key) for d in docs])
    is_val = scores < val_fraction
    if not is_val.any():
        is_val[np.argmin(scores)] = True
    if is_val.all():
        is_val[np.argmax(scores)] = False
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val


# ------------------------------------------------------------------------------------ tokenizers


def _encode_bytes(docs: Sequence[_Document]) -> np.ndarray:
    return np.frombuffer(BYTE_SEPARATOR.join(d.text for d in docs), dtype=np.uint8)


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "--tokenizer bpe needs the HF tokenizers package: pip install tokenizers "
            "(or pip install 'lmledger[bpe]'), or use --tokenizer bytes"
        ) from None
    return tokenizers


def _train_bpe(docs: Sequence[_Document], vocab_size: int):
    """A byte-level BPE with the separator as special token: GPT-2 style pre-tokenization, no prefix space."""
    tk = _import_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_BPE_SEPARATOR],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text.decode("utf-8") for d in docs), trainer=trainer, length=len(docs))
    return tokenizer


def _encode_bpe(tokenizer, docs: Sequence[_Document], dtype: np.dtype, on_chunk: Callable[[int], object]) -> np.ndarray:
    separator = np.array([tokenizer.token_to_id(_BPE_SEPARATOR)], dtype=dtype)
    pieces = []
    chunk = 64  # documents per encode_batch call, which runs in parallel in Rust
    for start in range(0, len(docs), chunk):
        batch = [d.text.decode("utf-8") for d in docs[start : start + chunk]]
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            if pieces:
                pieces.append(separator)
            pieces.append(np.array(encoding.ids, dtype=dtype))
        on_chunk(len(batch))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


# ---------------------------------------------------------------------------------------- output


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to replace prepared data without --overwrite, before anything is read or written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    existing = [n for n in (META_FILE, *SPLIT_FILES.values()) if (out / n).exists()]
    if existing and not overwrite:
        raise UserError(
            f"{out} already holds prepared data ({', '.join(existing)}); pass --overwrite to replace it "
            "or choose another --out"
        )


def _write_prepared(out: Path, splits: dict[str, np.ndarray], meta: dict, tokenizer_json: str | None) -> None:
    """Write every file to a temp file in `out`, then move them into place, meta.json last.

    An OSError (a full disk, a read-only file system) becomes one DiskWriteError line. Until the first
    rename the previous data is untouched. After it, meta.json is gone. So the loader refuses the
    directory rather than reading a mix.
    """
    names = [*(SPLIT_FILES[s] for s in splits), *([_TOKENIZER_FILE] if tokenizer_json is not None else []), META_FILE]
    writing = out
    staged: dict[str, Path] = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out, (*SPLIT_FILES.values(), _TOKENIZER_FILE, META_FILE))
        for split, tokens in splits.items():
            writing = out / SPLIT_FILES[split]
            staged[SPLIT_FILES[split]] = stage(writing, memoryview(np.ascontiguousarray(tokens)))
        if tokenizer_json is not None:
            writing = out / _TOKENIZER_FILE
            staged[_TOKENIZER_FILE] = stage(writing, tokenizer_json)
        writing = out / META_FILE
        staged[META_FILE] = stage(writing, json.dumps(meta, indent=2) + "\n")
    except OSError as err:
        raise write_error(err, writing) from None
    finally:
        if len(staged) < len(names):
            for tmp in staged.values():
                tmp.unlink(missing_ok=True)
    writing, unprepared = out / META_FILE, False
    try:
        (out / META_FILE).unlink(missing_ok=True)  # from here to the last replace, `out` reads as unprepared
        unprepared = True
        if tokenizer_json is None:
            (out / _TOKENIZER_FILE).unlink(missing_ok=True)  # a stale one would contradict meta.json
        for name, tmp in staged.items():  # dicts keep insertion order: meta.json goes last
            writing = out / name
            os.replace(tmp, writing)
        unprepared = False
        fsync_dir(out)  # the renames live in the directory entry
    except OSError as err:
        after = f"{out} holds no prepared data now (no meta.json); run prepare again" if unprepared else None
        raise write_error(err, writing, after) from None
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------- main


def _progress() -> Progress:
    console = Console(stderr=True)
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # logs and pipes get only the summary
    )


def _checked_settings(tokenizer: str, vocab_size: int | None, val_fraction: float) -> int | None:
    """Check prepare's settings before anything is read; the vocabulary size bpe will train."""
    if tokenizer not in ("bytes", "bpe"):
        raise UserError(f"unknown --tokenizer {tokenizer!r}; choose bytes or bpe")
    if tokenizer == "bytes" and vocab_size not in (None, _BYTE_VOCAB_SIZE):
        raise UserError("--vocab-size applies to --tokenizer bpe only (the byte tokenizer's vocabulary is 256)")
    if tokenizer == "bpe":
        vocab_size = DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size
        if vocab_size <= _BYTE_VOCAB_SIZE:
            raise UserError(f"--vocab-size {vocab_size} is too small for bpe: it must exceed the 256-byte alphabet")
        if vocab_size > MAX_BPE_VOCAB_SIZE:
            raise UserError(
                f"--vocab-size {vocab_size:,} is larger than lmledger allows ({MAX_BPE_VOCAB_SIZE:,}): the BPE "
                "trainer reserves memory for every id before training, and vocabularies in use stop near 256k"
            )
        _import_tokenizers()  # fail before reading anything
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive)")
    return vocab_size


def _read_documents(files: Sequence[tuple[str, Path]], progress: Progress) -> tuple[list[_Document], int]:
    """The non-empty UTF-8 files as Documents; and how many were skipped as not text."""
    reading = progress.add_task("reading files", total=len(files))
    docs, skipped = [], 0
    for key, path in files:
        text = _read_text_file(path)
        if text is None:
            skipped += 1
        elif text:
            docs.append(_Document(key, text))
        progress.advance(reading)
    return docs, skipped


def prepare(
    sources: Sequence[str] = (STDLIB,),
    out: str | os.PathLike = DEFAULT_OUT,
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    overwrite: bool = False,
) -> dict:
    """Tokenize `sources` into `out`; the meta.json it wrote."""
    out = Path(out)
    vocab_size = _checked_settings(tokenizer, vocab_size, val_fraction)
    check_out_dir(out, overwrite)
    files, description = list_source_files(sources)
    if not files:
        raise UserError(f"no files found in --source {' '.join(sources)}")

    with _progress() as progress:
        docs, skipped = _read_documents(files, progress)
        if not docs:
            raise UserError(f"no non-empty UTF-8 text files in --source {' '.join(sources)} ({skipped} skipped)")
        train_docs, val_docs = _split_documents(docs, val_fraction)

        tokenizer_json = None
        if tokenizer == "bytes":
            vocab_size, dtype = _BYTE_VOCAB_SIZE, token_dtype(_BYTE_VOCAB_SIZE)
            splits = {"train": _encode_bytes(train_docs), "val": _encode_bytes(val_docs)}
            separator, separator_id = BYTE_SEPARATOR.decode(), BYTE_SEPARATOR[0]
        else:
            progress.add_task(f"training BPE (vocab {vocab_size})", total=None)
            bpe = _train_bpe(train_docs, vocab_size)
            vocab_size, separator = bpe.get_vocab_size(), _BPE_SEPARATOR
            dtype, separator_id = token_dtype(vocab_size), bpe.token_to_id(_BPE_SEPARATOR)
            encoding = progress.add_task("encoding", total=len(docs))
            advance = functools.partial(progress.advance, encoding)
            splits = {s: _encode_bpe(bpe, d, dtype, advance) for s, d in (("train", train_docs), ("val", val_docs))}
            tokenizer_json = bpe.to_str()

        progress.add_task("writing", total=None)
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": int(vocab_size),
            "train_tokens": int(splits["train"].size),
            "val_tokens": int(splits["val"].size),
            "tokenizer": tokenizer,
            "tokenizer_file": _TOKENIZER_FILE if tokenizer_json is not None else None,
            "separator": separator,
            "separator_id": int(separator_id),
            "source": description,
            "python_version": platform.python_version() if STDLIB in sources else None,
            "train_documents": len(train_docs),
            "val_documents": len(val_docs),
            "skipped_files": skipped,
            "val_fraction": val_fraction,
            "sha256": {SPLIT_FILES[s]: hashlib.sha256(memoryview(a)).hexdigest() for s, a in splits.items()},
            "created_by": f"lmledger {__version__}",
        }
        _write_prepared(out, splits, meta, tokenizer_json)
    return meta


def summary(meta: dict, out: Path, seconds: float) -> str:
    itemsize = np.dtype(meta["dtype"]).itemsize
    total = meta["train_tokens"] + meta["val_tokens"]
    tokenizer = "bytes" if meta["tokenizer"] == "bytes" else f"byte-level BPE, {out / _TOKENIZER_FILE}"
    return (
        f"Prepared {total:,} tokens from {meta['train_documents'] + meta['val_documents']:,} files of "
        f"{meta['source']} in {seconds:.1f} s ({meta['skipped_files']} files skipped as binary or not UTF-8). "
        f"Tokenizer: {tokenizer}; vocab {meta['vocab_size']:,}, stored as {meta['dtype']}. "
        f"Train: {meta['train_tokens']:,} tokens ({meta['train_documents']:,} files, "
        f"{_mb(meta['train_tokens'] * itemsize)}) in {out / SPLIT_FILES['train']}; "
        f"val: {meta['val_tokens']:,} tokens ({meta['val_documents']:,} files, "
        f"{_mb(meta['val_tokens'] * itemsize)}) in {out / SPLIT_FILES['val']}; metadata in {out / META_FILE}."
    )
