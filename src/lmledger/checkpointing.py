"""Checkpoints that survive a kill, load without running code, and say when they do not fit.

    AtomicCheckpointIO      Lightning's checkpoint plugin over `lmledger.atomic.atomic_write`; loads weights_only
    open_checkpoint,        a missing, corrupt or mismatched checkpoint -> one UserError line
    check_checkpoint_fits
    newest_checkpoint       the checkpoint of a run directory that `--ckpt_path last` means

A kill leaves the previous file or the complete new one. Never a torn one.

Beside it: lmledger.seeding (per-batch reseeding) and lmledger.preemption (save and stop on
SIGTERM/SIGUSR1, SLURM requeue). And lmledger.rundir: a run directory of one's own, locked. It is
undone when a run is refused.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.lightning_private import is_local_path
from lmledger.model import ModelConfig

__all__ = [
    "AtomicCheckpointIO",
    "check_checkpoint_fits",
    "make_last_checkpoint_atomic",
    "newest_checkpoint",
    "open_checkpoint",
]

# Objects besides tensors and containers that our checkpoints may hold. A LitLM built in Python keeps
# its ModelConfig dataclass in hyper_parameters. (The CLI stores plain dicts.)
_SAFE_CHECKPOINT_GLOBALS = [ModelConfig]


# ------------------------------------------------------------------------------------- writing


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save/torch.load checkpoints: local saves are atomic, loads run no pickled code.

    Lightning's own local save writes a temp file in the system temp dir. It moves it into place
    without fsync (canary test_lightning_saves_through_the_system_temp_dir_without_fsync). That is a
    copy when /tmp is another filesystem. A killed save leaves a checkpoint-sized orphan there. URLs
    keep Lightning's path.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_local_path(path):
            # Lightning reads weights_only=None as False for URLs. Keep it safe unless asked otherwise
            # (canary test_remote_checkpoints_load_unsafely_by_default).
            safe = True if weights_only is None else weights_only
            return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=safe)
        if weights_only is False:
            # Only code asks for this, never the CLI. Say once that it unpickles arbitrary objects.
            rank_zero_warn(f"loading {path} with weights_only=False runs any code pickled into it")
            return torch.load(path, map_location=map_location or "cpu", weights_only=False)
        return open_checkpoint(path, map_location=map_location or "cpu")


def make_last_checkpoint_atomic(callbacks: list[pl.Callback]) -> None:
    """Keep last.ckpt whole across a kill, for every ModelCheckpoint among `callbacks`.

    With save_last="link", Lightning removes last.ckpt before linking the new one (canary
    test_link_last_removes_the_old_link_before_making_the_new_one). A kill in between leaves it
    missing or dangling. A full save through AtomicCheckpointIO never does. So "link" becomes a full save.
    """
    for callback in callbacks:
        # Lightning links only when it also keeps top-k files. With save_top_k=0, "link" saves in full.
        if isinstance(callback, ModelCheckpoint) and callback.save_last == "link" and callback.save_top_k != 0:
            callback.save_last = True
            rank_zero_warn("ModelCheckpoint(save_last='link') is not crash-safe; saving last.ckpt in full instead")


# ------------------------------------------------------------------------------------- reading


def open_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True. A missing, unreadable or non-Lightning file is one UserError line.

    With mmap=True it reads only the pickled structure: a cheap check. Tensors stay on disk until touched.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass a .ckpt file written by `lmledger fit`")
    try:
        with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # damaged files: torch raises RuntimeError, UnpicklingError, OSError, ...
        if not zipfile.is_zipfile(path):
            # A truncated archive gives a bare "[Errno 22] Invalid argument" from torch.
            reason = "not a complete zip archive: truncated, or not written by torch.save"
        elif "Weights only load failed" in str(err):
            reason = "it holds pickled objects other than tensors and plain containers, refused for safety"
        else:  # torch's messages run to several sentences of advice. The first names the damage.
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


def _checkpoint_step(path: str | os.PathLike) -> int | None:
    """A checkpoint's recorded global_step (read through mmap: cheap); None if unreadable."""
    try:
        with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # a damaged file is reported when opened for real, if it is the one chosen
        return None


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint in `checkpoint_dir` that has trained furthest.

    That is the largest recorded global_step; among equals, the newest modification time. Candidates
    are last.ckpt, last-v1.ckpt (after a moved run directory) and top-k files.
    """
    found = []
    for path in Path(checkpoint_dir).glob("*.ckpt"):
        if path.is_file():
            step = _checkpoint_step(path)
            found.append((-1 if step is None else step, path.stat().st_mtime_ns, path))
    return max(found)[2] if found else None
