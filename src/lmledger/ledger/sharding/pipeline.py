"""Pipeline parallelism per stage: the model cut into chunks, and one pipeline rank's step predicted in one process.

The split is torchtitan's (torchtitan/distributed/pipeline_parallel.py, pipeline_module_split): each of the
pp x v chunks is a copy of the model with the blocks of the others removed; the first keeps the embeddings, the
last the final norm and the LM head. Virtual stage j runs on rank j % pp (torch's stage_index_to_group_rank).

`predict_pipeline` runs one rank's optimizer step on a fake copy of its chunks (the dry run's fakes: no memory, no
compute): its forwards and backwards in the order `schedule.orders` gives that rank, holding what torch 2.13's
PipelineStage and schedule hold (torch/distributed/pipelining/stage.py, schedules.py; docs/scale.md "Pipeline
stages"):

    kept for the whole run   a receive buffer per micro-batch for a stage's input (all but the first virtual stage)
                             and one for its output's gradient (all but the last), made at the first step
                             (_PipelineStage._setup_forward_recv_info, _create_grad_recv_info): `comm_buffers`
    per forward              the chunk's saved activations and its output (the stage's fwd_cache) until its
                             backward; on the last stage the micro-batch's loss (the schedule's _internal_losses)
    past that                the references the schedule's loop keeps (`_HOLDS`): a forward's output until its
                             send is dropped, a backward's input gradient until its send is dropped (a gloo Work
                             holds its tensor until the Work dies: test_a_gloo_work_holds_its_tensor_until_it_dies)

So the rank holds at most `schedule.in_flight` micro-batches' activations at once. Its measured twin on real gloo
ranks is ledger.sharding.realranks.measure_pipeline; both are read by `read_rank_step`. Pure torch: no Lightning.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.closedform.activations import measure_saved_activations
from lmledger.ledger.closedform.memory import unique_storage_bytes
from lmledger.ledger.count.flopcounter import StepFlopCounter
from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun import fakecopy
from lmledger.ledger.dryrun.steptypes import NotTraced, OptimizerSpec, StepLedger, no_cyclic_gc
from lmledger.ledger.sharding.rankstate import FakeCopy, ShardedLedger, ShardedTracker, local_state_bytes
from lmledger.ledger.sharding.schedule import BACKWARD, FORWARD, Pipeline, orders

__all__ = [
    "CausalLMChunk",
    "LossFn",
    "predict_pipeline",
    "rank_chunks",
    "read_rank_step",
    "split_causal_lm",
    "split_toy",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, targets) -> a micro-batch's loss


# --------------------------------------------------------------------------------------------
# The split
# --------------------------------------------------------------------------------------------


def _equal_blocks(layers: int, pipe: Pipeline) -> int:
    """Blocks per chunk: the layers split evenly over pp x v chunks, or one line saying why not."""
    chunks, how = pipe.chunks, f"{pipe.stages} stages x {pipe.virtual} chunks"
    if chunks > layers:
        raise ConfigError(f"{layers} layers cannot fill {chunks} pipeline chunks ({how}): use at most {layers}")
    if layers % chunks:
        raise ConfigError(
            f"{layers} layers do not split evenly into {chunks} pipeline chunks ({how}): "
            f"use a layer count divisible by {chunks}"
        )
    return layers // chunks


def _part(model: nn.Module, replace: dict[str, nn.Module | None]) -> nn.Module:
    """A deep copy of `model` with the submodules at the dotted names in `replace` swapped first (for a slice of
    the blocks, None or nn.Identity), so the parts left out are never copied."""
    top = copy.copy(model)
    top._modules = dict(model._modules)  # a table of its own: the original keeps its submodules
    for dotted, value in replace.items():
        *path, name = dotted.split(".")
        parent = top
        for step in path:
            child = copy.copy(getattr(parent, step))
            child._modules = dict(child._modules)
            setattr(parent, step, child)
            parent = child
        setattr(parent, name, value)
    return copy.deepcopy(top)


def _chunk_blocks(blocks: nn.ModuleList, pipe: Pipeline, j: int) -> nn.ModuleList:
    per = _equal_blocks(len(blocks), pipe)
    return nn.ModuleList(blocks[j * per : (j + 1) * per])


def split_toy(model: nn.Module, pipe: Pipeline) -> list[nn.Module]:
    """The toy LM (lmledger.model.ToyLM) as pipe.chunks stage modules, in virtual-stage order (module docstring).

    Each chunk is a ToyLM whose `block_offset` is its first block's index in the whole model, so checkpointing
    picks the same blocks. A tied embedding cannot be split: the embedding and the head would be on two ranks.
    """
    if model.cfg.tie_embeddings and pipe.chunks > 1:
        raise ConfigError("tie_embeddings: the embedding and the LM head would sit on two pipeline stages; untie them")
    chunks = []
    for j in range(pipe.chunks):
        replace: dict[str, nn.Module | None] = {"blocks": _chunk_blocks(model.blocks, pipe, j)}
        if j > 0:
            replace.update(embed=None, pos_embed=None)
        if j < pipe.chunks - 1:
            replace.update(norm=None, lm_head=None)
        part = _part(model, replace)
        part.block_offset = j * len(part.blocks)
        chunks.append(part)
    return chunks


class CausalLMChunk(nn.Module):
    """One pipeline chunk of a transformers causal LM (`model.embed_tokens`, `model.layers`, `model.norm`,
    `lm_head`, as Llama's): token ids in on the first chunk, hidden states on the others; logits out of the last,
    hidden states out of the others. The decoder runs its own forward (masks, rotary positions) over its slice."""

    def __init__(self, lm: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.lm, self.first, self.last = lm, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.lm.model(**inputs, use_cache=False).last_hidden_state
        return self.lm.lm_head(hidden) if self.last else hidden


def split_causal_lm(model: nn.Module, pipe: Pipeline) -> list[CausalLMChunk]:
    """A transformers causal LM as pipe.chunks CausalLMChunks, split by its decoder layers as split_toy splits
    blocks. A tied embedding is refused as there."""
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight and pipe.chunks > 1:
        raise ConfigError("tie_word_embeddings: the embedding and the LM head would sit on two pipeline stages")
    chunks = []
    for j in range(pipe.chunks):
        first, last = j == 0, j == pipe.chunks - 1
        replace: dict[str, nn.Module | None] = {"model.layers": _chunk_blocks(model.model.layers, pipe, j)}
        if not first:
            replace["model.embed_tokens"] = None
        if not last:
            replace.update({"model.norm": nn.Identity(), "lm_head": None})
        chunks.append(CausalLMChunk(_part(model, replace), first, last))
    return chunks


def rank_chunks(chunks: list, pipe: Pipeline, rank: int) -> list:
    """The chunks pipeline rank `rank` runs, in its order: virtual stages rank, rank + pp, ..."""
    if not 0 <= rank < pipe.stages:
        raise ConfigError(f"pipeline rank {rank} of {pipe.stages} stages: use 0 to {pipe.stages - 1}")
    if len(chunks) != pipe.chunks:
        raise ConfigError(f"{len(chunks)} chunks for {pipe.chunks} virtual stages ({pipe.stages} x {pipe.virtual})")
    return [chunks[c * pipe.stages + rank] for c in range(pipe.virtual)]


# --------------------------------------------------------------------------------------------
# What torch's schedule loop keeps past the stage's own fwd_cache
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Hold:
    """How long a schedule's loop keeps a forward's output (its `output` variable and the Work of its send) and a
    backward's input gradient (the Work of its send), each as "until the end of the rank's next action of a kind"
    or "until the step's end"."""

    output: str  # "next forward", "end", or "action" (dropped with the action's locals)
    output_sent: str  # the same, for the output of a virtual stage that sends it on
    input_grad: str  # "next backward" or "end"


# torch 2.13, torch/distributed/pipelining/schedules.py:
#   Schedule1F1B._step_microbatches: `output` and `fwd_sends` are replaced after the next forward, `bwd_sends` and the
#     cool-down's `send_work` after the next backward; the warm-up's `send_work` keeps the Work of its next-to-last
#     forward until the steady loop ends (`_warmup_send_held`)
#   ScheduleGPipe._step_microbatches: `output` is replaced by each forward and kept after the last; every send's Work
#     sits in fwd_sends_to_wait / bwd_sends_to_wait until the step's end
#   _PipelineScheduleRuntime._step_microbatches (ScheduleInterleaved1F1B): every send's Work sits in `send_ops` until
#     the step's end; `output` is a local of _perform_action
_HOLDS = {
    "1f1b": _Hold(output="next forward", output_sent="next forward", input_grad="next backward"),
    "gpipe": _Hold(output="next forward", output_sent="end", input_grad="end"),
    "interleaved": _Hold(output="action", output_sent="end", input_grad="end"),
}


def _released_after(pipe: Pipeline, rank: int) -> list[int]:
    """For each of the rank's actions, the index of the action after which the schedule's loop drops what it kept
    of it beyond the stage's fwd_cache (len(actions): the step's end)."""
    if pipe.schedule not in _HOLDS:
        raise ConfigError(f"torch's pipelining has no {pipe.schedule!r} schedule to run a stage under: choose one of "
                          f"{', '.join(_HOLDS)}")  # fmt: skip
    actions = orders(pipe)[rank]
    end, hold, last = len(actions), _HOLDS[pipe.schedule], pipe.chunks - 1

    def until(rule: str, n: int) -> int:
        if rule in ("action", "end"):
            return n if rule == "action" else end
        kind = FORWARD if rule == "next forward" else BACKWARD
        return next((k for k in range(n + 1, end) if actions[k][0] == kind), end)

    out = []
    for n, (kind, _, j) in enumerate(actions):
        if kind == BACKWARD:
            out.append(until(hold.input_grad, n) if j > 0 else n)
        else:
            out.append(until(hold.output_sent if j < last else hold.output, n))
    if pipe.schedule == "1f1b" and rank < pipe.stages - 1:
        _warmup_send_held(actions, out)
    return out


def _warmup_send_held(actions: list, out: list[int]) -> None:
    """Schedule1F1B's warm-up sends each forward but its last, each Work kept in `send_work` until the next; the
    next-to-last's stays there through the steady loop, dropped once the backward after the last forward ran."""
    warmup = next(n for n, a in enumerate(actions) if a[0] == BACKWARD)  # forwards before the first backward
    if warmup >= 2:
        last_forward = max(n for n, a in enumerate(actions) if a[0] == FORWARD)
        after = next(n for n in range(last_forward, len(actions)) if actions[n][0] == BACKWARD)
        out[warmup - 2] = max(out[warmup - 2], after)


