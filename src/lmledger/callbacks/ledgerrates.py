"""The Ledger's throughput figures: tokens, samples and FLOPs per batch into a ledger.timing.throughput.Window,
logged as perf/* at logging steps, and the measured peak raised when training beats it.

Each function takes the callbacks.ledger.Ledger whose window, peak and report it reads and updates; its
on_train_batch_end hook calls them.
"""

from __future__ import annotations

import dataclasses
import time

import lightning.pytorch as pl
import torch

from lmledger.callbacks import closedform as toy
from lmledger.callbacks.trainer_io import log_scalars, log_text, synchronize
from lmledger.ledger.dryrun.fakecopy import batch_tensors
from lmledger.ledger.hardware.gpus import PeakFlops
from lmledger.ledger.timing.throughput import Window
from lmledger.ledger.units import tera

__all__ = ["batch_tokens", "flops_per_batch", "log_throughput", "raise_measured_peak", "show_rates"]


def batch_tokens(ledger, batch: object) -> int | None:
    if ledger.run is not None:
        inputs = batch_tensors(batch)[0]
        return int(inputs.numel())
    return ledger.tokens


def flops_per_batch(ledger, batch: object) -> dict[str, int | None]:
    if ledger.run is not None:  # the closed forms per batch shape (a last, shorter batch counts less)
        shape = tuple(batch_tensors(batch)[0].shape)
        if shape not in ledger._toy_flops:
            run = dataclasses.replace(ledger.run, batch_size=shape[0], seq_len=shape[1])
            ledger._toy_flops[shape] = toy.flops_by_convention(run)
        return ledger._toy_flops[shape]
    if ledger._flops_per_batch_of_any_module is None:  # once: the prediction's, else step 1's count
        figures = ledger.report.primary if ledger.report is not None else None
        hardware = figures.flops_hardware if figures is not None else None
        if hardware is None and ledger.measurement is not None:
            hardware = ledger.measurement.values.get("flops_hardware")
        model = figures.flops_model if figures is not None else None
        k = ledger._accumulate
        per_batch = {"model": model // k if model else None, "hardware": hardware // k if hardware else None}
        if hardware is None:
            return per_batch  # neither predicted nor counted yet: ask again next batch
        ledger._flops_per_batch_of_any_module = per_batch
    return ledger._flops_per_batch_of_any_module


def log_throughput(ledger, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    synchronize(pl_module.device)  # only at logging steps: no host sync on the others
    now = time.perf_counter()
    window = ledger._window
    raise_measured_peak(ledger, trainer, window, now)
    rates = window.rates(
        now, ledger.peak_flops.flops_per_s if ledger.peak_flops else None, counts_tokens=ledger.tokens is not None
    )
    ledger._steady[0] += now - window.start - window.paused
    ledger._steady[1] += window.batches
    ledger._window = Window(start=now)  # the report's own cost falls in the next window
    if not rates:
        return
    if trainer.world_size > 1 and "perf/tokens_per_sec" in rates:
        rates["perf/tokens_per_sec_total"] = rates["perf/tokens_per_sec"] * trainer.world_size
    log_scalars(trainer, rates)
    show_rates(ledger, rates)
    if trainer.progress_bar_callback is not None:  # LightningModule.log costs ~1 ms: only for a bar
        # Host tensors: Lightning reads prog_bar values back after every batch.
        for name, tag in (("tok/s", "perf/tokens_per_sec"), ("mfu", "perf/mfu")):
            if tag in rates:
                pl_module.log(name, torch.tensor(rates[tag]), prog_bar=True, logger=False, batch_size=1)


def show_rates(ledger, rates: dict[str, float]) -> None:
    shown = {}
    for tag, name in (("perf/tokens_per_sec", "tokens/s"), ("perf/samples_per_sec", "samples/s"),
                      ("perf/mfu", "MFU"), ("perf/hfu", "HFU")):  # fmt: skip
        if tag in rates:
            shown[name] = rates[tag]
    ledger.report.rates = shown


def raise_measured_peak(ledger, trainer: pl.Trainer, window: Window, now: float) -> None:
    """A measured peak (CPU, unlisted GPU) is an estimate of the best this device does.

    If training beats it, the fit-start measurement was pessimistic. A machine busy with other work
    makes every matmul slower. The achieved rate is then the better estimate, so it becomes the
    peak. The perf/peak card says so. Datasheet and spec peaks are never changed.
    """
    seconds = now - window.start - window.paused
    achieved = window.flops.get("hardware", 0) / seconds if seconds > 0 else 0.0
    if ledger.peak_flops is None or ledger.peak_flops.source != "measured" or achieved <= ledger.peak_flops.flops_per_s:
        return
    before = ledger.peak_flops.flops_per_s
    ledger.peak_flops = PeakFlops(achieved, "measured", ledger.peak_flops.dtype)
    log_text(
        trainer,
        "perf/peak",
        f"{tera(achieved):.4g} TFLOP/s {ledger.peak_flops.dtype}: raised at step {trainer.global_step} from the "
        f"fit-start measurement ({tera(before):.4g} TFLOP/s), which training beat",
    )
