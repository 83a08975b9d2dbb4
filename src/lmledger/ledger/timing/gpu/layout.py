"""A ToyLM step at a parallel layout on a GPU: the sharded dry run of one rank (ledger.sharding), priced by the GPU
op model (step.py). What `plan train-time`, `plan layout` and benchmarks/published_runs.py ask of a run at scale.

    Layout        tensor parallel (tp), data parallel (dp), how data-parallel ranks hold the state ("ddp": replicated,
                  gradients all-reduced; ZeRO-1/2 move the same bytes; "fsdp": fully sharded, FSDP2), the micro-batch,
                  gradient accumulation and activation recompute: "none"; "full" (every block, in the dry run);
                  "layer" (every second block: torchtitan's selective layer AC, priced as the mean of none and
                  full); "attention" (the attention core's forward again in backward: Korthikanti et al.'s selective
                  recompute); "op" (every forward op but every other matmul and attention again in backward:
                  torchtitan's selective op AC, which saves those outputs)
    step_at_layout    the predicted step: per-rank dry runs of one and two layers priced, and extrapolated to the
                  model's depth (each layer adds the same ops: the step is linear in it), with accumulation's extra
                  micro-batches (forward and backward, their own collectives; DDP's gradients reduced once)

Tensor parallelism is Megatron-LM's: attention and MLP column- then row-split (ledger.sharding.tp's plan), the
embedding and the LM head split by vocabulary, the cross-entropy on each rank's vocabulary shard. Pure torch: no
Lightning import.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from lmledger.errors import UserError
from lmledger.ledger.count.ops import COMMUNICATION, OPTIMIZER, OpSummary
from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.hardware.interconnect import Links
from lmledger.ledger.sharding.schedule import Pipeline, in_flight, timeline
from lmledger.ledger.timing.gpu.frameworks import Kernels
from lmledger.ledger.timing.gpu.step import predict_gpu_step
from lmledger.ledger.timing.steptime.predict import CATEGORIES, HOST, NoStepTime, StepTime

__all__ = [
    "BUBBLE",
    "RECOMPUTE",
    "Layout",
    "RankMemory",
    "memory_at_layout",
    "rank_memories",
    "rank_ops",
    "step_at_layout",
    "trace_key",
]

RECOMPUTE = ("none", "full", "layer", "attention", "op")

# torch DDP's buckets: 25 MiB, the first 1 MiB (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES); Megatron's local DDP
# without overlap reduces all gradients in one go.
_BUCKET, _FIRST_BUCKET = 25 << 20, 1 << 20


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    sharding: str = "ddp"  # "ddp" (replicated state) or "fsdp" (fully sharded)
    micro_batch: int = 1
    accumulate: int = 1  # micro-batches a data-parallel replica runs per step (through the pipeline, if any)
    recompute: str = "none"  # RECOMPUTE (module doc)
    # Megatron-LM's sequence parallelism (Korthikanti et al. 2022) beside TP: the norms, dropouts and residual stream
    # split along the sequence, TP's all-reduces become a reduce-scatter and an all-gather (ledger.sharding.tp)
    sequence_parallel: bool = False
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel: each sequence split over cp ranks (ledger.sharding.context: torch's ring attention)
    virtual: int = 1  # model chunks per pipeline rank (the interleaved schedule)
    schedule: str = "1f1b"  # ledger.sharding.schedule.SCHEDULES

    def __post_init__(self) -> None:
        if self.sharding not in ("ddp", "fsdp"):
            raise UserError(f"sharding {self.sharding!r}: choose ddp (replicated) or fsdp (fully sharded)")
        if self.recompute not in (*RECOMPUTE, *_SELECTIVE):
            raise UserError(f"recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        for name in ("tp", "dp", "micro_batch", "accumulate", "pp", "virtual", "cp"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tp == 1:
            raise UserError("sequence parallel splits the sequence over the TP ranks: it needs tp above 1")
        self.pipeline  # noqa: B018 - the schedule's own checks (interleaved: micro-batches a multiple of pp)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(self.pp, self.accumulate, self.schedule, self.virtual)


def _megatron_tp(fsdp_too: bool, sequence_parallel: bool = False):
    """The shard function of FSDPSettings: the toy LM's TP plan (with sequence parallel where asked), the embedding
    and LM head split by vocabulary (the logits stay split: each rank's cross-entropy reads its shard), then FSDP2
    over data parallel where asked."""
    from lmledger.ledger.sharding import tp
    from lmledger.ledger.sharding.fsdp2 import DEFAULT_FSDP, TP_DIMS, shard_blocks

    def shard(model, mesh) -> None:
        tp.toy_tp_plan(model, mesh[TP_DIMS[1]], sequence_parallel, split_logits=True, regather=sequence_parallel)
        if fsdp_too:
            shard_blocks(model, mesh[TP_DIMS[0]], DEFAULT_FSDP)

    return shard


def rank_ops(config, seq: int, layout: Layout, precision: str) -> tuple[OpSummary, tuple[int, ...], int] | NotTraced:
    """(one micro-batch's step on one rank, each gradient's bytes, its forward FLOPs): the sharded dry run of the ToyLM
    `config` at `layout` (data parallel replicated: dry-run at the TP group alone; its all-reduce is added by
    step_at_layout). Cached per what decides it: a search or a table of runs meets the same shapes again."""
    found = _traced(config, seq, layout, precision)
    if isinstance(found, NotTraced):
        return found
    ops, grads, forward, _ = found
    if layout.recompute not in _SELECTIVE:
        return ops, grads, forward
    return _selective(ops, layout.recompute), grads, forward


# torchtitan's op-level AC saves every matmul's output but every second one in a block, and attention's: it is priced
# as the mean of recomputing the forward's elementwise ops alone and those with every block matmul (the LM head, the
# last forward matmul, sits outside the blocks), so that a model of one or two layers shows a block's share.
_SELECTIVE = ("attention", "op", "op:elementwise", "op:matmuls")


def _selective(ops: OpSummary, kind: str) -> OpSummary:
    """`ops` with the forward ops a selective recompute runs again inserted where backward starts (module doc). The
    copies read and write nothing the dataflow follows: they only take their time on the stream."""
    from lmledger.ledger.count.ops import ATTENTION, MATMUL, OTHER

    records = list(ops.ops)
    forward = [op for op in records if op.phase == "forward"]
    matmuls = [i for i, op in enumerate(forward) if op.category == MATMUL][:-1]  # the blocks', not the LM head
    if kind == "attention":
        again = [op for op in forward if op.category == ATTENTION]
    else:
        with_matmuls = kind == "op:matmuls"
        again = [op for i, op in enumerate(forward) if op.category == OTHER or (with_matmuls and i in matmuls)]
    copies = [dataclasses.replace(op, phase="backward", recompute=True, storages=(), output_storages=())
              for op in again]  # fmt: skip
    start = next((i for i, op in enumerate(records) if op.phase == "backward"), len(records))
    return OpSummary.of(records[:start] + copies + records[start:], ops.outside)


def _traced(config, seq: int, layout: Layout, precision: str):
    """_rank_ops' (ops, grads, forward FLOPs, (state, activations, peak)) of one rank at `layout` (recompute traced:
    none or full), or NotTraced; under context parallel, ledger.sharding.context's rank (its ring in the dry run, beside
    TP where the layout has it)."""
    traced = "full" if layout.recompute == "full" else "none"
    if layout.cp > 1:
        from lmledger.ledger.sharding.context import context_rank

        try:
            return context_rank(config, seq, layout.cp, layout.micro_batch, precision, traced, dp=_fsdp_world(layout),
                                sharding=layout.sharding, tp=layout.tp,
                                sequence_parallel=layout.sequence_parallel)  # fmt: skip
        except UserError as err:  # e.g. a sequence that does not split into 2 x cp, learned positions
            return NotTraced(str(err))
    return _rank_ops(config, seq, layout.tp, _fsdp_world(layout), layout.micro_batch, traced, precision,
                     layout.sequence_parallel)  # fmt: skip


def _fsdp_world(layout: Layout) -> int:
    """The data-parallel ranks a rank's dry run shards over: FSDP's; replicated, a rank's step is the same at any
    data-parallel width (its all-reduce is the caller's)."""
    return layout.dp if layout.sharding == "fsdp" else 1


def trace_key(layout: Layout) -> tuple:
    """What decides a layout's dry runs (_traced), at whatever pipeline depth or recompute: layouts with the same key
    share them."""
    return layout.tp, layout.cp, _fsdp_world(layout), layout.micro_batch, layout.sequence_parallel


@functools.lru_cache(maxsize=256)
def _rank_ops(
    config, seq: int, tp: int, fsdp_dp: int, micro_batch: int, recompute: str, precision: str, sp: bool = False
):
    from lmledger.ledger.sharding.fsdp2 import FSDPSettings
    from lmledger.ledger.sharding.rankstate import priced_rank
    from lmledger.ledger.sharding.sharded import predict_sharded
    from lmledger.ledger.sharding.tp import SplitAdamW
    from lmledger.model import ToyLM

    with torch.device("meta"):
        model = ToyLM(dataclasses.replace(config, activation_checkpointing=0))
    ids = torch.empty((micro_batch, seq), dtype=torch.long, device="meta")
    fused = not precision.startswith("16-mixed")  # LitLM's rule: foreach under fp16's GradScaler
    fsdp = fsdp_dp > 1
    world = tp * fsdp_dp
    if tp > 1:
        strategy, optimizer = "fsdp2", (lambda params: SplitAdamW(params, lr=1e-4, fused=fused))
        settings = FSDPSettings(tensor_parallel=tp, shard=_megatron_tp(fsdp, sp))
    else:
        strategy, optimizer = ("fsdp2" if fsdp else "ddp"), (lambda params: torch.optim.AdamW(params, fused=fused))
        settings = FSDPSettings()
    found = predict_sharded(
        model, (ids, ids.clone()), step=lambda m, b: m(*b), optimizer=optimizer, precision=precision,
        strategy=strategy, world_size=world, fsdp=settings,
        activation_checkpointing=True if recompute == "full" else None,
    )  # fmt: skip
    return found if isinstance(found, NotTraced) else priced_rank(found, model)


def _buckets(grads: tuple[int, ...], dtype: str, kernels: Kernels) -> list[tuple[int, str]]:
    """The data-parallel all-reduces of a replicated step: torch DDP's 25 MiB buckets, or one bucket of every gradient
    (Megatron-LM's contiguous buffer, DeepSpeed's flattened one)."""
    grad_bytes = sum(grads)
    if kernels.grad_reduce == "one":
        return [(grad_bytes, dtype)] if grad_bytes else []
    out, left, cap = [], grad_bytes, _FIRST_BUCKET
    while left > 0:
        out.append((min(cap, left), dtype))
        left -= cap
        cap = _BUCKET
    return out


def _one(ops: OpSummary, layout: Layout, gpu, dtype: str, kernels: Kernels, links: Links):
    """(the whole step of one micro-batch, a further micro-batch's forward and backward, and where the state is
    replicated the backward alone: the window its gradient all-reduce hides under) on the GPU, without that
    all-reduce (_data_parallel_reduce)."""
    world = layout.dp * layout.cp
    settings = dict(compute_dtype=dtype, kernels=kernels, links=links, world_size=world)
    whole = predict_gpu_step(ops, gpu, **settings)
    micro = OpSummary.of([op for op in ops.ops if op.category != OPTIMIZER])
    more = predict_gpu_step(micro, gpu, **settings)
    backward = None
    if _replicated(layout):
        backward = predict_gpu_step(OpSummary.of([op for op in ops.ops if op.phase == "backward"]), gpu, **settings)
    return whole, more, backward


def _replicated(layout: Layout) -> bool:
    """Replicated data parallelism over more than one rank: the step all-reduces its gradients."""
    return layout.sharding == "ddp" and layout.dp * layout.cp > 1


def _data_parallel_reduce(
    grads: tuple[tuple[int, ...], tuple[int, ...]], depth: int, backward_s: float, dtype: str, layout: Layout,
    kernels: Kernels, links: Links,
) -> tuple[float, float]:  # fmt: skip
    """(exposed, hidden) seconds of a replicated step's gradient all-reduce at the model's depth, once a step (after
    the last micro-batch's backward, as DDP's no_sync accumulates). Its buckets (_buckets) hold the one-layer run's
    gradient bytes and `depth` more layers' (the two-layer run's extra ones); each is ready once the backward's share of
    its bytes is done (step.with_buckets' placement) and they run in order on one stream, so the tail past the
    `backward_s` window is exposed; without overlap (Megatron-LM's local DDP) they all run after it. Priced at depth
    rather than from the one- and two-layer steps: how much of the all-reduce a backward hides is not linear in
    depth (a one-layer step exposes nearly all of it, a deep one little), and a line through the two had cut the
    per-layer collectives that follow (TP's) out of the deep step."""
    one, two = grads
    at_depth = (sum(one) + depth * max(0, sum(two) - sum(one)),)  # the buckets take the bytes alone
    buckets = _buckets(at_depth, dtype, kernels)
    times = _reduce_times(buckets, layout, links)
    if not kernels.ddp_overlap:
        return sum(times), 0.0
    total, done, end = sum(size for size, _ in buckets) or 1, 0, 0.0
    for (size, _), seconds in zip(buckets, times, strict=True):
        done += size
        end = max(end, backward_s * done / total) + seconds
    exposed = max(0.0, end - backward_s)
    return exposed, sum(times) - exposed


def step_at_layout(
    config, seq: int, layout: Layout, precision: str, gpu, *, compute_dtype: str, kernels: Kernels, links: Links
) -> StepTime | NoStepTime:
    """The predicted step of the ToyLM `config` (its n_layers deep) at `layout` on `gpu` (module doc)."""
    halves = {"layer": ("none", "full"), "op": ("op:elementwise", "op:matmuls")}.get(layout.recompute)
    if halves:  # the mean of two steps: every second block recomputed, or every second block matmul
        settings = dict(compute_dtype=compute_dtype, kernels=kernels, links=links)
        none, full = (step_at_layout(config, seq, dataclasses.replace(layout, recompute=r), precision, gpu, **settings)
                      for r in halves)  # fmt: skip
        if not isinstance(none, StepTime) or not isinstance(full, StepTime):
            return none if not isinstance(none, StepTime) else full
        mean = {c: (none.seconds[c] + full.seconds[c]) / 2 for c in CATEGORIES}
        hidden = {k: (none.hidden.get(k, 0.0) + full.hidden.get(k, 0.0)) / 2 for k in none.hidden}
        return dataclasses.replace(none, seconds=mean, hidden=hidden)
    if layout.cp > 1:  # a CP group's ranks lie tp apart (torchtitan's mesh (dp, cp, tp)): it spans cp x tp ranks
        links = dataclasses.replace(links, context_stride=layout.tp)
    if layout.pp > 1:
        return _pipelined(config, seq, layout, precision, gpu, compute_dtype, kernels, links)
    priced, grads, grad_dtype = {}, {}, "float32"
    for layers in (1, 2):
        found = rank_ops(dataclasses.replace(config, n_layers=layers), seq, layout, precision)
        if isinstance(found, NotTraced):
            return NoStepTime(found.reason)
        ops, grads[layers], _ = found
        grad_dtype = next((op.dtype for op in ops.ops if op.category == OPTIMIZER and op.dtype), "float32")
        priced[layers] = _one(ops, layout, gpu, compute_dtype, kernels, links)
        if isinstance(priced[layers][0], NoStepTime):
            return priced[layers][0]
    depth, extra = config.n_layers - 1, layout.accumulate - 1

    def at_depth(index: int, category: str) -> float:
        one, two = priced[1][index].seconds[category], priced[2][index].seconds[category]
        return one + depth * (two - one)

    seconds = {c: max(0.0, at_depth(0, c) + extra * at_depth(1, c)) for c in CATEGORIES}
    first = priced[1][0]
    hidden = {k: max(0.0, v + depth * (priced[2][0].hidden.get(k, 0.0) - v)) for k, v in first.hidden.items()}
    exposed = 0.0
    if _replicated(layout):  # the gradients' all-reduce, at depth
        backward_s = priced[1][2].total_s + depth * (priced[2][2].total_s - priced[1][2].total_s)
        exposed, overlapped = _data_parallel_reduce((grads[1], grads[2]), depth, backward_s, grad_dtype, layout,
                                                    kernels, links)  # fmt: skip
        seconds[COMMUNICATION] += exposed
        hidden[COMMUNICATION] = hidden.get(COMMUNICATION, 0.0) + overlapped
    # The host's launches are linear in depth, but a shallow step's kernels can hide them where a deep one's cannot
    # (a one-layer step kernel-bound, its further layers host-bound): the step is never shorter than its launches
    # and the kernels still to run after the last one (the one-layer step's: its optimizer's end). Where the deep
    # step's GPU work is shorter than its launches it is host-bound, and that is the step: the exposed host
    # extrapolated from one and two layers would count the second layer's newly exposed launches once a layer.
    issued = _issued(priced[1][0]) + depth * (_issued(priced[2][0]) - _issued(priced[1][0]))
    issued += extra * (_issued(priced[1][1]) + depth * (_issued(priced[2][1]) - _issued(priced[1][1])))
    # After the last launch the GPU still runs what the last ops queued: the one-layer step's tail, with the optimizer's
    # kernels grown to the model's depth and the gradients' exposed all-reduce before them
    tail = max(0.0, priced[1][0].total_s - _issued(priced[1][0]))
    tail += max(0.0, seconds[OPTIMIZER] - priced[1][0].seconds[OPTIMIZER]) + exposed
    busy = sum(v for c, v in seconds.items() if c != HOST)
    if busy <= issued:  # host-bound
        seconds[HOST] = issued + tail - busy
    else:
        seconds[HOST] += max(0.0, issued + tail - sum(seconds.values()))
    hidden[HOST] = max(0.0, issued - seconds[HOST])
    tokens = layout.micro_batch * seq
    ops = first.ops + depth * (priced[2][0].ops - first.ops)
    return dataclasses.replace(first, seconds=seconds, hidden=hidden, accumulate=layout.accumulate,
                               tokens=tokens * layout.accumulate, mfu=None, ops=ops)  # fmt: skip


def _issued(step: StepTime) -> float:
    """The host's time launching a priced step's kernels: what it left the GPU idle, and what hid under kernels."""
    return step.seconds.get(HOST, 0.0) + step.hidden.get(HOST, 0.0)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes at a layout: params, gradients and optimizer state; the saved activations of the micro-batches
    it holds at once; its peak."""

    state: int
    activations: int
    peak: int
    stage: int = 0  # the pipeline rank it is (the one with the highest peak)


def memory_at_layout(config, seq: int, layout: Layout, precision: str) -> RankMemory | NoStepTime:
    """The rank with the highest peak (rank_memories)."""
    found = rank_memories(config, seq, layout, precision)
    return found if isinstance(found, NoStepTime) else max(found, key=lambda m: m.peak)


def rank_memories(config, seq: int, layout: Layout, precision: str) -> list[RankMemory] | NoStepTime:
    """Each pipeline rank's bytes (one rank without a pipeline) of the ToyLM `config` at `layout`: the one- and
    two-layer dry runs (per rank, at the layout's TP and FSDP) extrapolated to the depth, each figure linear in it.
    A pipeline rank holds its own layers' state (the first the embedding's, the last the head's, shared by their
    sizes) and the activations of the micro-batches its schedule keeps in flight (ledger.sharding.schedule.in_flight);
    its peak adds the further micro-batches' activations to one micro-batch's (below). The step's transient (the
    logits and loss) stays in every rank's peak: high for all but the last."""
    if layout.recompute in ("layer", "op"):  # priced as means; their memory lies between none and full: take none's
        layout = dataclasses.replace(layout, recompute="none")
    pipe = layout.pipeline
    if config.n_layers % pipe.chunks:
        return NoStepTime(f"{config.n_layers} layers do not split evenly into {pipe.chunks} pipeline chunks")
    found = {}
    for layers in (1, 2):
        got = _traced(dataclasses.replace(config, n_layers=layers), seq, layout, precision)
        if isinstance(got, NotTraced):
            return NoStepTime(got.reason)
        found[layers] = got[3]
    (s1, a1, p1), (s2, a2, p2) = found[1], found[2]
    layer_state, layer_act, layer_peak = s2 - s1, a2 - a1, p2 - p1
    end_state, end_act = s1 - layer_state, a1 - layer_act
    # The peak at depth. Replicated state: the state and every layer's saved activations add up, and what the peak
    # holds beyond them (the logits and loss, a block recomputed) is one phase's, not linear in depth (where the
    # peak's phase moves between the one- and two-layer runs, a linear peak falls below the state itself: 70B at TP
    # 1): the two-layer run's. FSDP: a layer's saved activations count its gathered weights, which resharding frees
    # before the peak, so they do not add up; the peak's own slope is the measure.
    additive = layout.sharding != "fsdp"
    transient = max(0, p2 - s2 - a2)
    n = config.n_layers // layout.pp
    sizes = _parameter_sizes(config, 1)
    share = sum(sizes["embedding"]) / max(1, sum(sizes["embedding"]) + sum(sizes["head"]))
    ranks = []
    for r in range(layout.pp):
        ends = (r == 0) * share + (r == layout.pp - 1) * (1 - share) if layout.pp > 1 else 1.0
        held = in_flight(pipe, r) / layout.virtual if layout.pp > 1 else 1  # micro-batches of the rank's layers
        one = n * layer_act + ends * end_act  # one micro-batch's saved activations on this rank
        state = n * layer_state + ends * end_state
        first = state + one + transient if additive else p1 + (n - 1) * layer_peak - (1 - ends) * (end_state + end_act)
        ranks.append(RankMemory(int(state), int(held * one), int(first + (held - 1) * one), r))
    return ranks


