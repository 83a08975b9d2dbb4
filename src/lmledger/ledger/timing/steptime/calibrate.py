"""What replaying ops one by one cannot see, each measured once per machine with a small experiment.

    per-op overhead   autograd's and the dispatcher's cost per op beyond its kernel: a chain of tiny ops
                      with backward, timed whole, minus the replayed time of the ops it ran, per op
    recompute         activation checkpointing's cost per recomputed op beyond its kernel and beyond the Python its
                      dry run times (what is left: memory given back and faulted in again): a stack of small blocks
                      with backward, checkpointed and not, the difference timed whole, minus the replayed time of
                      the extra ops and the extra Python their dry runs spend outside dispatch, per recomputed op
    model's Python    what a dry run's step spends outside dispatch per op on a model with no Python of its own
                      (the per-op chain as a module): predict.py takes it, per op, from the time outside
                      dispatch of the run's own dry run (count/ops.DispatchClock); the rest is the model's Python
    optimizer step    the run's optimizer class and hyperparameters stepping real tensors of its
                      parameters' shapes (foreach/fused kernels and Python as they really run), with
                      the run's gradient clipping before it, each timed step after the cache is flushed
                      where the passes before it in a step touch more than the cache (they evict its
                      tensors), else with them kept; cached per optimizer
    data wait         the user's own dataset: the first batches' items fetched and collated, timed;
                      with loader workers the prefetch overlaps the step (predict.py)
    collectives       all-reduce on real gloo ranks on this machine (processes of their own, never the
                      run's group), at sizes from 4 KiB to 16 MiB: latency and bandwidth fitted (alpha-beta)

The Lightning loop's cost per step needs Lightning, so it is measured in callbacks/steptime.py and passed in.
No Lightning import.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass

import torch

from lmledger.ledger.count.ops import OpRecorder, Outside
from lmledger.ledger.hardware.interconnect import Interconnect, Links, default_links, wire_bytes
from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.probes import in_own_process, on_gloo_ranks
from lmledger.ledger.timing.steptime.replay import (
    Replayer,
    as_recorded,
    cache_bytes,
    time_call,
    untouched_rng,
    why_not_replayed,
)

__all__ = [
    "DataWait",
    "collective_model",
    "gloo_calibration",
    "data_wait",
    "optimizer_seconds",
    "outside_per_dispatch",
    "per_op_overhead",
    "recompute_overhead",
]

_CHAIN_LINKS = 24


def _cached(cache: StepTimeCache, name: str) -> tuple[float, str] | None:
    """A per-machine calibration already measured: (its value, how), or None."""
    found = cache.calibration(name)
    return None if found is None else (float(found["value"]), f"measured {found['measured_at'][:10]} (cache)")


class _Chain(torch.nn.Module):
    """A chain of tiny ops with backward, one op per line of Python and no submodules: the per-op costs' probe."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(_CHAIN_LINKS):
            y = torch.tanh(y * self.w + 0.5).view(4, 4).reshape(16)
        return y.sum()


def per_op_overhead(device: torch.device, cache: StepTimeCache, replayer: Replayer) -> tuple[float, str]:
    """(seconds per op, how): the per-op cost a replay does not see (module doc), cached per machine."""
    if (found := _cached(cache, "per_op_overhead")) is not None:
        return found
    with untouched_rng(device), as_recorded():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(16, generator=generator).to(device).requires_grad_()
        model = _Chain().to(device)
        with torch.no_grad():
            model.w.copy_(torch.randn(16, generator=generator))

        def chain() -> None:
            model(x).backward()
            x.grad = model.w.grad = None

        recorder = OpRecorder({})
        with recorder:
            chain()
        ops = recorder.records
        kernels = 0.0
        for op in ops:
            seconds = replayer.seconds(op) if why_not_replayed(op) is None else None
            kernels += seconds or 0.0
        walls = [time_call(chain, device, budget_s=0.05, max_repeats=41)[0] for _ in range(3)]
    overhead = max(0.0, (min(walls) - kernels) / max(1, len(ops)))
    method = (
        f"a chain of {len(ops)} tiny ops with backward ({_CHAIN_LINKS} x tanh(y * w + 0.5) and views), timed whole "
        "(best of 3 medians), minus the replayed time of its ops, per op"
    )
    cache.set_calibration("per_op_overhead", overhead, method, ops=len(ops), wall_s=min(walls), kernels_s=kernels)
    return overhead, "measured now"


