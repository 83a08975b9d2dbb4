"""plan layout's library (ledger/timing/gpu/layout.memory_at_layout, search.py): a rank's bytes at a layout from the
one- and two-layer dry runs, held to the dry run of the whole depth, and the search that drops what does not fit."""

import dataclasses

import pytest
import torch

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.hardware.interconnect import links_for
from lmledger.ledger.sharding.fsdp2 import FSDPSettings
from lmledger.ledger.sharding.pipeline import _released_after
from lmledger.ledger.sharding.schedule import Pipeline
from lmledger.ledger.sharding.sharded import predict_sharded
from lmledger.ledger.sharding.tp import SplitAdamW, check_toy_plan
from lmledger.ledger.timing.gpu import kernels_for
from lmledger.ledger.timing.gpu.layout import (
    Layout,
    _megatron_tp,
    memory_at_layout,
    rank_memories,
    step_at_layout,
)
from lmledger.ledger.timing.gpu.search import LONG_CONTEXT, PARALLEL_AFTER_S, WORKER_BYTES, auto_workers, search_layouts
from lmledger.model import ModelConfig, ToyLM

SMALL = ModelConfig(vocab_size=512, context_length=64, d_model=64, n_layers=4, n_heads=4, d_ff=256)
GPT = ModelConfig(**{**SMALL.__dict__, "positions": "learned", "mlp": "gelu", "norm": "layer", "bias": True})


def _whole(layout: Layout, config: ModelConfig = SMALL) -> tuple[int, int]:
    """(state, peak) of the dry run of `config` at its full depth, at `layout` (no pipeline)."""
    with torch.device("meta"):
        model = ToyLM(config)
    ids = torch.empty((layout.micro_batch, 64), dtype=torch.long, device="meta")
    if layout.tp > 1:
        strategy, optimizer = "fsdp2", (lambda p: SplitAdamW(p, lr=1e-4, fused=True))
        fsdp = FSDPSettings(tensor_parallel=layout.tp,
                            shard=_megatron_tp(layout.sharding == "fsdp", layout.sequence_parallel))  # fmt: skip
    else:
        strategy, optimizer, fsdp = (
            layout.sharding.replace("fsdp", "fsdp2"),
            (lambda p: torch.optim.AdamW(p)),
            FSDPSettings(),
        )
    world = layout.tp * (layout.dp if layout.sharding == "fsdp" else 1)
    found = predict_sharded(model, (ids, ids.clone()), step=lambda m, b: m(*b), optimizer=optimizer,
                            precision="bf16-true", strategy=strategy, world_size=world, fsdp=fsdp,
                            activation_checkpointing=True if layout.recompute == "full" else None)  # fmt: skip
    return found.params + found.grads + found.optimizer, found.peak


@pytest.mark.parametrize("layout, config", [
    (Layout(micro_batch=2), SMALL), (Layout(micro_batch=2, recompute="full"), SMALL),
    (Layout(tp=2, micro_batch=2), SMALL), (Layout(dp=2, sharding="fsdp", micro_batch=2), SMALL),
    (Layout(tp=2, micro_batch=2, sequence_parallel=True), GPT),
], ids=["ddp", "ddp-recompute", "tp2", "fsdp2", "gpt-tp2-sp"])  # fmt: skip
def test_a_ranks_bytes_from_one_and_two_layers_are_the_whole_depths(layout, config):
    state, peak = _whole(layout, config)
    memory = memory_at_layout(config, 64, layout, "bf16-true")
    assert memory.state == pytest.approx(state, rel=0.01)
    assert memory.peak == pytest.approx(peak, rel=0.03)


