"""Checkpoints that survive a kill, load without running code, and say clearly when they do not fit.

- `AtomicCheckpointIO` is Lightning's checkpoint plugin over `lmledger.atomic.atomic_write` (a kill leaves
  the previous file or the complete new one, never a torn one); it loads with weights_only=True.
- `open_checkpoint` / `check_checkpoint_fits` turn a missing, corrupt or mismatched checkpoint into one UserError line.
- `StepSeeder` makes each training batch's random state a function of (seed, rank, batch), so a resumed run
  draws the same random numbers as an uninterrupted one without saving generator states.
- `PreemptionCheckpoint` turns SIGTERM into "finish this step, save last.ckpt, stop" (`Preempted`).
- `newest_checkpoint` / `claim_version_dir`: which checkpoint `--ckpt_path last` means; a run directory
  of one's own even when two runs of the same name start together.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.lightning_private import (
    accumulating,
    batches_fetched,
    is_local_path,
    save_last_checkpoint,
    take_received_sigterm,
)
from lmledger.model import ModelConfig

# Objects besides tensors and containers that our checkpoints may hold: a LitLM built in Python (not through
# the CLI, which stores plain dicts) keeps its ModelConfig dataclass in hyper_parameters.
SAFE_CHECKPOINT_GLOBALS = [ModelConfig]


# ------------------------------------------------------------------------------------- writing


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save/torch.load checkpoints; local saves are atomic and loads refuse to run pickled code.

    Lightning's own local save writes a temp file in the system temp dir and moves it into place without
    fsync (canary test_lightning_saves_through_the_system_temp_dir_without_fsync): a copy when /tmp is
    another filesystem, and a killed save leaves a checkpoint-sized orphan there. URLs keep Lightning's path.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_local_path(path):
            # Lightning reads weights_only=None as False for URLs; keep it safe unless asked otherwise
            # (canary test_remote_checkpoints_load_unsafely_by_default).
            safe = True if weights_only is None else weights_only
            return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=safe)
        if weights_only is False:
            # Only code can ask for this (the CLI never does); say once that it unpickles arbitrary objects.
            rank_zero_warn(f"loading {path} with weights_only=False runs any code pickled into it")
            return torch.load(path, map_location=map_location or "cpu", weights_only=False)
        return open_checkpoint(path, map_location=map_location or "cpu")


def make_last_checkpoint_atomic(callbacks: list[pl.Callback]) -> None:
    """Keep last.ckpt whole across a kill for every ModelCheckpoint among `callbacks`.

    With save_last="link" Lightning removes last.ckpt before linking the new one (canary
    test_link_last_removes_the_old_link_before_making_the_new_one): a kill in between leaves it missing or
    dangling. A full save through AtomicCheckpointIO never does, so "link" becomes a full save.
    """
    for callback in callbacks:
        # Lightning links only when it also keeps top-k files; with save_top_k=0 "link" already saves in full.
        if isinstance(callback, ModelCheckpoint) and callback.save_last == "link" and callback.save_top_k != 0:
            callback.save_last = True
            rank_zero_warn("ModelCheckpoint(save_last='link') is not crash-safe; saving last.ckpt in full instead")


# ------------------------------------------------------------------------------------- reading


def open_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True; a missing, unreadable or non-Lightning file is one UserError line.

    mmap=True reads only the pickled structure (tensors stay on disk until touched): a cheap check.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass a .ckpt file written by `lmledger fit`")
    try:
        with torch.serialization.safe_globals(SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, OSError, ... for damaged files
        if not zipfile.is_zipfile(path):
            # A truncated archive gives a bare "[Errno 22] Invalid argument" from torch.
            reason = "not a complete zip archive: truncated, or not written by torch.save"
        elif "Weights only load failed" in str(err):
            reason = "it holds pickled objects other than tensors and plain containers, refused for safety"
        else:  # torch's messages run to several sentences of advice; the first names the damage
            reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"checkpoint {path} cannot be read ({reason}); pass a .ckpt file written by `lmledger fit`"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"checkpoint {path} has no state_dict: it is not a Lightning checkpoint from `lmledger fit`")
    return checkpoint


def _as_dict(config: Any) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config) if isinstance(config, dict) else {}


def check_checkpoint_fits(path: str | os.PathLike, module: pl.LightningModule) -> None:
    """UserError unless `path` holds exactly the tensors `module` has, with the same shapes."""
    checkpoint = open_checkpoint(path, mmap=True)
    theirs = checkpoint["state_dict"]
    ours = module.state_dict()
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    wrong_shape = [k for k in ours if k in theirs and tuple(theirs[k].shape) != tuple(ours[k].shape)]
    if not (missing or unexpected or wrong_shape):
        return
    if wrong_shape:
        k = wrong_shape[0]
        problem = f"{k} is {list(theirs[k].shape)} there but {list(ours[k].shape)} here"
    elif missing:
        problem = f"it lacks {len(missing)} tensors of this model (e.g. {missing[0]})"
    else:
        problem = f"it holds {len(unexpected)} tensors this model lacks (e.g. {unexpected[0]})"
    saved = _as_dict(checkpoint.get("hyper_parameters", {}).get("config"))
    current = _as_dict(module.hparams.get("config")) if hasattr(module, "hparams") else {}
    differences = [f"{k}={saved[k]} there, {current[k]} here" for k in current if k in saved and saved[k] != current[k]]
    trained_with = f" (model.config: {'; '.join(differences)})" if differences else ""
    raise UserError(
        f"checkpoint {path} does not fit this model: {problem}{trained_with}; use the config it was trained "
        "with (config.yaml in its run directory) or start a fresh run"
    )


# ------------------------------------------------------------------------------------- randomness


def step_seed(seed: int, rank: int, batch: int) -> int:
    """A 63-bit seed for training batch `batch` on `rank`, well mixed by SeedSequence."""
    state = np.random.SeedSequence(seed, spawn_key=(rank, batch)).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class StepSeeder(pl.Callback):
    """Reseeds torch (CPU and every CUDA device), numpy and `random` before each training batch.

    Lightning checkpoints model, optimizer, schedule and loop progress but no generator states. Even saved
    states would not make resume exact: dataloader iterators, validation and measurement callbacks draw from
    the global generators between steps, differently in a resumed run. Keying each batch's random state
    on (seed, rank, batch index) instead makes dropout masks and other draws in batch i the same however
    the run got there. The seed is the one `seed_everything` set (LightningCLI's `seed_everything:`);
    without one, nothing is reseeded.
    """

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        seed = os.environ.get("PL_GLOBAL_SEED")
        if seed is None:
            return
        batch_index = batches_fetched(trainer) - 1
        value = step_seed(int(seed), trainer.global_rank, batch_index)
        random.seed(value)
        np.random.seed(value % 2**32)
        torch.manual_seed(value)  # also seeds every CUDA device


# ------------------------------------------------------------------------------------- run directories


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The global_step recorded in a checkpoint (read through mmap: cheap), or None if it cannot be read."""
    try:
        with torch.serialization.safe_globals(SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # a damaged file is reported when it is opened for real, if it is the one chosen
        return None


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint in `checkpoint_dir` that has trained furthest: the largest recorded global_step, the
    newest modification time among equals (last.ckpt, last-v1.ckpt after a moved run directory, top-k files)."""
    found = []
    for path in Path(checkpoint_dir).glob("*.ckpt"):
        if path.is_file():
            step = checkpoint_step(path)
            found.append((-1 if step is None else step, path.stat().st_mtime_ns, path))
    return max(found)[2] if found else None


_VERSION = re.compile(r"version_(\d+)")


def versions(run_root: str | os.PathLike) -> list[int]:
    """The N of every `run_root/version_N` directory."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir())


def claim_version_dir(run_root: str | os.PathLike) -> int:
    """Create `run_root/version_N` for the next free N and return N.

    mkdir is atomic: of two runs that pick the same N at the same moment, one creates it and the other
    moves on to N+1 (TensorBoardLogger lists the directory and creates the version later: both took N).
    """
    root = Path(run_root)
    root.mkdir(parents=True, exist_ok=True)
    n = max(versions(root), default=-1) + 1
    while True:
        try:
            (root / f"version_{n}").mkdir()
            return n
        except FileExistsError:
            n += 1


# ------------------------------------------------------------------------------------- preemption


class Preempted(SIGTERMException):
    """Training stopped on SIGTERM after a complete step; `checkpoint` holds it (None: nothing was saved)."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        super().__init__(143)
        self.step, self.checkpoint = step, checkpoint


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (SLURM's and Kubernetes' notice of preemption) finish the current optimizer step, save
    last.ckpt atomically, and stop the fit with `Preempted`.

    Lightning's own handler stops after the current batch without saving, mid-accumulation alike, and
    exits 0 (canary test_lightning_stops_on_sigterm_without_saving). Here the handler only takes note;
    the save follows the optimizer step (where ModelCheckpoint saves) and the stop comes at the next
    batch's start, after that step's logging and validation. One process only: under DDP the ranks would
    first have to agree on the step, so Lightning's handling (and SLURM's SIGUSR1 requeue) stays.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saved: str | None = None
        self._saved_step = -1
        self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 or not hasattr(signal, "SIGTERM"):
            return
        # A SIGTERM during set-up or the sanity check reached Lightning's handler: take it over.
        self.requested = take_received_sigterm(trainer)
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: leave Lightning's handler in place
            self._previous_handler = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.requested and self._saved_step == trainer.global_step:
            raise Preempted(trainer.global_step, self.saved)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.requested or accumulating(trainer):
            return  # mid-accumulation: the step is not complete yet
        self.saved = self._save_last(trainer)
        self._saved_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handler()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    @staticmethod
    def _save_last(trainer: pl.Trainer) -> str:
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        for callback in checkpoints:
            if callback.save_last and callback.dirpath:
                return save_last_checkpoint(callback, trainer)
        if checkpoints and checkpoints[0].dirpath:
            directory = Path(checkpoints[0].dirpath)
        elif trainer.log_dir is not None:
            directory = Path(trainer.log_dir) / "checkpoints"
        else:
            directory = Path(trainer.default_root_dir) / "checkpoints"
        path = str(directory / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}")
        trainer.save_checkpoint(path)
        return path
