"""Context parallelism per rank (ledger/sharding/context.py): torch's ring attention with the CPU flash kernel, one
rank's step predicted on fakes held to real gloo ranks (one launch of 2 ranks runs every case, and records torch's
own context_parallel refusing the CPU kernel), and the fake ranks against the closed forms at 2 and 4 ranks."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.count.ops import COMMUNICATION
from lmledger.ledger.dryrun.engine import NotTraced, dry_run
from lmledger.ledger.hardware.interconnect import collective_kind
from lmledger.ledger.sharding import context
from lmledger.model import ModelConfig, ToyLM

TOY = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
SEQ, BATCH = 32, 2
# (FSDP2 over the cp ranks or replicated, rotate method, precision, every block checkpointed)
CASES = [
    (True, "allgather", "32-true", False),
    (False, "alltoall", "32-true", False),
    (True, "allgather", "bf16-mixed", True),
]
TORCH_REFUSAL = (
    "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
    "sharding strategy registered."
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (BATCH, SEQ), generator=g), torch.randint(0, 64, (BATCH, SEQ), generator=g)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _step(model, batch):
    return model(*batch)


def _torch_context_parallel() -> str:
    """What torch's own context_parallel does with the toy LM's attention on this rank's CPU tensors."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = (torch.randn(1, 2, SEQ, 8) for _ in range(3))
    try:
        with context_parallel(init_device_mesh("cpu", (dist.get_world_size(),)), buffers=[q, k, v],
                              buffer_seq_dims=[2, 2, 2]):  # fmt: skip
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as err:  # noqa: BLE001 - the refusal is the record
        return f"{type(err).__name__}: {err}"
    return "ran"


def _rank_worker() -> tuple[str, list]:
    refusal = _torch_context_parallel()
    measured = []
    for fsdp, rotate, precision, ac in CASES:
        torch.manual_seed(0)
        measured.append(context.measure_context(
            ToyLM(TOY), _batch(), rotate=rotate, step=_step, optimizer=_adamw, precision=precision, fsdp=fsdp,
            activation_checkpointing=ac,
        ))  # fmt: skip
    return refusal, measured


@functools.cache  # two of CASES train in 32-true: the same two steps
def _unsharded_losses(precision: str) -> list[float]:
    torch.manual_seed(0)
    model = ToyLM(TOY)
    opt = _adamw(model.parameters())
    losses = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model(*_batch())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_real_ranks_hold_the_prediction(gloo_ranks):
    """On 2 gloo ranks: torch's context_parallel refuses the CPU attention kernel (its exact error); the ring as
    ring_attention runs it gives the whole batch's loss before and after an AdamW step, and each rank's state,
    saved activations and FLOPs equal the prediction's, its peak and every phase's within 3 %."""
    results = gloo_ranks(_rank_worker, 2)
    assert [refusal for refusal, _ in results] == [TORCH_REFUSAL] * 2
    torch.manual_seed(0)
    model = ToyLM(TOY)
    for index, (fsdp, rotate, precision, ac) in enumerate(CASES):
        expected = _unsharded_losses(precision)
        for rank, (_, measured) in enumerate(results):
            real, losses = measured[index]
            predicted = context.predict_context(
                model, _batch(), cp=2, rank=rank, rotate=rotate, step=_step, optimizer=_adamw, precision=precision,
                fsdp=fsdp, activation_checkpointing=ac,
            )  # fmt: skip
            case = (fsdp, rotate, precision, ac, rank)
            assert not isinstance(predicted, NotTraced), predicted
            for field in ("params", "grads", "optimizer", "activations", "flops_forward", "flops_backward",
                          "comm_buffers"):  # fmt: skip
                assert getattr(predicted, field) == getattr(real, field), (case, field)
            assert abs(predicted.peak - real.peak) <= 0.03 * real.peak, (case, predicted.peak, real.peak)
            for phase, peak in real.phase_peaks.items():
                assert abs(predicted.phase_peaks[phase] - peak) <= 0.03 * peak, (case, phase)
            tolerance = 1e-5 if precision == "32-true" else 2e-3
            assert losses == pytest.approx(expected, rel=tolerance), case
            assert (predicted.strategy, predicted.world_size) == ("context_parallel", 2)


