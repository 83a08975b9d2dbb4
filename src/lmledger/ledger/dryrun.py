"""One training step of any model on fake tensors: what it holds and computes, with no compute and no memory.

`dry_run(model, batch, ...)` copies the model onto `torch._subclasses.FakeTensorMode` tensors (shapes,
dtypes, devices and storage sizes, no data), then runs two training steps in Lightning's order
(forward, zero_grad, backward, optimizer step; grads of the previous step are alive during the
forward). FLOPs and saved tensors are read on the first, the peak on the second (steady state:
optimizer state and grads exist):

    params, grads, optimizer   storages of the fake parameters, their .grad and the optimizer's state
                               (measure_state_bytes: each storage once, 0-dim `step` counters left out),
                               so dtypes, ties, frozen parameters and the optimizer's layout are the
                               real ones
    activations                what autograd saves during the forward (measure_saved_activations);
                               autocast weight copies apart
    peak, phase_peaks          high-water mark of live tensor bytes per phase (memtrack.MemoryTracker)
    flops_forward/_backward    hardware FLOPs, as FlopCounterMode counts them (recompute included)

`measure_step` runs the same two steps on the real tensors: it is the dry run's measured twin, and
the two agree exactly where fake and real code allocate alike (tests/test_dryrun.py,
tests/test_examples.py). Where they do not, the dry run follows the real code: losses the real
kernels return inside an input-sized buffer and oneDNN's RNN workspace (_RealOutputStorages),
libraries that branch on being traced (_eager_library_decisions), scalars an optimizer reads
(_PlaceholderScalars). `largest_batch` searches the batch size that fits a capacity.

A model the dry run cannot trace (an operator without a fake/meta kernel, data-dependent control
flow such as `.item()`) gives `NotTraced(reason)`, never a crash and never zeros; bad input (an
unknown precision, a step that returns no loss, a device this machine lacks) is a UserError. No
Lightning import: the step is a plain callable `step(model, batch) -> loss`.
"""

from __future__ import annotations

import copy
import gc
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import torch
import torch.utils.data
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.optim.optimizer import _get_foreach_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lmledger.errors import UserError
from lmledger.ledger import moe, precisions
from lmledger.ledger.activations import measure_saved_activations
from lmledger.ledger.flops import flop_counter
from lmledger.ledger.memory import measure_state_bytes, unique_storage_bytes
from lmledger.ledger.memtrack import MemoryTracker
from lmledger.ledger.ops import OpRecorder, OpSummary

StepFn = Callable[[nn.Module, object], torch.Tensor]
OptimizerSpec = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None

PHASES = ("forward", "backward", "optimizer step")
# Under gradient accumulation (k micro-batches per optimizer step) the phases are the micro-batches: the
# first (the previous step's grads alive through its forward, freed by zero_grad before its backward), the
# later ones (grads alive and accumulating throughout), and the optimizer step.
ACCUMULATION_PHASES = ("first micro-batch", "later micro-batches", "optimizer step")


def phases(accumulate: int = 1) -> tuple[str, ...]:
    """The phase names a step of `accumulate` micro-batches is tracked in (dry run and live alike)."""
    return PHASES if accumulate == 1 else ACCUMULATION_PHASES


@dataclass(frozen=True)
class StepLedger:
    """Bytes and FLOPs of one steady-state training (optimizer) step (dry or measured).

    `phase_peaks` holds the high-water mark of live tensor bytes in "forward", "backward" (zero_grad
    included: it only frees) and "optimizer step" (under accumulation: `ACCUMULATION_PHASES`); `peak` is
    the largest, reached in `peak_phase`. Everything live before the step counts: params, grads,
    optimizer state, buffers and the batch. FLOPs cover every micro-batch of the step; `activations`
    what one micro-batch saves.
    """

    params: int
    grads: int
    optimizer: int
    buffers: int
    batch: int
    activations: int
    autocast_weight_copies: int
    peak: int
    peak_phase: str
    phase_peaks: dict[str, int]
    flops_forward: int
    flops_backward: int
    flops_by_op: dict[str, int] = field(default_factory=dict)
    ops: OpSummary | None = None  # step 1's ops: FLOPs, bytes, category (ledger/ops.py; the roofline reads it)

    @property
    def flops(self) -> int:
        """Hardware FLOPs of the step (forward + backward, recompute included)."""
        return self.flops_forward + self.flops_backward


