"""One prediction of a training step, before anything runs: `predict(run, batch=...)`.

For lmledger's ToyLM (run.config set) it is the lecture's closed forms (ledger.closedform.memory, activations,
peak, flops). The fit tables (callbacks.closedform.closed_form), the preflight guard, account, plan max-batch
and the sweeps' dry run all show it. Its activations and peak are absent (`unmodelled` says why) for a ToyLM
with an architecture option set (GeLU, LayerNorm, learned positions, GQA, biases), which the dry run
(toy_dry_run, toy_max_batch) predicts. For any other module (run.module, no config) it is a dry run of
the module's training step (ledger.dryrun.engine). It runs on fake tensors of `batch`'s shapes.

A LightningModule is used by duck typing only (no Lightning import). Its `training_step(batch,
batch_idx)` is the step. Its `configure_optimizers()` gives the optimizer. Lightning's automatic
optimization runs them so. `measure_module`, the dry run's twin, runs the same two steps on real tensors
(dryrun.measure_step); `measure(run)`, account --measure's, runs them on the run's ToyLM with its one
optimizer (`toy_optimizer`), the same bytes fit's Ledger measures (tests/commands/test_account_measure.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.closedform import activations as ledger_activations
from lmledger.ledger.closedform import flops as ledger_flops
from lmledger.ledger.closedform import memory as ledger_memory
from lmledger.ledger.closedform import peak as ledger_peak
from lmledger.ledger.dryrun.engine import (
    LargestBatch,
    NotTraced,
    StepLedger,
    dry_run,
    largest_batch,
    loss_of,
    measure_step,
    training_step,
)
from lmledger.ledger.dryrun.fakecopy import batch_tensors, map_tensors
from lmledger.ledger.run import Run
from lmledger.model import ToyLM, count_parameters

__all__ = [
    "Measurement",
    "Prediction",
    "SeveralOptimizers",
    "configured_optimizer",
    "configured_optimizers",
    "lightning_step",
    "max_batch_module",
    "measure",
    "measure_module",
    "module_step",
    "optimizer_arguments",
    "parameter_count",
    "predict",
    "resized",
    "steps_by_hand",
    "toy_dry_run",
    "toy_max_batch",
    "toy_optimizer",
    "toy_step",
]


@dataclass(frozen=True)
class Prediction:
    """Bytes per device and FLOPs of one training step of a run, predicted.

    Activations and peak are None where the run has no model; `unmodelled` says why. The precision or
    device may be one ledger.closedform.activations does not cover. Or the dry run cannot trace the module. Only
    ToyLM has flops_model (6N + attention, what MFU divides). For any other module, `dry` is the dry
    run's whole ledger.
    """

    params: int | None
    grads: int | None
    optimizer: int | None
    activations: int | None
    autocast_weight_copies: int | None
    peak: int | None
    peak_phase: str | None
    flops_model: int | None
    flops_hardware: int | None
    forward_precision: str
    unmodelled: str | None = None
    dry: StepLedger | None = None

    @property
    def state(self) -> dict[str, int | None]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def predict(run: Run, batch: object = None, *, batch_size: int | None = None) -> Prediction:
    """The prediction for `run`, or for the same run at another per-device batch size.

    ToyLM (run.config set): closed forms. Any other module (run.module): a dry run on `batch`, which is
    then required. It is resized to `batch_size` samples if given.
    """
    if run.config is None:
        return _dry_prediction(run, batch, batch_size)
    if batch_size is not None:
        run = dataclasses.replace(run, batch_size=batch_size)
    cfg, b, t = run.config, run.batch_size, run.seq_len
    report = ledger_flops.analytic_flops(cfg, b, t, training=True)
    state = ledger_memory.state_bytes(
        count_parameters(cfg), run.precision, run.optimizer, run.strategy, run.world_size,
        momentum=run.momentum, weights_dtype=run.weights_dtype,
        largest_layer=ledger_memory.largest_layer_params(cfg),
    )  # fmt: skip
    forward_precision = ledger_memory.model_precision(run.precision, run.strategy)
    flops = {"flops_model": report.model, "flops_hardware": report.hardware}
    try:
        saved = ledger_activations.activation_bytes(cfg, b, t, forward_precision, run.device.type)
        peak = ledger_peak.peak_bytes(
            cfg, b, t, run.precision, run.optimizer, run.strategy, run.world_size,
            momentum=run.momentum, device=run.device.type, fused=run.fused_optimizer,
        )  # fmt: skip
    except UserError as err:  # e.g. transformer-engine: its kernels' saved tensors are not modelled
        return Prediction(**state, activations=None, autocast_weight_copies=None, peak=None, peak_phase=None,
                          **flops, forward_precision=forward_precision, unmodelled=str(err))  # fmt: skip
    return Prediction(
        **state, activations=saved.total, autocast_weight_copies=saved.autocast_weight_copies, peak=peak.total,
        peak_phase=peak.phase, **flops, forward_precision=forward_precision,
    )  # fmt: skip


# Precisions `measure` runs, as Lightning's plugins do (autocast, or the module converted).
# They are those whose activations the closed forms model.
_MEASURABLE = tuple(row.name for row in precision_table.ROWS.values() if row.activation_bytes is not None)


@dataclass(frozen=True)
class Measurement:
    """predict's measured twin for a ToyLM run: bytes and FLOPs of real training steps here.

    `step` runs one more training step, to time.
    """

    flops: int
    params: int
    grads: int
    optimizer: int
    activations: int
    autocast_weight_copies: int
    peak: int
    peak_phase: str | None  # where the tracked peak fell (None: CUDA's allocator, which has no phases)
    step: Callable[[], None]


def toy_optimizer(run: Run) -> Callable[[list], torch.optim.Optimizer] | None:
    """The optimizer of a Run of lmledger's ToyLM, as a factory `params -> optimizer`; None for "none".

    LitLM's kind, fused flag and SGD momentum (lmledger.lit.configure_optimizers). Its learning rate, betas
    and weight-decay groups change no byte of the state, so one group at lr 1e-4 stands for them. The one
    copy: the dry runs (atscale.toy_inputs), `measure` and account's step-time tables take it from here.
    """
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if run.optimizer == "none":
        return None
    if run.optimizer not in kinds:
        raise UserError(f"unknown optimizer {run.optimizer!r}: use adamw or sgd")
    kind, extra = kinds[run.optimizer], {"momentum": run.momentum} if run.optimizer == "sgd" else {}

    def make(params: list) -> torch.optim.Optimizer:
        return kind(params, lr=1e-4, fused=run.fused_optimizer, **extra)

    return make


def toy_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The ToyLM's training step on (inputs, targets): its loss, as LitLM.training_step computes it."""
    return model(*batch)


