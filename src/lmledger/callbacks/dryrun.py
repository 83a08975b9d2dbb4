"""What the Ledger dry-runs for a live module: its batch, and one rank's training_step.

Tokens per batch: the module's `tokens_per_batch`, if it has one. That is an int, or a method taking the batch.
Else the element count of the batch's first integer rank-2 tensor (token ids, batch x sequence).
A batch with none has samples (the first tensor's first dimension): the run reports samples/s.

The dry run follows the trainer: its optimizers, precision and accumulation, and its strategy.
One device or DDP runs the module's own step on a fake copy (ledger.dryrun.moe, ledger.sharding.sharded).
ModelParallelStrategy (FSDP2) dry-runs the meta copy kept at setup (callbacks.fsdp2).
Other sharded strategies get one line saying why, and are measured only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lmledger.callbacks import fsdp2
from lmledger.callbacks.trainer_io import torch_optimizers, untouched_rng
from lmledger.errors import UserError
from lmledger.ledger.dryrun import moebounds
from lmledger.ledger.dryrun.engine import LargestBatch, NotTraced, StepLedger, search_batch
from lmledger.ledger.dryrun.fakecopy import batch_tensors
from lmledger.ledger.predict import lightning_step
from lmledger.ledger.run import Run
from lmledger.ledger.sharding import sharded
from lmledger.ledger.sharding.ddp import DDPSettings
from lmledger.model import ToyLM

__all__ = [
    "ddp_arguments",
    "dry_run_training_step",
    "is_toy_run",
    "largest_training_batch",
    "replicated_ranks",
    "samples_per_batch",
    "tokens_per_batch",
    "toy_batch",
]


# --------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------


def tokens_per_batch(pl_module: pl.LightningModule, batch: object) -> int | None:
    """Tokens in `batch`, or None when the batch holds no token ids.

    As the module docstring says: the module's `tokens_per_batch`, else the first integer rank-2 tensor's size.
    """
    told = getattr(pl_module, "tokens_per_batch", None)
    if callable(told):
        told = told(batch)
    if told is not None:
        if not isinstance(told, int) or isinstance(told, bool) or told < 0:
            raise UserError(
                f"{type(pl_module).__name__}.tokens_per_batch gave {told!r}: it must be a non-negative int "
                "(or a method returning one)"
            )
        return told
    for t in batch_tensors(batch):
        if t.ndim == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return None


def samples_per_batch(batch: object) -> int:
    """The first tensor's first dimension (1 for a batch with no tensors or a 0-dim one)."""
    tensors = batch_tensors(batch)
    return tensors[0].shape[0] if tensors and tensors[0].ndim else 1


