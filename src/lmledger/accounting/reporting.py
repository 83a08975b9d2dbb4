"""An accounting result as the one row representation, a ledger.report.Report, and as the one JSON shape.

Every mode (one device, per rank, any model, measured or not) records its predictors in order,
result["predictors"] ({source: Figures}, the main one first), and the measured Figures; `ledger_report`
adds the caption lines, `ledger_json` the run's facts (ledger.report.RUN_KEYS). `lmledger account` prints
the one, or the other.
"""

from __future__ import annotations

from lmledger.ledger.report import RUN_KEYS, Report

__all__ = ["ledger_json", "ledger_report"]

_TOY = "lmledger.lit.LitLM"


def ledger_report(result: dict) -> Report:
    """lmledger.accounting's result as a Report: its predictors beside its measurement, with their notes."""
    return Report(dict(result["predictors"]), result.get("measured"), notes=_notes(result))


def _notes(result: dict) -> list[str]:
    """The table's caption and the JSON's notes: per what, which source is which, where the peak fell."""
    run, predictors = result["run"], result["predictors"]
    main_source, main = next(iter(predictors.items()), (None, None))
    ranks = run.get("world_size") or 1
    per = f"per rank of {ranks} ({run['strategy']})" if ranks > 1 else "per device"
    notes = [f"{per}; {run['tokens_per_step']} tokens per batch" if run.get("tokens_per_step") is not None
             else f"{per}; {run['batch_size']} samples per batch"]  # fmt: skip
    if (result.get("accumulate") or 1) > 1:
        notes.append(f"one optimizer step = {result['accumulate']} micro-batches (activations: one micro-batch's)")
    if "per_rank" in result and main_source == "dry run":
        notes.append("dry run: one rank's, on fake tensors at the config's world size (per_rank: its configured "
                     "checkpointing case)")  # fmt: skip
    elif main_source == "dry run":
        notes.append("dry run: the step on fake tensors, nothing allocated")
    elif result.get("not_traced"):
        notes.append(f"closed form only, no dry run: {result['not_traced']}")
    if "closed form" in predictors:
        from lmledger.callbacks.closedform import closed_form_note

        buffers = main_source == "dry run" and "per_rank" not in result
        notes.append(closed_form_note(predictors["closed form"], buffers))
    why = run.get("not_predicted") or (main.why_missing.get("peak") if main is not None else None)
    if main is None or main.peak is None:
        if not any(why and why in note for note in notes):  # the closed form's note may have said it already
            notes.append(f"activations and peak not predicted: {why}")
    else:
        measured_in = run.get("measured_peak_phase")
        measured_in = f"; measured peak (live tensor bytes) in: {measured_in}" if measured_in else ""
        notes.append(f"predicted peak falls in: {main.peak_phase}{measured_in}")
    if "memory" not in result:  # any model at scale: built on the meta device
        notes.append("dry run on the meta device with the CPU's kernels (a GPU's attention kernels may hold more "
                     "or less)")  # fmt: skip
    elif result.get("measured"):
        notes.append(f"measured on {run['device']}")
    else:
        if main is not None and main.activations is not None:  # the one row that depends on the device's kernels
            notes.append(f"predicted for {run['device']}")
        stand_in = run.get("dry_run_device")
        if stand_in and stand_in != run["device"]:
            notes.append(f"dry run on this machine's {stand_in} in its place: the same parameters, gradients, "
                         "optimizer state and FLOPs; activations as this CPU's kernels save them (a GPU's fused "
                         "norms and attention kernels save a little less or more)")  # fmt: skip
    if run.get("fp8") and not result.get("measured"):
        notes.append(f"fp8 ({run['fp8']}): the memory is the {run['precision']} step's, without the Float8Linear "
                     "swap (it runs on a CUDA GPU of compute capability 8.9 or later), so without its fp8 casts; a "
                     "GPU step time prices each swapped linear's matmuls in fp8")  # fmt: skip
    if run.get("compiled"):
        notes.append("torch.compile: the memory is the eager step's (the compiled step fuses its elementwise ops and "
                     "may keep fewer intermediates); a GPU step time prices the fused kernels")  # fmt: skip
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
        run["tensor_parallel"] = result["per_rank"].tensor_parallel
    report = ledger_report(result)
    primary = report.primary  # where the peak fell, or why there is none, as the table's notes say
    run["peak_phase"] = primary.peak_phase if primary else None
    run["not_predicted"] = primary.why_missing.get("peak") if primary and primary.peak is None else None
    out = report.to_json(run, result["params"])
    for key in ("time", "mfu_conventions"):
        if result.get(key) is not None:
            out[key] = result[key]
    if result.get("per_rank") is not None:
        out["per_rank"] = result["per_rank"].to_json()
    return out
