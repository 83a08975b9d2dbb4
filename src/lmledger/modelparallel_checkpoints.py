"""A ModelParallelStrategy's (FSDP2, tensor parallel) checkpoints routed through lmledger.

    save_sharded                    a sharded (torch.distributed.checkpoint) checkpoint directory: staged whole,
    make_sharded_checkpoints_safe   then renamed into place; loaded weights-only, into any strategy

Reading a checkpoint, sharded or not, is lmledger.checkpointing's; this module adds the strategy's side: its
collective save, and a single-file checkpoint loaded into sharded parameters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lmledger.atomic import fsync_dir, publish, remove_path, remove_stale_temps, temp_path
from lmledger.checkpointing import _SAFE_CHECKPOINT_GLOBALS, SHARDED_META, _first_line, _open_sharded, open_checkpoint
from lmledger.errors import UserError
from lmledger.lightning_private import is_local_path

__all__ = ["make_sharded_checkpoints_safe", "save_sharded"]


def _by_name(state: dict[str, Any], optimizer, module) -> dict[str, Any]:
    """torch's optimizer state (keyed by position) -> keyed by parameter name, for set_optimizer_state_dict.

    Lightning's own re-keying assumes the groups list the parameters in module order (FSDP's
    rekey_optim_state_dict). LitLM's groups (decay, then no decay) do not: a single-file checkpoint
    resumed under fsdp2 then fails with "The size of tensor a (48) must match the size of tensor b (32)".
    """
    names = {id(p): name for name, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = state.get("param_groups", [])
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in optimizer.param_groups]:
        raise UserError(
            "the checkpoint's optimizer has other parameter groups than this run's "
            f"({[len(g['params']) for g in saved]} parameters per group there, "
            f"{[len(g['params']) for g in optimizer.param_groups]} here); resume with the run's own config"
        )
    flat = [i for g in saved for i in g["params"]]
    name_of = dict(zip(flat, order, strict=True))
    return {
        "state": {name_of[i]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved],
    }


def _load_full_into_sharded(strategy, path: Path) -> dict[str, Any]:
    """A single-file checkpoint into a sharded model and its optimizers: each rank keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = open_checkpoint(path)
    module = strategy.model
    strict = getattr(strategy.lightning_module, "strict_loading", True)
    set_model_state_dict(
        module, checkpoint.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict)
    )
    states = checkpoint.pop("optimizer_states", [])
    for optimizer, state in zip(strategy.optimizers, states, strict=False):
        set_optimizer_state_dict(
            module, optimizer, _by_name(state, optimizer, module), options=StateDictOptions(full_state_dict=True)
        )
    return checkpoint


def save_sharded(strategy, checkpoint: dict[str, Any], filepath) -> None:
    """ModelParallelStrategy's distributed save, made atomic: a whole new directory, renamed into place.

    Every rank writes its shard into one staging directory beside the target (".last.ckpt.PID.HEX.tmp",
    PID rank 0's), never into the checkpoint in place (Lightning's own save overwrites its shards: torch warns
    "Detected an existing checkpoint ... overwriting"). After a barrier rank 0 writes meta.pt, fsyncs, and
    swaps the directory in (lmledger.atomic.publish); a last barrier keeps every rank from going on before.
    """
    from torch.distributed.checkpoint import save as dcp_save

    path = Path(strategy.broadcast(str(filepath)))
    staging = Path(strategy.broadcast(str(temp_path(path)) if strategy.is_global_zero else None))
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, [path.name])
        staging.mkdir()
    strategy.barrier("lmledger.save_sharded.staged")
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    try:
        dcp_save(state, checkpoint_id=staging)  # collective; each rank writes and fsyncs its shard, rank 0 the index
        if strategy.is_global_zero:
            _write_synced(staging / SHARDED_META, lambda f: torch.save(checkpoint, f))
            fsync_dir(staging)
        strategy.barrier("lmledger.save_sharded.written")
        if strategy.is_global_zero:
            publish(staging, path)
    except BaseException:
        if strategy.is_global_zero:
            remove_path(staging)
        raise
    strategy.barrier("lmledger.save_sharded.published")


def _holds_shards(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint dict holds DTensor shards (ModelParallelStrategy's save_distributed_checkpoint=True)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in checkpoint.get("state_dict", {}).values())


def _write_synced(path: Path, write) -> None:
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def make_sharded_checkpoints_safe(strategy) -> None:
    """Route a ModelParallelStrategy's checkpoints through lmledger: atomic sharded saves (save_sharded),
    weights-only loads, and single-file checkpoints loaded with the optimizer's own parameter order.

    Set on the instance, so a plain ModelParallelStrategy (tensor parallel) gets it as FSDP2Strategy does.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy) or "save_checkpoint" in vars(strategy):
        return
    lightning_save, lightning_load = strategy.save_checkpoint, strategy.load_checkpoint

    def save_checkpoint(checkpoint, filepath, storage_options=None) -> None:
        if storage_options is not None or not is_local_path(filepath) or not _holds_shards(checkpoint):
            return lightning_save(checkpoint, filepath, storage_options)  # save_distributed_checkpoint=False: a file
        save_sharded(strategy, checkpoint, filepath)

    def load_checkpoint(checkpoint_path, weights_only=None):
        path = Path(strategy.broadcast(str(checkpoint_path)))
        if not is_local_path(path):
            return lightning_load(checkpoint_path, weights_only)
        try:
            if path.is_file():
                return _load_full_into_sharded(strategy, path)
            _open_sharded(path)  # nothing pickled but data, before torch's loader unpickles it (weights_only=False)
            with torch.serialization.safe_globals(_SAFE_CHECKPOINT_GLOBALS):
                return lightning_load(path, True)
        except (UserError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a damaged shard, a model it does not fit: torch's error, every rank alike
            # (torch.distributed.checkpoint's CheckpointException, one per rank, is a BaseException.)
            refused = UserError(
                f"checkpoint {path} cannot be loaded into this run ({_first_line(err)}); pass an older checkpoint "
                "of the run, or start a fresh run without --ckpt_path"
            )
            refused.every_rank = True  # each rank raises it past the load's last collective: fitting.cli may close
            raise refused from None

    strategy.save_checkpoint, strategy.load_checkpoint = save_checkpoint, load_checkpoint
