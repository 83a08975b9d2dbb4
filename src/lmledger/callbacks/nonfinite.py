"""Never train on NaNs. A step whose loss or gradients are not finite stops the run, or is skipped.

The check runs after backward, before the optimizer step. So a bad step's update is never applied.
The weights and Adam moments stay those of the last good step.
Stopping raises NonFiniteLossError, a UserError (one line from the CLI, exit 2). It names the step and
the newest checkpoint saved before it.
Skipping drops the update. The batch, the step counter and the LR schedule move on.
fp16's GradScaler does the same with an overflowed step.

How is the update dropped without stalling the GPU? Fused optimizers (LitLM's AdamW and SGD) read a
`found_inf` tensor, the one GradScaler hands them. When it is 1 they return early, on the device.
Parameters, moments and step counts stay untouched. The guard sets `found_inf` from a flag computed
on the device, so no step waits for the host.
The host reads the verdict once the device has computed it, then warns of the skip or stops.
On CPU that is at once. On CUDA it is when an event recorded after the flag has completed, usually by
the next step. Under torch.distributed it is exactly one step later, on every rank.
Some steps are judged at once, at the cost of one host sync: other optimizers, an optimizer's first
step (its state is created then), and fp16 runs (their GradScaler owns `found_inf`).
Their skipped update is dropped by discarding the gradients.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lmledger.checkpointing import open_checkpoint
from lmledger.errors import UserError

__all__ = ["NonFiniteGuard", "NonFiniteLossError"]


class NonFiniteLossError(UserError):
    """A step's loss or gradient was NaN or infinite, and no skips were left."""


@dataclass
class _Verdict:
    """One step's check, on its way from the device.

    values = [bad, loss, gradient norm], 0 where unchecked."""

    step: int
    values: torch.Tensor  # on the host once `done` has completed
    has_loss: bool
    has_norm: bool
    done: torch.cuda.Event | None = None

    @classmethod
    def record(cls, step: int, bad: torch.Tensor, loss: torch.Tensor | None, norm: torch.Tensor | None) -> _Verdict:
        zero = bad.new_zeros(())
        values = torch.stack([bad, *(zero if t is None else t.detach().float().reshape(()) for t in (loss, norm))])
        if values.device.type != "cuda":
            return cls(step, values, loss is not None, norm is not None)
        host = values.to("cpu", non_blocking=True)  # lands in pinned memory; `done` says when
        done = torch.cuda.Event()
        done.record()
        return cls(step, host, loss is not None, norm is not None, done)

    def due(self, step: int, in_lockstep: bool) -> bool:
        """Whether to judge this verdict in `step`'s hook.

        A CPU verdict is there at once. Ranks must judge a verdict in the same step. (A rank that stops
        alone leaves the others waiting in a collective.) So under torch.distributed a CUDA verdict is
        judged exactly one step later, waited for if need be. The device has nearly always got that far.
        Alone, a verdict is judged as soon as it has arrived."""
        if self.done is None:
            return True
        return self.step < step if in_lockstep else self.done.query()

    def problem(self) -> str | None:
        """None for a finite step, else what was not finite, e.g. 'loss is nan'."""
        if self.done is not None:
            self.done.synchronize()
        bad, loss, norm = self.values.tolist()
        if not bad:
            return None
        if self.has_loss and not math.isfinite(loss):
            return f"loss is {loss}"
        if self.has_norm and not math.isfinite(norm):
            return f"gradient norm is {norm}" + (f" (loss {loss:.4g})" if self.has_loss else "")
        return "another rank's loss or gradients were not finite"


