"""The Ledger's step-time prediction before step 1, and the measured step beside it at fit end.

predict_fit_step_time prices this fit's dry run on this device: on a CPU by replay (ledger.timing.steptime: each op
replayed, the optimizer, data wait and collectives calibrated, priced on the links they cross: run_links), on a GPU
the table knows by the GPU op-time model (ledger.timing.gpu: no replay, no calibration process). Lightning's own
loop per batch needs Lightning, so it is measured here (lightning_loop_seconds): an empty training_step through
Trainer.fit, in a process of its own (callbacks.loopprobe), cached per machine with the step-time cache.
predict_time is the Ledger's glue: the report's `step time` and rate rows, time/predicted/<category>, and the time
ledger's `predicted` column; measured_time fills the measured side from the throughput windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lmledger.callbacks.trainer_io import log_scalars
from lmledger.ledger.dryrun.engine import StepLedger
from lmledger.ledger.hardware.gpus import find_gpu
from lmledger.ledger.hardware.interconnect import Links, links_for
from lmledger.ledger.hardware.peak_flops import compute_dtype_for_precision
from lmledger.ledger.timing.roofline import with_ddp_allreduce, with_step_collectives

__all__ = [
    "NO_STEP_TIME",
    "fit_ops",
    "lightning_loop_seconds",
    "loop_calibration_name",
    "measured_time",
    "predict_fit_step_time",
    "predict_time",
    "run_links",
]

# Set in the loop probe's own process, so its Ledger does not predict (and probe) in turn.
NO_STEP_TIME = "LMLEDGER_NO_STEP_TIME"


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
    from lmledger.ledger.timing.steptime.cache import StepTimeCache

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
    the trainer's devices per node (ledger.hardware.interconnect.links_for); None on a CPU (memory copies)."""
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
    """The predicted step (ledger.timing.steptime.StepTime or NoStepTime) of this fit, from its dry run; `intra` and
    `inter` as TimeLedger's intra_node and inter_node."""
    from lmledger.callbacks.trainer_io import torch_optimizers
    from lmledger.callbacks.trainer_io import untouched_rng as fit_rng
    from lmledger.ledger.timing.steptime import NoStepTime, data_wait, predict_step_time

    if os.environ.get(NO_STEP_TIME):
        return NoStepTime("step-time prediction off in this process")
    if prediction.ops is None:
        return NoStepTime("the dry run holds no op records")
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():  # Trainer(detect_anomaly=True)
        return NoStepTime("detect_anomaly=True reads every backward output for a NaN (isnan, any, item), which the "
                          "dry run leaves out; its memory and FLOPs are the step's")  # fmt: skip
    if pl_module.device.type == "cuda":  # priced by the GPU op model: no replay, no calibration process
        found = _gpu_op_model(trainer, pl_module, prediction, tokens, samples, accumulate, intra, inter)
        if found is not None:
            return found
    optimizers = torch_optimizers(trainer) if pl_module.automatic_optimization else []
    clip = None
    if trainer.gradient_clip_val:
        algorithm = str(trainer.gradient_clip_algorithm or "norm").lower().split(".")[-1]
        clip = ("value" if "value" in algorithm else "norm", float(trainer.gradient_clip_val))
    alone = trainer.world_size == 1  # several ranks: local rank 0 calibrates before they meet (_calibrate_ranks)
    settings = dict(progress_bar=trainer.progress_bar_callback is not None, logger=bool(trainer.loggers),
                    log_every_n_steps=int(trainer.log_every_n_steps or 50))  # fmt: skip
    backend = str(getattr(trainer.strategy, "_process_group_backend", None) or "gloo")
    ops = fit_ops(trainer, pl_module, prediction)
    ranks_here = max(1, int(getattr(trainer, "num_devices", 1) or 1)) if not alone else 1
    if ranks_here > 1:
        try:
            if trainer.local_rank == 0 and backend == "gloo" and pl_module.device.type == "cpu":
                _calibrate_ranks(trainer.world_size, ranks_here, ops, settings)  # the other ranks wait at the barrier
        finally:  # a calibration that raises must not leave the others at the barrier for its timeout
            _replay_together()
    loop = lightning_loop_seconds(**settings, measure=alone)
    loader = trainer.train_dataloader
    data = data_wait(loader) if isinstance(loader, torch.utils.data.DataLoader) else None
    with fit_rng(pl_module.device):
        return predict_step_time(
            ops, pl_module.device, compute_dtype=compute_dtype_for_precision(str(trainer.precision)),
            optimizer=optimizers[0] if optimizers else None, clip=clip, loop_s=loop[0] if loop else None,
            loop_how=loop[1] if loop else "", data=data, world_size=trainer.world_size, backend=backend,
            tokens=tokens, samples=samples, accumulate=accumulate, calibrate_collectives=alone,
            links=run_links(trainer, pl_module.device, intra, inter), ranks_here=ranks_here,
        )  # fmt: skip