@dataclass(frozen=True)
class NotTraced:
    """The dry run could not run the model on fake tensors; `reason` is one line saying why."""

    reason: str


def dry_run(
    model: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
    share: tuple[object, ...] = (),
    accumulate: int = 1,
    routing: str | moe.Assumption | None = None,
    manual: bool = False,
) -> StepLedger | NotTraced:
    """One steady-state training step of `model` on a fake `batch`, with no compute and no memory.

    model      any nn.Module; its parameters may be real or on the meta device (never touched)
    batch      a tensor, or tuples / lists / dicts of tensors, of the real batch's shapes and dtypes;
               values are never read, so `torch.empty(..., device="meta")` will do
    step       `step(model, batch) -> scalar loss`; default: call the model on the batch (dict:
               keywords, tuple/list: positional) and take a scalar output, `out.loss` or `out["loss"]`
    optimizer  None (no optimizer step), an optimizer over the model's parameters (copied with its
               groups and hyperparameters; the first step rebuilds its state), or a factory
               `params -> optimizer`
    precision  a Lightning precision name (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true)
    device     the device the step runs on (default: the parameters', CPU for a meta model)
    share      objects the model refers to that the copy must share, not copy (a LightningModule's
               Trainer)
    accumulate micro-batches per optimizer step (Lightning's accumulate_grad_batches): each runs
               forward and backward on a batch of `batch`'s shapes, its loss divided by `accumulate`
               as Lightning divides it; zero_grad after the first one's forward
    routing    None, "balanced", "worst" or moe.Assumption("worst", capacity): the mixture-of-experts
               routing assumed where top-k routing decides a shape (ledger.moe; moe.predict_moe
               runs both; None: such a shape gives a NotTraced line that names them)
    manual     Lightning's manual optimization: `step` is the module's whole training_step, which runs
               its own backward and optimizer steps (`optimizer` may then be a list); the calls it makes
               on the module reach the fake optimizers (`_ManualOptimization`)

    Raises UserError for bad input (an unknown precision, a step that returns no scalar loss, a
    device this machine lacks); returns NotTraced when the model cannot run on fake tensors.
    """
    dtype, autocast = _precision_dtypes(precision)
    target = _target_device(model, device)
    if not (isinstance(accumulate, int) and accumulate >= 1):
        raise UserError(f"accumulate must be a positive number of micro-batches, got {accumulate!r}")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake_model, memo = _fake_copy(model, mode, target, dtype, share)
        fake_batch = map_tensors(lambda t: _fake_tensor(t, mode, target), _cast_batch(batch, dtype))
        configured = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if len(configured) > 1 and not manual:
            raise UserError(
                f"{len(configured)} optimizers: Lightning steps several optimizers only under manual optimization"
            )
        with mode:  # an optimizer that makes state in its constructor (Adagrad) makes it fake
            fake_optimizers = [_fake_optimizer(o, fake_model, memo, target) for o in configured]
    except UserError:
        raise
    except Exception as err:  # deepcopy or fake conversion: a model we cannot copy
        return NotTraced(f"could not copy the model onto fake tensors: {_one_line(err)}")
    try:
        # force_eager: torch.compile'd submodules run their eager code, so a dry run compiles nothing
        # (dynamo would trace the fake step too, at compile time's cost); it describes the eager step.
        moe_routing = moe.RoutingAssumption(routing)  # grouped GEMMs on CPU fakes; routing-decided shapes
        with mode, torch.compiler.set_stance("force_eager"), _RealOutputStorages(), moe_routing:
            with _eager_library_decisions():
                if manual:
                    return _ledger_of_manual_step(fake_model, fake_batch, step, fake_optimizers, autocast, target)
                return _ledger_of_step(fake_model, fake_batch, step, fake_optimizers[0], autocast, target, accumulate)
    except UserError:
        raise
    except Exception as err:
        return NotTraced(f"the step does not run on fake tensors: {_why(err)}")


