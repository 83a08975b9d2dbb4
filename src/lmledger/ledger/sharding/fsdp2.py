"""FSDP2 per rank at world size W, on fake tensors over torch's fake process group.

Here torch's `fully_shard` wraps the fake copy, as Lightning's ModelParallelStrategy runs it in
configure_model. The fake process group has W ranks. Its DeviceMesh is made outside FakeTensorMode,
as torchtitan's memory estimator does. Modelled:

    sharded DTensor parameters, grads and AdamW state
    the all-gather and reduce-scatter buffers
    reshard after forward, on or off
    activation checkpointing, as the model has it

Counted per rank on the local shards. The storages FSDP resizes outside any operator are followed
(ledger.sharding.rankstate).

The fake process group never outlives the call and never clashes with a real one. The caller may
already have a default group (Lightning's DDP in the same process). Then the fake ranks get a
non-default group of their own, destroyed alone (fake_process_group). Pure torch: no Lightning import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.dryrun.engine import NotTraced, StepFn
from lmledger.ledger.sharding import tp
from lmledger.ledger.sharding.rankstate import FakeCopy, ShardedLedger, sharded_ledger, sharded_tracking

__all__ = [
    "DEFAULT_FSDP",
    "TP_DIMS",
    "FSDPSettings",
    "fake_process_group",
    "fsdp2_shard_bytes",
    "fsdp_units",
    "make_mesh",
    "predict_fsdp2",
    "shard_blocks",
    "shard_model",
]


@dataclass(frozen=True)
class FSDPSettings:
    """How fully_shard wraps the model.

    Fields:

        shard         `shard(module, mesh)` wraps it as a LightningModule's configure_model would.
                      Default: each child of every nn.ModuleList (the transformer blocks), then the
                      root, all with `reshard_after_forward`.
        mp_policy     passed to fully_shard as it is
        shard_size    makes the mesh 2-D, (W / shard_size replicas, shard_size shards): hybrid
                      sharding (HSDP), as torchtitan's data_parallel_replicate/shard degrees do
        tensor_parallel  makes the mesh 2-D, (W / tp data_parallel, tp tensor_parallel), as Lightning's
                      ModelParallelStrategy names it. `shard(model, mesh)` then gets that mesh (a
                      configure_model replayed); without one, `tp_plan(model, mesh["tensor_parallel"])`
                      (default: ledger.sharding.tp's ToyLM plan) runs, then shard_blocks over "data_parallel"
        sequence_parallel  the default ToyLM plan's option (ledger.sharding.tp.toy_tp_plan)
    """

    reshard_after_forward: bool = True
    shard: Callable[[nn.Module, object], None] | None = None
    mp_policy: object = None
    shard_size: int | None = None  # HSDP: shard within groups of this many ranks, replicate across them
    tensor_parallel: int = 1
    tp_plan: Callable[[nn.Module, object], None] | None = None
    sequence_parallel: bool = False


DEFAULT_FSDP = FSDPSettings()


@contextmanager
def fake_process_group(world_size: int, shard_size: int | None = None, tensor_parallel: int = 1) -> Iterator[object]:
    """torch's fake process group of `world_size` ranks, and a CPU DeviceMesh over it.

    This process is its rank 0. The mesh is 1-D; with shard_size, 2-D (replicate x shard); with
    tensor_parallel > 1, 2-D (data_parallel x tensor_parallel). All are made outside any
    FakeTensorMode, and torn down on exit.

    Without a default group, it is the default one: init_process_group("fake"), as torchtitan's
    estimator does. It is destroyed after. The caller may already have a default group (Lightning's DDP
    in this process). Then the fake group is a separate, non-default one. It is registered as c10d
    registers a new group, and destroyed alone. So the caller's groups are untouched. (c10d private API:
    test_a_real_default_group_is_set_aside holds it.)
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise _Unavailable("this torch is built without torch.distributed: no fake process group")
    try:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise _Unavailable(f"torch {torch.__version__} has no fake process group") from None
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield make_mesh(init_device_mesh, world_size, shard_size, tensor_parallel)
        finally:
            dist.destroy_process_group()
            _forget_meshes()
        return
    if tensor_parallel > 1:
        try:
            with _fake_2d_beside(world_size, tensor_parallel) as mesh:
                yield mesh
        finally:
            _forget_meshes()
        return
    if shard_size is not None and shard_size != world_size:
        raise _Unavailable("a 2-D (HSDP) mesh beside this process's own process group is not built yet")
    c10d = dist.distributed_c10d
    _FAKE_GROUPS[0] += 1
    # This process is the fake group's rank 0; the other ranks' global numbers exist nowhere (never looked up).
    ranks = [dist.get_rank()] + [_NO_SUCH_RANK + i for i in range(1, world_size)]
    group, _ = c10d._new_process_group_helper(
        world_size, 0, ranks, "fake", FakeStore(), group_name=f"lmledger_fake_{os.getpid()}_{_FAKE_GROUPS[0]}",
        timeout=c10d.default_pg_timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {global_rank: i for i, global_rank in enumerate(ranks)}
    try:
        yield DeviceMesh.from_group(group, "cpu")
    finally:
        dist.destroy_process_group(group)
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches (the C++ fast path's and Python's) as a fake world ends. Their
    entries keep output specs, meshes included, and a mesh equals any other of the same ranks, shape and names
    whatever its groups: a later world's equal mesh (the tensor-parallel row of (dp, tp) and of (dp, cp, tp)) was
    handed the gone world's, whose group names then resolve to another group or to none ("Could not resolve the
    process group registered under the name 3"). torch's own debug helper clears both."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def make_mesh(init_device_mesh: Callable, world_size: int, shard_size: int | None, tensor_parallel: int = 1) -> object:
    """A CPU mesh of `world_size` ranks: 1-D, or 2-D (replicate x shard) with a smaller shard_size, or 2-D
    (data_parallel x tensor_parallel) with tensor_parallel > 1."""
    if tensor_parallel > 1:
        return init_device_mesh("cpu", (world_size // tensor_parallel, tensor_parallel), mesh_dim_names=TP_DIMS)
    if shard_size is None or shard_size == world_size:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


TP_DIMS = ("data_parallel", "tensor_parallel")  # Lightning's ModelParallelStrategy's names
_FAKE_GROUPS = [0]


@contextmanager
def _fake_2d_beside(world_size: int, tensor_parallel: int) -> Iterator[object]:
    """A (data_parallel x tensor_parallel) mesh of fake groups beside this process's real default group.

    This process sits at [0, 0] under its real global rank. The other ranks' numbers exist nowhere.
    Only its own row (the tp group) and column (the dp group) are made: every collective it joins.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    c10d = dist.distributed_c10d
    dp = world_size // tensor_parallel
    table = torch.arange(world_size).reshape(dp, tensor_parallel) + _NO_SUCH_RANK
    table[0, 0] = dist.get_rank()
    groups = []
    try:
        for ranks in (table[:, 0].tolist(), table[0, :].tolist()):
            _FAKE_GROUPS[0] += 1
            group, _ = c10d._new_process_group_helper(
                len(ranks), 0, ranks, "fake", FakeStore(),
                group_name=f"lmledger_fake_{os.getpid()}_{_FAKE_GROUPS[0]}", timeout=c10d.default_pg_timeout,
            )  # fmt: skip
            c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
            groups.append(group)
        yield DeviceMesh.from_group(groups, "cpu", mesh=table, mesh_dim_names=TP_DIMS)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


_NO_SUCH_RANK = 1 << 30


class _Unavailable(Exception):
    pass


def shard_blocks(model: nn.Module, mesh: object, settings: FSDPSettings) -> None:
    """The common FSDP2 wrapping (torchtitan's, Lightning's examples).

    It runs fully_shard on every child of every nn.ModuleList (the repeated blocks), then on the root.
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward}
    if settings.mp_policy is not None:
        kwargs["mp_policy"] = settings.mp_policy
    for sub in list(model.modules()):
        if isinstance(sub, nn.ModuleList):
            for block in sub:
                fully_shard(block, **kwargs)
    # A LightningModule's training_step calls its children, never itself: FSDP2's root is then the child
    # (the module Lightning's ModelParallelStrategy examples shard in configure_model).
    roots = (
        [c for c in model.children() if any(True for _ in c.parameters())]
        if hasattr(model, "training_step")
        else [model]
    )
    for root in roots:
        fully_shard(root, **kwargs)


def shard_model(model: nn.Module, mesh: object, settings: FSDPSettings) -> None:
    """Wrap `model` with fully_shard as `settings` say (their own `shard`, else shard_blocks).

    With tensor_parallel > 1 and no `shard`, the TP plan runs first (settings.tp_plan, else the ToyLM's).
    """
    if settings.shard is not None:
        settings.shard(model, mesh)
    elif settings.tensor_parallel > 1:
        from lmledger.ledger.sharding import tp

        plan = settings.tp_plan or (lambda m, tp_mesh: tp.toy_tp_plan(m, tp_mesh, settings.sequence_parallel))
        plan(model, mesh[TP_DIMS[1]])
        shard_blocks(model, mesh[TP_DIMS[0]], settings)
    else:
        shard_blocks(model, mesh, settings)


def predict_fsdp2(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None,
    optimizer: object,
    precision: str | int,
    world_size: int,
    settings: FSDPSettings,
    device: torch.device | str | None,
    accumulate: int = 1,
    manual: bool = False,
) -> ShardedLedger | NotTraced:
    """One FSDP2 rank's steady-state step (module docstring); arguments as ledger.sharding.sharded.predict_sharded."""
    if device is not None and torch.device(device).type != "cpu":
        return NotTraced(f"the sharded dry run runs FSDP2 on a CPU mesh, not {device}: predict it for cpu")
    size, tensor_parallel = settings.shard_size, settings.tensor_parallel
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1 or world_size % tensor_parallel:
        raise UserError(
            f"tensor_parallel_size {tensor_parallel} does not divide the {world_size} ranks: choose one that "
            "divides devices x num_nodes"
        )
    if tensor_parallel > 1 and size is not None and size != world_size // tensor_parallel:
        return NotTraced("hybrid sharding (HSDP) with tensor parallelism is not modelled yet: the run is measured only")
    if size is not None and (not isinstance(size, int) or size < 1 or world_size % size):
        return NotTraced(
            f"world size {world_size} does not divide into shard groups of {size} ranks (HSDP's mesh): "
            "the run is measured only"
        )
    try:
        with (
            fake_process_group(world_size, None if tensor_parallel > 1 else size, tensor_parallel) as device_mesh,
            _rank_chunks_only(),
            tp.meshes_outside_fake_mode(),
        ):
            wrap = lambda model: shard_model(model, device_mesh, settings)  # noqa: E731
            fake = FakeCopy(module, batch, step, optimizer, precision, device, wrap=wrap, manual=manual)
            if isinstance(fake.error, NotTraced):
                return fake.error
            with sharded_tracking():
                result = fake.ledger(accumulate=accumulate)
            if isinstance(result, NotTraced):
                return result
            result = _name_groups(result, device_mesh)
            units = fsdp_units(fake.model)
    except _Unavailable as err:
        return NotTraced(f"{err}: the run is measured only")
    comm = max((2 * u for u in units), default=0)
    return sharded_ledger(
        result, "fsdp2", world_size, comm_buffers=comm, state=fake.state, tensor_parallel=tensor_parallel
    )


def _name_groups(result, mesh: object):
    """`result` with each collective's group named by its mesh dimension ("data_parallel", "tensor_parallel",
    HSDP's "replicate"/"shard"): what says which link it crosses (ledger/interconnect.links_for)."""
    import dataclasses

    from lmledger.ledger.count.ops import OpSummary

    if result.ops is None:  # a dry run without its op list (manual optimization's)
        return result
    names = {mesh.get_group(dim).group_name: dim for dim in (mesh.mesh_dim_names or ())}
    if mesh.ndim == 1:
        names[mesh.get_group().group_name] = "data_parallel"
    ops = [dataclasses.replace(op, group=names.get(op.group, op.group)) if op.group else op for op in result.ops.ops]
    return dataclasses.replace(result, ops=OpSummary.of(ops, result.ops.outside))


class _RankChunks:
    """torch.chunk(tensor, n, dim) padded with empties to n, as FSDP2's _chunk_with_empty returns it.

    Each chunk is made when it is read. FSDP2 reads its own rank's and the 0th (the padded size). So the
    fake run makes 2 views per parameter, not W. The dry run's cost then stays flat in the world size.
    """

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        length = tensor.size(dim)
        self.size = math.ceil(length / num_chunks) if length else 0
        self.count = math.ceil(length / self.size) if self.size else 0

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0:
            index += self.num_chunks
        if not 0 <= index < self.num_chunks:
            raise IndexError(index)
        if index < self.count:
            start = index * self.size
            return self.tensor.narrow(self.dim, start, min(self.size, self.tensor.size(self.dim) - start))
        return self[0].new_empty(0) if self.count else self.tensor.new_empty(0)

    def __iter__(self):
        return (self[i] for i in range(self.num_chunks))


@contextmanager
def _rank_chunks_only() -> Iterator[None]:
    """FSDP2's _chunk_with_empty made lazy for the fake run (_RankChunks). The real twin runs torch's own.

    The W = 2 and 4 tests against real ranks hold the two equal. The canary
    test_canary_fsdp2_reads_two_chunks holds the use.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    with mock.patch.object(_fsdp_param, "_chunk_with_empty", _RankChunks):
        yield


def fsdp_units(model: nn.Module) -> list[int]:
    """Bytes each fully_shard unit all-gathers: its padded shards times the world size."""
    units = []
    for sub in model.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is None:
            continue
        world = group.mesh_info.shard_mesh_size
        units.append(
            sum(p._sharded_param_data.numel() * p._sharded_param_data.element_size() for p in group.fsdp_params) * world
        )
    return units


def fsdp2_shard_bytes(shapes_and_widths: list[tuple[tuple[int, ...], int]], world_size: int) -> int:
    """The closed form of one rank's FSDP2 shards.

    Each tensor is chunked on dim 0 into W pieces of ceil(dim0 / W) rows. The last ones are padded
    (FSDPParam._init_sharded_param).
    """
    total = 0
    for shape, width in shapes_and_widths:
        rows = math.ceil(shape[0] / world_size) if shape else 1
        total += rows * math.prod(shape[1:]) * width
    return total
