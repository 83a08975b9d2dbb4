"""The sharded dry run's measured twin: one rank of a real process group, and W gloo ranks on this CPU.

`measure_sharded` runs the step predict_sharded predicts, on this rank of the initialised (real)
default process group. It runs real steps on a copy of the module, wrapped in torch's
DistributedDataParallel or fully_shard. The trackers are the same (ledger.sharding.rankstate).

Under DDP it drives the wrapper as Lightning does. Under automatic optimization, the micro-batches of an
optimizer step but the last run under no_sync. Under manual optimization, the module's own training
step runs inside DDP's forward. The Reducer is then prepared at each manual_backward. `measure_pipeline` is
the twin of a pipeline rank (ledger.sharding.pipeline): torch.distributed.pipelining's stage and schedule on this
rank. `spawn_gloo_ranks` starts W gloo processes on this CPU for them. Pure torch: no Lightning import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import tempfile
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun import fakecopy, manualopt
from lmledger.ledger.dryrun.engine import StepFn, StepLedger
from lmledger.ledger.sharding import pipeline, tp
from lmledger.ledger.sharding.ddp import Bucket, DDPSettings
from lmledger.ledger.sharding.fsdp2 import DEFAULT_FSDP, FSDPSettings, fsdp_units, make_mesh, shard_model
from lmledger.ledger.sharding.rankstate import (
    ShardedLedger,
    local_state_bytes,
    made_optimizers,
    sharded_ledger,
    sharded_tracking,
    strategy_name,
)
from lmledger.ledger.sharding.schedule import Pipeline

__all__ = ["measure_pipeline", "measure_sharded", "spawn_gloo_ranks"]

_DEFAULT_DDP = DDPSettings()


def measure_sharded(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None = None,
    optimizer: object = None,
    precision: str | int = "32-true",
    strategy: str = "ddp",
    ddp: DDPSettings = _DEFAULT_DDP,
    fsdp: FSDPSettings = DEFAULT_FSDP,
    accumulate: int = 1,
    manual: bool = False,
) -> ShardedLedger:
    """The twin of predict_sharded, on this rank of the initialised (real) default process group.

    See the module docstring. Under DDP it runs two optimizer steps first: the Reducer rebuilds its buckets
    at the second forward. Then come dryrun's two steps, the second tracked. A comm hook all-reduces as
    DDP's default one does. It hands over each bucket buffer, which the tracker counts from the start.
    Under FSDP2 it runs dryrun's two steps on the sharded copy.
    """
    import torch.distributed as dist

    model = _copy_in_precision(module, precision)
    if strategy_name(strategy) == "fsdp2":
        return _measure_fsdp2(model, module, batch, step, optimizer, precision, fsdp, accumulate, manual)
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    dtype, autocast = fakecopy.precision_dtypes(precision)
    device = fakecopy.target_device(model, None)
    batch = fakecopy.cast_batch(batch, dtype)
    wrapped = _ManualStep(model, step) if manual else _StepModule(model, step or dryrun.default_step)
    # As Lightning's DDPStrategy runs a LightningModule: DDP wraps a module whose forward is the step, so
    # the Reducer's forward bookkeeping runs (lightning/pytorch/overrides/base.py _LightningModuleWrapperBase).
    ddp_model = DistributedDataParallel(wrapped, **dataclasses.asdict(ddp))
    buffers = _hand_over_buffers(ddp_model, world)
    opts = made_optimizers(optimizer, module, list(model.parameters()))
    if manual:
        wrapped.wrapper = weakref.ref(ddp_model)
        if not hasattr(type(model), "trainer"):  # a plain module: what its step reaches through self.trainer
            model.trainer = SimpleNamespace(strategy=_DDPStrategyStandIn(ddp_model))
        run = _manual_forward(ddp_model)
        for _ in range(2):  # buckets built, rebuilt (second forward) and handed over
            buffers.clear()
            with manualopt.ManualOptimization(model, [o for o in opts if o is not None]):
                run(model, batch)
        with sharded_tracking(tuple(buffers.values())):
            result = manualopt.ledger_of_manual_step(model, batch, run, opts, autocast, device)
    else:
        run = _no_sync_before_last(ddp_model, accumulate)
        for _ in range(2):
            buffers.clear()
            _train_step(ddp_model, batch, run, opts[0], accumulate)
        with sharded_tracking(tuple(buffers.values())):
            result = dryrun.ledger_of_step(ddp_model, batch, run, opts[0], autocast, device, accumulate)
    return _ddp_ledger(result, ddp_model, buffers, world)


def _copy_in_precision(module: nn.Module, precision: str | int) -> nn.Module:
    """A deep copy of `module`, cast to a *-true precision's dtype."""
    import copy

    model = copy.deepcopy(module)
    dtype, _ = fakecopy.precision_dtypes(precision)
    if dtype is not None:
        model.to(dtype)
    return model