class NonFiniteGuard(pl.Callback):
    """Stop at the first non-finite step, or skip up to `max_skips` of them over the run.

    Args:
        max_skips: non-finite steps to skip (no update applied) before stopping; 0 stops at the first.
    """

    def __init__(self, max_skips: int = 0) -> None:
        if max_skips < 0:
            raise UserError(f"nonfinite.max_skips must be >= 0, got {max_skips}")
        self.max_skips = max_skips
        self.skipped = 0  # over the whole run: checkpointed, so a resumed run keeps counting
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses (non-finite iff one is)
        self._in_flight: deque[_Verdict] = deque()
        self._stop: tuple[_Verdict, str] | None = None  # the bad step past max_skips, and its problem

    def collectives_per_step(self, trainer: pl.Trainer) -> int:
        """The all-reduces this callback runs each optimizer step: the ranks' verdict, where there are several (the
        step-time prediction prices it: callbacks.steptime.fit_ops)."""
        return 1 if trainer.world_size > 1 else 0

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach().float().sum()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        loss, self._loss_sum = self._loss_sum, None
        # Under fp16's GradScaler, inf gradients are routine (it lowers the scale and skips the step
        # itself), so only the loss is checked there, and the scaler owns `found_inf`.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None:
            optimizer.__dict__.pop("found_inf", None)  # the previous step's flag
        norm = _gradient_norm(pl_module, optimizer) if scaler is None else None
        checked = [t.detach().float().reshape(()) for t in (loss, norm) if t is not None]
        if not checked:
            return
        bad = (~torch.isfinite(torch.stack(checked))).any().float()
        in_lockstep = torch.distributed.is_available() and torch.distributed.is_initialized()
        if in_lockstep:
            # Every rank skips or stops together. A collective on the device: no host sync.
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        step = trainer.global_step
        verdict = _Verdict.record(step, bad, loss, norm)
        if scaler is None and _drops_update_on_found_inf(optimizer):
            optimizer.found_inf = bad
            self._in_flight.append(verdict)
            while self._in_flight and self._in_flight[0].due(step, in_lockstep):
                self._judge(self._in_flight.popleft())
        elif self._judge(verdict):  # judged now (one host sync): drop the update by hand
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # optimizers skip parameters without a gradient
        self._raise_if_stopped(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle_all()
        self._raise_if_stopped(trainer)

    def _settle_all(self) -> None:
        """Judge every verdict in flight, oldest first. Wait for those not yet on the host."""
        while self._in_flight:
            self._judge(self._in_flight.popleft())

    def _judge(self, verdict: _Verdict) -> bool:
        """True if the step was bad. It counts as skipped, or, past max_skips, as the reason to stop."""
        problem = verdict.problem()
        if problem is None:
            return False
        if self._stop is None and self.skipped < self.max_skips:
            self.skipped += 1
            rank_zero_warn(
                f"step {verdict.step}: {problem}; update skipped ({self.skipped} of max_skips {self.max_skips})"
            )
        elif self._stop is None:
            self._stop = (verdict, problem)
        return True

    def _raise_if_stopped(self, trainer: pl.Trainer) -> None:
        if self._stop is None:
            return
        verdict, problem = self._stop
        earlier = (
            f" ({self.skipped} earlier non-finite steps skipped, max_skips {self.max_skips})" if self.skipped else ""
        )
        raise NonFiniteLossError(
            f"step {verdict.step}: {problem}; stopped before applying it{earlier}. {_last_checkpoint(trainer)}. "
            "Lower --model.lr or lengthen warm-up, or let --nonfinite.max_skips K skip such steps"
        )

    def state_dict(self) -> dict:
        # A checkpoint is written between steps: wait for the verdicts in flight so the count is exact. One
        # that must stop the run is raised by the next hook; this checkpoint is clean (its update was dropped).
        self._settle_all()
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped = state_dict["skipped"]


def _gradient_norm(pl_module: pl.LightningModule, optimizer) -> torch.Tensor | None:
    """This step's total gradient norm.

    The module's own, when it keeps one. (LitLM computes it once a step for logging, this check and
    clipping.) Else it is measured over the optimizer's parameters."""
    shared = getattr(pl_module, "gradient_norm", None)
    if callable(shared):
        return shared()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if len({id(getattr(g, "device_mesh", None)) for g in grads}) > 1:  # FSDP2 x TP: DTensors on two meshes
        from lmledger.ledger.sharding.tp import norm_over_meshes

        return norm_over_meshes(grads)
    return torch.nn.utils.get_total_norm(grads) if grads else None


def _drops_update_on_found_inf(optimizer) -> bool:
    """Whether optimizer.step() skips the update on the device when `optimizer.found_inf` is 1.

    torch's fused Adam, AdamW and SGD kernels do
    (canary test_fused_optimizers_skip_the_step_when_found_inf_is_set).

    Read from the live param groups, not `defaults`. A restored optimizer takes its groups' settings
    from the checkpoint. And not before every parameter has its state. Fused SGD allocates its momentum
    buffers uninitialised and fills them in the step itself. A first step skipped on the device would
    leave garbage momentum behind. So that step is judged at once and its gradients dropped instead."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    groups = optimizer.param_groups
    return all(group.get("fused") for group in groups) and all(
        p in optimizer.state for group in groups for p in group["params"] if p.grad is not None
    )


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
