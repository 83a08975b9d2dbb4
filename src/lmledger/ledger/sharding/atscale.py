"""Sizing at scale: one rank's peak and largest micro-batch at a run's world size and strategy.

Both come with the model as it is and with every block checkpointed. They are ledger.sharding.sharded's dry run.
Each case is a RankCase: the one row type (ledger.report.Figures) and what only a rank at scale has (its
communication buffers and buckets, its collectives' seconds, its largest micro-batch). `lmledger account` and
`lmledger plan` print them. Pure torch: no Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.dryrun.engine import NotTraced, OptimizerSpec, StepFn
from lmledger.ledger.hardware.interconnect import Links, communication
from lmledger.ledger.predict import toy_optimizer
from lmledger.ledger.report import Figures
from lmledger.ledger.sharding.ddp import DDPSettings
from lmledger.ledger.sharding.fsdp2 import DEFAULT_FSDP, FSDPSettings
from lmledger.ledger.sharding.sharded import largest_batch_sharded, predict_sharded
from lmledger.ledger.timing.roofline import with_ddp_allreduce
from lmledger.ledger.units import MEMORY_ROWS

__all__ = ["AtScale", "RankCase", "at_scale", "toy_at_scale", "sharded_strategy_name", "toy_inputs"]

_DEFAULT_DDP = DDPSettings()


@dataclass(frozen=True)
class RankCase:
    """One rank's step at scale in one checkpointing case.

    figures      its rows, as every ledger table has them: bytes per rank, and the rank's FLOPs (hardware: forward
                 and backward as the kernels do them; model: 3 x the forward, as a fit's dry run counts them)
    not_predicted    why the dry run cannot model the case (then the figures say it for every row), else None
    max_batch    the largest micro-batch per rank under a capacity (None: none asked, or not traced), and its peak;
                 at 0, by how many bytes one sample per rank is over"""

    figures: Figures
    comm_buffers: int | None = None  # DDP's buckets, FSDP2's gathered blocks
    buckets: int = 0
    flops_forward: int | None = None
    flops_backward: int | None = None
    peak_checked: bool = False  # the sharded peak has been held to a real rank's (on a GPU, or by gloo ranks)
    communication: dict | None = None  # interconnect.communication, where links were given
    not_predicted: str | None = None
    max_batch: int | None = None
    max_batch_peak: int | None = None
    over_by_at_batch_1: int | None = None
    # the rank's step as the GPU op model prices it (ledger/timing/gpu): its ops and DDP's buckets (bytes, dtype)
    ops: object = field(default=None, compare=False, repr=False)
    bucket_sizes: tuple[tuple[int, str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def missing(cls, why: str) -> RankCase:
        return cls(Figures(why_missing=dict.fromkeys((*MEMORY_ROWS, "flops_hardware"), why)), not_predicted=why)

    def answer_peak(self, capacity_bytes: int) -> int | None:
        """The peak beside plan's answer: at the largest micro-batch, or where not even one sample fits, at one."""
        if self.max_batch == 0 and self.over_by_at_batch_1 is not None:
            return capacity_bytes + self.over_by_at_batch_1
        return self.max_batch_peak

    def to_json(self, sized: bool) -> dict:
        """The case in `per_rank.cases` of the one JSON shape (docs/commands.md); `sized`: a capacity was given."""
        if self.not_predicted:
            return {"not_predicted": self.not_predicted}
        f = self.figures
        out = {"params": f.params, "grads": f.grads, "optimizer": f.optimizer, "activations": f.activations,
               "peak": f.peak, "peak_phase": f.peak_phase, "comm_buffers": self.comm_buffers,
               "buckets": self.buckets, "flops_forward": self.flops_forward, "flops_backward": self.flops_backward,
               "peak_checked": self.peak_checked, "not_predicted": None,
               "communication": self.communication}  # fmt: skip
        if sized:
            out.update(max_batch=self.max_batch, max_batch_peak=self.max_batch_peak,
                       over_by_at_batch_1=self.over_by_at_batch_1)  # fmt: skip
        return out


@dataclass(frozen=True)
class AtScale:
    """One rank of a run at its world size and strategy, per checkpointing case (at_scale)."""

    strategy: str
    world_size: int
    batch_size: int  # per rank
    capacity_bytes: int | None = None
    tensor_parallel: int = 1
    cases: dict[str, RankCase] = field(default_factory=dict)

    @property
    def configured(self) -> RankCase:
        """The first case: the model as it is configured."""
        return next(iter(self.cases.values()))

    def to_json(self) -> dict:
        sized = self.capacity_bytes is not None
        return {"strategy": self.strategy, "world_size": self.world_size, "tensor_parallel": self.tensor_parallel,
                "batch_size": self.batch_size, "capacity_bytes": self.capacity_bytes,
                "cases": {label: case.to_json(sized) for label, case in self.cases.items()}}  # fmt: skip