def test_sequence_parallel_splits_a_tp_ranks_activations_and_the_search_runs_it():
    """Under TP 2 with sequence parallel, a GPT rank's saved activations shrink (the norms' inputs and the residual
    stream split too, and, Megatron-LM's column linears regathering their input in backward, the inputs of qkv and
    w1) and its state is unchanged; the search lays every TP layout out with it, unless the embedding is tied to the
    head (sequence parallel splits the two apart)."""
    from lmledger.ledger.timing.gpu.search import candidates

    plain, split = (memory_at_layout(GPT, 64, Layout(tp=2, micro_batch=2, sequence_parallel=sp), "bf16-true")
                    for sp in (False, True))  # fmt: skip
    assert split.state == plain.state
    # each of the 9 LayerNorms (2 a block, the final one) saves its bf16 input (2 x 64 x 64), half of it a rank, and
    # each of the 8 gather sites (attn's, the MLP's) its shard where TP alone saves the whole input
    assert plain.activations - split.activations >= (9 + 8) * (2 * 64 * 64 * 2) // 2
    layouts, _ = candidates(GPT, 64, 4, 8, 4)
    assert {layout.tp > 1 for layout in layouts} == {True, False}
    assert all(layout.sequence_parallel == (layout.tp > 1) for layout in layouts)
    tied, _ = candidates(ModelConfig(**{**GPT.__dict__, "tie_embeddings": True}), 64, 4, 8, 4)
    assert not any(layout.sequence_parallel for layout in tied)
    # 66 tokens split over 2 TP ranks, not over 4: TP 4 runs without sequence parallel, and fit refuses it
    uneven, _ = candidates(GPT, 66, 4, 8, 4)
    assert {(layout.tp, layout.sequence_parallel) for layout in uneven} == {(1, False), (2, True), (4, False)}
    with pytest.raises(ConfigError, match="context_length 66 does not divide by tensor_parallel_size 4"):
        check_toy_plan(dataclasses.replace(GPT, context_length=66), 4, sequence_parallel=True)
    with pytest.raises(UserError, match="sequence parallel splits the sequence over the TP ranks"):
        Layout(sequence_parallel=True)


def test_plan_layouts_sequence_parallel_regathers_the_column_linears_inputs_as_megatron_lm():
    """_megatron_tp's sequence parallel is Megatron-LM's (tp.toy_tp_plan's regather): against torch's styles, a GPT
    rank at TP 2 holds the same state and saves, of the input of qkv and of w1 at each of the 4 layers, its
    sequence shard (2 x 32 x 64, bf16) where torch's save the gathered (2 x 64 x 64): 4 x 2 x (2 x 64 x 64 x 2) / 2
    bytes fewer, exactly."""
    from lmledger.ledger.sharding.tp import toy_tp_plan

    def rank(shard):
        with torch.device("meta"):
            model = ToyLM(GPT)
        ids = torch.empty((2, 64), dtype=torch.long, device="meta")
        return predict_sharded(model, (ids, ids.clone()), step=lambda m, b: m(*b), precision="bf16-true",
                               optimizer=lambda p: SplitAdamW(p, lr=1e-4, fused=True), strategy="fsdp2",
                               world_size=2, fsdp=FSDPSettings(tensor_parallel=2, shard=shard))  # fmt: skip

    torch_styles = rank(lambda model, mesh: toy_tp_plan(model, mesh["tensor_parallel"], True, split_logits=True))
    megatron = rank(_megatron_tp(False, True))
    assert megatron.params == torch_styles.params and megatron.flops_forward == torch_styles.flops_forward
    assert torch_styles.activations - megatron.activations == 4 * 2 * (2 * 64 * 64 * 2) // 2
    assert megatron.peak < torch_styles.peak


def test_a_pipeline_rank_holds_its_layers_and_the_micro_batches_in_flight():
    (flat,) = rank_memories(SMALL, 64, Layout(micro_batch=2), "bf16-true")
    gpipe = rank_memories(SMALL, 64, Layout(micro_batch=2, pp=2, accumulate=8, schedule="gpipe"), "bf16-true")
    onef = rank_memories(SMALL, 64, Layout(micro_batch=2, pp=2, accumulate=8), "bf16-true")
    # the two ranks' state is the whole model's, split by where each parameter sits; the schedule does not move it
    assert sum(r.state for r in gpipe) == pytest.approx(flat.state, abs=2) and [r.state for r in onef] == [
        r.state for r in gpipe
    ]
    # GPipe holds all 8 micro-batches on each rank; 1F1B 2 on the first and 1 on the last
    assert gpipe[0].activations == pytest.approx(4 * onef[0].activations, rel=0.01)
    assert gpipe[1].activations == pytest.approx(8 * onef[1].activations, rel=0.01)


