"""Token files: open and validate a prepared directory, and serve it to Lightning as batches.

`lmledger prepare` writes DIR/train.bin, DIR/val.bin and DIR/meta.json (lmledger.corpus owns the format).
`load_meta` and `TokenFiles.open` check a directory. Every way it can be wrong is one UserError line.
`train_window_starts`, `val_window_starts` and `_gather_windows` are the pure window functions.
`TokenDataModule` feeds them to a Trainer.

Training batch i on rank r is a pure function of (seed, r, i). It holds random windows of
context_length + 1 tokens. A counter-based generator keyed on those three numbers draws them.
The sampler starts at the number of batches the trainer has already consumed. So a resumed run sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lmledger.atomic import DiskWriteError, atomic_write
from lmledger.corpus import FORMAT_VERSION, META_FILE, SPLIT_FILES, TOKEN_DTYPES
from lmledger.errors import UserError
from lmledger.lightning_private import batches_fetched

__all__ = [
    "MAX_BATCH",
    "TokenDataModule",
    "TokenFiles",
    "TrainBatches",
    "check_data_values",
    "load_meta",
    "train_window_starts",
    "val_window_starts",
]


_SPLITS = tuple(SPLIT_FILES)  # ("train", "val")


def _redo(root: Path) -> str:
    return f"re-run `lmledger prepare --out {root} --overwrite`"


# ------------------------------------------------------------------------------- files and meta


def load_meta(path: str | os.PathLike) -> dict:
    """meta.json of a prepared directory, checked for the fields the loader relies on."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"data dir {root} does not exist: run `lmledger prepare --out {root}`")
    meta_path = root / META_FILE
    if not meta_path.is_file():
        raise UserError(f"data dir {root} has no {META_FILE}: run `lmledger prepare --out {root}`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{meta_path} is not valid JSON ({err}); {_redo(root)}") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path} is not a JSON object; {_redo(root)}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{meta_path} has format_version {meta.get('format_version')!r} but this lmledger reads "
            f"{FORMAT_VERSION}; {_redo(root)}"
        )
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"{meta_path}: {key} must be a non-negative integer, got {value!r}; {_redo(root)}")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise UserError(f"{meta_path}: dtype must be one of {', '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}")
    if not 0 < meta["vocab_size"] <= np.iinfo(meta["dtype"]).max + 1:
        raise UserError(
            f"{meta_path}: vocab_size {meta['vocab_size']} does not fit dtype {meta['dtype']}; {_redo(root)}"
        )
    return meta


# A directory's verified hashes: (size, mtime_ns, sha256) per .bin. The hash is computed on first use,
# then again only when a file changes.
_VERIFIED_FILE = ".lmledger-verified.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_sha256(files: TokenFiles) -> None:
    """UserError unless each .bin hashes to the sha256 its meta.json records.

    A mismatch means data re-prepared or edited in place under the same meta.json.
    Hashed on a directory's first use and after a file changes. The verdict is kept in _VERIFIED_FILE
    (skipped quietly where the directory is read-only)."""
    recorded = files.meta.get("sha256")
    if not isinstance(recorded, dict):
        return  # prepared by a version that recorded none
    stamp_path = files.root / _VERIFIED_FILE
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = {}
    stamp = stamp if isinstance(stamp, dict) else {}
    fresh = {}
    for split in _SPLITS:
        name = SPLIT_FILES[split]
        if name not in recorded:
            continue
        st = files.bin_path(split).stat()
        key = [st.st_size, st.st_mtime_ns, recorded[name]]
        if stamp.get(name) != key:
            actual = _sha256(files.bin_path(split))
            if actual != recorded[name]:
                raise UserError(
                    f"{files.bin_path(split)} has sha256 {actual[:12]}... but {META_FILE} records "
                    f"{str(recorded[name])[:12]}...: the file changed after it was prepared; {_redo(files.root)}"
                )
        fresh[name] = key
    if fresh != stamp:
        try:
            atomic_write(stamp_path, json.dumps(fresh))
        except DiskWriteError:
            pass  # a read-only directory is hashed again next time


