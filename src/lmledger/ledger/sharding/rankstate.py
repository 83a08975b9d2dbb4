"""One rank's share of a data-parallel step.

The sharded dry run (ledger.sharding.sharded, ledger.sharding.ddp_dryrun, ledger.sharding.fsdp2) counts it. So does its
measured twin on real ranks (ledger.sharding.realranks). Both use:

    ShardedLedger    a StepLedger of one rank at world size W, and what sharding added
    strategy names   the ones traced, the state-only ones, the ones not modelled
    local shards     a DTensor's untyped_storage() is its global size, so state and live bytes are
                     read from `_local_tensor`. Storages FSDP resizes outside any operator
                     (UntypedStorage.resize_, its unsharded parameters) are followed (canary in
                     tests/ledger/test_sharded.py). DDP's bucket buffers are live from the start.
    FakeCopy          the dry run's fake copy of model, batch and optimizers, optionally wrapped
                     (fully_shard)

Pure torch: no Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from lmledger.errors import UserError
from lmledger.ledger.count import flopcounter
from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun import fakecopy, manualopt
from lmledger.ledger.dryrun.engine import NotTraced, OptimizerSpec, StepLedger
from lmledger.ledger.dryrun.watch import Reading
from lmledger.ledger.sharding.ddp import Bucket
from lmledger.ledger.sharding.schedule import Pipeline

__all__ = [
    "LOCAL_SHARDS",
    "ShardedTracker",
    "following_resizes",
    "local_flops",
    "NOT_MODELLED",
    "STATE_ONLY",
    "TRACED",
    "FakeCopy",
    "ShardedLedger",
    "local_state_bytes",
    "made_optimizers",
    "optimizer_factory",
    "sharded_ledger",
    "sharded_tracking",
    "strategy_name",
]

TRACED = ("ddp", "fsdp2")
STATE_ONLY = ("zero1", "zero2", "zero3", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
NOT_MODELLED = {
    "tensor": "tensor parallelism",
    "pipeline": "pipeline parallelism",
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
}


@dataclass(frozen=True)
class ShardedLedger(StepLedger):
    """A StepLedger of one rank at `world_size`, and what sharding added.

    Fields beyond StepLedger's:

        buckets        DDP's steady-state buckets (ledger.sharding.ddp.Bucket), empty otherwise
        comm_buffers   DDP: the bucket buffers. FSDP2: the largest unit's all-gather output plus its
                       reduce-scatter input (both W padded shards long), sized from the FSDP state.
                       (The peak counts the buffers themselves as they are allocated.)
        peak_checked   False where the peak is the single-device step's with the sharded state
                       swapped in (DeepSpeed, FSDP1): not yet held to a measurement
        tensor_parallel  the mesh's tensor-parallel size (1: data parallel only); world_size counts
                       every rank, data_parallel x tensor_parallel
        pipeline, pipeline_rank   strategy "pipeline" (ledger.sharding.pipeline): the schedule, and which of its
                       stages this rank is; comm_buffers are then the receive buffers the stage keeps
    """

    strategy: str = "ddp"
    world_size: int = 1
    buckets: tuple[Bucket, ...] = ()
    comm_buffers: int = 0
    peak_checked: bool = True
    tensor_parallel: int = 1
    pipeline: Pipeline | None = None
    pipeline_rank: int = 0


def sharded_ledger(result: StepLedger, strategy: str, world_size: int, *, state=None, **extra) -> ShardedLedger:
    """`result` as a ShardedLedger. `state` (params/grads/optimizer bytes), if given, replaces its own."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(StepLedger)}
    if state:
        fields.update(state)
    return ShardedLedger(**fields, strategy=strategy, world_size=world_size, **extra)