def is_toy_run(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """lmledger's own run: a ToyLM at `.model` and a data module that states batch_size and context_length."""
    datamodule = getattr(trainer, "datamodule", None)
    return (
        isinstance(getattr(pl_module, "model", None), ToyLM)
        and isinstance(getattr(datamodule, "batch_size", None), int)
        and isinstance(getattr(datamodule, "context_length", None), int)
    )


def toy_batch(run: Run, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch shaped like the TokenDataModule's (inputs, targets). On the meta device: the dry run reads shapes."""
    shape = (run.batch_size if size is None else size, run.seq_len)
    return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")


# --------------------------------------------------------------------------------------------
# The dry run of a live module
# --------------------------------------------------------------------------------------------


def dry_run_training_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, accumulate: int = 1,
    unsharded: torch.nn.Module | None = None,
) -> StepLedger | moebounds.MoEBounds | NotTraced:  # fmt: skip
    """The dry run of `pl_module.training_step` on `batch`, or why there is none.

    It uses the trainer's optimizer, precision and accumulation. Where top-k routing decides a shape, it
    gives two: balanced and worst routing (ledger.dryrun.moe). The copy keeps the trainer and logs nothing. The
    RNG streams are untouched. Under ModelParallelStrategy (FSDP2), it is one rank's step on `unsharded`:
    the module as setup saw it.
    """
    why = _not_modelled(trainer, pl_module)
    if why is not None:
        return NotTraced(why)
    predict = _rank_step(trainer, pl_module, batch_idx, accumulate, unsharded)
    with untouched_rng(pl_module.device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return predict(batch)
        except UserError as err:
            return NotTraced(str(err))


def largest_training_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch_for: Callable[[int], object], capacity_bytes: int,
    limit: int, accumulate: int = 1, unsharded: torch.nn.Module | None = None,
) -> LargestBatch | NotTraced:  # fmt: skip
    """The largest batch b <= limit whose dry-run peak fits `capacity_bytes` (dryrun.search_batch).

    Each probe is the dry run dry_run_training_step makes, of `batch_for(b)`: per rank under DDP and FSDP2,
    worst routing's peak where routing decides a shape (the memory check holds that one).
    """
    why = _not_modelled(trainer, pl_module)
    if why is not None:
        return NotTraced(why)
    predict = _rank_step(trainer, pl_module, 0, accumulate, unsharded)

    def bound(batch: object) -> StepLedger | NotTraced:
        result = predict(batch)
        return result.worst if isinstance(result, moebounds.MoEBounds) else result

    with untouched_rng(pl_module.device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return search_batch(bound, batch_for, capacity_bytes, limit)
        except UserError as err:
            return NotTraced(str(err))


def _rank_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int, accumulate: int,
    unsharded: torch.nn.Module | None,
) -> Callable[[object], StepLedger | moebounds.MoEBounds | NotTraced]:  # fmt: skip
    """`predict(batch)`: one rank's dry run under this trainer's strategy, the one place it is told apart.

    FSDP2 (ModelParallelStrategy): the unsharded copy's step (callbacks.fsdp2). DDP: one rank's step with
    its gradient buckets (ledger.sharding.ddp_dryrun). One device: the module's step, both routings where top-k
    routing decides a shape (ledger.dryrun.moebounds).
    """
    if isinstance(trainer.strategy, ModelParallelStrategy):  # configure_model sharded pl_module: callbacks.fsdp2
        return lambda batch: fsdp2.predict_fsdp2_rank(trainer, pl_module, unsharded, batch, batch_idx, accumulate)
    if replicated_ranks(trainer) > 1:
        arguments = ddp_arguments(trainer, pl_module, batch_idx, accumulate)
        return lambda batch: sharded.predict_sharded(pl_module, batch, **arguments)
    optimizers = torch_optimizers(trainer)
    manual = not pl_module.automatic_optimization
    arguments = dict(
        step=lightning_step(batch_idx, trainer),
        optimizer=optimizers if manual else (optimizers[0] if optimizers else None), precision=str(trainer.precision),
        device=pl_module.device, share=(trainer,), accumulate=accumulate, manual=manual,
    )  # fmt: skip
    return lambda batch: moebounds.dry_run_bounds(pl_module, batch, **arguments)


def ddp_arguments(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int, accumulate: int) -> dict:
    """predict_sharded's arguments for one rank of this DDP trainer.

    Accumulation: the micro-batches before the last run under no_sync, as Lightning runs them.
    Manual: each manual_backward fills the buckets. Not when the step turned the real wrapper's
    require_backward_grad_sync off (trainer.strategy.block_backward_sync()). That flag is read as it runs.
    """
    optimizers = torch_optimizers(trainer)
    manual = not pl_module.automatic_optimization
    return dict(
        step=lightning_step(batch_idx, trainer),
        optimizer=optimizers if manual else (optimizers[0] if optimizers else None),
        precision=str(trainer.precision), strategy="ddp", world_size=trainer.world_size,
        ddp=DDPSettings.from_kwargs(getattr(trainer.strategy, "_ddp_kwargs", {}) or {}),
        device=pl_module.device, accumulate=accumulate, manual=manual,
        synced=lambda: getattr(trainer.strategy.model, "require_backward_grad_sync", True),
    )  # fmt: skip


def replicated_ranks(trainer: pl.Trainer) -> int:
    """The world size of a DDP run (every rank holds the whole model), else 1."""
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):
        return trainer.world_size
    return 1


def _not_modelled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the dry run does not apply to this run, or None."""
    modelled = isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy))
    if not modelled or isinstance(trainer.strategy, DeepSpeedStrategy):  # DeepSpeed subclasses DDPStrategy
        return (
            f"{type(trainer.strategy).__name__} shards the model; the live dry run models replicated devices and "
            "FSDP2 (ModelParallelStrategy)"
        )
    return None