# --- pipeline parallel -------------------------------------------------------------------------------------------
# A pipeline rank's step: its chunks' forwards and backwards for every micro-batch in the schedule's order
# (ledger.sharding.schedule.timeline, the sends between stages on the link they cross), then its gradients'
# data-parallel all-reduce and its optimizer, after the flush (Megatron-LM's and torch's schedules reduce once the
# last backward is done). The step is the slowest rank's. Each chunk is priced from the one- and two-layer dry runs:
# a layer's forward and backward, the embedding's on the first chunk, the final norm, LM head and loss on the last.
BUBBLE = "bubble"  # a pipelined step's idle share on its slowest rank: the schedule's bubble and the sends it waits on


def _seconds(ops: list, gpu, compute_dtype: str, kernels: Kernels, links: Links, world: int) -> dict[str, float]:
    """Per-category seconds of `ops` run alone on one rank (empty: zeros)."""
    if not ops:
        return dict.fromkeys((*CATEGORIES, _ISSUED), 0.0)
    found = predict_gpu_step(OpSummary.of(ops), gpu, compute_dtype=compute_dtype, kernels=kernels, links=links,
                             world_size=world)  # fmt: skip
    if isinstance(found, NoStepTime):
        raise _Unpriced(found.reason)
    return {**found.seconds, _ISSUED: _issued(found)}


