"""Every op of one training step, once: its FLOPs, the bytes it reads and writes, and its category.

`OpRecorder` is a TorchDispatchMode the dry run (ledger/dryrun/engine.py) enters around its first step
(forward, backward, optimizer step). It sits below the step's FLOP counter (flopcounter.StepFlopCounter,
which decomposes nothing) on the mode stack. So it sees the ops the real step runs, and prices them with
the counter's formula registry. The per-op FLOPs of forward and backward sum to StepLedger.flops.
Bytes are sizes x element sizes of the op's tensor inputs (read) and outputs (written). Each storage
counts once per op, never above its size. Three views of one qkv buffer read it once. Views, metadata
queries and allocations move nothing.

Categories, shared with the measured side (ledger/timing/profile.py). It classifies profiler event names
("aten::mm") with the same function:
    matmul          mm, bmm, addmm, baddbmm, linear, convolution (and their backward), _scaled_mm
    attention       scaled_dot_product_attention and its fused kernels, forward and backward
    other           the rest of forward and backward: elementwise, norms, softmax, the loss, copies
    optimizer       everything inside optimizer.step (phase "optimizer step")
    communication   collectives (c10d ops), for a sharded step

`DispatchClock`, the outermost mode around the dry run's steady-state forward and backward (step 2), splits
their wall time into inside dispatch (the fake kernels, the modes below it) and outside: the model's own Python,
module calls and autograd's bookkeeping, which run alike on fake and real tensors. It is `OpSummary.outside`.
No Lightning import.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ATTENTION",
    "CATEGORIES",
    "COMMUNICATION",
    "MATMUL",
    "OPTIMIZER",
    "OTHER",
    "CategoryTotals",
    "DispatchClock",
    "OpRecord",
    "OpRecorder",
    "OpSummary",
    "Outside",
    "TensorSpec",
    "category_of",
    "signature_of",
]

MATMUL, ATTENTION, OTHER, OPTIMIZER, COMMUNICATION = "matmul", "attention", "other", "optimizer", "communication"
CATEGORIES = (MATMUL, ATTENTION, OTHER, OPTIMIZER, COMMUNICATION)

_MATMUL_OPS = frozenset(
    {
        "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear", "_addmm_activation",
        "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d", "mkldnn_convolution",
        "cudnn_convolution", "_scaled_mm", "_int_mm", "mkldnn_linear", "_mkldnn_linear",
    }
)  # fmt: skip
_ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
# Profiler names of collectives outside those namespaces (fsdp::all_gather_copy_in is a local copy, not one).
_COMMUNICATION_PREFIXES = ("nccl", "gloo", "record_param_comms")
# Ops that move no data: shape and metadata queries, fresh (uninitialized) allocations.
_FREE_OPS = frozenset(
    {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "size", "stride", "numel", "dim",
     "is_contiguous", "storage_offset", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
     "_local_scalar_dense", "set_", "resize_", "lift_fresh", "detach", "alias", "record_stream", "_unsafe_view",
     "_reshape_alias", "view_as_real", "view_as_complex"}
)  # fmt: skip
# Ops that overwrite their first argument without reading it.
_WRITE_ONLY_FIRST = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_"})


def _split_name(name: str) -> tuple[str, str]:
    """(namespace, base op name) of "aten.mm.default", "aten.mm", "aten::mm" or "mm"."""
    parts = name.replace("::", ".").split(".")
    if len(parts) == 1:
        return "aten", parts[0]
    return parts[0], parts[1]


def category_of(name: str) -> str:
    """The category of an op or profiler event name outside an optimizer step (module doc)."""
    namespace, op = _split_name(name)
    if namespace in _COMMUNICATION_NAMESPACES or name.lower().startswith(_COMMUNICATION_PREFIXES):
        return COMMUNICATION
    if any(mark in op for mark in _ATTENTION_MARKS):
        return ATTENTION
    if op in _MATMUL_OPS:
        return MATMUL
    return OTHER


@dataclass(frozen=True)
class OpRecord:
    """One op of the step.

    Its aten name ("aten.mm.default"), phase, category, FLOPs, and bytes read and written. `dtype` is
    the compute dtype ("float32", ...): the largest floating input's. `shapes`: a matmul's input
    shapes, for shape advice.
    """

    name: str
    phase: str
    category: str
    flops: int
    bytes_read: int
    bytes_written: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...] = ()
    # What a replay needs (ledger/timing/steptime): its arguments with each tensor as a TensorSpec, or why not.
    signature: tuple | None = None
    not_replayable: str = ""
    # (storage id, bytes) of each tensor argument in signature order, and of each output: how far back each
    # input was last touched, so a replay knows which inputs come from cache and which from memory. The ids
    # differ from run to run, so two records of the same op compare equal without them.
    storages: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    output_storages: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    # A collective's process group: its name (a mesh dimension's, "tensor_parallel", once the sharded dry run
    # names it) and size; what the time ledger needs to price it on the link it crosses (ledger/interconnect).
    group: str = field(default="", compare=False)
    group_size: int = 0
    # Dispatched in backward with grad mode on: activation checkpointing re-running a forward (the backward's own
    # ops run with it off), which the real step drives from Python again (ledger/timing/steptime/calibrate.py).
    recompute: bool = field(default=False, compare=False)
    # Dispatched on DTensors (TP's, FSDP2's parameters in the optimizer): the rank runs it through DTensor's
    # sharding propagation and its Python dispatch first, a host cost its local op does not pay (steptime/dtensor.py).
    dtensor: bool = field(default=False, compare=False)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _group_of(args: tuple) -> tuple[str, int]:
    """(name, size) of the process group a collective's arguments name: c10d's ops take the ProcessGroup,
    the functional ones (_c10d_functional, what DTensor runs) its registered name."""
    import torch.distributed as dist

    if not dist.is_available():
        return "", 0
    for arg in args:
        if isinstance(arg, torch.ScriptObject):  # c10d's ops see the group boxed
            try:
                arg = dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue  # another boxed argument (the ReduceOp)
        if isinstance(arg, dist.ProcessGroup):
            return arg.group_name, arg.size()
        if isinstance(arg, str):
            try:
                group = dist.distributed_c10d._resolve_process_group(arg)
            except (KeyError, RuntimeError, ValueError):
                continue
            return group.group_name, group.size()
    return "", 0


@dataclass(frozen=True)
class CategoryTotals:
    ops: int = 0
    flops: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Outside:
    """Wall seconds of a step's forward and backward spent outside dispatch, over `dispatches` top-level ops."""

    seconds: float
    dispatches: int


