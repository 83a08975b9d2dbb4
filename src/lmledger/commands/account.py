"""`lmledger account --config FILE [overrides] [--measure] [--json]`: one training step, on paper.

With --measure, also on this machine, each figure beside its twin. lmledger.accounting does the sums and
turns them into the one Report (accounting.reporting); this command parses, calls and prints.
"""

from __future__ import annotations

import argparse
from json import dumps

from lmledger.accounting import (
    account,
    account_any_model,
    any_model_at_scale,
    at_scale,
    ledger_json,
    ledger_report,
    print_per_rank,
    trainer_scale,
)
from lmledger.commands.argparser import run_command
from lmledger.errors import UserError
from lmledger.fitting.checks import check_accelerator
from lmledger.fitting.clusterenv import refuse_stray_launcher
from lmledger.ledger.report import render
from lmledger.run_config import load_run

__all__ = ["main"]


# The fit arguments (--config, --model, overrides) pass through to LightningCLI's parser, not argparse's.
_USAGE = """lmledger account --config FILE [--config FILE2] [--a.b VALUE ...] [--measure] [--gpu NAME] [--json]
       lmledger account --model CLASS_PATH [--data CLASS_PATH] [--a.b VALUE ...] [--measure] [--gpu NAME] [--json]"""


_DESCRIPTION = """One training step of a `lmledger fit` config. It shows the parameter count and the model
and hardware FLOPs. It predicts bytes per component and the peak. It shows the FLOPs per token each
MFU convention counts (docs/mfu.md).
--measure also runs real steps on this machine: CUDA if the config asks for a GPU and one is present,
else CPU. Each measurement prints beside its prediction, with each convention's MFU.
The model may be any LightningModule (--model CLASS_PATH, or `model: {class_path: ...}`).
A dry run of its training_step then predicts it, on the shapes of its data's first batch
(docs/any-model.md)."""


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
    """The predicted step time line and its notes, as a fit prints them (and, with --measure, the step-time
    table with its predicted column)."""
    time = result.get("time") or {}
    if time.get("predicted"):
        predicted = time["predicted"]
        print(predicted["line"])
        if predicted.get("priced_on"):
            print(gpu_breakdown(predicted))
        for note in predicted.get("notes", ()):
            print(note)
    if time.get("table"):
        print(time["table"])


def gpu_breakdown(predicted: dict) -> str:
    """The GPU op model's step per category, one line: the kernels, then what communication and the host add to the
    step (exposed) beside what overlap hides of them."""
    seconds, hidden = predicted["seconds"], predicted.get("hidden") or {}
    total = sum(seconds.values()) or 1.0
    parts = [f"{name} {seconds.get(key, 0.0) * 1e3:.4g} ms ({seconds.get(key, 0.0) / total:.0%})"
             for key, name in (("matmul", "matmul"), ("attention", "attention"), ("other", "other compute"),
                               ("optimizer", "optimizer"))]  # fmt: skip
    for key, name in (("communication", "communication"), ("host", "host")):
        parts.append(f"{name} {seconds.get(key, 0.0) * 1e3:.4g} ms exposed, {hidden.get(key, 0.0) * 1e3:.4g} ms hidden")
    why = predicted.get("mfu_explained")
    return "  " + "; ".join(parts) + (f"\n{mfu_why(why)}" if why else "")


_REST = {"other": "other compute", "optimizer": "the optimizer", "communication": "exposed communication",
         "host": "the exposed host", "bubble": "the pipeline's bubble", "data_wait": "waiting for data"}  # fmt: skip


