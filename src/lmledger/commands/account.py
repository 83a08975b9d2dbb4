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
    print_per_rank,
    trainer_scale,
)
from lmledger.commands.argparser import run_command
from lmledger.errors import UserError
from lmledger.ledger.report import RUN_KEYS, Figures, Report, render
from lmledger.ledger.units import MEMORY_ROWS
from lmledger.run_config import load_run

__all__ = ["ledger_json", "ledger_report", "main"]


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


_TOY = "lmledger.lit.LitLM"


def ledger_report(result: dict) -> Report:
    """lmledger.accounting's result as the one row representation, a ledger.report.Report.

    One device, per rank (the configured checkpointing case, or any model's case "as configured"), closed
    form or dry run, measured or not: the table and the JSON both come from it."""
    run = result["run"]
    if "memory" not in result:  # any model at scale: one rank's dry run, the case as the module is configured
        case = next(iter(result["per_rank"]["cases"].values()))
        why = case.get("not_predicted")
        rows = {row: None if why else case.get(row) for row in MEMORY_ROWS}
        predicted = Figures(**rows, peak_phase=case.get("peak_phase"),
                            why_missing={row: why for row in MEMORY_ROWS} if why else {})  # fmt: skip
        notes = [
            f"per rank of {run['world_size']} ({run['strategy']}); {run['batch_size']} samples per rank",
            "dry run on the meta device with the CPU's kernels (a GPU's attention kernels may hold more or less)",
        ]
        return Report({"dry run": predicted}, notes=notes)
    memory, flops, copies = result["memory"], result["flops"], result["autocast_weight_copies"]
    why = run.get("not_predicted") or (run["peak_phase"] if memory["peak"]["predicted"] is None else None)

    def figures(kind: str, hardware, model=None, phase=None, why_missing=None) -> Figures:
        rows = {row: memory[row][kind] for row in MEMORY_ROWS}
        return Figures(**rows, autocast_weight_copies=copies[kind], peak_phase=phase, flops_hardware=hardware,
                       flops_model=model, why_missing=why_missing or {})  # fmt: skip

    missing = {row: why for row in ("activations", "peak") if memory[row]["predicted"] is None} if why else {}
    predicted = figures("predicted", flops["hardware"], flops["model"], None if why else run["peak_phase"], missing)
    measured = None
    if flops["measured"] is not None:
        measured = figures("measured", flops["measured"], phase=run["measured_peak_phase"])
    source = _predictor(result)
    notes = _notes(result, why)
    if source == "dry run" and "model" not in run:
        notes.insert(1, "bytes: one rank's dry run (per_rank, the configured checkpointing); FLOPs: the closed forms")
    return Report({source: predicted}, measured, notes=notes)


def _predictor(result: dict) -> str:
    """The main prediction's source: any model's dry run; the toy LM's closed forms, or its per-rank dry run where
    that replaced them (accounting._add_per_rank: DDP over several ranks, FSDP2)."""
    if "model" in result["run"]:
        return "dry run"
    cases = (result.get("per_rank") or {}).get("cases", {})
    peak = result["memory"]["peak"]["predicted"]
    if peak is not None and any(c.get("peak") == peak and c.get("peak_phase") == result["run"]["peak_phase"]
                                for c in cases.values()):  # fmt: skip
        return "dry run"
    return "closed form"


def _notes(result: dict, why: str | None) -> list[str]:
    """The table's caption and the JSON's notes: per what, where the peak fell, where it was measured."""
    run = result["run"]
    per = f"per rank of {run['world_size']}" if run.get("world_size", 1) > 1 else "per device"
    notes = [f"{per}; {run['tokens_per_step']} tokens per batch" if run.get("tokens_per_step") is not None
             else f"{per}; {run['batch_size']} samples per batch"]  # fmt: skip
    measured = result["flops"]["measured"] is not None
    where = f"measured on {run['device']}" if measured else f"predicted for {run['device']}"
    if why:
        notes.append(f"activations and peak not predicted: {why}")
    else:
        measured_in = run.get("measured_peak_phase")
        measured_in = f"; measured peak (live tensor bytes) in: {measured_in}" if measured_in else ""
        notes.append(f"predicted peak falls in: {run['peak_phase']}{measured_in}")
    notes.append(where)
    if "model" in run:
        notes.append("no model FLOPs or MFU for a module that is not lmledger's ToyLM: HFU comes from a fit's perf/hfu")
    return notes


def ledger_json(result: dict) -> dict:
    """The one JSON shape (ledger.report.Report.to_json; docs/commands.md) of an accounting result.

    Every mode fills the same keys. A mode adds its own: "per_rank" (at scale: each checkpointing case), "time"
    (the step time predicted, and with --measure its table), "mfu_conventions" (the toy LM)."""
    run = {key: result["run"].get(key) for key in RUN_KEYS}
    run.update({k: v for k, v in result["run"].items() if k not in run})
    run["model"] = run["model"] or _TOY
    run["world_size"] = run["world_size"] or 1  # any model on one device: the accounting names no world size
    if run["seq_len"] is None and run["tokens_per_step"] and run["batch_size"]:
        run["seq_len"] = run["tokens_per_step"] // run["batch_size"]
    if "per_rank" in result:
        run["tensor_parallel"] = result["per_rank"].get("tensor_parallel", 1)
    report = ledger_report(result)
    primary = report.primary  # where the peak fell, or why there is none, as the table's notes say
    run["peak_phase"] = primary.peak_phase
    run["not_predicted"] = primary.why_missing.get("peak") if primary.peak is None else None
    out = report.to_json(run, result["params"])
    for key in ("per_rank", "time", "mfu_conventions"):
        if result.get(key) is not None:
            out[key] = result[key]
    return out


def _title(result: dict) -> str:
    run = result["run"]
    if "model" not in run:
        return (f"one training step: {result['params']:,} params, batch {run['batch_size']} × {run['seq_len']} "
                f"tokens, {run['precision']}, {run['optimizer']}, {run['strategy']} × {run['world_size']}")  # fmt: skip
    per_batch = f"{run['tokens_per_step']} tokens" if run.get("tokens_per_step") is not None else "no token ids"
    return (f"one training step of {run['model']}: {result['params']:,} params, batch of {run['batch_size']} "
            f"({per_batch}), {run['precision']}")  # fmt: skip


def _print_table(result: dict) -> None:
    from rich.console import Console

    report = ledger_report(result)
    Console().print(report.table(_title(result)))
    if result.get("mfu_conventions"):
        _print_conventions(result["mfu_conventions"], result["run"])
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

    rows = []
    for key, row in conv["conventions"].items():
        label = row["label"] + (" = perf/mfu" if key == conv["perf_mfu"] else "")
        mfu = "—" if row["mfu"] is None else f"{row['mfu']:.4f}"
        rows.append((label, f"{row['flops_per_token']:,}", f"{row['vs_perf_mfu']:+.3%}", mfu))
    title = f"MFU conventions: FLOPs per token of a training step, T = {conv['seq_len']}"
    Console().print(render(["convention", "FLOPs / token", "vs perf/mfu", "MFU"], rows, title=title))
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
    elif named_classes(rest):
        result = account_any_model(rest, measure, step_time=True)
    elif not any(a == "--config" or a.startswith("--config=") for a in rest):
        raise UserError("account needs --config FILE (e.g. configs/tiny.yaml) or --model CLASS_PATH")
    else:
        result = account(load_run(rest), measure, rest, step_time=True)
    if json:
        print(dumps(ledger_json(result)))
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
