"""`lmledger plan train-time|max-params|max-batch ...`: napkin math from lmledger.ledger.planner."""

from __future__ import annotations

import argparse
import math
import re
from json import dumps
from typing import Annotated

from rich.console import Console
from rich.table import Table

from lmledger.commands.argparser import run_command
from lmledger.errors import UserError
from lmledger.ledger.gpus import DTYPES, dtype_name, require_gpu
from lmledger.ledger.planner import MAX_COUNT, MAX_GPUS, max_params, train_time
from lmledger.ledger.units import GB

# torch and Lightning are imported only by max-batch (it reads a fit config): train-time, max-params'
# parsing and `gpus` start in a fraction of a second.

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
PEAK_DTYPES = ", ".join(DTYPES)  # quoted in train-time's --help


def _count(text: str) -> float:
    """A positive finite count such as 70e9, 70B or 15T (k, M, B, T suffixes), at most MAX_COUNT."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBtT]?)\s*", text)
    try:
        value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 70e9 or 70B)") from None
    if not math.isfinite(value) or not 0 < value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count between 0 and {MAX_COUNT:g} (e.g. 70e9 or 70B)")
    return value


def _fraction(text: str) -> float:
    """A finite number (the MFU); its range is checked by the planner."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 0.5)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r} (e.g. 0.5)")
    return value


def _mfu(text: str) -> float | str:
    """A number (the MFU), or roofline:CONFIG: the roofline's upper bound for that fit config's step."""
    if text.startswith("roofline:") and text.removeprefix("roofline:"):
        return text
    if text == "roofline" or text == "roofline:":
        raise argparse.ArgumentTypeError("roofline needs the fit config it prices: --mfu roofline:configs/tiny.yaml")
    return _fraction(text)


def roofline_mfu(config: str, gpu: str, dtype: str) -> tuple[float, str, str]:
    """The roofline MFU of a ToyLM fit config's training step on `gpu` (docs/time.md): its dry run (here,
    on this machine's CPU) priced at the GPU's datasheet peaks and bandwidth; a line saying so; and the
    step's shape advice for that GPU."""
    from lmledger.ledger.roofline import gpu_roofline, toy_step_ops
    from lmledger.ledger.shapes import advice_text
    from lmledger.runspec import load_run_spec

    spec = load_run_spec(["--config", config])
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


def _positive_gb(text: str) -> float:
    value = _fraction(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GB (e.g. 80)")
    return value


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} (e.g. 8)") from None
    if not 1 <= value <= MAX_GPUS:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 1 and {MAX_GPUS:,}")
    return value


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def train_time_command(
    *,
    params: Annotated[float, _count],
    tokens: Annotated[float, _count],
    gpu: str,
    num_gpus: Annotated[int, _gpu_count] = 1,
    mfu: Annotated[float | str, _mfu],
    dtype: str = "bf16",
    json: bool = False,
) -> None:
    """days to train N params on D tokens

    Args:
        params: parameters, e.g. 70e9 or 70B
        tokens: training tokens, e.g. 15e12 or 15T
        gpu: a key from `lmledger gpus` or a torch device name
        num_gpus: GPUs (default 1)
        mfu: model FLOPs utilization in (0, 1], e.g. 0.5; or roofline:CONFIG, the highest MFU that fit config's
            step can reach on --gpu (an upper bound, docs/time.md)
        dtype: whose dense peak applies: {PEAK_DTYPES} (default bf16)
    """
    mfu_line = advice = None
    if isinstance(mfu, str):
        mfu, mfu_line, advice = roofline_mfu(mfu.removeprefix("roofline:"), gpu, dtype)
    result = train_time(params, tokens, gpu, num_gpus, mfu, dtype)
    if json:
        out = result.to_json()
        if mfu_line:
            out["mfu_source"] = "roofline upper bound: " + mfu_line
            out["shape_advice"] = advice
        print(dumps(out))
        return
    _print_rows(
        "training time (6·N·D / (peak · GPUs · MFU))",
        [
            ("params", f"{result.params:.4g}"),
            ("tokens", f"{result.tokens:.4g}"),
            ("total FLOPs", f"{result.total_flops:.4g}"),
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            (f"peak {result.dtype} per GPU", f"{result.peak_flops / 1e12:g} TFLOP/s (dense)"),
            ("MFU", mfu_line or f"{result.mfu:g}"),
            ("hours", f"{result.hours:,.1f}"),
            ("days", f"{result.days:,.1f}"),
        ],
    )
    if advice:
        print(advice)


