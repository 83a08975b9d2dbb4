"""The per-rank ledger of a data-parallel step at world size W, predicted in one process.

`predict_sharded(module, batch, strategy=..., world_size=W)` is the dry run (ledger.dryrun) of the step
one rank runs, with the rank's own wrapping of the model on fake tensors:

    ddp      the single-device step plus DDP's gradient buckets (ledger.ddp): flat buffers made on
             the fake copy and filled from each parameter's post-accumulate-grad hook, as the
             Reducer's autograd hook fills them (reducer.cpp mark_variable_ready_dense); under
             gradient_as_bucket_view `param.grad` becomes the bucket's view. No process group is
             needed: the all-reduce is in place.
    fsdp2    torch's `fully_shard` (what Lightning's ModelParallelStrategy runs in configure_model)
             on the fake copy, over torch's fake process group of W ranks (a DeviceMesh made
             outside FakeTensorMode, as torchtitan's memory estimator does): sharded DTensor
             parameters, grads and AdamW state, the all-gather and reduce-scatter buffers, reshard
             after forward on or off, activation checkpointing as the model has it.
    zero1/2/3, fsdp (FSDP1), deepspeed_stage_N
             not traced: the state bytes per rank are ledger.memory's closed forms (DeepSpeed's own
             allocation rules); their peak is not predicted (`ShardedLedger.peak_checked` False).

Counted per rank, on the local shards (a DTensor's untyped_storage() is its global size, so state and
live bytes are read from `_local_tensor`), and storages FSDP resizes outside any operator
(UntypedStorage.resize_, its unsharded parameters) are followed (canary in tests/test_sharded.py).
`measure_sharded` is the measured twin inside a real process group, `run_ranks` starts W gloo
processes on this CPU for it.

The fake process group never outlives the call and never clashes with a real one: when the caller
already has a default group (Lightning's DDP in the same process), the fake ranks get a non-default
group of their own, destroyed alone (fake_process_group). Pure torch: no Lightning import.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lmledger.errors import UserError
from lmledger.ledger import dryrun
from lmledger.ledger import memory as ledger_memory
from lmledger.ledger.ddp import Bucket, DDPSettings, bucket_bytes, rebuilt_buckets
from lmledger.ledger.dryrun import LargestBatch, NotTraced, OptimizerSpec, StepFn, StepLedger
from lmledger.ledger.memtrack import MemoryTracker

TRACED = ("ddp", "fsdp2")
STATE_ONLY = ("zero1", "zero2", "zero3", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
NOT_MODELLED = {
    "tensor": "tensor parallelism",
    "pipeline": "pipeline parallelism",
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
}


@dataclass(frozen=True)
class FSDPSettings:
    """How fully_shard wraps the model. `shard(module, mesh)` wraps it as a LightningModule's
    configure_model would; default: each child of every nn.ModuleList (the transformer blocks), then the
    root, all with `reshard_after_forward`. `mp_policy` is passed to fully_shard as it is. `shard_size` makes
    the mesh 2-D, (W / shard_size replicas, shard_size shards): hybrid sharding (HSDP), as torchtitan's
    data_parallel_replicate/shard degrees do."""

    reshard_after_forward: bool = True
    shard: Callable[[nn.Module, object], None] | None = None
    mp_policy: object = None
    shard_size: int | None = None  # HSDP: shard within groups of this many ranks, replicate across them


DEFAULT_DDP, DEFAULT_FSDP = DDPSettings(), FSDPSettings()


@dataclass(frozen=True)
class ShardedLedger(StepLedger):
    """A StepLedger of one rank at `world_size`, and what sharding added.

    buckets        DDP's steady-state buckets (ledger.ddp.Bucket), empty otherwise
    comm_buffers   DDP: the bucket buffers; FSDP2: the largest unit's all-gather output plus its
                   reduce-scatter input (both W padded shards long), sized from the FSDP state (the
                   peak counts the buffers themselves as they are allocated)
    peak_checked   False where the peak is the single-device step's with the sharded state swapped in
                   (DeepSpeed, FSDP1): not yet held to a measurement
    """

    strategy: str = "ddp"
    world_size: int = 1
    buckets: tuple[Bucket, ...] = ()
    comm_buffers: int = 0
    peak_checked: bool = True


def predict_sharded(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    strategy: str = "ddp",
    world_size: int = 1,
    ddp: DDPSettings = DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
    device: torch.device | str | None = None,
    activation_checkpointing: bool | None = None,
) -> ShardedLedger | NotTraced:
    """One rank's steady-state training step of `module` at `world_size` (module docstring).

    Arguments as dryrun.dry_run; `batch` is one rank's micro-batch. `strategy`: "ddp" (also "auto",
    "single_device"), "fsdp2" (torch's fully_shard / Lightning's ModelParallelStrategy), or a
    state-only one (STATE_ONLY). Returns NotTraced with one line for what it cannot model (tensor or
    pipeline parallelism, a world size the mesh cannot take, a torch without the fake process group)
    and for a model the dry run cannot trace; bad input is a UserError. `activation_checkpointing`:
    None runs the model as it is; True checkpoints every block (each child of an nn.ModuleList) on the
    copy with torch's non-reentrant checkpoint_wrapper, as Lightning's FSDP strategies'
    activation_checkpointing_policy and torchtitan do."""
    if activation_checkpointing:
        return _with_checkpointed_blocks(
            predict_sharded, module, batch, step=step, optimizer=optimizer, precision=precision,
            strategy=strategy, world_size=world_size, ddp=ddp, fsdp=fsdp, device=device,
        )  # fmt: skip
    name = _strategy(strategy)
    if isinstance(name, NotTraced):
        return name
    if not isinstance(world_size, int) or world_size < 1:
        return NotTraced(f"world size {world_size!r} is not a positive whole number of ranks")
    if name == "fsdp2":
        return _predict_fsdp2(module, batch, step, optimizer, precision, world_size, fsdp, device)
    if name in STATE_ONLY:
        return _predict_state_only(module, batch, step, optimizer, precision, name, world_size, device)
    return _predict_ddp(module, batch, step, optimizer, precision, world_size, ddp, device)


def _with_checkpointed_blocks(predict: Callable, module: nn.Module, batch: object, **kwargs) -> object:
    """predict(copy, batch, **kwargs) on a copy of module whose blocks are checkpointed: the copy
    shares the real tensors (never copied: deepcopy's memo maps each to itself), only the wrappers are new."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
    )

    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    for sub in module.modules():
        memo.update({id(v): v for v in vars(sub).values() if isinstance(v, torch.Tensor)})
    copied = copy.deepcopy(module, memo)
    blocks = {id(b) for sub in copied.modules() if isinstance(sub, nn.ModuleList) for b in sub}
    if not blocks:
        return NotTraced(f"{type(module).__name__} has no nn.ModuleList of blocks to checkpoint")
    apply_activation_checkpointing(
        copied, checkpoint_wrapper_fn=_non_reentrant(CheckpointImpl), check_fn=lambda m: id(m) in blocks
    )
    return predict(copied, batch, **kwargs)


