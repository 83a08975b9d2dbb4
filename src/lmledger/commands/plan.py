"""`lmledger plan train-time|max-params|max-batch ...`: napkin math from lmledger.ledger.planner."""

from __future__ import annotations

import argparse
import json
import math
import re

from rich.console import Console
from rich.table import Table

from lmledger.commands.argparser import ArgumentParser
from lmledger.errors import UserError
from lmledger.ledger.hardware import DTYPES, require_gpu
from lmledger.ledger.planner import MAX_COUNT, MAX_GPUS, max_params, train_time

# torch and Lightning are imported only by max-batch (it reads a fit config): train-time, max-params'
# parsing and `gpus` start in a fraction of a second.

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


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


def _train_time(args: argparse.Namespace) -> None:
    result = train_time(args.params, args.tokens, args.gpu, args.num_gpus, args.mfu, args.dtype)
    if args.json:
        print(json.dumps(result.to_json()))
        return
    _print_rows(
        "training time (6·N·D / (peak · GPUs · MFU))",
        [
            ("params", f"{result.params:.4g}"),
            ("tokens", f"{result.tokens:.4g}"),
            ("total FLOPs", f"{result.total_flops:.4g}"),
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            (f"peak {result.dtype} per GPU", f"{result.peak_flops / 1e12:g} TFLOP/s (dense)"),
            ("MFU", f"{result.mfu:g}"),
            ("hours", f"{result.hours:,.1f}"),
            ("days", f"{result.days:,.1f}"),
        ],
    )


def _max_params(args: argparse.Namespace) -> None:
    result = max_params(args.gpu, args.num_gpus, args.precision, args.optimizer)
    if args.json:
        print(json.dumps(result.to_json()))
        return
    _print_rows(
        "largest model that fits (activations ignored)",
        [
            ("GPU", f"{result.num_gpus} × {result.gpu}"),
            ("memory (all GPUs)", f"{result.capacity_bytes / 1e9:g} GB"),
            ("precision / optimizer", f"{result.precision} / {result.optimizer}"),
            ("bytes per param", f"{result.bytes_per_param:g}"),
            ("max params", f"{result.max_params:,} ({result.max_params / 1e9:.3g}B)"),
        ],
    )


def _capacity(args: argparse.Namespace) -> tuple[int, str, str | None]:
    """(bytes one device may use, how to show it, the GPU key or None) from --gpu or --device-memory-gb."""
    if (args.gpu is None) == (args.device_memory_gb is None):
        raise UserError(
            "max-batch needs the memory to fit in: --gpu KEY or --device-memory-gb GB (or --ledger.device_memory_gb), "
            "one of them"
        )
    if args.gpu is not None:
        gpu = require_gpu(args.gpu)
        return gpu.memory_bytes, f"{gpu.key} ({gpu.memory_bytes / 1e9:g} GB)", gpu.key
    return round(args.device_memory_gb * 1e9), f"{args.device_memory_gb:g} GB per device", None


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


def _max_batch(args: argparse.Namespace, fit_args: list[str]) -> None:
    from lmledger.commands.train import named_classes

    if not fit_args:
        raise UserError("max-batch needs --config FILE (a `lmledger fit` config, e.g. configs/cs336-small.yaml)")
    if args.gpu is None and args.device_memory_gb is None:
        args.device_memory_gb = _ledger_memory_flag(fit_args)
    _capacity(args)  # a missing or doubled memory size is refused before any config is read
    if named_classes(fit_args):
        _max_batch_any_model(args, fit_args)
        return
    import dataclasses

    import torch

    from lmledger.ledger.planner import max_batch
    from lmledger.ledger.predict import predict
    from lmledger.model import count_parameters
    from lmledger.runspec import load_run_spec

    capacity, shown, gpu_key = _capacity(args)
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
    if args.json:
        print(json.dumps(result))
        return
    _print_rows(
        "largest batch that fits (params, grads, optimizer, activations, transients)",
        [
            ("memory", shown),
            ("model", f"{count_parameters(spec.config):,} params, seq {spec.seq_len}"),
            ("precision / optimizer", f"{spec.precision} / {spec.optimizer}"),
            ("max batch per device", f"{best:,}"),
            (f"predicted peak at {'that batch' if best else 'batch 1'}", f"{result['peak_bytes'] / 1e9:.2f} GB"),
        ],
    )


