"""`lmledger plan train-time|max-params|max-batch|layout ...`: napkin math (lmledger.ledger.closedform.napkin), and
the predicted step and layouts of a fit config (lmledger.planning, lmledger.accounting)."""

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
from lmledger.ledger.closedform.napkin import (
    DEVICE_MEMORY_RANGE,
    MAX_COUNT,
    MAX_GPUS,
    device_capacity,
    device_memory_bytes,
    max_params,
    train_time,
)
from lmledger.ledger.hardware.gpus import DTYPES
from lmledger.ledger.units import GB, tera

__all__ = ["PEAK_DTYPES", "main"]


# torch and Lightning are imported only by max-batch (it reads a fit config): train-time, max-params'
# parsing and `gpus` start in a fraction of a second.

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
PEAK_DTYPES = ", ".join(DTYPES)  # quoted in train-time's --help


def _count(text: str) -> float:
    """A positive finite count such as 70e9, 70B or 15T (k, M, B, T suffixes). At most MAX_COUNT."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBtT]?)\s*", text)
    try:
        value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 70e9 or 70B)") from None
    if not math.isfinite(value) or not 0 < value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count above 0, at most {MAX_COUNT:g} (e.g. 70e9 or 70B)")
    return value


def _parsed(text: str, kind: type, example: str) -> float | int:
    """`text` as a float or int, else argparse's one line naming the kind and an example."""
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r} (e.g. {example})") from None


def _fraction(text: str) -> float:
    """A finite number (the MFU); its range is checked by the planner."""
    value = _parsed(text, float, "0.5")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r} (e.g. 0.5)")
    return value


def _mfu(text: str) -> float | str:
    """A number (the MFU), or roofline:CONFIG. The latter is the roofline's bound for that config's step."""
    if text.startswith("roofline:") and text.removeprefix("roofline:"):
        return text
    if text == "roofline" or text == "roofline:":
        raise argparse.ArgumentTypeError("roofline needs the fit config it prices: --mfu roofline:configs/tiny.yaml")
    return _fraction(text)


def _positive_gb(text: str) -> float:
    value = _fraction(text)
    try:
        device_memory_bytes(value)  # fit's own check of --ledger.device_memory_gb
    except UserError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: {DEVICE_MEMORY_RANGE} (e.g. 80)") from None
    return value


def _gpu_count(text: str) -> int:
    value = _parsed(text, int, "8")
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


def _train_time_command(
    *fit_args: str,
    params: Annotated[float | None, _count] = None,
    tokens: Annotated[float, _count],
    gpu: str | None = None,
    num_gpus: Annotated[int | None, _gpu_count] = None,
    mfu: Annotated[float | str | None, _mfu] = None,
    dtype: str | None = None,
    json: bool = False,
) -> None:
    """days to train N params on D tokens

    With a fit config (--config FILE, repeatable, and --a.b VALUE overrides, read as by `lmledger fit`): the time at
    its predicted step, on --gpu (or the GPU the config runs on) by the GPU op-time model at its layout over
    --num-gpus, or on this machine for a CPU config (docs/time.md); no --params or --mfu: its MFU is predicted.

    Args:
        params: parameters, e.g. 70e9 or 70B
        tokens: training tokens, e.g. 15e12 or 15T
        gpu: a key from `lmledger gpus` or a torch device name
        num_gpus: GPUs (default 1; with --config, the config's devices)
        mfu: model FLOPs utilization in (0, 1], e.g. 0.5 (your own figure); or roofline:CONFIG, the highest MFU that
            fit config's step can reach on --gpu (an upper bound, docs/time.md)
        dtype: whose dense peak applies: {PEAK_DTYPES} (default bf16)
    """
    if fit_args:
        if params is not None or mfu is not None:
            raise UserError("plan train-time --config predicts the step and its MFU from the config: drop --params and "
                            "--mfu (they plan by 6ND at an MFU you give)")  # fmt: skip
        if dtype is not None:
            raise UserError("plan train-time --config prices the step in the config's precision: drop --dtype, or set "
                            "--trainer.precision")  # fmt: skip
        from lmledger.accounting import train_time_from_config  # imports torch and Lightning

        out = train_time_from_config(list(fit_args), tokens, gpu, num_gpus)
        if json:
            print(dumps(out))
            return
        rows = [("config", out["config"]), ("tokens", f"{tokens:.4g}"),
                ("tokens per step", f"{out['tokens_per_step']:,}")]  # fmt: skip
        if out["gpu"]:
            rows.append(("GPU", f"{out['num_gpus']} × {out['gpu']}"))
        rows += [("step", f"{out['step_s'] * 1e3:.4g} ms"), ("tokens/s", f"{out['tokens_per_s']:,.0f}")]
        if out["mfu"] is not None:
            rows.append(("MFU (predicted)", f"{out['mfu']:.3f}"))
        rows += [("hours", f"{out['seconds'] / 3600:,.1f}"), ("days", f"{out['days']:,.2f}")]
        _print_rows("training time (tokens / tokens per step x predicted step)", rows)
        print(out["source"])
        if out["gpu"]:
            from lmledger.commands.account import gpu_breakdown

            print(gpu_breakdown(out["predicted"]))
        for note in out["predicted"].get("notes", ()):
            print(note)
        return
    num_gpus, dtype = num_gpus or 1, dtype or "bf16"
    if params is None or gpu is None or mfu is None:
        raise UserError("plan train-time needs --params, --gpu and --mfu, or --config FILE (its predicted step)")
    mfu_line = advice = None
    if isinstance(mfu, str):
        from lmledger.planning import roofline_mfu  # imports torch: only for --mfu roofline:CONFIG

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
            (f"peak {result.dtype} per GPU", f"{tera(result.peak_flops):g} TFLOP/s (dense)"),
            ("MFU", mfu_line or f"{result.mfu:g}"),
            ("hours", f"{result.hours:,.1f}"),
            ("days", f"{result.days:,.1f}"),
        ],
    )
    if advice:
        print(advice)