@dataclass(frozen=True)
class LargestBatch:
    """The largest batch size whose dry-run peak fits; `fits` is its ledger (None when size is 0:
    not even one sample fits), `over` the ledger of size + 1 (None when the search hit `limit`)."""

    size: int
    fits: StepLedger | None
    over: StepLedger | None


def largest_batch(
    model: nn.Module,
    batch_for: Callable[[int], object],
    capacity_bytes: int,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
    limit: int = 1 << 16,
    accumulate: int = 1,
    share: tuple[object, ...] = (),
) -> LargestBatch | NotTraced:
    """The largest batch size b <= limit whose predicted peak is at most capacity_bytes.

    `batch_for(b)` makes a batch of b samples (meta tensors will do). Sizes double until one does not
    fit, then bisect; each probe is a dry run, so nothing is allocated. The peak grows with the batch,
    which the search relies on."""
    if capacity_bytes <= 0 or limit < 1:
        raise UserError(f"capacity_bytes and limit must be positive, got {capacity_bytes} and {limit}")
    ledgers: dict[int, StepLedger] = {}

    def fits(size: int) -> bool | NotTraced:
        result = dry_run(
            model, batch_for(size), step=step, optimizer=optimizer, precision=precision, device=device,
            accumulate=accumulate, share=share,
        )  # fmt: skip
        if isinstance(result, NotTraced):
            return result
        ledgers[size] = result
        return result.peak <= capacity_bytes

    low, high = 0, 1  # low fits (0 trivially), high is the next size to try
    while True:
        verdict = fits(high)
        if isinstance(verdict, NotTraced):
            return verdict
        if not verdict:
            break
        low = high
        if high == limit:
            return LargestBatch(limit, ledgers[limit], None)
        high = min(2 * high, limit)
    while high - low > 1:  # low fits, high does not
        middle = (low + high) // 2
        verdict = fits(middle)
        if isinstance(verdict, NotTraced):
            return verdict
        low, high = (middle, high) if verdict else (low, middle)
    return LargestBatch(low, ledgers.get(low), ledgers[high])


def measure_step(
    model: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    accumulate: int = 1,
) -> StepLedger:
    """dry_run's measured twin: the same two training steps on the real model and batch.

    The model is trained by them (two optimizer steps) and, for *-true precisions, converted in
    place; pass a copy to keep the original. Peak and activations are counted by the same trackers
    as the dry run, on real storages; FLOPs by FlopCounterMode on the real kernels.
    """
    dtype, autocast = _precision_dtypes(precision)
    device = _target_device(model, None)
    if dtype is not None:
        model.to(dtype)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(list(model.parameters()))
    return _ledger_of_step(model, _cast_batch(batch, dtype), step, optimizer, autocast, device, accumulate)


# --------------------------------------------------------------------------------------------
# The step, on fake or real tensors
# --------------------------------------------------------------------------------------------