# --------------------------------------------------------------------------------------------
# One rank's step, as torch's stage runs it
# --------------------------------------------------------------------------------------------


class _RankStep:
    """A pipeline rank's chunks stepped through its actions (orders(pipe)[rank]), holding what the stage and the
    schedule hold (module docstring). `metas` are each virtual stage's (input, output) shapes and dtypes, as torch's
    metadata inference finds them; the receive buffers are made from them once, as torch makes them."""

    def __init__(self, chunks: list[nn.Module], pipe: Pipeline, rank: int, loss_fn: LossFn, metas: list) -> None:
        self.chunks, self.pipe, self.rank, self.loss_fn = chunks, pipe, rank, loss_fn
        m, last = pipe.micro_batches, pipe.chunks - 1
        mine = [c * pipe.stages + rank for c in range(pipe.virtual)]
        empty = lambda meta: torch.empty(meta[0], dtype=meta[1])  # noqa: E731  (_utils._make_tensor_from_meta)
        self.inputs = {j: [empty(metas[j][0]) for _ in range(m)] for j in mine if j > 0}
        self.output_grads = {j: [empty(metas[j][1]) for _ in range(m)] for j in mine if j < last}

    def buffers(self) -> list[torch.Tensor]:
        return [t for kept in (*self.inputs.values(), *self.output_grads.values()) for t in kept]

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor], mark: Callable[[str], None]) -> list[torch.Tensor]:
        """The schedule's step: every action, then the gradients divided by m (perform_reduce_grad). Returns the
        losses, which the caller keeps (torchtitan logs them after the optimizer step)."""
        pipe = self.pipe
        inputs, targets = (t.tensor_split(pipe.micro_batches) for t in batch)  # views, as _split_tensor makes them
        cache: dict[tuple[int, int], tuple] = {}
        losses: list[torch.Tensor] = []
        kept: dict[int, list[torch.Tensor]] = {}  # by the action after which the loop drops them
        plan = zip(orders(pipe)[self.rank], _released_after(pipe, self.rank), strict=True)
        for n, (action, until) in enumerate(plan):
            mark("forward" if action[0] == FORWARD else "backward")
            kept.setdefault(until, []).append(self._run(action, inputs, cache, losses))
            kept.pop(n, None)  # dropped after the action's compute: before the loss, which the loop computes next
            if action[0] == FORWARD and action[2] == pipe.chunks - 1:
                losses.append(self.loss_fn(cache[action[1], action[2]][0], targets[action[1]]))
        kept.clear()
        for chunk in self.chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.div_(pipe.micro_batches)
        return losses

    def _run(self, action, inputs, cache, losses) -> torch.Tensor | None:
        """One action (stage.forward_one_chunk or backward_one_chunk); returns what the loop keeps of it."""
        kind, i, j = action
        chunk, last = self.chunks[j // self.pipe.stages], self.pipe.chunks - 1
        if kind == FORWARD:
            x = inputs[i] if j == 0 else self.inputs[j][i].requires_grad_()
            out = chunk(x)
            cache[i, j] = (out, x)
            return out
        out, x = cache.pop((i, j))
        if j == last:
            torch.autograd.backward(losses[i])
        else:
            torch.autograd.backward(out, self.output_grads[j][i])
        if j == 0:
            return None
        grad, x.grad = x.grad, None  # _backward.stage_backward: the input's gradient leaves .grad for the send
        if j == last:
            out.detach_()  # backward_one_chunk releases a non-first last stage's output from the graph
        return grad


# --------------------------------------------------------------------------------------------
# Reading a rank's two steps (the prediction's and the real rank's alike)
# --------------------------------------------------------------------------------------------


def read_rank_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: object,
    step: Callable[[Callable[[str], None]], object],
    *,
    micro_batches: int,
    buffers: Callable[[], list[torch.Tensor]],
    autocast: torch.dtype | None = None,
    device: torch.device | None = None,
) -> StepLedger:
    """Two optimizer steps of one pipeline rank: zero_grad, `step(mark)` (the schedule's step, calling mark with
    "forward" or "backward" before each action), the optimizer step.

    Step 1: FLOPs split by action, the saved activations (of one micro-batch: the step's divided by micro_batches),
    then the state on the local shards. Step 2: the peak, live bytes from the start: the rank's chunks (`model`),
    optimizer, `batch` and the pipeline's kept `buffers()` (made in step 1). zero_grad only frees: it is charged to
    backward, as the dry run charges it.
    """
    device = device or torch.device("cpu")
    flops = {"forward": 0, "backward": 0}
    counted: list = [0, "forward"]  # FLOPs counted so far, and where the next ones go
    tracker: list[ShardedTracker | None] = [None]
    counter = StepFlopCounter()

    def mark(phase: str) -> None:
        """From here on the step is in `phase`. An optimizer's own FLOPs count with the forward (dryrun/watch.py)."""
        if counter.mode is not None:
            total = counter.get_total_flops()
            flops[counted[1]] += total - counted[0]
            counted[:] = [total, "backward" if phase == "backward" else "forward"]
        if tracker[0] is not None:
            tracker[0].phase(phase)

    def one_step() -> object:
        (optimizer or model).zero_grad(set_to_none=True)
        context = (
            torch.autocast(device.type, dtype=autocast, cache_enabled=False) if autocast else contextlib.nullcontext()
        )
        with context:
            losses = step(mark)
        mark("optimizer step")
        dryrun._optimizer_step(optimizer)
        return losses  # alive until the step is over, as a training loop keeps them to log

    with measure_saved_activations(model) as saved, counter:
        one_step()
        mark("optimizer step")
    by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    state = local_state_bytes(model, [optimizer])
    with no_cyclic_gc():
        tracker[0] = ShardedTracker().track(model, optimizer, fakecopy.batch_tensors(batch), buffers())
        tracker[0].phase("backward")
        tracker[0].start()
        try:
            one_step()
        finally:
            tracker[0].stop()
    peaks = {p: tracker[0].phase_peaks.get(p, 0) for p in ("forward", "backward", "optimizer step")}
    return StepLedger(
        **state, buffers=unique_storage_bytes(model.buffers()),
        batch=unique_storage_bytes(fakecopy.batch_tensors(batch)), activations=saved.activations // micro_batches,
        autocast_weight_copies=saved.autocast_weight_copies // micro_batches, peak=tracker[0].peak_bytes,
        peak_phase=max(peaks, key=peaks.__getitem__), phase_peaks=peaks, flops_forward=flops["forward"],
        flops_backward=flops["backward"], flops_by_op=by_op,
    )  # fmt: skip