def toy_dry_run(run: Run, accumulate: int = 1) -> StepLedger | NotTraced:
    """The dry run of a Run of lmledger's ToyLM as configured (its checkpointing too), on meta weights.

    `measure(run)` is its measured twin, byte for byte (tests/commands/test_account_measure.py). Fit's Ledger
    dry-runs LitLM's training_step, which also keeps its loss (4 B more). A device this machine lacks, or a
    precision the dry run does not cover, is a NotTraced with the reason.
    """
    with torch.device("meta"):
        model = ToyLM(run.config)
    batch = tuple(torch.empty(run.batch_size, run.seq_len, dtype=torch.long, device="meta") for _ in range(2))
    try:
        return dry_run(model, batch, step=toy_step, optimizer=toy_optimizer(run), precision=run.precision,
                       device=run.device, accumulate=accumulate)  # fmt: skip
    except UserError as err:
        return NotTraced(str(err))


def toy_max_batch(run: Run, capacity_bytes: int) -> LargestBatch | NotTraced:
    """The largest batch of the run's ToyLM whose dry-run peak (on run.device) fits `capacity_bytes`.

    Plan max-batch's answer where the closed forms are absent (an architecture option set).
    """
    with torch.device("meta"):
        model = ToyLM(run.config)

    def batch_for(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.empty(size, run.seq_len, dtype=torch.long, device="meta") for _ in range(2))

    return largest_batch(model, batch_for, capacity_bytes, step=toy_step, optimizer=toy_optimizer(run),
                         precision=run.precision, device=run.device)  # fmt: skip