def strategy_name(strategy: str) -> str | NotTraced:
    """The sharded dry run's name for a strategy: "ddp", "fsdp2" or one of STATE_ONLY.

    NotTraced for one it does not model. An unknown name is a UserError.
    """
    name = str(strategy).lower().removesuffix("strategy").strip("_")
    for key, what in NOT_MODELLED.items():
        if name.startswith(key) and what == "tensor parallelism":  # it is FSDP2's, with a 2-D mesh
            return NotTraced(
                f"{strategy}: tensor parallelism is predicted as strategy 'fsdp2' with "
                "FSDPSettings(tensor_parallel=T); as named, the run is measured only"
            )
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
    """A DTensor's local shard (what this rank allocates); a collective's AsyncCollectiveTensor its result
    (a wrapper without storage of its own); anything else as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    shard = getattr(t, "_local_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    elem = getattr(t, "elem", None)
    return elem if type(t).__name__ == "AsyncCollectiveTensor" and isinstance(elem, torch.Tensor) else t


def local_state_bytes(model: nn.Module, optimizer: object) -> dict[str, int]:
    """measure_state_bytes on each rank's own shards: params, their .grad and optimizer state.

    `optimizer` is one, None, or a list under manual optimization. Local storages count once each.
    0-dim `step` counters are left out.
    """
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    states = []
    for opt in (o for o in optimizers if o is not None):
        for per_param in opt.state.values():
            states += [_local(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _unique(params), "grads": _unique(grads), "optimizer": _unique(states)}


def _unique(tensors: list) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())
    return sum(seen.values())


class ShardedTracker(MemoryTracker):
    """MemoryTracker on local shards.

    Its `extra` storages (DDP's buckets) are live from the start. It follows UntypedStorage.resize_
    while it runs: FSDP2 allocates and frees unsharded parameters so.
    """

    extra: tuple[torch.Tensor, ...] = ()
    active: list[ShardedTracker] = []

    def track(self, *objects):
        tensors: list[torch.Tensor] = []
        for obj in _optimizers_spread(objects):
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
        ShardedTracker.active.append(self)
        return self

    def stop(self):
        if self in ShardedTracker.active:
            ShardedTracker.active.remove(self)
        super().stop()

    def resized(self, storage: torch.UntypedStorage) -> None:
        if self.running:
            self._add(storage)  # new, or a tracked one at its new size
            self._raise_peak()


def _optimizers_spread(objects: tuple) -> list:
    """`objects` with a list of optimizers (manual optimization's) spread out.

    Each is then read by its local shards. A list would be read as plain tensors, at a DTensor's global size.
    """
    out: list = []
    for obj in objects:
        listed = isinstance(obj, (list, tuple)) and obj and all(isinstance(o, torch.optim.Optimizer) for o in obj)
        out += list(obj) if listed else [obj]
    return out


_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_seen(storage: torch.UntypedStorage, size: int):
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in ShardedTracker.active:
        tracker.resized(storage)
    return out


def following_resizes():
    """While it is open, ShardedTrackers see UntypedStorage.resize_ (FSDP2's unsharded parameters)."""
    return mock.patch.object(torch.UntypedStorage, "resize_", _resize_seen)


# torch.distributed's one-tensor collectives FSDP2 and DDP's comm hooks call synchronously
_SYNC_COLLECTIVES = ("reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor", "all_gather_into_tensor",
                     "all_reduce")  # fmt: skip
_LET_GO_S = 2.0  # the most a collective waits for gloo's thread (it lets go within microseconds unless descheduled)


@contextmanager
def collectives_let_go() -> Iterator[None]:
    """While it is open, a synchronous collective returns once the backend's threads have let go of its tensors.

    gloo runs a collective on a worker thread that wakes the caller, then drops its references to the tensors: on a
    busy machine the caller may run on first, and a buffer the program has already freed (FSDP2's reduce-scatter
    input) dies later, in that thread, beside the next allocation. So a real gloo rank's measured peak depended on
    thread timing; now a buffer dies when the program lets it go, as the prediction's fake group has it."""
    import time

    import torch.distributed as dist

    def waiting(collective):
        def call(*args, **kwargs):
            if kwargs.get("async_op") or not _on_gloo(kwargs.get("group")):
                return collective(*args, **kwargs)  # NCCL keeps its tensors until the GPU is done: not this race
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            before = [_holders(t) for t in tensors]
            out = collective(*args, **kwargs)
            deadline = time.monotonic() + _LET_GO_S
            while time.monotonic() < deadline:
                if all(_holders(t) <= n for t, n in zip(tensors, before, strict=True)):
                    break
                time.sleep(1e-5)
            return out

        return call

    with ExitStack() as stack:
        for name in _SYNC_COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, waiting(getattr(dist, name))))
        stack.enter_context(_functional_collectives_let_go())
        yield


# The functional collectives whose output is fresh from the op and alone in its Work (DTensor's, context parallel's):
# not the coalesced ones, whose Work holds a list, nor the point-to-point ones, which return the caller's tensor.
_FRESH_OUTPUT_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")


@contextmanager
def _functional_collectives_let_go() -> Iterator[None]:
    """The same for DTensor's functional collectives (tensor parallelism), which return their output before it is
    done: on a gloo group each is waited for as it is issued (as under tracing), and returns once its Work, which
    holds the output and the inputs, is gone. The output is fresh from the collective, so that is when nothing but
    the caller holds it. A Work lives in torch's registry until its wait, then in gloo's thread a moment longer."""
    import time

    import torch.distributed._functional_collectives as funcol

    original = funcol._maybe_wrap_tensor
    fresh = _holders(torch.empty(1))  # a tensor one Python object holds, as the caller holds the output
    inside: list[str] = []  # the fresh-output collective being issued, if any

    def wrap(tensor):
        if not inside or tensor.device.type != "cpu" or not _on_gloo(None):
            return original(tensor)  # NCCL keeps its tensors until the GPU is done; the fake group holds none
        with torch.no_grad():
            funcol.wait_tensor(tensor)
        deadline = time.monotonic() + _LET_GO_S
        while _holders(tensor) > fresh and time.monotonic() < deadline:
            time.sleep(1e-5)
        return original(tensor)

    def issuing(name, collective):
        def call(*args, **kwargs):
            inside.append(name)
            try:
                return collective(*args, **kwargs)
            finally:
                inside.pop()

        return call

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(funcol, "_maybe_wrap_tensor", wrap))
        for name in _FRESH_OUTPUT_COLLECTIVES:
            if hasattr(funcol, name):
                stack.enter_context(mock.patch.object(funcol, name, issuing(name, getattr(funcol, name))))
        yield