def _max_batch_any_model(args: argparse.Namespace, fit_args: list[str]) -> None:
    """max-batch for any LightningModule: dry runs of its training_step on batches shaped like its data's
    first batch, doubling then bisecting the number of samples (ledger.predict.max_batch)."""
    import warnings

    import torch

    from lmledger.commands.train import build_model_and_data, first_batch
    from lmledger.ledger import predict as any_model
    from lmledger.ledger.dryrun import NotTraced, batch_tensors

    capacity, shown, gpu_key = _capacity(args)
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
    if args.json:
        print(json.dumps(result))
        return
    _print_rows(
        "largest batch that fits (dry runs of the module's training step)",
        [
            ("memory", shown),
            ("model", f"{config.model.class_path}, {any_model.parameter_count(module):,} params"),
            ("precision", precision),
            ("max batch per device", f"{found.size:,}"),
            (f"predicted peak at {'that batch' if found.size else 'batch 1'}", f"{result['peak_bytes'] / 1e9:.4g} GB"),
        ],
    )
    if wants_gpu and device.type == "cpu":
        print("dry-run with the CPU's kernels: this machine has no CUDA GPU, and a GPU's attention and optimizer "
              "kernels may hold more or less than these")  # fmt: skip


def _add_gpu_arguments(parser: argparse.ArgumentParser, *, num_gpus: bool) -> None:
    parser.add_argument("--gpu", required=num_gpus, help="a key from `lmledger gpus` or a torch device name")
    if num_gpus:
        parser.add_argument("--num-gpus", type=_gpu_count, default=1, help="GPUs (default 1)")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="lmledger plan", description="Napkin math (CS336 lecture 2).")
    verbs = parser.add_subparsers(dest="verb", required=True)

    tt = verbs.add_parser("train-time", help="days to train N params on D tokens")
    tt.add_argument("--params", type=_count, required=True, help="parameters, e.g. 70e9 or 70B")
    tt.add_argument("--tokens", type=_count, required=True, help="training tokens, e.g. 15e12 or 15T")
    _add_gpu_arguments(tt, num_gpus=True)
    tt.add_argument("--mfu", type=_fraction, required=True, help="model FLOPs utilization in (0, 1], e.g. 0.5")
    tt.add_argument("--dtype", default="bf16", help=f"whose dense peak applies: {', '.join(DTYPES)} (default bf16)")
    tt.add_argument("--json", action="store_true")
    tt.set_defaults(run=_train_time)

    mp = verbs.add_parser("max-params", help="largest model whose params, grads and optimizer state fit")
    _add_gpu_arguments(mp, num_gpus=True)
    mp.add_argument(
        "--precision",
        default="32-true",
        help="a Lightning precision: 32-true, bf16-mixed, bf16-true, ... (default 32-true)",
    )
    mp.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd or none (default adamw)")
    mp.add_argument("--json", action="store_true")
    mp.set_defaults(run=_max_params)

    mb = verbs.add_parser(
        "max-batch",
        help="largest batch of a fit config that fits on a GPU (activations included)",
        description="Any other arguments are read as by `lmledger fit`: --config FILE and --a.b VALUE overrides.",
    )
    _add_gpu_arguments(mb, num_gpus=False)
    mb.add_argument(
        "--device-memory-gb", type=_positive_gb, help="memory one device may use, in GB (1e9 bytes), instead of --gpu"
    )
    mb.add_argument("--json", action="store_true")

    args, rest = parser.parse_known_args(argv)
    if args.verb == "max-batch":
        _max_batch(args, rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        args.run(args)
    return 0
