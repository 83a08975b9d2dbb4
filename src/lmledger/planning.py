"""What a fit config can reach before it runs: its largest batch under a memory cap, its roofline MFU.

`lmledger plan max-batch` and `train-time --mfu roofline:CONFIG` print these.
A ToyLM config is sized by ledger.predict's closed forms. (ledger.closedform.napkin.max_batch searches the batch.)
A run at scale is sized by one rank's dry run (lmledger.accounting.per_rank).
Any LightningModule is sized by dry runs of its training_step (ledger.predict.max_batch_module).
"""

from __future__ import annotations

import dataclasses
import warnings

from lmledger.accounting import AC_LABELS, any_model_at_scale, at_scale, per_rank, traced_at_scale, trainer_scale
from lmledger.errors import UserError
from lmledger.ledger.hardware.gpus import dtype_name
from lmledger.precision import local_device, predicted_device

__all__ = ["max_batch_json", "max_batch_of", "roofline_mfu"]


def roofline_mfu(config: str, gpu: str, dtype: str) -> tuple[float, str, str]:
    """The roofline MFU of a ToyLM fit config's step on `gpu`, a line saying so, and shape advice.

    The step's dry run (here, on this CPU) is priced at the GPU's datasheet peaks and bandwidth.
    See docs/time.md."""
    from lmledger.ledger.timing.roofline import gpu_roofline, toy_step_ops
    from lmledger.ledger.timing.shapes import advice_text
    from lmledger.run_config import load_run

    spec = load_run(["--config", config])
    if spec.config is None:
        raise UserError(f"--mfu roofline:{config}: the roofline MFU is computed for lmledger's ToyLM configs")
    ops = toy_step_ops(spec.config, spec.batch_size, spec.seq_len, spec.precision)
    bound = gpu_roofline(ops, dtype_name(dtype), gpu)
    mfu = bound.mfu(3 * ops.flops_in("forward"))
    line = (
        f"{mfu:.3g}, an upper bound: the roofline of {config}'s step (batch {spec.batch_size} x {spec.seq_len}, "
        f"{spec.precision}) at {bound.device}'s datasheet {dtype} peak and bandwidth"
    )
    names = {spec.config.vocab_size: "vocab_size", spec.config.d_ff: "d_ff", spec.config.d_model: "d_model"}
    return mfu, line, advice_text(ops, gpu, dtype_name(dtype), "cuda", names=names)


def max_batch_of(fit_args: list[str], capacity: int, gpu_key: str | None) -> tuple[str, dict, object]:
    """plan max-batch's answer: (kind, JSON, what printing needs besides).

    Kinds: "at scale" needs the accounting result (accounting.any_model_at_scale). "module" needs the parameter
    count and whether a GPU was asked for. "config" needs the Run. max_batch_json makes the JSON printable."""
    from lmledger.fitting.checks import named_classes

    if named_classes(fit_args):
        scale = trainer_scale(fit_args)  # refuses what fit refuses, in its words
        _refuse_transformer_engine(fit_args)
        if at_scale(scale.world_size, scale.strategy):  # one rank's dry run at the world size (ledger.sharding.sharded)
            found = any_model_at_scale(fit_args, capacity, gpu=gpu_key)
            case = found["per_rank"].configured  # the module as it is configured answers, as for a config
            result = {
                "max_batch": case.max_batch, "peak_bytes": case.answer_peak(capacity), "capacity_bytes": capacity,
                "gpu": gpu_key, "params": found["params"], "run": found["run"], "per_rank": found["per_rank"],
                "step": (found.get("time") or {}).get("predicted"),  # at the config's own batch
            }  # fmt: skip
            return "at scale", result, found
        result, params, wants_gpu = _max_batch_any_model(fit_args, capacity, gpu_key)
        return "module", result, (params, wants_gpu)
    result, spec = _max_batch_of_config(fit_args, capacity, gpu_key)
    return "config", result, spec


