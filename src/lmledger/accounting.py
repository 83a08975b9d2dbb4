"""One training step of a fit config, accounted: predicted, measured, MFU by convention, time, per rank.

`lmledger account` prints it. `plan max-batch` and `sweep --dry-run` reuse it.
`account(spec)`: a ToyLM config, ledger.predict's closed forms beside real steps here.
`account_any_model(argv)`: any LightningModule, by its dry run.
`per_rank`: one rank's dry run at the config's world size (ledger.sharded).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lmledger.ledger import flops as ledger_flops
from lmledger.ledger.gpus import Peak
from lmledger.ledger.peak_flops import NoPeak, compute_dtype_for_precision, peak_flops
from lmledger.ledger.predict import measure as measure_run
from lmledger.ledger.predict import predict as predict_run
from lmledger.ledger.run import Run
from lmledger.ledger.units import MEMORY_ROWS, format_bytes, tera
from lmledger.model import count_parameters
from lmledger.precision import local_device, predicted_device

__all__ = [
    "AC_LABELS",
    "account",
    "account_any_model",
    "any_model_at_scale",
    "at_scale",
    "per_rank",
    "print_any_model_at_scale",
    "print_per_rank",
    "traced_at_scale",
    "trainer_scale",
]


def _predict(spec: Run, device: str) -> dict:
    """ledger.predict.predict of the config's run on `device` ("cpu" or "cuda"), as account shows it."""
    p = predict_run(dataclasses.replace(spec, device=torch.device(device)))
    return {
        "flops": {"model": p.flops_model, "hardware": p.flops_hardware},
        "memory": {**p.state, "activations": p.activations, "peak": p.peak},
        "autocast_weight_copies": p.autocast_weight_copies,
        "peak_phase": p.peak_phase if p.peak is not None else p.unmodelled,
    }


def _measure(spec: Run, device: torch.device, step_time: dict | None = None) -> dict:
    """ledger.predict.measure of the config's run on `device`, and the median time of a further step.

    Real training steps: FLOPs are counted once. Saved activations come from the first step, state
    after it. The peak is over a second, steady step."""
    m = measure_run(dataclasses.replace(spec, device=device))
    return {
        "flops": {"measured": m.flops},
        "memory": {
            "params": m.params,
            "grads": m.grads,
            "optimizer": m.optimizer,
            "activations": m.activations,
            "peak": m.peak,
        },  # fmt: skip
        "peak_phase": m.peak_phase,
        "autocast_weight_copies": m.autocast_weight_copies,
        "step_seconds": _step_seconds(m.step, device),
        "time": _step_time(spec, device, m.step, (step_time or {}).get("seconds")),
    }


def _step_time(spec: Run, device: torch.device, step, predicted: dict | None = None) -> dict:
    """The step-time table (docs/time.md).

    The roofline bound of the config's step on `device` (its dry run's ops), beside the mean of three
    profiled real steps."""
    from lmledger.ledger import roofline
    from lmledger.ledger.predict import toy_optimizer

    ops = roofline.toy_step_ops(spec.config, spec.batch_size, spec.seq_len, spec.precision, toy_optimizer(spec))
    return _time_table(ops, spec.precision, device, step, predicted)


def _time_table(ops, precision: str, device: torch.device, step, predicted: dict | None = None) -> dict:
    """The bound of `ops` (a dry run's OpSummary) on `device`, beside three profiled `step(phase)` calls."""
    from lmledger.ledger import profile, roofline

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
    from lmledger.callbacks.throughput import forward_backward_seconds

    return forward_backward_seconds(step, device, eager=False, repeats=3)