def _non_reentrant(impl) -> Callable:
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return partial(checkpoint_wrapper, checkpoint_impl=impl.NO_REENTRANT)


def largest_batch_sharded(
    module: nn.Module,
    batch_for: Callable[[int], object],
    capacity_bytes: int,
    *,
    limit: int = 1 << 16,
    **kwargs: object,
) -> LargestBatch | NotTraced:
    """The largest per-rank micro-batch b <= limit whose predict_sharded peak (kwargs passed on) is at most
    capacity_bytes: sizes double until one does not fit, then bisect (as dryrun.largest_batch)."""
    if capacity_bytes <= 0 or limit < 1:
        raise UserError(f"capacity_bytes and limit must be positive, got {capacity_bytes} and {limit}")
    ledgers: dict[int, StepLedger] = {}

    def fits(size: int) -> bool | NotTraced:
        result = predict_sharded(module, batch_for(size), **kwargs)
        if isinstance(result, NotTraced):
            return result
        ledgers[size] = result
        return result.peak <= capacity_bytes

    # The peak grows about linearly with the batch: sizes 1 and 2 give the line, its crossing of the
    # capacity the first guess; from there the distance doubles until one size fits and the next does not,
    # then bisects. A handful of dry runs, where doubling from 1 takes two per power of two.
    first = fits(1)
    if isinstance(first, NotTraced) or not first:
        return first if isinstance(first, NotTraced) else LargestBatch(0, None, ledgers[1])
    if limit == 1:
        return LargestBatch(1, ledgers[1], None)
    second = fits(2)
    if isinstance(second, NotTraced):
        return second
    slope = max(ledgers[2].peak - ledgers[1].peak, 1)
    guess = max(1, min(limit, 1 + (capacity_bytes - ledgers[1].peak) // slope)) if second else 1
    low, high = _bracket(fits, guess, limit, ledgers, capacity_bytes)
    if isinstance(low, NotTraced):
        return low
    if high is None:
        return LargestBatch(limit, ledgers[limit], None)
    while high - low > 1:
        middle = (low + high) // 2
        verdict = fits(middle)
        if isinstance(verdict, NotTraced):
            return verdict
        low, high = (middle, high) if verdict else (low, middle)
    return LargestBatch(low, ledgers.get(low), ledgers[high])


def _bracket(fits, guess: int, limit: int, ledgers: dict, capacity: int):
    """(low, high): a size that fits and one that does not (None: even `limit` fits), from `guess` outward."""
    known = lambda size: ledgers[size].peak <= capacity if size in ledgers else fits(size)  # noqa: E731
    verdict = known(guess)
    if isinstance(verdict, NotTraced):
        return verdict, None
    step = 1
    if verdict:
        low = guess
        while low < limit:
            high = min(low + step, limit)
            verdict = known(high)
            if isinstance(verdict, NotTraced):
                return verdict, None
            if not verdict:
                return low, high
            low, step = high, 2 * step
        return limit, None
    high = guess
    while True:
        low = max(high - step, 1)
        verdict = known(low)
        if isinstance(verdict, NotTraced):
            return verdict, None
        if verdict:
            return low, high
        high, step = low, 2 * step


def _strategy(strategy: str) -> str | NotTraced:
    name = str(strategy).lower().removesuffix("strategy").strip("_")
    for key, what in NOT_MODELLED.items():
        if name.startswith(key):
            return NotTraced(f"the dry run does not model {what} ({strategy}) yet: the run is measured only")
    if name in ("ddp", "auto", "single_device", "ddp_spawn", "ddp_fork", "ddp_notebook"):
        return "ddp"
    if name in ("fsdp2", "modelparallel", "model_parallel", "fully_shard"):
        return "fsdp2"
    if name in STATE_ONLY:
        return name
    known = ", ".join(("ddp", "fsdp2", *STATE_ONLY))
    raise UserError(f"unknown strategy {strategy!r} for the sharded dry run: use one of {known}")


# --------------------------------------------------------------------------------------------
# Counting local shards, and storages FSDP resizes outside an operator
# --------------------------------------------------------------------------------------------


def _local(t: object) -> object:
    """A DTensor's local shard (what this rank allocates); anything else as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(t, torch.Tensor) and isinstance(local, torch.Tensor) else t


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """measure_state_bytes on each rank's own shards: params, their .grad and optimizer state, local
    storages once each (0-dim `step` counters left out)."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            states += [_local(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _unique(params), "grads": _unique(grads), "optimizer": _unique(states)}


def _unique(tensors: list) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())
    return sum(seen.values())


class _ShardedTracker(MemoryTracker):
    """MemoryTracker on local shards, with `extra` storages live from the start (DDP's buckets) and
    UntypedStorage.resize_ followed while it runs (FSDP2 allocates and frees unsharded parameters so)."""

    extra: tuple[torch.Tensor, ...] = ()
    active: list[_ShardedTracker] = []

    def track(self, *objects):
        tensors: list[torch.Tensor] = []
        for obj in objects:
            if isinstance(obj, nn.Module):
                for p in obj.parameters():
                    tensors.append(_local(p))
                    if p.grad is not None:
                        tensors.append(_local(p.grad))
                tensors += list(obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
            else:
                tensors.append(tree_map(_local, obj))
        return super().track(tensors, list(self.extra))

    def _after_op(self, out, inputs):
        super()._after_op(tree_map(_local, out), tree_map(_local, inputs))

    def start(self):
        super().start()
        _ShardedTracker.active.append(self)
        return self

    def stop(self):
        if self in _ShardedTracker.active:
            _ShardedTracker.active.remove(self)
        super().stop()

    def resized(self, storage: torch.UntypedStorage) -> None:
        if self.running:
            self._add(storage)  # new, or a tracked one at its new size
            self._raise_peak()


_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_seen(storage: torch.UntypedStorage, size: int):
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in _ShardedTracker.active:
        tracker.resized(storage)
    return out


@contextmanager
def _sharded_tracking(extra: tuple[torch.Tensor, ...] = ()) -> Iterator[None]:
    """Make the dry run's (and measure's) MemoryTracker a _ShardedTracker with `extra` storages."""
    tracker_type = type("_Tracker", (_ShardedTracker,), {"extra": extra})
    with (
        mock.patch.object(dryrun, "MemoryTracker", tracker_type),
        mock.patch.object(torch.UntypedStorage, "resize_", _resize_seen),
    ):
        yield


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------


def _grad_sizes(model: nn.Module) -> list[tuple[int, str]]:
    return [(p.numel() * p.element_size(), str(p.dtype)) for p in _reduced(model)]


def _reduced(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP reduces: those that need grad, each shared one once, in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


class _EmulatedReducer:
    """DDP's Reducer on a fake copy: flat bucket buffers, filled as each gradient is accumulated."""

    def __init__(self, model: nn.Module, settings: DDPSettings, world_size: int) -> None:
        self.model, self.settings, self.world_size = model, settings, world_size
        self.params = _reduced(model)
        self.ready: list[int] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.buckets: list[Bucket] = []
        self.buffers: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}

    def build(self, ready_order: list[int] | None) -> None:
        """Allocate the steady-state buckets (rebuilt in gradient-ready order) and each parameter's view."""
        self.buckets = rebuilt_buckets(_grad_sizes(self.model), self.settings, ready_order)
        self.buffers, self.views = [], {}
        for bucket in self.buckets:
            dtype = self.params[bucket.indices[0]].dtype
            flat = torch.empty(sum(self.params[i].numel() for i in bucket.indices), dtype=dtype)
            offset = 0
            for i in bucket.indices:
                p = self.params[i]
                self.views[i] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            self.buffers.append(flat)

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if len(self.ready) < len(self.params):
                self.ready.append(index)
            view = self.views.get(index)
            if view is None or param.grad is None:
                return
            # Tensor.is_set_to would do, but on a fake tensor it materializes real memory (torch 2.13)
            grad = param.grad
            same = grad.untyped_storage()._cdata == view.untyped_storage()._cdata
            if not (same and grad.storage_offset() == view.storage_offset()):
                torch.mul(param.grad, 1.0 / self.world_size, out=view)  # the Reducer's mul_out into the bucket
                if self.settings.gradient_as_bucket_view:
                    param.grad = view

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _predict_ddp(module, batch, step, optimizer, precision, world_size, settings, device):
    if world_size == 1:
        single = dryrun.dry_run(module, batch, step=step, optimizer=optimizer, precision=precision, device=device)
        return single if isinstance(single, NotTraced) else _sharded(single, "ddp", 1)
    fake = _FakeRun(module, batch, step, optimizer, precision, device)
    if isinstance(fake.error, NotTraced):
        return fake.error
    reducer = _EmulatedReducer(fake.model, settings, world_size)
    try:
        # The bucket order: the order gradients become ready, read from one fake backward first.
        order = fake.ready_order(reducer)
        if isinstance(order, NotTraced):
            return order
        with fake.mode:
            reducer.build(order)
        with _sharded_tracking(tuple(reducer.buffers)):
            result = fake.ledger()
    finally:
        reducer.remove()
    if isinstance(result, NotTraced):
        return result
    return _sharded(
        result, "ddp", world_size, buckets=tuple(reducer.buckets), comm_buffers=bucket_bytes(reducer.buckets)
    )


# --------------------------------------------------------------------------------------------
# FSDP2 over the fake process group
# --------------------------------------------------------------------------------------------


@contextmanager
def fake_process_group(world_size: int, shard_size: int | None = None) -> Iterator[object]:
    """torch's fake process group of `world_size` ranks (this process is its rank 0) and a CPU DeviceMesh
    over it (1-D; with shard_size, 2-D: replicate x shard), made outside any FakeTensorMode; torn down on exit.

    Without a default group it is the default one (init_process_group("fake"), as torchtitan's estimator
    does), destroyed after. When the caller already has a default group (Lightning's DDP in this process),
    the fake group is a separate, non-default one, registered as c10d registers a new group and destroyed
    alone, so the caller's groups are untouched (c10d private API: test_a_real_default_group_is_set_aside
    holds it)."""
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
            yield _mesh(init_device_mesh, world_size, shard_size)
        finally:
            dist.destroy_process_group()
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


def _mesh(init_device_mesh: Callable, world_size: int, shard_size: int | None) -> object:
    if shard_size is None or shard_size == world_size:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


_FAKE_GROUPS = [0]
_NO_SUCH_RANK = 1 << 30


class _Unavailable(Exception):
    pass


def shard_blocks(model: nn.Module, mesh: object, settings: FSDPSettings) -> None:
    """The common FSDP2 wrapping (torchtitan's, Lightning's examples): fully_shard every child of every
    nn.ModuleList (the repeated blocks), then the root."""
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


def _shard(model: nn.Module, mesh: object, settings: FSDPSettings) -> None:
    if settings.shard is not None:
        settings.shard(model, mesh)
    else:
        shard_blocks(model, mesh, settings)


def _predict_fsdp2(module, batch, step, optimizer, precision, world_size, settings, device):
    if device is not None and torch.device(device).type != "cpu":
        return NotTraced(f"the sharded dry run runs FSDP2 on a CPU mesh, not {device}: predict it for cpu")
    size = settings.shard_size
    if size is not None and (not isinstance(size, int) or size < 1 or world_size % size):
        return NotTraced(
            f"world size {world_size} does not divide into shard groups of {size} ranks (HSDP's mesh): "
            "the run is measured only"
        )
    try:
        with fake_process_group(world_size, size) as mesh, _rank_chunks_only():
            fake = _FakeRun(module, batch, step, optimizer, precision, device, mesh=mesh, shard=settings)
            if isinstance(fake.error, NotTraced):
                return fake.error
            with _sharded_tracking():
                result = fake.ledger()
            if isinstance(result, NotTraced):
                return result
            units = _fsdp_units(fake.model)
    except _Unavailable as err:
        return NotTraced(f"{err}: the run is measured only")
    comm = max((2 * u for u in units), default=0)
    return _sharded(result, "fsdp2", world_size, comm_buffers=comm, state=fake.state)


class _RankChunks:
    """torch.chunk(tensor, n, dim) padded with empties to n, as FSDP2's _chunk_with_empty returns it, with each
    chunk made when it is read: FSDP2 reads its own rank's and the 0th (the padded size), so the fake run
    makes 2 views per parameter, not W (the dry run's cost then stays flat in the world size)."""

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
    """FSDP2's _chunk_with_empty made lazy for the fake run (_RankChunks); the real twin runs torch's own. The
    W = 2 and 4 tests against real ranks hold the two equal; test_canary_fsdp2_reads_two_chunks holds the use."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    with mock.patch.object(_fsdp_param, "_chunk_with_empty", _RankChunks):
        yield


def _fsdp_units(model: nn.Module) -> list[int]:
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
    """The closed form of one rank's FSDP2 shards: each tensor is chunked on dim 0 into W pieces of
    ceil(dim0 / W) rows (the last ones padded: FSDPParam._init_sharded_param)."""
    total = 0
    for shape, width in shapes_and_widths:
        rows = math.ceil(shape[0] / world_size) if shape else 1
        total += rows * math.prod(shape[1:]) * width
    return total


# --------------------------------------------------------------------------------------------
# The fake copy, wrapped
# --------------------------------------------------------------------------------------------


class _FakeRun:
    """The dry run's fake copy of the model, batch and optimizer (dryrun._fake_copy and friends), wrapped
    with fully_shard when a mesh is given; `ledger()` is dryrun._ledger_of_step on them."""

    def __init__(self, module, batch, step, optimizer, precision, device, mesh=None, shard=None) -> None:
        self.error: NotTraced | None = None
        self.step = step
        self.dtype, self.autocast = dryrun._precision_dtypes(precision)
        self.target = dryrun._target_device(module, device)
        self.mode = dryrun.FakeTensorMode(allow_non_fake_inputs=True)
        self.state: dict[str, int] | None = None
        try:
            self.model, memo = dryrun._fake_copy(module, self.mode, self.target, self.dtype)
            self.batch = dryrun.map_tensors(
                lambda t: dryrun._fake_tensor(t, self.mode, self.target), dryrun._cast_batch(batch, self.dtype)
            )
            with self.mode:
                if mesh is not None:
                    _shard(self.model, mesh, shard)
                # an optimizer made after sharding sees the DTensor parameters, as in configure_model
                self.optimizer = dryrun._fake_optimizer(
                    _factory(optimizer, module) if mesh is not None else optimizer, self.model, memo, self.target
                )
        except UserError:
            raise
        except Exception as err:
            self.error = NotTraced(f"could not copy the model onto fake tensors: {dryrun._one_line(err)}")

    def ledger(self) -> StepLedger | NotTraced:
        try:
            with self.mode, torch.compiler.set_stance("force_eager"), dryrun._RealOutputStorages():
                with dryrun._eager_library_decisions():
                    result = dryrun._ledger_of_step(
                        self.model, self.batch, self.step, self.optimizer, self.autocast, self.target
                    )
        except UserError:
            raise
        except Exception as err:
            return NotTraced(f"the step does not run on fake tensors: {dryrun._why(err)}")
        self.state = local_state_bytes(self.model, self.optimizer)
        return dataclasses.replace(result, **self.state)

    def ready_order(self, reducer: _EmulatedReducer) -> list[int] | NotTraced:
        """The order gradients become ready in one backward (hooks record it), on a throwaway forward."""
        try:
            with self.mode, torch.compiler.set_stance("force_eager"), dryrun._eager_library_decisions():
                loss = (self.step or dryrun.default_step)(self.model, self.batch)
                loss = dryrun.loss_of(loss)
                loss.backward()
        except Exception as err:
            return NotTraced(f"the step does not run on fake tensors: {dryrun._why(err)}")
        self.model.zero_grad(set_to_none=True)
        order = list(reducer.ready)
        seen = set(order)
        return order + [i for i in reversed(range(len(reducer.params))) if i not in seen]


def _factory(optimizer: OptimizerSpec, module: nn.Module) -> OptimizerSpec:
    """An optimizer over the real module becomes a factory making the same kind over the sharded
    parameters (its first group's hyperparameters; per-group settings follow by position)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    real_params = list(module.parameters())
    position = {id(p): i for i, p in enumerate(real_params)}
    groups = [([position[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
              for g in optimizer.param_groups]  # fmt: skip
    kind = type(optimizer)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return kind([{"params": [params[i] for i in ix], **opts} for ix, opts in groups])

    return make


def _sharded(result: StepLedger, strategy: str, world_size: int, *, state=None, **extra) -> ShardedLedger:
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(StepLedger)}
    if state:
        fields.update(state)
    return ShardedLedger(**fields, strategy=strategy, world_size=world_size, **extra)


# --------------------------------------------------------------------------------------------
# ZeRO / FSDP1 / DeepSpeed: state per rank, peak not yet held to a measurement
# --------------------------------------------------------------------------------------------


def _predict_state_only(module, batch, step, optimizer, precision, strategy, world_size, device):
    single = dryrun.dry_run(module, batch, step=step, optimizer=optimizer, precision=precision, device=device)
    if isinstance(single, NotTraced):
        return single
    n = sum(p.numel() for p in module.parameters())
    states = ledger_memory.optimizer_states(_optimizer_name(optimizer, module)) if optimizer is not None else 0
    name = {0: "none", 1: "sgd", 2: "adamw"}[min(states, 2)]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    state = ledger_memory.state_bytes(n, precision, name, strategy, world_size, largest_layer=largest)
    whole = single.params + single.grads + single.optimizer
    peak = single.peak - whole + sum(state.values())
    phase_peaks = {k: v - whole + sum(state.values()) for k, v in single.phase_peaks.items()}
    replaced = dataclasses.replace(single, **state, peak=peak, phase_peaks=phase_peaks)
    return _sharded(replaced, strategy, world_size, peak_checked=False)


def _optimizer_name(optimizer: OptimizerSpec, module: nn.Module) -> str:
    made = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if made is None:
        with torch.device("meta"):
            made = optimizer([nn.Parameter(torch.empty(1))])
    name = type(made).__name__.lower()
    if name in ("adamw", "adam"):
        return name
    if name == "sgd":
        return "sgd" if made.param_groups[0].get("momentum") else "none"
    return "adamw"


# --------------------------------------------------------------------------------------------
# The measured twin: one rank of a real process group
# --------------------------------------------------------------------------------------------


def measure_sharded(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    strategy: str = "ddp",
    ddp: DDPSettings = DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
) -> ShardedLedger:
    """predict_sharded's twin on this rank of the initialised (real) default process group: `module` (a
    copy of it) wrapped in torch's DistributedDataParallel or fully_shard, real steps, the same tracker.

    DDP: three steps, the third tracked (the Reducer rebuilds its buckets at the second forward); a
    comm hook that all-reduces as DDP's default one does hands over each bucket buffer, which the
    tracker counts from the start. FSDP2: dryrun's two steps on the sharded copy."""
    import torch.distributed as dist

    name = _strategy(strategy)
    world = dist.get_world_size()
    model = copy.deepcopy(module)
    dtype, autocast = dryrun._precision_dtypes(precision)
    if dtype is not None:
        model.to(dtype)
    device = dryrun._target_device(model, None)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        _shard(model, _mesh(init_device_mesh, world, fsdp.shard_size), fsdp)
        opt = _factory(optimizer, module)
        opt = opt(list(model.parameters())) if opt is not None else None
        with _sharded_tracking():
            result = dryrun._ledger_of_step(model, dryrun._cast_batch(batch, dtype), step, opt, autocast, device)
        state = local_state_bytes(model, opt)
        units = _fsdp_units(model)
        return _sharded(dataclasses.replace(result, **state), "fsdp2", world, comm_buffers=max(units, default=0) * 2)
    from torch.nn.parallel import DistributedDataParallel

    # As Lightning's DDPStrategy runs a LightningModule: DDP wraps a module whose forward is the step, so
    # the Reducer's forward bookkeeping runs (lightning/pytorch/overrides/base.py _LightningModuleWrapperBase).
    ddp_model = DistributedDataParallel(_StepModule(model, step or dryrun.default_step), **dataclasses.asdict(ddp))
    buffers: dict[int, torch.Tensor] = {}

    def allreduce(_state, bucket):  # DDP's default: divide, then all-reduce in place
        buffer = bucket.buffer()
        buffers[bucket.index()] = buffer
        buffer.div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp_model.register_comm_hook(None, allreduce)
    opt = _factory(optimizer, module)
    opt = opt(list(model.parameters())) if opt is not None else None
    batch = dryrun._cast_batch(batch, dtype)
    for _ in range(2):  # buckets built, rebuilt (second forward) and handed over
        buffers.clear()
        loss = ddp_model(batch)
        (opt or ddp_model).zero_grad(set_to_none=True)
        loss.backward()
        if opt is not None:
            opt.step()
        del loss
    with _sharded_tracking(tuple(buffers.values())):
        result = dryrun._ledger_of_step(ddp_model, batch, _call, opt, autocast, device)
    sizes = tuple(b.numel() * b.element_size() for _, b in sorted(buffers.items()))
    logging = ddp_model._get_ddp_logging_data()
    logged = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "")
    buckets = tuple(Bucket("", (), int(s)) for s in str(logged).split(", ") if s) or tuple(
        Bucket("", (), s) for s in sizes
    )
    return _sharded(result, "ddp", world, buckets=buckets, comm_buffers=sum(sizes))


class _StepModule(nn.Module):
    def __init__(self, module: nn.Module, step: StepFn) -> None:
        super().__init__()
        self.module, self.step = module, step

    def forward(self, batch: object) -> torch.Tensor:
        return dryrun.loss_of(self.step(self.module, batch))


def _call(model: nn.Module, batch: object) -> torch.Tensor:
    return model(batch)


def run_ranks(target: Callable, world_size: int, *args: object) -> list:
    """`target(*args)` on each of `world_size` processes of a gloo process group on this CPU (spawned,
    one thread each); the list of their return values by rank. `target` must be importable (a module-level
    function) and its result picklable."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank_main, args=(world_size, tmp, target, args), nprocs=world_size, join=True, start_method="spawn"
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, world_size: int, tmp: str, target: Callable, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = target(*args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Planning at scale: a run's per-rank peak and largest micro-batch, checkpointing off and on
# --------------------------------------------------------------------------------------------


def run_strategy(strategy: str) -> str:
    """predict_sharded's name for a ledger.run strategy name (ledger.run.sharding)."""
    return "ddp" if strategy in ("ddp", "auto", "single_device") else strategy


def toy_inputs(run) -> tuple[nn.Module, Callable[[int], object], OptimizerSpec]:
    """A ledger.run.Run of lmledger's ToyLM as the dry run takes it: the model on the meta device (nothing
    allocated, activation checkpointing off: at_scale adds it), a meta batch of b windows, LitLM's
    optimizer as a factory."""
    from lmledger.model import ToyLM

    with torch.device("meta"):
        model = ToyLM(dataclasses.replace(run.config, activation_checkpointing=0))

    def batch_for(size: int) -> object:
        ids = torch.empty((size, run.seq_len), dtype=torch.long, device="meta")
        return ids, ids.clone()

    fused = bool(run.fused_optimizer)
    if run.optimizer in ("adamw", "adam"):
        kind = torch.optim.AdamW if run.optimizer == "adamw" else torch.optim.Adam

        def optimizer(params):
            return kind(params, lr=1e-4, fused=fused)
    elif run.optimizer == "sgd":

        def optimizer(params):
            return torch.optim.SGD(params, lr=1e-4, momentum=run.momentum, fused=fused)
    else:
        optimizer = None
    return model, batch_for, optimizer


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
    ddp: DDPSettings = DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
    labels: tuple[str, str] = ("as configured", "every block checkpointed"),
) -> dict:
    """One rank's ledger at `batch_size` per rank and, given a capacity, its largest micro-batch, with the
    model as it is (labels[0]) and with every block checkpointed (labels[1]): a JSON-ready dict. A case
    the dry run cannot model carries `not_predicted` (one line) instead of numbers."""
    name = run_strategy(strategy)
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
            "peak_checked": ledger.peak_checked, "not_predicted": None,
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
    return {"strategy": name, "world_size": world_size, "batch_size": batch_size, "capacity_bytes": capacity_bytes,
            "cases": cases}  # fmt: skip


def run_at_scale(
    run, capacity_bytes: int | None = None, labels: tuple[str, str] = ("off", "on"), **settings: object
) -> dict:
    """at_scale for a ledger.run.Run of lmledger's ToyLM (toy_inputs): its world size, strategy, precision and
    optimizer, the config's batch per rank; checkpointing off and on (labels). `settings`: at_scale's ddp,
    fsdp, or a strategy name that replaces the run's."""
    model, batch_for, optimizer = toy_inputs(run)
    settings.setdefault("strategy", run.strategy)
    return at_scale(
        model, batch_for, run.batch_size, world_size=run.world_size, optimizer=optimizer,
        precision=run.precision, capacity_bytes=capacity_bytes, labels=labels, **settings,
    )  # fmt: skip
