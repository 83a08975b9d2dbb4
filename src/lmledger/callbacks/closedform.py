"""What the ledger adds for lmledger's own toy LM (a LitLM): the closed forms, and the toy-only cards.

`closed_form(run)`: the lecture's closed forms as Figures, a second predictor beside the dry run.
(ledger.predict on the run's ModelConfig.) The closed-form peak leaves out the buffers (rotary
tables) and the batch. The dry run counts them, as the tracker does, so they are added here.
`summary_rows`: the `ledger/summary` card. Parameters, tokens per batch, predicted peak, FLOPs.
`flop_breakdown`: the `flops/breakdown` card. Analytic FLOPs by component, beside FlopCounterMode's
by module and operator. Also what each MFU convention counts.
`validation_flops`: FLOPs of a forward-only validation batch. Counted once per shape, on a meta copy.
"""

from __future__ import annotations

import re

from lmledger.ledger.closedform.flops import (
    MFU_CONVENTIONS,
    analytic_flops,
    count_flops_meta,
    flops_per_token_by_convention,
    matmul_parameters,
)
from lmledger.ledger.dryrun.engine import StepLedger
from lmledger.ledger.predict import predict
from lmledger.ledger.report import Figures, markdown_table
from lmledger.ledger.run import Run
from lmledger.ledger.units import format_bytes, format_count
from lmledger.model import count_parameters

__all__ = [
    "closed_form",
    "closed_form_note",
    "flop_breakdown",
    "flops_by_convention",
    "summary_rows",
    "validation_flops",
]


# FlopCounterMode module names shown in the breakdown: the embedding, each block's attention and
# MLP (their norms do no matmul), the LM head. Deeper names split the MLP's backward unreliably
# (see MeasuredFlops).
_BREAKDOWN_MODULE = re.compile(r"ToyLM\.(embed|lm_head|blocks\.\d+\.(attn|mlp))")

# The conventions perf/* logs, and under which tag.
_CONVENTION_TAGS = {"6n": "perf/mfu_6n", "palm": "perf/mfu", "causal": "perf/mfu_causal", "hfu": "perf/hfu"}


def closed_form(run: Run, dry: StepLedger | None, accumulate: int = 1) -> Figures:
    """The toy LM's closed forms for one optimizer step of `accumulate` micro-batches.

    Under tensor parallelism they are absent, each row saying why: the lecture's formulas shard nothing over TP
    (a TP rank holds part of each layer and saves other activations), and a wrong figure is worse than none."""
    if run.tensor_parallel > 1:
        why = f"n/a: the closed forms do not model tensor parallelism ({run.tensor_parallel}); the dry run does"
        rows = ("params", "grads", "optimizer", "activations", "peak", "flops_hardware", "flops_model")
        return Figures(why_missing=dict.fromkeys(rows, why))
    p = predict(run)
    why: dict[str, str] = {}
    peak = p.peak
    if peak is not None and dry is not None:
        peak += dry.buffers + dry.batch
    if p.peak is None:
        why = {"activations": f"n/a: {p.unmodelled}", "peak": f"n/a: {p.unmodelled}"}
    elif accumulate > 1:
        peak, why = None, {"peak": "n/a: the closed forms model one micro-batch per step"}
    copies = p.autocast_weight_copies if p.autocast_weight_copies else None
    return Figures(
        params=p.params, grads=p.grads, optimizer=p.optimizer, activations=p.activations,
        autocast_weight_copies=copies, peak=peak, peak_phase=p.peak_phase if peak is not None else None,
        flops_hardware=p.flops_hardware * accumulate, flops_model=p.flops_model * accumulate, why_missing=why,
    )  # fmt: skip


def closed_form_note(figures: Figures, buffers: bool = True) -> str:
    """The table's note on the closed-form column: what it is, and why its activations or peak are absent."""
    note = "closed form: the lecture's formulas" + (" (its peak plus the buffers and the batch)" if buffers else "")
    why = figures.why_missing.get("peak")
    if figures.peak is None and why:
        lines = "activations and peak" if figures.activations is None else "peak"
        note += f"; its {lines} {why}"
    return note


def flops_by_convention(run: Run) -> dict[str, int]:
    """FLOPs of one training batch under the conventions perf/* logs ("model" is PaLM's: perf/mfu)."""
    report = analytic_flops(run.config, run.batch_size, run.seq_len, training=True)
    return {"model": report.model, "hardware": report.hardware, "6n": report.model_6n, "causal": report.model_causal}