def _ledger_of_step(
    model: nn.Module,
    batch: object,
    step: StepFn | None,
    optimizer: torch.optim.Optimizer | None,
    autocast: torch.dtype | None,
    device: torch.device,
    accumulate: int = 1,
) -> StepLedger:
    step = step or default_step
    was_training = model.training
    model.train()
    names = phases(accumulate)
    try:
        # Step 1 makes grads and optimizer state; FLOPs and saved tensors are counted there. Step 2,
        # the steady state, is tracked alone: FlopCounterMode's module hooks hold checkpoint
        # recomputes alive longer in backward, which would raise the peak they are beside.
        # One counter per micro-batch and direction: FlopCounterMode clears its counts on every entry.
        forward_flops, backward_flops = (
            [flop_counter() for _ in range(accumulate)],
            [flop_counter() for _ in range(accumulate)],
        )
        # Below the FLOP counters on the mode stack: it sees the ops they price, with their formulas.
        recorder = OpRecorder(forward_flops[0].flop_registry).watch(optimizer)
        with recorder:
            with measure_saved_activations(model) as saved:  # what one micro-batch saves
                loss, kept = _forward(model, batch, step, autocast, device, forward_flops[0], accumulate)
            recorder.phase = "backward"
            _backward(model, loss, optimizer, first=True, counter=backward_flops[0])
            del loss
            for micro in range(1, accumulate):
                recorder.phase = "forward"
                loss, kept = _forward(model, batch, step, autocast, device, forward_flops[micro], accumulate)
                recorder.phase = "backward"
                _backward(model, loss, optimizer, first=False, counter=backward_flops[micro])
                del loss
            _optimizer_step(optimizer)
        tracker = MemoryTracker().track(model, optimizer, batch_tensors(batch))
        with tracker, _no_cyclic_gc():
            for micro in range(accumulate):
                tracker.phase(names[0] if accumulate == 1 or micro == 0 else names[1])
                loss, kept = _forward(model, batch, step, autocast, device, accumulate=accumulate)
                if accumulate == 1:
                    tracker.phase(names[1])
                _backward(model, loss, optimizer, first=micro == 0)
                del loss
            tracker.phase(names[2])
            _optimizer_step(optimizer)
        del kept
    finally:
        model.train(was_training)
    state = measure_state_bytes(model, optimizer)
    buffers = unique_storage_bytes(model.buffers())
    phase_peaks = {name: tracker.phase_peaks.get(name, 0) for name in names}
    by_op: dict[str, int] = {}
    for counter in (*forward_flops, *backward_flops):
        for op, n in counter.get_flop_counts().get("Global", {}).items():
            by_op[str(op)] = by_op.get(str(op), 0) + n
    return StepLedger(
        params=state["params"],
        grads=state["grads"],
        optimizer=state["optimizer"],
        buffers=buffers,
        batch=unique_storage_bytes(batch_tensors(batch)),
        activations=saved.activations,
        autocast_weight_copies=saved.autocast_weight_copies,
        peak=tracker.peak_bytes,
        peak_phase=max(phase_peaks, key=phase_peaks.__getitem__),
        phase_peaks=phase_peaks,
        flops_forward=sum(c.get_total_flops() for c in forward_flops),
        flops_backward=sum(c.get_total_flops() for c in backward_flops),
        flops_by_op=by_op,
        ops=recorder.summary(),
    )


def _ledger_of_manual_step(
    model: nn.Module,
    batch: object,
    step: StepFn,
    optimizers: list[torch.optim.Optimizer | None],
    autocast: torch.dtype | None,
    device: torch.device,
) -> StepLedger:
    """Two manual-optimization steps: `step` runs the module's training_step, which calls manual_backward
    and steps its optimizers itself. FLOPs (split at each manual_backward) and saved activations (up to the
    first backward) are read on the first, the peak on the second, as in the automatic step."""
    optimizers = [o for o in optimizers if o is not None]
    manual = _ManualOptimization(model, optimizers)
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
            with tracker, _no_cyclic_gc(), context:
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


class _ManualOptimization:
    """While entered, the LightningModule calls a manual training step makes reach the fake copy's own
    optimizers: `optimizers()`, `manual_backward`, `toggle_optimizer`/`untoggle_optimizer`/`toggled_optimizer`,
    `lr_schedulers()` (schedulers whose step does nothing: the real ones would move the real learning rates),
    and each optimizer's `step`. Lightning's own versions go through the trainer to the real optimizers, and
    toggle_optimizer would flip requires_grad on the real parameters. Duck-typed: no Lightning import."""

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.module, self.fakes = module, optimizers
        self.tracker: MemoryTracker | None = None
        self.at_first_backward: Callable[[], None] | None = None
        self.counter: FlopCounterMode | None = None  # step 1's; backward's share is read around each call
        self.backward_flops = 0
        self._requires_grad: dict[nn.Parameter, bool] = {}

    def __enter__(self) -> _ManualOptimization:
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
        """The module's schedulers (read when the step asks: its trainer is set by then), frozen."""
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
            with _PlaceholderScalars():
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


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector off for the tracked step: tensors a step leaves in reference cycles
    (FlopCounterMode's module hooks made such cycles in step 1) are then freed at the same point in
    every run, not wherever a collection happens to fall, and the peak is the one without its help."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _backward(
    model: nn.Module,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    *,
    first: bool = True,
    counter: AbstractContextManager | None = None,
) -> None:
    """Lightning's order after a forward: zero_grad (set_to_none; the first micro-batch only), backward."""
    if first:
        (optimizer or model).zero_grad(set_to_none=True)
    with counter or nullcontext():
        loss.backward()