@dataclass(frozen=True)
class OpSummary:
    """The step's ops (in the order they ran) and their totals per category; `outside`: DispatchClock's measure of
    the step (None where the dry run took none)."""

    ops: tuple[OpRecord, ...] = ()
    by_category: dict[str, CategoryTotals] = field(default_factory=dict)
    outside: Outside | None = field(default=None, compare=False)  # a timing: two dry runs of one step compare equal

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def flops_in(self, *phases: str) -> int:
        return sum(op.flops for op in self.ops if op.phase in phases)

    @staticmethod
    def of(ops: list[OpRecord], outside: Outside | None = None) -> OpSummary:
        totals: dict[str, list[int]] = {c: [0, 0, 0] for c in CATEGORIES}
        for op in ops:
            row = totals[op.category]
            row[0] += 1
            row[1] += op.flops
            row[2] += op.bytes
        return OpSummary(tuple(ops), {c: CategoryTotals(*row) for c, row in totals.items()}, outside)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a replay rebuilds it: its layout on a storage of `storage_numel` elements."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    storage_numel: int
    device: str


class DispatchClock(TorchDispatchMode):
    """Wall time while entered, and the part of it spent dispatching top-level ops (module doc).

    Entered last, so first on the mode stack: every mode below it and the kernels count as inside; ops it
    dispatches are not seen again. Enter it once per span to time; `outside` sums the spans.
    """

    def __init__(self) -> None:
        super().__init__()
        self.wall_s = self.inside_s = 0.0
        self.dispatches = 0
        self._entered = 0.0

    def __enter__(self) -> DispatchClock:
        entered = super().__enter__()
        self._entered = time.perf_counter()
        return entered

    def __exit__(self, *exc) -> None:
        self.wall_s += time.perf_counter() - self._entered
        self._entered = 0.0
        return super().__exit__(*exc)

    @contextmanager
    def left_out(self) -> Iterator[None]:
        """A span that counts neither as wall time nor as dispatches (a manual step's optimizer step, whose Python
        the optimizer's own pricing holds); nothing while the clock is not entered."""
        start, inside, dispatches, entered = time.perf_counter(), self.inside_s, self.dispatches, self._entered
        try:
            yield
        finally:
            if entered:
                self.wall_s -= time.perf_counter() - start
                self.inside_s, self.dispatches = inside, dispatches

    @property
    def outside(self) -> Outside:
        return Outside(max(0.0, self.wall_s - self.inside_s), self.dispatches)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside_s += time.perf_counter() - start
            self.dispatches += 1


