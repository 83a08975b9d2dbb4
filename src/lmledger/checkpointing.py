"""Checkpoints that survive a kill, load without running code, and say when they do not fit.

    AtomicCheckpointIO      Lightning's checkpoint plugin over `lmledger.atomic.atomic_write`; loads weights_only
    open_checkpoint,        a missing, corrupt or mismatched checkpoint -> one UserError line
    check_checkpoint_fits
    newest_checkpoint       the checkpoint of a run directory that `--ckpt_path last` means
    load_sharded_in_full    a sharded (FSDP2, torch.distributed.checkpoint) checkpoint directory, read weights-only
                            into one full state (its atomic save and strategy loads: lmledger.modelparallel_checkpoints)

A kill leaves the previous file (or directory) or the complete new one. Never a torn one.

Beside it: lmledger.seeding (per-batch reseeding) and lmledger.preemption (save and stop on
SIGTERM/SIGUSR1, SLURM requeue). And lmledger.rundir: a run directory of one's own, locked. It is
undone when a run is refused.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from lmledger.atomic import TEMP_NAME, atomic_write
from lmledger.errors import UserError
from lmledger.lightning_private import is_local_path
from lmledger.model import ModelConfig

__all__ = [
    "AtomicCheckpointIO",
    "check_checkpoint_fits",
    "is_sharded_checkpoint",
    "load_sharded_in_full",
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
        if Path(path).is_dir():  # a sharded checkpoint resumed by a strategy that does not shard (one device, DDP)
            return load_sharded_in_full(path)
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
    if path.is_dir():
        return _open_sharded(path)
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
    path = Path(path)
    try:
        if path.is_dir():  # sharded: the step is in Lightning's meta.pt beside the shards
            if not is_sharded_checkpoint(path):
                return None
            path = path / SHARDED_META
        with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # a damaged file is reported when opened for real, if it is the one chosen
        return None


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint in `checkpoint_dir` that has trained furthest.

    That is the largest recorded global_step; among equals, the newest modification time. Candidates
    are last.ckpt, last-v1.ckpt (after a moved run directory) and top-k files, single files or sharded
    directories alike. Also a whole one `lmledger.atomic.publish` had moved aside when a kill cut its
    swap short (".last.ckpt.PID.HEX.old", only where the file system cannot swap names atomically). A
    directory cut short while it was staged (".tmp") is never a candidate.
    """
    found = []
    directory = Path(checkpoint_dir)
    candidates = list(directory.glob("*.ckpt"))
    for aside in directory.glob(".*.old"):
        match = TEMP_NAME.fullmatch(aside.name)
        if match and match["kind"] == "old" and not (directory / match["name"]).exists():
            candidates.append(aside)
    for path in candidates:
        if path.is_file() or is_sharded_checkpoint(path):
            step = _checkpoint_step(path)
            found.append((-1 if step is None else step, path.stat().st_mtime_ns, path))
    return max(found)[2] if found else None


# ------------------------------------------------------------------------- sharded checkpoints
# Lightning's ModelParallelStrategy (`--trainer.strategy fsdp2`) saves a directory: torch.distributed.checkpoint
# (DCP) shards, one file per rank (__R_0.distcp), DCP's index (.metadata, written last by rank 0 once every rank
# has written and fsynced its shard), and Lightning's meta.pt (everything but the model and optimizer state).

SHARDED_INDEX = ".metadata"  # torch.distributed.checkpoint.filesystem's metadata file name
SHARDED_META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A whole sharded checkpoint directory: its DCP index and Lightning's meta.pt are both there."""
    path = Path(path)
    return path.is_dir() and (path / SHARDED_INDEX).is_file() and (path / SHARDED_META).is_file()


class _IndexUnpickler(pickle.Unpickler):
    """DCP's .metadata is a plain pickle (torch reads it with pickle.load). Only its own classes may load."""

    _ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" or name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's index")


