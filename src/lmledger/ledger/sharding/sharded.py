"""The per-rank ledger of a data-parallel step at world size W, predicted in one process.

`predict_sharded(module, batch, strategy=..., world_size=W)` dry-runs the step one rank runs
(ledger.dryrun.engine). The model on fake tensors is wrapped as the rank wraps it:

    ddp      the single-device step plus DDP's gradient buckets (ledger.sharding.ddp_dryrun, ledger.sharding.ddp): flat
             buffers made on the fake copy and filled from each parameter's post-accumulate-grad hook, as
             the Reducer's autograd hook fills them; under gradient_as_bucket_view `param.grad` becomes
             the bucket's view. Gradient accumulation (the micro-batches before the last under no_sync,
             as Lightning runs them) and manual optimization (each manual_backward synchronised unless
             the step turns DDP's sync off: `synced`) included.
    fsdp2    torch's `fully_shard` on the fake copy over torch's fake process group of W ranks
             (ledger.sharding.fsdp2): sharded DTensor parameters, grads and AdamW state, the all-gather and
             reduce-scatter buffers, reshard after forward on or off, activation checkpointing.
    zero1/2/3, fsdp (FSDP1), deepspeed_stage_N
             not traced: the state bytes per rank are ledger.closedform.memory's closed forms (DeepSpeed's own
             allocation rules); their peak is not predicted (`ShardedLedger.peak_checked` False).

Counted per rank, on the local shards (ledger.sharding.rankstate). The measured twin is ledger.sharding.realranks. There
`measure_sharded` runs inside a real process group, and `spawn_gloo_ranks` starts W gloo processes on this CPU.
Sizing at scale is ledger.sharding.atscale (`at_scale`, `toy_at_scale`, `toy_inputs`), which imports this module.
This module is the entry point of one rank's step: callers import the DDP, FSDP2 and rank-state names from
here. Pure torch: no Lightning import.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.closedform import memory as ledger_memory
from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun.engine import LargestBatch, NotTraced, OptimizerSpec, StepFn
from lmledger.ledger.sharding.ddp import DDPSettings
from lmledger.ledger.sharding.ddp_dryrun import predict_ddp
from lmledger.ledger.sharding.fsdp2 import (  # noqa: F401  (the entry point's names)
    DEFAULT_FSDP,
    FSDPSettings,
    fake_process_group,
    fsdp2_shard_bytes,
    predict_fsdp2,
    shard_blocks,
)
from lmledger.ledger.sharding.rankstate import (  # noqa: F401
    NOT_MODELLED,
    STATE_ONLY,
    TRACED,
    ShardedLedger,
    local_state_bytes,
    sharded_ledger,
    strategy_name,
)
from lmledger.ledger.sharding.realranks import measure_sharded, spawn_gloo_ranks  # noqa: F401

__all__ = [
    "DEFAULT_FSDP",
    "NOT_MODELLED",
    "STATE_ONLY",
    "TRACED",
    "DDPSettings",
    "FSDPSettings",
    "ShardedLedger",
    "fake_process_group",
    "fsdp2_shard_bytes",
    "largest_batch_sharded",
    "local_state_bytes",
    "measure_sharded",
    "predict_fsdp2",
    "predict_sharded",
    "spawn_gloo_ranks",
    "shard_blocks",
    "sharded_ledger",
    "strategy_name",
]

_DEFAULT_DDP = DDPSettings()


def predict_sharded(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec | list = None,
    precision: str | int = "32-true",
    strategy: str = "ddp",
    world_size: int = 1,
    ddp: DDPSettings = _DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
    device: torch.device | str | None = None,
    activation_checkpointing: bool | None = None,
    accumulate: int = 1,
    manual: bool = False,
    synced: Callable[[], bool] | None = None,
) -> ShardedLedger | NotTraced:
    """One rank's steady-state training step of `module` at `world_size` (module docstring).

    Arguments are as dryrun.dry_run's; `batch` is one rank's micro-batch.

        strategy                  "ddp" (also "auto", "single_device"), "fsdp2" (torch's fully_shard /
                                  Lightning's ModelParallelStrategy), or a state-only one (STATE_ONLY)
        activation_checkpointing  None runs the model as it is; True checkpoints every block (each child of
                                  an nn.ModuleList) on the copy with torch's non-reentrant checkpoint_wrapper,
                                  as Lightning's FSDP strategies' activation_checkpointing_policy and
                                  torchtitan do
        accumulate, manual        micro-batches per optimizer step and manual optimization, as dry_run takes
                                  them (DDP: ledger.sharding.ddp_dryrun)
        synced                    under manual optimization: whether a backward running now fills DDP's
                                  buckets, read as it runs. Default: every one does, as Lightning's
                                  manual_backward prepares the Reducer each time. The live Ledger passes the
                                  DDP wrapper's require_backward_grad_sync, so a training step's own no_sync
                                  is followed

    What it cannot model returns NotTraced, with one line. That covers tensor or pipeline parallelism, a
    world size the mesh cannot take, and a torch without the fake process group. It covers accumulation or
    manual optimization beyond DDP, and a model the dry run cannot trace. Bad input is a UserError.
    """
    if activation_checkpointing:
        return _with_checkpointed_blocks(
            predict_sharded, module, batch, step=step, optimizer=optimizer, precision=precision,
            strategy=strategy, world_size=world_size, ddp=ddp, fsdp=fsdp, device=device, accumulate=accumulate,
            manual=manual, synced=synced,
        )  # fmt: skip
    name = strategy_name(strategy)
    if isinstance(name, NotTraced):
        return name
    if not isinstance(world_size, int) or world_size < 1:
        return NotTraced(f"world size {world_size!r} is not a positive whole number of ranks")
    if not (isinstance(accumulate, int) and accumulate >= 1):
        raise UserError(f"accumulate must be a positive number of micro-batches, got {accumulate!r}")
    if name not in TRACED and (accumulate > 1 or manual):
        what = "manual optimization" if manual else "gradient accumulation"
        return NotTraced(f"the sharded dry run does not model {what} under {name} yet: the run is measured only")
    if name == "fsdp2":
        return predict_fsdp2(
            module, batch, step=step, optimizer=optimizer, precision=precision, world_size=world_size,
            settings=fsdp, device=device, accumulate=accumulate, manual=manual,
        )  # fmt: skip
    if name in STATE_ONLY:
        return _predict_state_only(module, batch, step, optimizer, precision, name, world_size, device)
    return predict_ddp(
        module, batch, step=step, optimizer=optimizer, precision=precision, world_size=world_size, settings=ddp,
        device=device, accumulate=accumulate, manual=manual, synced=synced,
    )  # fmt: skip


def _with_checkpointed_blocks(predict: Callable, module: nn.Module, batch: object, **kwargs) -> object:
    """predict(copy, batch, **kwargs) on a copy of module whose blocks are checkpointed.

    The copy shares the real tensors: deepcopy's memo maps each to itself, so none is copied. Only the
    wrappers are new.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
    )

    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    for sub in module.modules():
        memo.update({id(v): v for v in vars(sub).values() if isinstance(v, torch.Tensor)})
    copied = copy.deepcopy(module, memo)
    blocks = {id(b) for sub in copied.modules() if isinstance(sub, nn.ModuleList) for b in sub}
    if not blocks:
        return NotTraced(f"{type(module).__name__} has no nn.ModuleList of blocks to checkpoint")
    apply_activation_checkpointing(
        copied, checkpoint_wrapper_fn=_non_reentrant(CheckpointImpl), check_fn=lambda m: id(m) in blocks
    )
    return predict(copied, batch, **kwargs)