def _mfu_conventions(spec: Run, seconds: float | None, device: torch.device) -> dict:
    """FLOPs per token of a training step under each MFU convention, and the ratio to perf/mfu's.

    With a measured step time, also MFU against the device's dense peak. A measured peak the step beats
    is raised to the step's own hardware rate, as the throughput callback does."""
    per_token = ledger_flops.flops_per_token_by_convention(spec.config, spec.seq_len)
    peak = peak_line = None
    if seconds is not None:
        dtype = compute_dtype_for_precision(spec.precision)
        peak = peak_flops(dtype, device)
        if isinstance(peak, NoPeak):
            peak, peak_line = None, peak.reason
        else:
            source = peak.source.removeprefix("datasheet:")
            detail = getattr(peak, "detail", "")
            where = detail if detail.startswith(source) else ": ".join(filter(None, (source, detail)))
            peak_line = f"{tera(peak.flops_per_s):.4g} TFLOP/s dense {peak.dtype} ({where})"
            achieved = per_token["hfu"] * spec.tokens_per_batch / seconds
            if peak.source == "measured" and achieved > peak.flops_per_s:
                peak = Peak(achieved, "measured", peak.dtype)
                peak_line += f", raised to the step's own {tera(achieved):.4g} TFLOP/s, which beat it"

    def mfu(n: int) -> float | None:
        return None if peak is None else n * spec.tokens_per_batch / seconds / peak.flops_per_s

    nanogpt_printed = (
        None if seconds is None else per_token["nanogpt"] * spec.tokens_per_batch / seconds / _NANOGPT_PEAK
    )

    return {
        "perf_mfu": "palm",
        "seq_len": spec.seq_len,
        "step_seconds": seconds,
        "peak_flops_per_s": peak and peak.flops_per_s,
        "peak": peak_line,
        "nanogpt_printed_mfu": nanogpt_printed,
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


def account(spec: Run, do_measure: bool, argv: list[str] = (), step_time: bool = False) -> dict:
    """`step_time`: predict the step's time here too (ledger.steptime), under result["time"]["predicted"]."""
    device = local_device(spec.accelerator) if do_measure else predicted_device(spec.accelerator)
    predicted = _predict(spec, device.type)
    step = None
    if step_time and spec.world_size == 1 and spec.config:
        elsewhere = predicted_device(spec.accelerator) != local_device(spec.accelerator)
        step = _not_here(spec.accelerator) if elsewhere else _toy_predicted_time(spec, list(argv))
    measured = _measure(spec, device, step) if do_measure else None
    result = {
        "params": count_parameters(spec.config),
        "flops": {**predicted["flops"], "measured": measured["flops"]["measured"] if measured else None},
        "memory": {
            row: {"predicted": predicted["memory"][row], "measured": measured["memory"][row] if measured else None}
            for row in MEMORY_ROWS
        },
        "autocast_weight_copies": {
            "predicted": predicted["autocast_weight_copies"],
            "measured": measured["autocast_weight_copies"] if measured else None,
        },
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
            "peak_phase": predicted["peak_phase"],
            "measured_peak_phase": measured["peak_phase"] if measured else None,
        },
        "mfu_conventions": _mfu_conventions(spec, measured["step_seconds"] if measured else None, device),
        "time": measured["time"] if measured else None,
    }
    if step is not None:  # the step time predicted here, before anything runs
        result["time"] = {**(result["time"] or {}), "predicted": step}
    if traced_at_scale(spec):
        _add_per_rank(result, spec, argv)
    return result


AC_LABELS = ("checkpointing off", "checkpointing on")


def traced_at_scale(spec: Run) -> bool:
    """Whether a ToyLM run's per-rank dry run (ledger.sharded) says more than the closed forms.

    It does for DDP over several ranks (its buckets) and for FSDP2 (its gathered blocks).
    ZeRO, FSDP1 and DeepSpeed keep the closed forms. Their state bytes are what the dry run would give."""
    return (spec.strategy in ("ddp", "auto", "single_device") and spec.world_size > 1) or spec.strategy == "fsdp2"