def _sharded_reader(path: Path):
    """torch's FileSystemReader, reading the index through _IndexUnpickler."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / SHARDED_INDEX, "rb") as f:
                metadata = _IndexUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def _first_line(err: BaseException) -> str:
    """The first sentence of an error: torch's run to paragraphs (and a CheckpointException to one per rank)."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException: per rank
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_first_line(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
    text = str(err).strip()
    return text.splitlines()[0].split(". ")[0][:300] if text else type(err).__name__


def _sharded_damage(path: Path, err: BaseException) -> UserError:
    reason = _first_line(err)
    return UserError(
        f"checkpoint {path} cannot be read ({reason}); pass a checkpoint written by `lmledger fit`, or an older "
        "one of the run (checkpoints/*.ckpt)"
    )


def _read_sharded(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Entries of a sharded checkpoint in full, in this process, with no process group.

    Tensors become whole (unsharded) CPU tensors; the other values (the optimizer's param groups) load
    weights-only, where torch's own planner would unpickle anything (weights_only=False in
    DefaultLoadPlanner.load_bytes, torch 2.13). Private torch names: canary in tests/fitting/test_resume_matrix.py.
    """
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class WeightsOnly(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
                obj = torch.load(value, map_location="cpu", weights_only=True)
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=_sharded_reader(path), planner=WeightsOnly(keys=keys), no_dist=True)
    return state


def _sharded_index(path: Path):
    with open(path / SHARDED_INDEX, "rb") as f:
        return _IndexUnpickler(f).load()


def _open_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's meta.pt, with `state_dict` as meta tensors of the saved (global) shapes.

    Cheap: no shard is read. The index and the non-tensor values are checked to hold nothing but data.
    """
    if not is_sharded_checkpoint(path):
        inside = sorted(p.name for p in path.glob("*.ckpt"))
        if inside:
            hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})"
            raise UserError(
                f"--ckpt_path {path} is a directory{hint}; pass a checkpoint file in it, or `last` for the newest "
                "checkpoint of this run's name"
            )
        missing = [name for name in (SHARDED_INDEX, SHARDED_META) if not (path / name).is_file()]
        raise UserError(
            f"checkpoint {path} is a directory without {' and '.join(missing)}: not a whole sharded checkpoint "
            "(a save cut short, or not one of `lmledger fit`); pass a checkpoint file, or a directory a "
            "--trainer.strategy fsdp2 run saved"
        )
    try:
        index = _sharded_index(path)
        groups = {k for k, v in index.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"}
        _read_sharded(path, keys=groups) if groups else None  # every pickled value must load weights-only
        with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # CheckpointException (from the weights-only read) is a BaseException
        if "Weights only load failed" in str(err) or isinstance(err, pickle.UnpicklingError):
            raise UserError(
                f"checkpoint {path} holds pickled objects other than tensors and plain containers, refused for "
                "safety; pass a checkpoint written by `lmledger fit`"
            ) from None
        raise _sharded_damage(path, err) from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"checkpoint {path} has no Lightning {SHARDED_META}: it is not a checkpoint of `lmledger fit`")
    shapes = {}
    for key, meta in index.state_dict_metadata.items():
        if key.startswith("state_dict.") and hasattr(meta, "size"):
            shapes[key.removeprefix("state_dict.")] = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
    if not shapes:
        raise UserError(f"checkpoint {path} has no state_dict: it is not a Lightning checkpoint from `lmledger fit`")
    return {**checkpoint, "state_dict": shapes}


def _by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A DCP optimizer state keyed by parameter name -> torch's own form, keyed by position in the param groups."""
    groups = state.get("param_groups", [])
    position = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    return {
        "state": {position[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**group, "params": [position[n] for n in group["params"]]} for group in groups],
    }


def load_sharded_in_full(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint dict, for a strategy that does not shard.

    The optimizer states are re-keyed from names to positions: each name's position in its saved param
    groups, which are the optimizer's own groups in order (get_optimizer_state_dict keeps them).
    """
    path = Path(path)
    checkpoint = _open_sharded(path)
    try:
        state = _read_sharded(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # CheckpointException is a BaseException
        raise _sharded_damage(path, err) from None
    checkpoint["state_dict"] = state.pop("state_dict")
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_by_position(state[k]) for k in optimizers]
    return checkpoint
