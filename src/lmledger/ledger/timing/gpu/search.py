"""The layout search behind `lmledger plan layout`: every way to lay a ToyLM model over N GPUs at a global batch, the
ones whose per-rank peak fits, ranked by predicted tokens/s.

    searched    tensor parallel (a divisor of the node's GPUs that the heads and KV heads divide) x context parallel
                (2, 4, 8 from LONG_CONTEXT tokens up, beside TP on torchtitan's mesh (dp, cp, tp)) x pipeline stages (a
                divisor of the depth) x data parallel (the rest), replicated ("ddp") or fully sharded ("fsdp"),
                x micro-batch (a power of two that divides a replica's share of the batch; one sequence under context
                parallel, as torchtitan runs it: b sequences over c ranks hold the tokens one over c / b does, and the
                search would dry-run each pair) x recompute (none or every
                block), 1F1B or interleaved 1F1B with 2, 3 or 4 chunks a rank when pipelined (where the chunks and
                the micro-batches divide); a TP layout runs sequence parallel (Megatron-LM's and torchtitan's
                usual: the norms' and residual stream's activations split too, the same bytes on the wire) unless the
                model ties its embedding to its head, or the search is told sequence_parallel=False
    dropped     a layout whose batch does not divide, or whose highest per-rank peak (layout.memory_at_layout) is over
                the GPU's memory: each with why
    ranked      the rest by the predicted step (layout.step_at_layout), fastest first

Each distinct (TP, CP, FSDP's world, micro-batch, recompute) is dry-run once, at one and two layers: the pipeline depths
and data-parallel widths that share them are priced from the same dry runs. A long search spreads those dry runs over
the machine's cores, in spawned processes (_judge_all). Pure torch: no Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from lmledger.ledger.hardware.interconnect import Links
from lmledger.ledger.hardware.memory import free_memory
from lmledger.ledger.timing.gpu.frameworks import Kernels
from lmledger.ledger.timing.gpu.layout import (
    BUBBLE,
    Layout,
    RankMemory,
    memory_at_layout,
    step_at_layout,
    trace_key,
)
from lmledger.ledger.timing.steptime.predict import StepTime

__all__ = ["Candidate", "Search", "auto_workers", "candidates", "schedules_for", "search_layouts"]

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTES = ("none", "full")
SHARDINGS = ("ddp", "fsdp")
# (schedule, model chunks a rank) of a pipelined layout: Megatron-LM's runs interleave 2 to 4 (Korthikanti et al.'s
# 3); more chunks shrink the bubble as 1/v, but send v times as often and hold a chunk more in flight
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved", 4))
# Context parallel is searched from this sequence length up: what it is for (torchtitan's Llama 3 runs use it at 64K
# to 256K tokens), where a shorter sequence's shards would leave each rank's attention too small to pay for the ring
LONG_CONTEXT = 16384


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: RankMemory | None = None
    step: StepTime | None = None
    dropped: str = ""  # why it is not ranked

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / self.step.total_s

    def breakdown(self) -> dict[str, float]:
        """The step's seconds as compute, exposed communication, the pipeline's bubble and the host's wait."""
        s = self.step.seconds
        compute = sum(s.get(c, 0.0) for c in ("matmul", "attention", "other", "optimizer"))
        return {"compute": compute, "communication": s.get("communication", 0.0), "bubble": s.get(BUBBLE, 0.0),
                "host": s.get("host", 0.0)}  # fmt: skip