def max_params_command(
    *,
    gpu: str,
    num_gpus: Annotated[int, _gpu_count] = 1,
    precision: str = "32-true",
    optimizer: str = "adamw",
    json: bool = False,
) -> None:
    """largest model whose params, grads and optimizer state fit

    Args:
        gpu: a key from `lmledger gpus` or a torch device name
        num_gpus: GPUs (default 1)
        precision: a Lightning precision: 32-true, bf16-mixed, bf16-true, ... (default 32-true)
        optimizer: adamw, adam, sgd or none (default adamw)
    """
    result = max_params(gpu, num_gpus, precision, optimizer)
    if json:
        print(dumps(result.to_json()))
        return
    _print_rows(
        "largest model that fits (activations ignored)",
        [
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            ("memory (all GPUs)", f"{result.capacity_bytes / GB:g} GB"),
            ("precision / optimizer", f"{result.precision} / {result.optimizer}"),
            ("bytes per param", f"{result.bytes_per_param:g}"),
            ("max params", f"{result.max_params:,} ({result.max_params / 1e9:.3g}B)"),
        ],
    )


def _capacity(gpu: str | None, device_memory_gb: float | None) -> tuple[int, str, str | None]:
    """(bytes one device may use, how to show it, the GPU key or None) from --gpu or --device-memory-gb."""
    if (gpu is None) == (device_memory_gb is None):
        raise UserError(
            "max-batch needs the memory to fit in: --gpu KEY or --device-memory-gb GB (or --ledger.device_memory_gb), "
            "one of them"
        )
    if gpu is not None:
        spec = require_gpu(gpu)
        return spec.memory_bytes, f"{spec.key} ({spec.memory_bytes / GB:g} GB)", spec.key
    return round(device_memory_gb * GB), f"{device_memory_gb:g} GB per device", None