def _max_params_command(
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


def _max_batch_command(
    *fit_args: str,
    gpu: str | None = None,
    device_memory_gb: Annotated[float | None, _positive_gb] = None,
    json: bool = False,
) -> None:
    """largest batch of a fit config that fits on a GPU (activations included)

    Any other arguments are read as by `lmledger fit`: --config FILE and --a.b VALUE overrides.

    Args:
        gpu: a key from `lmledger gpus` or a torch device name
        device_memory_gb (GB): memory one device may use, in GB (1e9 bytes), instead of --gpu (the cap a fit's
            preflight uses)
    """
    from lmledger.planning import max_batch_json, max_batch_of

    fit_args = list(fit_args)
    if not fit_args:
        raise UserError("max-batch needs --config FILE (a `lmledger fit` config, e.g. configs/cs336-small.yaml)")
    capacity, shown, gpu_key = device_capacity(gpu, device_memory_gb)  # refused before any config is read
    kind, result, extra = max_batch_of(fit_args, capacity, gpu_key)
    if json:
        print(dumps(max_batch_json(result)))
    elif kind == "at scale":
        from lmledger.accounting import print_any_model_at_scale

        print(f"memory per rank: {shown}")
        print_any_model_at_scale(extra)
        _print_step(result.get("step"), "at the config's batch")
    elif kind == "module":
        _print_any_model_batch(result, shown, *extra)
    else:
        _print_config_batch(result, shown, extra)


def _print_config_batch(result: dict, shown: str, spec) -> None:
    from lmledger.model import count_parameters

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
            ("sized by", result["sized_by"]),
        ],
    )
    if result.get("per_rank"):
        from lmledger.accounting import print_per_rank

        print_per_rank(result["per_rank"])
    _print_step(result.get("step"), "at that batch")


def _print_step(step: dict | None, where: str) -> None:
    """The predicted step on its GPU (accounting.gpustep), its categories and notes."""
    if not step:
        return
    from lmledger.commands.account import gpu_breakdown

    print(f"{where}: {step['line']}")
    if step.get("priced_on"):
        print(gpu_breakdown(step))
    for note in step.get("notes", ()):
        print(note)


def _print_any_model_batch(result: dict, shown: str, params: int, wants_gpu: bool) -> None:
    size = result["max_batch"]
    _print_rows(
        "largest batch that fits (dry runs of the module's training step)",
        [
            ("memory", shown),
            ("model", f"{result['model']}, {params:,} params"),
            ("precision", result["precision"]),
            ("max batch per device", f"{size:,}"),
            (f"predicted peak at {'that batch' if size else 'batch 1'}", f"{result['peak_bytes'] / GB:.4g} GB"),
        ],
    )
    if wants_gpu and result["device"] == "cpu":
        print("dry-run with the CPU's kernels: this machine has no CUDA GPU, and a GPU's attention and optimizer "
              "kernels may hold more or less than these")  # fmt: skip


def _top(text: str) -> int:
    value = _parsed(text, int, "10")
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 1 and 10,000 layouts to show")
    return value


