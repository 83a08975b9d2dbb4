"""The live FSDP2 fit's prediction: Lightning's ModelParallelStrategy, `fully_shard` in configure_model.

Lightning calls callbacks' `setup` before the module's `configure_model` (canary in
tests/callbacks/test_ledger_fsdp2.py). So at setup the Ledger keeps `unsharded_copy`. In it, every parameter,
buffer and tensor attribute is on the meta device. It uses no memory.

At the first batch, `predict_fsdp2_rank` dry-runs one rank's step on it. It calls
ledger.sharding.sharded.predict_sharded at the mesh's data-parallel size, with:

    FSDP2       the module's own configure_model, replayed on the fake copy. Its mesh spans torch's
                fake process group (beside the real one), with the strategy's dimension names.
    optimizer   the same kind and groups as configure_optimizers made over the real shards

Gradient accumulation and manual optimization are predicted as Lightning runs them here. Every
micro-batch's backward (every manual_backward) reduce-scatters. The reason: its block_backward_sync
is ParallelStrategy's, a no-op for an FSDPModule (canary in tests/ledger/test_fsdp2_accumulate.py). A step's
own set_requires_gradient_sync runs on the fake copy too.

Tensor parallelism (a mesh with tensor_parallel_size > 1) is predicted too: the fake mesh is then a
2-D (data_parallel x tensor_parallel) one of fake groups beside the real ones, and configure_model's own
TP plan runs on it (Lightning's TP-tutorial form: parallelize_module over device_mesh["tensor_parallel"],
then fully_shard over device_mesh["data_parallel"]). A GPU run gets one line: it is measured only.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lmledger.callbacks.trainer_io import torch_optimizers, untouched_rng
from lmledger.errors import UserError
from lmledger.ledger.dryrun.engine import NotTraced, StepLedger
from lmledger.ledger.predict import lightning_step
from lmledger.ledger.sharding import sharded
from lmledger.ledger.sharding.rankstate import optimizer_factory

__all__ = ["predict_fsdp2_rank", "unsharded_copy"]

# Data a module may hold, not state: the copy shares them (deepcopy would read them whole).
_SHARED = (torch.utils.data.Dataset, torch.utils.data.DataLoader)


def unsharded_copy(trainer: pl.Trainer, pl_module: pl.LightningModule) -> nn.Module | None:
    """Under ModelParallelStrategy, before configure_model: a deep copy of `pl_module`.

    Its parameters, buffers and tensor attributes are meta twins: shapes and dtypes, no memory. None under
    any other strategy.
    """
    if not isinstance(trainer.strategy, ModelParallelStrategy):
        return None
    memo: dict[int, object] = {id(trainer): trainer, id(pl_module._device_mesh): None}
    for module in pl_module.modules():
        for value in vars(module).values():
            if isinstance(value, _SHARED):
                memo[id(value)] = value
        tensors = [*module._parameters.values(), *module._buffers.values()]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and id(t) not in memo:
                twin = torch.empty_like(t.detach(), device="meta")
                memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    return copy.deepcopy(pl_module, memo)


def mesh_sizes(trainer: pl.Trainer) -> tuple[int, int]:
    """(data-parallel, tensor-parallel) sizes of ModelParallelStrategy's mesh."""
    mesh = trainer.strategy.device_mesh
    return mesh["data_parallel"].size(), mesh["tensor_parallel"].size()