def _refuse_transformer_engine(fit_args: list[str]) -> None:
    """A module's dry run under Transformer Engine is a bf16 stand-in's (ledger.precision_table.traced_precision), whose
    peak lacks te.Linear's own saved tensors and fp8 weight copies: no batch is sized by it."""
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.ledger.precision_table import traced_precision, transformer_engine
    from lmledger.precision import requested_precision

    precision, weights = requested_precision(parse_fit_config(list(fit_args)).trainer)
    if transformer_engine(precision):
        traced = traced_precision(precision, weights)
        raise UserError(f"no peak to size the batch by: {precision}'s memory is not modelled (its step is planned as "
                        f"{traced}, without Transformer Engine's own saved tensors and fp8 weight copies)")  # fmt: skip


def max_batch_json(result: dict) -> dict:
    """max_batch_of's result as JSON: its per-rank cases (an atscale.AtScale) in the one JSON shape's form."""
    return {**result, "per_rank": result["per_rank"].to_json()} if result.get("per_rank") else result


def _max_batch_of_config(fit_args: list[str], capacity: int, gpu_key: str | None) -> tuple[dict, object]:
    """plan's JSON for a ToyLM config, and its Run.

    The batch is the largest whose predicted peak fits in `capacity` bytes per device."""
    from lmledger.ledger.closedform.napkin import max_batch
    from lmledger.ledger.precision_table import transformer_engine
    from lmledger.ledger.predict import predict
    from lmledger.run_config import load_run

    spec = load_run(fit_args)
    # The closed forms for a GPU (its kernels' transients); with only a memory size, for the config's device.
    run = dataclasses.replace(spec, device=predicted_device("gpu" if gpu_key else spec.accelerator))

    def bytes_for_batch(batch: int) -> int:
        return predict(run, batch_size=batch).peak

    sized_by = "closed forms"
    # The closed forms model the default toy LM in the precisions they list: dry runs size another architecture or
    # precision (64-true: its fit was predicted by its dry run while plan refused it). Not Transformer Engine's, whose
    # dry run is a stand-in without te.Linear's own saved tensors.
    unmodelled = None if spec.config.non_default_architecture else predict(run, batch_size=1).unmodelled
    if spec.config.non_default_architecture or (unmodelled is not None and not transformer_engine(spec.precision)):
        best, peak, sized_by = _dry_run_max_batch(run, capacity)
    elif unmodelled is not None:
        raise UserError(f"no peak to size the batch by: {unmodelled}")
    else:
        best = max_batch(bytes_for_batch, capacity)
        peak = bytes_for_batch(best) if best else bytes_for_batch(1)
    result = {
        "max_batch": best,
        "seq_len": spec.seq_len,
        "tokens_per_step": best * spec.seq_len,
        "peak_bytes": peak,
        "capacity_bytes": capacity,
        "gpu": gpu_key,
        "precision": spec.precision,
        "optimizer": spec.optimizer,
        "activation_checkpointing": spec.config.activation_checkpointing,
        "sized_by": sized_by,
    }
    if traced_at_scale(spec):
        _per_rank_batch(result, spec, capacity, fit_args)
    result["step"] = _step_at_batch(spec, fit_args, gpu_key, result["max_batch"])
    return result, spec


def _step_at_batch(spec, fit_args: list[str], gpu_key: str | None, batch: int) -> dict | None:
    """The step at the answer's batch on the GPU (accounting.gpustep): --gpu's, or the one a GPU config runs on;
    None for a CPU config without --gpu, or where not even one sample fits."""
    from lmledger.accounting.gpustep import target_gpu, toy_gpu_step
    from lmledger.accounting.steptime import trainer_time_settings

    target, why = target_gpu(spec.accelerator, gpu_key, spec.precision, spec.fp8)
    if target is None or not batch:
        return None
    step = toy_gpu_step(dataclasses.replace(spec, batch_size=batch), fit_args, target,
                        trainer_time_settings(fit_args)["accumulate"])  # fmt: skip
    step["notes"] = [*step.get("notes", ()), *([why] if why != "--gpu" else [])]
    return step


