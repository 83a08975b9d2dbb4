"""Ledger: the whole ledger as one callback, for any LightningModule, with no arguments.

    Trainer(callbacks=[lmledger.Ledger()])

One pipeline serves lmledger's LitLM and any other module:

    predicted   once per fit, before step 1 (callbacks.dryrun). A dry run (ledger.dryrun.engine) runs the
                module's own training_step on fake tensors of the first batch's shapes. It uses the
                module's optimizer, the trainer's precision and its gradient accumulation. It gives
                params, grads, optimizer state, saved activations, peak, hardware FLOPs, and model
                FLOPs as 3 x the forward's (docs/mfu.md). A LitLM also gets the toy LM's closed
                forms as a second predictor (callbacks.closedform), at fit start.
    checked     a predicted peak over what the device holds stops the run before step 1
                (callbacks.preflight)
    measured    on the real steps (callbacks.measure): state, saved activations and FLOPs over
                optimizer step 1, the peak over step 2. Throughput after the warm-up
                (ledger.timing.throughput).
    reported    as one ledger.report.Report: a rich table at fit start, first measurement and end.
                The same goes to JSON (`report.to_json()`), TensorBoard scalars
                (`memory/{predicted,closed_form,measured}/*`,
                `flops/{hardware,model,closed_form,measured}_per_step`, `perf/*`), the text
                `ledger/table` and the chart `memory/predicted_vs_measured`.

This class holds the hooks and the fit's state; each hook hands its work to a part: the prediction and the
fit check to callbacks.ledgerpredict, throughput to callbacks.ledgerrates, the measured table and the
self-check to callbacks.ledgercheck, the step time to callbacks.steptime and callbacks.timing.

Under DDP and FSDP2 the prediction is per rank (callbacks.dryrun, callbacks.fsdp2).
A module the dry run cannot trace gets one line saying why, and is measured only.

The callbacks never change what is trained. The dry run works on a fake copy. Measurement only
observes. Every RNG stream a step may draw from is left as it was found.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from rich.console import Console

from lmledger.callbacks import closedform as toy
from lmledger.callbacks import cpukernels, fsdp2, ledgercheck, ledgerpredict, ledgerrates
from lmledger.callbacks.dryrun import is_toy_run, toy_batch
from lmledger.callbacks.measure import compiled_parts, fit_watch
from lmledger.callbacks.peak_flops import compile_speedup, resolve_peak
from lmledger.callbacks.ranks import write_rank_record
from lmledger.callbacks.settings import LedgerSettings
from lmledger.callbacks.steptime import measured_time, predict_time
from lmledger.callbacks.timing import TimeLedger
from lmledger.callbacks.trainer_io import (
    is_logging_step,
    log_scalars,
    log_text,
    run_from_trainer,
    synchronize,
    torch_optimizers,
    untouched_rng,
)
from lmledger.errors import UserError
from lmledger.ledger.dryrun.engine import StepLedger
from lmledger.ledger.dryrun.fakecopy import batch_tensors
from lmledger.ledger.dryrun.watch import StepWatch
from lmledger.ledger.hardware.cpu import OthersBusy
from lmledger.ledger.hardware.gpus import PeakFlops
from lmledger.ledger.report import Figures, Report
from lmledger.ledger.run import Run
from lmledger.ledger.timing.throughput import Window
from lmledger.ledger.units import MEMORY_ROWS

__all__ = ["Ledger"]

# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class Ledger(pl.Callback):
    """The ledger in one callback (module docstring).

    Args:
        device_memory_gb: memory one device may use, in GB; a run whose predicted peak exceeds it stops
            before step 1. None: CUDA's free memory, or on a CPU this machine's share of available RAM.
        warmup_steps: training batches left out of the throughput figures.
        measure: measure beside the prediction (false: predictions only).
    """

    def __init__(
        self, device_memory_gb: float | None = None, warmup_steps: int = 3, measure: bool = True,
        settings: LedgerSettings | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings or LedgerSettings(
            device_memory_gb=device_memory_gb, warmup_steps=warmup_steps, measure=measure
        )
        self._reset()
        self._unsharded: torch.nn.Module | None = None  # FSDP2: the module before configure_model (on meta)

    # -- fit start --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        ledgers = [c for c in trainer.callbacks if isinstance(c, Ledger)]
        if len(ledgers) > 1 and ledgers[0] is self:
            raise UserError(
                f"the Trainer has {len(ledgers)} Ledger callbacks, and each would count the other's work: keep one "
                "(lmledger fit adds its own; leave lmledger.Ledger out of --trainer.callbacks)"
            )
        # Before configure_model shards it (callbacks.fsdp2): under ModelParallelStrategy, a meta copy to dry-run.
        self._unsharded = fsdp2.unsharded_copy(trainer, pl_module) if stage == "fit" else None

    def _reset(self, accumulate: int = 1) -> None:
        """The state of one fit (a Ledger may see several fits, and validate without one)."""
        self.report: Report | None = None
        self.run: Run | None = None  # the toy LM's run description (None for any other module)
        self.measurement: StepWatch | None = None
        self.timing: TimeLedger | None = None  # the time ledger (callbacks.timing), fed this pipeline's dry run
        self.why_not_predicted: str | None = None
        self.compiled: list[str] = []  # where the module runs torch.compile'd code (measure.compiled_parts)
        self.check: list[str] = []  # the self-check's lines: where measured and predicted differ, and why
        self.tokens: int | None = None
        self.samples = 0
        self.peak_flops: PeakFlops | None = None
        self._accumulate = accumulate
        self._batches = 0
        self._dry: StepLedger | None = None
        self._window: Window | None = None
        self._last_batch_end: float | None = None
        self._paused_since: float | None = None
        self._profiled_since: float | None = None
        self._gap_paused = 0.0
        self._flops_per_batch_of_any_module: dict[str, int | None] | None = None
        self._val_shapes: set[tuple[int, ...]] = set()
        self._toy_flops: dict[tuple[int, int], dict[str, int]] = {}
        self.step_time: object | None = None  # ledger.timing.steptime StepTime or NoStepTime, before step 1
        self._steady = [0.0, 0]  # seconds and batches of the throughput windows: the measured step
        self._others = OthersBusy()  # other processes' share of the CPUs from the first window on

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(1 if not pl_module.automatic_optimization else trainer.accumulate_grad_batches)
        self.compiled = compiled_parts(pl_module)
        self.run = run_from_trainer(trainer, pl_module) if is_toy_run(trainer, pl_module) else None
        if self.settings.time:
            # Profiled batches come after the warm-up and the two measured steps, which they would slow.
            measured = 2 * self._accumulate if self.settings.measure else 0
            self.timing = TimeLedger(
                warmup_steps=max(self.settings.warmup_steps, measured), every_n_steps=self.settings.profile_every,
                intra_node=self.settings.intra_node, inter_node=self.settings.inter_node,
            )  # fmt: skip
        fp8 = self.run.fp8 if self.run is not None else None
        with untouched_rng(pl_module.device):
            self.peak_flops, line = resolve_peak(str(trainer.precision), pl_module.device, fp8)
        log_text(trainer, "perf/peak", line)
        if self.run is not None:  # the toy LM's batch shape is known before the first batch
            ledgerpredict.predict(self, trainer, pl_module, toy_batch(self.run), 0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self.run.compiled:
            compile_speedup(trainer, pl_module, self.run)
        if self.timing is not None:
            self.timing.on_train_start(trainer, pl_module)
        if self.settings.measure:
            # The toy LM compiled: its FLOPs are the closed forms'. Any other compiled module: step 1 compiles
            # unwatched, then FLOPs and the peak are read off the compiled step 2 (dryrun.watch.StepWatch).
            toy_compiled = self.run is not None and self.run.compiled
            compiled = toy_compiled or bool(self.compiled)
            self.measurement = fit_watch(
                pl_module, accumulate=self._accumulate, count_flops=not toy_compiled, activations=not compiled,
                compiled=compiled and not toy_compiled,
            )  # fmt: skip

    # -- every batch (the prediction, once per fit, is callbacks.ledgerpredict) -------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.report is None:
            ledgerpredict.predict(self, trainer, pl_module, batch, batch_idx)
        if self.step_time is None and self.timing is not None and self.report is not None:
            self.step_time = predict_time(trainer, pl_module, self._dry, self.why_not_predicted, self.report,
                                          self._accumulate, self.tokens, self.samples, self.timing)  # fmt: skip
        if self.timing is not None:
            self.timing.prepare(trainer, pl_module, batch, batch_idx)  # its probes before the FLOP counter opens
        if self.measurement is not None and not self.measurement.done:
            self.measurement.batch_start(pl_module, torch_optimizers(trainer), batch, trainer.global_step)
        self._profiled_since = None
        if self.timing is not None:
            self.timing.on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if self.timing.is_profiling_step(self._batches):
                self._profiled_since = time.perf_counter()  # left out of throughput: the profiler slows it
        now = time.perf_counter()
        if self._window is not None and self._last_batch_end is not None:
            self._window.data_wait += now - self._last_batch_end - self._gap_paused
        self._gap_paused = 0.0
        # Throughput leaves out the warm-up batches (by default 3: they hold the two measured steps too).
        if self._window is None and self._batches == self.settings.warmup_steps:
            synchronize(pl_module.device)
            self._others.start()
            self._window = Window(start=time.perf_counter())

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        if self.measurement is not None:
            self.measurement.before_zero_grad()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.measurement is not None:
            self.measurement.before_backward()

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.measurement is not None:
            self.measurement.after_backward()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.measurement is not None:
            self.measurement.before_optimizer_step()
        if self.timing is not None:
            self.timing.on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.timing is not None:
            self.timing.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._batches += 1
        measuring = self.measurement is not None and not self.measurement.done
        if measuring and self.measurement.batch_end(pl_module, torch_optimizers(trainer), trainer.global_step):
            ledgercheck.report_measured(self, trainer)
        if self._window is not None and self._profiled_since is not None:
            self._window.paused += time.perf_counter() - self._profiled_since
        elif self._window is not None:
            tokens, flops = ledgerrates.batch_tokens(self, batch), ledgerrates.flops_per_batch(self, batch)
            self._window.add(tokens=tokens, samples=self.samples, flops=flops)
            if is_logging_step(trainer):
                ledgerrates.log_throughput(self, trainer, pl_module)
        self._last_batch_end = time.perf_counter()

    # -- validation -------------------------------------------------------------------------------

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.run is None:  # the toy LM only; and `validate` runs no fit
            return
        shape = tuple(batch_tensors(batch)[0].shape)
        if shape not in self._val_shapes:
            self._val_shapes.add(shape)
            log_scalars(trainer, toy.validation_flops(self.run, shape))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window is not None and not trainer.sanity_checking:
            synchronize(pl_module.device)
            self._paused_since = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timing is not None:
            self.timing.on_validation_end(trainer, pl_module)
        if self._paused_since is not None:
            paused = time.perf_counter() - self._paused_since
            self._window.paused += paused
            self._gap_paused += paused
            self._paused_since = None

    # -- the measured table -----------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measurement is not None:
            self.measurement.close()
            if self.report is not None and self.report.measured is None:
                for line in (*MEMORY_ROWS, "flops_hardware"):
                    if line not in self.measurement.values:
                        self.measurement.why_missing.setdefault(line, "not measured (run too short)")
                ledgercheck.report_measured(self, trainer)
        if self.report is not None:
            measured_time(
                self.report,
                self.step_time,
                self._steady,
                self._accumulate,
                trainer.is_global_zero,
                self._others.share(),
            )
            write_rank_record(trainer, self.report)
        if trainer.is_global_zero and self.report is not None:
            Console().print(self.report.table("ledger (summary)"))
        if self.timing is not None:
            self.timing.on_fit_end(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.measurement is not None:
            self.measurement.close()
        if self.timing is not None:
            self.timing.on_exception(trainer, pl_module, exception)
        if isinstance(exception, torch.cuda.OutOfMemoryError) and self.report is not None:
            ledgercheck.explain_oom(self, trainer, pl_module, exception)
        line = cpukernels.missing_kernel_line(exception, str(trainer.precision))
        if line is not None:  # `lmledger fit` prints it alone (exit 2); a traceback in library use ends with it
            exception.ledger_line = line
            exception.add_note(line)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.measurement is not None:
            self.measurement.close()

    # -- reading the results ----------------------------------------------------------------------

    @property
    def predicted(self) -> Figures | None:
        """The first predictor's figures (the dry run where it traced)."""
        return self.report.primary if self.report is not None else None

    @property
    def measured(self) -> Figures | None:
        return self.report.measured if self.report is not None else None
