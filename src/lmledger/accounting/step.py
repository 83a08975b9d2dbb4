"""One training step of a fit config on one device, accounted: predicted, measured, MFU by convention, time.

`lmledger account` prints it. `plan max-batch` and `sweep --dry-run` reuse it.
`account(spec)`: a ToyLM config. Its main prediction is the dry run of the toy LM as configured
(ledger.predict.toy_dry_run, what `fit`'s Ledger shows first), with the lecture's closed forms beside it
(callbacks.closedform.closed_form, fit's second column). At scale, one rank's dry run (accounting.scale).
`account_any_model(argv)`: any LightningModule, by its dry run.
Each result names its predictors in order (result["predictors"]: {source: ledger.report.Figures}, the
main one first) and holds the measured Figures; accounting.reporting turns it into the one Report.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lmledger.accounting.scale import add_per_rank, traced_at_scale
from lmledger.accounting.steptime import (
    no_step_time,
    predicted_step_time,
    ranks_on_cpus,
    toy_predicted_time,
    trainer_time_settings,
)
from lmledger.ledger.closedform import flops as ledger_flops
from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.hardware.gpus import PeakFlops
from lmledger.ledger.hardware.peak_flops import NoPeakFlops, compute_dtype_for_precision, peak_flops
from lmledger.ledger.predict import measure as measure_run
from lmledger.ledger.predict import predict as predict_run
from lmledger.ledger.predict import toy_dry_run
from lmledger.ledger.report import Figures, figures_of_step
from lmledger.ledger.run import Run
from lmledger.ledger.units import MEMORY_ROWS, tera
from lmledger.model import count_parameters
from lmledger.precision import local_device, predicted_device

__all__ = ["account", "account_any_model", "account_module", "main_rows", "one_device_dry_run"]


def one_device_dry_run(spec: Run) -> bool:
    """Whether the toy LM's own dry run (predict.toy_dry_run) is the main prediction: one device, no sharding.

    Sharded and multi-device runs are predicted per rank (accounting.scale) or by the closed forms (ZeRO,
    FSDP1, DeepSpeed, whose state the closed forms follow)."""
    return spec.world_size == 1 and spec.strategy in ("ddp", "auto", "single_device") and not traced_at_scale(spec)


def _predictors(spec: Run, device: torch.device, accumulate: int) -> tuple[dict[str, Figures], object]:
    """{source: Figures}, the main one first: the dry run where it runs, then the closed forms; and the dry run.

    The dry run is what fit's Ledger predicts for the same config (LitLM's step also keeps its 4-byte loss);
    the closed forms are fit's "closed form" column (their peak plus the dry run's buffers and batch)."""
    from lmledger.callbacks.closedform import closed_form

    run = dataclasses.replace(spec, device=device)
    dry = None
    if one_device_dry_run(spec):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dry = toy_dry_run(run, accumulate)
    traced = dry if dry is not None and not isinstance(dry, NotTraced) else None
    closed = closed_form(run, traced, accumulate)
    if closed.autocast_weight_copies is None and closed.peak is not None:  # fit's table hides a 0; it is a figure
        closed = dataclasses.replace(closed, autocast_weight_copies=predict_run(run).autocast_weight_copies)
    if traced is None:
        return {"closed form": closed}, dry
    return {"dry run": figures_of_step(traced, flops_model=3 * traced.flops_forward), "closed form": closed}, dry


def _measure(spec: Run, device: torch.device, accumulate: int, step_time: dict | None = None, ops=None) -> dict:
    """ledger.predict.measure of the config's run on `device`, and the median time of a further step.

    Real training steps: FLOPs are counted once. Saved activations come from the first step, state
    after it. The peak is over a second, steady step."""
    m = measure_run(dataclasses.replace(spec, device=device), accumulate)
    figures = Figures(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                      autocast_weight_copies=m.autocast_weight_copies, peak=m.peak, peak_phase=m.peak_phase,
                      flops_hardware=m.flops)  # fmt: skip
    return {
        "figures": figures,
        "step_seconds": _step_seconds(m.step, device),
        "time": _step_time(spec, device, m.step, (step_time or {}).get("seconds"), ops),
    }


def main_rows(result: dict) -> None:
    """result["memory"] ({row: {predicted, measured}}) and result["flops"] ({model, hardware, measured}) from
    the main predictor and the measurement: what sweep's listing and checks read of an accounting result."""
    main = next(iter(result["predictors"].values()), None)
    measured = result.get("measured")
    result["memory"] = {
        row: {"predicted": main and main.get(row), "measured": measured and measured.get(row)}
        for row in (*MEMORY_ROWS, "autocast_weight_copies")
    }  # fmt: skip
    result["flops"] = {"model": main and main.flops_model, "hardware": main and main.flops_hardware,
                       "measured": measured and measured.flops_hardware}  # fmt: skip
    result["run"]["peak_phase"] = main and main.peak_phase


