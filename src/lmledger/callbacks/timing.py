"""TimeLedger: where a step's time goes, the roofline bound beside a profiled measurement.

    Trainer(callbacks=[TimeLedger()])

Before step 1 it takes the dry run's ops (ledger/count/ops.py), or those of the `prediction` it is given.
It prices them on this device (ledger/timing/roofline.py).
Then it profiles a few sampled steps with torch.profiler, never every step. That is `profile_steps`
steps after `warmup_steps`, then one every `every_n_steps`. Their op events go into the same
categories (ledger/timing/profile.py). Two more categories join them. One is the data wait between
on_train_batch_end and the next on_train_batch_start (as the throughput callback measures it).
The other is host overhead / idle.

It logs, per profiled step:
    time/bound/<category>       seconds per step the roofline allows
    time/measured/<category>    seconds per step measured (time/measured/data_wait, time/measured/host)
At fit end it logs a stacked bar chart (time/breakdown) and the step-time table as text (time/table).
It prints the table and its one-line diagnosis.

Before step 1 the Ledger also predicts the step's time (callbacks/steptime.py over ledger/timing/steptime) and
hands it here as `step_time`: it logs time/predicted/<category> once, and the table gets a `predicted` column.

A profiled step runs slower: the profiler has its own cost. `is_profiling_step(n)` says which training
batches are profiled (0-based, counted over the fit). So a throughput window can leave them out.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from matplotlib.figure import Figure

from lmledger.callbacks.steptime import fit_ops, run_links
from lmledger.callbacks.trainer_io import log_scalars, log_text, synchronize, tensorboard_writers, untouched_rng
from lmledger.errors import ConfigError
from lmledger.ledger.dryrun.engine import NotTraced, StepLedger
from lmledger.ledger.hardware.gpus import find_gpu
from lmledger.ledger.hardware.interconnect import resolve_interconnect
from lmledger.ledger.hardware.peak_flops import compute_dtype_for_precision
from lmledger.ledger.timing import profile as ledger_profile
from lmledger.ledger.timing.roofline import LABELS, Roofline, device_roofline, format_table
from lmledger.ledger.timing.shapes import advice_text

__all__ = ["TimeLedger"]


class TimeLedger(pl.Callback):
    """The time ledger: roofline bound per category beside a profiled step (module doc).

    Args:
        prediction: the dry run's StepLedger of this run's step (the Ledger pipeline passes its own);
            None: the callback dry-runs the training step on the first batch itself
        warmup_steps: training batches before the first profiled one
        profile_steps: consecutive profiled batches after warm-up
        every_n_steps: then one profiled batch every this many (0: none after the first ones)
        print_table: print the step-time table and diagnosis at fit end
        gpu: the GPU (a `lmledger gpus` key) whose tensor cores the shape advice is for; default this
            run's GPU, none on a CPU
        interconnect_gb_per_s: one bandwidth every collective moves bytes at (GB/s, 1e9 bytes), e.g. 450
            for H100 NVLink 4 one way
        intra_node, inter_node: the links collectives cross inside a node and between nodes (a key of
            ledger.hardware.interconnect's table or a rate, "nvlink4", "400Gb/s"): TP's inside, DDP's and FSDP's
            between nodes once the run spans them. Default on a GPU: its usual links (interconnect.
            default_links); on a CPU: memory copies at its bandwidth (gloo's ranks on one machine)
    """

    def __init__(
        self,
        prediction: StepLedger | None = None,
        warmup_steps: int = 3,
        profile_steps: int = 2,
        every_n_steps: int = 500,
        print_table: bool = True,
        gpu: str | None = None,
        interconnect_gb_per_s: float | None = None,
        intra_node: str | None = None,
        inter_node: str | None = None,
    ) -> None:
        if warmup_steps < 0 or profile_steps < 0 or every_n_steps < 0:
            raise ConfigError(
                f"TimeLedger takes warmup_steps, profile_steps, every_n_steps >= 0, got "
                f"{warmup_steps}, {profile_steps}, {every_n_steps}"
            )
        self.prediction = prediction
        self.warmup_steps, self.profile_steps, self.every_n_steps = warmup_steps, profile_steps, every_n_steps
        self.print_table = print_table
        self.gpu = gpu
        if interconnect_gb_per_s is not None and not interconnect_gb_per_s > 0:
            raise ConfigError(f"TimeLedger interconnect_gb_per_s must be positive, got {interconnect_gb_per_s}")
        self.interconnect = interconnect_gb_per_s * 1e9 if interconnect_gb_per_s else None
        for spec, scope in ((intra_node, "intra-node"), (inter_node, "inter-node")):
            if spec is not None:
                resolve_interconnect(spec, scope)  # a bad key or rate: one line now, not at step 1
        self.intra_node, self.inter_node = intra_node, inter_node
        self.bound: Roofline | None = None
        self.model_flops: float | None = None
        self.samples: list[ledger_profile.Breakdown] = []
        self.why_no_bound: str | None = None
        self.step_time = None  # the predicted step (ledger.timing.steptime.StepTime), set by the Ledger before step 1
        self.skipped = 0  # sampled steps not profiled: another profiler was recording
        self.why_not_profiled: str | None = None  # the profiler could not run: no step is profiled this fit
        self._own_prediction = False
        self._batches = 0
        self._last_end: float | None = None
        self._profiler = None
        self._record = None
        self._started = 0.0
        self._data_wait = 0.0
        self._device = torch.device("cpu")

    def is_profiling_step(self, n: int) -> bool:
        """Whether training batch n (0-based over the fit) is profiled."""
        first = self.warmup_steps
        if first <= n < first + self.profile_steps:
            return True
        last = first + self.profile_steps - 1
        return self.every_n_steps > 0 and n > last and (n - last) % self.every_n_steps == 0

    @property
    def measured(self) -> ledger_profile.Breakdown | None:
        """The mean of the profiled steps."""
        return ledger_profile.mean_breakdown(self.samples)

    # -- the bound -------------------------------------------------------------------------------

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.accumulate_grad_batches != 1:
            # The bound covers an optimizer step of k micro-batches; a profiled batch is one of them.
            self.why_no_bound = "gradient accumulation: the profiled batch is one micro-batch of the bound's step"
            return
        prediction = self.prediction
        if prediction is None:
            from lmledger.callbacks.dryrun import dry_run_training_step

            result = dry_run_training_step(trainer, pl_module, batch, batch_idx)
            if isinstance(result, NotTraced):
                self.why_no_bound = result.reason
                return
            prediction = self.prediction = result
            self._own_prediction = True
        if prediction.ops is None:
            self.why_no_bound = "the prediction holds no op records"
            return
        dtype = compute_dtype_for_precision(str(trainer.precision))
        try:
            ops = fit_ops(trainer, pl_module, prediction)  # DDP's buckets and the per-step decisions, if any
            # A peak or bandwidth not yet cached is measured now (random matmuls): not from the run's RNG.
            with untouched_rng(pl_module.device):
                links = run_links(trainer, pl_module.device, self.intra_node, self.inter_node)
                self.bound = device_roofline(ops, dtype, pl_module.device, self.interconnect, links)
        except ValueError as err:
            self.why_no_bound = str(err)
            return
        # Model FLOPs: 3 x the forward's, which is 6N + attention for ToyLM and Llama.
        self.model_flops = 3 * prediction.flops_forward

    # -- profiling -------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = pl_module.device
        self._batches = 0
        self._last_end = time.perf_counter()
        self.samples, self.skipped = [], 0  # one fit's; a prediction passed in stays, one made here is redone
        self.why_not_profiled = None
        if self._own_prediction:
            self.prediction, self._own_prediction = None, False
            self.bound = self.model_flops = self.why_no_bound = None

    def prepare(self, trainer, pl_module, batch, batch_idx) -> None:
        """The bound, made before the first step opens: its peak and bandwidth probes run random matmuls,
        which a measuring FLOP counter open around step 1 would count as the step's (the Ledger calls this
        before its measurement starts)."""
        if self.bound is None and self.why_no_bound is None:
            self._predict(trainer, pl_module, batch, batch_idx)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.prepare(trainer, pl_module, batch, batch_idx)
        if not self.is_profiling_step(self._batches) or not trainer.is_global_zero or self.why_not_profiled:
            return
        if torch._C._autograd._profiler_enabled():  # canary test_one_profiler_at_a_time_is_visible
            # Another profiler (Lightning's PyTorchProfiler, a second TimeLedger) is recording: a second one
            # started now would record nothing, so this step is left to it.
            self.skipped += 1
            return
        self._data_wait = now - self._last_end if self._last_end is not None else 0.0
        profiler = ledger_profile.profiler(self._device)
        try:
            ledger_profile.start(profiler)
        except Exception as err:  # e.g. Kineto cannot start here: the fit goes on, without profiled steps
            self._step_aside(f"the profiler did not start ({type(err).__name__}: {_first_line(err)})")
            return
        self._profiler = profiler
        self._record = torch.autograd.profiler.record_function(ledger_profile.STEP_MARK)
        self._record.__enter__()
        # The step's wall time: the data wait before it plus what follows; the profiler's start is not in it.
        self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._profiler is not None:
            with torch.autograd.profiler.record_function(ledger_profile.OPTIMIZER_MARK):
                pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None:
            synchronize(self._device)
            wall = time.perf_counter() - self._started + self._data_wait
            self._record.__exit__(None, None, None)
            ledger_profile.stop(self._profiler)
            events = ledger_profile.op_events(self._profiler, self._device)
            sample = ledger_profile.breakdown(events, wall, self._data_wait, device=self._device.type)
            self.samples.append(sample)
            self._profiler = self._record = None
            self._log_sample(trainer, sample)
        self._batches += 1
        self._last_end = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._last_end = time.perf_counter()  # validation is not data wait

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # A step that raised inside its profile: close both, keep nothing. Closing must not raise, or the
        # user would see this error instead of the step's (Lightning raises the first callback error).
        record, profiler, self._record, self._profiler = self._record, self._profiler, None, None
        for close in (lambda: record.__exit__(None, None, None) if record is not None else None,
                      lambda: ledger_profile.stop(profiler) if profiler is not None else None):  # fmt: skip
            try:
                close()
            except Exception:  # noqa: S110  the step's own error is the one to see
                pass

    def _step_aside(self, why: str) -> None:
        """No more profiled steps this fit, said in one line (the bound, if any, is still reported)."""
        self.why_not_profiled = why
        rank_zero_warn(f"time ledger: {why}; no step is profiled in this fit, and the fit goes on")

    def _log_sample(self, trainer: pl.Trainer, sample: ledger_profile.Breakdown) -> None:
        metrics = {f"time/measured/{name}": seconds for name, seconds in sample.seconds.items()}
        if self.bound is not None:
            metrics.update({f"time/bound/{name}": c.seconds for name, c in self.bound.by_category.items()})
            metrics["time/bound/total"] = self.bound.seconds
        metrics["time/measured/total"] = sample.wall_s
        predicted = getattr(self.step_time, "seconds", None)
        if predicted is not None and trainer.accumulate_grad_batches == 1:
            metrics.update({f"time/predicted/{name}": seconds for name, seconds in predicted.items()})
            metrics["time/predicted/total"] = sum(predicted.values())
        log_scalars(trainer, metrics, step=trainer.global_step)

    # -- the report ------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        text = self.report()
        if text is None:
            return
        log_text(trainer, "time/table", text.replace("\n", "  \n"), step=trainer.global_step)
        measured = self.measured
        if measured is not None and self.bound is not None:
            for writer in tensorboard_writers(trainer):
                writer.add_figure("time/breakdown", self.chart(), global_step=trainer.global_step)
        if self.print_table:
            rank_zero_info(text)

    def report(self) -> str | None:
        """The step-time table and the diagnosis, as plain text (None before any prediction)."""
        if self.bound is None:
            if not self.why_no_bound:
                return None
            text = f"time ledger: no roofline bound ({self.why_no_bound})"
            if self.why_not_profiled:
                text += f"; no step profiled: {self.why_not_profiled}"
            measured = self.measured
            if measured is not None:  # the profiled step needs no prediction
                seconds = {k: v for k, v in measured.seconds.items() if v}
                rows = [f"{LABELS[k]} {v * 1e3:.3f} ms ({measured.share(k):.1%})" for k, v in seconds.items()]
                text += f"; measured {measured.wall_s * 1e3:.3f} ms per step: " + ", ".join(rows)
            return text
        predicted = getattr(self.step_time, "seconds", None)
        text = format_table(self.bound, self.measured, self.model_flops, predicted)
        if self.skipped:
            text += f"\n{self.skipped} sampled step(s) not profiled: another profiler was recording"
        if self.why_not_profiled:
            text += f"\nno step profiled: {self.why_not_profiled}"
        gpu = self.gpu or _this_gpu(self._device)
        if gpu is not None and self.prediction is not None and self.prediction.ops is not None:
            text += "\n" + advice_text(self.prediction.ops, gpu, self.bound.peak_dtype, self._device.type)
        return text

    def chart(self) -> Figure:
        """Two stacked bars, bound and measured seconds per step, one colour per category."""
        measured = self.measured
        figure = Figure(figsize=(7, 3.2), layout="constrained")
        axes = figure.add_subplot()
        left = [0.0, 0.0]
        for name, label in LABELS.items():
            bound = self.bound.by_category[name].seconds if name in self.bound.by_category else 0.0
            values = [bound * 1e3, measured.seconds.get(name, 0.0) * 1e3]
            if not any(values):
                continue
            axes.barh(["roofline bound", "measured"], values, left=left, label=label)
            left = [a + b for a, b in zip(left, values, strict=True)]
        axes.invert_yaxis()
        axes.set_xlabel("ms per step")
        axes.set_title("time ledger: where the step goes")
        figure.legend(loc="outside lower center", ncols=4, fontsize=8)
        return figure


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


def _this_gpu(device: torch.device) -> str | None:
    """The GPUS key of a CUDA device. None for a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None

    spec = find_gpu(torch.cuda.get_device_name(device))
    return spec.key if spec is not None else None
