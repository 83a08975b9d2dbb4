"""Throughput during a fit: the peak that MFU and HFU divide by, and the torch.compile speedup probe.

The Ledger callback feeds ledger.timing.throughput's accumulator and logs at every logging step:
    perf/tokens_per_sec    tokens trained per second on this device (perf/samples_per_sec without tokens)
    perf/tflops            model FLOPs per second / 1e12 (the MFU numerator)
    perf/mfu, perf/hfu     model / hardware FLOPs per second over the device's dense peak
    perf/mfu_6n, perf/mfu_causal   MFU under two other conventions (docs/mfu.md), toy LM only: 6N alone
                           (Kaplan, Chinchilla), and causal attention counted half (Megatron-LM); perf/mfu
                           counts attention in full (PaLM appendix B)
    perf/data_wait_frac    share of the window's wall time spent between steps, i.e. fetching and
                           copying the next batch (plus Lightning's per-step bookkeeping)
    perf/tokens_per_sec_total   x world size (only when world size > 1)
    perf/compile_speedup   under model.compile, once before step 0 (`compile_speedup` here)
No figure counts validation inside a window. The warm-up batches and the two measured steps are
not timed.

Why not Lightning's ThroughputMonitor? It synchronizes the device after every batch
(canary test_throughput_monitor_syncs_every_batch). Its rolling window gives no value before it fills.
Its peaks come from `get_available_flops`. That maps "NVIDIA H200" to nothing
(canary test_lightning_resolves_no_peak_for_nvidia_h200), and lists sparse peaks for H200 and H100 NVL.
Here the device is synchronized only when a window starts or ends, and every window is reported.
The peak comes from lmledger.ledger.hardware.peak_flops: dense datasheet figures, or a measured matmul peak
labelled so.

On CUDA the host runs ahead of the device. Between two synchronizations, the host's time between
steps may overlap queued kernels. So data_wait_frac is an upper bound on the device's idle share.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import TransformerEnginePrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info

from lmledger.callbacks.trainer_io import log_scalars, log_text, synchronize, untouched_rng
from lmledger.ledger.hardware.gpus import PeakFlops
from lmledger.ledger.hardware.peak_flops import NoPeakFlops, compute_dtype_for_precision, peak_flops
from lmledger.ledger.run import Run
from lmledger.ledger.units import tera

__all__ = ["compile_speedup", "forward_backward_seconds", "resolve_peak"]


def resolve_peak(precision: str, device: torch.device, fp8: str | None = None) -> tuple[PeakFlops | None, str]:
    """This device's dense peak FLOP/s (MFU's denominator), and a line saying where it came from."""
    # torchao float8 (LitLM fp8="torchao") runs the eligible linears in fp8 under a bf16 precision.
    dtype = "fp8" if fp8 == "torchao" else compute_dtype_for_precision(precision)
    with untouched_rng(device):
        peak = peak_flops(dtype, device)
    if isinstance(peak, NoPeakFlops):
        return None, f"no peak, so no MFU/HFU: {peak.reason}"
    source = (
        "datasheet " + peak.source.removeprefix("datasheet:")
        if peak.source.startswith("datasheet:")
        else peak.detail or f"measured on this {device.type} (fastest square {peak.dtype} matmul)"
    )
    line = f"{tera(peak.flops_per_s):.4g} TFLOP/s dense {peak.dtype} ({source}) for precision {precision}"
    if peak.dtype in ("fp32", "tf32"):
        line += f", float32 matmul precision {torch.get_float32_matmul_precision()!r}"
    if dtype == "fp8":
        linears = "torchao's Float8Linear layers (not the LM head)" if fp8 else "Transformer Engine's linear layers"
        line += (
            f". FLAGGED fp8: only {linears} run in fp8, attention and the rest in bf16/fp16, so MFU "
            "against the fp8 peak understates how busy the chip is"
        )
    return peak, line


def forward_backward_seconds(step: Callable[[], None], device: torch.device, eager: bool, repeats: int = 3) -> float:
    """Median seconds of `step()` after one untimed call.

    With `eager`, torch.compile'd code inside runs eagerly (torch.compiler.set_stance).
    So one model times both ways."""
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


def compile_speedup(trainer: pl.Trainer, pl_module: pl.LightningModule, run: Run) -> None:
    """Log perf/compile_speedup and perf/compile: the step timed compiled and eager, before training.

    The random batch is laid out as the data module's: contiguous int64 B x T. So the graph timed is
    the one training then uses. Gradients come from autograd.grad: nothing lands in .grad, no weight
    moves. The batch comes off a private generator. Training goes on exactly as it would without this.

    On one device only. Under DDP, Dynamo splits the graph at DDP's gradient buckets (so the
    all-reduce overlaps backward). It does so only when it compiles inside DDP's forward.
    Training would reuse the probe's unsplit graph. Sharded parameters (FSDP, DeepSpeed) exist only
    inside the strategy's forward. Not under Transformer Engine either: its delayed fp8 scaling would
    learn from the random batch."""
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
    params = [p for p in run.module.parameters() if p.requires_grad]

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
