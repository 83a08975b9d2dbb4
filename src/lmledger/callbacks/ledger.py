"""Ledger: the whole ledger as one callback, for any LightningModule, with no arguments.

    Trainer(callbacks=[lmledger.Ledger()])

One pipeline serves lmledger's LitLM and any other module:

    predicted   once per fit, before step 1 (callbacks.live). A dry run (ledger.dryrun) runs the
                module's own training_step on fake tensors of the first batch's shapes. It uses the
                module's optimizer, the trainer's precision and its gradient accumulation. It gives
                params, grads, optimizer state, saved activations, peak, hardware FLOPs, and model
                FLOPs as 3 x the forward's (docs/mfu.md). A LitLM also gets the toy LM's closed
                forms as a second predictor (callbacks.toy), at fit start.
    checked     a predicted peak over what the device holds stops the run before step 1
                (callbacks.preflight)
    measured    on the real steps (callbacks.measure): state, saved activations and FLOPs over
                optimizer step 1, the peak over step 2. Throughput after the warm-up
                (ledger.throughput).
    reported    as one ledger.report.Report: a rich table at fit start, first measurement and end.
                The same goes to JSON (`report.to_json()`), TensorBoard scalars
                (`memory/{predicted,closed_form,measured}/*`,
                `flops/{hardware,model,closed_form,measured}_per_step`, `perf/*`), the text
                `ledger/table` and the chart `memory/predicted_vs_measured`.

Under DDP and FSDP2 the prediction is per rank (callbacks.live, callbacks.fsdp2).
A module the dry run cannot trace gets one line saying why, and is measured only.

The callbacks never change what is trained. The dry run works on a fake copy. Measurement only
observes. Every RNG stream a step may draw from is left as it was found.
"""

from __future__ import annotations

import dataclasses
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from rich.console import Console

from lmledger.callbacks import cpukernels, fsdp2, preflight, toy
from lmledger.callbacks.live import (
    dry_run_training_step,
    is_toy_run,
    largest_training_batch,
    samples_per_batch,
    tokens_per_batch,
    toy_batch,
)
from lmledger.callbacks.measure import StepMeasurement, compiled_parts
from lmledger.callbacks.ranks import write_rank_record
from lmledger.callbacks.run import (
    is_logging_step,
    log_scalars,
    log_text,
    logging_step,
    run_from_trainer,
    synchronize,
    tensorboard_writers,
    torch_optimizers,
    untouched_rng,
)
from lmledger.callbacks.settings import LedgerSettings
from lmledger.callbacks.throughput import compile_speedup, resolve_peak
from lmledger.callbacks.timing import TimeLedger, measured_time, predict_time
from lmledger.errors import UserError
from lmledger.ledger import moebounds, precision_table
from lmledger.ledger.dryrun import NotTraced, StepLedger
from lmledger.ledger.fakecopy import batch_tensors
from lmledger.ledger.gpus import Peak
from lmledger.ledger.predict import resized
from lmledger.ledger.report import Figures, Miss, Report, bar_chart, figures_of_step, markdown_table, misses
from lmledger.ledger.run import Run
from lmledger.ledger.throughput import Window
from lmledger.ledger.units import format_bytes, tera

__all__ = ["Ledger"]