def pipeline_ledger(result: StepLedger, pipe: Pipeline, rank: int, buffers: list[torch.Tensor]) -> ShardedLedger:
    """A rank's step as the one per-rank type: world size pp, its kept receive buffers as comm_buffers."""
    fields = {name: getattr(result, name) for name in StepLedger.__dataclass_fields__}
    return ShardedLedger(
        **fields, strategy="pipeline", world_size=pipe.stages, comm_buffers=unique_storage_bytes(buffers),
        pipeline=pipe, pipeline_rank=rank,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The prediction
# --------------------------------------------------------------------------------------------


def predict_pipeline(
    chunks: list[nn.Module],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    pipe: Pipeline,
    rank: int,
    loss_fn: LossFn,
    optimizer: OptimizerSpec = None,
    precision: str | int = "32-true",
    device: torch.device | str | None = None,
) -> ShardedLedger | NotTraced:
    """Pipeline rank `rank`'s optimizer step, predicted in one process (module docstring).

        chunks     all pp x v chunks, in virtual-stage order (split_toy, split_causal_lm); real or on the meta device
        batch      (inputs, targets) of the whole step: pipe.micro_batches micro-batches along dim 0, as
                   schedule.step takes them (every rank holds it; the first stage reads the inputs, the last the
                   targets)
        loss_fn    (last chunk's output, a micro-batch's targets) -> its mean loss (the schedule's loss_fn)
        optimizer  a factory params -> optimizer over the rank's chunks (one over all its chunks)

    NotTraced, with one line, for a model the dry run cannot trace. Bad input is a ConfigError or UserError.
    """
    mine = nn.ModuleList(rank_chunks(chunks, pipe, rank))
    inputs, _ = batch
    if inputs.shape[0] % pipe.micro_batches:
        raise ConfigError(f"a batch of {inputs.shape[0]} does not split into {pipe.micro_batches} equal micro-batches")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise UserError("predict_pipeline takes an optimizer factory (params -> optimizer), not an optimizer")
    fake = FakeCopy(mine, batch, None, optimizer, precision, device)
    if fake.error is not None:
        return fake.error
    try:
        everything, _ = fakecopy.fake_copy(nn.ModuleList(chunks), fake.mode, fake.target, fake.dtype)
        with fake.mode, torch.compiler.set_stance("force_eager"), fakecopy.RealOutputStorages():
            with fakecopy.eager_library_decisions():
                metas = _stage_metas(everything, fake, inputs.shape[0] // pipe.micro_batches)
                emulated = _RankStep(list(fake.model), pipe, rank, loss_fn, metas)
                result = read_rank_step(
                    fake.model, fake.optimizer, fake.batch, lambda mark: emulated(fake.batch, mark),
                    micro_batches=pipe.micro_batches, buffers=emulated.buffers, autocast=fake.autocast,
                    device=fake.target,
                )  # fmt: skip
    except UserError:
        raise
    except Exception as err:
        return NotTraced(f"the pipeline stage does not run on fake tensors: {dryrun.why(err)}")
    return pipeline_ledger(result, pipe, rank, emulated.buffers())


def _stage_metas(everything: nn.ModuleList, fake: FakeCopy, micro_batch: int) -> list[tuple]:
    """Each virtual stage's ((input shape, dtype), (output shape, dtype)) for one micro-batch, found as torch's
    metadata inference finds them: the chunks (a fake copy of all of them) run in turn without grad."""
    x = fake.batch[0][:micro_batch]
    metas = []
    context = torch.autocast(fake.target.type, dtype=fake.autocast) if fake.autocast else contextlib.nullcontext()
    with torch.no_grad(), context:
        for chunk in everything:
            y = chunk(x)
            metas.append(((x.shape, x.dtype), (y.shape, y.dtype)))
            x = y
    return metas
