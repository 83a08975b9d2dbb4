"""Each distinct op of a dry run, replayed on real tensors on this device and timed.

An op's signature is rebuilt on real tensors of its recorded layouts (ledger/timing/steptime/tensors.py).
Each is called once or twice to warm up, then timed call by call until `budget_s` or `max_repeats`, and
the median is its time: robust to a descheduled call on a busy machine.

Where the data comes from matters as much as the kernel: an input the step last touched more than a
last-level cache ago (a saved activation read in backward, a weight read once per pass) comes from
memory, one written by the op before it from cache. `cold_inputs` reads that from the op sequence (each
input's reuse distance: the bytes the step moved since it last touched that storage, against the
cache this process can use: measured on a CPU, the GPU's L2). A replay gives each cold input fresh
copies, enough of them to outgrow the cache twice, and rotates through them, so each call reads it from
memory; hot inputs stay one tensor, read from cache.

Not replayed, so priced by the caller (ledger/timing/steptime/predict.py): collectives, ops outside torch's own
namespaces (a custom op's kernel may need real data or have side effects), ops whose arguments cannot be
rebuilt, and ops whose replay raises. Every RNG stream is left as it was found. No Lightning import.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from lmledger.ledger.count.ops import COMMUNICATION, OpRecord, TensorSpec
from lmledger.ledger.hardware.bandwidth import cpu_cache_levels, usable_cpu_cache
from lmledger.ledger.timing.steptime.tensors import bind, leaves_of, rebuild, thaw

__all__ = [
    "REPLAYED_NAMESPACES",
    "Replayer",
    "as_recorded",
    "cache_bytes",
    "cold_inputs",
    "kept_heap",
    "kernel_seconds",
    "live_bytes",
    "op_key",
    "sequence_seconds",
    "settle_allocator",
    "stays_cached",
    "untouched_rng",
    "usable_cache_bytes",
    "why_not_replayed",
]

# The share of a replayed step its ops already cached must make up for fill_sequence to read a drift from them.
SHARED_TO_JUDGE = 0.25
# torch's own operator namespaces: their kernels read only shapes (and in-range indices) to run as they run.
REPLAYED_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed"})


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


def cache_bytes(device: torch.device) -> int:
    """The last-level cache as the device reports it: a GPU's L2, a CPU's largest level (/sys), whole. Enough to
    evict; what this process's data stays in is usable_cache_bytes."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return (cpu_cache_levels() or [32 << 20])[-1]  # none reported (not Linux): a server CPU's L3 is tens of MiB


def usable_cache_bytes(device: torch.device) -> int:
    """The last-level cache this process's data stays in: a GPU's L2; on a CPU, measured (bandwidth.usable_cpu_cache),
    since a VM shares the level /sys reports with its neighbours."""
    return cache_bytes(device) if device.type == "cuda" else usable_cpu_cache()


def stays_cached(device: torch.device, nbytes: int) -> bool:
    """Whether data touched again after `nbytes` of other traffic is still in the last-level cache. On a CPU the
    usable cache is measured only where the answer turns on it: over the reported level is never cached, and within
    twice the level below it always is."""
    if device.type == "cuda":
        return nbytes <= cache_bytes(device)
    levels = cpu_cache_levels()
    if levels and nbytes > levels[-1]:
        return False
    if len(levels) >= 2 and nbytes <= 2 * levels[-2]:
        return True
    return nbytes <= usable_cpu_cache()


def cold_inputs(ops: list[OpRecord], cache: int) -> list[tuple[bool, ...]]:
    """Per op, per tensor input: whether it was last touched more than `cache` bytes of traffic ago.

    The step repeats, so an input first seen in it was last touched in the previous step: its distance
    runs over the end and back (two passes over the ops).
    """
    touched, last = 0, {}
    for op in ops:  # the previous step
        for key, _ in (*op.storages, *op.output_storages):
            last[key] = touched
        touched += op.bytes
    marks = []
    for op in ops:
        marks.append(tuple(touched - last.get(key, touched - 2 * cache - 1) > cache for key, _ in op.storages))
        touched += op.bytes
        for key, _ in (*op.storages, *op.output_storages):
            last[key] = touched
    return marks


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


