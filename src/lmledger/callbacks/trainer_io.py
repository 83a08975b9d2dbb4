"""What the ledger callbacks read from a live Trainer, and how they write back to it.

`run_from_trainer` gathers the facts every ledger figure depends on. Model shape, batch,
precision, optimizer, sharding: it reads them from the objects Lightning has already built.
So the callbacks need no configuration of their own. It is the ledger.run.Run that account and
plan build from a config.
The writers send one-off values (a table, a measured figure) straight to the loggers, at the
current step. `LightningModule.log` would hold them until the next logging step. It would drop
them if none comes.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import TransformerEnginePrecision
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lmledger import lightning_private
from lmledger.errors import UserError
from lmledger.ledger.precision_table import PRECISIONS
from lmledger.ledger.run import Run, sharding
from lmledger.ledger.timing.steptime.replay import untouched_rng  # the one RNG guard, re-exported for the callbacks
from lmledger.model import ToyLM

__all__ = [
    "is_logging_step",
    "log_scalars",
    "log_text",
    "logging_step",
    "run_from_trainer",
    "synchronize",
    "tensorboard_writers",
    "torch_optimizers",
    "untouched_rng",
]


_DISABLE_HINT = "or run without the ledger (--ledger.enabled false)"


def run_from_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Run:
    """The ledger.run.Run of a live LitLM fit: its ToyLM, data module, precision and strategy."""
    model = getattr(pl_module, "model", None)
    if not isinstance(model, ToyLM):
        raise UserError(
            f"the ledger accounts for lmledger's ToyLM, but {type(pl_module).__name__}.model is "
            f"{type(model).__name__}: train a LitLM {_DISABLE_HINT}"
        )
    datamodule = trainer.datamodule
    batch_size = getattr(datamodule, "batch_size", None)
    seq_len = getattr(datamodule, "context_length", None)
    if not (isinstance(batch_size, int) and isinstance(seq_len, int)):
        raise UserError(
            "the ledger reads batch_size and context_length from the data module: fit with a "
            f"TokenDataModule {_DISABLE_HINT}"
        )
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise UserError(
            f"the ledger accounts for precisions {', '.join(PRECISIONS)}, not {precision}: "
            f"choose one of them {_DISABLE_HINT}"
        )
    optimizer, momentum = _optimizer_kind(trainer)
    hparams = getattr(pl_module, "hparams", {})
    plugin = trainer.precision_plugin
    return Run(
        config=model.cfg,
        module=model,
        compiled=bool(hparams.get("compile", False)),
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        weights_dtype=plugin.weights_dtype if isinstance(plugin, TransformerEnginePrecision) else None,
        fp8=hparams.get("fp8"),
        optimizer=optimizer,
        momentum=momentum,
        fused_optimizer=_optimizer_is_fused(trainer),
        strategy=_strategy_name(trainer.strategy),
        world_size=trainer.world_size,
        tensor_parallel=_tensor_parallel(trainer.strategy),
        device=pl_module.device,
    )


def torch_optimizers(trainer: pl.Trainer) -> list[torch.optim.Optimizer]:
    """The run's torch optimizers. (Some strategies wrap them; the torch one is inside.)"""
    return [getattr(o, "optimizer", o) for o in trainer.optimizers]


def _optimizer_is_fused(trainer: pl.Trainer) -> bool:
    optimizers = torch_optimizers(trainer)
    return bool(optimizers) and all(group.get("fused") for o in optimizers for group in o.param_groups)


def _optimizer_kind(trainer: pl.Trainer) -> tuple[str, float]:
    """The optimizer's ledger.closedform.memory name and SGD momentum (which decides whether SGD keeps state)."""
    if not trainer.optimizers:
        return "none", 0.0
    optimizer = torch_optimizers(trainer)[0]
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        return "adamw", 0.0
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd", float(optimizer.param_groups[0].get("momentum", 0.0))
    raise UserError(
        f"the memory ledger models AdamW, Adam and SGD, not {type(optimizer).__name__}: "
        f"use model.optimizer adamw|sgd {_DISABLE_HINT}"
    )


def _strategy_name(strategy: pl.strategies.Strategy) -> str:
    """The ledger.run.sharding name of a live Lightning strategy (as run_config names a config's)."""
    if isinstance(strategy, FSDPStrategy):
        return sharding(
            "fsdp", fsdp_sharding=getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
        )
    if isinstance(strategy, ModelParallelStrategy):
        return sharding("modelparallel")
    if isinstance(strategy, DeepSpeedStrategy):
        stage = (strategy.config or {}).get("zero_optimization", {}).get("stage", 0)
        return sharding("deepspeed", deepspeed_stage=int(stage))
    return "ddp"


def _tensor_parallel(strategy: pl.strategies.Strategy) -> int:
    """The tensor-parallel size of a ModelParallelStrategy's mesh (set up by now); 1 for any other strategy."""
    if not isinstance(strategy, ModelParallelStrategy):
        return 1
    return strategy.device_mesh["tensor_parallel"].size()


# ------------------------------------------------------------------------------------ writing


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own train metrics use (as LearningRateMonitor does: optimizer steps)."""
    return lightning_private.batches_that_stepped(trainer)


def is_logging_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes train metrics after this batch (every log_every_n_steps)."""
    return lightning_private.should_update_logs(trainer)


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Write scalars to every logger now (loggers write on global rank zero only)."""
    step = logging_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def tensorboard_writers(trainer: pl.Trainer) -> list:
    """The SummaryWriters of the run's TensorBoard loggers, on global rank zero (else none)."""
    if not trainer.is_global_zero:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def log_text(trainer: pl.Trainer, tag: str, markdown: str, step: int | None = None) -> None:
    step = logging_step(trainer) if step is None else step
    for writer in tensorboard_writers(trainer):
        writer.add_text(tag, markdown, global_step=step)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a host clock read afterwards covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