def test_the_search_ranks_what_fits_and_says_why_the_rest_do_not():
    settings = dict(precision="bf16-true", gpu="h100-sxm", compute_dtype="bf16", kernels=kernels_for("pytorch"),
                    links=links_for("h100-sxm", None, None, 2, 1), recomputes=("full",),
                    micro_batches=(1,))  # fmt: skip
    # judged in two spawned workers (each but the first group of layouts that share their dry runs), the tight search
    # below in this process: the layouts both rank are the same candidates, to the byte and the second
    roomy = search_layouts(SMALL, 64, num_gpus=2, global_batch=4, capacity_bytes=80e9, workers=2, **settings)
    assert not [c for c in roomy.dropped if "over the GPU" in c.dropped]
    steps = [c.step.total_s for c in roomy.ranked]
    assert steps == sorted(steps) and len({c.layout for c in roomy.ranked}) == len(steps)
    assert {(c.layout.tp, c.layout.pp) for c in roomy.ranked} == {(1, 1), (2, 1), (1, 2)}
    # under a capacity between the layouts' peaks, those above it are dropped with their peak, the rest still ranked
    peaks = sorted(c.memory.peak for c in roomy.ranked)
    cap = peaks[len(peaks) // 2]
    tight = search_layouts(SMALL, 64, num_gpus=2, global_batch=4, capacity_bytes=cap, workers=1, **settings)
    assert all(c.memory.peak <= cap for c in tight.ranked) and tight.ranked
    assert tight.ranked == [c for c in roomy.ranked if c.memory.peak <= cap]
    over = [c for c in tight.dropped if "over the GPU" in c.dropped]
    assert over and all(c.memory.peak > cap for c in over)
    assert len(tight.ranked) + len(tight.dropped) == len(roomy.ranked) + len(roomy.dropped)


def test_a_search_takes_workers_only_when_long_and_no_more_than_cores_memory_and_groups_allow():
    short = PARALLEL_AFTER_S / 10  # the first group's seconds: ten groups more are the threshold exactly
    assert auto_workers(short, 10, cores=16, free_bytes=64 * WORKER_BYTES) == 1  # not long enough to pay for spawning
    assert auto_workers(short, 11, cores=16, free_bytes=64 * WORKER_BYTES) == 11  # long: one a group, below the cores
    assert auto_workers(short, 100, cores=16, free_bytes=64 * WORKER_BYTES) == 16  # one a core
    assert auto_workers(short, 100, cores=128, free_bytes=int(5.5 * WORKER_BYTES)) == 5  # a login node's memory
    assert auto_workers(short, 100, cores=128, free_bytes=WORKER_BYTES // 2) == 1


def test_a_deep_replicated_peak_holds_its_state_and_grows_with_the_micro_batch():
    # Llama 3 70B's shape on one rank, every block recomputed: the one-layer run peaks in another phase than the
    # two-layer one (its logits), so a peak extrapolated linearly in depth fell below the state at micro-batch 4
    llama = ModelConfig(vocab_size=128256, context_length=8192, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        d_ff=28672)  # fmt: skip
    peaks = [memory_at_layout(llama, 8192, Layout(micro_batch=mb, recompute="full"), "bf16-true") for mb in (2, 4)]
    for m in peaks:
        assert m.peak >= m.state + m.activations
    assert peaks[1].peak > peaks[0].peak


def test_the_search_interleaves_two_to_four_chunks_a_rank_where_the_layers_and_micro_batches_divide():
    from lmledger.ledger.timing.gpu.search import candidates

    layouts, _ = candidates(SMALL, 64, 4, 8, 4)  # 4 layers: PP 2 takes 2 x 2 chunks, PP 4 none
    interleaved = [layout for layout in layouts if layout.schedule == "interleaved"]
    assert interleaved and {(layout.pp, layout.virtual) for layout in interleaved} == {(2, 2)}
    assert all(layout.accumulate % layout.pp == 0 for layout in interleaved)
    assert {layout.pp for layout in layouts if layout.schedule == "1f1b"} == {1, 2, 4}
    # 12 layers: PP 2 in 2 or 3 chunks (4 would be 1.5 layers), PP 4 in 3 (2 would be 1.5 layers; 4 would be 0.75)
    layouts, _ = candidates(dataclasses.replace(SMALL, n_layers=12), 64, 4, 8, 4)
    assert {(layout.pp, layout.virtual) for layout in layouts if layout.schedule == "interleaved"} == {
        (2, 2),
        (2, 3),
        (4, 3),
    }


def test_a_replicated_steps_all_reduce_is_priced_at_depth_and_hides_no_tp_collective():
    """Replicated data parallelism adds its gradients' all-reduce to a TP step and takes nothing away. Llama 3 70B's
    shape at TP 8 over 16 nodes, 2 micro-batches of 2 x 8192 tokens: a line through the one- and two-layer steps had
    priced the replicated step 1.0 s shorter than TP 8 alone (a one-layer backward hides little of the embedding's
    all-reduce, a two-layer one more, and that fall, taken per layer, cut TP's all-reduces out of the deep step).
    Priced at depth, it is no shorter, its exposed communication no less, and the all-reduce's own seconds (exposed
    and hidden) grow with the depth."""
    llama = ModelConfig(vocab_size=128256, context_length=8192, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        d_ff=28672)  # fmt: skip
    settings = dict(compute_dtype="bf16", kernels=kernels_for("compile"),
                    links=links_for("h100-sxm", None, None, 8, 16))  # fmt: skip
    layout = Layout(tp=8, micro_batch=2, accumulate=2, recompute="full", sequence_parallel=True)
    alone = step_at_layout(llama, 8192, layout, "bf16-true", "h100-sxm", **settings)
    steps = {n: step_at_layout(dataclasses.replace(llama, n_layers=n), 8192, dataclasses.replace(layout, dp=16),
                               "bf16-true", "h100-sxm", **settings) for n in (40, 80)}  # fmt: skip
    replicated = steps[80]
    assert replicated.total_s >= alone.total_s
    assert replicated.seconds["communication"] >= alone.seconds["communication"]
    reduce = {n: s.seconds["communication"] + s.hidden["communication"] for n, s in steps.items()}
    assert reduce[80] > reduce[40]


def test_a_framework_with_its_own_pipeline_engine_is_searched_under_its_schedule():
    from lmledger.ledger.timing.gpu.search import candidates, schedules_for

    # Megatron-DeepSpeed pipelines under DeepSpeed's TrainSchedule, which has no interleaving
    layouts, _ = candidates(SMALL, 64, 4, 8, 4, schedules=schedules_for(kernels_for("megatron-deepspeed")))
    assert {(layout.schedule, layout.virtual) for layout in layouts if layout.pp > 1} == {("deepspeed", 1)}
    assert schedules_for(kernels_for("torchtitan"))[:2] == (("1f1b", 1), ("interleaved", 2))
    with pytest.raises(ConfigError, match="no 'deepspeed' schedule"):  # torch's pipelining runs no such stage
        _released_after(Pipeline(2, 4, "deepspeed"), 0)


def test_from_a_long_context_up_the_search_lays_context_parallel_beside_tp_one_sequence_a_micro_batch():
    long = dataclasses.replace(SMALL, context_length=LONG_CONTEXT, n_layers=1)  # one layer: no pipeline to search
    settings = dict(precision="bf16-true", gpu="h100-sxm", compute_dtype="bf16", kernels=kernels_for("torchtitan"),
                    links=links_for("h100-sxm", None, None, 4, 1), recomputes=("full",), shardings=("fsdp",),
                    schedules=(("1f1b", 1),), cps=(1, 2))  # fmt: skip
    found = search_layouts(long, LONG_CONTEXT, num_gpus=4, global_batch=2, capacity_bytes=80e9, **settings)
    laid = {(c.layout.tp, c.layout.cp) for c in found.ranked}
    assert {(1, 2), (2, 2), (2, 1)} <= laid, laid  # CP alone and beside TP, TP alone
    assert all(c.layout.micro_batch == 1 for c in found.ranked if c.layout.cp > 1)
    beside = next(c for c in found.ranked if (c.layout.tp, c.layout.cp) == (2, 2))
    assert beside.layout.sequence_parallel and beside.memory.peak < next(
        c.memory.peak for c in found.ranked if (c.layout.tp, c.layout.cp, c.layout.pp) == (2, 1, 1)
    )