def _dry_run_max_batch(run, capacity: int) -> tuple[int, int, str]:
    """(largest batch, its peak or batch 1's, how it was sized) by dry runs of the run's ToyLM.

    Fake CUDA tensors need a CUDA build and device; without one the CPU's kernels stand in, and the answer says so."""
    from lmledger.ledger.dryrun.engine import NotTraced
    from lmledger.ledger.predict import toy_max_batch

    device = local_device(run.device.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = toy_max_batch(dataclasses.replace(run, device=device), capacity)
    if isinstance(found, NotTraced):
        raise UserError(f"the model cannot be dry-run, so no batch size is predicted: {found.reason}")
    ledger = found.fits or found.over
    kernels = "" if device.type == run.device.type else f", the CPU's kernels standing in for {run.device.type}"
    return found.size, ledger.peak, f"dry runs on {device.type}{kernels}"


def _per_rank_batch(result: dict, spec, capacity: int, fit_args: list[str]) -> None:
    """Set result["per_rank"]: the largest micro-batch per rank, checkpointing off and on.

    It comes from one rank's dry run (ledger.sharding.sharded) at the config's world size and strategy.
    The config's own case (every block checkpointed, or none) then answers max_batch."""
    result["per_rank"] = per_rank(spec, capacity, fit_args)
    checkpointing = spec.config.activation_checkpointing
    case = result["per_rank"].cases[AC_LABELS[checkpointing]] if checkpointing in (0, 1) else None
    if case is not None and case.not_predicted is None and case.peak_checked and case.max_batch is not None:
        result["max_batch"] = case.max_batch
        result["tokens_per_step"] = case.max_batch * spec.seq_len
        result["peak_bytes"] = case.answer_peak(capacity)
    elif spec.tensor_parallel > 1:  # the closed forms' answer stands elsewhere; they model no TP
        if case is None:
            why = "its dry run covers checkpointing of every block or none"
        else:
            why = case.not_predicted or "its peak is unchecked"
        raise UserError(f"no largest batch for tensor_parallel_size {spec.tensor_parallel}: the closed forms do not "
                        f"model tensor parallelism, and the per-rank dry run cannot answer ({why})")  # fmt: skip


def _max_batch_any_model(fit_args: list[str], capacity: int, gpu_key: str | None) -> tuple[dict, int, bool]:
    """max-batch for any LightningModule: (plan's JSON, parameter count, whether a GPU was asked for).

    Dry runs of its training_step on batches shaped like its data's first one, sized by the one search
    (ledger.predict.max_batch_module, napkin.largest_within)."""
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import predict as ledger_predict
    from lmledger.ledger.dryrun.engine import NotTraced
    from lmledger.ledger.dryrun.fakecopy import batch_tensors

    module, data, config = build_model_and_data(fit_args)
    precision = str(config.trainer.get("precision") or "32-true")
    # Fake CUDA tensors need a CUDA build and device; without one the CPU's kernels stand in (plan says so).
    wanted = predicted_device("gpu" if gpu_key is not None else config.trainer.get("accelerator"))
    device = local_device(wanted.type)
    wants_gpu = wanted.type == "cuda"
    batch = first_batch(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = ledger_predict.max_batch_module(module, batch, capacity, precision=precision, device=device)
    if isinstance(found, NotTraced):
        raise UserError(f"{config.model.class_path} cannot be dry-run, so no batch size is predicted: {found.reason}")
    per_sample = batch_tensors(batch)[0].shape[1:]
    seq_len = per_sample[0] if len(per_sample) == 1 else None
    ledger = found.fits or found.over
    result = {
        "max_batch": found.size,
        "seq_len": seq_len,
        "tokens_per_step": found.size * seq_len if seq_len is not None else None,
        "peak_bytes": ledger.peak if ledger else None,
        "next_peak_bytes": found.over.peak if found.over else None,
        "capacity_bytes": capacity,
        "gpu": gpu_key,
        "precision": precision,
        "model": config.model.class_path,
        "device": device.type,
    }
    return result, ledger_predict.parameter_count(module), wants_gpu