@contextmanager
def as_recorded() -> Iterator[None]:
    """Ops run as the dry run recorded them: autocast off, whatever the caller's context (a fit's precision
    plugin may hold one open). The recorded ops are post-autocast aten ops, its casts among them; replayed
    under autocast each would be cast again (tiny.yaml in bf16-mixed: 191 ms replayed under it, 106 ms not)."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


# glibc's malloc serves a chunk over its mmap threshold (128 KiB at start) by mmap, and on freeing one of up to
# 32 MiB raises that threshold to its size and the heap's trim threshold to twice it (mallopt(3),
# M_MMAP_THRESHOLD). Until then each step-sized tensor costs page faults. How far a process has got depends on
# the largest tensor it happened to free; an LM's logits (over 32 MiB) take it all the way in step 1.
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None under another C library (looked up once: time_call asks per timed op)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def settle_allocator(device: torch.device) -> None:
    """Set glibc's mmap and trim thresholds to where its dynamic rules end (32 and 64 MiB, as in any process that
    freed an LM's logits; comment above), so the replay and the real steps of this process meet one allocator,
    whatever ran before. mallopt also ends those rules, which at their ceiling have nowhere left to go; freeing a
    32 MiB chunk instead would not get there in a heap that already has room for one."""
    mallopt = _mallopt() if device.type == "cpu" else None
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
        mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX)


@contextmanager
def kept_heap(device: torch.device) -> Iterator[None]:
    """While ops are timed, the heap keeps what they free. A replay's round can free more than the trim
    threshold at the heap's top where the real step's does not (its long-lived objects sit among its tensors);
    glibc then hands it back and the next round faults it in again. tiny.yaml's replay of one dry run's records,
    2026-12-03 (Intel Xeon VM): runs of rounds with 20,000 page faults at 83-87 ms between rounds with none at
    69-72 ms; its real steps, 0-5,000 at 74-79 ms. Afterwards the heap is as settle_allocator leaves it."""
    mallopt = _mallopt() if device.type == "cpu" else None
    if mallopt is None:
        yield
        return
    settle_allocator(device)
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield
    finally:
        settle_allocator(device)


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
    warm: bool = True,
) -> tuple[float, int]:
    """(median seconds of `call`, timed calls) after a warm-up (module doc); `warm=False`: none."""
    clock = CLOCK
    samples: list[float] = []
    with kept_heap(device):
        started = clock()
        if warm:
            call()
            _sync(device)
        if warm and clock() - started < budget_s / 4:  # a cheap call: a second warm-up call (caches, allocator)
            call()
            _sync(device)
        spent = 0.0
        while len(samples) < min_repeats or (spent < budget_s and len(samples) < max_repeats):
            t0 = clock()
            call()
            _sync(device)
            dt = clock() - t0
            samples.append(dt)
            spent += dt
    return statistics.median(samples), len(samples)


# On CUDA an op's replayed time is its kernels' time on the GPU. The host queues work ahead of the GPU, so its own
# cost per op overlaps the kernels and is priced apart (predict.py's host); timed wall-clock with a sync per call,
# a 3 us kernel would read 20-30 us of launch and sync. A spin kernel (torch.cuda._sleep) holds the stream while
# the host queues the timed call, so the events around it see the kernels and no launch gap.
_SPIN_CYCLES = 200_000  # about 100 us at Hopper's 1.98 GHz boost clock: longer than an eager op's dispatch


def _spin() -> None:
    torch.cuda._sleep(_SPIN_CYCLES)


def kernel_seconds(
    call: Callable[[], object],
    device: torch.device,
    *,
    budget_s: float = 0.02,
    max_repeats: int = 21,
    min_repeats: int = 3,
    warm: bool = True,
) -> tuple[float, int]:
    """time_call's twin on CUDA (comment above): (median GPU seconds of `call`'s kernels, timed calls)."""
    if device.type != "cuda":
        return time_call(call, device, budget_s=budget_s, max_repeats=max_repeats, min_repeats=min_repeats, warm=warm)
    if warm:
        call()
        torch.cuda.synchronize(device)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < min_repeats or (spent < budget_s and len(samples) < max_repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _spin()
        start.record()
        call()
        end.record()
        end.synchronize()
        dt = start.elapsed_time(end) / 1e3
        samples.append(dt)
        spent += dt + 1e-4  # the spin's time counts against the budget too
    return statistics.median(samples), len(samples)


_IN_SEQUENCE = " (in sequence)"


class Replayer:
    """Times ops by replay, memoised in `times` (op_key -> seconds), which a cache fills and keeps.

    `benchmarked` counts the signatures timed by this replayer, each once however often (0 when every op came from
    the cache).
    `failed` maps op_key -> why its replay raised.
    """

    def __init__(
        self, device: torch.device, times: dict[str, float] | None = None, seed: int = 0, max_bytes: int = 1 << 62
    ) -> None:
        self.device = device
        self.max_bytes = max_bytes  # an op whose tensors would take more is not replayed (priced otherwise)
        self.times = times if times is not None else {}
        self.failed: dict[str, str] = {}
        self._timed: set[str] = set()
        self._seed = seed

    def seconds(self, op: OpRecord, cold: tuple[bool, ...] = (), cache: int = 32 << 20) -> float | None:
        """The op's replayed time, or None where it is not replayed (why_not_replayed, or its replay raised).

        `cold`: which tensor inputs come from memory (cold_inputs), each read from fresh copies.
        """
        if why_not_replayed(op) is not None:
            return None
        cold = tuple(c for c in cold) if any(cold) else ()
        key = op_key(op) + (" cold=" + "".join("1" if c else "0" for c in cold) if cold else "")
        if key in self.times:
            return self.times[key]
        if key in self.failed:
            return None
        size = sum(s.storage_numel * torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
                   for s in leaves_of(thaw(op.signature)))  # fmt: skip
        if 2 * size > self.max_bytes:  # its inputs, outputs of about their size, and cold copies
            self.failed[key] = f"too large to replay here ({size / 1e9:.3g} GB of inputs)"
            return None
        generator = torch.Generator().manual_seed(self._seed)
        func = None
        try:
            func = _overload(op.name)
            cold_bytes = sum(n for (_, n), c in zip(op.storages, cold, strict=False) if c)
            copies = min(64, max(2, -(-2 * cache // max(1, cold_bytes)))) if cold_bytes else 1
            copies = max(1, min(copies, min(1 << 30, self.max_bytes // 4) // max(1, cold_bytes))) if cold_bytes else 1
            with untouched_rng(self.device), as_recorded(), torch.no_grad():
                sets = rebuild(op, self.device, generator, cold, copies)
                turn = iter(range(1 << 62))

                def call() -> object:
                    args, kwargs = sets[next(turn) % len(sets)]
                    return func(*args, **kwargs)

                seconds, _ = kernel_seconds(call, self.device)
        except Exception as err:  # noqa: BLE001 - an op that will not run on made-up values is priced otherwise
            text = str(err).strip().splitlines()
            self.failed[key] = f"{type(err).__name__}: {text[0] if text else ''}"[:200]
            return None
        self._timed.add(key)
        self.times[key] = seconds
        return seconds

    @property
    def benchmarked(self) -> int:
        return len(self._timed)

    def all_cached(self, ops: list[OpRecord]) -> bool:
        """Whether every replayable op of the step has its in-sequence time in `times`."""
        return all(k is None or k in self.times for k in _sequence_keys(ops))

    def drift(self, ops: list[OpRecord], budget_s: float = 0.25) -> float | None:
        """Now over then: the step's opening ops whose cached times add up to `budget_s` (all of a small step),
        replayed in sequence for three timed rounds after a warm-up, against those cached times. None where no
        cached op could be compared. Three rounds, not fifteen: this asks whether the machine moved by more than
        a round's noise, not what the step takes."""
        keys = _sequence_keys(ops)
        end, cached = 0, 0.0
        while end < len(ops) and cached < budget_s:
            cached += self.times.get(keys[end], 0.0) if keys[end] is not None else 0.0
            end += 1
        medians, failed = sequence_seconds(ops[:end], self.device, rounds=3, budget_s=4 * budget_s, seed=self._seed)
        pairs = [(self.times[k], m) for i, (k, m) in enumerate(zip(keys[:end], medians, strict=True))
                 if k in self.times and m is not None and i not in failed]  # fmt: skip
        then = sum(t for t, _ in pairs)
        return sum(m for _, m in pairs) / then if then > 0 else None

    def fill_sequence(self, ops: list[OpRecord]) -> float | None:
        """Time the step's ops in sequence (sequence_seconds) unless every replayable one is cached. A cached time
        stands, so a second prediction gives the same step; the replay returns now over then for the ops it had
        cached (None: no replay, or too little of the step cached to judge), as `drift` does, for the caller."""
        keys = _sequence_keys(ops)
        if self.all_cached(ops):
            return None
        medians, failed = sequence_seconds(ops, self.device, seed=self._seed)
        per_key: dict[str, list[float]] = {}
        for i, (key, median) in enumerate(zip(keys, medians, strict=True)):
            if key is None:
                continue
            if i in failed:
                self.failed[key] = failed[i]
            elif median is not None:
                per_key.setdefault(key, []).append(median)
        fresh = {key: statistics.fmean(values) for key, values in per_key.items()}
        total = sum(sum(values) for values in per_key.values())  # every occurrence: the replayed step
        shared = sum(sum(values) for key, values in per_key.items() if key in self.times) / max(total, 1e-12)
        then = sum(self.times[k] for k in fresh if k in self.times)
        now = sum(v for k, v in fresh.items() if k in self.times)
        for key, value in fresh.items():
            if key not in self.times:
                self._timed.add(key)
                self.times[key] = value
        # A few ops this step shares with another model cached before (a scalar loss's copy, its detach) say nothing
        # of the machine: an op that short takes what the ops around it leave it. An MLP after the toy LM shared 7
        # such ops, 70 us, and read 0.41x them. Now over then is read where the shared ops are a quarter of the step.
        return now / then if then > 0 and shared >= SHARED_TO_JUDGE else None

    def in_sequence(self, op: OpRecord) -> float | None:
        """The op's time from fill_sequence (the mean over its occurrences), or None."""
        if why_not_replayed(op) is not None:
            return None
        return self.times.get(op_key(op) + _IN_SEQUENCE)


