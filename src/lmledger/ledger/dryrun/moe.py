"""Mixture of experts in the dry run: expert shapes that top-k routing decides, under a stated assumption.

A token-choice MoE layer routes each token to k of E experts (`torch.topk` over the router's scores).
It then sizes each expert's batch from the routing: `nonzero`/`where`, `bincount`, `unique`, a mask,
or `.item()`/`.tolist()` of per-expert counts. Fake tensors hold no values, so such shapes stop a dry
run. `RoutingAssumption` answers them. The indices every topk (and top-1 argmax / max) returns get
values. Those values are carried through every later operator whose inputs all have values. They
are computed for real, on small CPU tensors: indices, masks, counts. A data-dependent operator
whose inputs have values is answered by the real result's shape. Two assumptions:

    balanced  row r of the scores picks experts (r·k + j) mod E, j < k: each expert gets tokens·k/E
              (floor or ceil), every expert is hit. The fewest tokens the busiest expert can get.
    worst     every expert is hit, and all other picks go to the same k experts: experts E-k+1..E-1
              get every token, expert E-k all but E-k of them, experts 0..E-k-1 one token each.

Under worst, no expert can get more than every token: topk picks distinct experts per token. Every
expert's fixed costs are paid: its autocast weight copy, per-expert buffers. With only k experts
hit, bf16-mixed would predict less than balanced. The heavy experts are the last ones. A loop over
experts runs them last in forward and first in backward. That is when the most saved activations
are alive. A layer that drops the tokens past an expert's capacity drops most of these. Given the
capacity (Assumption("worst", capacity), predict_moe(capacity=...)), the heavy experts are filled to
it instead.

Balanced is the routing a load-balancing loss aims at, not a lower bound. Where the peak falls inside
the expert loop, one expert's batch sets it. A random routing can give that expert fewer than
tokens·k/E. On two of six seeds, tests/ledger/test_moe.py measures Mixtral 0.9 % below balanced.

Token-choice routing computes tokens·k expert rows whatever the routing. So FLOPs are the same under
both, unless a capacity drops tokens. The peak differs where an expert's batch sizes its temporaries.

A data-dependent shape or value no topk decided still stops the dry run (NotTraced). Examples:
`x[x > 0]`, `.item()` of a loss. Without an assumption (routing=None), the dry run says when routing
decided a shape. It names the fix (`routing_dependent`).

Also here, for every dry run: transformers' default `grouped_mm` experts path calls torch's
`_grouped_mm`. Its meta kernel (torch/_meta_registrations.py, _meta_grouped_mm_common) checks the
CUDA kernel's rule, "bf16 only". The CPU kernel takes float32 too (canary
test_grouped_mm_meta_kernel_refuses_what_the_cpu_kernel_runs). The fake CPU step gets the CPU
kernel's output shape instead (`_grouped_mm_shape`). Its shapes do not depend on routing. Every
token-expert row goes through one GEMM; offsets split them. So balanced and worst agree there.

Use:

    dry_run_bounds(model, batch, ...)   any model: a StepLedger, MoEBounds where routing decides a
                                        shape, or NotTraced
    predict_moe                         both bounds
    dry_run(..., routing=...)           one: "balanced", "worst" or Assumption("worst", capacity)
    routing_dependent(result)           whether a NotTraced is the routing line

Pure torch, no Lightning.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lmledger.errors import UserError

__all__ = ["ROUTINGS", "ROUTING_REASON", "Assumption", "RoutingAssumption", "routing_indices"]

_Routing = Literal["balanced", "worst"]
ROUTINGS: tuple[str, ...] = ("balanced", "worst")

aten = torch.ops.aten

# Tensors with values are computed for real: indices, masks and counts, never activations. They hold
# tokens·k elements, or tokens·k·(E+1) for Mixtral's one-hot mask (9.4M for 512k tokens of top-2 over
# 8 experts). Past this many elements an operator's inputs or outputs get no values. A shape they
# decide stays not traced (the generic line).
_VALUE_LIMIT = 1 << 24

# What NotTraced says when top-k routing decided a shape and no assumption was given.
ROUTING_REASON = "expert shapes depend on top-k routing (mixture of experts)"

_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)
_ROUTERS = frozenset({aten.topk.default, aten.argmax.default, aten.max.dim})
_FACTORIES = frozenset(
    {
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.zeros.default,
        aten.ones.default,
        aten.full.default,
        aten.empty.memory_format,
        aten.scalar_tensor.default,
    }
)


class _RoutingDependentShape(RuntimeError):
    """A shape or value the routing decides, met in a dry run without a routing assumption."""


@dataclass(frozen=True)
class Assumption:
    """A routing assumption: "balanced" or "worst", and for worst the experts' capacity.

    `capacity` is the tokens an expert keeps per call; None keeps every token. dry_run's `routing`
    takes an Assumption, or the name alone.
    """

    routing: _Routing
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise UserError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.capacity is not None and not (isinstance(self.capacity, int) and self.capacity >= 1):
            raise UserError(f"an expert capacity must be a positive number of tokens, got {self.capacity!r}")


def routing_indices(
    shape: torch.Size | tuple[int, ...], dim: int, k: int, routing: _Routing, capacity: int | None = None
) -> torch.Tensor:
    """The indices a topk over `dim` of a `shape` tensor returns under `routing` (int64, CPU).

    Under balanced, the r-th row (all other dims, row-major) picks (r·k + j) mod n for j < k. Over the
    rows every choice is picked rows·k/n times (floor or ceil). A row's k picks are distinct. Under
    worst, every choice is picked once. Then the last choices are filled to `capacity` picks each
    (default: every row), from n-1 down (_worst_loads).
    """
    Assumption(routing, capacity)  # checks both
    dim = dim % len(shape) if shape else 0
    n = shape[dim] if shape else 1
    others = [s for i, s in enumerate(shape) if i != dim]
    rows = math.prod(others)
    if routing == "balanced":
        flat = (torch.arange(rows, dtype=torch.int64)[:, None] * k + torch.arange(k)) % max(n, 1)
    else:
        # Each choice's picks are consecutive here, at most `rows` long. Laid out column by column they
        # fall in distinct rows: a row's k picks stay distinct.
        loads = torch.tensor(_worst_loads(rows, n, k, capacity))
        flat = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), loads).reshape(k, rows).t()
    return flat.reshape(*others, k).movedim(-1, dim).contiguous() if shape else flat.reshape(k)


def _worst_loads(rows: int, n: int, k: int, capacity: int | None) -> list[int]:
    """Picks per choice under the worst routing.

    One each first: every expert's fixed costs. Then the last choices are filled to the capacity. A
    loop over experts meets them last in forward and first in backward. That is when the most saved
    activations are alive. Picks past every capacity (the layer drops them) go to the last choices,
    up to one per row.
    """
    cap = rows if capacity is None else min(capacity, rows)
    remaining = rows * k
    loads = [0] * n
    for e in range(n):
        loads[e], remaining = (1, remaining - 1) if remaining else (0, remaining)
    for limit in (cap, rows):
        for e in reversed(range(n)):
            extra = min(limit - loads[e], remaining) if limit > loads[e] else 0
            loads[e], remaining = loads[e] + extra, remaining - extra
    return loads


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """Output shape of torch._grouped_mm; the CPU kernel returns it contiguous.

    From the layouts of torch/_meta_registrations.py's _create_grouped_mm_output_tensor.
    """
    if a.dim() == 2 and b.dim() == 3:  # rows grouped by the offsets, one matrix per group
        return [a.shape[0], b.shape[-1]]
    if a.dim() == 2 and b.dim() == 2:  # the contraction grouped by the offsets: one product per group
        return [offs.shape[0] if offs is not None else 1, a.shape[0], b.shape[1]]
    if a.dim() == 3 and b.dim() == 2:  # columns grouped by the offsets
        return [a.shape[1], b.shape[1]]
    return [a.shape[0], a.shape[1], b.shape[-1]]  # 3D x 3D: a batched matmul


class RoutingAssumption(TorchDispatchMode):
    """Answers the shapes and values routing decides (module docstring).

    Entered inside the FakeTensorMode, so what it makes is fake. With routing=None it gives no answer.
    A routing-decided shape raises _RoutingDependentShape instead. `answered` counts the answers given.
    """

    def __init__(self, routing: _Routing | Assumption | None) -> None:
        super().__init__()
        self.routing = Assumption(routing) if isinstance(routing, str) else routing
        if self.routing is not None and not isinstance(self.routing, Assumption):
            raise UserError(f"routing must be one of {', '.join(ROUTINGS)}, an Assumption or None, got {routing!r}")
        self.answered = 0
        self.routed = 0  # topk / argmax calls given values
        self._values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    # -- values ---------------------------------------------------------------------------------

    def _value(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if isinstance(t, FakeTensor):
            return t.constant  # a small constant made in fake mode (torch.tensor([...]))
        return None  # a real tensor: not ours to read

    def _remember(self, fake: object, real: object) -> None:
        if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and fake.shape == real.shape:
            key = id(fake)
            self._values[key] = (weakref.ref(fake, partial(self._forget, key)), real)

    def _forget(self, key: int, _ref: weakref.ref) -> None:
        self._values.pop(key, None)

    # -- dispatch -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default:
            return self._grouped_mm(func, args, kwargs)
        if func in _ROUTERS:
            return self._route(func, args, kwargs)
        if not self.routed:  # no routing yet, nothing to carry: the dry run as without this mode
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        values = [self._value(t) for t in tensors]
        with_values = bool(tensors) and all(v is not None for v in values)
        with_values = with_values and sum(t.numel() for t in tensors) <= _VALUE_LIMIT
        if not tensors and func in _FACTORIES:
            with_values = True
        if not with_values:
            out = func(*args, **kwargs)
            self._forget_mutated(func, args, kwargs)
            return out
        real_flat = iter(values)
        real_args, real_kwargs = tree_unflatten(
            [next(real_flat) if isinstance(x, torch.Tensor) else x for x in flat], spec
        )
        if "device" in real_kwargs:
            real_kwargs["device"] = torch.device("cpu")
        try:
            out = func(*args, **kwargs)
        except _DATA_DEPENDENT as err:
            if self.routing is None:
                raise _RoutingDependentShape(
                    f"{ROUTING_REASON}: predict with routing='balanced' and 'worst' (ledger.dryrun.moe.predict_moe)"
                ) from err
            with unset_fake_temporarily():
                real = func(*real_args, **real_kwargs)
            self.answered += 1
            device = next((t.device for t in tensors if isinstance(t, FakeTensor)), torch.device("cpu"))
            return tree_map(partial(self._fake_like_remembered, device), real)
        leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if sum(x.numel() for x in leaves) > _VALUE_LIMIT:
            return out
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=False):
            self._remember(fake, value)
        return out

    def _fake_like_remembered(self, device: torch.device, real: object) -> object:
        if not isinstance(real, torch.Tensor):
            return real  # .item(), .tolist(), `if tensor:`: the value itself
        # made inside the mode, so fake
        fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        self._remember(fake, real)
        return fake

    def _forget_mutated(self, func, args, kwargs) -> None:
        """An in-place / out= operator with an input that has no value leaves its target without one."""
        if not self._values:
            return
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = kwargs.get(argument.name, args[i] if i < len(args) else None)
            if isinstance(target, torch.Tensor):
                self._values.pop(id(target), None)

    def _route(self, func, args, kwargs):
        """topk / argmax / max(dim) on scores without values: the indices the assumption picks."""
        out = func(*args, **kwargs)
        scores = args[0]
        if self._value(scores) is not None:  # indices of values we know: computed, not assumed
            with unset_fake_temporarily():
                real = func(*(self._value(a) if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=False):
                self._remember(fake, value)
            return out
        if not isinstance(scores, FakeTensor) or scores.dim() == 0:
            return out
        if func is aten.topk.default:
            k = args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices, keepdim = out[1], True
        else:
            k = 1
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:  # argmax over everything: not a routing decision
                return out
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            indices = out if func is aten.argmax.default else out[1]
        if indices.numel() > _VALUE_LIMIT:
            return out
        with unset_fake_temporarily():  # real values
            assumption = self.routing or Assumption("balanced")
            value = routing_indices(tuple(scores.shape), dim, k, assumption.routing, assumption.capacity)
            value = value.to(indices.dtype)
            value = value if keepdim else value.squeeze(dim)
        self._remember(indices, value)
        self.routed += 1
        return out

    def _grouped_mm(self, func, args, kwargs):
        a, b = args[0], args[1]
        on_fake_cpu = isinstance(a, FakeTensor) and a.device.type == "cpu"
        if not on_fake_cpu or a.dtype == torch.bfloat16:
            return func(*args, **kwargs)
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
        return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device=a.device)