def _outside(model: torch.nn.Module, batch: torch.Tensor, runs: int) -> list[Outside]:
    """The time outside dispatch of `runs` dry runs of `model` on `batch`, each the run's own (count/ops.py)."""
    from lmledger.ledger.dryrun.engine import dry_run

    return [dry_run(model, batch, step=lambda m, b: m(b), device="cpu").ops.outside for _ in range(runs)]


def outside_per_dispatch(cache: StepTimeCache) -> tuple[float, str]:
    """(seconds per op, how): a dry run's time outside dispatch per op on _Chain, the median of 5 dry runs after one
    warm-up; cached per machine. The same dry run as the run's own, so its instruments cost alike per op."""
    if (found := _cached(cache, "outside_per_dispatch")) is not None:
        return found
    with torch.device("meta"):
        model = _Chain()
    per_op = [o.seconds / max(1, o.dispatches) for o in _outside(model, torch.empty(16, device="meta"), 6)]
    value = statistics.median(per_op[1:])
    method = (
        f"a dry run's forward and backward of {_CHAIN_LINKS} x tanh(y * w + 0.5) and views, its time outside "
        "dispatch per op (median of 5 dry runs)"
    )
    cache.set_calibration("outside_per_dispatch", value, method, per_op_s=per_op)
    return value, "measured now"