@dataclass(frozen=True)
class Search:
    ranked: list[Candidate]  # fastest first
    dropped: list[Candidate]
    tokens_per_step: int
    num_gpus: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    config, seq: int, num_gpus: int, global_batch: int, gpus_per_node: int, *, shardings=SHARDINGS,
    recomputes=RECOMPUTES, micro_batches=MICRO_BATCHES, schedules=SCHEDULES, cps=(1,), sequence_parallel=True,
) -> tuple[list[Layout], list[Candidate]]:  # fmt: skip
    """(the layouts to price, those dropped before any dry run: a global batch that does not divide over the
    data-parallel replicas). Sequence parallel where a rank's `seq` tokens split evenly over the TP ranks
    (Megatron-LM requires it; DTensor would shard them unevenly)."""
    out, dropped = [], []
    sequence_parallel = sequence_parallel and not getattr(config, "tie_embeddings", False)
    heads, kv = config.n_heads, getattr(config, "kv_heads", config.n_heads)
    for tp, cp in itertools.product(_divisors(min(gpus_per_node, num_gpus)), cps):
        if heads % tp or kv % tp or num_gpus % (tp * cp):
            continue
        for pp in _divisors(config.n_layers):
            if num_gpus % (tp * cp * pp):
                continue
            dp = num_gpus // (tp * cp * pp)
            if global_batch % dp:
                dropped.append(Candidate(Layout(tp=tp, dp=dp, pp=pp, cp=cp), dropped=f"the global batch {global_batch} "
                                         f"does not split over {dp} data-parallel replicas"))  # fmt: skip
                continue
            share = global_batch // dp
            for mb, sharding, recompute, (schedule, virtual) in itertools.product(
                [b for b in micro_batches if share % b == 0 and (cp == 1 or b == 1)],
                [s for s in shardings if dp * cp > 1 or s == "ddp"],
                recomputes, schedules if pp > 1 else (("1f1b", 1),),
            ):  # fmt: skip
                if virtual > 1 and (config.n_layers % (pp * virtual) or (share // mb) % pp):
                    continue  # no such interleaving: chunks of whole layers, micro-batches in groups of the stages
                settings = dict(tp=tp, dp=dp, pp=pp, cp=cp, sharding=sharding, micro_batch=mb, accumulate=share // mb,
                                recompute=recompute, schedule=schedule, virtual=virtual,
                                sequence_parallel=sequence_parallel and tp > 1 and (seq // cp) % tp == 0)  # fmt: skip
                out.append(Layout(**settings))
    return out, dropped


def schedules_for(kernels: Kernels) -> tuple[tuple[str, int], ...]:
    """The (schedule, chunks a rank) a framework's pipelines can run: 1F1B and interleaved 1F1B, or the framework's
    own engine's (DeepSpeed's TrainSchedule, which Megatron-DeepSpeed takes: no interleaving)."""
    return SCHEDULES if kernels.pipeline_schedule == "1f1b" else ((kernels.pipeline_schedule, 1),)


def search_layouts(
    config, seq: int, *, num_gpus: int, global_batch: int, capacity_bytes: int, precision: str, gpu,
    compute_dtype: str, kernels: Kernels, links: Links, memory_precision: str | None = None, workers: int | None = None,
    **space,
) -> Search:  # fmt: skip
    """Every layout of `config` at `global_batch` sequences of `seq` tokens over `num_gpus` GPUs (module doc); `space`
    narrows or widens what is searched (candidates' shardings, recomputes, micro_batches, schedules, cps,
    sequence_parallel). The bytes are
    the dry run's at `memory_precision` where the trainer keeps other state than its kernels show (Megatron-LM: 16-bit
    weights in the kernels, fp32 master weights and moments in its optimizer), else at `precision`. `workers`: the
    processes that dry-run the layouts (_judge_all; None: this machine's cores, where the search is long enough)."""
    space.setdefault("cps", (1, 2, 4, 8) if seq >= LONG_CONTEXT else (1,))
    space.setdefault("schedules", schedules_for(kernels))
    layouts, dropped = candidates(config, seq, num_gpus, global_batch, max(1, links.gpus_per_node), **space)
    judge = functools.partial(_judge, config, seq, capacity_bytes, memory_precision or precision, precision, gpu,
                              compute_dtype, kernels, links)  # fmt: skip
    ranked = []
    for found in _judge_all(judge, layouts, workers):
        (ranked if found.step is not None else dropped).append(found)
    ranked.sort(key=lambda c: c.step.total_s)
    return Search(ranked, dropped, global_batch * seq, num_gpus)


def _judge(
    config, seq: int, capacity_bytes: int, memory_precision: str, precision: str, gpu, compute_dtype: str,
    kernels: Kernels, links: Links, layout: Layout,
) -> Candidate:  # fmt: skip
    """One layout: dropped where its highest per-rank peak is over `capacity_bytes` or it cannot be priced, else its
    predicted step."""
    memory = memory_at_layout(config, seq, layout, memory_precision)
    if not isinstance(memory, RankMemory):
        return Candidate(layout, dropped=memory.reason)
    if memory.peak > capacity_bytes:
        where = f" (pipeline rank {memory.stage})" if layout.pp > 1 else ""
        return Candidate(layout, memory, dropped=f"its peak {memory.peak / 1e9:.1f} GB{where} is over the GPU's "
                         f"{capacity_bytes / 1e9:.0f} GB")  # fmt: skip
    step = step_at_layout(config, seq, layout, precision, gpu, compute_dtype=compute_dtype, kernels=kernels,
                          links=links)  # fmt: skip
    if not isinstance(step, StepTime):
        return Candidate(layout, memory, dropped=step.reason)
    return Candidate(layout, memory, step)


# A search whose dry runs would take longer than this on one core spreads them over the cores: a spawned worker
# imports torch and lmledger first (2-4 s on the 2-core VM, 2026-12-06), which a shorter search would not win back.
PARALLEL_AFTER_S = 20.0
# The memory a worker is given room for: the 70B search's workers held 0.39 GB resident each (2026-12-06, the 2-core
# VM), and a whole process dry-running Llama 3 70B's layers 0.48-0.76 GB (docs/scale.md). So a machine with many cores
# and little free memory (a login node) starts fewer workers than cores.
WORKER_BYTES = 1 << 30


def auto_workers(first_s: float, groups: int, cores: int, free_bytes: int) -> int:
    """The workers for `groups` more groups of layouts after a first that took `first_s`: one, where the rest would
    take under PARALLEL_AFTER_S; else one a core, no more than `free_bytes` has WORKER_BYTES for, nor than groups."""
    if first_s * groups <= PARALLEL_AFTER_S:
        return 1
    return max(1, min(cores, free_bytes // WORKER_BYTES, groups))


def _judge_all(judge, layouts: list[Layout], workers: int | None) -> list[Candidate]:
    """Each layout judged, in order. Layouts that share their dry runs (layout.trace_key) are judged together, the first
    group here; the others in `workers` spawned processes, or where `workers` is None, as many as auto_workers says
    for this machine's cores and free memory. The candidates are the same either way: every dry run is
    deterministic."""
    groups: dict[tuple, list[int]] = {}
    for i, layout in enumerate(layouts):
        groups.setdefault(trace_key(layout), []).append(i)
    order = list(groups.values())
    out: list[Candidate | None] = [None] * len(layouts)
    started = time.perf_counter()
    for i in order[0] if order else ():
        out[i] = judge(layouts[i])
    rest = order[1:]
    first_s = time.perf_counter() - started
    if workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = auto_workers(first_s, len(rest), cores, free_memory(torch.device("cpu")))
    workers = max(1, min(workers, len(rest)))
    if workers == 1:
        for group in rest:
            for i in group:
                out[i] = judge(layouts[i])
        return out
    # spawned, not forked: this process's torch threads and locks stay its own. Pool's exit terminates the workers, so
    # an error or Ctrl-C here does not wait for their queue; each also dies with this process (lifetime.py).
    spawn = multiprocessing.get_context("spawn")
    with _exit_on_sigterm(), spawn.Pool(workers, initializer=_worker_start, initargs=(os.getpid(),)) as pool:
        batches = [[layouts[i] for i in group] for group in rest]
        for group, judged in zip(rest, pool.imap(functools.partial(_judge_group, judge), batches), strict=True):
            for i, candidate in zip(group, judged, strict=True):
                out[i] = candidate
    return out


@contextlib.contextmanager
def _exit_on_sigterm():
    """SIGTERM exits (143) through the pool's exit, which ends the workers and frees their semaphores, where dying at
    once left multiprocessing's resource tracker to warn of them. Only where this thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)  # None: set outside Python


def _judge_group(judge, layouts: list[Layout]) -> list[Candidate]:
    return [judge(layout) for layout in layouts]


def _worker_start(parent: int) -> None:
    """A worker dies with the search's process, leaves Ctrl-C to it (which ends the pool in one line, where a worker
    would print a traceback), and runs torch on one thread: the workers already take every core."""
    from lmledger.lifetime import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    torch.set_num_threads(1)