def _step_time(spec: Run, device: torch.device, step, predicted: dict | None = None, ops=None) -> dict:
    """The step-time table (docs/time.md).

    The roofline bound of the config's step on `device` (its dry run's ops: `ops` where the main column's
    dry run of one micro-batch on this CPU has them), beside the mean of three profiled real steps."""
    from lmledger.ledger.predict import toy_optimizer
    from lmledger.ledger.timing import roofline

    if ops is None:
        ops = roofline.toy_step_ops(spec.config, spec.batch_size, spec.seq_len, spec.precision, toy_optimizer(spec))
    return _time_table(ops, spec.precision, device, step, predicted)


def _time_table(ops, precision: str, device: torch.device, step, predicted: dict | None = None) -> dict:
    """The bound of `ops` (a dry run's OpSummary) on `device`, beside three profiled `step(phase)` calls."""
    from lmledger.ledger.timing import profile, roofline

    bound = roofline.device_roofline(ops, compute_dtype_for_precision(precision), device)
    measured = profile.mean_breakdown([profile.profile_step(step, device) for _ in range(3)])
    model_flops = 3 * ops.flops_in("forward")  # = 6N + attention for ToyLM and Llama
    return {
        "rows": {
            name: row.to_json() for name, row in roofline.time_rows(bound, measured, model_flops, predicted).items()
        },
        "roofline_mfu": bound.mfu(model_flops),
        "diagnosis": roofline.diagnosis(bound, measured, model_flops),
        "table": roofline.format_table(bound, measured, model_flops, predicted),
    }


# nanoGPT's estimate_mfu (model.py) divides by this on any device: "A100 GPU bfloat16 peak flops is 312 TFLOPS".
_NANOGPT_PEAK = 312e12


def _step_seconds(step, device: torch.device) -> float:
    """Median seconds of a training step, after one untimed step. The throughput callback's timer."""
    from lmledger.callbacks.peak_flops import forward_backward_seconds

    return forward_backward_seconds(step, device, eager=False, repeats=3)


def _mfu_conventions(spec: Run, seconds: float | None, device: torch.device, predicted: dict | None = None) -> dict:
    """FLOPs per token of a training step under each MFU convention, and the ratio to perf/mfu's.

    With a measured step time, also MFU against the device's dense peak. A measured peak the step beats
    is raised to the step's own hardware rate, as the throughput callback does. Without one, a step `predicted` on a
    GPU (accounting.gpustep) gives each convention its MFU at that step against the GPU's datasheet peak: its own
    MFU (PaLM's) scaled by the convention's FLOPs."""
    per_token = ledger_flops.flops_per_token_by_convention(spec.config, spec.seq_len)
    if seconds is None and predicted and predicted.get("gpu") and predicted.get("mfu"):
        return _predicted_conventions(spec, per_token, predicted)
    peak = peak_line = None
    if seconds is not None:
        dtype = compute_dtype_for_precision(spec.precision)
        peak = peak_flops(dtype, device)
        if isinstance(peak, NoPeakFlops):
            peak, peak_line = None, peak.reason
        else:
            source = peak.source.removeprefix("datasheet:")
            detail = getattr(peak, "detail", "")
            where = detail if detail.startswith(source) else ": ".join(filter(None, (source, detail)))
            peak_line = f"{tera(peak.flops_per_s):.4g} TFLOP/s dense {peak.dtype} ({where})"
            achieved = per_token["hfu"] * spec.tokens_per_batch / seconds
            if peak.source == "measured" and achieved > peak.flops_per_s:
                peak = PeakFlops(achieved, "measured", peak.dtype)
                peak_line += f", raised to the step's own {tera(achieved):.4g} TFLOP/s, which beat it"

    def mfu(n: int) -> float | None:
        return None if peak is None else n * spec.tokens_per_batch / seconds / peak.flops_per_s

    nanogpt_printed = (
        None if seconds is None else per_token["nanogpt"] * spec.tokens_per_batch / seconds / _NANOGPT_PEAK
    )

    return _conventions_json(spec, per_token, seconds, peak and peak.flops_per_s, peak_line, nanogpt_printed, mfu)


