"""`lmledger account --config FILE [overrides] [--measure] [--json]`: one training step, on paper.

With --measure, also on this machine, each figure beside its twin. lmledger.accounting does the sums.
"""

from __future__ import annotations

import argparse
from json import dumps

from lmledger.accounting import (
    account,
    account_any_model,
    any_model_at_scale,
    at_scale,
    print_any_model_at_scale,
    print_per_rank,
    trainer_scale,
)
from lmledger.commands.argparser import run_command
from lmledger.errors import UserError
from lmledger.ledger.units import MEMORY_ROWS, format_bytes
from lmledger.run_config import load_run

__all__ = ["main"]


# The fit arguments (--config, --model, overrides) pass through to LightningCLI's parser, not argparse's.
_USAGE = """lmledger account --config FILE [--config FILE2] [--a.b VALUE ...] [--measure] [--json]
       lmledger account --model CLASS_PATH [--data CLASS_PATH] [--a.b VALUE ...] [--measure] [--json]"""


_DESCRIPTION = """One training step of a `lmledger fit` config. It shows the parameter count and the model
and hardware FLOPs. It predicts bytes per component and the peak. It shows the FLOPs per token each
MFU convention counts (docs/mfu.md).
--measure also runs real steps on this machine: CUDA if the config asks for a GPU and one is present,
else CPU. Each measurement prints beside its prediction, with each convention's MFU.
The model may be any LightningModule (--model CLASS_PATH, or `model: {class_path: ...}`).
A dry run of its training_step then predicts it, on the shapes of its data's first batch
(docs/any-model.md)."""


def _error_pct(predicted: float | None, measured: float | None) -> str:
    if measured is None or predicted is None:
        return ""
    if measured == 0:
        return "0.0%" if predicted == 0 else "—"
    return f"{100 * (predicted - measured) / measured:+.2f}%"


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    run = result["run"]
    table = Table(
        title=(
            f"one training step: {result['params']:,} params, batch {run['batch_size']} × {run['seq_len']} tokens, "
            f"{run['precision']}, {run['optimizer']}, {run['strategy']} × {run['world_size']}"
        )
    )
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column else "left")

    def add_row(label: str, pair: dict, fmt) -> None:
        predicted, measured = pair["predicted"], pair["measured"]
        table.add_row(label, fmt(predicted), fmt(measured), _error_pct(predicted, measured))

    f = result["flops"]
    was_measured = f["measured"] is not None
    table.add_row("model FLOPs (6N + attn, MFU)", f"{f['model']:.4g}", "—", "")
    add_row("hardware FLOPs (as kernels)", {"predicted": f["hardware"], "measured": f["measured"]}, _fmt)
    for row in MEMORY_ROWS:
        m = result["memory"][row]
        add_row(f"{row} (bytes)", m, format_bytes)
    w = result["autocast_weight_copies"]
    if w["predicted"]:
        add_row("autocast weight copies", w, format_bytes)
    Console().print(table)
    where = f"measured on {run['device']}" if was_measured else f"predicted for {run['device']}"
    if result["memory"]["peak"]["predicted"] is None:
        print(f"activations and peak not predicted: {run['peak_phase']}; {where}")
    else:
        measured_in = run["measured_peak_phase"]
        measured_in = f"; measured peak (live tensor bytes) in: {measured_in}" if measured_in else ""
        print(f"predicted peak falls in: {run['peak_phase']}{measured_in}; {where}")
    _print_conventions(result["mfu_conventions"], run)
    if result.get("per_rank"):
        print_per_rank(result["per_rank"])
    _print_time(result)


def _print_time(result: dict) -> None:
    """The predicted step time line (and, with --measure, the step-time table with its predicted column)."""
    time = result.get("time") or {}
    if time.get("predicted"):
        print(time["predicted"]["line"])
    if time.get("table"):
        print(time["table"])