def validation_flops(run: Run, shape: tuple[int, int]) -> dict[str, int]:
    """flops/val/*: model, hardware and counted (meta copy) FLOPs of a forward-only batch of `shape`."""
    analytic = analytic_flops(run.config, *shape, training=False)
    counted = count_flops_meta(run.config, *shape, training=False)
    return {
        "flops/val/model_per_batch": analytic.model,
        "flops/val/hardware_per_batch": analytic.hardware,
        "flops/val/measured_per_batch": counted.total,
    }


def summary_rows(run: Run, predicted: Figures) -> list[list[str]]:
    """The ledger/summary card: what the run's hyperparameters cost, per device."""
    n_params, n_matmul = count_parameters(run.config), matmul_parameters(run.config)
    peak = "n/a" if predicted.peak is None else f"{predicted.peak:,}"
    setup = f"{run.precision}, {run.optimizer}, {run.strategy}"
    model, hardware = predicted.flops_model, predicted.flops_hardware
    return [
        ["parameters", f"{n_params:,}", f"{format_count(n_params)}; {format_count(n_matmul)} in matmuls"],
        [
            "tokens per batch",
            f"{run.tokens_per_batch:,}",
            f"{run.batch_size} x {run.seq_len} on each of {run.world_size}",
        ],
        ["predicted peak memory", peak, f"{format_bytes(predicted.peak)} per device ({setup})"],
        ["model FLOPs per step", f"{model:,}", f"{format_count(model)} (6N + attention, per device)"],
        ["hardware FLOPs per step", f"{hardware:,}", f"{format_count(hardware)} (with recompute)"],
    ]


def flop_breakdown(cfg, shape: tuple[int, int]) -> str:
    """The flops/breakdown text for one training batch of `shape`.

    Analytic FLOPs by component. FlopCounterMode's by module and op, on a meta copy.
    What each MFU convention counts."""
    analytic = analytic_flops(cfg, *shape, training=True)
    measured = count_flops_meta(cfg, *shape, training=True)
    batch, seq = shape
    phases = ("forward", "backward", "recompute")
    rows = [
        [name, *(format_count(by_phase[p]) for p in phases), format_count(sum(by_phase.values()))]
        for name, by_phase in analytic.by_component.items()
    ]
    rows.append(["**hardware total**", "", "", "", format_count(analytic.hardware)])
    rows.append(["**model (MFU convention)**", "", "", "", format_count(analytic.model)])
    parts = [
        f"One training batch of {batch} x {seq} tokens on one device. Analytic, by component "
        "(summed over layers; FLOPs):",
        markdown_table(["component", *phases, "total"], rows),
    ]
    shown = {name: n for name, n in measured.by_module.items() if _BREAKDOWN_MODULE.fullmatch(name)}
    module_rows = [[name, format_count(n)] for name, n in shown.items()]
    unattributed = measured.total - sum(shown.values())
    if unattributed:
        module_rows.append(["(not attributed to a module)", format_count(unattributed)])
    module_rows.append(["**measured total**", format_count(measured.total)])
    parts += [
        "Measured with FlopCounterMode on a meta-device copy, by module (forward + backward):",
        markdown_table(["module", "FLOPs"], module_rows),
        "By operator:",
        markdown_table(["op", "FLOPs"], [[op, format_count(n)] for op, n in sorted(measured.by_op.items())]),
        "What each MFU convention counts for this batch (docs/mfu.md):",
        markdown_table(["convention", "FLOPs", "vs perf/mfu", "tag"], _convention_rows(cfg, shape)),
    ]
    return "\n\n".join(parts)


def _convention_rows(cfg, shape: tuple[int, int]) -> list[list[str]]:
    """One row per MFU convention: FLOPs of a training batch of `shape`, ratio to perf/mfu's, tag."""
    batch, seq = shape
    per_token = flops_per_token_by_convention(cfg, seq)
    return [
        [
            MFU_CONVENTIONS[key],
            format_count(n * batch * seq),
            f"{n / per_token['palm'] - 1:+.3%}",
            _CONVENTION_TAGS.get(key, "(not logged)"),
        ]
        for key, n in per_token.items()
    ]