def _on_gloo(group: object) -> bool:
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # no process group
        return False


def _holders(tensor: torch.Tensor) -> int:
    """How many references hold the tensor and its storage (the backend's copies of it, or views)."""
    return tensor._use_count() + torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@contextmanager
def _real_rank_tracking() -> Iterator[None]:
    """What a rank's tracker needs open on real ranks: FSDP2's resizes seen, collectives' buffers let go."""
    with following_resizes(), collectives_let_go():
        yield


def _count_local_without_decomposing(self, func, types, args=(), kwargs=None):
    """ledger.count.flopcounter's counter of a real step (StepFlopCounter's mode), on the local shards."""
    out = func(*args, **(kwargs or {}))
    packet = func._overloadpacket
    if packet in self.counter.flop_registry:
        local = lambda tree: tree_map(_local, tree)  # noqa: E731
        count = self.counter.flop_registry[packet](*local(args), **local(kwargs or {}), out_val=local(out))
        self.counter.flop_counts["Global"][packet] += count
    return out


def local_flops():
    """While open, the step's FLOP counter (count.flopcounter.StepFlopCounter) counts a DTensor op (TP's
    matmuls) at its local shards' shapes: it sees the op before DTensor runs it, at the global shapes."""
    return mock.patch.object(
        flopcounter._CountWithoutDecomposing, "__torch_dispatch__", _count_local_without_decomposing
    )


@contextmanager
def sharded_tracking(extra: tuple[torch.Tensor, ...] = ()) -> Iterator[None]:
    """Make the dry run's (and measure's) MemoryTracker a ShardedTracker with `extra` storages.

    It patches both the automatic step's tracker (dryrun) and the manual one's (manualopt). FLOPs are
    counted on local shards too: the FLOP counter sees a DTensor op at its global shapes.
    """
    tracker_type = type("_Tracker", (ShardedTracker,), {"extra": extra})
    with (
        mock.patch.object(dryrun, "MemoryTracker", tracker_type),
        mock.patch.object(manualopt, "MemoryTracker", tracker_type),
        local_flops(),
        _real_rank_tracking(),
    ):
        yield


# A rank's tensors by their local shards, for the one step reader (dryrun.watch): a fit's FSDP2 or
# tensor-parallel rank reads its step so.
LOCAL_SHARDS = Reading(
    tracker=ShardedTracker, state=local_state_bytes, while_tracking=_real_rank_tracking, while_counting=local_flops
)