class NotReplayable(Exception):
    """An argument a replay cannot rebuild (a generator, a script object, a symbolic size)."""


_SCALARS = (bool, int, float, str, type(None))


def signature_of(tree: object) -> object:
    """An op's arguments with each tensor replaced by its TensorSpec: hashable, values never read."""
    if isinstance(tree, torch.Tensor):
        try:
            numel = tree.untyped_storage().nbytes() // max(1, tree.element_size())
            spec = TensorSpec(tuple(tree.shape), tuple(tree.stride()), int(tree.storage_offset()),
                              str(tree.dtype).removeprefix("torch."), int(numel), tree.device.type)  # fmt: skip
        except (RuntimeError, NotImplementedError, TypeError) as err:  # sparse, nested, symbolic
            raise NotReplayable(f"a {type(tree).__name__} argument without a strided layout") from err
        if tree.layout != torch.strided or tree.is_quantized:
            raise NotReplayable(f"a {tree.layout} tensor argument")
        return spec
    if isinstance(tree, _SCALARS):
        return tree
    if isinstance(tree, (list, tuple)):
        return tuple(signature_of(x) for x in tree) if isinstance(tree, tuple) else [signature_of(x) for x in tree]
    if isinstance(tree, dict):
        return {k: signature_of(v) for k, v in tree.items()}
    if isinstance(tree, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return tree
    raise NotReplayable(f"a {type(tree).__name__} argument")


def _frozen(tree: object) -> object:
    """signature_of's lists and dicts as tuples, so the record stays hashable."""
    if isinstance(tree, list):
        return ("__list__", tuple(_frozen(x) for x in tree))
    if isinstance(tree, dict):
        return ("__dict__", tuple((k, _frozen(v)) for k, v in tree.items()))
    if isinstance(tree, tuple):
        return tuple(_frozen(x) for x in tree)
    return tree


def _touched_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of these tensors, each storage counted once up to its size (views of one buffer share it)."""
    per_storage: dict[int, list[int]] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            key, cap = storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
            key, cap = id(t), t.numel() * t.element_size()
        row = per_storage.setdefault(key, [0, cap])
        row[0] += t.numel() * t.element_size()
    return sum(min(used, cap) for used, cap in per_storage.values())


def _storage_of(t: torch.Tensor) -> tuple[int, int]:
    """(t's storage's address, which names it while it lives (OpRecorder._id), the bytes t spans)."""
    try:
        key = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        key = id(t)
    return key, t.numel() * t.element_size()


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs.

    Tensors, lists and tuples of them, a kwargs dict: the shapes aten schemas allow. A hand-rolled walk
    costs a third of pytree's per op.
    """
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def _recomputing() -> bool:
    """Whether an op runs inside autograd's backward (a graph task is executing) with grad mode on: a checkpointed
    forward re-run (canary test_a_checkpoint_recompute_runs_in_a_graph_task_with_grad_on)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _local(tree: object) -> tuple[object, bool]:
    """(`tree` with each DTensor (TP's and FSDP2's sharded tensors) replaced by its local shard, whether it held one):
    an op on DTensors is recorded as the rank runs it, at its shards' shapes, bytes and FLOPs (DTensor's sharding
    propagation and its own dispatch run below this mode, unseen: steptime/dtensor.py prices them). As rankstate's
    FLOP counter counts it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without torch.distributed
        return tree, False
    from torch.utils._pytree import tree_map

    found = []

    def local(x: object) -> object:
        if isinstance(x, DTensor):
            found.append(True)
            return x._local_tensor
        return x

    return tree_map(local, tree), bool(found)