def _add_per_rank(result: dict, spec: Run, argv: list[str]) -> None:
    """Set result["per_rank"]: one rank's dry run at the config's world size and strategy.

    It replaces the closed forms where it traces the strategy. (DDP's buckets and FSDP2's gathered blocks
    are in it.) The config's checkpointing picks the case: every block, or none."""
    result["per_rank"] = per_rank(spec, argv=argv)
    if spec.config.activation_checkpointing in (0, 1):
        case = result["per_rank"]["cases"][AC_LABELS[spec.config.activation_checkpointing]]
        if case.get("not_predicted") is None and case["peak_checked"]:
            for row in ("params", "grads", "optimizer", "activations", "peak"):
                result["memory"][row]["predicted"] = case[row]
            result["run"]["peak_phase"] = case["peak_phase"]


def per_rank(spec: Run, capacity_bytes: int | None = None, argv: list[str] = ()) -> dict:
    """ledger.atscale.run_at_scale with account's case names: checkpointing off and on.

    The strategy's settings come from the fit arguments `argv` (_scale_settings; none without them)."""
    from lmledger.ledger.atscale import run_at_scale

    settings = {**_scale_settings(trainer_scale(argv)), "links": scale_links(argv)} if argv else {}
    return run_at_scale(spec, capacity_bytes, labels=AC_LABELS, **settings)


def _module_step_fn(module, batch: object, precision: str):
    """`step(phase)`: one training step of a copy of `module` on `batch`, as Lightning runs it.

    dryrun.training_step: precision as its plugin does it, the module's own optimizer, zero_grad,
    backward, step. Two untimed steps run first."""
    import copy

    from lmledger.ledger.dryrun import training_step
    from lmledger.ledger.fakecopy import precision_dtypes
    from lmledger.ledger.predict import configured_optimizer, module_step

    real = copy.deepcopy(module)
    dtype, _ = precision_dtypes(precision)
    if dtype is not None:
        real.to(dtype)
    step = training_step(real, batch, step=module_step, optimizer=configured_optimizer(real), precision=precision)
    step()
    step()
    return step


