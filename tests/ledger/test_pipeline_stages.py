"""Pipeline parallelism per stage (ledger/sharding/pipeline.py): the split, and each rank's step predicted in one
process held to torch.distributed.pipelining on real gloo ranks (PipelineStage with Schedule1F1B, ScheduleGPipe,
ScheduleInterleaved1F1B): the toy LM and a tiny Hugging Face Llama. One launch of 2 ranks runs every case."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from lmledger.errors import ConfigError
from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.sharding.pipeline import predict_pipeline, rank_chunks, split_causal_lm, split_toy
from lmledger.ledger.sharding.realranks import measure_pipeline
from lmledger.ledger.sharding.schedule import Pipeline, in_flight
from lmledger.model import ModelConfig, ToyLM

TOY = ModelConfig(vocab_size=256, context_length=16, d_model=32, n_layers=4, n_heads=2, d_ff=64)
MICRO_BATCH = 2
# (model, pipeline, precision, activation checkpointing: every n-th block of the whole model)
CASES = [
    ("toy", Pipeline(2, 4, "1f1b"), "32-true", 0),
    ("toy", Pipeline(2, 4, "gpipe"), "32-true", 0),
    ("toy", Pipeline(2, 4, "interleaved", 2), "32-true", 0),
    ("toy", Pipeline(2, 2, "1f1b"), "bf16-mixed", 2),
    ("llama", Pipeline(2, 2, "1f1b"), "32-true", 0),
]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _batch(pipe: Pipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch: pipe.micro_batches micro-batches of MICRO_BATCH x 16 tokens."""
    g = torch.Generator().manual_seed(0)
    size = (MICRO_BATCH * pipe.micro_batches, 16)
    return torch.randint(0, 256, size, generator=g), torch.randint(0, 256, size, generator=g)


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, max_position_embeddings=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _chunks(kind: str, pipe: Pipeline, ac: int = 0) -> list:
    torch.manual_seed(0)
    if kind == "toy":
        return split_toy(ToyLM(dataclasses.replace(TOY, activation_checkpointing=ac)), pipe)
    return split_causal_lm(_llama(), pipe)


def _measure(cases) -> list:
    return [
        measure_pipeline(_chunks(kind, pipe, ac), _batch(pipe), pipe=pipe, loss_fn=_loss, optimizer=_adamw,
                         precision=precision)
        for kind, pipe, precision, ac in cases
    ]  # fmt: skip


@functools.cache  # a case's rank predicts the same ledger each time: a test after the first reads it from here
def _predict(case, rank: int):
    kind, pipe, precision, ac = case
    return predict_pipeline(
        _chunks(kind, pipe, ac), _batch(pipe), pipe=pipe, rank=rank, loss_fn=_loss, optimizer=_adamw,
        precision=precision,
    )  # fmt: skip


@pytest.fixture(scope="module")
def measured(gloo_ranks) -> list:
    """Every case on the same 2 real gloo ranks: measured[rank][case]."""
    return gloo_ranks(_measure, 2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].schedule}-v{c[1].virtual}-{c[2]}-ac{c[3]}")
def test_each_rank_matches_real_gloo_ranks(case, measured):
    for rank in range(case[1].stages):
        predicted, real = _predict(case, rank), measured[rank][CASES.index(case)]
        assert not isinstance(predicted, NotTraced), predicted
        fields = ("params", "grads", "optimizer", "buffers", "activations", "comm_buffers", "flops_forward",
                  "flops_backward")  # fmt: skip
        assert {f: getattr(predicted, f) for f in fields} == {f: getattr(real, f) for f in fields}, (case, rank)
        assert abs(predicted.peak / real.peak - 1) <= 0.03, (case, rank, predicted.peak, real.peak)
        # exact, phase by phase: a difference means torch's stage or schedule now holds something else (pipeline._HOLDS)
        assert predicted.phase_peaks == real.phase_peaks, (case, rank)
        assert (predicted.strategy, predicted.world_size, predicted.pipeline_rank) == ("pipeline", 2, rank)