def _measure_fsdp2(model, module, batch, step, optimizer, precision, fsdp, accumulate=1, manual=False) -> ShardedLedger:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dtype, autocast = fakecopy.precision_dtypes(precision)
    device = fakecopy.target_device(model, None)
    tensor_parallel = fsdp.tensor_parallel
    with tp.meshes_outside_fake_mode():  # the same code path as the prediction's (a no-op without fake mode)
        shard_model(model, make_mesh(init_device_mesh, world, fsdp.shard_size, tensor_parallel), fsdp)
    opts = made_optimizers(optimizer, module, list(model.parameters()))
    batch = fakecopy.cast_batch(batch, dtype)
    # As Lightning's ModelParallelStrategy runs it: every micro-batch's backward reduce-scatters (its
    # block_backward_sync is ParallelStrategy's, a no-op for an FSDPModule), every manual_backward too.
    with sharded_tracking():
        if manual:
            result = manualopt.ledger_of_manual_step(model, batch, step, opts, autocast, device)
        else:
            result = dryrun.ledger_of_step(model, batch, step, opts[0], autocast, device, accumulate)
    state = local_state_bytes(model, opts)
    units = fsdp_units(model)
    return sharded_ledger(
        dataclasses.replace(result, **state), "fsdp2", world, comm_buffers=max(units, default=0) * 2,
        tensor_parallel=tensor_parallel,
    )  # fmt: skip