class _Unpriced(Exception):
    pass


_ISSUED = "issued"  # beside a part's categories: the host's launch time, linear in depth (_issued)


def _floored(seconds: dict[str, float]) -> dict[str, float]:
    """A chunk's categories, its host wait raised so that the chunk takes at least its launches (step_at_layout)."""
    out = {k: v for k, v in seconds.items() if k != _ISSUED}
    out[HOST] = out.get(HOST, 0.0) + max(0.0, seconds.get(_ISSUED, 0.0) - sum(out.values()))
    return out


def _parts(ops: OpSummary, gpu, compute_dtype: str, kernels: Kernels, links: Links, world: int) -> dict[str, dict]:
    """One micro-batch's forward and backward, the embedding's part of them, and the optimizer: per category."""
    records = list(ops.ops)
    pick = {
        "forward": [op for op in records if op.phase == "forward"],
        "backward": [op for op in records if op.phase == "backward"],
        "embedding forward": [op for op in records if op.phase == "forward" and "embedding" in op.name],
        "embedding backward": [op for op in records if op.phase == "backward" and "embedding" in op.name],
        "optimizer": [op for op in records if op.category == OPTIMIZER],
    }
    return {k: _seconds(v, gpu, compute_dtype, kernels, links, world) for k, v in pick.items()}


