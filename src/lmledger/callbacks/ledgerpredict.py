"""The Ledger's prediction, once per fit before step 1: the dry run, the report's predicted columns, the fit check.

Each function takes the callbacks.ledger.Ledger whose state it reads and fills (report, tokens, samples, the
dry run), and is called from one of its hooks (on_fit_start for the toy LM, else the first on_train_batch_start).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from rich.console import Console

from lmledger.callbacks import closedform as toy
from lmledger.callbacks import preflight
from lmledger.callbacks.dryrun import (
    dry_run_training_step,
    largest_training_batch,
    samples_per_batch,
    tokens_per_batch,
    toy_batch,
)
from lmledger.callbacks.trainer_io import log_scalars, log_text
from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.dryrun import moebounds
from lmledger.ledger.dryrun.engine import NotTraced, StepLedger
from lmledger.ledger.predict import resized
from lmledger.ledger.report import Figures, Report, figures_of_step, markdown_table

__all__ = ["batch_hint", "check_fits", "predict", "summary_card"]


def predict(ledger, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> None:
    ledger.tokens = ledger.run.tokens_per_batch if ledger.run is not None else tokens_per_batch(pl_module, batch)
    ledger.samples = ledger.run.batch_size if ledger.run is not None else samples_per_batch(batch)
    dry = dry_run_training_step(trainer, pl_module, batch, batch_idx, ledger._accumulate, ledger._unsharded)
    worst = None
    if isinstance(dry, moebounds.MoEBounds):  # top-k routing decides shapes: two stated assumptions
        dry, worst = dry.balanced, dry.worst
    predicted: dict[str, Figures] = {}
    notes = [f"per device; {ledger.tokens} tokens per batch" if ledger.tokens is not None
             else f"per device; {ledger.samples} samples per batch"]  # fmt: skip
    if ledger._accumulate > 1:
        notes.append(f"one optimizer step = {ledger._accumulate} micro-batches (activations: one micro-batch's)")
    if ledger.timing is not None:  # the same dry run prices the step's time: each op is seen once
        ledger.timing.prediction = dry if isinstance(dry, StepLedger) else None
        ledger.timing.why_no_bound = dry.reason if isinstance(dry, NotTraced) else None
    if isinstance(dry, NotTraced):
        ledger.why_not_predicted = dry.reason
        rank_zero_info(f"ledger: {type(pl_module).__name__} is not dry-run, so measured only: {dry.reason}")
        notes.append(f"not predicted, measured only: {dry.reason}")
        ledger._dry = None
    else:
        ledger._dry = dry
        predicted["dry run"] = figures_of_step(dry, flops_model=3 * dry.flops_forward)
        notes.append(f"dry run on fake tensors, peak during {dry.peak_phase}")
        if ledger.compiled:  # the dry run runs compiled code eager (dryrun: set_stance force_eager)
            shown = ", ".join(ledger.compiled[:3]) + (", ..." if len(ledger.compiled) > 3 else "")
            line = (
                f"torch.compile ({shown}): the dry run predicts the eager step, which does not cover the "
                "compiled step's own saved activations and buffers (fused kernels); the fit runs compiled, "
                "and is measured so"
            )
            rank_zero_info(f"ledger: {line}")
            notes.append(line)
    if worst is not None:
        predicted["worst routing"] = figures_of_step(worst, flops_model=3 * worst.flops_forward)
        notes.append(
            "mixture of experts: the dry run assumes balanced routing (tokens·k/E per expert), 'worst routing' "
            "every expert hit and the rest of the tokens on the same k (the memory check holds it)"
        )
    if ledger.run is not None:
        predicted["closed form"] = toy.closed_form(ledger.run, ledger._dry, ledger._accumulate)
        notes.append(toy.closed_form_note(predicted["closed form"]))
    if precision_table.precision(str(trainer.precision)).autocast is not None:
        notes.append("autocast_weight_copies: autocast's low-precision weight casts, in neither params nor "
                     "activations; in the peak")  # fmt: skip
    ledger.report = Report(predicted, notes=notes)
    if not predicted:
        return
    log_scalars(trainer, ledger.report.scalars("predicted"), step=trainer.global_step)
    if ledger.run is not None:
        summary_card(ledger, trainer)
    check_fits(ledger, trainer, pl_module, batch)
    ledger._unsharded = None  # predicted: the copy is no longer needed
    if trainer.is_global_zero:
        Console().print(ledger.report.table("ledger (predicted)"))


def summary_card(ledger, trainer: pl.Trainer) -> None:
    rows = toy.summary_rows(ledger.run, ledger.report.primary)
    log_text(trainer, "ledger/summary", markdown_table(["", "value", ""], rows), step=trainer.global_step)
    breakdown = toy.flop_breakdown(ledger.run.config, (ledger.run.batch_size, ledger.run.seq_len))
    log_text(trainer, "flops/breakdown", breakdown, step=trainer.global_step)


def check_fits(ledger, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object) -> None:
    """Stop before step 1 if the predicted peak exceeds what the device holds (callbacks.preflight)."""
    processes = preflight.processes_on_this_machine(trainer)
    capacity = preflight.available_memory(pl_module.device, ledger.settings.device_memory_gb, pl_module, processes)
    primary = ledger.report.predicted.get("worst routing") or next(
        (f for f in ledger.report.predicted.values() if f.peak is not None), None
    )
    if capacity is None:
        return
    if primary is None:
        if ledger.settings.device_memory_gb is not None or pl_module.device.type == "cuda":
            rank_zero_warn(f"no memory check before step 1: no predicted peak ({ledger.why_not_predicted})")
        return
    if primary.peak <= capacity.bytes:
        return
    if trainer.is_global_zero:
        Console(stderr=True).print(ledger.report.table("ledger (predicted)"))
    raise UserError(preflight.does_not_fit(primary, capacity, batch_hint(ledger, trainer, pl_module, batch, capacity)))


def batch_hint(ledger, trainer, pl_module, batch, capacity: preflight.Capacity) -> str:
    """The largest batch whose dry-run peak fits, found by dry runs at other batch sizes."""
    now = ledger.run.batch_size if ledger.run is not None else ledger.samples
    flag = "--data.batch_size" if ledger.run is not None else "a batch of"

    def batch_for(size: int) -> object:
        return toy_batch(ledger.run, size) if ledger.run is not None else resized(batch, size)

    found = largest_training_batch(  # per rank under DDP and FSDP2, as the dry run above
        trainer, pl_module, batch_for, capacity.bytes, max(1, now), ledger._accumulate, ledger._unsharded
    ) if ledger._dry is not None else None  # fmt: skip
    if found is None or isinstance(found, NotTraced):
        return "lower the batch size, checkpoint activations or set ledger.device_memory_gb"
    if found.size == 0:
        return (
            f"not even {flag} 1 fits: shorten the sequence, checkpoint activations, train in bf16-true, or shard"
            if ledger.run is not None
            else "not even one sample fits: checkpoint activations, train in bf16-true, or shard (FSDP)"
        )
    return f"{flag} {found.size} fits (now {now})" + ("" if ledger.run is not None else " samples")