def measure_pipeline(
    chunks: list,
    batch: tuple,
    *,
    pipe: Pipeline,
    loss_fn: Callable,
    optimizer: Callable,
    precision: str | int = "32-true",
) -> ShardedLedger:
    """The twin of pipeline.predict_pipeline, on this rank of the initialised (real) default process group of
    pipe.stages ranks: torch.distributed.pipelining's PipelineStage over this rank's chunks (of all pp x v
    `chunks`), run by the schedule's torch class for two optimizer steps (torchtitan's order: zero_grad,
    schedule.step(return_outputs=False), optimizer step), read by pipeline.read_rank_step."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank = dist.get_rank()
    dtype, autocast = fakecopy.precision_dtypes(precision)
    mine = [_copy_in_precision(c, precision) for c in pipeline.rank_chunks(chunks, pipe, rank)]
    device = fakecopy.target_device(mine[0], None)
    stages = [pipelining.PipelineStage(c, n * pipe.stages + rank, pipe.chunks, device) for n, c in enumerate(mine)]
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}.get(pipe.schedule)
    schedule = (
        kind(stages[0], pipe.micro_batches, loss_fn=loss_fn) if kind
        else pipelining.ScheduleInterleaved1F1B(stages, pipe.micro_batches, loss_fn=loss_fn)
    )  # fmt: skip
    model = nn.ModuleList(mine)
    opt = optimizer(list(model.parameters()))
    inputs, targets = fakecopy.cast_batch(batch, dtype)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    announce = [lambda phase: None]  # the reader's mark, told each action as the prediction tells its own
    for stage in stages:
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            setattr(stage, name, _announced(getattr(stage, name), announce, phase))

    def step(mark: Callable[[str], None]) -> list | None:
        announce[0] = mark
        losses = [] if last else None
        schedule.step(*((inputs,) if first else ()), **({"target": targets} if last else {}), losses=losses,
                      return_outputs=False)  # fmt: skip
        return losses

    def kept() -> list[torch.Tensor]:  # the receive buffers each stage made at the first step
        infos = [i for s in stages for r in (*s.args_recv_info.values(), *s.grad_recv_info.values()) for i in r]
        return [i.buffer for i in infos if not i.is_root_arg and i.buffer is not None]

    # The first schedule.step also runs each stage once more to learn its shapes (stage.py,
    # _forward_metadata_inference) and makes the receive buffers: a step first, so the two read are the steady ones.
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast, cache_enabled=False) if autocast else contextlib.nullcontext():
        step(announce[0])
    opt.step()
    result = pipeline.read_rank_step(model, opt, (inputs, targets), step, micro_batches=pipe.micro_batches,
                                     buffers=kept, autocast=autocast, device=device)  # fmt: skip
    return pipeline.pipeline_ledger(result, pipe, rank, kept())


def _announced(method: Callable, announce: list[Callable[[str], None]], phase: str) -> Callable:
    def run(*args, **kwargs):
        announce[0](phase)
        return method(*args, **kwargs)

    return run


def _hand_over_buffers(ddp_model: nn.Module, world: int) -> dict[int, torch.Tensor]:
    """Register a comm hook that does what DDP's default one does: divide, then all-reduce in place.

    It keeps each bucket's buffer in the dict returned, by bucket index.
    """
    import torch.distributed as dist

    buffers: dict[int, torch.Tensor] = {}

    def allreduce(_state, bucket):
        buffer = bucket.buffer()
        buffers[bucket.index()] = buffer
        buffer.div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp_model.register_comm_hook(None, allreduce)
    return buffers


def _ddp_ledger(result, ddp_model, buffers: dict[int, torch.Tensor], world: int) -> ShardedLedger:
    """The measured step with the Reducer's rebuilt buckets as DDP logs them (else the buffers' sizes)."""
    sizes = tuple(b.numel() * b.element_size() for _, b in sorted(buffers.items()))
    logging = ddp_model._get_ddp_logging_data()
    logged = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "")
    buckets = tuple(Bucket("", (), int(s)) for s in str(logged).split(", ") if s) or tuple(
        Bucket("", (), s) for s in sizes
    )
    return sharded_ledger(result, "ddp", world, buckets=buckets, comm_buffers=sum(sizes))


def _train_step(ddp_model, batch, run: StepFn, opt, accumulate: int) -> None:
    """One optimizer step of `accumulate` micro-batches, in Lightning's order (dryrun.ledger_of_step's)."""
    for micro in range(accumulate):
        loss = run(ddp_model, batch) / accumulate
        if micro == 0:
            (opt or ddp_model).zero_grad(set_to_none=True)
        loss.backward()
        del loss
    if opt is not None:
        opt.step()


def _no_sync_before_last(ddp_model, accumulate: int) -> StepFn:
    """The DDP forward of each micro-batch, as Lightning's automatic optimization runs them.

    Every one but each `accumulate`-th runs under no_sync (_block_parallel_sync_behavior). The context
    no_sync() only clears require_backward_grad_sync. DDP reads that in its forward alone: _pre_forward and
    _post_forward decide whether the Reducer expects the backward's hooks. So setting it before each forward
    does the same.
    """
    calls = itertools.count()

    def run(model: nn.Module, batch: object) -> torch.Tensor:
        model.require_backward_grad_sync = next(calls) % accumulate == accumulate - 1
        try:
            return model(batch)
        finally:
            model.require_backward_grad_sync = True

    return run


class _StepModule(nn.Module):
    def __init__(self, module: nn.Module, step: StepFn) -> None:
        super().__init__()
        self.module, self.step = module, step

    def forward(self, batch: object) -> torch.Tensor:
        return dryrun.loss_of(self.step(self.module, batch))


class _ManualStep(nn.Module):
    """A manual-optimization training step as Lightning's DDPStrategy runs it inside DDP's forward.

    Each manual_backward first prepares the Reducer (DDPStrategy.pre_backward -> prepare_for_backward).
    After the step, the wrapper's require_backward_grad_sync is off until the outer forward returns
    (_DDPForwardRedirection). So DDP's own _post_forward prepares nothing.
    """

    def __init__(self, module: nn.Module, step: StepFn) -> None:
        super().__init__()
        self.module, self.step = module, step
        self.wrapper: Callable[[], nn.Module] = lambda: None  # the DDP wrapper (a weakref: not a submodule)

    def forward(self, batch: object) -> object:
        patched = self.module.manual_backward  # manualopt.ManualOptimization's

        ddp_model = self.wrapper()

        def manual_backward(loss: torch.Tensor, *args, **kwargs) -> None:
            _prepare_for_backward(ddp_model)
            patched(loss, *args, **kwargs)

        self.module.manual_backward = manual_backward
        try:
            return self.step(self.module, batch)
        finally:
            self.module.manual_backward = patched
            ddp_model.require_backward_grad_sync = False


class _DDPStrategyStandIn:
    """What a manual training step reaches through `self.trainer.strategy` under Lightning's DDPStrategy.

    That is the wrapper (`model`) and `block_backward_sync()`, its no_sync.
    """

    def __init__(self, ddp_model: nn.Module) -> None:
        self.model = ddp_model

    def block_backward_sync(self):
        return self.model.no_sync()


def _prepare_for_backward(ddp_model) -> None:
    """Lightning's overrides.distributed.prepare_for_backward (find_unused_parameters off)."""
    if torch.is_grad_enabled() and ddp_model.require_backward_grad_sync:
        ddp_model.require_forward_param_sync = True
        ddp_model.reducer._rebuild_buckets()
        ddp_model.reducer.prepare_for_backward([])
    else:
        ddp_model.require_forward_param_sync = False