def _sequence_keys(ops: list[OpRecord]) -> list[str | None]:
    """Each op's key for its in-sequence time; None for an op that is not replayed."""
    return [op_key(op) + _IN_SEQUENCE if why_not_replayed(op) is None else None for op in ops]


def _leaf_and_last_use(ops: list[OpRecord]) -> tuple[set[int], dict[int, int]]:
    """Storages no op of the step writes as an output (parameters, the batch, optimizer state), and the
    index of each storage's last use."""
    produced, last = set(), {}
    for i, op in enumerate(ops):
        for key, _ in (*op.storages, *op.output_storages):
            last[key] = i
        produced.update(key for key, _ in op.output_storages)
    leaves = {key for op in ops for key, _ in op.storages} - produced
    return leaves, last


def storage_sizes(ops: list[OpRecord]) -> dict[int, int]:
    """Each storage the ops read or write, by its id in the records, at the most bytes any of them saw of it."""
    sizes: dict[int, int] = {}
    for op in ops:
        for key, n in (*op.storages, *op.output_storages):
            sizes[key] = max(sizes.get(key, 0), n)
    return sizes


def live_bytes(ops: list[OpRecord]) -> int:
    """The most bytes a sequence replay holds at once: leaf storages plus produced ones until last use."""
    leaves, last = _leaf_and_last_use(ops)
    sizes = storage_sizes(ops)
    held, live = sum(sizes[k] for k in leaves), {}
    peak = held
    for i, op in enumerate(ops):
        for key, _ in op.output_storages:
            if key not in leaves and key not in live:
                live[key] = sizes[key]
                held += sizes[key]
        peak = max(peak, held)
        for key in [k for k in live if last[k] <= i]:
            held -= live.pop(key)
    return peak