def predict_fsdp2_rank(
    trainer: pl.Trainer, pl_module: pl.LightningModule, unsharded: nn.Module | None, batch: object, batch_idx: int,
    accumulate: int = 1,
) -> StepLedger | NotTraced:  # fmt: skip
    """One rank's step under the live ModelParallelStrategy (module docstring), or why there is none."""
    why = _not_modelled(trainer, pl_module, unsharded)
    if why is not None:
        return NotTraced(why)
    with untouched_rng(pl_module.device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            arguments = _fsdp2_arguments(trainer, pl_module, batch_idx, accumulate)
            return sharded.predict_sharded(unsharded, batch, **arguments)
        except UserError as err:
            return NotTraced(str(err))


def _fsdp2_arguments(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int, accumulate: int) -> dict:
    """predict_sharded's arguments for one rank of this ModelParallelStrategy trainer.

    Among them:

        world_size    the mesh's size: data parallel x tensor parallel
        fsdp          the module's configure_model, replayed
        optimizer     the same optimizers over the fake shards
        accumulate    micro-batches; each one's backward reduce-scatters, as Lightning runs FSDP2
        manual        the module's own manual step instead
    """
    manual = not pl_module.automatic_optimization
    made = [_same_optimizer(o, pl_module) for o in torch_optimizers(trainer)]
    data, tensor = mesh_sizes(trainer)
    settings = sharded.FSDPSettings(shard=_replay_configure_model(trainer), tensor_parallel=tensor)
    return dict(
        step=lightning_step(batch_idx, trainer), optimizer=made if manual else (made[0] if made else None),
        precision=str(trainer.precision), strategy="fsdp2", world_size=data * tensor, fsdp=settings,
        device=pl_module.device, accumulate=accumulate, manual=manual,
    )  # fmt: skip


def _not_modelled(trainer, pl_module, unsharded) -> str | None:
    if pl_module.device.type != "cpu":  # ledger.sharding.sharded runs FSDP2 on a CPU mesh; not yet held to a GPU's peak
        return f"the FSDP2 dry run runs on a CPU mesh, not yet on {pl_module.device.type}"
    if unsharded is None:
        return "the Ledger joined after configure_model had sharded the module: no unsharded copy to dry-run"
    return None


def _same_optimizer(optimizer: torch.optim.Optimizer, pl_module: nn.Module) -> Callable:
    """A factory making `optimizer`'s kind over the fake copy's sharded parameters (rankstate.optimizer_factory).

    Each group's parameters are found by position in the module: configure_model keeps the order. Each
    group keeps its hyperparameters. An optimizer over tensors outside the module is refused.
    """
    position = {id(p): i for i, p in enumerate(pl_module.parameters())}
    unknown = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in position]
    if unknown:
        raise UserError("the optimizer holds tensors that are not the module's parameters: FSDP2 is measured only")
    return optimizer_factory(optimizer, pl_module)


def _replay_configure_model(trainer: pl.Trainer) -> Callable[[nn.Module, object], None]:
    """FSDPSettings.shard for predict_sharded: the fake copy's own configure_model.

    Its `device_mesh` has the strategy's shape and dimension names, over the fake process group.
    (LightningModule.device_mesh reads `_device_mesh`: canary in tests/callbacks/test_ledger_fsdp2.py.)
    """

    def shard(model: nn.Module, fake_mesh: object) -> None:
        model.trainer = trainer  # a deep copy drops its trainer; configure_model may read it
        real = trainer.strategy.device_mesh
        # Under TP the fake mesh is already (data_parallel x tensor_parallel), of fake groups.
        model._device_mesh = fake_mesh if fake_mesh.ndim == 2 else _fake_mesh_like(real, fake_mesh)
        model.configure_model()

    return shard


def _fake_mesh_like(real: object, fake_mesh: object) -> object:
    """A 2-D (data_parallel, tensor_parallel) DeviceMesh like the strategy's.

    Its data-parallel dimension is the fake process group's ranks. With tensor_parallel_size 1, its
    tensor dimension is this rank alone. The real one-rank group stands there. FSDP2 over the
    data-parallel dimension never calls it.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    group = fake_mesh.get_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    names = real.mesh_dim_names
    with unset_fake_temporarily():  # the mesh's rank table is read as values: a real tensor, as the fake mesh's
        return DeviceMesh.from_group(
            [group, real[names[1]].get_group()], "cpu", mesh=torch.tensor(ranks).reshape(len(ranks), 1),
            mesh_dim_names=names,
        )  # fmt: skip