def _predicted_conventions(spec: Run, per_token: dict[str, int], predicted: dict) -> dict:
    """The conventions at a step predicted on a GPU: the step's MFU is PaLM's (gpustep.toy_gpu_step), so each
    convention's is that times its FLOPs over PaLM's, against the same datasheet peak."""
    from lmledger.accounting.gpustep import gpu_dtype
    from lmledger.ledger.hardware.gpus import require_gpu

    dtype = gpu_dtype(spec.precision)
    peak = require_gpu(predicted["gpu"]).peak_flops[dtype]
    line = f"{tera(peak):.4g} TFLOP/s dense {dtype} (datasheet:{predicted['gpu']})"
    palm = predicted["mfu"]
    out = _conventions_json(spec, per_token, predicted["total_s"], peak, line,
                            palm * per_token["nanogpt"] / per_token["palm"] * peak / _NANOGPT_PEAK,
                            lambda n: palm * n / per_token["palm"])  # fmt: skip
    return {**out, "predicted_on": predicted["gpu"]}


def _conventions_json(spec: Run, per_token: dict[str, int], seconds, peak, peak_line, nanogpt_printed, mfu) -> dict:
    return {
        "perf_mfu": "palm",
        "seq_len": spec.seq_len,
        "step_seconds": seconds,
        "peak_flops_per_s": peak,
        "peak": peak_line,
        "nanogpt_printed_mfu": nanogpt_printed,
        "predicted_on": None,  # the GPU a predicted step's conventions are for; None: a measured step (or none)
        "conventions": {
            key: {
                "label": ledger_flops.MFU_CONVENTIONS[key],
                "flops_per_token": n,
                "vs_perf_mfu": n / per_token["palm"] - 1,
                "mfu": mfu(n),
            }
            for key, n in per_token.items()
        },
    }


def account(spec: Run, do_measure: bool, argv: list[str] = (), step_time: bool = False, gpu: str | None = None) -> dict:
    """`step_time`: predict the step's time too, under result["time"]["predicted"]: here (ledger.timing.steptime) for
    a CPU config, on a GPU (accounting.gpustep: the config's, or `gpu`) for a GPU config or with `gpu`."""
    from lmledger.accounting.gpustep import target_gpu, toy_gpu_step

    # A GPU config on a machine without one: its closed forms model CUDA's kernels; a dry run on this CPU would save
    # what the CPU's composite norms save. The GPU step is priced from dry runs of its own (accounting.gpustep).
    device = local_device(spec.accelerator) if do_measure else predicted_device(spec.accelerator)
    accumulate = trainer_time_settings(list(argv))["accumulate"] if argv else 1
    predictors, dry = _predictors(spec, device, accumulate)
    step = None
    here = dry if device.type == "cpu" and dry is not None else None  # the same dry run prices the time
    target, why = (None, "")
    if step_time and spec.config:
        target, why = target_gpu(spec.accelerator, gpu, spec.precision, spec.fp8)
    if target is not None:
        step = toy_gpu_step(spec, list(argv), target, accumulate)
        step["notes"] = [*step.get("notes", ()), *([why] if why != "--gpu" else [])]
    elif step_time and spec.world_size == 1 and spec.config:
        step = toy_predicted_time(spec, list(argv), here)
    elif step_time and spec.config:
        step = ranks_on_cpus(spec.world_size)
    one_step_ops = here.ops if here is not None and not isinstance(here, NotTraced) and accumulate == 1 else None
    measured = _measure(spec, device, accumulate, step, one_step_ops) if do_measure else None
    result = {
        "params": count_parameters(spec.config),
        "predictors": predictors,
        "measured": measured["figures"] if measured else None,
        "not_traced": dry.reason if isinstance(dry, NotTraced) else None,
        "accumulate": accumulate,
        "run": {
            "batch_size": spec.batch_size,
            "seq_len": spec.seq_len,
            "tokens_per_step": spec.tokens_per_batch,
            "precision": spec.precision,
            "optimizer": spec.optimizer,
            "strategy": spec.strategy,
            "world_size": spec.world_size,
            "vocab_size": spec.config.vocab_size,
            "vocab_from_data": spec.vocab_from_data,
            "device": device.type,
            "compiled": bool(spec.compiled),
            "fp8": spec.fp8,
            "measured_peak_phase": measured["figures"].peak_phase if measured else None,
        },
        "mfu_conventions": _mfu_conventions(
            spec, measured["step_seconds"] if measured else None, device, step if target is not None else None
        ),
        "time": measured["time"] if measured else None,
    }
    if step is not None:  # the step time predicted here, before anything runs
        result["time"] = {**(result["time"] or {}), "predicted": step}
    if traced_at_scale(spec):
        add_per_rank(result, spec, argv)
    main_rows(result)
    return result


def _module_step_fn(module, batch: object, precision: str):
    """`step(phase)`: one training step of a copy of `module` on `batch`, as Lightning runs it.

    dryrun.training_step: precision as its plugin does it, the module's own optimizer, zero_grad,
    backward, step. Two untimed steps run first."""
    import copy

    from lmledger.ledger.dryrun.engine import training_step
    from lmledger.ledger.dryrun.fakecopy import precision_dtypes
    from lmledger.ledger.predict import configured_optimizer, module_step

    real = copy.deepcopy(module)
    dtype, _ = precision_dtypes(precision)
    if dtype is not None:
        real.to(dtype)
    step = training_step(real, batch, step=module_step, optimizer=configured_optimizer(real), precision=precision)
    step()
    step()
    return step


