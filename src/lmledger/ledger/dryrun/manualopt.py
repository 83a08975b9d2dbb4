"""Manual optimization in the dry run: the module's own training_step, on the fake copy.

Under Lightning's manual optimization the training_step runs its own backward and optimizer steps.
`ledger_of_manual_step` runs it twice, as `dryrun.ledger_of_step` runs an automatic step, and the
fit's reader reads both (watch.StepWatch): FLOPs and saved activations on the first run, the peak on
the second. `ManualOptimization` routes the calls the step makes on its module to the copy's own
optimizers. Those are `optimizers()`, `manual_backward`, toggling and `lr_schedulers()`. No Lightning
import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.count.ops import DispatchClock, OpRecorder
from lmledger.ledger.dryrun.fakecopy import PlaceholderScalars
from lmledger.ledger.dryrun.steptypes import StepFn, StepLedger
from lmledger.ledger.dryrun.watch import Reading, StepWatch

__all__ = ["ManualOptimization", "ledger_of_manual_step"]


def ledger_of_manual_step(
    model: nn.Module,
    batch: object,
    step: StepFn,
    optimizers: list[torch.optim.Optimizer | None],
    autocast: torch.dtype | None,
    device: torch.device,
) -> StepLedger:
    """Two manual-optimization steps, read as the automatic step is read.

    `step` runs the module's training_step. It calls manual_backward and steps its optimizers itself.
    FLOPs are split at each manual_backward. Saved activations are counted up to the first backward. Both
    are read on the first step, the peak on the second. The first also records every op, in its phase
    (forward, backward at each manual_backward, the optimizer step at each optimizer's step), as the automatic
    step's are; the second is timed outside dispatch, its optimizer steps left out, as the automatic step's are.
    """
    optimizers = [o for o in optimizers if o is not None]
    # MemoryTracker is read here, so that ledger.sharding can make it its local-shard tracker.
    watch = StepWatch(device, manual=True, reading=Reading(tracker=MemoryTracker))
    # Below the FLOP counter on the mode stack (entered before the watch's), as in engine.ledger_of_step.
    recorder = OpRecorder(watch.flop_registry)
    for optimizer in optimizers:
        recorder.watch(optimizer)
    clock = DispatchClock()
    manual = ManualOptimization(model, optimizers, watch, recorder, clock)
    was_training = model.training
    model.train()
    context = (
        torch.autocast(device.type, dtype=autocast, cache_enabled=False) if autocast is not None else nullcontext()
    )

    def one_step(index: int) -> None:
        recorder.phase = "forward"
        watch.batch_start(model, optimizers, batch, global_step=index)
        with context, clock if index == 1 else nullcontext():
            step(model, batch)
        watch.batch_end(model, optimizers, global_step=index + 1)

    try:
        with manual:
            with recorder:  # step 1: FLOPs, saved activations, state, and every op
                try:
                    one_step(0)
                except BaseException:
                    watch.close()  # its FLOP counter sits above the recorder on the mode stack
                    raise
            one_step(1)  # step 2: the peak, and the module's Python
    finally:
        watch.close()
        model.train(was_training)
    return watch.step_ledger(model, batch, ops=dataclasses.replace(recorder.summary(), outside=clock.outside))


class ManualOptimization:
    """While entered, a manual training step's calls on the LightningModule reach the fake copy's optimizers.

    The calls are `optimizers()`, `manual_backward`, each optimizer's `step`, and
    `toggle_optimizer`/`untoggle_optimizer`/`toggled_optimizer`. Also `lr_schedulers()`: its schedulers'
    step does nothing, since the real ones would move the real learning rates. Lightning's own versions go
    through the trainer to the real optimizers. Its toggle_optimizer would flip requires_grad on the real
    parameters. Duck-typed: no Lightning import.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        watch: StepWatch | None = None,
        recorder: OpRecorder | None = None,
        clock: DispatchClock | None = None,
    ) -> None:
        self.module, self.fakes, self.watch = module, optimizers, watch  # no watch: a step run unread
        self.recorder, self.clock = recorder, clock  # the phase of each op recorded; the Python timed
        self._requires_grad: dict[nn.Parameter, bool] = {}

    def __enter__(self) -> ManualOptimization:
        module = self.module
        module.optimizers = lambda use_pl_optimizer=True: self.fakes[0] if len(self.fakes) == 1 else list(self.fakes)
        module.lr_schedulers = self.lr_schedulers
        module.manual_backward = self.manual_backward
        module.toggle_optimizer, module.untoggle_optimizer = self.toggle, self.untoggle
        module.toggled_optimizer = self.toggled
        for optimizer in self.fakes:
            optimizer.step = self._stepper(optimizer)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("optimizers", "lr_schedulers", "manual_backward", "toggle_optimizer", "untoggle_optimizer",
                     "toggled_optimizer"):  # fmt: skip
            vars(self.module).pop(name, None)
        for optimizer in self.fakes:
            vars(optimizer).pop("step", None)

    def lr_schedulers(self) -> object:
        """The module's schedulers, frozen.

        They are read when the step asks: its trainer is set by then.
        """
        real = getattr(type(self.module), "lr_schedulers", None)
        found = real(self.module) if real is not None else None
        if found is None:
            return None
        return [_FrozenScheduler(s) for s in found] if isinstance(found, list) else _FrozenScheduler(found)

    def manual_backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if self.watch is not None:
            self.watch.before_backward()
        if self.recorder is not None:
            self.recorder.phase = "backward"
        loss.backward(*args, **kwargs)
        if self.recorder is not None:
            self.recorder.phase = "forward"  # whatever the step runs next, up to its optimizer's step
        if self.watch is not None:
            self.watch.after_backward()

    def _stepper(self, optimizer: torch.optim.Optimizer):
        real_step = type(optimizer).step

        def step(closure=None):
            if self.watch is not None:
                self.watch.before_optimizer_step()
            # The optimizer step is priced whole or replayed apart: its Python is not the module's.
            with PlaceholderScalars(), self.clock.left_out() if self.clock is not None else nullcontext():
                return real_step(optimizer, closure) if closure is not None else real_step(optimizer)

        return step

    def toggle(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self._requires_grad = {p: p.requires_grad for o in self.fakes for g in o.param_groups for p in g["params"]}
        for p in self._requires_grad:
            p.requires_grad_(False)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.requires_grad_(self._requires_grad[p])

    def untoggle(self, optimizer: torch.optim.Optimizer) -> None:
        for p, flag in self._requires_grad.items():
            p.requires_grad_(flag)
        self._requires_grad = {}

    @contextmanager
    def toggled(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        self.toggle(optimizer)
        try:
            yield
        finally:
            self.untoggle(optimizer)


class _FrozenScheduler:
    """A learning-rate scheduler whose step does nothing; it reports the real one's rates."""

    def __init__(self, scheduler: object) -> None:
        self._scheduler = getattr(scheduler, "scheduler", scheduler)

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self._scheduler.get_last_lr()
