"""One training step of a fit config, accounted: predicted, measured, MFU by convention, time, per rank.

`lmledger account` prints it; `plan max-batch`, `plan train-time --config` and `sweep --dry-run` reuse it.
    step.py       one device: the toy LM's dry run (the main column) beside its closed forms, or any
                  LightningModule's dry run; with --measure the real step, MFU and the step-time table
    scale.py      one rank at the config's world size and strategy (ledger.sharding.atscale), its table
    steptime.py   the step time predicted before anything runs (ledger.timing.steptime)
    traintime.py  `plan train-time --config`: the days to train at that step time
    reporting.py  a result as the one Report, the table and the JSON shape (docs/commands.md)
"""

from __future__ import annotations

from lmledger.accounting.reporting import ledger_json, ledger_report
from lmledger.accounting.scale import (
    AC_LABELS,
    any_model_at_scale,
    at_scale,
    per_rank,
    print_any_model_at_scale,
    print_per_rank,
    scale_links,
    traced_at_scale,
    trainer_scale,
)
from lmledger.accounting.step import account, account_any_model, account_module
from lmledger.accounting.steptime import predicted_step_time
from lmledger.accounting.traintime import train_time_from_config

__all__ = [
    "AC_LABELS", "account", "account_any_model", "account_module", "any_model_at_scale", "at_scale", "ledger_json",
    "ledger_report", "per_rank", "predicted_step_time", "print_any_model_at_scale", "print_per_rank", "scale_links",
    "traced_at_scale", "train_time_from_config", "trainer_scale",
]  # fmt: skip