def _add(*terms: tuple[float, dict]) -> dict[str, float]:
    """sum of weight x per-category seconds."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for weight, seconds in terms:
        for k, v in seconds.items():
            out[k] = out.get(k, 0.0) + weight * v
    return out


def _pipelined(config, seq, layout: Layout, precision, gpu, compute_dtype, kernels, links) -> StepTime | NoStepTime:
    pipe = layout.pipeline
    if config.n_layers % pipe.chunks:
        return NoStepTime(f"{config.n_layers} layers do not split evenly into {pipe.chunks} pipeline chunks "
                          f"(PP {layout.pp} x {layout.virtual} a rank)")  # fmt: skip
    n = config.n_layers // pipe.chunks
    stage = dataclasses.replace(layout, pp=1, virtual=1, accumulate=1, schedule="1f1b")
    gpn = max(1, links.gpus_per_node)
    # Megatron-LM's rank order (tp, dp, pp): a stage's TP and data-parallel groups span tp x dp consecutive ranks, so
    # they stay in a node where those fit; the hand-over between stages crosses nodes unless the whole pipeline fits
    inner = dataclasses.replace(links, num_nodes=-(-layout.tp * layout.cp * layout.dp // gpn))
    try:
        parts, grads = {}, {}
        for layers in (1, 2):
            found = rank_ops(dataclasses.replace(config, n_layers=layers), seq, stage, precision)
            if isinstance(found, NotTraced):
                return NoStepTime(found.reason)
            parts[layers] = _parts(found[0], gpu, compute_dtype, kernels, inner, layout.dp * layout.cp)
            grads[layers] = found[1]
    except _Unpriced as err:
        return NoStepTime(str(err))
    one, two = parts[1], parts[2]
    layer = {k: _add((1, two[k]), (-1, one[k])) for k in one}  # what each further layer adds
    ends = {k: _add((1, one[k]), (-1, layer[k])) for k in one}  # the embedding, final norm, head, loss
    embed = {"forward": one["embedding forward"], "backward": one["embedding backward"]}
    head = {k: {c: max(0.0, v - embed[k].get(c, 0.0)) for c, v in ends[k].items()} for k in embed}

    def chunk(j: int, phase: str) -> dict[str, float]:
        return _add((n, layer[phase]), (j == 0, embed[phase]), (j == pipe.chunks - 1, head[phase]))

    forward = [_floored(chunk(j, "forward")) for j in range(pipe.chunks)]
    backward = [_floored(chunk(j, "backward")) for j in range(pipe.chunks)]
    send = _send_seconds(layout, config.d_model * seq * layout.micro_batch, compute_dtype, links)
    line = timeline(pipe, [sum(f.values()) for f in forward], [sum(b.values()) for b in backward], send)

    # The ends' optimizer shared between the first rank (embedding) and the last (head) by their parameters' sizes
    sizes = _parameter_sizes(config, sum(grads[1]))
    embed_share = sum(sizes["embedding"]) / max(1, sum(sizes["embedding"]) + sum(sizes["head"]))
    ranks = []
    for r in range(pipe.stages):
        chunks = [c * pipe.stages + r for c in range(pipe.virtual)]
        first, last = r == 0, r == pipe.stages - 1
        ends_here = first * embed_share + last * (1 - embed_share)
        optimizer = _floored(_add((n * pipe.virtual, layer["optimizer"]), (ends_here, ends["optimizer"])))
        held = sizes["layer"] * (n * pipe.virtual) + sizes["embedding"] * first + sizes["head"] * last
        reduce = _reduce_seconds(held, layout, kernels, inner) if layout.sharding == "ddp" else 0.0
        end = line.ends[r] + reduce + sum(optimizer.values())
        compute = _add(*((pipe.micro_batches, forward[j]) for j in chunks),
                       *((pipe.micro_batches, backward[j]) for j in chunks))  # fmt: skip
        ranks.append((end, r, compute, optimizer, reduce))
    end, r, compute, optimizer, reduce = max(ranks, key=lambda x: x[0])
    seconds = _add((1, compute), (1, optimizer))
    seconds[COMMUNICATION] = seconds.get(COMMUNICATION, 0.0) + reduce
    seconds[BUBBLE] = max(0.0, end - sum(seconds.values()))
    first = predict_gpu_step(OpSummary.of([]), gpu, compute_dtype=compute_dtype, kernels=kernels, links=links)
    how = dict(first.how) if isinstance(first, StepTime) else {}
    how[BUBBLE] = (f"{pipe.schedule} schedule, PP {pipe.stages} x {pipe.virtual} chunk(s) of {n} layer(s), "
                   f"{pipe.micro_batches} micro-batches; the slowest rank is stage {r}; a send between stages "
                   f"{send * 1e6:.3g} us")  # fmt: skip
    tokens = layout.micro_batch * seq * pipe.micro_batches
    return StepTime(seconds=seconds, ops=0, replayed=0, fallback=0, fallback_s=0.0, accumulate=pipe.micro_batches,
                    tokens=tokens, how=how, priced_on=getattr(gpu, "key", gpu), hidden={})  # fmt: skip


def _parameter_sizes(config, rank_grad_bytes: int) -> dict[str, list[int]]:
    """Each parameter's gradient bytes on a rank, by where it sits: a block's ("layer", one block), the embedding's,
    the head's (final norm and LM head): the one-layer rank's gradient bytes shared by the parameters' sizes."""
    from lmledger.model import ToyLM

    with torch.device("meta"):
        named = list(ToyLM(dataclasses.replace(config, n_layers=1)).named_parameters())
    per_element = rank_grad_bytes / max(1, sum(p.numel() for _, p in named))
    out: dict[str, list[int]] = {"layer": [], "embedding": [], "head": []}
    for name, p in named:
        where = "layer" if name.startswith("blocks.") else "embedding" if "embed" in name else "head"
        out[where].append(int(p.numel() * per_element))
    return out