def sharded_strategy_name(strategy: str) -> str:
    """predict_sharded's name for a ledger.run strategy name (ledger.run.sharding)."""
    return "ddp" if strategy in ("ddp", "auto", "single_device") else strategy


def toy_inputs(run) -> tuple[nn.Module, Callable[[int], object], OptimizerSpec]:
    """A ledger.run.Run of lmledger's ToyLM, as the dry run takes it.

    The model is on the meta device, so nothing is allocated. Its activation checkpointing is off: at_scale
    adds it. The batch is a meta batch of b windows. The optimizer is LitLM's (predict.toy_optimizer).
    """
    from lmledger.model import ToyLM

    with torch.device("meta"):
        model = ToyLM(dataclasses.replace(run.config, activation_checkpointing=0))

    def batch_for(size: int) -> object:
        ids = torch.empty((size, run.seq_len), dtype=torch.long, device="meta")
        return ids, ids.clone()

    return model, batch_for, toy_optimizer(run)


def at_scale(
    module: nn.Module,
    batch_for: Callable[[int], object],
    batch_size: int,
    *,
    strategy: str,
    world_size: int,
    capacity_bytes: int | None = None,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    ddp: DDPSettings = _DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
    labels: tuple[str, str] = ("as configured", "every block checkpointed"),
    links: Links | None = None,
    manual: bool = False,
) -> AtScale:
    """One rank's ledger at `batch_size` per rank and, given a capacity, its largest micro-batch.

    Both come with the model as it is (labels[0]) and with every block checkpointed (labels[1]). A case the dry
    run cannot model says why (RankCase.not_predicted) instead of giving numbers. Given `links`, each case prices
    its collectives on them too (interconnect.communication).
    """
    name = sharded_strategy_name(strategy)
    cases = {}
    for label, ac in zip(labels, (None, True), strict=True):
        kwargs = dict(step=step, optimizer=optimizer, precision=precision, strategy=name, world_size=world_size,
                      ddp=ddp, fsdp=fsdp, activation_checkpointing=ac, manual=manual)  # fmt: skip
        try:
            ledger = predict_sharded(module, batch_for(batch_size), **kwargs)
        except UserError as err:  # e.g. a precision the dry run does not cover: the run is measured only
            ledger = NotTraced(str(err))
        if isinstance(ledger, NotTraced):
            cases[label] = RankCase.missing(ledger.reason)
            continue
        forward, backward = ledger.flops_forward, ledger.flops_backward
        figures = Figures(
            params=ledger.params, grads=ledger.grads, optimizer=ledger.optimizer, activations=ledger.activations,
            peak=ledger.peak, peak_phase=ledger.peak_phase,
            flops_hardware=None if forward is None else forward + backward,
            flops_model=None if forward is None else 3 * forward,
        )  # fmt: skip
        sized = {}
        if capacity_bytes is not None:
            found = largest_batch_sharded(module, batch_for, capacity_bytes, limit=1 << 12, **kwargs)
            if not isinstance(found, NotTraced):
                over = found.over.peak - capacity_bytes if found.size == 0 else None  # not even one sample fits
                sized = {"max_batch": found.size, "max_batch_peak": found.fits.peak if found.fits else None,
                         "over_by_at_batch_1": over}  # fmt: skip
        cases[label] = RankCase(
            figures, comm_buffers=ledger.comm_buffers, buckets=len(ledger.buckets), flops_forward=forward,
            flops_backward=backward, peak_checked=ledger.peak_checked,
            communication=links and communication(with_ddp_allreduce(ledger.ops, ledger), links, world_size),
            ops=ledger.ops, bucket_sizes=tuple((b.nbytes, b.dtype) for b in ledger.buckets), **sized,
        )  # fmt: skip
    return AtScale(name, world_size, batch_size, capacity_bytes, fsdp.tensor_parallel, cases)


def toy_at_scale(
    run, capacity_bytes: int | None = None, labels: tuple[str, str] = ("off", "on"), **settings: object
) -> AtScale:
    """The at_scale of a ledger.run.Run of lmledger's ToyLM (toy_inputs).

    It takes the run's world size, strategy, precision and optimizer, and the config's batch per rank.
    Checkpointing is off and on (labels). `settings` are at_scale's ddp and fsdp. A strategy name among them
    replaces the run's.
    """
    model, batch_for, optimizer = toy_inputs(run)
    settings.setdefault("strategy", run.strategy)
    return at_scale(
        model, batch_for, run.batch_size, world_size=run.world_size, optimizer=optimizer,
        precision=run.precision, capacity_bytes=capacity_bytes, labels=labels, **settings,
    )  # fmt: skip