def fit_ops(trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: StepLedger):
    """The dry run's ops as this fit's steps run them: with DDP's bucket all-reduces (the dry run emulates its
    Reducer), and the one-value all-reduces that the fit's callbacks and module run at each optimizer step, each
    saying how many by a `collectives_per_step(trainer)` method (PreemptionCheckpoint, NonFiniteGuard, LitLM)."""
    ops = with_ddp_allreduce(prediction.ops, prediction)
    declared = (getattr(owner, "collectives_per_step", None) for owner in (*trainer.callbacks, pl_module))
    count = sum(int(method(trainer)) for method in declared if callable(method))  # a user's own attribute: not ours
    return with_step_collectives(ops, count, trainer.world_size)


# How long a rank waits for the others to finish their dry runs before replaying alone (their dry runs differ by
# seconds; a rank that never comes has failed, and the fit with it).
REPLAY_TOGETHER_S = 300


def _calibrate_ranks(world_size: int, ranks_here: int, ops, loop_settings: dict) -> None:
    """Local rank 0's calibrations for a multi-rank fit, each in processes of its own, where the cache lacks them:
    Lightning's loop, gloo's all-reduce (at its probe sizes), the ranks' wait at a collective, with FSDP2 its cost
    per collective, and the usable last-level cache where the step asks for it (measured alone: ranks sweeping at once
    would share the cache and cache half of it for the machine). The other ranks wait at the barrier meanwhile (a rank's
    minutes here would otherwise time out their first collective), then read them."""
    from lmledger.ledger.timing.steptime.cache import StepTimeCache
    from lmledger.ledger.timing.steptime.calibrate import collective_model
    from lmledger.ledger.timing.steptime.fsdp2 import FSDP2_COLLECTIVES, fsdp2_collective_s
    from lmledger.ledger.timing.steptime.predict import touched_between_steps
    from lmledger.ledger.timing.steptime.rankwait import rank_wait
    from lmledger.ledger.timing.steptime.replay import stays_cached

    lightning_loop_seconds(**loop_settings)
    stays_cached(torch.device("cpu"), touched_between_steps(ops))
    cache = StepTimeCache(torch.device("cpu"), ranks=ranks_here)
    collective_model(world_size, cache)
    if any(op.name.startswith(FSDP2_COLLECTIVES) for op in ops.ops):
        fsdp2_collective_s(world_size, cache)
    rank_wait(world_size, cache)
    cache.save()


def _replay_together() -> None:
    """Wait until every rank has reached its replay, so that the ranks replay at once, as their steps run: one rank
    replaying beside another's dry run, or beside an idle one, times its ops on a machine its steps never see
    (issue 50: 2.18x apart). gloo's monitored barrier, so a rank that never comes costs a wait, not a hang."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=REPLAY_TOGETHER_S))
    except RuntimeError:  # a rank did not come: replay now, alone
        pass


def _gpu_op_model(trainer, pl_module, prediction, tokens, samples, accumulate, intra, inter):
    """This fit's step on its GPU by the GPU op-time model (ledger/timing/gpu), from its dry run; None for a GPU the
    table lacks (the replay prices it then). Its precision and LitLM's compile and fp8 switches say which kernels
    run."""
    from lmledger.ledger.timing.gpu import lightning_kernels, predict_gpu_step

    spec = find_gpu(torch.cuda.get_device_name(pl_module.device))
    if spec is None or spec.sms is None:
        return None
    hparams = getattr(pl_module, "hparams", {}) or {}
    kernels = lightning_kernels(str(trainer.precision), bool(hparams.get("compile")), bool(hparams.get("fp8")))
    dtype = compute_dtype_for_precision(str(trainer.precision))
    buckets = [(b.nbytes, b.dtype) for b in getattr(prediction, "buckets", ())]
    return predict_gpu_step(
        prediction.ops, spec, compute_dtype=dtype if dtype in ("bf16", "fp16", "fp32", "tf32") else "bf16",
        kernels=kernels, links=run_links(trainer, pl_module.device, intra, inter), world_size=trainer.world_size,
        buckets=buckets, tokens=tokens, samples=samples, accumulate=accumulate,
        model_flops=3 * prediction.flops_forward,
    )  # fmt: skip


def predict_time(trainer, pl_module, dry, why_not, report, accumulate, tokens, samples, timing):
    """The Ledger's step-time prediction before step 1: its report's `step time` and rate rows, the
    time/predicted/<category> tags, one printed line, and the time ledger's `predicted` column."""
    from lmledger.ledger.timing.steptime import NoStepTime, StepTime

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


def measured_time(report, step_time, steady: list, accumulate: int, show: bool, others: float | None = None) -> None:
    """The measured step (the throughput windows' mean, per optimizer step) beside the predicted one; `others`:
    the share of the CPUs other processes took meanwhile (ledger.hardware.cpu.OthersBusy), said beside it."""
    from lmledger.ledger.timing.steptime import StepTime

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
            f"(measured/predicted {measured / step_time.total_s:.3f}; over {batches} batches"
            + (f"; other processes busy {others:.0%} of the CPUs meanwhile)" if others is not None else ")")
        )
