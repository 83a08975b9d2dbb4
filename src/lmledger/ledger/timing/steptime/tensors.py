"""A recorded op's arguments rebuilt on real tensors, for a replay to time (ledger/timing/steptime/replay.py).

An op's signature (ledger/count/ops.py: its overload, and its arguments with each tensor as a TensorSpec of
shape, stride, offset, dtype and storage size) is rebuilt on real tensors: floating values from a normal
distribution, integers in range for what they index (embedding ids below the table's rows, class targets
below the class count, gather/scatter/index positions below their dimension; any other integer tensor
below the smallest dimension of the op's tensors, which is a valid index into each), booleans at random.
`rebuild` makes a lone op's arguments (fresh copies of its cold inputs); `bind` lays a sequence replay's
op on the storages the ops before it wrote. No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from lmledger.ledger.count.ops import OpRecord, TensorSpec

__all__ = ["bind", "leaves_of", "rebuild", "thaw"]

_INDEXED_BY_FIRST_ARG_DIM = frozenset(
    {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
     "index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
     "take_along_dim"}
)  # fmt: skip


def thaw(tree: object) -> object:
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "__list__":
        return [thaw(x) for x in tree[1]]
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "__dict__":
        return {k: thaw(v) for k, v in tree[1]}
    if isinstance(tree, tuple):
        return tuple(thaw(x) for x in tree)
    return tree


def leaves_of(tree: object, kind: type = TensorSpec) -> Iterator:
    """The `kind` instances in a tree of lists, tuples and dicts, in order (TensorSpecs by default)."""
    if isinstance(tree, kind):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from leaves_of(x, kind)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from leaves_of(x, kind)


def _map_specs(tree: object, leaf: Callable[[TensorSpec], torch.Tensor], device: torch.device) -> object:
    """The tree with each TensorSpec replaced by leaf(spec) and each device by `device`."""
    if isinstance(tree, TensorSpec):
        return leaf(tree)
    if isinstance(tree, list):
        return [_map_specs(x, leaf, device) for x in tree]
    if isinstance(tree, tuple):
        return tuple(_map_specs(x, leaf, device) for x in tree)
    if isinstance(tree, dict):
        return {k: _map_specs(v, leaf, device) for k, v in tree.items()}
    if isinstance(tree, torch.device):
        return device
    return tree


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


def rebuild(
    op: OpRecord, device: torch.device, generator: torch.Generator, cold: tuple[bool, ...] = (), copies: int = 1
) -> list[tuple[list, dict]]:
    """`copies` sets of the op's arguments on real tensors of its recorded layouts (module doc).

    Inputs marked in `cold` (by position among the op's tensors) are fresh in each set; the rest shared.
    """
    args_spec, kwargs_spec = (thaw(part) for part in op.signature)
    base = op.name.split(".")[1]
    bounds = _index_bounds(base, args_spec, kwargs_spec)
    sizes = [d for spec in leaves_of((args_spec, kwargs_spec)) for d in spec.shape if d > 0]
    generic = min(sizes) if sizes else 1
    made: dict[int, torch.Tensor] = {}
    position = {id(spec): i for i, spec in enumerate(leaves_of((args_spec, kwargs_spec)))}

    def tensor(spec: TensorSpec) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype)
        numel = max(
            spec.storage_numel, spec.offset + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True)) + 1
        )
        if dtype.is_floating_point:
            # std 1/sqrt(fan-in) for a matrix, as weights start: values that flow through the step stay
            # O(1), never overflowing into inf or underflowing into denormals (slow on x86), as the model's
            scale = 1 / math.sqrt(spec.shape[-1]) if len(spec.shape) >= 2 and spec.shape[-1] > 0 else 1.0
            flat = (torch.randn(numel, generator=generator, dtype=torch.float32) * scale).to(dtype)
        elif dtype.is_complex:
            flat = torch.randn(numel, generator=generator, dtype=dtype)
        elif dtype == torch.bool:
            flat = torch.randint(0, 2, (numel,), generator=generator).bool()
        else:
            high = max(1, min(bounds.get(id(spec), generic), int(torch.iinfo(dtype).max)))
            flat = torch.randint(0, high, (numel,), generator=generator, dtype=torch.int64).to(dtype)
        return flat.to(device).as_strided(spec.shape, spec.stride, spec.offset)

    def leaf(spec: TensorSpec) -> torch.Tensor:
        index = position[id(spec)]
        if index < len(cold) and cold[index]:
            return tensor(spec)
        if id(spec) not in made:
            made[id(spec)] = tensor(spec)
        return made[id(spec)]

    return [(_map_specs(args_spec, leaf, device), _map_specs(kwargs_spec, leaf, device)) for _ in range(max(1, copies))]


def bind(op: OpRecord, device: torch.device, generator: torch.Generator, pool: dict) -> tuple[list, dict]:
    """The op's arguments on the pool's storages (by the recorded storage ids), new ones where missing."""
    args_spec, kwargs_spec = (thaw(part) for part in op.signature)
    specs = list(leaves_of((args_spec, kwargs_spec)))
    keys = {id(spec): key for spec, (key, _) in zip(specs, op.storages, strict=False)}
    fresh: dict[int, torch.Tensor] = {}
    missing = []
    for spec in specs:
        key = keys.get(id(spec))
        dtype = getattr(torch, spec.dtype)
        need = (spec.offset + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True)) + 1) * (
            torch.empty((), dtype=dtype).element_size()
        )
        storage = pool.get(key)
        if storage is None or storage.nbytes() < need or storage.device.type != device.type:
            missing.append(spec)
    if missing:  # made as a lone replay makes them (in-range integers), then kept in the pool
        made = rebuild(op, device, generator)[0]
        for spec, tensor in zip(leaves_of((args_spec, kwargs_spec)), leaves_of(made, torch.Tensor), strict=True):
            if any(spec is m for m in missing):
                key = keys.get(id(spec))
                if key is not None:
                    pool[key] = tensor.untyped_storage()
                fresh[id(spec)] = tensor

    def leaf(spec: TensorSpec) -> torch.Tensor:
        if id(spec) in fresh:
            return fresh[id(spec)]
        storage = pool[keys[id(spec)]]
        return torch.empty(0, dtype=getattr(torch, spec.dtype), device=device).set_(
            storage, spec.offset, spec.shape, spec.stride
        )

    return _map_specs(args_spec, leaf, device), _map_specs(kwargs_spec, leaf, device)
