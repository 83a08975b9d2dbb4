"""Each distinct op of a dry run, replayed on real tensors on this device and timed.

An op's signature (ledger/ops.py: its overload, and its arguments with each tensor as a TensorSpec of
shape, stride, offset, dtype and storage size) is rebuilt on real tensors: floating values from a normal
distribution, integers in range for what they index (embedding ids below the table's rows, class targets
below the class count, gather/scatter/index positions below their dimension; any other integer tensor
below the smallest dimension of the op's tensors, which is a valid index into each), booleans at random.
Each is called once or twice to warm up, then timed call by call until `budget_s` or `max_repeats`, and
the median is its time: robust to a descheduled call on a busy machine.

Not replayed, so priced by the caller (ledger/steptime/predict.py): collectives, ops outside torch's own
namespaces (a custom op's kernel may need real data or have side effects), ops whose arguments cannot be
rebuilt, and ops whose replay raises. Every RNG stream is left as it was found. No Lightning import.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from lmledger.ledger.ops import COMMUNICATION, OpRecord, TensorSpec

__all__ = ["REPLAYED_NAMESPACES", "Replayer", "op_key", "rebuild", "untouched_rng", "why_not_replayed"]

# torch's own operator namespaces: their kernels read only shapes (and in-range indices) to run as they run.
REPLAYED_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed"})

_INDEXED_BY_FIRST_ARG_DIM = frozenset(
    {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
     "index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
     "take_along_dim"}
)  # fmt: skip


def op_key(op: OpRecord) -> str:
    """The cache key of an op: its overload and signature, scalar float values left out (they cost nothing)."""

    def strip(tree: object) -> object:
        if isinstance(tree, float):
            return "f"
        if isinstance(tree, tuple):
            return tuple(strip(x) for x in tree)
        if isinstance(tree, TensorSpec):
            return (tree.shape, tree.stride, tree.offset, tree.dtype, tree.storage_numel)
        return str(tree) if isinstance(tree, (torch.dtype, torch.device, torch.layout, torch.memory_format)) else tree

    return f"{op.name} {strip(op.signature)!r}"


def why_not_replayed(op: OpRecord) -> str | None:
    """Why `op` is not replayed (module doc), or None when it is."""
    if op.category == COMMUNICATION:
        return "a collective (priced by the communication model)"
    namespace = op.name.split(".", 1)[0]
    if namespace not in REPLAYED_NAMESPACES:
        return f"a custom op ({namespace}): its kernel may need real data, so it is not replayed"
    if op.signature is None:
        return f"its arguments cannot be rebuilt ({op.not_replayable or 'not recorded'})"
    return None


def _overload(name: str):
    """torch.ops.<ns>.<op>.<overload> from "aten.mm.default"."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _thaw(tree: object) -> object:
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "__list__":
        return [_thaw(x) for x in tree[1]]
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "__dict__":
        return {k: _thaw(v) for k, v in tree[1]}
    if isinstance(tree, tuple):
        return tuple(_thaw(x) for x in tree)
    return tree


