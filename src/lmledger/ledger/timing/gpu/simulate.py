"""A step on a GPU as its streams run it: the host issues each priced op (price.py) in the dry run's order, the
compute stream runs kernels one after another, each group's collectives run on a stream of their own, and an op
starts once the host has issued it, its stream is free and the storages it reads are written.

    kernel      start = max(issued, compute stream free, its inputs ready)
    collective  start = max(issued, its stream free, its inputs ready, the compute stream's work issued before it: a
                process group's stream waits for the current stream, as NCCL's collectives do; not FSDP's
                all-gathers, on streams of their own: price.Priced.after_compute): it then overlaps the compute
                that follows until something reads it
    wait        the compute stream waits for the collective whose output it names
    sync        an op the host issues only after the device is idle (a `.item()` before it: price.Priced.sync)
    chunks      async TP (price.Priced.chunks): an all-gather's matmul starts with the gather and ends no sooner than
                a chunk's share of it after the gather; a reduce-scatter starts a chunk into its matmul and ends no
                sooner than a chunk's share of it after the matmul
    optimizer   its first op waits for every collective in flight (DDP's and FSDP's gradient reductions finish
                before the step), and the step ends when the host and every stream are done

So small kernels leave the GPU waiting on the host (a launch-bound step), prefetched all-gathers and bucketed
all-reduces hide under compute, and TP's all-reduces, read at once, do not. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmledger.ledger.count.ops import MATMUL, OPTIMIZER
from lmledger.ledger.timing.gpu.price import COLLECTIVE, FREE, KERNEL, WAIT, Priced

__all__ = ["Timeline", "simulate"]


@dataclass(frozen=True)
class Timeline:
    seconds: float  # the step: the host and every stream done
    kernels_s: dict[str, float]  # compute-stream seconds per category
    collectives_s: float  # every collective's own seconds, overlapped or not
    host_s: float  # the host's issuing time


def simulate(
    priced: list[Priced], *, comm: float = 1.0, host: float = 1.0, tail_host_s: float = 0.0, serial: bool = False
) -> Timeline:
    """The step's timeline; `comm` and `host` scale the collectives' and the host's seconds (0: free), which is how
    step.py tells what each of them adds; `tail_host_s`: host work after the last op (a trainer's loop); `serial`:
    the host waits for each kernel before it launches the next (frameworks.Kernels.serial_host)."""
    issued = compute = 0.0
    streams: dict[str, float] = {}
    ready: dict[int, float] = {}
    kernels: dict[str, float] = {}
    collectives = 0.0
    barrier_done = False
    # async TP: a pipelined gather's output, (its end, chunks), read before it lands; a matmul's output, (its start,
    # seconds), for the reduce-scatter that drains it; both carried through views. Kept only where a step has one.
    pipelined = any(p.chunks for p in priced)
    landing: dict[int, tuple[float, int]] = {}
    made: dict[int, tuple[float, float]] = {}
    for p in priced:
        if p.sync:  # a device synchronize before it: the host waits for every stream
            issued = max(issued, compute, *streams.values())
        if serial and p.kind == KERNEL:  # the host waits for the GPU before each launch (a synchronising stack)
            issued = max(issued, compute)
        issued += p.host_s * host
        inputs = max((ready.get(key, 0.0) for key in p.reads), default=0.0)
        if p.category == OPTIMIZER and not barrier_done:
            compute = max(compute, *streams.values()) if streams else compute
            barrier_done = True
        lands = drains = None
        if pipelined:
            lands = max((landing[key] for key in p.reads if key in landing), default=None)
            drains = max((made[key] for key in p.reads if key in made), default=None)
        start = done = inputs  # a free op's output is ready when its input is
        if p.kind == KERNEL:
            if lands is not None and p.category != MATMUL:
                inputs = max(inputs, lands[0])  # anything else reads the gather once it has all landed
            start = max(issued, compute, inputs)
            compute = start + p.gpu_s
            if lands is not None and p.category == MATMUL:  # a pipelined gather's matmul: its last chunk after it
                compute = max(compute, lands[0] + p.gpu_s / lands[1])
            done = compute
            kernels[p.category] = kernels.get(p.category, 0.0) + p.gpu_s
        elif p.kind == COLLECTIVE:
            seconds = p.gpu_s * comm
            if p.chunks and drains is not None:  # a pipelined reduce-scatter: from its matmul's first chunk
                rest = max((ready.get(key, 0.0) for key in p.reads if key not in made), default=0.0)
                start = max(issued, streams.get(p.stream, 0.0), rest, drains[0] + drains[1] / p.chunks)
                done = max(start + seconds, inputs + seconds / p.chunks)
            else:
                start = max(issued, streams.get(p.stream, 0.0), inputs, compute if p.after_compute else 0.0)
                done = start + seconds
            streams[p.stream] = done
            collectives += p.gpu_s
        elif p.kind == WAIT:  # on a pipelined gather, its start (the readiness below): the matmul paces itself
            compute = max(compute, inputs)
            done = compute
        for key in p.writes:
            ready[key] = max(done, ready.get(key, 0.0)) if p.kind != KERNEL else done
            if p.kind == COLLECTIVE and p.chunks and drains is None:  # a pipelined gather: readable as it starts
                ready[key], landing[key] = start, (done, p.chunks)
            elif p.kind in (WAIT, FREE) and lands is not None:
                landing[key] = lands
            elif p.kind == FREE and drains is not None:
                made[key] = drains
            elif pipelined and p.kind == KERNEL and p.category == MATMUL:
                made[key] = (start, p.gpu_s)
    issued += tail_host_s * host
    end = max(issued, compute, *streams.values()) if streams else max(issued, compute)
    return Timeline(end, kernels, collectives, issued)