def measure(run: Run, accumulate: int = 1) -> Measurement:
    """The run's ToyLM built for real on run.device: the dry run's measured twin (dryrun.measure_step).

    `accumulate` micro-batches per optimizer step, as `toy_dry_run(run, accumulate)` takes them; `step`
    (timed by account) is one micro-batch's.

    Two training steps in Lightning's order, as `lmledger fit`'s Ledger measures them: FLOPs, saved
    activations and state from the first, the peak (live tensor bytes, ledger.count.memtrack, with its phase)
    over the second, steady one. On CUDA the peak is the allocator's over a third step, as fit's is.
    """
    if run.precision not in _MEASURABLE:
        raise UserError(f"--measure supports precisions {', '.join(_MEASURABLE)}, not {run.precision}")
    if run.world_size > 1 or run.strategy != "ddp":
        raise UserError("--measure runs one process; measure a sharded or multi-device config with `lmledger fit`")
    torch.manual_seed(0)
    model = ToyLM(run.config).to(run.device)
    make = toy_optimizer(run)
    optimizer = make(list(model.parameters())) if make is not None else None
    shape = (run.batch_size, run.seq_len)
    batch = tuple(torch.randint(0, run.config.vocab_size, shape, device=run.device) for _ in range(2))
    measured = measure_step(
        model, batch, step=toy_step, optimizer=optimizer, precision=run.precision, accumulate=accumulate
    )
    step = training_step(model, batch, step=toy_step, optimizer=optimizer, precision=run.precision)
    peak, peak_phase = measured.peak, measured.peak_phase
    if run.device.type == "cuda":
        peak, peak_phase = ledger_peak.measure_peak_cuda(step, run.device), None
    return Measurement(
        flops=measured.flops, params=measured.params, grads=measured.grads, optimizer=measured.optimizer,
        activations=measured.activations, autocast_weight_copies=measured.autocast_weight_copies, peak=peak,
        peak_phase=peak_phase, step=step,
    )  # fmt: skip


def _dry_prediction(run: Run, batch: object, batch_size: int | None) -> Prediction:
    if run.module is None or batch is None:
        raise UserError("a run of a module other than lmledger's ToyLM is predicted by a dry run: pass its batch")
    if batch_size is not None:
        batch = resized(batch, batch_size)
    result = _predict_module(run.module, batch, precision=run.precision, device=run.device)
    forward_precision = precision_table.normalize_precision(run.precision)
    if isinstance(result, NotTraced):
        return Prediction(None, None, None, None, None, None, None, None, None, forward_precision, result.reason)
    return Prediction(
        params=result.params, grads=result.grads, optimizer=result.optimizer, activations=result.activations,
        autocast_weight_copies=result.autocast_weight_copies, peak=result.peak, peak_phase=result.peak_phase,
        flops_model=None, flops_hardware=result.flops, forward_precision=forward_precision, dry=result,
    )  # fmt: skip


def _no_log(*args, **kwargs) -> None:
    return None


def lightning_step(batch_idx: int = 0, trainer: object = None) -> Callable[[nn.Module, object], object]:
    """`step(module, batch)` for the dry run of a LightningModule.

    One call of its training_step; the loss as Lightning takes it (a tensor, or a dict's 'loss').
    The module it runs on is a copy. `self.log` is silenced: its metrics must not reach a real trainer.
    `trainer`, if given, is set on it: copies lose theirs (canary
    test_a_lightning_module_copies_without_its_trainer).
    """

    def step(module: nn.Module, batch: object) -> object:
        if trainer is not None:
            module.trainer = trainer
        module.log = module.log_dict = _no_log
        return loss_of(module.training_step(batch, batch_idx))

    return step


module_step = lightning_step()  # no trainer, batch_idx 0: for account, plan and _predict_module


class SeveralOptimizers(UserError):
    """configure_optimizers returned more than one optimizer (configured_optimizer)."""


def configured_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """The one torch optimizer a LightningModule's configure_optimizers returns; None if it has none.

    It takes any form Lightning accepts. An optimizer, or a dict with 'optimizer'. Or a list or tuple
    whose first item is one, or a list of them. More than one is SeveralOptimizers: Lightning steps one optimizer
    under automatic optimization.
    """
    found = configured_optimizers(module)
    if len(found) > 1:
        raise SeveralOptimizers(
            f"{type(module).__name__}.configure_optimizers returns {len(found)} optimizers, which Lightning steps "
            "only under manual optimization: set self.automatic_optimization = False and step them in "
            "training_step, or return one optimizer"
        )
    return found[0] if found else None


def steps_by_hand(module: nn.Module) -> bool:
    """Whether a LightningModule steps its optimizers itself: Lightning's manual optimization."""
    return getattr(module, "automatic_optimization", True) is False