def test_fake_ranks_against_the_closed_forms():
    """At cp 2 and 4 (replicated state): the state is the unsharded step's; the saved activations are 1 / cp of its
    plus the head merge's copy (merge_copy_bytes), within 8 bytes (the 4-byte loss, whole on every rank); the ring's
    collectives are ring_traffic's, kind and buffer, phase by phase, in group context_parallel of size cp."""
    with torch.device("meta"):
        model = ToyLM(dataclasses.replace(TOY, context_length=64))
    seq = 64
    batch = (torch.empty(BATCH, seq, dtype=torch.long, device="meta"),) * 2
    wholes = {}
    for precision, cp, rank, rotate in (("32-true", 2, 0, "allgather"), ("32-true", 2, 1, "alltoall"),
                                        ("32-true", 4, 0, "alltoall"), ("32-true", 4, 3, "allgather"),
                                        ("bf16-mixed", 2, 0, "alltoall")):  # fmt: skip
        if precision not in wholes:
            wholes[precision] = dry_run(model, batch, step=_step, optimizer=_adamw, precision=precision)
        whole, case = wholes[precision], (precision, cp, rank, rotate)
        ledger = context.predict_context(model, batch, cp=cp, rank=rank, rotate=rotate, step=_step,
                                         optimizer=_adamw, precision=precision, fsdp=False)  # fmt: skip
        assert (ledger.params, ledger.grads, ledger.optimizer) == (whole.params, whole.grads, whole.optimizer)
        extra = context.merge_copy_bytes(model.cfg, seq, cp, BATCH, precision, rank)
        assert extra > 0 if rank < cp - 1 else extra == 0
        assert abs(ledger.activations - (whole.activations / cp + extra)) <= 8, case
        expected = context.ring_traffic(model.cfg, seq, cp, BATCH, precision, rotate)
        for phase, ring in expected.items():
            ops = [op for op in ledger.ops.ops
                   if op.phase == phase and op.category == COMMUNICATION and collective_kind(op.name)]  # fmt: skip
            assert [(collective_kind(op.name), op.bytes_read) for op in ops] == ring, (case, phase)
            assert {(op.group, op.group_size) for op in ops} == {(context.CP_GROUP, cp)}


def test_beside_tensor_parallel_against_the_closed_forms():
    """CP beside TP 2 on fakes (torchtitan's mesh), FSDP2 over the cp ranks: the state is TP x FSDP2's over as many
    data-parallel ranks; the ring passes the rank's own heads (ring_traffic at tp 2) while TP's collectives keep their
    group; the saved activations are TP's at the whole sequence by 1 / cp, but for what does not shrink with the
    rank's tokens (the gathered weights, the loss), the same at cp 2 and 4 and no more than the rank's weights; the
    ranks differ by the head merge's copy of 1 / tp of the width. Sequence parallel's state is the same. Then: after a
    TP-only world, a CP x TP world dry-runs (DTensor's sharding caches keep the earlier world's equal meshes, whose
    groups are gone: ledger.sharding.fsdp2._forget_meshes)."""
    from lmledger.ledger.sharding.sharded import FSDPSettings, predict_sharded

    cfg = dataclasses.replace(TOY, context_length=64, n_heads=4)
    with torch.device("meta"):
        model = ToyLM(cfg)
    seq = 64
    batch = (torch.empty(BATCH, seq, dtype=torch.long, device="meta"),) * 2
    beyond, tp_fsdps = {}, {}
    for cp, rank, rotate, sp in ((2, 0, "allgather", False), (2, 1, "alltoall", False), (4, 3, "allgather", False),
                                 (2, 0, "alltoall", True)):  # fmt: skip
        if (cp, sp) not in tp_fsdps:
            tp_fsdps[cp, sp] = predict_sharded(model, batch, step=_step, optimizer=_adamw, strategy="fsdp2",
                                               world_size=2 * cp, fsdp=FSDPSettings(tensor_parallel=2,
                                                                                    sequence_parallel=sp))  # fmt: skip
        tp_fsdp = tp_fsdps[cp, sp]
        ledger = context.predict_context(model, batch, cp=cp, rank=rank, tp=2, rotate=rotate, step=_step,
                                         optimizer=_adamw, sequence_parallel=sp)  # fmt: skip
        case = (cp, rank, rotate, sp)
        assert (ledger.world_size, ledger.tensor_parallel) == (2 * cp, 2), case
        state = ("params", "grads", "optimizer", "comm_buffers")
        assert [getattr(ledger, f) for f in state] == [getattr(tp_fsdp, f) for f in state], case
        for phase, ring in context.ring_traffic(cfg, seq, cp, BATCH, "32-true", rotate, tp=2).items():
            ops = [op for op in ledger.ops.ops if op.phase == phase and op.group == context.CP_GROUP
                   and collective_kind(op.name)]  # fmt: skip
            assert [(collective_kind(op.name), op.bytes_read) for op in ops] == ring, (case, phase)
        groups = {(op.group, op.group_size) for op in ledger.ops.ops if op.category == COMMUNICATION and op.group}
        assert groups == {(context.CP_GROUP, cp), ("tensor_parallel", 2), ("data_parallel", cp)}, case
        if not sp:
            merge = context.merge_copy_bytes(cfg, seq, cp, BATCH, "32-true", rank) // 2
            whole = tp_fsdp.activations  # FSDP2 over cp ranks without the ring: every token on each rank
            beyond[case] = (ledger.activations - merge - whole / cp) / (1 - 1 / cp)
            assert 0 < beyond[case] <= ledger.params * cp + 8, beyond  # the weights gathered whole, and the loss
    assert max(beyond.values()) - min(beyond.values()) <= 1, beyond  # one amount, whatever cp and rank