class _Blocks(torch.nn.Module):
    """recompute_overhead's stack: 4 small residual blocks (LayerNorm, Linear, GELU, Linear), checkpointed or not."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(4)
        )  # fmt: skip
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return x.sum()


def recompute_overhead(device: torch.device, cache: StepTimeCache, replayer: Replayer) -> tuple[float, str]:
    """(seconds per recomputed op, how): what checkpointing costs beyond its ops' kernels and beyond the Python that
    its dry run's time outside dispatch already prices (module doc; predict.py's model Python), cached."""
    if (found := _cached(cache, "recompute_overhead")) is not None:
        return found
    with untouched_rng(device), as_recorded():
        torch.manual_seed(0)
        model = _Blocks().to(device)
        x = torch.randn(4, 8, 16).to(device)

        def step() -> None:
            model(x).backward()
            model.zero_grad(set_to_none=True)

        kernels, walls, python = {}, {}, {}
        base = outside_per_dispatch(cache)[0]
        for checkpointed in (False, True):
            model.checkpointed = checkpointed
            recorder = OpRecorder({})
            with recorder:
                step()
            recomputed = sum(op.recompute for op in recorder.records)  # the checkpointed pass's, read last
            replayable = [op for op in recorder.records if why_not_replayed(op) is None]
            kernels[checkpointed] = sum(replayer.seconds(op) or 0.0 for op in replayable)
            walls[checkpointed] = min(time_call(step, device, budget_s=0.05, max_repeats=41)[0] for _ in range(3))
            outside = _outside(model, x, 4)[1:]  # after a warm-up
            python[checkpointed] = statistics.median(o.seconds - base * o.dispatches for o in outside)
        model.checkpointed = False
    extra = (walls[True] - walls[False]) - (kernels[True] - kernels[False]) - (python[True] - python[False])
    overhead = max(0.0, extra / max(1, recomputed))
    method = (
        f"4 blocks (LayerNorm, Linear, GELU, Linear) with backward, checkpointed and not (best of 3 medians each), "
        "the difference minus the replayed time of the extra ops and minus the extra Python their dry runs timed "
        f"outside dispatch, per recomputed op ({recomputed})"
    )
    cache.set_calibration("recompute_overhead", overhead, method, recomputed=recomputed, walls_s=list(walls.values()),
                          kernels_s=list(kernels.values()), python_s=list(python.values()))  # fmt: skip
    return overhead, "measured now"


def optimizer_seconds(
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    clip: tuple[str, float] | None = None,
    cache: StepTimeCache | None = None,
    max_bytes: int = 2 << 30,
    flushed: bool = True,
) -> tuple[float, str] | None:
    """Median seconds of the run's optimizer step on real tensors of its parameters' shapes.

    With `clip` ("norm" or "value", the threshold) the clipping Lightning does before it. `flushed`: each timed
    step follows a write of twice the last-level cache, as a step whose forward and backward move more than that
    cache meets its optimizer (False: the state stays cached, as between a small model's steps). None where
    the optimizer cannot be rebuilt, or its parameters and state would take over `max_bytes`. Cached
    per optimizer class, hyperparameters, parameter shapes, clipping and flushing.
    """
    if optimizer is None:
        return None
    # A DTensor parameter (FSDP2's, TP's) steps its local shard; DTensor's own dispatch is priced apart (dtensor.py).
    shapes = [(_local_shape(p), p.dtype) for g in optimizer.param_groups for p in g["params"]]
    hyper = [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in optimizer.param_groups]
    what = (type(optimizer).__qualname__, hyper, shapes, clip, "caches flushed" if flushed else "caches kept")
    digest = hashlib.sha256(repr(what).encode()).hexdigest()[:16]
    name = f"optimizer {type(optimizer).__name__} {digest}"
    found = cache.calibration(name) if cache is not None else None
    if found is not None:
        return float(found["value"]), f"{found['how']} ({found['measured_at'][:10]}, cache)"
    timed = _time_optimizer(optimizer, shapes, device, clip, max_bytes, flushed)
    if timed is not None and cache is not None:
        cache.set_calibration(name, timed[0], "the run's optimizer on real tensors of its parameters' shapes",
                              how=timed[1])  # fmt: skip
    return timed


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape on this rank: a DTensor's (FSDP2's, TP's) local shard's."""
    return tuple(getattr(p, "_local_tensor", p).shape)


def _time_optimizer(optimizer, shapes, device, clip, max_bytes, flushed=True) -> tuple[float, str] | None:
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in shapes)
    if 4 * total > max_bytes:
        return None
    with untouched_rng(device), as_recorded(), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        groups, params = [], []
        for group in optimizer.param_groups:
            tensors = []
            for p in group["params"]:
                shape = _local_shape(p)
                t = torch.randn(shape, generator=generator).to(device=device, dtype=p.dtype)
                t.grad = torch.randn(shape, generator=generator).to(device=device, dtype=p.dtype) * 1e-3
                tensors.append(t)
            params += tensors
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": tensors})
        try:
            real = type(optimizer)(groups)
        except Exception:  # noqa: BLE001 - an optimizer whose constructor wants more than its groups
            return None

        def step() -> None:
            if clip is not None and clip[0] == "norm":
                torch.nn.utils.clip_grad_norm_(params, clip[1])
            elif clip is not None:
                torch.nn.utils.clip_grad_value_(params, clip[1])
            real.step()

        # Where the forward and backward passes move more than the last-level cache this process can use between two
        # optimizer steps (replay.stays_cached), its parameters, gradients and state come from memory: each timed step
        # follows the same, a buffer twice the level /sys reports written first (untimed). A small model's stay cached
        # (Adam on 2.4k parameters, the AMD VM, 2026-12-07: 0.12 ms a step kept, 0.28-0.30 ms flushed).
        evict = torch.empty(2 * cache_bytes(device), dtype=torch.uint8, device=device) if flushed else None
        try:
            step()  # the first step makes the state
            samples = []
            while len(samples) < 5 or (sum(samples) < 0.1 and len(samples) < 31):
                if evict is not None:
                    evict.fill_(len(samples) % 251)
                samples.append(time_call(step, device, budget_s=0.0, max_repeats=1, min_repeats=1, warm=False)[0])
            seconds, repeats = statistics.median(samples), len(samples)
        except Exception:  # noqa: BLE001
            return None
    what = f"{type(optimizer).__name__} on real tensors of its {len(params)} parameters' shapes, caches "
    what += "flushed" if flushed else "kept (the step moves less than the last-level cache)"
    if clip is not None:
        what += f", clip_grad_{clip[0]} first"
    return seconds, f"{what}: median of {repeats} steps"