def _layout_command(
    *fit_args: str,
    gpu: str | None = None,
    num_gpus: Annotated[int, _gpu_count],
    tokens: Annotated[float | None, _count] = None,
    top: Annotated[int, _top] = 10,
    json: bool = False,
) -> None:
    """the layouts of a fit config over N GPUs that fit, ranked by predicted time

    Any other arguments are read as by `lmledger fit`: --config FILE and --a.b VALUE overrides (the global batch is
    the config's: batch size x accumulation x its data-parallel ranks; --ledger.intra_node/inter_node name the links).

    Args:
        gpu: a key from `lmledger gpus` or a torch device name (default: the config's GPU, else h100-sxm)
        num_gpus: GPUs to lay the model over
        tokens: training tokens, e.g. 15T: each layout's days
        top: how many ranked layouts to show (default 10)
    """
    from lmledger.accounting.layouts import plan_layouts

    if not fit_args:
        raise UserError("plan layout needs --config FILE (a `lmledger fit` config)")
    out = plan_layouts(list(fit_args), gpu, num_gpus, tokens, top)
    if json:
        print(dumps(out))
        return
    table = Table(title=f"layouts of {out['global_batch']} x {out['seq_len']} tokens a step on {out['num_gpus']} x "
                  f"{out['gpu']}, ranked by predicted time ({out['fits']} of {out['searched']} fit)")  # fmt: skip
    for name in ("TP", "CP", "PP", "DP", "micro", "recompute", "peak GB", "step ms", "MFU", "compute", "comm", "bubble",
                 *(("days",) if tokens else ())):  # fmt: skip
        table.add_column(name, justify="right")
    for r in out["ranked"]:
        b = r["breakdown_s"]
        sp = " sp" if r["sequence_parallel"] else ""
        chunks = f" x{r['chunks_per_rank']}" if r["chunks_per_rank"] > 1 else ""  # interleaved: chunks a rank
        table.add_row(f"{r['tensor_parallel']}{sp}", str(r["context_parallel"]), f"{r['pipeline_parallel']}{chunks}",
                      f"{r['data_parallel']} {r['sharding']}",
                      f"{r['micro_batch']}x{r['micro_batches']}", r["recompute"], f"{r['peak_bytes'] / GB:.1f}",
                      f"{r['step_s'] * 1e3:,.0f}", "—" if r["mfu"] is None else f"{r['mfu']:.3f}",
                      f"{b['compute'] * 1e3:,.0f}",
                      f"{b['communication'] * 1e3:,.0f}", f"{b['bubble'] * 1e3:,.0f}",
                      *((f"{r['days']:,.1f}",) if tokens else ()))  # fmt: skip
    if out["ranked"]:
        Console(width=max(Console().width, 120)).print(table)
        if out["ranked"][0].get("mfu_explained"):
            from lmledger.commands.account import mfu_why

            print(mfu_why(out["ranked"][0]["mfu_explained"], whose="the first layout: "))
    else:
        low = out["lowest_peak"]
        which = f"none of the {out['searched']} layouts fits" if out["searched"] > 1 else "the one layout does not fit"
        if not any("peak_bytes" in group for group in out["dropped_reasons"]):  # none was over memory: laid out
            which = f"no layout of the {out['searched']} searched runs" if out["searched"] > 1 else "no layout runs"
        print(f"{which} on {out['num_gpus']} x {out['gpu']}" + (
            f": the lowest peak is {low['peak_bytes'] / GB:.1f} GB (TP {low['tensor_parallel']} x PP "
            f"{low['pipeline_parallel']} x DP {low['data_parallel']}, micro-batch {low['micro_batch']}, recompute "
            f"{low['recompute']}); more GPUs, or a GPU with more memory" if low else ""))  # fmt: skip
    for group in out["dropped_reasons"]:  # one line a reason; those over the GPU's memory as the range of their peaks
        reason = group["reason"]
        if "peak_bytes" in group:
            low, high = (peak / GB for peak in group["peak_bytes"])
            reason = f"peaks of {low:,.1f} to {high:,.1f} GB, over the GPU's {out['memory_bytes'] / GB:.0f} GB"
        print(f"dropped {group['count']}: {reason}")
    if any(r["sequence_parallel"] for r in out["ranked"]):
        print("sp: tensor parallel with sequence parallel (the norms' and residual stream's activations split too)")
    if any(r["chunks_per_rank"] > 1 for r in out["ranked"]):
        print("PP n xv: interleaved 1F1B, v model chunks a pipeline rank")
    print(f"links: {out['links']['intra_node']} in a node of {out['links']['gpus_per_node']}, "
          f"{out['links']['inter_node']} between nodes; not searched: {out['not_searched']}")  # fmt: skip
    for note in out["notes"]:
        print(note)


def main(argv: list[str]) -> int:
    verbs = {"train-time": _train_time_command, "max-params": _max_params_command, "max-batch": _max_batch_command,
             "layout": _layout_command}  # fmt: skip
    return run_command("lmledger plan", verbs, argv, "Napkin math (CS336 lecture 2).", verb_name="verb")