def test_context_rank_for_the_gpu_model():
    """context_rank gives layout._rank_ops's shape, cached; FSDP2 over dp x cp ranks shards the state dp x cp ways
    and puts its collectives in data_parallel; recompute runs the ring's forward again in backward."""
    cfg = dataclasses.replace(TOY, context_length=64)
    ops, grads, forward, (state, activations, peak) = context.context_rank(cfg, 64, 2, 1, "bf16-mixed")
    assert context.context_rank(cfg, 64, 2, 1, "bf16-mixed")[0] is ops
    assert forward > 0 and 0 < activations < peak and state > 0 and sum(grads) > 0
    groups = Counter((op.group, op.group_size) for op in ops.ops if op.category == COMMUNICATION and op.group)
    assert set(groups) == {(context.CP_GROUP, 2), ("data_parallel", 2)}
    replicated = context.context_rank(cfg, 64, 2, 1, "bf16-mixed", sharding="ddp")[3][0]
    wider = context.context_rank(cfg, 64, 2, 1, "bf16-mixed", dp=2)
    assert wider[3][0] < state < replicated
    assert abs(wider[3][0] - replicated / 4) <= 0.02 * replicated / 4
    assert {op.group_size for op in wider[0].ops if op.group == "data_parallel"} == {4}
    full = context.context_rank(cfg, 64, 2, 1, "bf16-mixed", "full")[0]
    counted = lambda s, phase: sum(op.group == context.CP_GROUP and op.phase == phase for op in s.ops)  # noqa: E731
    assert counted(full, "backward") == counted(ops, "backward") + counted(ops, "forward")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: context.check_context(30, 2), "sequence length 30 does not split head-tail over 2"),
        (lambda: context.check_context(32, 0), "context parallel size must be a positive"),
        (lambda: context.cp_positions(32, 2, 2), "context-parallel rank 2 of 2"),
        (lambda: context.ring_attention(None, "ring").__enter__(), "rotate method 'ring'"),
        (lambda: context.context_rank(TOY, 32, 2, 1, "32-true", "op"), "recompute 'op'"),
        (lambda: context.context_rank(TOY, 32, 2, 1, "32-true", sharding="zero"), "sharding 'zero'"),
        (lambda: context.predict_context(ToyLM(TOY), (torch.zeros(1, 32, dtype=torch.long),) * 2, cp=2, tp=0),
         "tensor-parallel size must be a positive"),
        (lambda: context.cp_module(ToyLM(dataclasses.replace(TOY, positions="learned")), 32, 2, 0),
         "context parallel needs rotary positions"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(call, message):
    with pytest.raises(UserError) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, (ConfigError, UserError))


def test_head_tail_positions_cover_the_sequence_once():
    """cp_positions is torch's head-tail split: rank r holds chunks r and 2 cp - 1 - r of 2 cp."""
    assert context.cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([context.cp_positions(24, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(24))