def _specs(tree: object) -> Iterator[TensorSpec]:
    if isinstance(tree, TensorSpec):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _specs(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _specs(x)


def _index_bounds(base: str, args: list, kwargs: dict) -> dict[int, int]:
    """{id(TensorSpec): exclusive upper bound} for the integer inputs whose values index something."""
    bounds: dict[int, int] = {}
    first = args[0] if args and isinstance(args[0], TensorSpec) else None
    if base == "embedding" and len(args) > 1 and first is not None:
        bounds[id(args[1])] = first.shape[0]
    elif base == "embedding_dense_backward" and len(args) > 2 and isinstance(args[2], int):
        bounds[id(args[1])] = args[2]
    elif base.startswith("nll_loss") and base.endswith("backward") and len(args) > 2:
        logits = args[1]
        bounds[id(args[2])] = logits.shape[1] if len(logits.shape) > 1 else logits.shape[0]
    elif base.startswith("nll_loss") and len(args) > 1 and first is not None:
        bounds[id(args[1])] = first.shape[1] if len(first.shape) > 1 else first.shape[0]
    elif base in _INDEXED_BY_FIRST_ARG_DIM and first is not None and len(args) > 2:
        dim = args[1] if isinstance(args[1], int) else 0
        index = args[2] if isinstance(args[2], TensorSpec) else kwargs.get("index")
        if isinstance(index, TensorSpec) and first.shape:
            bounds[id(index)] = first.shape[dim % len(first.shape)]
    elif base in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index") and first is not None:
        for axis, index in enumerate(args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()):
            if isinstance(index, TensorSpec) and axis < len(first.shape):
                bounds[id(index)] = first.shape[axis]
    return bounds


def rebuild(op: OpRecord, device: torch.device, generator: torch.Generator) -> tuple[list, dict]:
    """The op's arguments on real tensors of its recorded layouts (module doc)."""
    args_spec, kwargs_spec = (_thaw(part) for part in op.signature)
    base = op.name.split(".")[1]
    bounds = _index_bounds(base, args_spec, kwargs_spec)
    sizes = [d for spec in _specs((args_spec, kwargs_spec)) for d in spec.shape if d > 0]
    generic = min(sizes) if sizes else 1
    made: dict[int, torch.Tensor] = {}

    def tensor(spec: TensorSpec) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype)
        numel = max(
            spec.storage_numel, spec.offset + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True)) + 1
        )
        if dtype.is_floating_point:
            flat = torch.randn(numel, generator=generator, dtype=torch.float32).to(dtype)
        elif dtype.is_complex:
            flat = torch.randn(numel, generator=generator, dtype=dtype)
        elif dtype == torch.bool:
            flat = torch.randint(0, 2, (numel,), generator=generator).bool()
        else:
            high = max(1, min(bounds.get(id(spec), generic), int(torch.iinfo(dtype).max)))
            flat = torch.randint(0, high, (numel,), generator=generator, dtype=torch.int64).to(dtype)
        return flat.to(device).as_strided(spec.shape, spec.stride, spec.offset)

    def build(tree: object) -> object:
        if isinstance(tree, TensorSpec):
            if id(tree) not in made:
                made[id(tree)] = tensor(tree)
            return made[id(tree)]
        if isinstance(tree, list):
            return [build(x) for x in tree]
        if isinstance(tree, tuple):
            return tuple(build(x) for x in tree)
        if isinstance(tree, dict):
            return {k: build(v) for k, v in tree.items()}
        if isinstance(tree, torch.device):
            return device
        return tree

    return build(args_spec), build(kwargs_spec)


@contextmanager
def untouched_rng(device: torch.device) -> Iterator[None]:
    """Every RNG stream a training step may draw from, as it was: torch's (CPU, CUDA), Python's, numpy's."""
    devices = [device] if device.type == "cuda" else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The clock timings read: wall time. A diagnosis on a busy machine may set time.thread_time (one thread's
# CPU time, blind to descheduling) for both sides of a comparison; the cache is then not this machine's.
CLOCK = time.perf_counter


def time_call(
    call: Callable[[], object],
    device: torch.device,
    *,
    budget_s: float = 0.02,
    max_repeats: int = 21,
    min_repeats: int = 3,
) -> tuple[float, int]:
    """(median seconds of `call`, timed calls) after a warm-up (module doc)."""
    clock = CLOCK
    started = clock()
    call()
    _sync(device)
    if clock() - started < budget_s / 4:  # a cheap call: a second warm-up call (caches, allocator)
        call()
        _sync(device)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < min_repeats or (spent < budget_s and len(samples) < max_repeats):
        t0 = clock()
        call()
        _sync(device)
        dt = clock() - t0
        samples.append(dt)
        spent += dt
    return statistics.median(samples), len(samples)


class Replayer:
    """Times ops by replay, memoised in `times` (op_key -> seconds), which a cache fills and keeps.

    `benchmarked` counts the signatures timed by this replayer (0 when every op came from the cache).
    `failed` maps op_key -> why its replay raised.
    """

    def __init__(self, device: torch.device, times: dict[str, float] | None = None, seed: int = 0) -> None:
        self.device = device
        self.times = times if times is not None else {}
        self.failed: dict[str, str] = {}
        self.benchmarked = 0
        self._seed = seed

    def seconds(self, op: OpRecord) -> float | None:
        """The op's replayed time, or None where it is not replayed (why_not_replayed, or its replay raised)."""
        if why_not_replayed(op) is not None:
            return None
        key = op_key(op)
        if key in self.times:
            return self.times[key]
        if key in self.failed:
            return None
        generator = torch.Generator().manual_seed(self._seed)
        func = None
        try:
            func = _overload(op.name)
            with untouched_rng(self.device), torch.no_grad():
                args, kwargs = rebuild(op, self.device, generator)
                seconds, _ = time_call(lambda: func(*args, **kwargs), self.device)
        except Exception as err:  # noqa: BLE001 - an op that will not run on made-up values is priced otherwise
            text = str(err).strip().splitlines()
            self.failed[key] = f"{type(err).__name__}: {text[0] if text else ''}"[:200]
            return None
        self.benchmarked += 1
        self.times[key] = seconds
        return seconds
