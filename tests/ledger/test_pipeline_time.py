"""A pipelined step on a GPU (ledger/timing/gpu/layout.py): each stage priced from the dry run, run in its schedule."""

import dataclasses

import pytest

from lmledger.ledger.hardware.interconnect import links_for
from lmledger.ledger.timing.gpu import kernels_for
from lmledger.ledger.timing.gpu.layout import BUBBLE, Layout, step_at_layout
from lmledger.ledger.timing.steptime.predict import NoStepTime
from lmledger.model import ModelConfig

GPT = ModelConfig(vocab_size=50304, context_length=1024, d_model=1024, n_layers=8, n_heads=16, d_ff=4096, mlp="gelu",
                  norm="layer", positions="learned", bias=True)  # fmt: skip
SETTINGS = dict(compute_dtype="fp16", kernels=kernels_for("megatron"), links=links_for("a100-80gb", None, None, 8, 1))


def step(config=GPT, **layout):
    found = step_at_layout(config, 1024, Layout(**layout), "16-true", "a100-80gb", **SETTINGS)
    assert not isinstance(found, NoStepTime), found
    return found


def test_one_micro_batch_through_two_stages_is_the_unpipelined_step_and_its_hand_overs():
    # with one micro-batch nothing overlaps: each stage waits for the other, so the step is the whole model's forward
    # and backward, less half the optimizer (each rank steps its own half), plus two sends and their latency
    flat, piped = step(micro_batch=2), step(micro_batch=2, pp=2)
    assert piped.total_s == pytest.approx(flat.total_s - flat.seconds["optimizer"] / 2, rel=0.05)
    assert piped.seconds[BUBBLE] == pytest.approx(piped.total_s / 2, rel=0.2)  # each rank idles about half the step


# A vocabulary small beside a layer, so that the stages are about equal (GPT's LM head at vocabulary 50304 is about
# four of its layers' FLOPs: the last stage sets the pace, as it does in Megatron-LM's runs)
SMALL_HEAD = dataclasses.replace(GPT, vocab_size=1024)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_the_bubble_shrinks_with_micro_batches_as_the_schedule_says(schedule, virtual):
    # pp 4: the idle share is about (pp - 1) / v over m + (pp - 1) / v micro-batches' time; not exactly: the ends make
    # the first and last stages a little slower, and the sends between stages wait on the critical path (v times as
    # many of them interleaved). 16 layers, so that an interleaved chunk holds 2: Megatron's embedding and eager loss
    # are a third of a 1-layer chunk's time at this width
    for m in (4, 16):
        s = step(dataclasses.replace(SMALL_HEAD, n_layers=16), micro_batch=1, pp=4, accumulate=m, schedule=schedule,
                 virtual=virtual)  # fmt: skip
        want = 3 / virtual / (m + 3 / virtual)
        assert s.seconds[BUBBLE] / s.total_s == pytest.approx(want, rel=0.5), (m, s.seconds)


def test_more_stages_shorten_the_step_of_many_micro_batches():
    one, two, four = (step(SMALL_HEAD, micro_batch=1, accumulate=32, pp=pp) for pp in (1, 2, 4))
    assert one.total_s / two.total_s == pytest.approx(2.0, rel=0.15)
    assert one.total_s / four.total_s == pytest.approx(4.0, rel=0.25)


def test_a_depth_that_does_not_split_evenly_says_so():
    found = step_at_layout(dataclasses.replace(GPT, n_layers=6), 1024, Layout(pp=4), "16-true", "a100-80gb",
                           **SETTINGS)  # fmt: skip
    assert isinstance(found, NoStepTime) and "split evenly" in found.reason


def test_the_lm_head_makes_the_last_stage_the_pace_and_the_others_wait():
    # GPT's head at vocabulary 50304: the other stages idle while the last one runs it, 32 times
    balanced, heavy = step(SMALL_HEAD, accumulate=32, pp=2), step(accumulate=32, pp=2)
    assert heavy.seconds[BUBBLE] / heavy.total_s > 2 * balanced.seconds[BUBBLE] / balanced.total_s