def _non_reentrant(impl) -> Callable:
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return partial(checkpoint_wrapper, checkpoint_impl=impl.NO_REENTRANT)


def largest_batch_sharded(
    module: nn.Module,
    batch_for: Callable[[int], object],
    capacity_bytes: int,
    *,
    limit: int = 1 << 16,
    **kwargs: object,
) -> LargestBatch | NotTraced:
    """The largest per-rank micro-batch b <= limit whose predict_sharded peak is at most capacity_bytes.

    The kwargs are passed on to predict_sharded. The search is dryrun.largest_batch's (dryrun.search_batch).
    """
    return dryrun.search_batch(lambda b: predict_sharded(module, b, **kwargs), batch_for, capacity_bytes, limit)


# --------------------------------------------------------------------------------------------
# ZeRO / FSDP1 / DeepSpeed: state per rank, peak not yet held to a measurement
# --------------------------------------------------------------------------------------------


def _predict_state_only(module, batch, step, optimizer, precision, strategy, world_size, device):
    """ZeRO, FSDP1, DeepSpeed: the single-device step with ledger.closedform.memory's state bytes per rank.

    The peak is unchecked.
    """
    single = dryrun.dry_run(module, batch, step=step, optimizer=optimizer, precision=precision, device=device)
    if isinstance(single, NotTraced):
        return single
    n = sum(p.numel() for p in module.parameters())
    states = ledger_memory.optimizer_states(_optimizer_name(optimizer, module)) if optimizer is not None else 0
    name = {0: "none", 1: "sgd", 2: "adamw"}[min(states, 2)]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    state = ledger_memory.state_bytes(n, precision, name, strategy, world_size, largest_layer=largest)
    whole = single.params + single.grads + single.optimizer
    peak = single.peak - whole + sum(state.values())
    phase_peaks = {k: v - whole + sum(state.values()) for k, v in single.phase_peaks.items()}
    replaced = dataclasses.replace(single, **state, peak=peak, phase_peaks=phase_peaks)
    return sharded_ledger(replaced, strategy, world_size, peak_checked=False)


def _optimizer_name(optimizer: OptimizerSpec, module: nn.Module) -> str:
    made = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if made is None:
        with torch.device("meta"):
            made = optimizer([nn.Parameter(torch.empty(1))])
    name = type(made).__name__.lower()
    if name in ("adamw", "adam"):
        return name
    if name == "sgd":
        return "sgd" if made.param_groups[0].get("momentum") else "none"
    return "adamw"