def optimizer_arguments(module: nn.Module) -> dict:
    """dry_run's `optimizer` and `manual` for a LightningModule, as the fit's Ledger passes them: under manual
    optimization (`automatic_optimization = False`) every optimizer configure_optimizers returns, which its
    training_step steps itself; else its one optimizer."""
    manual = steps_by_hand(module)
    return {"optimizer": configured_optimizers(module) if manual else configured_optimizer(module), "manual": manual}


def configured_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """Every torch optimizer a LightningModule's configure_optimizers returns, in any form Lightning accepts."""
    configure = getattr(module, "configure_optimizers", None)
    try:
        configured = configure() if callable(configure) else None
    except ValueError as err:
        if "empty parameter list" not in str(err):
            raise
        raise UserError(_nothing_to_optimize(module)) from None
    found: list[torch.optim.Optimizer] = []

    def collect(item: object) -> None:
        if isinstance(item, torch.optim.Optimizer):
            found.append(item)
        elif isinstance(item, Mapping):
            collect(item.get("optimizer"))
        elif isinstance(item, (list, tuple)) and item:
            # ([optimizers], [schedulers]) or [opt, ...] or [{"optimizer": ...}, ...]
            first = item[0]
            for part in first if isinstance(first, (list, tuple)) else item:
                if isinstance(part, (torch.optim.Optimizer, Mapping)):
                    collect(part)

    collect(configured)
    return found


def _nothing_to_optimize(module: nn.Module) -> str:
    """The line for a configure_optimizers whose optimizer got no parameters (torch: "optimizer got an empty
    parameter list"): the module has none, or none it hands over."""
    name = type(module).__name__
    params = list(module.parameters())
    cause = (
        f"{name} holds no parameters (no layer with weights, no nn.Parameter)"
        if not params
        else f"none of {name}'s {len(params)} parameters reach it (all frozen, or filtered out)"
    )
    return (
        f"{name}.configure_optimizers builds an optimizer over no parameters (torch: optimizer got an empty parameter "
        f"list): {cause}; give the module something to train, or return None from configure_optimizers"
    )


def resized(batch: object, size: int) -> object:
    """The batch's shapes with `size` samples, as meta tensors (nothing allocated).

    Every tensor's first dimension becomes `size`. The batch dimension comes first, as in the ledger's
    samples rule.
    """
    if not batch_tensors(batch):
        raise UserError(
            f"a {type(batch).__name__} batch holds no tensor: the prediction reads batch shapes from tensors "
            "(a tensor, or tuples, lists or dicts of them)"
        )

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return torch.empty((), dtype=t.dtype, device="meta")
        return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")

    return map_tensors(resize, batch)


def _predict_module(
    module: nn.Module,
    batch: object,
    *,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
) -> StepLedger | NotTraced:
    """The dry-run ledger of one training step of `module` on `batch`'s shapes, with its own optimizer(s)."""
    return dry_run(module, batch, step=module_step, precision=precision, device=device, **optimizer_arguments(module))


def measure_module(module: nn.Module, batch: object, *, precision: str | int = "32-true") -> StepLedger:
    """The dry run's measured twin: the same two steps on a copy of the module and the real batch."""
    if precision_table.transformer_engine(precision):  # its layer swap is Lightning's plugin's, at fit
        raise UserError(f"--measure supports precisions {', '.join(_MEASURABLE)}, not {precision}")
    if steps_by_hand(module):
        raise UserError(
            f"--measure runs Lightning's automatic step, and {type(module).__name__} steps its optimizers itself "
            "(automatic_optimization = False): `lmledger fit` measures it beside this prediction"
        )
    real = copy.deepcopy(module)
    return measure_step(real, batch, step=module_step, optimizer=configured_optimizer(real), precision=precision)


def max_batch_module(
    module: nn.Module,
    batch: object,
    capacity_bytes: int,
    *,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
    limit: int = 1 << 16,
) -> LargestBatch | NotTraced:
    """The most samples per batch whose predicted peak fits `capacity_bytes`.

    dryrun.largest_batch over batches shaped like `batch`.
    """
    batch_for: Callable[[int], object] = lambda size: resized(batch, size)  # noqa: E731
    return largest_batch(
        module,
        batch_for,
        capacity_bytes,
        step=module_step,
        precision=precision,
        device=device,
        limit=limit,
        **optimizer_arguments(module),
    )


def parameter_count(module: nn.Module) -> int:
    """Parameters, each shared tensor once (Module.parameters() yields a tied weight once)."""
    return sum(p.numel() for p in module.parameters())