@pytest.mark.parametrize("pp", [1, 2])
def test_a_deep_host_bound_step_takes_at_least_its_launches(pp):
    # Megatron-DeepSpeed launches at 21 us an op (frameworks.py): a one-layer step at micro-batch 2 keeps the GPU
    # busier than the host, its further layers do not. Extrapolated in depth, a bigger micro-batch must never
    # come out faster than a smaller one at the same number of micro-batches, nor the step shorter than its launches.
    settings = dict(SETTINGS, kernels=kernels_for("megatron-deepspeed"))
    gpt = dataclasses.replace(GPT, n_layers=12)
    one, two = (step_at_layout(gpt, 1024, Layout(micro_batch=mb, accumulate=4, pp=pp, recompute="full"), "16-true",
                               "a100-80gb", **settings) for mb in (1, 2))  # fmt: skip
    assert two.total_s >= one.total_s
    if pp == 1:
        assert two.hidden["host"] + two.seconds["host"] >= 0.9 * one.hidden["host"] + 0.9 * one.seconds["host"]


def test_a_deep_host_bound_step_still_runs_its_optimizer_and_all_reduce_after_its_last_launch():
    # 24 layers at micro-batch 1 launch for longer than their kernels run; the gradients' all-reduce (after backward,
    # unbucketed) and the optimizer's kernels, grown with the depth, still run after the host's last launch
    settings = dict(SETTINGS, kernels=kernels_for("megatron-deepspeed"))
    gpt = dataclasses.replace(GPT, n_layers=24)
    found = step_at_layout(gpt, 1024, Layout(micro_batch=1, accumulate=4, dp=2, recompute="full"), "16-true",
                           "a100-80gb", **settings)  # fmt: skip
    launches = found.seconds["host"] + found.hidden["host"]
    after = found.seconds["optimizer"] + found.seconds["communication"]
    assert launches > 0.9 * found.total_s and after > 0.02 * found.total_s
    assert found.total_s >= launches + 0.98 * after


def test_context_parallel_halves_a_ranks_compute_and_adds_its_ring():
    # Llama-style (RoPE: learned positions do not shard along the sequence), one sequence of 4096 split over 2 ranks
    llama = ModelConfig(vocab_size=32000, context_length=4096, d_model=1024, n_layers=4, n_heads=16, d_ff=2816)
    settings = dict(SETTINGS, compute_dtype="bf16", kernels=kernels_for("torchtitan"))
    one, two = (step_at_layout(llama, 4096, Layout(cp=cp, sharding="fsdp"), "bf16-mixed", "a100-80gb", **settings)
                for cp in (1, 2))  # fmt: skip
    compute = [s.seconds["matmul"] + s.seconds["attention"] for s in (one, two)]
    assert compute[1] == pytest.approx(compute[0] / 2, rel=0.15)
    assert two.seconds["communication"] + two.hidden["communication"] > one.seconds["communication"]
    learned = step_at_layout(GPT, 1024, Layout(cp=2), "16-true", "a100-80gb", **SETTINGS)
    assert isinstance(learned, NoStepTime) and "position" in learned.reason


def test_context_parallel_beside_tensor_parallel_halves_tps_compute_and_crosses_nodes_past_a_node():
    # Llama-style at 8192 tokens: TP 2 (sequence parallel) with CP 2 beside it computes half of TP 2's rank; the ring of
    # CP 2 beside TP 8 spans 16 ranks, two nodes of 8, so its collectives (and FSDP2's over the same two ranks) cost
    # more than where the 16 ranks share a node
    llama = ModelConfig(vocab_size=32000, context_length=8192, d_model=2048, n_layers=4, n_heads=16, d_ff=5632)
    settings = dict(SETTINGS, compute_dtype="bf16", kernels=kernels_for("torchtitan"))

    def at(links=SETTINGS["links"], **layout):
        found = step_at_layout(llama, 8192, Layout(sharding="fsdp", sequence_parallel=True, **layout), "bf16-mixed",
                               "a100-80gb", **dict(settings, links=links))  # fmt: skip
        assert not isinstance(found, NoStepTime), found
        return found

    tp, both = at(tp=2), at(tp=2, cp=2)
    compute = [s.seconds["matmul"] + s.seconds["attention"] for s in (tp, both)]
    assert compute[1] == pytest.approx(compute[0] / 2, rel=0.15)
    two_nodes, one_node = (at(links=links_for("a100-80gb", None, None, gpn, 16 // gpn), tp=8, cp=2) for gpn in (8, 16))
    ring = [s.seconds["communication"] + s.hidden.get("communication", 0.0) for s in (two_nodes, one_node)]
    assert ring[0] > 1.2 * ring[1]