def _print_conventions(conv: dict, run: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MFU conventions: FLOPs per token of a training step, T = {conv['seq_len']}")
    for column in ("convention", "FLOPs / token", "vs perf/mfu", "MFU"):
        table.add_column(column, justify="left" if column == "convention" else "right")
    for key, row in conv["conventions"].items():
        label = row["label"] + (" = perf/mfu" if key == conv["perf_mfu"] else "")
        mfu = "—" if row["mfu"] is None else f"{row['mfu']:.4f}"
        table.add_row(label, f"{row['flops_per_token']:,}", f"{row['vs_perf_mfu']:+.3%}", mfu)
    Console().print(table)
    if conv["step_seconds"] is None:
        print("MFU needs a measured step time: add --measure")
    elif conv["peak_flops_per_s"] is None:
        print(f"no MFU: {conv['peak']}")
    else:
        print(
            f"MFU: a {conv['step_seconds'] * 1e3:.4g} ms step ({run['batch_size']} x {run['seq_len']} tokens, median "
            f"of 3) on {run['device']} against {conv['peak']}; nanoGPT's estimate_mfu would print "
            f"{conv['nanogpt_printed_mfu']:.4g} (it divides by 312 TFLOP/s, an A100's bf16 peak, on any device)"
        )


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def _print_any_model_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    run = result["run"]
    per_batch = f"{run['tokens_per_step']} tokens" if run["tokens_per_step"] is not None else "no token ids"
    table = Table(
        title=(
            f"one training step of {run['model']}: {result['params']:,} params, batch of {run['batch_size']} "
            f"({per_batch}), {run['precision']}"
        )
    )
    for column in ("", "predicted (dry run)", "measured", "error"):
        table.add_column(column, justify="right" if column else "left")
    f = result["flops"]
    table.add_row("hardware FLOPs", _fmt(f["hardware"]), _fmt(f["measured"]), _error_pct(f["hardware"], f["measured"]))
    for row in MEMORY_ROWS:
        m = result["memory"][row]
        measured = format_bytes(m["measured"]) if m["measured"] is not None else "—"
        table.add_row(
            f"{row} (bytes)", format_bytes(m["predicted"]), measured, _error_pct(m["predicted"], m["measured"])
        )
    Console().print(table)
    if run["not_predicted"]:
        print(f"not predicted: {run['not_predicted']}")
    else:
        measured_in = run["measured_peak_phase"]
        measured_in = f"; measured peak (live tensor bytes) in: {measured_in}" if measured_in else ""
        print(f"predicted peak falls in: {run['peak_phase']}{measured_in}; on {run['device']}")
    print("no model FLOPs or MFU for a module that is not lmledger's ToyLM: HFU comes from a fit's perf/hfu")
    _print_time(result)


def _account_command(*fit_args: str, measure: bool = False, json: bool = False) -> int:
    """`lmledger account`: one training step, on paper and (with --measure) here. See _DESCRIPTION.

    Args:
        measure: also run real steps here and print each measurement beside its prediction
        json: print one JSON object
    """
    from lmledger.fitting.checks import named_classes

    rest = list(fit_args)
    scale = trainer_scale(rest) if named_classes(rest) else None  # refuses what fit refuses, in its words
    if scale is not None and not measure and at_scale(scale.world_size, scale.strategy):
        result = any_model_at_scale(rest)
        if json:
            print(dumps(result))
        else:
            print_any_model_at_scale(result)
        return 0
    if named_classes(rest):
        result = account_any_model(rest, measure, step_time=True)
        if json:
            print(dumps(result))
        else:
            _print_any_model_table(result)
        return 0
    if not any(a == "--config" or a.startswith("--config=") for a in rest):
        raise UserError("account needs --config FILE (e.g. configs/tiny.yaml) or --model CLASS_PATH")
    result = account(load_run(rest), measure, rest, step_time=True)
    if json:
        print(dumps(result))
    else:
        _print_table(result)
    return 0


def main(argv: list[str]) -> int:
    # Exact flags only: an abbreviation is a fit argument, as LightningCLI reads it.
    return run_command(
        "lmledger account",
        _account_command,
        argv,
        _DESCRIPTION,
        usage=_USAGE,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