def _optimizer_step(optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        return
    on_fake = any(isinstance(p, FakeTensor) for group in optimizer.param_groups for p in group["params"])
    with _PlaceholderScalars() if on_fake else nullcontext():
        optimizer.step()


class _PlaceholderScalars(TorchDispatchMode):
    """In a fake optimizer step, a scalar read from a tensor that has no value reads as 1.

    Optimizers read such values to size the step, never to size a tensor: Adafactor scales its
    learning rate by param.norm().item() (torch/optim/_adafactor.py), so the step's memory and FLOPs
    do not depend on them. The forward and backward get no such help: a model's values may decide
    what it computes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def _forward(
    model: nn.Module,
    batch: object,
    step: StepFn,
    autocast: torch.dtype | None,
    device: torch.device,
    counter: AbstractContextManager | None = None,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss as Lightning hands it to backward, and the copy Lightning keeps of it."""
    # cache_enabled=False, as Lightning runs autocast (canary test_lightning_autocast_keeps_no_weight_cache):
    # a weight cast lives while backward needs it, not until autocast exits
    context = (
        torch.autocast(device.type, dtype=autocast, cache_enabled=False) if autocast is not None else nullcontext()
    )
    with counter or nullcontext(), context:
        loss = step(model, batch)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise UserError(
            f"the training step returned {got}, not a scalar loss that needs grad: "
            "pass step=lambda model, batch: <loss> to the dry run"
        )
    # Lightning's ClosureResult divides each micro-batch's loss by accumulate_grad_batches (by 1 too: a new
    # scalar) and keeps a detached copy of it for the callbacks, alive past the step (BoringModel's 8 bytes).
    loss = loss / accumulate
    return loss, loss.detach().clone()


def default_step(model: nn.Module, batch: object) -> torch.Tensor:
    """Call the model on the batch (dict: keywords, tuple/list: positional, else one argument) and
    return the loss: a scalar output, `output.loss` (Hugging Face) or `output["loss"]`."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    return loss_of(out)


def loss_of(output: object) -> object:
    """The scalar loss in a model's output, or the output itself when there is none to find."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else output


# --------------------------------------------------------------------------------------------
# Fake copies
# --------------------------------------------------------------------------------------------


def _precision_dtypes(precision: str | int) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype the module and its floating inputs are converted to, autocast dtype), as Lightning's plugins
    run the precision (ledger.precisions). The loss scaling 16-mixed adds on CUDA is a few scalars, not
    modelled; Transformer Engine's layer swap is not run."""
    row = precisions.precision(precision)
    if row.transformer_engine:
        covered = [r.name for r in precisions.ROWS.values() if not r.transformer_engine]
        raise UserError(f"the dry run covers {', '.join(covered)}, not {row.name}: use one of those")
    return row.convert_dtype, row.autocast_dtype


