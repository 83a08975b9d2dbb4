"""A measured peak on any device: the high-water mark of live tensor bytes while a block runs.

CUDA keeps allocator statistics (torch.cuda.max_memory_allocated); the CPU keeps none. This
tracker counts bytes itself, the same way on every device.

The baseline is what `track` is told is live at the start. That is a model's parameters, buffers and
gradients, an optimizer's state, the batch. A TorchDispatchMode sees each operator's outputs. An
output storage that is none of the operator's inputs' is a new allocation. A view, an in-place or an
`out=` result is not. A storage is freed when its one Python object is finalized, baseline ones
included. A weakref callback sees it (canary test_a_storage_keeps_one_python_object_that_dies_with_it).

The peak is taken after every operator, with its inputs still alive. It is charged to the phase the
caller last named (`phase("backward")`). It does not see a kernel's scratch buffers, allocated and
freed inside one operator. Those are oneDNN / cuBLAS workspaces and fused kernels' temporaries. Nor storages resized
with UntypedStorage.resize_ outside an operator (FSDP's flat parameters). Nor allocator rounding.
Storages of all devices count together: track one device's tensors.

Tensors go through the operators unchanged: training is bit-identical with and without it.
Pure torch (no Lightning). `ledger.closedform.memory` predicts; this measures.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "track_peak"]

_Trackable = torch.Tensor | nn.Module | torch.optim.Optimizer | Iterable


class _Dispatch(TorchDispatchMode):
    """Sees every operator below autograd (forward, backward, optimizer); reports its outputs."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile'd code run compiled while tracked (flopcounter._CountWithoutDecomposing says why)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tracker._after_op(out, (args, kwargs))
        return out


def _storages(tree: object) -> list[torch.UntypedStorage]:
    leaves, _ = tree_flatten(tree)
    return [t.untyped_storage() for t in leaves if isinstance(t, torch.Tensor) and _has_storage(t)]


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and some subclass tensors have none
        return False
    return True


class MemoryTracker:
    """High-water mark of live tensor bytes (module docstring).

        tracker = MemoryTracker().track(model, optimizer, batch)
        with tracker:
            tracker.phase("forward"); loss = model(x, y)
            tracker.phase("zero_grad"); optimizer.zero_grad(set_to_none=True)
            tracker.phase("backward"); loss.backward()
            tracker.phase("optimizer step"); optimizer.step()
        tracker.peak_bytes, tracker.peak_phase, tracker.phase_peaks

    start()/stop() do what the `with` block does. They suit callers whose start and end are apart
    (a Lightning callback's hooks). After stop() nothing of the tracker stays attached.
    """

    def __init__(self) -> None:
        self.baseline_bytes = 0  # tracked before start()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = ""
        self.phase_peaks: dict[str, int] = {}  # the high-water mark within each phase
        self._phase = ""
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, for every live tracked storage
        self._refs: dict[int, weakref.ref] = {}
        self._mode: _Dispatch | None = None
        self.stopped = False  # started and stopped: the readings are final

    # -- what is live at the start -------------------------------------------------------------

    def track(self, *objects: _Trackable) -> MemoryTracker:
        """Count already-live tensors. Each storage counts once.

        Modules (parameters, buffers, their .grad), optimizers (every state tensor), tensors, and
        lists / tuples / dicts of these. Anything else (a batch's strings) holds no tensor bytes and is
        passed over.
        """
        for obj in objects:
            for tensor in _tensors_of(obj):
                if _has_storage(tensor):
                    self._add(tensor.untyped_storage())
        if self._mode is None:
            self.baseline_bytes = self.current_bytes
        self._raise_peak()
        return self

    # -- phases --------------------------------------------------------------------------------

    def phase(self, name: str) -> None:
        """Charge what happens from here on to `name`, until the next call."""
        self._phase = name
        self.phase_peaks.setdefault(name, self.current_bytes)
        self._raise_peak()

    # -- start / stop --------------------------------------------------------------------------

    def start(self) -> MemoryTracker:
        if self._mode is not None:
            raise RuntimeError("this MemoryTracker is already running")
        self.peak_bytes = self.current_bytes
        self.peak_phase = self._phase
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    @property
    def running(self) -> bool:
        return self._mode is not None

    def stop(self) -> None:
        """Leave the dispatch mode; drop every weakref (their callbacks die with them)."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            self.stopped = True
        self._refs.clear()
        self._sizes.clear()

    def __enter__(self) -> MemoryTracker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        if key in self._sizes:
            self.current_bytes += nbytes - self._sizes[key]  # resized in place (an out= argument)
            self._sizes[key] = nbytes
            return
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(storage, partial(self._freed, key))
        self.current_bytes += nbytes

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self._refs.pop(key, None)
        self.current_bytes -= self._sizes.pop(key, 0)

    def _after_op(self, out: object, inputs: object) -> None:
        outputs = _storages(out)
        if not outputs:
            return
        seen_inputs = {id(s) for s in _storages(inputs)}
        for storage in outputs:
            key = id(storage)
            if key not in seen_inputs or key in self._sizes:
                # New, or an input we already count: an out= argument may have been resized.
                # An alias of an untracked input (a view of the batch) is left out.
                self._add(storage)
        self._raise_peak()

    def _raise_peak(self) -> None:
        if self.current_bytes > self.phase_peaks.get(self._phase, -1):
            self.phase_peaks[self._phase] = self.current_bytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_phase = self._phase


def _tensors_of(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.is_leaf and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_of(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_of(item)


def track_peak(*baseline: _Trackable) -> MemoryTracker:
    """A MemoryTracker over `baseline`, started by `with`: `with track_peak(model, optimizer, batch) as t:`.

    It keeps no reference to `baseline`: a tensor freed inside is seen as freed.
    """
    return MemoryTracker().track(*baseline)