@dataclass(frozen=True)
class TokenFiles:
    """A prepared directory whose meta.json and .bin files agree (build it with `TokenFiles.open`)."""

    root: Path
    meta: dict

    @classmethod
    def open(cls, path: str | os.PathLike, check_token_ids: bool = True) -> TokenFiles:
        files = cls(Path(path), load_meta(path))
        for split in _SPLITS:
            bin_path, n_tokens = files.bin_path(split), files.num_tokens(split)
            if not bin_path.is_file():
                raise UserError(f"{bin_path} is missing; {_redo(files.root)}")
            expected, actual = n_tokens * files.dtype.itemsize, bin_path.stat().st_size
            if actual != expected:
                raise UserError(
                    f"{bin_path} holds {actual:,} bytes but meta.json promises {n_tokens:,} {files.dtype.name} tokens "
                    f"({expected:,} bytes): truncated or written with another dtype; {_redo(files.root)}"
                )
            if n_tokens == 0:
                raise UserError(f"{bin_path} holds no tokens; {_redo(files.root)} with more data")
        if check_token_ids:
            for split in _SPLITS:
                largest = int(files.tokens(split).max())  # one pass over the map; ~GB/s
                if largest >= files.vocab_size:
                    raise UserError(
                        f"{files.bin_path(split)} holds token id {largest} but vocab_size is {files.vocab_size}: "
                        f"the .bin does not belong to this meta.json; {_redo(files.root)}"
                    )
        return files

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"]).newbyteorder("<")

    def num_tokens(self, split: str) -> int:
        return self.meta[f"{split}_tokens"]

    def bin_path(self, split: str) -> Path:
        return self.root / SPLIT_FILES[split]

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(self.bin_path(split), dtype=self.dtype, mode="r", shape=(self.num_tokens(split),))

    def require_context(self, context_length: int) -> None:
        """Both splits must hold one window of context_length + 1 tokens: inputs and shifted targets."""
        for split in _SPLITS:
            if self.num_tokens(split) < context_length + 1:
                more = "a larger --val-fraction" if split == "val" else "a larger --source"
                raise UserError(
                    f"context_length {context_length} needs {context_length + 1} tokens but the {split} split of "
                    f"{self.root} holds {self.num_tokens(split):,}: use a shorter context, or prepare with {more}"
                )


# ---------------------------------------------------------------------------------------- windows


def train_window_starts(
    seed: int, rank: int, index: int, batch_size: int, n_tokens: int, context_length: int
) -> np.ndarray:
    """Start offsets (int64, shape (batch_size,)) of training batch `index` on `rank`: a pure function.

    Philox is counter-based. SeedSequence hashes (seed, rank, index) into its key. So any batch can be
    drawn directly, without replaying the ones before it. Starts are uniform over every offset that
    leaves room for context_length + 1 tokens.
    """
    key = np.random.SeedSequence(seed, spawn_key=(rank, index))
    rng = np.random.Generator(np.random.Philox(key))
    return rng.integers(0, n_tokens - context_length, size=batch_size, dtype=np.int64)


def _val_window_count(n_tokens: int, context_length: int) -> int:
    """Non-overlapping input windows in a split.

    Window k is tokens [kT, (k+1)T]. Its last token is only a target."""
    return (n_tokens - 1) // context_length


