"""The FLOP ledger during a fit: FLOPs of a training batch and of a validation batch, on paper and counted.

Once per batch shape (not per step), three figures (lmledger.ledger.flops):
- model FLOPs, the MFU convention (6·N_matmul + 12·L·H·Q·T per token; forward only for validation);
- hardware FLOPs, what the kernels do (attention's score recompute, activation checkpointing);
- measured FLOPs, FlopCounterMode's count of one step of a meta-device copy of the model.

The count runs on the meta device (measure_flops_meta): shapes only, so it spends no real compute,
touches neither the model's gradients nor any RNG, works under Lightning's inference_mode during
validation, and sees the eager model even when the step is torch.compile'd. It is exact: the flops
module routes meta SDPA to the fused kernel's formula and its tests hold the meta count equal to a
real CPU count op for op.

Logged: `flops/{model,hardware,measured}_per_step` (one training batch of one device) and
`flops/val/{model,hardware,measured}_per_batch`, plus the per-component and per-module breakdown
once as text (`flops/breakdown`), with the FLOPs each MFU convention counts and its TensorBoard tag.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import torch

from lmledger.callbacks.run import LedgerRun, log_scalars, log_text, markdown_table
from lmledger.ledger.flops import (
    MFU_CONVENTIONS,
    FlopReport,
    MeasuredFlops,
    analytic_flops,
    flops_per_token_by_convention,
    measure_flops_meta,
)
from lmledger.ledger.units import format_count

# FlopCounterMode module names shown in the breakdown: the embedding, each block's attention and
# MLP (their norms do no matmul), the LM head. Deeper names split the MLP's backward unreliably
# (see MeasuredFlops).
_BREAKDOWN_MODULE = re.compile(r"ToyLM\.(embed|lm_head|blocks\.\d+\.(attn|mlp))")

# The conventions ThroughputLedger logs, and under which tag.
CONVENTION_TAGS = {"6n": "perf/mfu_6n", "palm": "perf/mfu", "causal": "perf/mfu_causal", "hfu": "perf/hfu"}


def batch_shape(batch) -> tuple[int, int]:
    """(batch, seq) of a batch of token ids, or of the first tensor of an (inputs, targets) pair."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise TypeError(f"expected (batch, seq) token ids, got {type(tokens).__name__}")
    return int(tokens.shape[0]), int(tokens.shape[1])


def flops_per_batch(run: LedgerRun, shape: tuple[int, int], training: bool) -> FlopReport:
    return analytic_flops(run.config, *shape, training=training)


class FlopLedger(pl.Callback):
    """Analytic and measured FLOPs per training and validation batch, counted once per shape."""

    def __init__(self) -> None:
        self.run: LedgerRun | None = None
        self.train: dict[tuple[int, int], tuple[FlopReport, MeasuredFlops]] = {}
        self.val: dict[tuple[int, int], tuple[FlopReport, MeasuredFlops]] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run = LedgerRun.from_trainer(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        shape = batch_shape(batch)
        if shape in self.train:
            return
        analytic, measured = self._count(shape, training=True)
        self.train[shape] = analytic, measured
        log_scalars(
            trainer,
            {
                "flops/model_per_step": analytic.model,
                "flops/hardware_per_step": analytic.hardware,
                "flops/measured_per_step": measured.total,
            },
        )
        if len(self.train) == 1:
            log_text(trainer, "flops/breakdown", self._breakdown(shape, analytic, measured))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.run is None:  # `validate` rather than `fit`: no ledger
            return
        shape = batch_shape(batch)
        if shape in self.val:
            return
        analytic, measured = self._count(shape, training=False)
        self.val[shape] = analytic, measured
        log_scalars(
            trainer,
            {
                "flops/val/model_per_batch": analytic.model,
                "flops/val/hardware_per_batch": analytic.hardware,
                "flops/val/measured_per_batch": measured.total,
            },
        )

    def _count(self, shape: tuple[int, int], training: bool) -> tuple[FlopReport, MeasuredFlops]:
        measured = measure_flops_meta(self.run.config, *shape, training=training)
        return flops_per_batch(self.run, shape, training), measured

    def _breakdown(self, shape: tuple[int, int], analytic: FlopReport, measured: MeasuredFlops) -> str:
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
            markdown_table(["convention", "FLOPs", "vs perf/mfu", "tag"], convention_rows(self.run.config, shape)),
        ]
        return "\n\n".join(parts)


def convention_rows(cfg, shape: tuple[int, int]) -> list[list[str]]:
    """One row per MFU convention: FLOPs of a training batch of `shape`, ratio to perf/mfu's, tag."""
    batch, seq = shape
    per_token = flops_per_token_by_convention(cfg, seq)
    return [
        [
            MFU_CONVENTIONS[key],
            format_count(n * batch * seq),
            f"{n / per_token['palm'] - 1:+.3%}",
            CONVENTION_TAGS.get(key, "(not logged)"),
        ]
        for key, n in per_token.items()
    ]