class OpRecorder(TorchDispatchMode):
    """Records every op dispatched while it is entered (module doc).

    `phase` names the part of the step. `watch(optimizer)` sets it to "optimizer step" for the
    optimizer's step, and back after.

        flop_registry  FlopCounterMode.flop_registry: {overload packet: formula(*args, out_val=out, **kwargs)}
    """

    def __init__(self, flop_registry: dict[object, Callable[..., int]]) -> None:
        super().__init__()
        self.flop_registry = flop_registry
        self.phase = "forward"
        self.records: list[OpRecord] = []
        self._handles: list = []
        # A storage's id in the records: its C++ address names it only while it lives, and the allocator hands the
        # address of a freed one to the next. So an op's output at an address its inputs do not hold is a new storage,
        # and gets a new id: storage ids name one storage across the whole step (the replay's pool, the GPU model's
        # dataflow and fusion read them so).
        self._ids: dict[int, int] = {}
        self._next_id = 0

    def watch(self, optimizer: torch.optim.Optimizer | None) -> OpRecorder:
        if optimizer is not None:
            previous: list[str] = []

            def before(*_args) -> None:
                previous.append(self.phase)
                self.phase = "optimizer step"

            def after(*_args) -> None:
                self.phase = previous.pop() if previous else self.phase

            self._handles += [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def summary(self) -> OpSummary:
        return OpSummary.of(self.records)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("prim", "profiler"):  # device queries, record_function markers: not work
            return out
        try:
            self.records.append(self._record(func, args, kwargs, out))
        except Exception:  # noqa: BLE001 - a formula that cannot price an op must not break the step
            pass
        return out

    def _id(self, address: int, fresh: bool) -> int:
        if fresh or address not in self._ids:
            self._next_id += 1
            self._ids[address] = self._next_id
        return self._ids[address]

    def _record(self, func, args, kwargs, out) -> OpRecord:
        (args, kwargs, out), on_dtensor = _local((args, kwargs, out))
        packet = func._overloadpacket
        name = str(func)  # "aten.mm.default"
        namespace, op = _split_name(name)
        formula = self.flop_registry.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        inputs = _tensors((args, kwargs))
        raw_inputs = [_storage_of(t) for t in inputs]
        storages = tuple((self._id(key, fresh=False), n) for key, n in raw_inputs)
        # The compute dtype: the largest floating input's. SDPA's backward takes bf16 q, k, v and fp32 logsumexp.
        floats = [t for t in inputs if t.is_floating_point()]
        dtype = str(max(floats, key=lambda t: t.numel()).dtype).removeprefix("torch.") if floats else ""
        if op in _FREE_OPS or func.is_view or op.startswith("_foreach_zero") or op.startswith("empty"):
            read = written = 0
        else:
            outputs = _tensors(out)
            if op in _WRITE_ONLY_FIRST and inputs:
                inputs = inputs[1:]
            read, written = _touched_bytes(iter(inputs)), _touched_bytes(iter(outputs))
            if op.startswith("_foreach_") and op.endswith("_") and not outputs:
                # in-place foreach ops return nothing: they write back their first list
                first = args[0] if args and isinstance(args[0], (list, tuple)) else []
                written = _touched_bytes(iter(t for t in first if isinstance(t, torch.Tensor)))
            elif op.startswith("_fused_") and not outputs:
                # _fused_adamw_ and kin update params, exp_avg, exp_avg_sq (and max_exp_avg_sq) in place
                lists = [a for a in args[:5] if isinstance(a, (list, tuple))]
                written = _touched_bytes(iter(t for a in lists if a is not args[1] for t in a))
        category = category_of(name)
        if self.phase == "optimizer step" and category != COMMUNICATION:  # a collective stays one
            category = OPTIMIZER
        shapes = tuple(tuple(t.shape) for t in inputs) if category == MATMUL else ()
        signature, why_not = None, ""
        try:
            signature = _frozen((signature_of(list(args)), signature_of(dict(kwargs))))
        except NotReplayable as err:
            why_not = str(err)
        held = {key for key, _ in raw_inputs}
        outputs = tuple((self._id(key, fresh=key not in held), n) for key, n in map(_storage_of, _tensors(out)))
        group, group_size = _group_of(args) if category == COMMUNICATION else ("", 0)
        return OpRecord(
            name, self.phase, category, flops, read, written, dtype, shapes, signature, why_not, storages, outputs,
            group=group, group_size=group_size, recompute=_recomputing(), dtensor=on_dtensor,
        )  # fmt: skip