def _manual_forward(ddp_model) -> StepFn:
    def run(model: nn.Module, batch: object) -> object:
        try:
            return ddp_model(batch)
        finally:
            ddp_model.require_backward_grad_sync = True  # _DDPForwardRedirection.on_after_outer_forward

    return run


def spawn_gloo_ranks(target: Callable, world_size: int, *args: object) -> list:
    """`target(*args)` on each of `world_size` processes of a gloo process group on this CPU.

    The processes are spawned, one thread each. Returns the list of their return values, by rank.
    `target` must be importable (a module-level function), and its result picklable.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _spawned_rank, args=(world_size, tmp, target, args), nprocs=world_size, join=True, start_method="spawn"
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, world_size: int, tmp: str, target: Callable, args: tuple) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts in C++ prints its Python stacks to the test's stderr
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = _without_ops(target(*args))
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        # No rank tears down while a peer's gloo threads still run its last collective (FSDP2's are async). A rank
        # that raised never gets here; spawn's join ends the others.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, tmp: str, target: Callable, args: tuple) -> None:
    """_rank_main in a process of its own, which then leaves without the interpreter's finalization: its result is
    on disk, and there objects still holding gloo groups (a mesh, FSDP2's state) are torn down beside gloo's
    threads. Twice in CI a rank aborted so, after a barrier, "terminate called without an active exception"
    (torch's #179291 is the same SIGABRT). A rank that raised leaves as spawn has it, with its traceback."""
    _rank_main(rank, world_size, tmp, target, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _without_ops(result: object) -> object:
    """`result` with every StepLedger's op list dropped: a real rank's ops hold what its collectives were
    called with (process groups), which cannot be pickled back to the parent, and no caller reads them."""
    if isinstance(result, StepLedger):
        return dataclasses.replace(result, ops=None)
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        changes = {f.name: _without_ops(getattr(result, f.name)) for f in dataclasses.fields(result) if f.init}
        return dataclasses.replace(result, **changes)
    if isinstance(result, dict):
        return {k: _without_ops(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)) and not hasattr(result, "_fields"):
        return type(result)(_without_ops(v) for v in result)
    return result
