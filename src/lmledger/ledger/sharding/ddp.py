"""DDP's gradient buckets, predicted from the settings that decide them (pure accounting, no Lightning).

torch.nn.parallel.DistributedDataParallel keeps every gradient that needs reducing in flat bucket
buffers. Sources: torch 2.13, nn/parallel/distributed.py and csrc/distributed/c10d/reducer.cpp.

Construction makes one bucket of everything (limit sys.maxsize). The exception is
find_unused_parameters without static_graph. Then the limits are [first bucket, bucket_cap], over the
parameters in registration order. The bucket list is then reversed
(_BucketCapacityConfig.compute_bucket_size_limits, _ddp_init_helper).

After the first backward the Reducer rebuilds them, at the next forward (Reducer::rebuild_buckets).
Under find_unused_parameters without static_graph it does not (should_rebuild_buckets). It fills them
greedily, in the order the gradients became ready, with limits [first bucket, bucket_cap]. The first
bucket holds up to `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) when bucket_cap_mb is left at its default
(25 MiB). Otherwise it holds bucket_cap itself (_BucketCapacityConfig.create). A bucket closes once it
reaches its limit; the tensor that crosses it stays in. There is one open bucket per dtype.

In memory, the buckets together hold one copy of the reduced gradients (their dtype, no padding). They
are alive from construction on. Without gradient_as_bucket_view that is a second copy beside
`param.grad`. With it, `param.grad` becomes a view of its bucket after each backward
(mark_variable_ready_dense). The grads then cost nothing more. The settings static_graph and
find_unused_parameters change the buckets' layout and the graph walk, not the steady state's bytes.
(Without static_graph, find_unused_parameters keeps the first buckets for good.)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MIB",
    "Bucket",
    "DDPSettings",
    "assign_buckets",
    "bucket_bytes",
    "initial_buckets",
    "rebuilt_buckets",
]

MIB = 1024 * 1024
_DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (canary test in test_ddp_buckets)


@dataclass(frozen=True)
class DDPSettings:
    """The DistributedDataParallel arguments that decide its buckets.

    Lightning's DDPStrategy passes its keyword arguments through to DDP:
    `DDPStrategy(bucket_cap_mb=..., gradient_as_bucket_view=...)`.
    """

    bucket_cap_mb: float | None = None  # None: torch's default, 25 MiB with a 1 MiB first bucket
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> DDPSettings:
        """The settings among DDP's keyword arguments (Lightning's DDPStrategy keeps them in `_ddp_kwargs`)."""
        return cls(
            bucket_cap_mb=kwargs.get("bucket_cap_mb"),
            gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
            static_graph=bool(kwargs.get("static_graph", False)),
            find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
        )

    @property
    def bucket_bytes_cap(self) -> int:
        return int((_DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb) * MIB)

    @property
    def first_bucket_bytes_cap(self) -> int:
        return DEFAULT_FIRST_BUCKET_BYTES if self.bucket_cap_mb is None else self.bucket_bytes_cap


@dataclass(frozen=True)
class Bucket:
    """One flat gradient buffer: the indices of its parameters (in the order they fill it) and its bytes."""

    dtype: str
    indices: tuple[int, ...]
    nbytes: int


def assign_buckets(sizes: Sequence[tuple[int, str]], order: Sequence[int], limits: Sequence[int]) -> list[Bucket]:
    """Greedy bucketing, as torch's compute_bucket_assignment_by_size does it.

    It walks the tensors in `order`, (bytes, dtype) each, with one open bucket per dtype. A bucket closes
    when it reaches its limit. The limits are taken in turn, and the last repeats. Closed buckets come in
    the order they closed, the open ones after them. All are sorted by their first tensor's position in
    `order`, as torch sorts them.
    """
    open_: dict[str, tuple[list[int], int, int]] = {}  # dtype -> (indices, bytes, which limit)
    done: list[Bucket] = []
    for index in order:
        nbytes, dtype = sizes[index]
        indices, total, which = open_.get(dtype, ([], 0, 0))
        indices.append(index)
        total += nbytes
        limit = limits[min(which, len(limits) - 1)]
        if total >= limit:
            done.append(Bucket(dtype, tuple(indices), total))
            open_[dtype] = ([], 0, which + 1)
        else:
            open_[dtype] = (indices, total, which)
    rest = [Bucket(dtype, tuple(ix), total) for dtype, (ix, total, _) in open_.items() if ix]
    position = {index: i for i, index in enumerate(order)}
    return sorted(done + rest, key=lambda b: position[b.indices[0]])


def initial_buckets(sizes: Sequence[tuple[int, str]], settings: DDPSettings) -> list[Bucket]:
    """The buckets DDP builds at construction.

    They are assigned over the parameters in registration order. The bucket list is then reversed
    (DistributedDataParallel._ddp_init_helper): the last-defined parameters' gradients come first. Under
    find_unused_parameters without static_graph they are the steady state: never rebuilt.
    """
    if settings.static_graph or not settings.find_unused_parameters:
        limits = [sys.maxsize]
    elif settings.first_bucket_bytes_cap < settings.bucket_bytes_cap:
        limits = [settings.first_bucket_bytes_cap, settings.bucket_bytes_cap]
    else:
        limits = [settings.bucket_bytes_cap]
    return list(reversed(assign_buckets(sizes, list(range(len(sizes))), limits)))


def rebuilt_buckets(
    sizes: Sequence[tuple[int, str]], settings: DDPSettings, ready_order: Sequence[int] | None = None
) -> list[Bucket]:
    """The steady-state buckets: rebuilt after the first backward, in the order gradients became ready.

    `ready_order` holds parameter indices. The default is reverse registration order, which a dry run
    refines.
    """
    order = list(reversed(range(len(sizes)))) if ready_order is None else list(ready_order)
    return assign_buckets(sizes, order, [settings.first_bucket_bytes_cap, settings.bucket_bytes_cap])


def bucket_bytes(buckets: Sequence[Bucket]) -> int:
    """What the bucket buffers hold together: one copy of the reduced gradients."""
    return sum(b.nbytes for b in buckets)
