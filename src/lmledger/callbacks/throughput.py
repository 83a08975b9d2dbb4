"""Throughput and utilisation during a fit: tokens/s, TFLOP/s, MFU, HFU and time spent waiting for data.

Each logging step (every trainer.log_every_n_steps) reports the window since the previous one:
    perf/tokens_per_sec    tokens trained per second on this device
    perf/tflops            model FLOPs per second / 1e12 (the MFU numerator)
    perf/mfu, perf/hfu     model / hardware FLOPs per second over the device's dense peak
    perf/mfu_6n, perf/mfu_causal   MFU under two other conventions (docs/mfu.md): 6N alone, no
                           attention (Kaplan, Chinchilla), and causal attention counted half
                           (Megatron-LM); perf/mfu counts attention in full (PaLM appendix B)
    perf/data_wait_frac    share of the window's wall time spent between steps, i.e. fetching and
                           copying the next batch (plus Lightning's per-step bookkeeping)
    perf/tokens_per_sec_total   x world size (only when world size > 1)
    perf/compile_speedup   under model.compile, once before step 0: seconds per forward+backward run
                           eagerly over seconds per compiled forward+backward, on a random batch of
                           the run's shape (the compile itself happens there instead of in step 0)
Validation inside a window is excluded from every figure. The first `warmup_steps` batches are not
timed (they hold the ledger's own measurements, optimizer-state allocation and kernel autotuning).

Why not Lightning's ThroughputMonitor: it synchronizes the device after every batch and its rolling
window gives no value before it fills (canary test_throughput_monitor_syncs_every_batch); its peaks come
from `get_available_flops`, which maps "NVIDIA H200" to nothing (canary
test_lightning_resolves_no_peak_for_nvidia_h200) and lists sparse peaks for H200 and H100 NVL. Here
the device is synchronized only when a window starts or ends, every window is reported, and the peak
comes from lmledger.ledger.hardware (dense datasheet figures, or a measured matmul peak labelled so).

On CUDA the host runs ahead of the device, so between two synchronizations the host's time between
steps may overlap queued kernels: data_wait_frac is an upper bound on the device's idle share.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import TransformerEnginePrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info

from lmledger.callbacks.flops import batch_shape, flops_per_batch
from lmledger.callbacks.run import (
    LedgerRun,
    is_logging_step,
    log_scalars,
    log_text,
    synchronize,
    untouched_rng,
)
from lmledger.errors import ConfigError
from lmledger.ledger.flops import FlopReport
from lmledger.ledger.hardware import Peak, compute_dtype_for_precision, peak_flops


@dataclass
class _Window:
    """What happened since the window opened (seconds, tokens, FLOPs)."""

    start: float
    tokens: int = 0
    model_flops: int = 0
    hardware_flops: int = 0
    model_6n_flops: int = 0
    model_causal_flops: int = 0
    data_wait: float = 0.0
    paused: float = 0.0  # validation


def resolve_peak(run: LedgerRun) -> tuple[Peak | None, str]:
    """The dense peak FLOP/s MFU is measured against on this device, and a line saying where it came from."""
    # torchao float8 (LitLM fp8="torchao") runs the eligible linears in fp8 under a bf16 precision.
    dtype = "fp8" if run.fp8 == "torchao" else compute_dtype_for_precision(run.precision)
    with warnings.catch_warnings(record=True) as caught, untouched_rng(run.device):
        warnings.simplefilter("always")
        peak = peak_flops(dtype, run.device)
    if peak is None:
        reason = "; ".join(str(w.message) for w in caught) or f"no {dtype} peak for {run.device}"
        return None, f"no peak, so no MFU/HFU: {reason}"
    source = (
        "datasheet " + peak.source.removeprefix("datasheet:")
        if peak.source.startswith("datasheet:")
        else peak.detail or f"measured on this {run.device.type} (fastest square {peak.dtype} matmul)"
    )
    line = f"{peak.flops_per_s / 1e12:.4g} TFLOP/s dense {peak.dtype} ({source}) for precision {run.precision}"
    if peak.dtype in ("fp32", "tf32"):
        line += f", float32 matmul precision {torch.get_float32_matmul_precision()!r}"
    if dtype == "fp8":
        linears = "torchao's Float8Linear layers (not the LM head)" if run.fp8 else "Transformer Engine's linear layers"
        line += (
            f". FLAGGED fp8: only {linears} run in fp8, attention and the rest in bf16/fp16, so MFU "
            "against the fp8 peak understates how busy the chip is"
        )
    return peak, line


def forward_backward_seconds(step: Callable[[], None], device: torch.device, eager: bool, repeats: int = 3) -> float:
    """Median seconds of `step()` after one untimed call; with `eager`, torch.compile'd code inside runs
    eagerly (torch.compiler.set_stance), so one model times both ways."""
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    times = []
    with stance:
        step()  # compiles (first compiled call) or warms the allocator
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class ThroughputLedger(pl.Callback):
    """tokens/s, TFLOP/s, MFU, HFU and data-wait share at every logging step after warm-up.

    Args:
        warmup_steps: training batches at the start of the fit that are not timed.
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        if warmup_steps < 0:
            raise ConfigError(f"ledger.warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.run: LedgerRun | None = None
        self.peak: Peak | None = None
        self._batches_seen = 0
        self._window: _Window | None = None
        self._last_batch_end: float | None = None
        self._gap_paused = 0.0
        self._pause_start: float | None = None
        self._flops: dict[tuple[int, int], FlopReport] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run = LedgerRun.from_trainer(trainer, pl_module)
        self.peak, line = resolve_peak(self.run)
        log_text(trainer, "perf/peak", line)
        self._batches_seen = 0
        self._window = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run.compiled:
            self._report_compile_speedup(trainer, pl_module)
        if self.warmup_steps == 0:
            self._open_window()

    def _report_compile_speedup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Times the step's forward+backward compiled and eagerly before training starts, on a random batch
        laid out as the data module's are (contiguous int64 B x T, so the graph timed is the one training
        then uses). Gradients are taken with autograd.grad (nothing lands in .grad, no weight moves) and
        the batch comes off a private generator, so training goes on exactly as it would without this.

        On one device only: under DDP, Dynamo splits the graph at DDP's gradient buckets (so the
        all-reduce overlaps backward) only when it compiles inside DDP's forward, and training would reuse
        the probe's unsplit graph; sharded parameters (FSDP, DeepSpeed) only exist inside the strategy's
        forward. Not under Transformer Engine: its delayed fp8 scaling would learn from the random batch."""
        run = self.run
        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            return
        if isinstance(trainer.precision_plugin, TransformerEnginePrecision):
            return
        generator = torch.Generator(run.device).manual_seed(0)
        x, y = (
            torch.randint(0, run.config.vocab_size, (run.batch_size, run.seq_len), device=run.device,
                          generator=generator)
            for _ in range(2)
        )  # fmt: skip
        params = [p for p in run.model.parameters() if p.requires_grad]

        def step() -> None:
            with trainer.precision_plugin.forward_context():
                loss = pl_module(x, y)
            torch.autograd.grad(loss, params)

        with untouched_rng(run.device):
            compiled = forward_backward_seconds(step, run.device, eager=False)
            eager = forward_backward_seconds(step, run.device, eager=True)
        speedup = eager / compiled
        log_scalars(trainer, {"perf/compile_speedup": speedup}, step=trainer.global_step)
        line = (
            f"torch.compile ({pl_module.hparams.get('compile')}): forward+backward {compiled * 1e3:.4g} ms "
            f"compiled vs {eager * 1e3:.4g} ms eager, {speedup:.2f}x (batch {run.batch_size} x {run.seq_len})"
        )
        log_text(trainer, "perf/compile", line, step=trainer.global_step)
        rank_zero_info(line)

    def _open_window(self) -> None:
        synchronize(self.run.device)
        now = time.perf_counter()
        self._window = _Window(start=now)
        self._last_batch_end = now
        self._gap_paused = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._window is not None and self._last_batch_end is not None:
            self._window.data_wait += time.perf_counter() - self._last_batch_end - self._gap_paused
        self._gap_paused = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batches_seen += 1
        window = self._window
        if window is None:
            if self._batches_seen == self.warmup_steps:
                self._open_window()
            return
        shape = batch_shape(batch)
        if shape not in self._flops:
            self._flops[shape] = flops_per_batch(self.run, shape, training=True)
        flops = self._flops[shape]
        window.tokens += shape[0] * shape[1]
        window.model_flops += flops.model
        window.hardware_flops += flops.hardware
        window.model_6n_flops += flops.model_6n
        window.model_causal_flops += flops.model_causal
        if is_logging_step(trainer):
            synchronize(self.run.device)
            now = time.perf_counter()
            self._report(trainer, pl_module, window, now)
            self._window = _Window(start=now)  # the report's own cost falls in the next window
        self._last_batch_end = time.perf_counter()

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: _Window, now: float) -> None:
        seconds = now - window.start - window.paused
        if seconds <= 0:
            return
        metrics = {
            "perf/tokens_per_sec": window.tokens / seconds,
            "perf/tflops": window.model_flops / seconds / 1e12,
            "perf/data_wait_frac": min(1.0, max(0.0, window.data_wait / seconds)),
        }
        if self.peak is not None:
            self._raise_measured_peak(trainer, window.hardware_flops / seconds)
            metrics["perf/mfu"] = window.model_flops / seconds / self.peak.flops_per_s
            metrics["perf/hfu"] = window.hardware_flops / seconds / self.peak.flops_per_s
            metrics["perf/mfu_6n"] = window.model_6n_flops / seconds / self.peak.flops_per_s
            metrics["perf/mfu_causal"] = window.model_causal_flops / seconds / self.peak.flops_per_s
        if self.run.world_size > 1:
            # Every rank trains the same batch shape; rank zero's rate stands for each of them.
            metrics["perf/tokens_per_sec_total"] = metrics["perf/tokens_per_sec"] * self.run.world_size
        log_scalars(trainer, metrics)
        if trainer.progress_bar_callback is not None:  # LightningModule.log costs ~1 ms: only for a bar
            # Host tensors: Lightning reads prog_bar values back after every batch (see LitLM.on_before_optimizer_step).
            pl_module.log(
                "tok/s", torch.tensor(metrics["perf/tokens_per_sec"]), prog_bar=True, logger=False, batch_size=1
            )
            if "perf/mfu" in metrics:
                pl_module.log("mfu", torch.tensor(metrics["perf/mfu"]), prog_bar=True, logger=False, batch_size=1)

    def _raise_measured_peak(self, trainer: pl.Trainer, achieved: float) -> None:
        """A measured peak (CPU, unlisted GPU) is an estimate of the best this device does. If training
        beats it, the fit-start measurement was pessimistic (a machine busy with other work makes every
        matmul slower): the achieved rate is the better estimate, so it becomes the peak, and the
        perf/peak card says so. Datasheet peaks are never changed."""
        if self.peak.source != "measured" or achieved <= self.peak.flops_per_s:
            return
        before = self.peak.flops_per_s
        self.peak = Peak(achieved, "measured", self.peak.dtype)
        log_text(
            trainer,
            "perf/peak",
            f"{achieved / 1e12:.4g} TFLOP/s {self.peak.dtype}: raised at step {trainer.global_step} from the "
            f"fit-start measurement ({before / 1e12:.4g} TFLOP/s), which training beat",
        )

    # Validation inside a window is not training time: pause the clocks around it.

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window is not None and not trainer.sanity_checking:
            synchronize(self.run.device)
            self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_start is not None:
            paused = time.perf_counter() - self._pause_start
            self._window.paused += paused
            self._gap_paused += paused
            self._pause_start = None
