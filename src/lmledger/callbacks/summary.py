"""The run's key ledger numbers on one TensorBoard text card (`ledger/summary`), written at fit start.

Lightning puts the hyperparameters in the HPARAMS tab; this card puts beside them what they cost:
parameter count, tokens per batch, predicted peak memory and FLOPs per training step. (Not as
HPARAMS metrics: Lightning writes the run's hparams experiment first, declaring only `hp_metric`,
and TensorBoard keeps the first declaration it reads.)
"""

from __future__ import annotations

import lightning.pytorch as pl
from rich.console import Console
from rich.table import Table

from lmledger.callbacks.memory import predict_memory
from lmledger.callbacks.run import LedgerRun, log_text, markdown_table
from lmledger.ledger.flops import analytic_flops, matmul_parameters
from lmledger.ledger.units import format_bytes, format_count
from lmledger.model import count_parameters


def summary_rows(run: LedgerRun) -> list[list[str]]:
    memory = predict_memory(run)
    flops = analytic_flops(run.config, run.batch_size, run.seq_len, training=True)
    n_params, n_matmul = count_parameters(run.config), matmul_parameters(run.config)
    peak = "n/a" if memory.peak is None else f"{memory.peak:,}"
    setup = f"{run.precision}, {run.optimizer}, {run.strategy}"
    return [
        ["parameters", f"{n_params:,}", f"{format_count(n_params)}; {format_count(n_matmul)} in matmuls"],
        [
            "tokens per batch",
            f"{run.tokens_per_batch:,}",
            f"{run.batch_size} x {run.seq_len} on each of {run.world_size}",
        ],
        ["predicted peak memory", peak, f"{format_bytes(memory.peak)} per device ({setup})"],
        ["model FLOPs per step", f"{flops.model:,}", f"{format_count(flops.model)} (6N + attention, per device)"],
        ["hardware FLOPs per step", f"{flops.hardware:,}", f"{format_count(flops.hardware)} (with recompute)"],
    ]


class LedgerSummary(pl.Callback):
    """The card above, also printed at fit start: it stands in for Lightning's model summary, whose
    FLOPs column reads 0 without an example input (and would miss CPU attention if given one)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run = LedgerRun.from_trainer(trainer, pl_module)
        rows = summary_rows(run)
        log_text(trainer, "ledger/summary", markdown_table(["", "value", ""], rows))
        if trainer.is_global_zero:
            table = Table(title="ledger", show_header=False)
            table.add_column(style="bold")
            table.add_column(justify="right")
            table.add_column()
            for row in rows:
                table.add_row(*row)
            Console().print(table)