def sequence_seconds(
    ops: list[OpRecord], device: torch.device, *, rounds: int = 15, budget_s: float = 6.0, seed: int = 0
) -> tuple[list[float | None], dict[int, str]]:
    """Each op's median time replayed in the step's own order, data flowing from op to op (module doc).

    The ops run in sequence, round after round (the first a warm-up), each reading the storages the ops
    before it wrote, so each meets the cache, allocator and threads the step leaves it; storages no op
    writes (parameters, the batch) persist across rounds, the rest are dropped after their last use.
    Rounds stop at `rounds` or once `budget_s` is spent (at least two timed). Returns per op its median
    (None where not replayed) and {index: why its replay raised}. Fifteen rounds, not five: a round's sum
    wanders +-7% on a 2-core VM, and three predictions of tiny.yaml's step spread 12% with five rounds
    (100.3-112.3 ms), 1.4% with fifteen (109.2-110.7; 2026-12-02, Intel Xeon VM), at 2.7 s of replay.
    """
    generator = torch.Generator().manual_seed(seed)
    funcs = []
    for op in ops:
        try:
            funcs.append(_overload(op.name) if why_not_replayed(op) is None else None)
        except AttributeError:
            funcs.append(None)
    leaves, last = _leaf_and_last_use(ops)
    pool: dict[int, torch.UntypedStorage] = {}
    samples: list[list[float]] = [[] for _ in ops]
    failed: dict[int, str] = {}
    clock = CLOCK
    cuda = device.type == "cuda"  # kernel time, by events behind a spin (kernel_seconds), read at the round's end
    started = time.perf_counter()
    with untouched_rng(device), as_recorded(), torch.no_grad(), kept_heap(device):
        for round_ in range(rounds + 1):
            events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
            for i, op in enumerate(ops):
                func = funcs[i]
                if func is None or i in failed:
                    continue
                try:
                    args, kwargs = bind(op, device, generator, pool)
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        _spin()
                        start.record()
                        out = func(*args, **kwargs)
                        end.record()
                        events.append((i, start, end))
                    else:
                        t0 = clock()
                        out = func(*args, **kwargs)
                        dt = clock() - t0
                        if round_:
                            samples[i].append(dt)
                except Exception as err:  # noqa: BLE001 - priced otherwise
                    text = str(err).strip().splitlines()
                    failed[i] = f"{type(err).__name__}: {text[0] if text else ''}"[:200]
                    continue
                for t, (key, _) in zip(leaves_of(out, torch.Tensor), op.output_storages, strict=False):
                    pool[key] = t.untyped_storage()
                for key, _ in (*op.storages, *op.output_storages):
                    if last.get(key) == i and key not in leaves:
                        pool.pop(key, None)
            if cuda:
                torch.cuda.synchronize(device)
                for i, start, end in events if round_ else ():
                    samples[i].append(start.elapsed_time(end) / 1e3)
            spent = time.perf_counter() - started
            if round_ >= 2 and spent > budget_s:
                break
    return [statistics.median(s) if s else None for s in samples], failed