def _val_batch_count(batch_size: int, n_tokens: int, context_length: int) -> int:
    """Full batches of consecutive windows. Fewer windows than batch_size give one short batch."""
    return max(1, _val_window_count(n_tokens, context_length) // batch_size)


def val_window_starts(index: int, batch_size: int, n_tokens: int, context_length: int) -> np.ndarray:
    """Start offsets of validation batch `index`. Windows index*B .. index*B + B - 1, back to back."""
    first = index * batch_size
    rows = min(batch_size, _val_window_count(n_tokens, context_length) - first)
    return (first + np.arange(rows, dtype=np.int64)) * context_length


def _gather_windows(tokens: np.ndarray, starts: np.ndarray, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = tokens[s : s+T] and targets y = tokens[s+1 : s+T+1] per start s.

    Both are int64 (B, T) tensors. All in numpy: a torch copy here would use intra-op threads.
    Those contend with the training step.
    """
    tokens = np.asarray(tokens)  # a plain view: slicing an np.memmap builds a memmap object per slice
    x = np.empty((len(starts), context_length), dtype=np.int64)
    y = np.empty_like(x)
    for row, start in enumerate(starts):
        window = tokens[start : start + context_length + 1]
        x[row], y[row] = window[:-1], window[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


# --------------------------------------------------------------------------------------- datasets


class _TokenFileDataset(Dataset):
    """A .bin's path, dtype and length. Each process maps the file on first use.

    The memmap is never pickled. Spawned DataLoader workers get the path and open their own map.
    """

    def __init__(self, bin_path: Path, dtype: np.dtype, n_tokens: int) -> None:
        self.bin_path, self.dtype, self.n_tokens = bin_path, dtype, n_tokens
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


class TrainBatches(_TokenFileDataset):
    """Item i is this rank's whole training batch i, (x, y). Any i >= 0 is valid.

    Its length is the epoch length (Lightning's progress total), not a bound on i.
    """

    def __init__(
        self,
        bin_path: Path,
        dtype: np.dtype,
        n_tokens: int,
        *,
        batch_size: int,
        context_length: int,
        seed: int,
        rank: int,
        epoch_length: int,
    ) -> None:
        super().__init__(bin_path, dtype, n_tokens)
        self.batch_size, self.context_length = batch_size, context_length
        self.seed, self.rank, self.epoch_length = seed, rank, epoch_length

    def __len__(self) -> int:
        return self.epoch_length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = train_window_starts(self.seed, self.rank, index, self.batch_size, self.n_tokens, self.context_length)
        return _gather_windows(self.tokens, starts, self.context_length)


class _ValBatches(_TokenFileDataset):
    """Item j is validation batch j: consecutive, non-overlapping windows. The same on every run."""

    def __init__(
        self, bin_path: Path, dtype: np.dtype, n_tokens: int, *, batch_size: int, context_length: int, num_batches: int
    ) -> None:
        super().__init__(bin_path, dtype, n_tokens)
        self.batch_size, self.context_length, self.num_batches = batch_size, context_length, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"validation batch {index} out of range(0, {self.num_batches})")
        starts = val_window_starts(index, self.batch_size, self.n_tokens, self.context_length)
        return _gather_windows(self.tokens, starts, self.context_length)


class _ResumingSampler(DistributedSampler):
    """Yields len(dataset) consecutive batch indices from `start()`, read anew at every iter().

    A DistributedSampler only so that Lightning leaves it alone under DDP. Any other sampler gets
    wrapped in a DistributedSamplerWrapper, which deals the indices out across ranks.
    The ranks already draw different batches: TrainBatches keys its windows on the rank.
    """

    def __init__(self, dataset: TrainBatches, start: Callable[[], int], num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        first = self.start()
        return iter(range(first, first + len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


# ----------------------------------------------------------------------------------- data module


# The most sequences or tokens per window a batch may ask for: 2**24, far beyond any device's memory (the
# largest runs' global batches hold about 16M tokens, over thousands of devices).
MAX_BATCH = 1 << 24


def check_data_values(batch_size: int, context_length: int, num_workers: int = 0, seed: int = 0, val_batches=None):
    """TokenDataModule's settings, refused in one line. `account` and `plan` check a config's with it too."""
    for name, value, least in (
        ("batch_size", batch_size, 1),
        ("context_length", context_length, 1),
        ("num_workers", num_workers, 0),
        ("seed", seed, 0),
    ):
        if value < least:
            raise UserError(f"data.{name} must be >= {least}, got {value}")
        if name in ("batch_size", "context_length") and value > MAX_BATCH:
            raise UserError(f"data.{name} {value} is beyond any device: at most {MAX_BATCH:,}")
    if val_batches is not None and val_batches < 1:
        raise UserError(f"data.val_batches must be >= 1 or null (all), got {val_batches}")


class TokenDataModule(pl.LightningDataModule):
    """Random training windows and fixed validation windows from a directory written by `lmledger prepare`.

    Args:
        path: directory holding train.bin, val.bin and meta.json.
        batch_size: sequences per batch (per device).
        context_length: tokens per sequence (inputs; targets are the same window shifted by one).
        num_workers: DataLoader worker processes (0 = load in the training process).
        seed: seeds the training windows; batch i on rank r depends only on (seed, r, i).
        val_batches: cap on validation batches (None = every full batch of the val split).
    """

    def __init__(
        self,
        path: str = "data/stdlib",
        batch_size: int = 16,
        context_length: int = 256,
        num_workers: int = 0,
        seed: int = 1234,
        val_batches: int | None = None,
    ) -> None:
        super().__init__()
        check_data_values(batch_size, context_length, num_workers, seed, val_batches)
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            shown = str(path).encode("utf-8", "backslashreplace").decode("ascii")
            raise UserError(
                f"data.path {shown} is not valid UTF-8 (the run's config.yaml could not record it); rename the "
                "directory or link it under a UTF-8 name"
            ) from None
        self.save_hyperparameters()
        self.path, self.batch_size, self.context_length = path, batch_size, context_length
        self.num_workers, self.seed, self.val_batches = num_workers, seed, val_batches
        # Read and checked here, not in setup(): the CLI links vocab_size into the model right after __init__.
        self.files = TokenFiles.open(path)
        self.files.require_context(context_length)
        _verify_sha256(self.files)

    def state_dict(self) -> dict:
        """What checkpoints record of the data: its sha256s. Compared on resume (lmledger.fitting.cli)."""
        recorded = self.files.meta.get("sha256")
        return {"sha256": dict(recorded)} if isinstance(recorded, dict) else {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass  # compared before the run starts; the batches themselves resume from the loop's progress

    @property
    def vocab_size(self) -> int:
        return self.files.vocab_size

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.context_length

    def batches_consumed(self) -> int:
        """Training batches the attached trainer has already taken. Restored from a checkpoint on resume.

        Lightning restores the loops' progress before it first iterates the train loader
        (canary test_loops_restore_their_progress_before_the_train_loader_is_iterated).
        The count is of batches fetched across epochs, without the prefetcher's look-ahead.
        """
        if self.trainer is None:
            return 0
        return batches_fetched(self.trainer)

    def train_batches_per_epoch(self) -> int:
        trainer = self.trainer
        if trainer is not None and trainer.max_steps > 0:
            # One epoch spans the whole run, so the progress bar shows the real total; each optimizer
            # step consumes accumulate_grad_batches batches.
            return trainer.max_steps * trainer.accumulate_grad_batches
        return max(1, self.files.num_tokens("train") // self.tokens_per_batch)  # ~one pass over the tokens

    def train_dataloader(self) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        dataset = TrainBatches(
            self.files.bin_path("train"),
            self.files.dtype,
            self.files.num_tokens("train"),
            batch_size=self.batch_size,
            context_length=self.context_length,
            seed=self.seed,
            rank=rank,
            epoch_length=self.train_batches_per_epoch(),
        )
        return self._loader(dataset, _ResumingSampler(dataset, self.batches_consumed, world_size, rank))

    def val_dataloader(self) -> DataLoader:
        n_tokens = self.files.num_tokens("val")
        num_batches = _val_batch_count(self.batch_size, n_tokens, self.context_length)
        if self.val_batches is not None:
            num_batches = min(num_batches, self.val_batches)
        dataset = _ValBatches(
            self.files.bin_path("val"),
            self.files.dtype,
            n_tokens,
            batch_size=self.batch_size,
            context_length=self.context_length,
            num_batches=num_batches,
        )
        return self._loader(dataset)

    def _loader(self, dataset: Dataset, sampler: DistributedSampler | None = None) -> DataLoader:
        # Items are whole batches (batch_size=None). Pinned, so Lightning's non-blocking copy to the GPU
        # overlaps compute (canary test_lightning_copies_batches_to_cuda_without_blocking).
        on_cuda = self.trainer is not None and isinstance(self.trainer.accelerator, CUDAAccelerator)
        return DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=on_cuda,
            persistent_workers=self.num_workers > 0,
        )