def _ledger_memory_flag(fit_args: list[str]) -> float | None:
    """`--ledger.device_memory_gb X` among the fit arguments (the cap a fit's preflight would use), or None."""
    for i, arg in enumerate(fit_args):
        value = None
        if arg == "--ledger.device_memory_gb" and i + 1 < len(fit_args):
            value = fit_args[i + 1]
        elif arg.startswith("--ledger.device_memory_gb="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return _positive_gb(value)
            except argparse.ArgumentTypeError as err:
                raise UserError(f"--ledger.device_memory_gb: {err}") from None
    return None


def max_batch_command(
    *fit_args: str,
    gpu: str | None = None,
    device_memory_gb: Annotated[float | None, _positive_gb] = None,
    json: bool = False,
) -> None:
    """largest batch of a fit config that fits on a GPU (activations included)

    Any other arguments are read as by `lmledger fit`: --config FILE and --a.b VALUE overrides.

    Args:
        gpu: a key from `lmledger gpus` or a torch device name
        device_memory_gb: memory one device may use, in GB (1e9 bytes), instead of --gpu
    """
    from lmledger.fitting.checks import named_classes

    fit_args = list(fit_args)
    if not fit_args:
        raise UserError("max-batch needs --config FILE (a `lmledger fit` config, e.g. configs/cs336-small.yaml)")
    if gpu is None and device_memory_gb is None:
        device_memory_gb = _ledger_memory_flag(fit_args)
    capacity, shown, gpu_key = _capacity(gpu, device_memory_gb)  # refused before any config is read
    if named_classes(fit_args):
        from lmledger.commands.account import any_model_at_scale, at_scale, print_any_model_at_scale, trainer_scale

        if at_scale(*trainer_scale(fit_args)):  # one rank's dry run at the world size (ledger.sharded)
            result = any_model_at_scale(fit_args, capacity)
            result.update(capacity_bytes=capacity, gpu=gpu_key)
            if json:
                print(dumps(result))
            else:
                print(f"memory per rank: {shown}")
                print_any_model_at_scale(result)
            return
        _max_batch_any_model(capacity, shown, gpu_key, fit_args, json)
        return
    import dataclasses

    import torch

    from lmledger.ledger.planner import max_batch
    from lmledger.ledger.predict import predict
    from lmledger.model import count_parameters
    from lmledger.runspec import load_run_spec

    spec = load_run_spec(fit_args)
    # The closed forms for a GPU (its kernels' transients); with only a memory size, for the config's device.
    device = "cuda" if gpu_key or spec.accelerator in ("gpu", "cuda") else "cpu"
    run = dataclasses.replace(spec, device=torch.device(device))

    def bytes_for_batch(batch: int) -> int:
        return predict(run, batch_size=batch).peak

    best = max_batch(bytes_for_batch, capacity)
    result = {
        "max_batch": best,
        "seq_len": spec.seq_len,
        "tokens_per_step": best * spec.seq_len,
        "peak_bytes": bytes_for_batch(best) if best else bytes_for_batch(1),
        "capacity_bytes": capacity,
        "gpu": gpu_key,
        "precision": spec.precision,
        "optimizer": spec.optimizer,
        "activation_checkpointing": spec.config.activation_checkpointing,
    }
    from lmledger.commands.account import traced_at_scale

    if traced_at_scale(spec):
        _per_rank_batch(result, spec, capacity, fit_args)
    if json:
        print(dumps(result))
        return
    _print_rows(
        "largest batch that fits (params, grads, optimizer, activations, transients)",
        [
            ("memory", shown),
            ("model", f"{count_parameters(spec.config):,} params, seq {spec.seq_len}"),
            ("precision / optimizer", f"{spec.precision} / {spec.optimizer}"),
            ("max batch per device", f"{result['max_batch']:,}"),
            (
                f"predicted peak at {'that batch' if result['max_batch'] else 'batch 1'}",
                f"{result['peak_bytes'] / GB:.2f} GB",
            ),
        ],
    )
    if result.get("per_rank"):
        from lmledger.commands.account import print_per_rank

        print_per_rank(result["per_rank"])


def _per_rank_batch(result: dict, spec, capacity: int, fit_args: list[str]) -> None:
    """result["per_rank"]: the largest micro-batch per rank at the config's world size and strategy, from
    one rank's dry run (ledger.sharded), checkpointing off and on; the config's own case (checkpointing
    every block or none) then answers max_batch."""
    from lmledger.commands.account import _AC_LABELS, per_rank

    result["per_rank"] = per_rank(spec, capacity, fit_args)
    if spec.config.activation_checkpointing not in (0, 1):
        return
    case = result["per_rank"]["cases"][_AC_LABELS[spec.config.activation_checkpointing]]
    if case.get("not_predicted") is None and case["peak_checked"] and case.get("max_batch") is not None:
        result["max_batch"] = case["max_batch"]
        result["tokens_per_step"] = case["max_batch"] * spec.seq_len
        if case["max_batch"]:
            result["peak_bytes"] = case["max_batch_peak"]
        else:
            result["peak_bytes"] = capacity + case["over_by_at_batch_1"]


def _max_batch_any_model(capacity: int, shown: str, gpu_key: str | None, fit_args: list[str], json: bool) -> None:
    """max-batch for any LightningModule: dry runs of its training_step on batches shaped like its data's
    first batch, doubling then bisecting the number of samples (ledger.predict.max_batch_module)."""
    import warnings

    import torch

    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import predict as any_model
    from lmledger.ledger.dryrun import NotTraced, batch_tensors

    module, data, config = build_model_and_data(fit_args)
    precision = str(config.trainer.get("precision") or "32-true")
    wants_gpu = gpu_key is not None or config.trainer.get("accelerator") in ("gpu", "cuda")
    # Fake CUDA tensors need a CUDA build and device; without one the CPU's kernels stand in (note below).
    device = torch.device("cuda" if wants_gpu and torch.cuda.is_available() else "cpu")
    batch = first_batch(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = any_model.max_batch_module(module, batch, capacity, precision=precision, device=device)
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
    if json:
        print(dumps(result))
        return
    _print_rows(
        "largest batch that fits (dry runs of the module's training step)",
        [
            ("memory", shown),
            ("model", f"{config.model.class_path}, {any_model.parameter_count(module):,} params"),
            ("precision", precision),
            ("max batch per device", f"{found.size:,}"),
            (f"predicted peak at {'that batch' if found.size else 'batch 1'}", f"{result['peak_bytes'] / GB:.4g} GB"),
        ],
    )
    if wants_gpu and device.type == "cpu":
        print("dry-run with the CPU's kernels: this machine has no CUDA GPU, and a GPU's attention and optimizer "
              "kernels may hold more or less than these")  # fmt: skip


def main(argv: list[str]) -> int:
    verbs = {"train-time": train_time_command, "max-params": max_params_command, "max-batch": max_batch_command}
    return run_command("lmledger plan", verbs, argv, "Napkin math (CS336 lecture 2).", verb_name="verb")
