"""Manual optimization in the dry run: the module's own training_step, on the fake copy.

Under Lightning's manual optimization the training_step runs its own backward and optimizer steps.
`ledger_of_manual_step` runs it twice, as `dryrun.ledger_of_step` runs an automatic step. FLOPs and
saved activations are read on the first run, the peak on the second. `ManualOptimization` routes the
calls the step makes on its module to the copy's own optimizers. Those are `optimizers()`,
`manual_backward`, toggling and `lr_schedulers()`. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lmledger.ledger.closedform.activations import measure_saved_activations
from lmledger.ledger.closedform.memory import measure_state_bytes, unique_storage_bytes
from lmledger.ledger.count.flopcounter import flop_counter
from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.dryrun.fakecopy import PlaceholderScalars, batch_tensors
from lmledger.ledger.dryrun.steptypes import PHASES, StepFn, StepLedger, no_cyclic_gc

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
    are read on the first step, the peak on the second.
    """
    optimizers = [o for o in optimizers if o is not None]
    manual = ManualOptimization(model, optimizers)
    was_training = model.training
    model.train()
    context = (
        torch.autocast(device.type, dtype=autocast, cache_enabled=False) if autocast is not None else nullcontext()
    )
    counter = flop_counter()
    try:
        with manual:
            hooks = ExitStack()  # closed at the first manual_backward, or when the step ends without one
            saved = hooks.enter_context(measure_saved_activations(model))
            manual.at_first_backward, manual.counter = hooks.close, counter
            with hooks, counter, context:
                step(model, batch)
            manual.at_first_backward, manual.counter = None, None
            tracker = MemoryTracker().track(model, optimizers, batch_tensors(batch))
            manual.tracker = tracker
            with tracker, no_cyclic_gc(), context:
                tracker.phase("forward")
                step(model, batch)
    finally:
        model.train(was_training)
    state = measure_state_bytes(model)
    state["optimizer"] = sum(measure_state_bytes(model, o)["optimizer"] for o in optimizers)
    phase_peaks = {name: tracker.phase_peaks.get(name, 0) for name in PHASES}
    total = counter.get_total_flops()
    return StepLedger(
        params=state["params"], grads=state["grads"], optimizer=state["optimizer"],
        buffers=unique_storage_bytes(model.buffers()), batch=unique_storage_bytes(batch_tensors(batch)),
        activations=saved.activations, autocast_weight_copies=saved.autocast_weight_copies,
        peak=tracker.peak_bytes, peak_phase=max(phase_peaks, key=phase_peaks.__getitem__), phase_peaks=phase_peaks,
        flops_forward=total - manual.backward_flops, flops_backward=manual.backward_flops,
        flops_by_op={str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()},
    )  # fmt: skip


class ManualOptimization:
    """While entered, a manual training step's calls on the LightningModule reach the fake copy's optimizers.

    The calls are `optimizers()`, `manual_backward`, each optimizer's `step`, and
    `toggle_optimizer`/`untoggle_optimizer`/`toggled_optimizer`. Also `lr_schedulers()`: its schedulers'
    step does nothing, since the real ones would move the real learning rates. Lightning's own versions go
    through the trainer to the real optimizers. Its toggle_optimizer would flip requires_grad on the real
    parameters. Duck-typed: no Lightning import.
    """

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.module, self.fakes = module, optimizers
        self.tracker: MemoryTracker | None = None
        self.at_first_backward: Callable[[], None] | None = None
        self.counter: FlopCounterMode | None = None  # step 1's; backward's share is read around each call
        self.backward_flops = 0
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
        if self.at_first_backward is not None:
            self.at_first_backward()  # forward is over: what backward needs is saved
            self.at_first_backward = None
        if self.tracker is not None:
            self.tracker.phase("backward")
        before = self.counter.get_total_flops() if self.counter is not None else 0
        loss.backward(*args, **kwargs)
        if self.counter is not None:
            self.backward_flops += self.counter.get_total_flops() - before

    def _stepper(self, optimizer: torch.optim.Optimizer):
        real_step = type(optimizer).step

        def step(closure=None):
            if self.tracker is not None:
                self.tracker.phase("optimizer step")
            with PlaceholderScalars():
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