@dataclass(frozen=True)
class DataWait:
    """The time to make one batch in the loading process, and how many workers make them."""

    per_batch_s: float
    workers: int
    how: str

    def wait(self, step_s: float) -> float:
        """The wait per step: the whole batch in the training process; with workers, what prefetch leaves."""
        if self.workers == 0:
            return self.per_batch_s
        return max(0.0, self.per_batch_s / self.workers - step_s)


def data_wait(loader: object, batches: int = 3) -> DataWait | None:
    """Time the first `batches` batches of a map-style DataLoader's own dataset, sampler and collate.

    Its sampler is iterated under untouched RNG and its items are read by index, so the loader the run
    iterates is unchanged (data order, RNG). None for an iterable dataset or anything else.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    collate = getattr(loader, "collate_fn", None) or (lambda x: x)
    batch_sampler, sampler = getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)
    try:
        with untouched_rng(torch.device("cpu")):
            source = batch_sampler if batch_sampler is not None else sampler
            it = iter(source)
            index_lists = [next(it) for _ in range(batches)]
        times = []
        for indices in index_lists:
            started = time.perf_counter()
            if batch_sampler is not None:
                collate([dataset[i] for i in indices])
            else:
                collate(dataset[indices])
            times.append(time.perf_counter() - started)
    except Exception:  # noqa: BLE001 - a dataset that will not be read out of order
        return None
    workers = int(getattr(loader, "num_workers", 0) or 0)
    how = f"median of the first {batches} batches read and collated here"
    return DataWait(statistics.median(times), workers, how + (f", {workers} workers prefetching" if workers else ""))


# bytes: 4 KiB .. 16 MiB, every factor of 4. gloo's all-reduce here is no straight line in its size: on the 2-core VM
# (2026-12-04) 0.5 ms at 64 KiB, 2.5-3.6 ms at 1 MiB, 12-20 ms at 16 MiB, so a step's collectives are priced along the
# measured points (gloo_seconds), not by a latency and bandwidth fitted through them.
_PROBE_SIZES = tuple(1 << k for k in range(12, 25, 2))
# A small all-reduce between two gloo ranks on the 2-core VM takes either about 0.5 or about 3 ms (2026-12-05), the
# mode sticking while the calls come back to back and flipping when the ranks compute between them, as a step's
# ranks do. So each sample follows a short segment of matmuls, the sizes take turns, and a size's time is the mean of
# its samples over every launch: the mixture a step pays. Medians of back-to-back calls read 0.84 and 3.17 ms at
# 1 MiB in two launches; these means, five probes in a row, 2.2-3.0 ms.
_PROBE_ROUNDS = 16
_PROBE_MATMULS = 10  # 128 x 128 matmuls before each sample: about 0.5 ms at one thread on the VM
# Rank processes started afresh this many times: the scheduler places the ranks' and gloo's threads anew each time.
_LAUNCHES = 3


def gloo_calibration(world_size: int) -> str:
    """The cache's name for the all-reduce probe's points on `world_size` gloo ranks. Named for this probe: a cache
    holding the earlier one's (medians of back-to-back calls, one mode of the two) measures again."""
    return f"gloo_allreduce_mixture_w{world_size}"


def collective_model(
    world_size: int, cache: StepTimeCache, backend: str = "gloo", measure: bool = True, links: Links | None = None
) -> tuple[Links, str]:
    """(the links a step's collectives cross, where they come from): the all-reduce alpha-beta on `world_size`
    real gloo ranks here (module doc), cached per machine, as one link.

    Other backends (nccl) cannot be timed on this machine without its GPUs: `links`, or an H100 node's (the
    interconnect table's NVLink 4 and NDR), labelled as not measured. `measure=False` (inside a multi-rank
    fit, where one rank's extra minutes would time out the others' first collective) takes the table where
    nothing is cached.
    """
    table = links or default_links("h100")
    said = f"table, not measured: {table.intra.name} in a node, {table.inter.name} between nodes"
    if backend != "gloo":
        return table, said
    name = gloo_calibration(world_size)
    found = cache.calibration(name)
    if found is None and not measure:
        return table, said + " (gloo's collectives are calibrated by a one-process fit or `lmledger account`)"
    if found is None:
        value = _time_gloo(world_size)
        if value is None:
            return table, said + " (gloo ranks would not start here)"
        how = (f"all_reduce on {world_size} gloo ranks here, {_PROBE_SIZES[0]}..{_PROBE_SIZES[-1]} bytes, each "
               f"call after compute, the mean of {_PROBE_ROUNDS} a size in each of {_LAUNCHES} launches")  # fmt: skip
        cache.set_calibration(name, value, how + "; least squares alpha + n/beta")
        found = cache.calibration(name)
    value = found["value"]
    # The fit is of an all-reduce's buffer; a ring sends 2(W-1)/W of it, so the link's own rate is that much more.
    rate = value["bytes_per_s"] * wire_bytes("all_reduce", 1, world_size) if world_size > 1 else value["bytes_per_s"]
    source = f"measured {found['measured_at'][:10]}: gloo, {world_size} ranks here"
    link = Interconnect(f"gloo ({world_size} ranks)", rate, "user", source, latency_s=value["alpha_s"])
    return Links.one(link), source