LABELS_FOR_CHECK = {"flops_hardware": "hardware FLOPs per step", "autocast_weight_copies": "autocast weight copies"}

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
        self.measurement: StepMeasurement | None = None
        self.timing: TimeLedger | None = None  # the time ledger (callbacks.timing), fed this pipeline's dry run
        self.why_not_predicted: str | None = None
        self.compiled: list[str] = []  # where the module runs torch.compile'd code (measure.compiled_parts)
        self.check: list[str] = []  # the self-check's lines: where measured and predicted differ, and why
        self.tokens: int | None = None
        self.samples = 0
        self.peak: Peak | None = None
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
        self.step_time: object | None = None  # ledger.steptime StepTime or NoStepTime, before step 1
        self._steady = [0.0, 0]  # seconds and batches of the throughput windows: the measured step

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
            self.peak, line = resolve_peak(str(trainer.precision), pl_module.device, fp8)
        log_text(trainer, "perf/peak", line)
        if self.run is not None:  # the toy LM's batch shape is known before the first batch
            self._predict(trainer, pl_module, toy_batch(self.run), 0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self.run.compiled:
            compile_speedup(trainer, pl_module, self.run)
        if self.timing is not None:
            self.timing.on_train_start(trainer, pl_module)
        if self.settings.measure:
            # The toy LM compiled: its FLOPs are the closed forms'. Any other compiled module: step 1 compiles
            # unwatched, then FLOPs and the peak are read off the compiled step 2 (measure.StepMeasurement).
            toy_compiled = self.run is not None and self.run.compiled
            compiled = toy_compiled or bool(self.compiled)
            self.measurement = StepMeasurement(
                pl_module.device, accumulate=self._accumulate, manual=not pl_module.automatic_optimization,
                count_flops=not toy_compiled, activations=not compiled, compiled=compiled and not toy_compiled,
            )  # fmt: skip

    # -- the prediction (once per fit) ------------------------------------------------------------

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> None:
        self.tokens = self.run.tokens_per_batch if self.run is not None else tokens_per_batch(pl_module, batch)
        self.samples = self.run.batch_size if self.run is not None else samples_per_batch(batch)
        dry = dry_run_training_step(trainer, pl_module, batch, batch_idx, self._accumulate, self._unsharded)
        worst = None
        if isinstance(dry, moebounds.MoEBounds):  # top-k routing decides shapes: two stated assumptions
            dry, worst = dry.balanced, dry.worst
        predicted: dict[str, Figures] = {}
        notes = [f"per device; {self.tokens} tokens per batch" if self.tokens is not None
                 else f"per device; {self.samples} samples per batch"]  # fmt: skip
        if self._accumulate > 1:
            notes.append(f"one optimizer step = {self._accumulate} micro-batches (activations: one micro-batch's)")
        if self.timing is not None:  # the same dry run prices the step's time: each op is seen once
            self.timing.prediction = dry if isinstance(dry, StepLedger) else None
            self.timing.why_no_bound = dry.reason if isinstance(dry, NotTraced) else None
        if isinstance(dry, NotTraced):
            self.why_not_predicted = dry.reason
            rank_zero_info(f"ledger: {type(pl_module).__name__} is not dry-run, so measured only: {dry.reason}")
            notes.append(f"not predicted, measured only: {dry.reason}")
            self._dry = None
        else:
            self._dry = dry
            predicted["dry run"] = figures_of_step(dry, flops_model=3 * dry.flops_forward)
            notes.append(f"dry run on fake tensors, peak during {dry.peak_phase}")
            if self.compiled:  # the dry run runs compiled code eager (dryrun: set_stance force_eager)
                shown = ", ".join(self.compiled[:3]) + (", ..." if len(self.compiled) > 3 else "")
                line = (
                    f"torch.compile ({shown}): the dry run predicts the eager step, which does not cover the "
                    "compiled step's own saved activations and buffers (fused kernels); the fit runs compiled, "
                    "and is measured so"
                )
                rank_zero_info(f"ledger: {line}")
                notes.append(line)
        if worst is not None:
            predicted["worst routing"] = figures_of_step(worst, flops_model=3 * worst.flops_forward)
            notes.append(
                "mixture of experts: the dry run assumes balanced routing (tokens·k/E per expert), 'worst routing' "
                "every expert hit and the rest of the tokens on the same k (the memory check holds it)"
            )
        if self.run is not None:
            predicted["closed form"] = toy.closed_form(self.run, self._dry, self._accumulate)
            notes.append("closed form: the lecture's formulas (its peak plus the buffers and the batch)")
        if precision_table.precision(str(trainer.precision)).autocast is not None:
            notes.append("autocast_weight_copies: autocast's low-precision weight casts, in neither params nor "
                         "activations; in the peak")  # fmt: skip
        self.report = Report(predicted, notes=notes)
        if not predicted:
            return
        log_scalars(trainer, self.report.scalars("predicted"), step=trainer.global_step)
        if self.run is not None:
            self._summary_card(trainer)
        self._check_fits(trainer, pl_module, batch)
        self._unsharded = None  # predicted: the copy is no longer needed
        if trainer.is_global_zero:
            Console().print(self.report.table("ledger (predicted)"))

    def _summary_card(self, trainer: pl.Trainer) -> None:
        rows = toy.summary_rows(self.run, self.report.primary)
        log_text(trainer, "ledger/summary", markdown_table(["", "value", ""], rows), step=trainer.global_step)
        breakdown = toy.flop_breakdown(self.run.config, (self.run.batch_size, self.run.seq_len))
        log_text(trainer, "flops/breakdown", breakdown, step=trainer.global_step)

    def _check_fits(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object) -> None:
        """Stop before step 1 if the predicted peak exceeds what the device holds (callbacks.preflight)."""
        processes = preflight.processes_on_this_machine(trainer)
        capacity = preflight.available_memory(pl_module.device, self.settings.device_memory_gb, pl_module, processes)
        primary = self.report.predicted.get("worst routing") or next(
            (f for f in self.report.predicted.values() if f.peak is not None), None
        )
        if capacity is None:
            return
        if primary is None:
            if self.settings.device_memory_gb is not None or pl_module.device.type == "cuda":
                rank_zero_warn(f"no memory check before step 1: no predicted peak ({self.why_not_predicted})")
            return
        if primary.peak <= capacity.bytes:
            return
        if trainer.is_global_zero:
            Console(stderr=True).print(self.report.table("ledger (predicted)"))
        raise UserError(
            preflight.does_not_fit(primary, capacity, self._batch_hint(trainer, pl_module, batch, capacity))
        )

    def _batch_hint(self, trainer, pl_module, batch, capacity: preflight.Capacity) -> str:
        """The largest batch whose dry-run peak fits, found by dry runs at other batch sizes."""
        now = self.run.batch_size if self.run is not None else self.samples
        flag = "--data.batch_size" if self.run is not None else "a batch of"

        def batch_for(size: int) -> object:
            return toy_batch(self.run, size) if self.run is not None else resized(batch, size)

        found = largest_training_batch(  # per rank under DDP and FSDP2, as the dry run above
            trainer, pl_module, batch_for, capacity.bytes, max(1, now), self._accumulate, self._unsharded
        ) if self._dry is not None else None  # fmt: skip
        if found is None or isinstance(found, NotTraced):
            return "lower the batch size, checkpoint activations or set ledger.device_memory_gb"
        if found.size == 0:
            return (
                f"not even {flag} 1 fits: shorten the sequence, checkpoint activations, train in bf16-true, or shard"
                if self.run is not None
                else "not even one sample fits: checkpoint activations, train in bf16-true, or shard (FSDP)"
            )
        return f"{flag} {found.size} fits (now {now})" + ("" if self.run is not None else " samples")

    # -- every batch --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.report is None:
            self._predict(trainer, pl_module, batch, batch_idx)
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
            self._window = Window(start=time.perf_counter())

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        if self.measurement is not None:
            self.measurement.before_zero_grad()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.measurement is not None:
            self.measurement.before_backward()

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
            self._report_measured(trainer)
        if self._window is not None and self._profiled_since is not None:
            self._window.paused += time.perf_counter() - self._profiled_since
        elif self._window is not None:
            self._window.add(tokens=self._tokens(batch), samples=self.samples, flops=self._flops_per_batch(batch))
            if is_logging_step(trainer):
                self._log_throughput(trainer, pl_module)
        self._last_batch_end = time.perf_counter()

    def _tokens(self, batch: object) -> int | None:
        if self.run is not None:
            inputs = batch_tensors(batch)[0]
            return int(inputs.numel())
        return self.tokens

    def _flops_per_batch(self, batch: object) -> dict[str, int | None]:
        if self.run is not None:  # the closed forms per batch shape (a last, shorter batch counts less)
            shape = tuple(batch_tensors(batch)[0].shape)
            if shape not in self._toy_flops:
                run = dataclasses.replace(self.run, batch_size=shape[0], seq_len=shape[1])
                self._toy_flops[shape] = toy.flops_by_convention(run)
            return self._toy_flops[shape]
        if self._flops_per_batch_of_any_module is None:  # once: the prediction's, else step 1's count
            figures = self.report.primary if self.report is not None else None
            hardware = figures.flops_hardware if figures is not None else None
            if hardware is None and self.measurement is not None:
                hardware = self.measurement.values.get("flops_hardware")
            model = figures.flops_model if figures is not None else None
            k = self._accumulate
            per_batch = {"model": model // k if model else None, "hardware": hardware // k if hardware else None}
            if hardware is None:
                return per_batch  # neither predicted nor counted yet: ask again next batch
            self._flops_per_batch_of_any_module = per_batch
        return self._flops_per_batch_of_any_module

    def _log_throughput(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize(pl_module.device)  # only at logging steps: no host sync on the others
        now = time.perf_counter()
        window = self._window
        self._raise_measured_peak(trainer, window, now)
        rates = window.rates(now, self.peak.flops_per_s if self.peak else None, counts_tokens=self.tokens is not None)
        self._steady[0] += now - window.start - window.paused
        self._steady[1] += window.batches
        self._window = Window(start=now)  # the report's own cost falls in the next window
        if not rates:
            return
        if trainer.world_size > 1 and "perf/tokens_per_sec" in rates:
            rates["perf/tokens_per_sec_total"] = rates["perf/tokens_per_sec"] * trainer.world_size
        log_scalars(trainer, rates)
        self._show_rates(rates)
        if trainer.progress_bar_callback is not None:  # LightningModule.log costs ~1 ms: only for a bar
            # Host tensors: Lightning reads prog_bar values back after every batch.
            for name, tag in (("tok/s", "perf/tokens_per_sec"), ("mfu", "perf/mfu")):
                if tag in rates:
                    pl_module.log(name, torch.tensor(rates[tag]), prog_bar=True, logger=False, batch_size=1)

    def _show_rates(self, rates: dict[str, float]) -> None:
        shown = {}
        for tag, name in (("perf/tokens_per_sec", "tokens/s"), ("perf/samples_per_sec", "samples/s"),
                          ("perf/mfu", "MFU"), ("perf/hfu", "HFU")):  # fmt: skip
            if tag in rates:
                shown[name] = rates[tag]
        self.report.rates = shown

    def _raise_measured_peak(self, trainer: pl.Trainer, window: Window, now: float) -> None:
        """A measured peak (CPU, unlisted GPU) is an estimate of the best this device does.

        If training beats it, the fit-start measurement was pessimistic. A machine busy with other work
        makes every matmul slower. The achieved rate is then the better estimate, so it becomes the
        peak. The perf/peak card says so. Datasheet and spec peaks are never changed.
        """
        seconds = now - window.start - window.paused
        achieved = window.flops.get("hardware", 0) / seconds if seconds > 0 else 0.0
        if self.peak is None or self.peak.source != "measured" or achieved <= self.peak.flops_per_s:
            return
        before = self.peak.flops_per_s
        self.peak = Peak(achieved, "measured", self.peak.dtype)
        log_text(
            trainer,
            "perf/peak",
            f"{tera(achieved):.4g} TFLOP/s {self.peak.dtype}: raised at step {trainer.global_step} from the "
            f"fit-start measurement ({tera(before):.4g} TFLOP/s), which training beat",
        )

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

    def _report_measured(self, trainer: pl.Trainer) -> None:
        self.report.measured = self.measurement.figures()
        if self.report.measured.peak_phase:
            self.report.notes.append(f"measured peak (live tensor bytes) during {self.report.measured.peak_phase}")
        elif self.report.measured.peak is not None:
            self.report.notes.append("measured peak: CUDA's max_memory_allocated")
        log_scalars(trainer, self.report.scalars("measured"))
        log_text(trainer, "ledger/table", self.report.markdown())
        write_rank_record(trainer, self.report)  # every rank's lines: the loggers keep rank 0's (callbacks/ranks.py)
        self._check_self(trainer)
        for writer in tensorboard_writers(trainer):
            writer.add_figure("memory/predicted_vs_measured", bar_chart(self.report), global_step=logging_step(trainer))
        if trainer.is_global_zero:
            Console().print(self.report.table("ledger (predicted beside measured)"))

    def _check_self(self, trainer: pl.Trainer) -> None:
        """The ledger checks itself on every measured run: one line per line beyond report.TOLERANCE, with
        the ratio and the likely cause, printed and logged (ledger/check, ledger/check/*)."""
        if self.report.primary is None:  # measured only: nothing to hold the measurement to
            log_text(trainer, "ledger/check", f"nothing to check: not predicted ({self.why_not_predicted})")
            return
        found = misses(self.report)
        foreign = self._foreign_parameters(trainer)
        if foreign and not any(m.line == "params" for m in found):  # both sides count 0: say it all the same
            held = self.report.measured.params or 0
            found.insert(0, Miss("params", held, held + foreign))
        self.check = [self._check_line(m, foreign) for m in found]
        for line in self.check:
            rank_zero_info(line)
        text = "  \n".join(self.check) if self.check else "every line within tolerance (ledger.report.TOLERANCE)"
        log_text(trainer, "ledger/check", text)
        scalars = {"ledger/check/misses": len(found)}
        scalars.update({f"ledger/check/ratio/{m.line}": m.ratio for m in found if m.predicted})
        log_scalars(trainer, scalars)

    def _foreign_parameters(self, trainer: pl.Trainer) -> int:
        """Bytes of the parameters the optimizers step that the LightningModule does not hold."""
        if self._dry is None:  # measured only (DeepSpeed's optimizer steps flat copies, say): nothing to hold to
            return 0
        own = {id(p) for p in trainer.lightning_module.parameters()}
        stepped = {id(p): p for o in torch_optimizers(trainer) for g in o.param_groups for p in g["params"]}
        return sum(p.numel() * p.element_size() for key, p in stepped.items() if key not in own)

    def _check_line(self, miss: Miss, foreign: int) -> str:
        name = LABELS_FOR_CHECK.get(miss.line, miss.line)
        ratio = f"{miss.ratio:.3g}" if miss.predicted else "inf (predicted 0)"
        said = f"ledger check: {name} measured {miss.measured:,} vs predicted {miss.predicted:,} (ratio {ratio})"
        if miss.line == "params" and foreign:
            said = (f"ledger check: params: the optimizer steps {format_bytes(foreign)} of parameters the "
                    f"LightningModule does not hold (the ledger counts {format_bytes(miss.predicted)})")  # fmt: skip
        if foreign:
            primary = self.report.primary
            zero = [n for n in ("params", "grads", "optimizer") if primary is not None and primary.get(n) == 0]
            cause = (
                "training_step reaches its model through a closure, a global or a plain dict/list rather than "
                f"an attribute of the LightningModule, so the ledger saw none of its parameters ({', '.join(zero)} "
                "0): make the model an attribute (self.model = model)"
            )
        elif self.compiled and miss.line in ("activations", "peak", "autocast_weight_copies", "flops_hardware"):
            cause = "torch.compile: the compiled step keeps other tensors than the eager step the dry run predicts"
            if miss.line == "peak" and self.measurement is not None and self.measurement.device.type == "cpu":
                cause += (" (on a CPU the live-tensor tracker does not see the buffers inductor allocates below "
                          "the dispatcher, so a compiled peak may read low)")  # fmt: skip
        elif self.run is not None and self.run.compiled:
            cause = "torch.compile (model.compile): the compiled step keeps other tensors than the eager prediction"
        elif miss.line == "flops_hardware":
            cause = "the real step ran ops the fake step did not (a branch on a value, or kernels chosen at run time)"
        else:
            cause = ("something the dry run does not model (an allocator's rounding or cache, a library's workspace, "
                     "a branch on a value): please report it with the ledger table")  # fmt: skip
        return f"{said}: likely cause: {cause}"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measurement is not None:
            self.measurement.close()
            if self.report is not None and self.report.measured is None:
                for line in ("params", "grads", "optimizer", "activations", "peak", "flops_hardware"):
                    if line not in self.measurement.values:
                        self.measurement.why_missing.setdefault(line, "not measured (run too short)")
                self._report_measured(trainer)
        if self.report is not None:
            measured_time(self.report, self.step_time, self._steady, self._accumulate, trainer.is_global_zero)
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
            self._explain_oom(trainer, pl_module, exception)
        line = cpukernels.missing_kernel_line(exception, str(trainer.precision))
        if line is not None:  # `lmledger fit` prints it alone (exit 2); a traceback in library use ends with it
            exception.ledger_line = line
            exception.add_note(line)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.measurement is not None:
            self.measurement.close()

    def _explain_oom(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Attach one line to a CUDA OOM: `ledger_line`.

        The `lmledger fit` command prints it in place of the traceback. Raising here instead would skip
        Lightning's teardown and the other callbacks' on_exception.
        """
        Console(stderr=True).print(self.report.table("ledger at the OOM"))
        line = f"CUDA out of memory at step {trainer.global_step + 1}"
        primary = next((f for f in self.report.predicted.values() if f.peak is not None), None)
        capacity = preflight.available_memory(
            pl_module.device, self.settings.device_memory_gb, pl_module, preflight.processes_on_this_machine(trainer)
        )
        if primary is not None and capacity is not None:
            line += (
                f"; the ledger predicted a peak of {format_bytes(primary.peak)} within the "
                f"{format_bytes(capacity.bytes)} available ({capacity.source}), so the rest is memory it does not "
                "model (other processes, allocator fragmentation, library workspaces): lower --data.batch_size"
                + (f" below {self.run.batch_size}" if self.run is not None else "")
            )
        elif primary is not None:
            line += f"; predicted peak {format_bytes(primary.peak)} per device"
        exception.ledger_line = line
        if hasattr(exception, "add_note"):  # Python >= 3.11: a traceback in library use shows the line too
            exception.add_note(line)

    # -- reading the results ----------------------------------------------------------------------

    @property
    def predicted(self) -> Figures | None:
        """The first predictor's figures (the dry run where it traced)."""
        return self.report.primary if self.report is not None else None

    @property
    def measured(self) -> Figures | None:
        return self.report.measured if self.report is not None else None
