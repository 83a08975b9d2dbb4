"""One training step of any model on fake tensors: what it holds and computes, with no compute and no memory.

`dry_run(model, batch, ...)` copies the model onto fake tensors (ledger.dryrun.fakecopy). Those are
`torch._subclasses.FakeTensorMode` tensors: shapes, dtypes, devices and storage sizes, no data. It then
runs two training steps in Lightning's order. That is forward, zero_grad, backward, optimizer step. The
previous step's grads are alive during the forward. FLOPs and saved tensors are read on the first step.
The peak is read on the second, the steady state: optimizer state and grads exist.

    params, grads, optimizer   storages of the fake parameters, their .grad and the optimizer's state
                               (measure_state_bytes: each storage once, 0-dim `step` counters left out),
                               so dtypes, ties, frozen parameters and the optimizer's layout are the
                               real ones
    activations                what autograd saves during the forward (measure_saved_activations);
                               autocast weight copies apart
    peak, phase_peaks          high-water mark of live tensor bytes per phase (memtrack.MemoryTracker)
    flops_forward/_backward    hardware FLOPs (recompute included), by FlopCounterMode's formulas with no op
                               decomposed (count.flopcounter.StepFlopCounter)

All of it is read by dryrun.watch.StepWatch, the reader a fit's Ledger reads the real steps with.

`measure_step` runs the same two steps on the real tensors: the dry run's measured twin. The two agree
exactly where fake and real code allocate alike (tests/ledger/test_dryrun.py, tests/test_examples.py). Where
they do not, the dry run follows the real code. That covers losses the real kernels return inside an
input-sized buffer, and oneDNN's RNN workspace. It covers libraries that branch on being traced, and
scalars an optimizer reads (ledger.dryrun.fakecopy). `largest_batch` searches the batch size that fits a
capacity. Manual optimization is ledger.dryrun.manualopt.

Some models cannot be traced. An operator may lack a fake/meta kernel. Control flow may depend on data,
as with `.item()`. Such a model gives `NotTraced(reason)`, never a crash and never zeros. Bad input is a
UserError: an unknown precision, a step that returns no loss, a device this machine lacks. No Lightning
import: the step is a plain callable `step(model, batch) -> loss`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lmledger.errors import UserError
from lmledger.ledger.closedform.napkin import largest_within
from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.count.ops import DispatchClock, OpRecorder
from lmledger.ledger.dryrun import moe
from lmledger.ledger.dryrun.fakecopy import (
    PlaceholderScalars,
    RealOutputStorages,
    cast_batch,
    eager_library_decisions,
    fake_copy,
    fake_optimizer,
    fake_tensor,
    map_tensors,
    precision_dtypes,
    target_device,
)
from lmledger.ledger.dryrun.steptypes import (
    PHASES,
    LargestBatch,
    NotTraced,
    OptimizerSpec,
    StepFn,
    StepLedger,
    no_cyclic_gc,
    phases,
)
from lmledger.ledger.dryrun.watch import Reading, StepWatch

__all__ = [
    "PHASES",
    "LargestBatch",
    "NotTraced",
    "OptimizerSpec",
    "StepFn",
    "StepLedger",
    "default_step",
    "dry_run",
    "largest_batch",
    "ledger_of_step",
    "loss_of",
    "measure_step",
    "no_cyclic_gc",
    "one_line",
    "phases",
    "search_batch",
    "why",
]


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

        model       any nn.Module; its parameters may be real or on the meta device (never touched)
        batch       a tensor, or tuples / lists / dicts of tensors, of the real batch's shapes and dtypes;
                    values are never read, so `torch.empty(..., device="meta")` will do
        step        `step(model, batch) -> scalar loss`; default: call the model on the batch (dict:
                    keywords, tuple/list: positional) and take a scalar output, `out.loss` or `out["loss"]`
        optimizer   None (no optimizer step), an optimizer over the model's parameters (copied with its
                    groups and hyperparameters; the first step rebuilds its state), or a factory
                    `params -> optimizer`
        precision   a Lightning precision name (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true)
        device      the device the step runs on (default: the parameters', CPU for a meta model)
        share       objects the model refers to that the copy must share, not copy (a LightningModule's
                    Trainer)
        accumulate  micro-batches per optimizer step (Lightning's accumulate_grad_batches): each runs
                    forward and backward on a batch of `batch`'s shapes, its loss divided by `accumulate`
                    as Lightning divides it; zero_grad after the first one's forward
        routing     None, "balanced", "worst" or moe.Assumption("worst", capacity): the mixture-of-experts
                    routing assumed where top-k routing decides a shape (ledger.dryrun.moe; moebounds.predict_moe
                    runs both; None: such a shape gives a NotTraced line that names them)
        manual      Lightning's manual optimization: `step` is the module's whole training_step, which runs
                    its own backward and optimizer steps (`optimizer` may then be a list); the calls it makes
                    on the module reach the fake optimizers (manualopt.ManualOptimization)

    Raises UserError for bad input: an unknown precision, a step that returns no scalar loss, a device
    this machine lacks. Returns NotTraced when the model cannot run on fake tensors.
    """
    from lmledger.ledger.dryrun.manualopt import ledger_of_manual_step  # manualopt imports this module

    dtype, autocast = precision_dtypes(precision)
    target = target_device(model, device)
    if not (isinstance(accumulate, int) and accumulate >= 1):
        raise UserError(f"accumulate must be a positive number of micro-batches, got {accumulate!r}")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake_model, memo = fake_copy(model, mode, target, dtype, share)
        fake_batch = map_tensors(lambda t: fake_tensor(t, mode, target), cast_batch(batch, dtype))
        configured = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if len(configured) > 1 and not manual:
            raise UserError(
                f"{len(configured)} optimizers: Lightning steps several optimizers only under manual optimization"
            )
        with mode:  # an optimizer that makes state in its constructor (Adagrad) makes it fake
            fake_optimizers = [fake_optimizer(o, fake_model, memo, target) for o in configured]
    except UserError:
        raise
    except Exception as err:  # deepcopy or fake conversion: a model we cannot copy
        return NotTraced(f"could not copy the model onto fake tensors: {one_line(err)}")
    try:
        # force_eager: torch.compile'd submodules run their eager code, so a dry run compiles nothing
        # (dynamo would trace the fake step too, at compile time's cost); it describes the eager step.
        moe_routing = moe.RoutingAssumption(routing)  # grouped GEMMs on CPU fakes; routing-decided shapes
        with mode, torch.compiler.set_stance("force_eager"), RealOutputStorages(), moe_routing:
            with eager_library_decisions():
                if manual:
                    return ledger_of_manual_step(fake_model, fake_batch, step, fake_optimizers, autocast, target)
                return ledger_of_step(fake_model, fake_batch, step, fake_optimizers[0], autocast, target, accumulate)
    except UserError:
        raise
    except Exception as err:
        return NotTraced(f"the step does not run on fake tensors: {why(err)}")


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
    manual: bool = False,
) -> LargestBatch | NotTraced:
    """The largest batch size b <= limit whose predicted peak is at most capacity_bytes.

    `batch_for(b)` makes a batch of b samples (meta tensors will do). The search is planner.largest_within;
    each probe is a dry run, so nothing is allocated. It relies on the peak growing with the batch.
    """

    def run(batch: object) -> StepLedger | NotTraced:
        return dry_run(model, batch, step=step, optimizer=optimizer, precision=precision, device=device,
                       accumulate=accumulate, share=share, manual=manual)  # fmt: skip

    return search_batch(run, batch_for, capacity_bytes, limit)