def account_module(argv: list[str], gpu: str | None = None) -> dict:
    """account (without --measure) of a config naming any LightningModule: one rank's step at its world size and
    strategy (accounting.scale.any_model_at_scale), else one device's (account_any_model)."""
    from lmledger.accounting.scale import any_model_at_scale, at_scale, trainer_scale

    scale = trainer_scale(argv)
    if at_scale(scale.world_size, scale.strategy):
        return any_model_at_scale(argv, gpu=gpu)
    return account_any_model(argv, False, step_time=True, gpu=gpu)


def account_any_model(argv: list[str], do_measure: bool, step_time: bool = False, gpu: str | None = None) -> dict:
    """account for a config naming any LightningModule.

    The dry run, beside the real step with --measure. Both run on its data's first batch.
    No model FLOPs (6N + attention needs the architecture), so no MFU."""
    import copy

    from lmledger.accounting.gpustep import (
        module_precision,
        ops_gpu_step,
        stand_in_note,
        target_gpu,
    )
    from lmledger.callbacks.dryrun import samples_per_batch, tokens_per_batch
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import predict as ledger_predict
    from lmledger.ledger.dryrun.fakecopy import map_tensors
    from lmledger.ledger.run import Run

    module, data, config = build_model_and_data(argv)
    precision, traced, weights = module_precision(config.trainer, module)
    device = local_device(config.trainer.get("accelerator"))
    batch = first_batch(data)
    if device.type == "cuda":
        module.to(device)
        batch = map_tensors(lambda t: t.to(device), batch)
    tokens = tokens_per_batch(module, batch)
    samples = samples_per_batch(batch)
    # Transformer Engine's step is traced at its weights' precision (te.Linear runs on a CUDA GPU only), priced on a GPU
    run = Run(None, samples, (tokens or samples) // max(samples, 1), traced, device=device, module=module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = ledger_predict.measure_module(module, batch, precision=precision) if do_measure else None
        predicted = predict_run(run, batch)
        timing = step = None
        target, why = target_gpu(config.trainer.get("accelerator"), gpu, precision) if step_time else (None, "")
        has_ops = predicted.dry is not None and predicted.dry.ops is not None
        if target is not None and has_ops:  # on a GPU: its dry run's ops priced by the GPU op model
            accumulate = trainer_time_settings(list(argv))["accumulate"]
            step = ops_gpu_step(predicted.dry.ops, target, precision, tokens, samples, accumulate)
            stand_in = [stand_in_note(precision, weights)] if traced != precision and "none" not in step else []
            step["notes"] = [*step.get("notes", ()), *([why] if why != "--gpu" else []), *stand_in]
        elif step_time and has_ops and target is None:  # the step time predicted here
            # a manual step's optimizer ops are replayed as recorded (the fit's Ledger does the same); else the
            # module's optimizer is timed whole
            manual = ledger_predict.steps_by_hand(module)
            optimizer = None if manual else ledger_predict.configured_optimizer(copy.deepcopy(module))
            step = predicted_step_time(
                predicted.dry.ops, optimizer, argv, precision, device, tokens, samples, data.train_dataloader()
            )
        elif step_time:
            step = no_step_time(predicted.unmodelled)
        if do_measure and has_ops:
            timing = _time_table(predicted.dry.ops, precision, device, _module_step_fn(module, batch, precision),
                                 (step or {}).get("seconds"))  # fmt: skip
        if step is not None:
            timing = {**(timing or {}), "predicted": step}
    why = predicted.unmodelled
    if why:  # not traced: the dry run's column holds no figure, each with the reason
        main = Figures(why_missing=dict.fromkeys((*MEMORY_ROWS, "flops_hardware"), why))
    else:
        main = figures_of_step(predicted.dry)  # no model FLOPs: 6N + attention needs the architecture
    result = {
        "params": ledger_predict.parameter_count(module),
        "predictors": {"dry run": main},
        "measured": figures_of_step(measured) if measured else None,
        "run": {
            "model": config.model.class_path,
            "data": config.data.class_path,
            "batch_size": samples,
            "tokens_per_step": tokens,
            "precision": precision,
            "device": device.type if do_measure else predicted_device(config.trainer.get("accelerator")).type,
            "dry_run_device": device.type,
            "measured_peak_phase": measured.peak_phase if measured else None,
            "not_predicted": why,
        },
        "mfu_conventions": None,
        "time": timing,
    }
    main_rows(result)
    return result
