"""The prediction for any model from its config, before anything runs: what `account` and `plan max-batch`
call for a module that is not lmledger's ToyLM (the toy LM keeps its closed forms, ledger.memory/flops).

A LightningModule is used by duck typing only (no Lightning import): its `training_step(batch, batch_idx)`
is the step and its `configure_optimizers()` the optimizer, as Lightning's automatic optimization runs
them. The prediction is dryrun.dry_run on the shapes of one real batch; `measure` is the same two steps
on real tensors (dryrun.measure_step), the prediction's twin.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.dryrun import (
    LargestBatch,
    NotTraced,
    StepLedger,
    batch_tensors,
    dry_run,
    largest_batch,
    loss_of,
    map_tensors,
    measure_step,
)


def _no_log(*args, **kwargs) -> None:
    return None


def module_step(module: nn.Module, batch: object) -> torch.Tensor:
    """One call of the module's training_step (batch_idx 0), its loss as Lightning takes it (a tensor, or a
    dict's 'loss'). `self.log` is silenced on the module it runs on (a copy: there is no trainer to log to)."""
    module.log = module.log_dict = _no_log
    return loss_of(module.training_step(batch, 0))


def configured_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """The one torch optimizer a LightningModule's configure_optimizers returns, in any of the forms Lightning
    accepts (an optimizer, a dict with 'optimizer', a list or tuple whose first item is one or a list of them);
    None when it configures none. More than one is a UserError: the dry run models a single optimizer step."""
    configure = getattr(module, "configure_optimizers", None)
    configured = configure() if callable(configure) else None
    found: list[torch.optim.Optimizer] = []

    def collect(item: object) -> None:
        if isinstance(item, torch.optim.Optimizer):
            found.append(item)
        elif isinstance(item, Mapping):
            collect(item.get("optimizer"))
        elif isinstance(item, (list, tuple)) and item:
            # ([optimizers], [schedulers]) or [opt, ...] or [{"optimizer": ...}, ...]
            first = item[0]
            for part in first if isinstance(first, (list, tuple)) else item:
                if isinstance(part, (torch.optim.Optimizer, Mapping)):
                    collect(part)

    collect(configured)
    if len(found) > 1:
        raise UserError(
            f"{type(module).__name__}.configure_optimizers returns {len(found)} optimizers; the prediction models "
            "one optimizer step (measure such a module with `lmledger fit`)"
        )
    return found[0] if found else None


def resized(batch: object, size: int) -> object:
    """The batch's shapes with `size` samples: every tensor's first dimension becomes `size` (meta tensors,
    nothing allocated). The batch dimension comes first, as in the ledger's samples rule."""
    if not batch_tensors(batch):
        raise UserError(
            f"a {type(batch).__name__} batch holds no tensor: the prediction reads batch shapes from tensors "
            "(a tensor, or tuples, lists or dicts of them)"
        )

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return torch.empty((), dtype=t.dtype, device="meta")
        return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")

    return map_tensors(resize, batch)


def predict(
    module: nn.Module,
    batch: object,
    *,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
) -> StepLedger | NotTraced:
    """The dry-run ledger of one training step of `module` on `batch`'s shapes, with its own optimizer."""
    return dry_run(
        module, batch, step=module_step, optimizer=configured_optimizer(module), precision=precision, device=device
    )


def measure(module: nn.Module, batch: object, *, precision: str | int = "32-true") -> StepLedger:
    """predict's measured twin: the same two steps on a copy of the module and the real batch."""
    real = copy.deepcopy(module)
    return measure_step(real, batch, step=module_step, optimizer=configured_optimizer(real), precision=precision)


def max_batch(
    module: nn.Module,
    batch: object,
    capacity_bytes: int,
    *,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
    limit: int = 1 << 16,
) -> LargestBatch | NotTraced:
    """The largest number of samples per batch whose predicted peak fits capacity_bytes (dryrun.largest_batch
    over batches shaped like `batch`)."""
    batch_for: Callable[[int], object] = lambda size: resized(batch, size)  # noqa: E731
    return largest_batch(
        module,
        batch_for,
        capacity_bytes,
        step=module_step,
        optimizer=configured_optimizer(module),
        precision=precision,
        device=device,
        limit=limit,
    )


def parameter_count(module: nn.Module) -> int:
    """Parameters, each shared tensor once (Module.parameters() already yields a tied weight once)."""
    return sum(p.numel() for p in module.parameters())
