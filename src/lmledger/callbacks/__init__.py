"""Lightning callbacks that keep the ledger during a fit: thin adapters over lmledger.ledger.

    Ledger            the whole ledger in one callback, for LitLM and any LightningModule alike
                      (ledger.py): `Trainer(callbacks=[Ledger()])`
    LedgerSettings    its settings, validated in one place (settings.py); `--ledger.*` on the CLI
    NonFiniteGuard    drops a step whose gradients are not finite (nonfinite.py)

The rest are the Ledger's parts:
    dryrun.py      what the dry run is given for a live module: its batch, one rank's step (one device, DDP)
    fsdp2.py       the same under FSDP2, on a meta copy kept at setup
    measure.py     the measured twin of the dry run
    timing.py      the time ledger (TimeLedger), fed the same dry run
    closedform.py  the toy LM's closed forms and cards
    preflight.py   what a device holds
    peak_flops.py  the peak, compile speedup
    progress.py    plain progress lines off a terminal
    trainer_io.py  reading the live Trainer, writing to loggers
The callbacks never change what is trained. Counting runs on fake or meta copies.
Measurement only observes. The RNG streams are left as they were found.
"""

from __future__ import annotations

import lightning.pytorch as pl

import lmledger.strategies  # noqa: F401  registers "fsdp2": Trainer(strategy="fsdp2") beside Trainer(callbacks=[Ledger()])
from lmledger.callbacks.ledger import Ledger
from lmledger.callbacks.settings import LedgerSettings

__all__ = ["Ledger", "LedgerSettings", "ledger_callbacks"]


def ledger_callbacks(settings: LedgerSettings) -> list[pl.Callback]:
    """The ledger's callbacks for one run: `[Ledger(settings)]`, or none when the ledger is disabled."""
    return [Ledger(settings=settings)] if settings.enabled else []
