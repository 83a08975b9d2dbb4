"""Sizing at scale: one rank's peak and largest micro-batch at a run's world size and strategy.

Both come with the model as it is and with every block checkpointed. They are ledger.sharding.sharded's dry run.
`lmledger account` and `lmledger plan` print them. Pure torch: no Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.dryrun.engine import NotTraced, OptimizerSpec, StepFn
from lmledger.ledger.hardware.interconnect import Links, communication
from lmledger.ledger.predict import toy_optimizer
from lmledger.ledger.sharding.ddp import DDPSettings
from lmledger.ledger.sharding.fsdp2 import DEFAULT_FSDP, FSDPSettings
from lmledger.ledger.sharding.sharded import largest_batch_sharded, predict_sharded
from lmledger.ledger.timing.roofline import with_ddp_allreduce

__all__ = ["at_scale", "toy_at_scale", "sharded_strategy_name", "toy_inputs"]

_DEFAULT_DDP = DDPSettings()


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
) -> dict:
    """One rank's ledger at `batch_size` per rank and, given a capacity, its largest micro-batch.

    Both come with the model as it is (labels[0]) and with every block checkpointed (labels[1]). The result
    is a JSON-ready dict. A case the dry run cannot model carries `not_predicted` (one line) instead of
    numbers. Given `links`, each case prices its collectives on them too (interconnect.communication).
    """
    name = sharded_strategy_name(strategy)
    cases = {}
    for label, ac in zip(labels, (None, True), strict=True):
        kwargs = dict(step=step, optimizer=optimizer, precision=precision, strategy=name, world_size=world_size,
                      ddp=ddp, fsdp=fsdp, activation_checkpointing=ac)  # fmt: skip
        try:
            ledger = predict_sharded(module, batch_for(batch_size), **kwargs)
        except UserError as err:  # e.g. a precision the dry run does not cover: the run is measured only
            ledger = NotTraced(str(err))
        if isinstance(ledger, NotTraced):
            cases[label] = {"not_predicted": ledger.reason}
            continue
        case = {
            "params": ledger.params, "grads": ledger.grads, "optimizer": ledger.optimizer,
            "activations": ledger.activations, "peak": ledger.peak, "peak_phase": ledger.peak_phase,
            "comm_buffers": ledger.comm_buffers, "buckets": len(ledger.buckets),
            "flops_forward": ledger.flops_forward, "flops_backward": ledger.flops_backward,
            "peak_checked": ledger.peak_checked, "not_predicted": None,
            "communication": links and communication(with_ddp_allreduce(ledger.ops, ledger), links, world_size),
        }  # fmt: skip
        if capacity_bytes is not None:
            found = largest_batch_sharded(module, batch_for, capacity_bytes, limit=1 << 12, **kwargs)
            if isinstance(found, NotTraced):
                case["max_batch"], case["max_batch_peak"] = None, None
            else:
                case["max_batch"] = found.size
                case["max_batch_peak"] = found.fits.peak if found.fits else None
                # Not even one sample fits: by how much the smallest step is over.
                case["over_by_at_batch_1"] = found.over.peak - capacity_bytes if found.size == 0 else None
        cases[label] = case
    return {"strategy": name, "world_size": world_size, "tensor_parallel": fsdp.tensor_parallel,
            "batch_size": batch_size, "capacity_bytes": capacity_bytes, "cases": cases}  # fmt: skip


def toy_at_scale(
    run, capacity_bytes: int | None = None, labels: tuple[str, str] = ("off", "on"), **settings: object
) -> dict:
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
