"""Lightning callbacks that keep the ledger during a fit: thin adapters over lmledger.ledger.

    MemoryLedger      predicted vs measured params / grads / optimizer / activations / peak (memory.py)
    FlopLedger        model, hardware and measured FLOPs per training and validation batch (flops.py)
    ThroughputLedger  tokens/s, TFLOP/s, MFU, HFU, data-wait share (throughput.py)
    PreflightGuard    stops a run whose predicted peak does not fit, before step 1 (preflight.py)
    LedgerSummary     the key numbers (params, peak, FLOPs/step) as one TensorBoard text (summary.py)
    Ledger            all of them in one callback for LitLM; for any other LightningModule a dry run
                      beside measurement (ledger.py): `Trainer(callbacks=[Ledger()])`

`ledger_callbacks(LedgerSettings(...))` builds them all; the CLI exposes the settings as `--ledger.*`.
The callbacks never change what is trained: counting runs on a meta-device copy, measurement only
observes (saved-tensor hooks, allocator statistics) and leaves the RNG streams as it found them.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl

from lmledger.callbacks.flops import FlopLedger
from lmledger.callbacks.ledger import Ledger
from lmledger.callbacks.memory import MemoryLedger
from lmledger.callbacks.preflight import PreflightGuard
from lmledger.callbacks.summary import LedgerSummary
from lmledger.callbacks.throughput import ThroughputLedger
from lmledger.errors import ConfigError

__all__ = [
    "FlopLedger",
    "Ledger",
    "LedgerSettings",
    "LedgerSummary",
    "MemoryLedger",
    "PreflightGuard",
    "ThroughputLedger",
    "ledger_callbacks",
]


@dataclass
class LedgerSettings:
    """Settings of the ledger callbacks (`--ledger.NAME value` on the command line).

    Args:
        enabled: keep the ledger during the run (false: no ledger callbacks at all).
        device_memory_gb: memory one device may use, in GB (1e9 bytes); the run stops before step 1
            if the predicted peak exceeds it. None: CUDA's free memory, or the RAM available on a CPU.
        warmup_steps: training batches at the start of each fit that perf/* leaves out (they hold the
            memory measurement, optimizer-state allocation and kernel autotuning).
        measure: measure memory on the first two steps beside the prediction (false: predictions only).
    """

    enabled: bool = True
    device_memory_gb: float | None = None
    warmup_steps: int = 3
    measure: bool = True

    def __post_init__(self) -> None:
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ConfigError(f"ledger.device_memory_gb must be positive, got {self.device_memory_gb}")
        if self.warmup_steps < 0:
            raise ConfigError(f"ledger.warmup_steps must be >= 0, got {self.warmup_steps}")


def ledger_callbacks(settings: LedgerSettings) -> list[pl.Callback]:
    """The ledger's callbacks for one run; an empty list when the ledger is disabled.

    PreflightGuard comes first so a run that cannot fit stops before anything else is done, and
    MemoryLedger last: the saved-tensor hooks it opens in on_train_batch_start must see only the
    training step, not the FLOP counter's meta-device step that FlopLedger runs in the same hook.
    """
    if not settings.enabled:
        return []
    return [
        PreflightGuard(device_memory_gb=settings.device_memory_gb),
        LedgerSummary(),
        FlopLedger(),
        ThroughputLedger(warmup_steps=settings.warmup_steps),
        MemoryLedger(measure=settings.measure),
    ]
