"""Never train on NaNs: a step whose loss or gradients are not finite stops the run, or is skipped.

The check runs after backward and before the optimizer step, so the weights and optimizer state are still
those of the last good step. Stopping raises NonFiniteLossError (a UserError: one line from the CLI, exit 2)
naming the step and the newest checkpoint saved before it. Skipping drops the update: the gradients are
discarded, so optimizer.step() leaves every parameter and its Adam moments untouched, while the batch,
the step counter and the LR schedule move on, as with fp16's GradScaler skipping an overflowed step.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lmledger.checkpointing import open_checkpoint
from lmledger.errors import UserError


class NonFiniteLossError(UserError):
    """A training step produced a NaN or infinite loss or gradient and no skips were left."""


class NonFiniteGuard(pl.Callback):
    """Stops training at the first non-finite step, or skips up to `max_skips` of them over the run.

    Args:
        max_skips: non-finite steps to skip (no update applied) before stopping; 0 stops at the first.
    """

    def __init__(self, max_skips: int = 0) -> None:
        if max_skips < 0:
            raise UserError(f"nonfinite.max_skips must be >= 0, got {max_skips}")
        self.max_skips = max_skips
        self.skipped = 0  # over the whole run: checkpointed, so a resumed run keeps counting
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses (non-finite iff one is)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach().float().sum()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        loss, self._loss_sum = self._loss_sum, None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Under fp16's GradScaler, inf gradients are routine (it lowers the scale and skips the step
        # itself), so only the loss is checked there.
        check_grads = params and getattr(trainer.precision_plugin, "scaler", None) is None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if check_grads else None
        checks = [t.float() for t in (loss, norm) if t is not None]
        if not checks:
            return
        # One host sync per step; the decision is shared so that every rank stops or skips together.
        if trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(torch.stack(checks)).all()), all=True):
            return

        loss_value = None if loss is None else loss.item()
        if loss_value is not None and not math.isfinite(loss_value):
            problem = f"loss is {loss_value}"
        else:
            problem = f"gradient norm is {norm.item()}" + ("" if loss_value is None else f" (loss {loss_value:.4g})")
        step = trainer.global_step
        if self.skipped < self.max_skips:
            self.skipped += 1
            for p in params:
                p.grad = None  # optimizers skip parameters without a gradient
            rank_zero_warn(f"step {step}: {problem}; update skipped ({self.skipped} of max_skips {self.max_skips})")
            return
        earlier = (
            f" ({self.skipped} earlier non-finite steps skipped, max_skips {self.max_skips})" if self.skipped else ""
        )
        raise NonFiniteLossError(
            f"step {step}: {problem}; stopped before applying it{earlier}. {_last_checkpoint(trainer)}. "
            "Lower --model.lr or lengthen warm-up, or let --nonfinite.max_skips K skip such steps"
        )

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped = state_dict["skipped"]


def _last_checkpoint(trainer: pl.Trainer) -> str:
    """'Last good checkpoint: PATH (step N)' for the newest checkpoint this run saved or resumed from."""
    candidates = [trainer.ckpt_path] if trainer.ckpt_path else []
    for callback in trainer.checkpoint_callbacks:
        candidates += [getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")]
    existing = [Path(c) for c in candidates if c and Path(c).is_file()]
    if not existing:
        return "No checkpoint was saved before it"
    newest = max(existing, key=lambda p: p.stat().st_mtime_ns)
    try:
        step = open_checkpoint(newest, mmap=True).get("global_step")
    except UserError:
        step = None
    return f"Last good checkpoint: {newest}" + (f" (step {step})" if step is not None else "")
