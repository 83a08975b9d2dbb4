"""TimeLedger: where a step's time goes, the roofline bound beside a profiled measurement.

    Trainer(callbacks=[TimeLedger()])

Before step 1 it takes the dry run's ops (ledger/ops.py), or those of the `prediction` it is given.
It prices them on this device (ledger/roofline.py).
Then it profiles a few sampled steps with torch.profiler, never every step. That is `profile_steps`
steps after `warmup_steps`, then one every `every_n_steps`. Their op events go into the same
categories (ledger/profile.py). Two more categories join them. One is the data wait between
on_train_batch_end and the next on_train_batch_start (as the throughput callback measures it).
The other is host overhead / idle.

It logs, per profiled step:
    time/bound/<category>       seconds per step the roofline allows
    time/measured/<category>    seconds per step measured (time/measured/data_wait, time/measured/host)
At fit end it logs a stacked bar chart (time/breakdown) and the step-time table as text (time/table).
It prints the table and its one-line diagnosis.

Before step 1 it also predicts the step's time (ledger/steptime): each op of the dry run replayed here,
the optimizer, data wait and communication calibrated, and Lightning's own loop per batch, which needs
Lightning and so is measured here (`lightning_loop_seconds`): an empty training_step through Trainer.fit,
in a process of its own, cached per machine with the step-time cache. It logs time/predicted/<category>
once, and the table gets a `predicted` column.

A profiled step runs slower: the profiler has its own cost. `is_profiling_step(n)` says which training
batches are profiled (0-based, counted over the fit). So a throughput window can leave them out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from matplotlib.figure import Figure

from lmledger.callbacks.run import log_scalars, log_text, synchronize, tensorboard_writers, untouched_rng
from lmledger.errors import ConfigError
from lmledger.ledger import profile as ledger_profile
from lmledger.ledger.dryrun import NotTraced, StepLedger
from lmledger.ledger.gpus import find_gpu
from lmledger.ledger.interconnect import Links, links_for, resolve_interconnect
from lmledger.ledger.peak_flops import compute_dtype_for_precision
from lmledger.ledger.roofline import LABELS, Roofline, device_roofline, format_table, with_ddp_allreduce
from lmledger.ledger.shapes import advice_text

__all__ = [
    "NO_STEP_TIME",
    "TimeLedger",
    "lightning_loop_seconds",
    "loop_calibration_name",
    "measured_time",
    "predict_fit_step_time",
    "predict_time",
    "run_links",
]

# Set in the loop probe's own process, so its Ledger does not predict (and probe) in turn.
NO_STEP_TIME = "LMLEDGER_NO_STEP_TIME"


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
            ledger.interconnect's table or a rate, "nvlink4", "400Gb/s"): TP's inside, DDP's and FSDP's
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
        self.step_time = None  # the predicted step (ledger.steptime.StepTime), set by the Ledger before step 1
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
            from lmledger.callbacks.live import dry_run_training_step

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
            ops = with_ddp_allreduce(prediction.ops, prediction)  # a DDP rank's buckets, if the prediction has them
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
    from lmledger.ledger.gpus import find_gpu

    spec = find_gpu(torch.cuda.get_device_name(device))
    return spec.key if spec is not None else None


# -- the predicted step time ---------------------------------------------------------------------------


def loop_calibration_name(progress_bar: bool, logger: bool, ledger: bool = True) -> str:
    """The step-time cache's name for the loop calibration of these trainer settings; its value is
    {"base_s": the loop per batch, "per_log_s": what a logging step adds}."""
    return f"lightning_loop bar={int(progress_bar)} logger={int(logger)} ledger={int(ledger)}"


def lightning_loop_seconds(
    *,
    progress_bar: bool,
    logger: bool,
    log_every_n_steps: int,
    ledger: bool = True,
    cache=None,
    measure: bool = True,
) -> tuple[float, str] | None:
    """(seconds, how) Lightning's loop costs per batch with these settings, measured once per machine.

    None where the probe could not run, or is not cached and `measure` is off (a multi-rank fit: one
    rank's minutes in the probe would time out the others' first collective); the prediction notes it.
    """
    from lmledger.ledger.steptime.cache import StepTimeCache

    cache = cache or StepTimeCache(torch.device("cpu"))
    name = loop_calibration_name(progress_bar, logger, ledger)
    found = cache.calibration(name)
    if found is None and not measure:
        return None
    if found is None:
        settings = {"progress_bar": progress_bar, "logger": logger, "ledger": ledger, "steps": 60,
                    "threads": torch.get_num_threads()}  # fmt: skip
        code = f"import json; from lmledger.callbacks.loopprobe import main; print(json.dumps(main({settings!r})))"
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, NO_STEP_TIME: "1"})  # fmt: skip
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            measured = json.loads(lines[-1]) if done.returncode == 0 and lines else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            measured = None
        if not measured:
            return None
        value = {
            "base_s": max(0.0, measured["unlogged_s"] - measured["bare_s"] - measured["fetch_s"]),
            "per_log_s": max(0.0, measured["logged_s"] - measured["unlogged_s"]),
        }
        cache.set_calibration(
            name, value, "an empty training_step through Trainer.fit, logging every batch and never (mean "
            "batch-to-batch after 10 batches), minus the same step bare (median) and its loader's fetch", **measured,
        )  # fmt: skip
        cache.save()
        found = cache.calibration(name)
    value = found["value"]
    if not isinstance(value, dict) or not all(isinstance(value.get(k), (int, float)) for k in ("base_s", "per_log_s")):
        return None
    per_batch = value["base_s"] + value["per_log_s"] / max(1, log_every_n_steps)
    return per_batch, f"empty training_step through Trainer.fit, measured {found['measured_at'][:10]}"


def run_links(trainer: pl.Trainer, device: torch.device, intra: str | None, inter: str | None) -> Links | None:
    """The links this fit's collectives cross: on a GPU (or where the user names one), its node's links split at
    the trainer's devices per node (ledger.interconnect.links_for); None on a CPU (memory copies)."""
    if device.type != "cuda" and intra is None and inter is None:
        return None
    spec = find_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    per_node = max(1, int(getattr(trainer, "num_devices", 1) or 1))
    return links_for(spec.key if spec else None, intra, inter, per_node, max(1, int(trainer.num_nodes or 1)))