def test_one_f_one_b_holds_in_flight_micro_batches_and_gpipe_all_of_them():
    # rank 0 of 2: 1F1B holds pp = 2 micro-batches at its peak whatever m is, GPipe all m. Doubling m from 4 to 8 adds
    # the batch and the receive buffers (one a micro-batch) under 1F1B; under GPipe 4 micro-batches' activations and
    # outputs too.
    def peak(schedule: str, m: int):
        pipe = Pipeline(2, m, schedule)
        return _predict(("toy", pipe, "32-true", 0), 0), in_flight(pipe, 0)  # m = 4: CASES' first two, as predicted

    (one4, held4), (one8, held8) = peak("1f1b", 4), peak("1f1b", 8)
    assert held4 == held8 == 2
    hidden = MICRO_BATCH * 16 * TOY.d_model * 4  # one micro-batch's hidden state, fp32
    assert one8.comm_buffers - one4.comm_buffers == 4 * hidden
    batch = one8.batch - one4.batch
    assert one8.peak - one4.peak == batch + 4 * hidden
    (g4, gheld4), (g8, gheld8) = peak("gpipe", 4), peak("gpipe", 8)
    assert (gheld4, gheld8) == (4, 8)
    saved = g4.activations - MICRO_BATCH * 16 * 8  # a micro-batch's saved tensors but its token ids (the batch's)
    assert g8.peak - g4.peak == batch + 4 * hidden + 4 * (saved + hidden)


@pytest.mark.parametrize("virtual", [1, 2])
def test_the_toy_split_runs_as_the_whole_model(virtual):
    torch.manual_seed(0)
    model = ToyLM(dataclasses.replace(TOY, activation_checkpointing=3))
    pipe = Pipeline(2, 2, "interleaved" if virtual > 1 else "1f1b", virtual)
    chunks = split_toy(model, pipe)
    assert sum(c.num_parameters() for c in chunks) == model.num_parameters()
    assert [c.block_offset for c in chunks] == list(range(0, 4, 4 // pipe.chunks))
    assert chunks[0].lm_head is None and chunks[-1].embed is None and chunks[-1].lm_head is not None
    # checkpointing picks blocks by their index in the whole model: blocks 0 and 3 of 4
    blocks = [(c, c.block_offset + i) for c in chunks for i in range(len(c.blocks))]
    assert [index for c, index in blocks if c.cfg.is_checkpointed(index)] == [0, 3]
    x = torch.randint(0, 256, (2, 16))
    out = x
    for chunk in chunks:
        out = chunk(out)
    torch.testing.assert_close(out, model(x))
    assert rank_chunks(chunks, pipe, 1) == chunks[1 :: pipe.stages]


def test_the_llama_split_runs_as_the_whole_model():
    torch.manual_seed(0)
    model = _llama(layers=4)
    chunks = split_causal_lm(model, Pipeline(2, 2, "interleaved", 2))
    assert sum(p.numel() for c in chunks for p in c.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (2, 16))
    out = x
    for chunk in chunks:
        out = chunk(out)
    torch.testing.assert_close(out, model(input_ids=x, use_cache=False).logits)


@pytest.mark.parametrize(
    "layers,pipe,says",
    [
        (3, Pipeline(2, 2, "1f1b"), "3 layers do not split evenly into 2 pipeline chunks"),
        (4, Pipeline(8, 8, "1f1b"), "4 layers cannot fill 8 pipeline chunks"),
        (4, Pipeline(2, 2, "interleaved", 4), "4 layers cannot fill 8 pipeline chunks (2 stages x 4 chunks)"),
    ],
)
def test_a_depth_that_does_not_split_is_one_line(layers, pipe, says):
    with pytest.raises(ConfigError, match=r"^" + says.replace("(", r"\(").replace(")", r"\)")) as err:
        split_toy(ToyLM(dataclasses.replace(TOY, n_layers=layers)), pipe)
    assert "\n" not in str(err.value)


def test_other_bad_input_is_one_line():
    pipe = Pipeline(2, 2, "1f1b")
    with pytest.raises(ConfigError, match="tie_embeddings"):
        split_toy(ToyLM(dataclasses.replace(TOY, tie_embeddings=True)), pipe)
    chunks = _chunks("toy", pipe)
    with pytest.raises(ConfigError, match="pipeline rank 2 of 2 stages"):
        rank_chunks(chunks, pipe, 2)
    with pytest.raises(ConfigError, match="does not split into 2 equal micro-batches"):
        predict_pipeline(chunks, (torch.zeros(3, 16, dtype=torch.long),) * 2, pipe=pipe, rank=0, loss_fn=_loss)
