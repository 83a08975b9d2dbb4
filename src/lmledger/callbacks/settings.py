"""The ledger's settings, validated in this one place (`--ledger.NAME value` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.closedform.napkin import device_memory_bytes

__all__ = ["LedgerSettings"]


@dataclass
class LedgerSettings:
    """Settings of the Ledger callback (`--ledger.NAME value` on the command line).

    Args:
        enabled: keep the ledger during the run (false: no ledger at all).
        device_memory_gb: memory one device may use, in GB (1e9 bytes); the run stops before step 1
            if the predicted peak exceeds it. None: CUDA's free memory, or the RAM available on a CPU.
        warmup_steps: training batches at the start of each fit that perf/* leaves out (they hold the
            memory measurement, optimizer-state allocation and kernel autotuning).
        measure: measure memory and FLOPs on the first two optimizer steps beside the prediction.
        profile_every: the time ledger profiles two training batches after the warm-up and the measured
            steps, then one every this many (0: those two only); see docs/time.md.
        time: keep the time ledger (the roofline bound beside profiled steps; false: none).
        intra_node: the link a GPU run's collectives cross inside a node (a key of ledger.hardware.interconnect's
            table such as nvlink4, or a rate such as 450GB/s); default the GPU's usual one (docs/time.md).
        inter_node: the link between nodes (ib-ndr, roce-400, 400Gb/s, ...); default the GPU's usual NIC.
    """

    enabled: bool = True
    device_memory_gb: float | None = None
    warmup_steps: int = 3
    measure: bool = True
    profile_every: int = 500
    time: bool = True
    intra_node: str | None = None
    inter_node: str | None = None

    def __post_init__(self) -> None:
        from lmledger.ledger.hardware.interconnect import resolve_interconnect

        for name, scope in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
            value = getattr(self, name)
            if value is not None:
                try:
                    resolve_interconnect(str(value), scope)
                except UserError as err:
                    raise ConfigError(f"ledger.{name}: {err}") from None
        if self.device_memory_gb is not None:
            device_memory_bytes(self.device_memory_gb)  # the check plan max-batch's --device-memory-gb shares
        for name in ("warmup_steps", "profile_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"ledger.{name} must be an integer >= 0, got {value!r}")