# --------------------------------------------------------------------------------------------
# The fake copy, wrapped
# --------------------------------------------------------------------------------------------


class FakeCopy:
    """The dry run's fake copy of the model, batch and optimizer (fakecopy.fake_copy and friends).

    `wrap(model)`, if given, runs on the fake copy before its optimizer is made. Example: fully_shard, as
    configure_model does. The optimizer then sees the DTensor parameters.

    `ledger()` is dryrun's step on them: `accumulate` micro-batches per optimizer step. With `manual`, it
    is the module's own training step (`optimizer` may be a list).
    """

    def __init__(self, module, batch, step, optimizer, precision, device, wrap=None, manual=False) -> None:
        self.error: NotTraced | None = None
        self.step, self.manual = step, manual
        self.dtype, self.autocast = fakecopy.precision_dtypes(precision)
        self.target = fakecopy.target_device(module, device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.state: dict[str, int] | None = None
        configured = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if len(configured) > 1 and not manual:
            raise UserError(
                f"{len(configured)} optimizers: Lightning steps several optimizers only under manual optimization"
            )
        try:
            self.model, memo = fakecopy.fake_copy(module, self.mode, self.target, self.dtype)
            self.batch = fakecopy.map_tensors(
                lambda t: fakecopy.fake_tensor(t, self.mode, self.target), fakecopy.cast_batch(batch, self.dtype)
            )
            with self.mode:
                if wrap is not None:
                    wrap(self.model)
                made = [optimizer_factory(o, module) if wrap is not None else o for o in configured]
                self.optimizers = [fakecopy.fake_optimizer(o, self.model, memo, self.target) for o in made]
        except UserError:
            raise
        except Exception as err:
            self.error = NotTraced(f"could not copy the model onto fake tensors: {dryrun.one_line(err)}")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0]

    def ledger(self, step=None, accumulate: int = 1) -> StepLedger | NotTraced:
        """The dry run's step on the fake copy. `step`, if given, replaces the run's own."""
        step = step or self.step
        try:
            with self.mode, torch.compiler.set_stance("force_eager"), fakecopy.RealOutputStorages():
                with fakecopy.eager_library_decisions():
                    if self.manual:
                        result = manualopt.ledger_of_manual_step(
                            self.model, self.batch, step, self.optimizers, self.autocast, self.target
                        )
                    else:
                        result = dryrun.ledger_of_step(
                            self.model, self.batch, step, self.optimizer, self.autocast, self.target, accumulate
                        )
        except UserError:
            raise
        except Exception as err:
            return NotTraced(f"the step does not run on fake tensors: {dryrun.why(err)}")
        self.state = local_state_bytes(self.model, self.optimizers)
        return dataclasses.replace(result, **self.state)


def optimizer_factory(optimizer: OptimizerSpec, module: nn.Module) -> OptimizerSpec:
    """An optimizer over the real module becomes a factory: the same kind over the sharded parameters.

    It takes its first group's hyperparameters. Per-group settings follow by position.
    """
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


def made_optimizers(optimizer: object, module: nn.Module, params: list[nn.Parameter]) -> list:
    """The run's optimizers over `params` (a copy's). `optimizer` is one spec, None, or a list (manual)."""
    specs = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    made = [optimizer_factory(spec, module) for spec in specs]
    return [spec(params) if spec is not None else None for spec in made]


def priced_rank(found: StepLedger, model: nn.Module) -> tuple:
    """What the GPU op model prices of one rank's dry run `found` of `model` (ledger/timing/gpu/layout.py): (its ops,
    each gradient's bytes in the order backward makes them, the forward's FLOPs, (state, activations, peak) bytes).
    The gradients are the rank's total shared as the parameters' sizes are (TP splits most of them alike), the last
    layer's first."""
    total = int(found.grads or 0)
    numels = [p.numel() for p in model.parameters()]
    grads = tuple(int(total * n / sum(numels)) for n in reversed(numels)) if numels else ()
    state = int(found.params or 0) + total + int(found.optimizer or 0)
    return found.ops, grads, int(found.flops_forward or 0), (state, int(found.activations or 0), int(found.peak or 0))