def predict_fit_step_time(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    prediction: StepLedger,
    *,
    accumulate: int = 1,
    tokens: int | None = None,
    samples: int = 0,
    intra: str | None = None,
    inter: str | None = None,
):
    """The predicted step (ledger.steptime.StepTime or NoStepTime) of this fit, from its dry run; `intra` and
    `inter` as TimeLedger's intra_node and inter_node."""
    from lmledger.callbacks.run import torch_optimizers
    from lmledger.callbacks.run import untouched_rng as fit_rng
    from lmledger.ledger.steptime import NoStepTime, data_wait, predict_step_time

    if os.environ.get(NO_STEP_TIME):
        return NoStepTime("step-time prediction off in this process")
    if prediction.ops is None:
        return NoStepTime("the dry run holds no op records")
    optimizers = torch_optimizers(trainer) if pl_module.automatic_optimization else []
    clip = None
    if trainer.gradient_clip_val:
        algorithm = str(trainer.gradient_clip_algorithm or "norm").lower().split(".")[-1]
        clip = ("value" if "value" in algorithm else "norm", float(trainer.gradient_clip_val))
    alone = trainer.world_size == 1  # several ranks wait for each other: no subprocess calibration there
    loop = lightning_loop_seconds(
        progress_bar=trainer.progress_bar_callback is not None, logger=bool(trainer.loggers),
        log_every_n_steps=int(trainer.log_every_n_steps or 50), measure=alone,
    )  # fmt: skip
    loader = trainer.train_dataloader
    data = data_wait(loader) if isinstance(loader, torch.utils.data.DataLoader) else None
    backend = getattr(trainer.strategy, "_process_group_backend", None) or "gloo"
    ops = with_ddp_allreduce(prediction.ops, prediction)
    with fit_rng(pl_module.device):
        return predict_step_time(
            ops, pl_module.device, compute_dtype=compute_dtype_for_precision(str(trainer.precision)),
            optimizer=optimizers[0] if optimizers else None, clip=clip, loop_s=loop[0] if loop else None,
            loop_how=loop[1] if loop else "", data=data, world_size=trainer.world_size, backend=str(backend),
            tokens=tokens, samples=samples, accumulate=accumulate, calibrate_collectives=alone,
            links=run_links(trainer, pl_module.device, intra, inter),
        )  # fmt: skip


def predict_time(trainer, pl_module, dry, why_not, report, accumulate, tokens, samples, timing):
    """The Ledger's step-time prediction before step 1: its report's `step time` and rate rows, the
    time/predicted/<category> tags, one printed line, and the time ledger's `predicted` column."""
    from lmledger.ledger.steptime import NoStepTime, StepTime

    if dry is None:
        result = NoStepTime(f"no dry run ({why_not})")
    else:
        try:
            result = predict_fit_step_time(
                trainer, pl_module, dry, accumulate=accumulate, tokens=tokens, samples=samples,
                intra=timing.intra_node, inter=timing.inter_node,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a prediction must never stop the fit
            text = str(err).strip().splitlines()
            result = NoStepTime(f"{type(err).__name__}: {text[0] if text else ''}")
    timing.step_time = result
    if isinstance(result, StepTime):
        report.times["step time"] = (result.total_s, None)
        rate = "tokens/s" if result.tokens_per_s else "samples/s"
        report.times[rate] = (result.tokens_per_s or result.samples_per_s, None)
        metrics = {f"time/predicted/{name}": seconds for name, seconds in result.seconds.items()}
        metrics["time/predicted/total"] = result.total_s
        log_scalars(trainer, metrics, step=trainer.global_step)
        line = "ledger: " + result.line()
        for note in result.notes:
            line += f"\nledger: {note}"
    else:
        line = f"ledger: no step-time prediction: {result.reason}"
    if trainer.is_global_zero and not os.environ.get(NO_STEP_TIME):
        rank_zero_info(line)
    return result


def measured_time(report, step_time, steady: list, accumulate: int, show: bool) -> None:
    """The measured step (the throughput windows' mean, per optimizer step) beside the predicted one."""
    from lmledger.ledger.steptime import StepTime

    seconds, batches = steady
    if not isinstance(step_time, StepTime) or batches == 0 or seconds <= 0:
        return
    measured = seconds / batches * accumulate
    report.times["step time"] = (step_time.total_s, measured)
    for rate, per_step in (("tokens/s", step_time.tokens), ("samples/s", step_time.samples)):
        if rate in report.times and per_step:
            report.times[rate] = (report.times[rate][0], per_step / measured)
    if show:
        rank_zero_info(
            f"step {step_time.total_s * 1e3:.4g} ms predicted, {measured * 1e3:.4g} ms measured "
            f"(measured/predicted {measured / step_time.total_s:.3f}; over {batches} batches)"
        )