def _send_seconds(layout: Layout, elements: int, compute_dtype: str, links: Links) -> float:
    """One hand-over between pipeline stages: a micro-batch's hidden states (or their gradient), split over the TP
    ranks that each send their share (Megatron-LM's scatter-gather across the TP group), on the link between the
    stages' nodes."""
    from lmledger.ledger.count.ops import OpRecord
    from lmledger.ledger.timing.gpu import comm

    width = 1 if compute_dtype == "fp8" else (4 if compute_dtype in ("fp32", "tf32") else 2)
    gpn = max(1, links.gpus_per_node)
    across = layout.gpus > gpn
    hop = dataclasses.replace(links, num_nodes=2 if across else 1)
    op = OpRecord("c10d.send (pipeline, predicted)", "forward", COMMUNICATION, 0, elements * width // layout.tp, 0,
                  compute_dtype, group="pipeline", group_size=2)  # fmt: skip
    return comm.collective(op, hop, 2)[0]


def _reduce_seconds(grads: list[int], layout: Layout, kernels: Kernels, links: Links) -> float:
    """A pipeline rank's data-parallel all-reduce of its gradients (bytes each), after the flush, on one stream."""
    if layout.dp * layout.cp <= 1 or not grads:
        return 0.0
    return sum(_reduce_times(_buckets(tuple(grads), "float32", kernels), layout, links))


def _reduce_times(buckets: list[tuple[int, str]], layout: Layout, links: Links) -> list[float]:
    """Each data-parallel all-reduce's seconds (buckets: nbytes, dtype) over the layout's dp x cp ranks."""
    from lmledger.ledger.count.ops import OpRecord
    from lmledger.ledger.timing.gpu import comm

    world = layout.dp * layout.cp
    ops = [OpRecord("c10d.allreduce_ (DDP bucket, predicted)", "backward", COMMUNICATION, 0, size, 0, dtype,
                    group="data_parallel", group_size=world) for size, dtype in buckets]  # fmt: skip
    return [comm.collective(op, links, world)[0] for op in ops]