def _target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is None:
        found = [t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
        return found[0] if found else torch.device("cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise UserError(f"unknown device {device!r} ({err}): use cpu or cuda") from None
    backend = getattr(torch, device.type, None)
    if device.type not in ("cpu", "meta") and not (backend is not None and backend.is_available()):
        # Fake tensors still go through the device's guard: a torch build without that device aborts
        # the process, past any exception handler.
        raise UserError(f"device {device} is not available on this machine: dry-run on a machine that has it")
    return device


class _RealOutputStorages(TorchDispatchMode):
    """Give fake outputs the storage size the real kernels give them, where the two differ.

    - aten/src/ATen/native/Loss.cpp computes a reduced mse / smooth L1 / Huber loss into an
      elementwise buffer and returns the scalar in that buffer's storage, so the loss keeps a
      buffer the size of its input alive until it is freed; the meta kernels return a one-element
      storage.
    - oneDNN's RNN layer (aten.mkldnn_rnn_layer: LSTM and GRU on a CPU) returns a workspace that
      backward needs, whose size only oneDNN knows (gates and states per step, page-aligned); the
      meta kernel returns an empty one. The dry run asks oneDNN: the layer runs once for real, on
      uninitialized tensors of the same shapes, per distinct shape. The only real compute and
      memory of a dry run: one RNN layer's, while it runs.
    Entered inside the FakeTensorMode, so the tensors made here are fake."""

    _REDUCED_INTO_INPUT_BUFFER = frozenset(
        {torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default, torch.ops.aten.huber_loss.default}
    )

    def __init__(self) -> None:
        super().__init__()
        self._rnn_workspaces: dict[tuple, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._REDUCED_INTO_INPUT_BUFFER and out.dim() == 0:
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            buffer = torch.empty(shape, dtype=out.dtype, device=out.device)
            return buffer.as_strided((), ())
        if func is torch.ops.aten.mkldnn_rnn_layer.default and out[3].numel() == 0:
            nbytes = self._rnn_workspace_bytes(func, args, kwargs or {})
            return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=out[3].device))
        return out

    def _rnn_workspace_bytes(self, func, args, kwargs) -> int:
        key = tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else tuple(a) if isinstance(a, list) else a
            for a in args
        )
        if key not in self._rnn_workspaces:

            def real(a):
                return torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a

            with unset_fake_temporarily():  # grad mode stays: without it oneDNN makes no workspace
                outputs = func(*(real(a) for a in args), **kwargs)
            self._rnn_workspaces[key] = outputs[3].untyped_storage().nbytes()
        return self._rnn_workspaces[key]


@contextmanager
def _eager_library_decisions() -> Iterator[None]:
    """Let libraries that branch on "am I being traced?" take their eager branch on fake tensors.

    Hugging Face transformers (masking_utils.find_packed_sequence_indices) reads the position ids to
    tell packed sequences apart; on a fake tensor it cannot, so it assumes packing and materializes
    a (batch, 1, seq, seq) mask, which also makes grouped-query attention repeat k and v. Eagerly,
    on the position ids its models make themselves, it finds no packing and lets SDPA mask causally.
    The dry run answers "not packed": batches of packed sequences are not modelled."""
    masking = sys.modules.get("transformers.masking_utils")
    finder = getattr(masking, "find_packed_sequence_indices", None)
    if finder is None:
        yield
        return

    def not_packed_when_fake(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else finder(position_ids)

    with mock.patch.object(masking, "find_packed_sequence_indices", not_packed_when_fake):
        yield


def batch_tensors(batch: object) -> list[torch.Tensor]:
    """The tensors of a batch in order: a tensor, or mappings (dict, Hugging Face BatchEncoding),
    tuples and lists of them, nested; anything else holds none."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in batch_tensors(item)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: object) -> object:
    """The batch with fn applied to every tensor, containers rebuilt as their own type (a
    BatchEncoding stays one, a namedtuple stays one)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        out = copy.copy(batch)
        for key, value in batch.items():
            out[key] = map_tensors(fn, value)
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, item) for item in batch)
    return batch