def mfu_why(why: dict, whose: str = "  ") -> str:
    """One line, after `whose`: the predicted MFU as its three factors (ledger.timing.gpu.explain), then what else
    holds 2% of the step or more, each with the MFU the step would reach without it (--json lists every part)."""
    rest = sorted(why["rest"].items(), key=lambda kv: -kv[1])
    held = [f"{_REST.get(c, c)} {share:.0%} (MFU {why['without'][c]:.2g} without it)" for c, share in rest
            if share >= 0.02]  # fmt: skip
    return (
        f"{whose}why MFU {why['mfu']:.2g}: the kernels run {1 / why['model_over_run']:.3g}x the model's FLOPs; the "
        f"matmul and attention kernels run them at {why['kernel_rate']:.2f} of the peak and hold "
        f"{why['kernel_share']:.0%} of the step" + (f"; the rest: {', '.join(held)}" if held else "")
    )


def _print_conventions(conv: dict, run: dict) -> None:
    from rich.console import Console

    rows = []
    for key, row in conv["conventions"].items():
        label = row["label"] + (" = perf/mfu" if key == conv["perf_mfu"] else "")
        mfu = "—" if row["mfu"] is None else f"{row['mfu']:.4f}"
        rows.append((label, f"{row['flops_per_token']:,}", f"{row['vs_perf_mfu']:+.3%}", mfu))
    title = f"MFU conventions: FLOPs per token of a training step, T = {conv['seq_len']}"
    Console().print(render(["convention", "FLOPs / token", "vs perf/mfu", "MFU"], rows, title=title))
    if conv.get("predicted_on"):
        print(
            f"MFU at the step predicted on {conv['predicted_on']} by the GPU op model ({conv['step_seconds'] * 1e3:.4g}"
            f" ms) against {conv['peak']}; nanoGPT's estimate_mfu would print {conv['nanogpt_printed_mfu']:.4g} (it "
            f"divides by 312 TFLOP/s, an A100's bf16 peak, on any device)"
        )
    elif conv["step_seconds"] is None:
        print("MFU needs a measured step time: add --measure")
    elif conv["peak_flops_per_s"] is None:
        print(f"no MFU: {conv['peak']}")
    else:
        print(
            f"MFU: a {conv['step_seconds'] * 1e3:.4g} ms step ({run['batch_size']} x {run['seq_len']} tokens, median "
            f"of 3) on {run['device']} against {conv['peak']}; nanoGPT's estimate_mfu would print "
            f"{conv['nanogpt_printed_mfu']:.4g} (it divides by 312 TFLOP/s, an A100's bf16 peak, on any device)"
        )


def _accelerator(argv: list[str]) -> object:
    from lmledger.fitting.cli import parse_fit_config

    return parse_fit_config(list(argv)).trainer.get("accelerator")


def _account_command(*fit_args: str, measure: bool = False, json: bool = False, gpu: str | None = None) -> int:
    """`lmledger account`: one training step, on paper and (with --measure) here. See _DESCRIPTION.

    Args:
        measure: also run real steps here and print each measurement beside its prediction
        json: print one JSON object
        gpu: price the step on this GPU (a key from `lmledger gpus`) with the GPU op-time model, whatever the config
            runs on; a GPU config without it is priced on this machine's GPU, else an H100 SXM
    """
    from lmledger.fitting.checks import named_classes

    rest = list(fit_args)
    if gpu is not None:
        from lmledger.ledger.hardware.gpus import require_gpu

        require_gpu(gpu)  # an unknown name, before anything is built
    named = named_classes(rest)
    if not named and not any(a == "--config" or a.startswith("--config=") for a in rest):
        raise UserError("account needs --config FILE (e.g. configs/tiny.yaml) or --model CLASS_PATH")
    scale = trainer_scale(rest) if named or measure else None  # refuses what fit refuses, in its words
    if measure:  # real steps here, as a fit's: a launcher's leftover RANK, or a GPU this machine lacks, is refused
        refuse_stray_launcher(scale.devices_here(), scale.num_nodes)
        check_accelerator(_accelerator(rest))
    if named and not measure and at_scale(scale.world_size, scale.strategy):
        result = any_model_at_scale(rest, gpu=gpu)
    elif named:
        result = account_any_model(rest, measure, step_time=True, gpu=gpu)
    else:
        result = account(load_run(rest), measure, rest, step_time=True, gpu=gpu)
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
