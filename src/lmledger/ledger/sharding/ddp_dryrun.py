"""One DDP rank's training step on fake tensors: the single-device dry run plus DDP's gradient buckets.

The module ledger.sharding.ddp predicts the buckets from DDP's settings. Here they are made on the fake copy,
filled as torch's Reducer fills them. Sources: torch 2.13, nn/parallel/distributed.py and
csrc/distributed/c10d/reducer.cpp.

The Reducer's autograd hook runs after each parameter's gradient is accumulated. Here that is a
post-accumulate-grad hook. It copies the gradient, divided by W, into its bucket view
(mark_variable_ready_dense's mul_out). With gradient_as_bucket_view, `param.grad` then becomes that
view. Once it already is one, nothing is copied.

The hook does nothing unless the forward before it prepared the Reducer for a backward. That is
`expect_autograd_hooks_`, set by prepare_for_backward in DDP's _post_forward. It is set only while
`require_backward_grad_sync`, which `no_sync()` clears. Under no_sync the gradients accumulate in
`param.grad` as on one device. After zero_grad(set_to_none) they are new tensors beside the buckets,
even with gradient_as_bucket_view. The synced backward after them copies them in. With bucket views, it
also frees them. Real gloo ranks hold this (tests/ledger/test_ddp_accumulate.py).

Lightning's automatic optimization runs every micro-batch of an optimizer step but the last under
no_sync. See loops/optimization/automatic.py, _block_parallel_sync_behavior ->
DDPStrategy.block_backward_sync. So the buckets fill in the last micro-batch's backward only. Under
gradient accumulation the bucket views then save nothing in the micro-batches. They save the second
copy in the first micro-batch's forward and in the optimizer step.

Under manual optimization every manual_backward prepares the Reducer (DDPStrategy.pre_backward ->
overrides.distributed.prepare_for_backward). The exception is when the DDP wrapper's
require_backward_grad_sync is off then: a training_step's own `trainer.strategy.block_backward_sync()`.
`synced` tells the emulation.

The buckets are the steady state's, alive from the start. They are rebuilt in gradient-ready order,
read from one fake backward first. With find_unused_parameters and no static graph they are the first
ones, never rebuilt. No process group is needed: the all-reduce is in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun import fakecopy, manualopt
from lmledger.ledger.dryrun.engine import NotTraced, StepFn
from lmledger.ledger.sharding.ddp import Bucket, DDPSettings, bucket_bytes, initial_buckets, rebuilt_buckets
from lmledger.ledger.sharding.rankstate import FakeCopy, ShardedLedger, sharded_ledger, sharded_tracking

__all__ = ["predict_ddp"]


def _reduced(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP reduces: those that need grad, each shared one once, in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


def _always() -> bool:
    return True


class _EmulatedReducer:
    """DDP's Reducer on a fake copy: flat bucket buffers, filled as each gradient is accumulated.

    They fill only while `syncing()` says the backward running is a synchronised one (module docstring).
    """

    def __init__(self, model: nn.Module, settings: DDPSettings, world_size: int) -> None:
        self.model, self.settings, self.world_size = model, settings, world_size
        self.params = _reduced(model)
        self.syncing: Callable[[], bool] = _always
        self.ready: list[int] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.buckets: list[Bucket] = []
        self.buffers: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}

    def build(self, ready_order: list[int] | None) -> None:
        """Allocate the steady-state buckets and each parameter's view.

        They are rebuilt in gradient-ready order. With find_unused_parameters and no static graph they are the
        first ones: the Reducer never rebuilds those (should_rebuild_buckets).
        """
        sizes = [(p.numel() * p.element_size(), str(p.dtype)) for p in self.params]
        settings = self.settings
        if settings.find_unused_parameters and not settings.static_graph:
            self.buckets = initial_buckets(sizes, settings)
        else:
            self.buckets = rebuilt_buckets(sizes, settings, ready_order)
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

    def no_sync_before_last(self, step: StepFn, accumulate: int) -> StepFn:
        """`step` as Lightning runs the micro-batches of one optimizer step under DDP.

        Every forward but each `accumulate`-th runs under no_sync. So only the last micro-batch's backward fills
        the buckets. As in DDP, the forward decides it.
        """
        calls = itertools.count()
        sync = [True]
        self.syncing = lambda: sync[0]

        def scheduled(model: nn.Module, batch: object) -> object:
            sync[0] = next(calls) % accumulate == accumulate - 1
            return step(model, batch)

        return scheduled

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.syncing():  # no_sync: the Reducer expects no hook; the grad stays in param.grad
                return
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


def predict_ddp(
    module: nn.Module,
    batch: object,
    *,
    step: StepFn | None,
    optimizer: object,
    precision: str | int,
    world_size: int,
    settings: DDPSettings,
    device: torch.device | str | None,
    accumulate: int = 1,
    manual: bool = False,
    synced: Callable[[], bool] | None = None,
) -> ShardedLedger | NotTraced:
    """One DDP rank's steady-state step (module docstring); arguments as ledger.sharding.sharded.predict_sharded."""
    if world_size == 1:
        single = dryrun.dry_run(
            module, batch, step=step, optimizer=optimizer, precision=precision, device=device,
            accumulate=accumulate, manual=manual,
        )  # fmt: skip
        return single if isinstance(single, NotTraced) else sharded_ledger(single, "ddp", 1)
    fake = FakeCopy(module, batch, step, optimizer, precision, device, manual=manual)
    if isinstance(fake.error, NotTraced):
        return fake.error
    reducer = _EmulatedReducer(fake.model, settings, world_size)
    try:
        # The bucket order: the order gradients become ready, read from one fake backward first.
        order = _ready_order(fake, reducer)
        if isinstance(order, NotTraced):
            return order
        with fake.mode:
            reducer.build(order)
        if manual:
            reducer.syncing, run = synced or _always, fake.step
        else:
            run = reducer.no_sync_before_last(fake.step or dryrun.default_step, accumulate)
        with sharded_tracking(tuple(reducer.buffers)):
            result = fake.ledger(run, accumulate)
    finally:
        reducer.remove()
    if isinstance(result, NotTraced):
        return result
    buckets = tuple(reducer.buckets)
    return sharded_ledger(result, "ddp", world_size, buckets=buckets, comm_buffers=bucket_bytes(buckets))


def _ready_order(fake: FakeCopy, reducer: _EmulatedReducer) -> list[int] | NotTraced:
    """The order gradients become ready in one synchronised backward, on a throwaway step.

    The reducer's hooks record it. The step is a forward and backward. Under manual optimization it is one
    call of the module's own step.
    """
    try:
        with fake.mode, torch.compiler.set_stance("force_eager"), fakecopy.eager_library_decisions():
            if fake.manual:
                with manualopt.ManualOptimization(fake.model, [o for o in fake.optimizers if o is not None]):
                    fake.step(fake.model, fake.batch)
            else:
                loss = dryrun.loss_of((fake.step or dryrun.default_step)(fake.model, fake.batch))
                loss.backward()
    except Exception as err:
        return NotTraced(f"the step does not run on fake tensors: {dryrun.why(err)}")
    fake.model.zero_grad(set_to_none=True)
    order = list(reducer.ready)
    seen = set(order)
    return order + [i for i in reversed(range(len(reducer.params))) if i not in seen]