def _cast_batch(batch: object, dtype: torch.dtype | None) -> object:
    """Floating tensors of the batch in `dtype`, as Lightning's *-true precision plugins convert inputs."""
    if dtype is None:
        return batch
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def _fake_tensor(
    t: torch.Tensor, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A fake tensor like t on `device` (floating tensors in `dtype` if given); one made from a real
    tensor on that device keeps its storage sharing with the other fakes of the same mode."""
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    same_device = t.device == device or (t.device.type == device.type and device.index is None)
    if same_device and t.device.type != "meta" and dtype == t.dtype:
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)


# Objects a module may keep that the step does not change and that can be large (a memory-mapped
# array would be read whole by deepcopy): the fake copy shares them with the original.
_SHARED_TYPES = (np.ndarray, torch.utils.data.Dataset, torch.utils.data.DataLoader)


def _fake_copy(
    model: nn.Module,
    mode: FakeTensorMode,
    device: torch.device,
    dtype: torch.dtype | None,
    share: tuple[object, ...] = (),
) -> tuple[nn.Module, dict[int, object]]:
    """A deep copy of model whose parameters, buffers and tensor attributes are fake, floating
    parameters and buffers in `dtype` if given (Module.to(dtype) leaves other attributes alone).

    The memo of copy.deepcopy is filled first, so each tensor object maps to one fake (tied weights
    stay tied) and the real ones are never copied."""
    memo: dict[int, object] = {id(obj): obj for obj in share}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, _SHARED_TYPES):  # data a module holds on to: never copied
                memo[id(value)] = value
        converted = [*module._parameters.values(), *module._buffers.values()]
        attributes = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t, cast in [*((t, dtype) for t in converted), *((t, None) for t in attributes)]:
            if t is None or id(t) in memo:
                continue
            fake = _fake_tensor(t.detach(), mode, device, cast)
            if isinstance(t, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
    return copy.deepcopy(model, memo), memo


def _fake_optimizer(
    optimizer: OptimizerSpec,
    fake_model: nn.Module,
    memo: dict[int, object],
    device: torch.device,
) -> torch.optim.Optimizer | None:
    """The optimizer over the fake parameters: a factory is called on them; an optimizer is deep-copied
    with its parameters mapped to the fakes (hyperparameters and groups kept) and an empty state."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        unknown = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in memo]
        if unknown:
            raise UserError("the optimizer holds tensors that are not the model's parameters: pass a factory instead")
        # Fresh state: step 1 creates it as the real optimizer did (a fake copy of a real `step`
        # counter would hold no value for AdamW to read).
        memo[id(optimizer.state)] = defaultdict(dict)
        fake = copy.deepcopy(optimizer, memo)
    else:
        fake = optimizer(list(fake_model.parameters()))
        if not isinstance(fake, torch.optim.Optimizer):
            raise UserError(f"the optimizer factory returned {type(fake).__name__}, not a torch.optim.Optimizer")
    _pin_kernel_choice(fake, device)
    return fake


def _pin_kernel_choice(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make the fake optimizer run the kernel torch would pick for the real parameters.

    torch.optim picks foreach by default only for plain tensors on a foreach device (CUDA):
    torch.optim.optimizer._default_to_fused_or_foreach tests `type(p) in [Tensor, Parameter]`,
    which a FakeTensor fails. Left alone, a fake CUDA step would take the per-tensor loop and miss
    foreach's temporaries; so an unset `foreach` is set to what the real step gets."""
    foreach_default = device.type in _get_foreach_kernels_supported_devices()
    for group in optimizer.param_groups:
        unset = "foreach" in group and group["foreach"] is None
        if unset and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = foreach_default


def _why(err: BaseException) -> str:
    """One line: what fake tensors could not do, and where in the user's code."""
    name = type(err).__name__
    if name == "DataDependentOutputException":
        what = f"a value read from a tensor ({err}), e.g. .item() or `if tensor:`; fake tensors hold no values"
    elif name == "DynamicOutputShapeException":
        what = f"an operator whose output shape depends on tensor values ({err})"
    elif name == "UnsupportedOperatorException":
        what = f"operator {err} has no fake/meta kernel"
    else:
        what = _one_line(err)
    return f"{what}{_user_frame(err)}"


def _user_frame(err: BaseException) -> str:
    """' at FILE:LINE' of the innermost traceback frame outside torch and lmledger.ledger (this module, ops, moe)."""
    where = ""
    tb = err.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/torch/" not in path and path.rsplit("/", 1)[0] != __file__.rsplit("/", 1)[0]:  # not ledger/
            where = f" at {'/'.join(path.split('/')[-2:])}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
