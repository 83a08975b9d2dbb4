"""The Ledger's measured table and self-check, and its line on a CUDA OOM.

report_measured puts the measured column beside the prediction (TensorBoard, the rank record, the terminal) and
runs the self-check: one line per ledger row beyond report.TOLERANCE, with the ratio and the likely cause.
Each function takes the callbacks.ledger.Ledger whose report it reads.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from rich.console import Console

from lmledger.callbacks import preflight
from lmledger.callbacks.measure import measured_figures
from lmledger.callbacks.ranks import write_rank_record
from lmledger.callbacks.trainer_io import log_scalars, log_text, logging_step, tensorboard_writers, torch_optimizers
from lmledger.ledger.report import Miss, bar_chart, misses
from lmledger.ledger.units import STATE_COMPONENTS, format_bytes

__all__ = ["LABELS_FOR_CHECK", "check_line", "check_self", "explain_oom", "foreign_parameters", "report_measured"]

LABELS_FOR_CHECK = {"flops_hardware": "hardware FLOPs per step", "autocast_weight_copies": "autocast weight copies"}


def report_measured(ledger, trainer: pl.Trainer) -> None:
    ledger.report.measured = measured_figures(ledger.measurement)
    if ledger.report.measured.peak_phase:
        ledger.report.notes.append(f"measured peak (live tensor bytes) during {ledger.report.measured.peak_phase}")
    elif ledger.report.measured.peak is not None:
        note = "measured peak: CUDA's max_memory_allocated"
        device = trainer.strategy.root_device
        if device.type == "cuda":  # what nvidia-smi sees: the caching allocator's blocks, tensors or not
            reserved = torch.cuda.max_memory_reserved(device)
            note += f" ({format_bytes(reserved)} reserved by the caching allocator at most)"
            log_scalars(trainer, {"memory/measured/reserved": reserved})
        ledger.report.notes.append(note)
    log_scalars(trainer, ledger.report.scalars("measured"))
    log_text(trainer, "ledger/table", ledger.report.markdown())
    write_rank_record(trainer, ledger.report)  # every rank's lines: the loggers keep rank 0's (callbacks/ranks.py)
    check_self(ledger, trainer)
    for writer in tensorboard_writers(trainer):
        writer.add_figure("memory/predicted_vs_measured", bar_chart(ledger.report), global_step=logging_step(trainer))
    if trainer.is_global_zero:
        Console().print(ledger.report.table("ledger (predicted beside measured)"))


def check_self(ledger, trainer: pl.Trainer) -> None:
    """The ledger checks itself on every measured run: one line per line beyond report.TOLERANCE, with
    the ratio and the likely cause, printed and logged (ledger/check, ledger/check/*)."""
    if ledger.report.primary is None:  # measured only: nothing to hold the measurement to
        log_text(trainer, "ledger/check", f"nothing to check: not predicted ({ledger.why_not_predicted})")
        return
    found = misses(ledger.report)
    foreign = foreign_parameters(ledger, trainer)
    if foreign and not any(m.line == "params" for m in found):  # both sides count 0: say it all the same
        held = ledger.report.measured.params or 0
        found.insert(0, Miss("params", held, held + foreign))
    ledger.check = [check_line(ledger, m, foreign) for m in found]
    for line in ledger.check:
        rank_zero_info(line)
    text = "  \n".join(ledger.check) if ledger.check else "every line within tolerance (ledger.report.TOLERANCE)"
    log_text(trainer, "ledger/check", text)
    scalars = {"ledger/check/misses": len(found)}
    scalars.update({f"ledger/check/ratio/{m.line}": m.ratio for m in found if m.predicted})
    log_scalars(trainer, scalars)


def foreign_parameters(ledger, trainer: pl.Trainer) -> int:
    """Bytes of the parameters the optimizers step that the LightningModule does not hold."""
    if ledger._dry is None:  # measured only (DeepSpeed's optimizer steps flat copies, say): nothing to hold to
        return 0
    own = {id(p) for p in trainer.lightning_module.parameters()}
    stepped = {id(p): p for o in torch_optimizers(trainer) for g in o.param_groups for p in g["params"]}
    return sum(p.numel() * p.element_size() for key, p in stepped.items() if key not in own)


def check_line(ledger, miss: Miss, foreign: int) -> str:
    name = LABELS_FOR_CHECK.get(miss.line, miss.line)
    ratio = f"{miss.ratio:.3g}" if miss.predicted else "inf (predicted 0)"
    said = f"ledger check: {name} measured {miss.measured:,} vs predicted {miss.predicted:,} (ratio {ratio})"
    if miss.line == "params" and foreign:
        said = (f"ledger check: params: the optimizer steps {format_bytes(foreign)} of parameters the "
                f"LightningModule does not hold (the ledger counts {format_bytes(miss.predicted)})")  # fmt: skip
    if foreign:
        primary = ledger.report.primary
        zero = [n for n in STATE_COMPONENTS if primary is not None and primary.get(n) == 0]
        cause = (
            "training_step reaches its model through a closure, a global or a plain dict/list rather than "
            f"an attribute of the LightningModule, so the ledger saw none of its parameters ({', '.join(zero)} "
            "0): make the model an attribute (ledger.model = model)"
        )
    elif ledger.compiled and miss.line in ("activations", "peak", "autocast_weight_copies", "flops_hardware"):
        cause = "torch.compile: the compiled step keeps other tensors than the eager step the dry run predicts"
        if miss.line == "peak" and ledger.measurement is not None and ledger.measurement.device.type == "cpu":
            cause += (" (on a CPU the live-tensor tracker does not see the buffers inductor allocates below "
                      "the dispatcher, so a compiled peak may read low)")  # fmt: skip
    elif ledger.run is not None and ledger.run.compiled:
        cause = "torch.compile (model.compile): the compiled step keeps other tensors than the eager prediction"
    elif miss.line == "flops_hardware":
        cause = "the real step ran ops the fake step did not (a branch on a value, or kernels chosen at run time)"
    else:
        cause = ("something the dry run does not model (an allocator's rounding or cache, a library's workspace, "
                 "a branch on a value): please report it with the ledger table")  # fmt: skip
    return f"{said}: likely cause: {cause}"


def explain_oom(ledger, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
    """Attach one line to a CUDA OOM: `ledger_line`.

    The `lmledger fit` command prints it in place of the traceback. Raising here instead would skip
    Lightning's teardown and the other callbacks' on_exception.
    """
    Console(stderr=True).print(ledger.report.table("ledger at the OOM"))
    line = f"CUDA out of memory at step {trainer.global_step + 1}"
    primary = next((f for f in ledger.report.predicted.values() if f.peak is not None), None)
    capacity = preflight.available_memory(
        pl_module.device, ledger.settings.device_memory_gb, pl_module, preflight.processes_on_this_machine(trainer)
    )
    if primary is not None and capacity is not None:
        line += (
            f"; the ledger predicted a peak of {format_bytes(primary.peak)} within the "
            f"{format_bytes(capacity.bytes)} available ({capacity.source}), so the rest is memory it does not "
            "model (other processes, allocator fragmentation, library workspaces): lower --data.batch_size"
            + (f" below {ledger.run.batch_size}" if ledger.run is not None else "")
        )
    elif primary is not None:
        line += f"; predicted peak {format_bytes(primary.peak)} per device"
    exception.ledger_line = line
    if hasattr(exception, "add_note"):  # Python >= 3.11: a traceback in library use shows the line too
        exception.add_note(line)