def gloo_seconds(op: object, world_size: int, cache: StepTimeCache) -> float | None:
    """A recorded collective's seconds on gloo here, along the all-reduce's measured points (collective_model's
    calibration): the all-reduce that sends the bytes it sends (interconnect.wire_bytes), interpolated between the
    two probe sizes around it, past the largest along the last two. None where nothing is cached."""
    from lmledger.ledger.hardware.interconnect import collective_kind

    found = cache.calibration(gloo_calibration(world_size))
    times = found["value"].get("times") if found is not None and isinstance(found["value"], dict) else None
    if not isinstance(times, dict) or len(times) < 2:
        return None
    points = sorted((float(size), float(t)) for size, t in times.items())
    kind = collective_kind(op.name)
    size = op.group_size or world_size
    if kind is None or size < 2:
        return 0.0
    buffer = wire_bytes(kind, max(op.bytes_read, op.bytes_written), size) / wire_bytes("all_reduce", 1, size)
    if buffer <= points[0][0]:
        return points[0][1]
    lower = max((p for p in points if p[0] <= buffer), key=lambda p: p[0])
    upper = min((p for p in points if p[0] > buffer), key=lambda p: p[0], default=None)
    if upper is None:
        lower, upper = points[-2], points[-1]
    slope = (upper[1] - lower[1]) / (upper[0] - lower[0])
    return max(points[0][1], lower[1] + slope * (buffer - lower[0]))


def _time_gloo(world_size: int) -> dict | None:
    """`world_size` gloo ranks spawned from a process of their own, their all-reduce's mean time per probe size and
    the latency and bandwidth fitted through them."""
    times = in_own_process(__name__, f"_gloo_main({world_size}, {_LAUNCHES})", 1, timeout_s=120)
    if not times:
        return None
    sizes = [float(s) for s in times]
    seconds = [times[s] for s in times]
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / sum(
        (x - mean_x) ** 2 for x in sizes
    )
    slope = max(slope, 1e-15)
    alpha = max(0.0, mean_y - slope * mean_x)
    return {"alpha_s": alpha, "bytes_per_s": 1.0 / slope, "times": times}


def _gloo_main(world_size: int, launches: int) -> dict[str, float]:
    runs = [on_gloo_ranks(_gloo_rank, world_size) for _ in range(launches)]
    return {size: statistics.mean(run[size] for run in runs) for size in runs[0]}


def _gloo_rank(rank: int, world_size: int, init_method: str, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        a = torch.randn(128, 128)
        buffers = {size: torch.ones(size // 4) for size in _PROBE_SIZES}
        for t in buffers.values():
            dist.all_reduce(t)
        samples: dict[int, list[float]] = {size: [] for size in _PROBE_SIZES}
        for _ in range(_PROBE_ROUNDS):
            for size, t in buffers.items():
                for _ in range(_PROBE_MATMULS):
                    a @ a
                dist.barrier()
                started = time.perf_counter()
                dist.all_reduce(t)
                samples[size].append(time.perf_counter() - started)
        if rank == 0:
            queue.put({str(size): statistics.mean(v) for size, v in samples.items()})
    finally:
        dist.destroy_process_group()