def search_batch(
    predict: Callable[[object], StepLedger | NotTraced],
    batch_for: Callable[[int], object],
    capacity_bytes: int,
    limit: int,
) -> LargestBatch | NotTraced:
    """The largest b <= limit whose `predict(batch_for(b))` peak fits, by planner.largest_within.

    `predict` is one device's dry run (largest_batch) or one rank's (sharded.largest_batch_sharded).
    """
    if capacity_bytes <= 0 or limit < 1:
        raise UserError(f"capacity_bytes and limit must be positive, got {capacity_bytes} and {limit}")
    ledgers: dict[int, StepLedger] = {}

    def peak(size: int) -> int | NotTraced:
        result = predict(batch_for(size))
        if isinstance(result, NotTraced):
            return result
        ledgers[size] = result
        return result.peak

    found = largest_within(peak, capacity_bytes, limit)
    if isinstance(found, NotTraced):
        return found
    size, over = found
    return LargestBatch(size, ledgers.get(size), ledgers.get(over))


def measure_step(
    model: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    accumulate: int = 1,
) -> StepLedger:
    """The dry run's measured twin: the same two training steps on the real model and batch.

    They train the model: two optimizer steps. For *-true precisions they also convert it in place. Pass a
    copy to keep the original. Peak and activations are counted by the dry run's trackers, on real
    storages. FLOPs are counted by FlopCounterMode on the real kernels.
    """
    dtype, autocast = precision_dtypes(precision)
    device = target_device(model, None)
    if dtype is not None:
        model.to(dtype)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(list(model.parameters()))
    return ledger_of_step(model, cast_batch(batch, dtype), step, optimizer, autocast, device, accumulate)