def account_any_model(argv: list[str], do_measure: bool, step_time: bool = False) -> dict:
    """account for a config naming any LightningModule.

    The dry run, beside the real step with --measure. Both run on its data's first batch.
    No model FLOPs (6N + attention needs the architecture), so no MFU."""
    import copy

    from lmledger.callbacks.live import samples_per_batch, tokens_per_batch
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import predict as ledger_predict
    from lmledger.ledger.fakecopy import map_tensors
    from lmledger.ledger.run import Run

    module, data, config = build_model_and_data(argv)
    precision = str(config.trainer.get("precision") or "32-true")
    device = local_device(config.trainer.get("accelerator"))
    batch = first_batch(data)
    if device.type == "cuda":
        module.to(device)
        batch = map_tensors(lambda t: t.to(device), batch)
    tokens = tokens_per_batch(module, batch)
    samples = samples_per_batch(batch)
    run = Run(None, samples, (tokens or samples) // max(samples, 1), precision, device=device, module=module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = predict_run(run, batch)
        measured = ledger_predict.measure_module(module, batch, precision=precision) if do_measure else None
        timing = step = None
        if step_time and predicted_device(config.trainer.get("accelerator")) != device:
            step = _not_here(config.trainer.get("accelerator"))
        elif step_time and predicted.dry is not None and predicted.dry.ops is not None:  # the step time predicted here
            step = predicted_step_time(
                predicted.dry.ops, ledger_predict.configured_optimizer(copy.deepcopy(module)), argv, precision, device,
                tokens, samples, data.train_dataloader(),
            )  # fmt: skip
        elif step_time:
            step = {"none": predicted.unmodelled, "line": f"no step-time prediction: {predicted.unmodelled}"}
        if do_measure and predicted.dry is not None and predicted.dry.ops is not None:
            timing = _time_table(predicted.dry.ops, precision, device, _module_step_fn(module, batch, precision),
                                 (step or {}).get("seconds"))  # fmt: skip
        if step is not None:
            timing = {**(timing or {}), "predicted": step}
    not_predicted = predicted.unmodelled
    p = None if not_predicted else predicted

    def pair(name: str) -> dict:
        return {
            "predicted": getattr(p, name) if p else None,
            "measured": getattr(measured, name) if measured else None,
        }

    return {
        "params": ledger_predict.parameter_count(module),
        "flops": {
            "model": None,
            "hardware": p.flops_hardware if p else None,
            "measured": measured.flops if measured else None,
        },
        "memory": {row: pair(row) for row in MEMORY_ROWS},
        "autocast_weight_copies": pair("autocast_weight_copies"),
        "run": {
            "model": config.model.class_path,
            "data": config.data.class_path,
            "batch_size": samples,
            "tokens_per_step": tokens,
            "precision": precision,
            "device": device.type,
            "peak_phase": p.peak_phase if p else None,
            "measured_peak_phase": measured.peak_phase if measured else None,
            "not_predicted": not_predicted,
        },
        "mfu_conventions": None,
        "time": timing,
    }


def trainer_scale(argv: list[str]):
    """The devices, nodes and strategy (a run_config.TrainerScale) that a fit's arguments ask for.

    They are parsed as `lmledger fit` parses them and read by the function fit's checks use
    (fitting.checks.resolve_strategy), so a value fit refuses is refused here in the same words. Nothing is
    built: a model at scale is then built on the meta device."""
    from lmledger.fitting.trainerscale import resolve_strategy
    from lmledger.fitting.cli import parse_fit_config

    config = parse_fit_config(list(argv))
    return resolve_strategy(config.trainer, config.model)


def scale_links(argv: list[str]):
    """The links a run at scale's collectives cross (ledger.interconnect.Links): --ledger.intra_node and
    --ledger.inter_node where given, else an H100 node's (NVLink 4, NDR), split at --trainer.devices a node.
    None for a CPU run on one machine (gloo's collectives there are memory copies)."""
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.ledger.interconnect import links_for

    config = parse_fit_config(list(argv))
    scale = trainer_scale(argv)
    intra, inter = config.get("ledger.intra_node"), config.get("ledger.inter_node")
    if str(config.get("trainer.accelerator") or "auto") == "cpu" and scale.num_nodes == 1 and not (intra or inter):
        return None
    return links_for(None, intra, inter, scale.devices, scale.num_nodes)


def _scale_settings(scale, module=None) -> dict:
    """The keyword arguments at_scale takes from the strategy's init_args (a run_config.TrainerScale's).

    DDP's bucket settings: DDPStrategy passes them through to torch's DDP.
    A ModelParallelStrategy with tensor_parallel_size > 1 is FSDP2 x TP on a (data_parallel x tensor_parallel)
    mesh (ledger.tp): the toy LM's own plan, or a module's configure_model replayed on the fake mesh."""
    from lmledger.ledger.ddp import DDPSettings

    tensor_parallel = getattr(scale, "tensor_parallel", 1)
    if tensor_parallel > 1:
        from lmledger.ledger.fsdp2 import FSDPSettings
        from lmledger.ledger.tp import replay_configure_model

        shard = replay_configure_model if module is not None and hasattr(module, "configure_model") else None
        return {"fsdp": FSDPSettings(tensor_parallel=tensor_parallel, shard=shard)}
    return {"ddp": DDPSettings.from_kwargs(scale.init_args)} if scale.strategy == "ddp" else {}


def at_scale(world_size: int, strategy: str) -> bool:
    return world_size > 1 or strategy not in ("ddp", "auto", "single_device")


def any_model_at_scale(argv: list[str], capacity_bytes: int | None = None) -> dict:
    """One rank's dry run of any LightningModule, at the arguments' world size and strategy.

    Cases: as configured, and every block checkpointed (ledger.sharded). The module is built on the
    meta device, so an 8B model costs no memory. The batch is shaped like its data's first batch."""
    from lmledger.callbacks.live import samples_per_batch, tokens_per_batch
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import atscale
    from lmledger.ledger import predict as ledger_predict

    scale = trainer_scale(argv)
    world_size, strategy = scale.world_size, scale.strategy
    with torch.device("meta"):
        module, data, config = build_model_and_data(argv)
    batch = first_batch(data)
    precision = str(config.trainer.get("precision") or "32-true")
    samples = samples_per_batch(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale = atscale.at_scale(
            module, lambda size: ledger_predict.resized(batch, size), samples, strategy=strategy, world_size=world_size,
            capacity_bytes=capacity_bytes, step=ledger_predict.module_step,
            optimizer=ledger_predict.configured_optimizer(module), precision=precision, links=scale_links(argv),
            **_scale_settings(scale, module),
        )  # fmt: skip
    return {
        "params": ledger_predict.parameter_count(module),
        "run": {
            "model": config.model.class_path,
            "batch_size": samples,
            "tokens_per_step": tokens_per_batch(module, batch),
            "precision": precision,
            "strategy": strategy,
            "world_size": world_size,
            "device": "cpu",
        },
        "per_rank": scale,
    }


def print_per_rank(scale: dict) -> None:
    """The per-rank table of a run at scale: state, buffers and peak per checkpointing case."""
    from rich.console import Console

    from lmledger.ledger.report import render

    tp = scale.get("tensor_parallel", 1)
    shape = f" (data parallel {scale['world_size'] // tp} x tensor parallel {tp})" if tp > 1 else ""
    title = f"per rank: {scale['strategy']} over {scale['world_size']} ranks{shape}, batch {scale['batch_size']}"
    cases, table = list(scale["cases"].values()), []
    rows = [("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "activations"),
            ("comm buffers (DDP buckets, FSDP2 gathers)", "comm_buffers"), ("peak", "peak")]  # fmt: skip
    if scale.get("capacity_bytes"):
        rows.append(("largest micro-batch per rank", "max_batch"))
    links = next((c["communication"]["links"] for c in cases if c.get("communication")), None)
    if links:
        rows += [(f"collectives per step in a node ({links['intra_node']['name']})", "intra-node"),
                 (f"collectives per step between nodes ({links['inter_node']['name']})", "inter-node")]  # fmt: skip
    for label, key in rows:
        cells = []
        for case in cases:
            value = case.get(key)
            if case.get("not_predicted"):
                cells.append("—")
            elif key in ("intra-node", "inter-node"):
                spent = [r for r in (case.get("communication") or {}).get("by_link", {}).values() if r["scope"] == key]
                cells.append(f"{sum(r['seconds'] for r in spent) * 1e3:.4g} ms" if spent else "—")
            elif key == "max_batch":
                cells.append("—" if value is None else f"{value:,}")
            else:
                cells.append(format_bytes(value) + ("" if key != "peak" or case["peak_checked"] else " (unchecked)"))
        table.append((label, *cells))
    Console().print(render(["", *scale["cases"]], table, title=title))  # the one renderer, as the ledger's
    if links:
        intra, inter = links["intra_node"], links["inter_node"]
        print(f"collectives: {links['num_nodes']} node(s) of {links['gpus_per_node']} ranks; in a node {intra['name']} "
              f"at {intra['bytes_per_s'] / 1e9:.4g} GB/s, between nodes {inter['name']} at "
              f"{inter['bytes_per_s'] / 1e9:.4g} GB/s one way (--ledger.intra_node / --ledger.inter_node set them); "
              "a ring's bytes at line rate, none overlapped with compute")  # fmt: skip
    for label, case in scale["cases"].items():
        if case.get("not_predicted"):
            print(f"{label}: not predicted: {case['not_predicted']}")
        elif case.get("max_batch") == 0:
            print(f"{label}: does not fit: one sample per rank is over by {format_bytes(case['over_by_at_batch_1'])}")
        elif not case["peak_checked"]:
            print(f"{label}: the peak is the single-device step's with the sharded state swapped in, not yet held "
                  "to a measurement (checked on a GPU when one is lent)")  # fmt: skip


def print_any_model_at_scale(result: dict) -> None:
    run = result["run"]
    print(
        f"{run['model']}: {result['params']:,} params, {run['batch_size']} samples per rank, {run['precision']}; "
        "dry-run on the meta device with the CPU's kernels (a GPU's attention kernels may hold more or less)"
    )
    print_per_rank(result["per_rank"])


# -- the predicted step time (ledger.steptime), before anything runs ------------------------------------


def _trainer_time_settings(argv: list[str]) -> dict:
    """What of a fit config's trainer the step-time prediction reads: accumulation, clipping, the loop's
    progress bar, logger and logging cadence."""
    from lmledger.fitting.cli import parse_fit_config

    trainer = parse_fit_config(list(argv)).trainer
    get = trainer.get if hasattr(trainer, "get") else lambda k, d=None: getattr(trainer, k, d)
    clip = get("gradient_clip_val")
    algorithm = str(get("gradient_clip_algorithm") or "norm")
    return {
        "accumulate": int(get("accumulate_grad_batches") or 1),
        "clip": ("value" if "value" in algorithm else "norm", float(clip)) if clip else None,
        "progress_bar": get("enable_progress_bar") is not False,
        "logger": get("logger") not in (False, None) or get("logger") is None,
        "log_every_n_steps": int(get("log_every_n_steps") or 50),
    }


def predicted_step_time(
    ops, optimizer, argv: list[str], precision: str, device: torch.device, tokens: int | None, samples: int,
    loader: object = None,
) -> dict:  # fmt: skip
    """StepTime.to_json() of a config's step on this machine (or {"none": why}), with its one line."""
    import os

    from lmledger.callbacks.steptime import NO_STEP_TIME, lightning_loop_seconds

    if os.environ.get(NO_STEP_TIME):
        return {"none": f"off ({NO_STEP_TIME} is set)", "line": f"no step-time prediction: {NO_STEP_TIME} is set"}
    from lmledger.ledger.steptime import StepTime, data_wait, predict_step_time

    settings = _trainer_time_settings(argv)
    loop = lightning_loop_seconds(
        progress_bar=settings["progress_bar"], logger=settings["logger"],
        log_every_n_steps=settings["log_every_n_steps"],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = predict_step_time(
            ops, device, compute_dtype=compute_dtype_for_precision(precision), optimizer=optimizer,
            clip=settings["clip"], loop_s=loop[0] if loop else None, loop_how=loop[1] if loop else "",
            data=data_wait(loader) if loader is not None else None, tokens=tokens, samples=samples,
            accumulate=settings["accumulate"],
        )  # fmt: skip
    if not isinstance(result, StepTime):
        return {"none": result.reason, "line": f"no step-time prediction: {result.reason}"}
    return {**result.to_json(), "line": result.line()}


def _not_here(accelerator: object) -> dict:
    """No step time for a config whose device this machine lacks: timing its ops here would answer for
    another machine (and replay a GPU-sized step on this CPU)."""
    why = f"the config runs on {accelerator}, which this machine lacks (plan train-time --gpu gives its roofline bound)"
    return {"none": why, "line": f"no step-time prediction: {why}"}


def _toy_predicted_time(spec: Run, argv: list[str]) -> dict:
    """The ToyLM config's step time predicted here: its dry run on meta weights, its optimizer."""
    import os

    from lmledger.callbacks.steptime import NO_STEP_TIME
    from lmledger.ledger.dryrun import NotTraced

    if os.environ.get(NO_STEP_TIME):
        return {"none": f"off ({NO_STEP_TIME} is set)", "line": f"no step-time prediction: {NO_STEP_TIME} is set"}
    from lmledger.ledger.predict import toy_dry_run, toy_optimizer
    from lmledger.ledger.steptime.predict import free_memory
    from lmledger.model import ToyLM

    needs = 16 * count_parameters(spec.config)  # params, grads and AdamW's two moments in fp32, before activations
    if needs > free_memory(torch.device("cpu")):
        why = (f"its training state alone ({format_bytes(needs)}) exceeds this machine's free memory, so its ops "
               "cannot run here; `plan train-time --config FILE --gpu NAME` gives a GPU's roofline bound")  # fmt: skip
        return {"none": why, "line": f"no step-time prediction: {why}"}
    accumulate = _trainer_time_settings(argv)["accumulate"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dry = toy_dry_run(dataclasses.replace(spec, device=torch.device("cpu")), accumulate)
    if isinstance(dry, NotTraced):
        return {"none": dry.reason, "line": f"no step-time prediction: {dry.reason}"}
    with torch.device("meta"):  # the optimizer the ops were priced with, over meta weights
        model = ToyLM(spec.config)
    optimizer = toy_optimizer(spec)(list(model.parameters()))
    return predicted_step_time(
        dry.ops, optimizer, argv, spec.precision, torch.device("cpu"),
        spec.tokens_per_batch, spec.batch_size,
    )  # fmt: skip


def train_time_from_config(config: str, tokens: float, gpu: str | None = None) -> dict:
    """`plan train-time --config FILE --tokens D [--gpu KEY]`: the time to train on D tokens.

    Without a GPU: at the step time predicted on this machine (ledger.steptime). With one: at that GPU's
    roofline bound of the same step (its datasheet peaks and bandwidth), the fastest it could run there,
    so an upper bound on speed, until a GPU results file gives per-category efficiencies for it."""
    from lmledger.errors import UserError
    from lmledger.fitting.checks import named_classes
    from lmledger.run_config import load_run

    argv = ["--config", config]
    if named_classes(argv):
        if gpu is not None:
            raise UserError("plan train-time --config --gpu prices lmledger's ToyLM configs; drop --gpu for this one")
        result = account_any_model(argv, False, step_time=True)
        predicted, per_step = result["time"]["predicted"], result["run"]["tokens_per_step"]
        spec = None
    else:
        spec = load_run(argv)
        if spec.world_size > 1:
            raise UserError(
                f"{config} runs on {spec.world_size} devices: plan train-time --config predicts one device's step; "
                "fit it with the Ledger to see its step time"
            )
        predicted = _toy_predicted_time(spec, argv) if gpu is None else {}
        per_step = spec.tokens_per_batch * _trainer_time_settings(argv)["accumulate"]
    if "none" in predicted:
        raise UserError(f"{config}: {predicted['line']}")
    if not per_step:
        raise UserError(f"{config}: its batches hold no token ids, so there is no tokens/s to plan with")
    out = {"config": config, "tokens": tokens, "tokens_per_step": per_step, "gpu": gpu}
    if gpu is None:
        step_s, source = predicted["total_s"], f"predicted on this machine: {predicted['line']}"
    else:
        from lmledger.ledger.peak_flops import compute_dtype_for_precision
        from lmledger.ledger.roofline import gpu_roofline, toy_step_ops

        ops = toy_step_ops(spec.config, spec.batch_size, spec.seq_len, spec.precision)
        bound = gpu_roofline(ops, compute_dtype_for_precision(spec.precision), gpu)
        step_s = bound.seconds * _trainer_time_settings(argv)["accumulate"]
        source = (
            f"roofline bound on {bound.device} (datasheet peaks and bandwidth): an upper bound on speed, so the days "
            "are a floor; no GPU results file gives this GPU's per-category efficiencies yet"
        )
    seconds = tokens / per_step * step_s
    out.update(step_s=step_s, tokens_per_s=per_step / step_s, seconds=seconds, days=seconds / 86400, source=source)
    return out
