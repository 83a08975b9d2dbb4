"""What the dry run and its callers share: a step's ledger, the phases it is tracked in, the optimizer and
step types, and the collector switch the tracked step runs under.

Its own module so that the engine (dryrun), manual optimization (manualopt), the fake copy (fakecopy) and
the MoE bounds (moebounds) import it and not each other.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lmledger.ledger.count.ops import OpSummary

__all__ = ["PHASES", "LargestBatch", "NotTraced", "OptimizerSpec", "StepFn", "StepLedger", "no_cyclic_gc", "phases"]

StepFn = Callable[[nn.Module, object], torch.Tensor]
OptimizerSpec = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None

PHASES = ("forward", "backward", "optimizer step")
# Under gradient accumulation (k micro-batches per optimizer step) the phases are the micro-batches: the
# first (the previous step's grads alive through its forward, freed by zero_grad before its backward), the
# later ones (grads alive and accumulating throughout), and the optimizer step.
_ACCUMULATION_PHASES = ("first micro-batch", "later micro-batches", "optimizer step")


def phases(accumulate: int = 1) -> tuple[str, ...]:
    """The phase names a step of `accumulate` micro-batches is tracked in (dry run and live alike)."""
    return PHASES if accumulate == 1 else _ACCUMULATION_PHASES


@dataclass(frozen=True)
class StepLedger:
    """Bytes and FLOPs of one steady-state training (optimizer) step, dry or measured.

    `phase_peaks` holds the high-water mark of live tensor bytes per phase. The phases are "forward",
    "backward" and "optimizer step". Backward includes zero_grad: it only frees. Under accumulation the
    phases are `phases(k)`. `peak` is the largest, reached in `peak_phase`. Everything live before the step
    counts: params, grads, optimizer state, buffers and the batch. FLOPs cover every micro-batch of the
    step. `activations` is what one micro-batch saves.
    """

    params: int
    grads: int
    optimizer: int
    buffers: int
    batch: int
    activations: int
    autocast_weight_copies: int
    peak: int
    peak_phase: str
    phase_peaks: dict[str, int]
    flops_forward: int
    flops_backward: int
    flops_by_op: dict[str, int] = field(default_factory=dict)
    ops: OpSummary | None = None  # step 1's ops: FLOPs, bytes, category (ledger/count/ops.py; the roofline reads it)

    @property
    def flops(self) -> int:
        """Hardware FLOPs of the step (forward + backward, recompute included)."""
        return self.flops_forward + self.flops_backward


@dataclass(frozen=True)
class NotTraced:
    """The dry run could not run the model on fake tensors; `reason` is one line saying why."""

    reason: str


@dataclass(frozen=True)
class LargestBatch:
    """The largest batch size whose dry-run peak fits.

    `fits` is its ledger: None when size is 0 (not even one sample fits). `over` is the ledger of
    size + 1: None when the search hit `limit`.
    """

    size: int
    fits: StepLedger | None
    over: StepLedger | None


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector off for the tracked step.

    A step can leave tensors in reference cycles. FlopCounterMode's module hooks made such cycles in step 1.
    With the collector off, those tensors are freed at the same point in every run. Otherwise they go
    wherever a collection happens to fall. The peak is then the one without its help.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