def training_step(
    model: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | int = "32-true",
) -> Callable[..., None]:
    """`run(phase)`: one more real training step of `model`, as measure_step runs it, to time or profile.

    The forward under the precision's autocast, zero_grad, backward, the optimizer step, each after
    `phase(name)`. The model is as measure_step left it (a *-true precision's dtype already).
    """
    dtype, autocast = precision_dtypes(precision)
    device = target_device(model, None)
    batch, step = cast_batch(batch, dtype), step or default_step

    def run(phase: Callable[[str], None] = lambda name: None) -> None:
        phase("forward")
        loss, _ = _forward(model, batch, step, autocast, device)
        phase("backward")
        _backward(model, loss, optimizer)
        del loss
        phase("optimizer step")
        _optimizer_step(optimizer)

    return run


# --------------------------------------------------------------------------------------------
# The step, on fake or real tensors
# --------------------------------------------------------------------------------------------


def ledger_of_step(
    model: nn.Module,
    batch: object,
    step: StepFn | None,
    optimizer: torch.optim.Optimizer | None,
    autocast: torch.dtype | None,
    device: torch.device,
    accumulate: int = 1,
) -> StepLedger:
    """Two optimizer steps of `accumulate` micro-batches in Lightning's order, read by the fit's reader (watch.py).

    Step 1 also records every op (count/ops.py: the roofline reads it). Step 2's forward and backward are
    timed outside dispatch: the model's own Python.
    """
    step = step or default_step
    was_training = model.training
    model.train()
    # MemoryTracker is read here, so that ledger.sharding can make it its local-shard tracker.
    watch = StepWatch(device, accumulate=accumulate, reading=Reading(tracker=MemoryTracker))
    # Below the FLOP counter on the mode stack: it sees the ops the counter prices, with its formulas.
    recorder = OpRecorder(watch.flop_registry).watch(optimizer)
    clock = DispatchClock()  # the outermost dispatch mode: entered after the watch's, around forward and backward
    kept: list[torch.Tensor | None] = [None]  # Lightning's copy of the last loss, alive into the next step

    def one_step(index: int, timed: AbstractContextManager | None) -> None:
        for micro in range(accumulate):
            recorder.phase = "forward"
            watch.batch_start(model, [optimizer], batch, global_step=index)
            loss, kept[0] = _forward(model, batch, step, autocast, device, timed, accumulate)
            recorder.phase = "backward"
            if micro == 0:
                watch.before_zero_grad()
            watch.before_backward()
            _backward(model, loss, optimizer, first=micro == 0, counter=timed)
            watch.after_backward()
            del loss
            if micro < accumulate - 1:
                watch.batch_end(model, [optimizer], global_step=index)  # still accumulating
        watch.before_optimizer_step()
        _optimizer_step(optimizer)
        watch.batch_end(model, [optimizer], global_step=index + 1)

    try:
        with recorder:  # step 1: FLOPs, saved activations, state, and every op
            try:
                one_step(0, None)
            except BaseException:
                watch.close()  # its FLOP counter sits above the recorder on the mode stack
                raise
        one_step(1, clock)  # step 2: the peak, and the model's Python
    finally:
        watch.close()
        model.train(was_training)
    return watch.step_ledger(model, batch, ops=dataclasses.replace(recorder.summary(), outside=clock.outside))


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
    with PlaceholderScalars() if on_fake else nullcontext():
        optimizer.step()


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
    """Call the model on the batch and return the loss.

    A dict is passed as keywords, a tuple or list as positional arguments, anything else as one argument.
    The loss is a scalar output, `output.loss` (Hugging Face) or `output["loss"]`.
    """
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


def why(err: BaseException) -> str:
    """One line: what fake tensors could not do, and where in the user's code."""
    name = type(err).__name__
    if name == "DataDependentOutputException":
        what = f"a value read from a tensor ({err}), e.g. .item() or `if tensor:`; fake tensors hold no values"
    elif name == "DynamicOutputShapeException":
        what = f"an operator whose output shape depends on tensor values ({err})"
    elif name == "UnsupportedOperatorException":
        what = f"operator {err} has no fake/meta kernel"
    else:
        what = one_line(err)
    return f"{what}{_user_frame(err)}"


def _user_frame(err: BaseException) -> str:
    """' at FILE:LINE' of the innermost traceback frame outside torch and lmledger.ledger.

    Frames in ledger/ are skipped: this module, fakecopy, manualopt, ops, moe.
    """
    where = ""
    tb = err.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/torch/" not in path and not path.startswith(__file__.rsplit("/", 2)[0] + "/"):  # not ledger/ (any folder)
            where = f" at {'/'.join(path.split('/')[-2:])}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
