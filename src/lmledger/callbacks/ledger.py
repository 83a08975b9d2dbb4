"""Ledger: the whole ledger as one callback, for any LightningModule, with no arguments.

    Trainer(callbacks=[lmledger.callbacks.Ledger()])

For lmledger's own LitLM (a ToyLM fed by a TokenDataModule) it is the ledger_callbacks() set, with
the toy LM's closed forms beside the measurement, plus ToyCrossCheck: the dry run beside the closed
forms. For any other module it is AnyModelLedger:

- before step 1, on the real first batch, a dry run (lmledger.ledger.dryrun) of the module's own
  training_step on fake tensors of that batch's shapes, with the optimizer it configured and the
  trainer's precision: params, grads, optimizer state, saved activations, peak, hardware FLOPs;
- beside it, measured on the real steps: state bytes after step 1, saved activations and FLOPs
  (FlopCounterMode) over step 1, the peak over step 2 (CUDA's allocator; elsewhere the live tensor
  bytes ledger.memtrack counts), and throughput after the warm-up steps;
- the table of both, printed at the first measurement and at the end, and TensorBoard scalars:
  memory/{predicted,measured}/*, flops/hardware_per_step, flops/measured_per_step,
  perf/tokens_per_sec (or perf/samples_per_sec), perf/tflops, perf/hfu.

Tokens per batch: the module's `tokens_per_batch` if it has one (an int, or a method taking the
batch); else the number of elements of the first integer tensor of rank 2 in the batch (token ids,
batch x sequence); a batch with none has samples (the first tensor's first dimension), and the run
reports samples/s and no tokens/s. There is no MFU for an arbitrary model: model FLOPs (6N +
attention) need the architecture; HFU (hardware FLOPs over the dense peak) is reported instead.

A module the dry run cannot trace, a manual-optimization module or a sharded strategy gets one line
saying why it is not predicted, and is measured only.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from rich.console import Console
from rich.table import Table

from lmledger.callbacks.preflight import available_memory, processes_on_this_machine
from lmledger.callbacks.run import log_scalars, log_text, markdown_table, synchronize, untouched_rng
from lmledger.errors import ConfigError, UserError
from lmledger.ledger.dryrun import NotTraced, StepLedger, batch_tensors, dry_run, loss_of
from lmledger.ledger.flops import flop_counter
from lmledger.ledger.hardware import compute_dtype_for_precision, peak_flops
from lmledger.ledger.memory import measure_saved_activations, measure_state_bytes
from lmledger.ledger.memtrack import MemoryTracker
from lmledger.ledger.units import MEMORY_COMPONENTS, format_bytes, format_count
from lmledger.lightning_private import should_update_logs
from lmledger.model import ToyLM

MEMORY = (*MEMORY_COMPONENTS, "autocast_weight_copies", "peak")


# --------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------


def tokens_per_batch(pl_module: pl.LightningModule, batch: object) -> int | None:
    """Tokens in `batch` (module docstring: the module's `tokens_per_batch`, else the first integer
    rank-2 tensor's size), or None when the batch holds no token ids."""
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


# --------------------------------------------------------------------------------------------
# The umbrella
# --------------------------------------------------------------------------------------------


def is_toy_run(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """lmledger's own run: a ToyLM at `.model` and a data module that states batch_size and context_length."""
    datamodule = getattr(trainer, "datamodule", None)
    return (
        isinstance(getattr(pl_module, "model", None), ToyLM)
        and isinstance(getattr(datamodule, "batch_size", None), int)
        and isinstance(getattr(datamodule, "context_length", None), int)
    )


class Ledger(pl.Callback):
    """The ledger in one callback (module docstring). Every hook goes to the callbacks it chose.

    Args:
        device_memory_gb: memory one device may use, in GB; a run whose predicted peak exceeds it
            stops before step 1. None: CUDA's free memory (no check on a CPU).
        warmup_steps: training batches left out of the throughput figures.
        measure: measure beside the prediction (false: predictions only).
    """

    def __init__(self, device_memory_gb: float | None = None, warmup_steps: int = 3, measure: bool = True) -> None:
        from lmledger.callbacks import LedgerSettings  # the package imports this module

        self.settings = LedgerSettings(device_memory_gb=device_memory_gb, warmup_steps=warmup_steps, measure=measure)
        self.callbacks: list[pl.Callback] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.callbacks:
            from lmledger.callbacks import ledger_callbacks

            if is_toy_run(trainer, pl_module):
                self.callbacks = ledger_callbacks(self.settings)
                # Before MemoryLedger: its saved-tensor hooks open in the same hook and must see
                # only the training step.
                self.callbacks.insert(len(self.callbacks) - 1, ToyCrossCheck())
            else:
                self.callbacks = [
                    AnyModelLedger(self.settings.device_memory_gb, self.settings.warmup_steps, self.settings.measure)
                ]
        for callback in self.callbacks:
            callback.setup(trainer, pl_module, stage)


def _forward_hook(name: str):
    def hook(self: Ledger, *args, **kwargs) -> None:
        for callback in self.callbacks:
            getattr(callback, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in [n for n in vars(pl.Callback) if n.startswith("on_") or n == "teardown"]:
    setattr(Ledger, _name, _forward_hook(_name))


class ToyCrossCheck(pl.Callback):
    """For LitLM: the dry run of its training step beside the toy LM's closed forms, once, before step 1.

    Prints one table and logs memory/dryrun/* and flops/dryrun_per_step; MemoryLedger and FlopLedger
    show the closed forms beside the measurement. The closed-form peak leaves out the buffers (rotary
    tables) and the batch, which the dry run counts as the tracker does: the table adds them to it."""

    def __init__(self) -> None:
        self.closed: dict[str, int | None] = {}
        self.dry: StepLedger | NotTraced | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.dry is not None:
            return
        from lmledger.callbacks.memory import predict_memory
        from lmledger.callbacks.run import LedgerRun
        from lmledger.ledger.flops import analytic_flops

        self.dry = dry_run_training_step(trainer, pl_module, batch, batch_idx)
        if isinstance(self.dry, NotTraced):
            rank_zero_info(f"ledger: no dry run beside the closed forms: {self.dry.reason}")
            return
        run = LedgerRun.from_trainer(trainer, pl_module)
        closed = predict_memory(run)
        self.closed = {name: getattr(closed, name) for name in MEMORY}
        if self.closed["peak"] is not None:
            self.closed["peak"] += self.dry.buffers + self.dry.batch
        self.closed["flops"] = analytic_flops(run.config, run.batch_size, run.seq_len).hardware
        scalars = {f"memory/dryrun/{name}": getattr(self.dry, name) for name in MEMORY}
        scalars["flops/dryrun_per_step"] = self.dry.flops
        log_scalars(trainer, scalars, step=trainer.global_step)
        if trainer.is_global_zero:
            Console().print(self.table())

    def rows(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for name in (*MEMORY, "flops"):
            closed = self.closed.get(name)
            dry = self.dry.flops if name == "flops" else getattr(self.dry, name)
            if name == "autocast_weight_copies" and not closed and not dry:
                continue
            show = format_count if name == "flops" else format_bytes
            label = "FLOPs/step (hardware)" if name == "flops" else name
            rows.append((label, show(closed) if closed is not None else "n/a", show(dry), _ratio(dry, closed)))
        return rows

    def table(self) -> Table:
        table = Table(title="toy LM: closed form beside dry run", title_justify="left")
        for column in ("", "closed form", "dry run", "dry run/closed form"):
            table.add_column(column, justify="right" if column else "left")
        for row in self.rows():
            table.add_row(*row)
        table.caption = (
            f"peak: the closed form's plus the buffers ({format_bytes(self.dry.buffers)}) and the batch "
            f"({format_bytes(self.dry.batch)}) the dry run counts; dry-run peak during {self.dry.peak_phase}"
        )
        return table


# --------------------------------------------------------------------------------------------
# Any model
# --------------------------------------------------------------------------------------------


@dataclass
class _Measured:
    values: dict[str, int] = field(default_factory=dict)
    flops: int | None = None
    rate: float | None = None  # tokens/s or samples/s over the last window
    tflops: float | None = None
    hfu: float | None = None


class AnyModelLedger(pl.Callback):
    """Predicted (dry run) beside measured for any LightningModule; Ledger() picks it (module docstring)."""

    def __init__(self, device_memory_gb: float | None = None, warmup_steps: int = 3, measure: bool = True) -> None:
        if device_memory_gb is not None and not device_memory_gb > 0:
            raise ConfigError(f"ledger.device_memory_gb must be positive, got {device_memory_gb}")
        if warmup_steps < 0:
            raise ConfigError(f"ledger.warmup_steps must be >= 0, got {warmup_steps}")
        self.device_memory_gb, self.warmup_steps, self.measure = device_memory_gb, warmup_steps, measure
        self.predicted: StepLedger | None = None
        self.why_not_predicted: str | None = None
        self.measured = _Measured()
        self.tokens: int | None = None
        self.samples = 0
        self._batches = 0
        self._counters: list = []
        self._saved = None
        self._hooks: contextlib.ExitStack | None = None
        self._tracker: MemoryTracker | None = None
        self._window_start: float | None = None
        self._window_batches = 0
        self._paused = 0.0
        self._pause_start: float | None = None
        self._peak_flops: float | None = None
        self._reported = False
        self._gc_was_enabled = False

    # -- before step 1: the dry run ---------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = 0
        self._reported = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._batches == 0:
            self._predict(trainer, pl_module, batch, batch_idx)
            if self.measure:
                self._hooks = contextlib.ExitStack()
                self._saved = self._hooks.enter_context(measure_saved_activations(pl_module))
                self._start_counter()
        elif self._batches == 1 and self.measure:
            self._arm_peak(trainer, pl_module, batch)
        # Throughput leaves out the warm-up and the two measured steps (their counters slow them).
        if self._batches == max(self.warmup_steps, 2 if self.measure else 0):
            synchronize(pl_module.device)
            self._window_start, self._window_batches, self._paused = time.perf_counter(), 0, 0.0

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.tokens = tokens_per_batch(pl_module, batch)
        self.samples = samples_per_batch(batch)
        result = dry_run_training_step(trainer, pl_module, batch, batch_idx)
        why = result.reason if isinstance(result, NotTraced) else None
        self.predicted = None if why else result
        self.why_not_predicted = why
        if why is not None:
            rank_zero_info(f"ledger: {type(pl_module).__name__} is measured only, not predicted: {why}")
        else:
            self._log_prediction(trainer)
            self._preflight(trainer, pl_module)
            if trainer.is_global_zero:
                Console().print(self.table("ledger (predicted)"))

    def _log_prediction(self, trainer: pl.Trainer) -> None:
        p = self.predicted
        scalars = {f"memory/predicted/{name}": getattr(p, name) for name in MEMORY}
        scalars["flops/hardware_per_step"] = p.flops
        log_scalars(trainer, scalars, step=trainer.global_step)

    def _preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The capacity PreflightGuard uses for LitLM: CUDA's free memory, this machine's share of RAM, or the setting.
        processes = processes_on_this_machine(trainer)
        capacity = available_memory(pl_module.device, self.device_memory_gb, pl_module, processes)
        if capacity is not None and self.predicted.peak > capacity.bytes:
            raise UserError(
                f"the predicted peak {format_bytes(self.predicted.peak)} ({self.predicted.peak_phase}) exceeds "
                f"{format_bytes(capacity.bytes)} per device ({capacity.source}): lower the batch size, "
                "checkpoint activations or set ledger.device_memory_gb"
            )

    # -- steps 1 and 2: measurement -----------------------------------------------------------------

    def _start_counter(self) -> None:
        counter = flop_counter()
        counter.__enter__()
        self._counters.append(counter)

    def _stop_counter(self) -> None:
        while self._counters:
            counter = self._counters.pop()
            counter.__exit__(None, None, None)
            self.measured.flops = (self.measured.flops or 0) + counter.get_total_flops()

    def _arm_peak(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch) -> None:
        # The cycle collector is off for this step, as in the dry run (dryrun._no_cyclic_gc): what a
        # step leaves in reference cycles is then freed at the same point every time.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            return
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        self._tracker = MemoryTracker().track(pl_module, optimizers, batch_tensors(batch))
        self._tracker.phase("forward")
        self._tracker.start()

    def _phase(self, name: str) -> None:
        if self._tracker is not None:
            self._tracker.phase(name)

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self._phase("backward")  # zero_grad only frees; the dry run charges it to backward too

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._close_hooks()  # forward is over: what backward needs is saved
        self._phase("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._phase("optimizer step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batches += 1
        if self._batches == 1 and self.measure:
            self._close_hooks()
            self._stop_counter()
            if self._saved is not None:
                self.measured.values["activations"] = self._saved.activations
                self.measured.values["autocast_weight_copies"] = self._saved.autocast_weight_copies
                self._saved = None
            self.measured.values.update(measure_state_bytes(pl_module, _torch_optimizer(trainer)))
        elif self._batches == 2 and self.measure:
            if self._tracker is not None:
                self._tracker.stop()
                self.measured.values["peak"] = self._tracker.peak_bytes
                self._tracker = None
            elif pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
                self.measured.values["peak"] = torch.cuda.max_memory_allocated(pl_module.device)
            self._restore_gc()
            self._report_measured(trainer)
        if self._window_start is not None:
            self._window_batches += 1
            if should_update_logs(trainer):
                self._log_throughput(trainer, pl_module)

    def _log_throughput(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize(pl_module.device)  # only at logging steps: no host sync on the others
        now = time.perf_counter()
        seconds = now - self._window_start - self._paused
        if seconds <= 0 or self._window_batches == 0:
            return
        per_step = self.measured.flops or (self.predicted.flops if self.predicted else None)
        scalars = {}
        if self.tokens is not None:
            self.measured.rate = scalars["perf/tokens_per_sec"] = self.tokens * self._window_batches / seconds
        else:
            self.measured.rate = scalars["perf/samples_per_sec"] = self.samples * self._window_batches / seconds
        if per_step:
            flops_per_s = per_step * self._window_batches / seconds
            self.measured.tflops = scalars["perf/tflops"] = flops_per_s / 1e12
            peak = self._peak(trainer, pl_module)
            if peak:
                self.measured.hfu = scalars["perf/hfu"] = flops_per_s / peak
        log_scalars(trainer, scalars)
        self._window_start, self._window_batches, self._paused = now, 0, 0.0

    def _peak(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
        if self._peak_flops is None:
            with warnings.catch_warnings(), untouched_rng(pl_module.device):
                warnings.simplefilter("ignore")
                try:
                    dtype = compute_dtype_for_precision(str(trainer.precision))
                    peak = peak_flops(dtype, pl_module.device)
                except UserError:
                    peak = None
            self._peak_flops = peak.flops_per_s if peak else 0.0
        return self._peak_flops or None

    def on_validation_start(self, trainer, pl_module) -> None:
        self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def _close_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    def _restore_gc(self) -> None:
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_gc()
        self._close_hooks()
        self._stop_counter()
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None

    # -- the table ------------------------------------------------------------------------------

    def _report_measured(self, trainer: pl.Trainer) -> None:
        self._reported = True
        scalars = {f"memory/measured/{k}": v for k, v in self.measured.values.items()}
        if self.measured.flops is not None:
            scalars["flops/measured_per_step"] = self.measured.flops
        log_scalars(trainer, scalars)
        rows = [[name, predicted, measured, ratio] for name, predicted, measured, ratio in self.rows()]
        log_text(trainer, "ledger/table", markdown_table(["", "predicted", "measured", "measured/predicted"], rows))
        if trainer.is_global_zero:
            Console().print(self.table("ledger (predicted beside measured)"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_gc()
        self._close_hooks()
        self._stop_counter()
        if self._tracker is not None:  # a fit that stopped inside the measured step
            self._tracker.stop()
            self._tracker = None
        if trainer.is_global_zero and (self.predicted is not None or self.measured.values):
            Console().print(self.table("ledger (summary)"))

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(line, predicted, measured, measured/predicted) as shown in the table."""
        p, m = self.predicted, self.measured
        rows = []
        for name in MEMORY:
            pred = getattr(p, name) if p is not None else None
            if name == "autocast_weight_copies" and not pred and not m.values.get(name):
                continue
            meas = m.values.get(name)
            rows.append((name, format_bytes(pred), format_bytes(meas) if meas is not None else "", _ratio(meas, pred)))
        pred_flops = p.flops if p is not None else None
        rows.append(
            (
                "FLOPs/step (hardware)",
                format_count(pred_flops) if pred_flops is not None else "n/a",
                format_count(m.flops) if m.flops is not None else "",
                _ratio(m.flops, pred_flops),
            )
        )
        if m.rate:  # measured after the warm-up steps
            rows.append(("tokens/s" if self.tokens is not None else "samples/s", "", f"{m.rate:.4g}", ""))
        if m.hfu is not None:
            rows.append(("HFU", "", f"{m.hfu:.2%}", ""))
        return rows

    def table(self, title: str) -> Table:
        table = Table(title=title, title_justify="left")
        for column in ("", "predicted", "measured", "measured/predicted"):
            table.add_column(column, justify="right" if column else "left")
        for row in self.rows():
            table.add_row(*row)
        per_batch = f"{self.tokens} tokens" if self.tokens is not None else f"{self.samples} samples"
        notes = [f"per device; {per_batch} per batch"]
        if self.predicted is not None:
            notes.append(f"predicted by a dry run on fake tensors; peak during {self.predicted.peak_phase}")
        else:
            notes.append(f"not predicted: {self.why_not_predicted}")
        table.caption = "; ".join(notes)
        return table


def dry_run_training_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
) -> StepLedger | NotTraced:
    """The dry run of `pl_module.training_step` on `batch` with the trainer's optimizer and precision,
    or why there is none. The copy keeps the trainer and logs nothing; the RNG streams are untouched."""
    why = _not_modelled(trainer, pl_module)
    if why is not None:
        return NotTraced(why)

    def step(module, fake_batch):
        module.trainer = trainer  # copies lose it (canary test_a_lightning_module_copies_without_its_trainer)
        module.log = module.log_dict = _no_log  # the copy's metrics must not reach the real trainer
        return loss_of(module.training_step(fake_batch, batch_idx))

    with untouched_rng(pl_module.device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return dry_run(
                pl_module,
                batch,
                step=step,
                optimizer=_torch_optimizer(trainer),
                precision=str(trainer.precision),
                device=pl_module.device,
                share=(trainer,),
            )
        except UserError as err:
            return NotTraced(str(err))


def _ratio(measured: float | None, predicted: float | None) -> str:
    return f"{measured / predicted:.3f}" if measured is not None and predicted else ""


def _torch_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer | None:
    """The run's torch optimizer (Lightning wraps it under some strategies), or None."""
    if not trainer.optimizers:
        return None
    return getattr(trainer.optimizers[0], "optimizer", trainer.optimizers[0])


def _no_log(*args, **kwargs) -> None:
    return None


def _not_modelled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the dry run does not apply to this run, or None."""
    if not pl_module.automatic_optimization:
        return "manual optimization (the dry run models Lightning's automatic optimization step)"
    if len(trainer.optimizers) > 1:
        return "more than one optimizer"
    replicated = isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy))
    if not replicated or isinstance(trainer.strategy, DeepSpeedStrategy):  # DeepSpeed subclasses DDPStrategy
        return f"{type(trainer.strategy).__name__} shards the model; the dry run models one replicated device"
    if trainer.accumulate_grad_batches != 1:
        return "gradient accumulation (the dry run models one batch per optimizer step)"
    return None
