"""The predicted seconds of one training step on a GPU this machine may not have, from a dry run's ops: the GPU
op-time model's entry point (docs/time.md, "On a GPU you do not have").

Each op is priced on the GPU (price.py, kernels.py) as the framework's kernels run it (frameworks.py), DDP's gradient
buckets are placed in backward where their gradients are ready, and the step is replayed on the host's and the
GPU's streams (simulate.py). The categories sum to the step:

    matmul, attention, other, optimizer   the compute stream's kernels
    communication                         what collectives add: the step less the same step with free collectives;
                                          the rest of their time is hidden under compute (StepTime.hidden)
    host                                  the compute stream's remaining idle time: waiting on the host to launch
                                          kernels (a launch-bound step), Lightning's loop; what the host's work
                                          hides under the kernels is StepTime.hidden's too

Pure arithmetic over the op records: no Lightning import.
"""

from __future__ import annotations

from lmledger.ledger.count.ops import ATTENTION, COMMUNICATION, MATMUL, OPTIMIZER, OTHER, OpRecord, OpSummary
from lmledger.ledger.hardware.gpus import GpuSpec, require_gpu
from lmledger.ledger.hardware.interconnect import Links, default_links
from lmledger.ledger.timing.gpu.frameworks import Kernels, kernels_for
from lmledger.ledger.timing.gpu.kernels import chip_of
from lmledger.ledger.timing.gpu.price import price_ops
from lmledger.ledger.timing.gpu.simulate import simulate
from lmledger.ledger.timing.steptime.predict import DATA_WAIT, HOST, NoStepTime, StepTime

__all__ = ["predict_gpu_step", "with_buckets"]


def with_buckets(ops: list[OpRecord], buckets: list[tuple[int, str]], world: int, overlap: bool) -> list[OpRecord]:
    """`ops` with DDP's bucket all-reduces (nbytes, dtype), in the order the Reducer fills them, placed in backward:
    each after the backward op by which that share of the backward's FLOPs is done, as its gradients are ready
    (gradients come out in reverse layer order, about in step with the backward's work); with `overlap` False, all
    after the last backward op (Megatron-LM's local DDP)."""
    if not buckets or world <= 1:
        return ops
    backward = [i for i, op in enumerate(ops) if op.phase == "backward"]
    if not backward:
        return ops
    records = [OpRecord("c10d.allreduce_ (DDP bucket, predicted)", "backward", COMMUNICATION, 0, nbytes, 0, dtype,
                        group="world", group_size=world) for nbytes, dtype in buckets]  # fmt: skip
    place: dict[int, list[OpRecord]] = {}
    if not overlap:
        place[backward[-1]] = records
    else:
        total = sum(ops[i].flops for i in backward) or 1
        total_bytes = sum(n for n, _ in buckets) or 1
        done, filled, at = 0, 0, 0
        for i in backward:
            done += ops[i].flops
            while at < len(records) and (filled + buckets[at][0]) / total_bytes <= done / total + 1e-12:
                place.setdefault(i, []).append(records[at])
                filled += buckets[at][0]
                at += 1
        place.setdefault(backward[-1], []).extend(records[at:])
    out = []
    for i, op in enumerate(ops):
        out.append(op)
        out.extend(place.get(i, ()))
    return out


def _gpu(gpu: GpuSpec | str) -> GpuSpec:
    return gpu if isinstance(gpu, GpuSpec) else require_gpu(gpu)


def predict_gpu_step(
    ops: OpSummary,
    gpu: GpuSpec | str,
    *,
    compute_dtype: str = "bf16",
    kernels: Kernels | None = None,
    links: Links | None = None,
    world_size: int = 1,
    buckets: list[tuple[int, str]] = (),
    tokens: int | None = None,
    samples: int = 0,
    accumulate: int = 1,
    loop_s: float = 0.0,
    model_flops: float | None = None,
) -> StepTime | NoStepTime:
    """One step of `ops` (a dry run's, one rank's) on `gpu` (a table key or GpuSpec), as the framework `kernels`
    runs them (default eager PyTorch), its collectives on `links` (default: the GPU's usual node), DDP's `buckets`
    (nbytes, dtype) placed in backward, all-reduced over the `world_size` ranks. `tokens`, `samples`
    per micro-batch; `loop_s` a trainer's host time per batch; `model_flops` per step, for MFU against the dense
    peak of `compute_dtype`."""
    spec = _gpu(gpu)
    try:
        chip = chip_of(spec)
    except ValueError as err:
        return NoStepTime(str(err))
    kernels = kernels or kernels_for("pytorch")
    for dtype in (compute_dtype, *(("fp8",) if kernels.fp8_matmuls else ())):
        if spec.peak_flops.get(dtype) is None:  # V100 and T4 run no bf16; Ampere no fp8
            why = f"{spec.name} has no dense {dtype} peak in the table: its {dtype} kernels do not run there"
            return NoStepTime(why)
    links = links or default_links(spec.key)
    records = with_buckets(list(ops.ops), list(buckets), world_size, kernels.ddp_overlap)
    priced = price_ops(records, chip, kernels, compute_dtype, links, world_size)
    tail = loop_s * accumulate
    full = simulate(priced, tail_host_s=tail, serial=kernels.serial_host)
    quiet = simulate(priced, comm=0.0, tail_host_s=tail, serial=kernels.serial_host)
    busy = sum(full.kernels_s.values())
    exposed_comm = max(0.0, full.seconds - quiet.seconds)
    seconds = {category: full.kernels_s.get(category, 0.0) for category in (MATMUL, ATTENTION, OTHER, OPTIMIZER)}
    seconds[COMMUNICATION] = exposed_comm
    seconds[DATA_WAIT] = 0.0
    seconds[HOST] = max(0.0, full.seconds - busy - exposed_comm)
    host_all = full.host_s
    hidden = {COMMUNICATION: max(0.0, full.collectives_s - exposed_comm), HOST: max(0.0, host_all - seconds[HOST])}
    peak = chip.peak(compute_dtype)
    mfu = model_flops / full.seconds / peak if model_flops and full.seconds > 0 else None
    how = {
        "kernels": f"{kernels.name}: {kernels.description}" if kernels.description else kernels.name,
        "gpu": f"{spec.name}: {chip.sms} SMs, {chip.arch.source}",
        "links": f"in a node {links.intra.name}, between nodes {links.inter.name}, at NCCL's measured share",
        HOST: f"{host_all * 1e3:.3g} ms of launches on the host ({kernels.host_forward_s * 1e6:.3g} us a forward "
        f"kernel, {kernels.host_backward_s * 1e6:.3g} us a backward one), overlapping the kernels they queue"
        + (f", Lightning's loop {loop_s * 1e3:.3g} ms a batch" if loop_s else ""),
    }  # fmt: skip
    return StepTime(
        seconds=seconds, ops=len(ops.ops), replayed=0, fallback=0, fallback_s=0.0,
        collectives=sum(1 for op in records if op.category == COMMUNICATION), accumulate=accumulate,
        tokens=tokens * accumulate if tokens else None, samples=samples * accumulate, how=how,
        priced_on=spec.key, hidden=hidden, mfu=mfu,
    )  # fmt: skip
