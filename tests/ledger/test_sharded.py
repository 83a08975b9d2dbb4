"""FSDP2 per rank at world size W, predicted in one process (ledger.sharding.sharded), held to real gloo ranks on CPU:
the toy LM and a tiny Hugging Face Llama, with and without activation checkpointing, reshard after forward
on and off. Models are tiny and each real run is two steps."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lmledger.hf import causal_lm_loss, checkpoint_layers
from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.sharding import fsdp2
from lmledger.ledger.sharding.realranks import measure_sharded
from lmledger.ledger.sharding.sharded import FSDPSettings, fsdp2_shard_bytes, predict_sharded
from lmledger.model import ModelConfig, ToyLM

TOY = ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=2, d_ff=128)
# (model, activation checkpointing, reshard_after_forward[, precision])
CASES = [("toy", 0, True), ("toy", 1, True), ("toy", 0, False), ("llama", 0, True), ("llama", 1, True)]
BF16 = [("toy", 0, True, "bf16-mixed"), ("llama", 1, True, "bf16-mixed")]
FOUR = [CASES[0], CASES[3]]  # at 4 ranks


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _model(kind: str, ac: int):
    torch.manual_seed(0)
    if kind == "toy":
        return ToyLM(dataclasses.replace(TOY, activation_checkpointing=ac)), None
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, max_position_embeddings=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if ac:
        checkpoint_layers(model)
    return model, causal_lm_loss


def _measure(cases) -> list:
    out = []
    for kind, ac, reshard, *precision in cases:
        model, step = _model(kind, ac)
        settings = FSDPSettings(reshard_after_forward=reshard)
        out.append(
            measure_sharded(model, _batch(), step=step, optimizer=_adamw, strategy="fsdp2", fsdp=settings,
                            precision=precision[0] if precision else "32-true")
        )  # fmt: skip
    return out


def _predict(case, world_size: int):
    kind, ac, reshard, *precision = case
    model, step = _model(kind, ac)
    settings = FSDPSettings(reshard_after_forward=reshard)
    return predict_sharded(
        model, _batch(), step=step, optimizer=_adamw, strategy="fsdp2", world_size=world_size, fsdp=settings,
        precision=precision[0] if precision else "32-true",
    )  # fmt: skip


# The same case at the same world size predicts the same ledger: the tests after the first that needs one read it
# from here (test_a_real_default_group_is_set_aside_and_restored predicts its own: the real group is its subject).
_predicted = functools.cache(_predict)


def _check(cases, world_size: int, ranks: list) -> None:
    """`ranks`: each real rank's _measure(cases) at `world_size`."""
    assert not dist.is_initialized()
    for i, case in enumerate(cases):
        predicted = _predicted(case, world_size)
        assert not isinstance(predicted, NotTraced), predicted
        assert not dist.is_initialized()  # the fake process group is gone
        for rank in ranks:
            measured = rank[i]
            state = (measured.params, measured.grads, measured.optimizer)
            assert (predicted.params, predicted.grads, predicted.optimizer) == state, case
            assert predicted.comm_buffers == measured.comm_buffers > 0, case
            assert abs(predicted.peak / measured.peak - 1) <= 0.03, (case, predicted.peak, measured.peak)


def test_fsdp2_two_ranks_match_real_gloo_ranks(gloo_ranks):
    _check(CASES + BF16, 2, gloo_ranks(_measure, 2, CASES + BF16))


def _measure_four() -> dict:
    """One rank of the module's one 4-rank launch: FSDP2's FOUR cases, then hybrid sharding (2 replicas of 2)."""
    return {"fsdp2": _measure(FOUR), "hsdp": _measure_hsdp(2)}


@pytest.fixture(scope="module")
def four_ranks(gloo_ranks) -> list[dict]:
    """Both 4-rank tests' real ranks, from one launch."""
    return gloo_ranks(_measure_four, 4)


def test_fsdp2_four_ranks_match_real_gloo_ranks(four_ranks):
    _check(FOUR, 4, [rank["fsdp2"] for rank in four_ranks])


def test_sharding_divides_the_state_and_follows_the_settings():
    whole = predict_sharded(*_model("toy", 0)[:1], _batch(), optimizer=_adamw, strategy="ddp", world_size=1)
    two, three = (_predicted(CASES[0], w) for w in (2, 3))
    shapes = [(tuple(p.shape), 4) for p in ToyLM(TOY).parameters()]
    for w, ledger in ((2, two), (3, three)):
        # FSDP2 chunks each tensor on dim 0 (ceil rows, padded): the closed form is exact per rank.
        assert ledger.params == ledger.grads == fsdp2_shard_bytes(shapes, w)
        assert ledger.optimizer == 2 * ledger.params
    assert three.params > whole.params / 3  # padding: 2 rows of 3 do not divide
    assert two.peak < whole.peak
    kept = _predicted(CASES[2], 2)  # reshard_after_forward=False keeps the gathered blocks to backward
    checkpointed = _predicted(CASES[1], 2)
    assert kept.phase_peaks["forward"] > two.phase_peaks["forward"]
    assert checkpointed.peak < two.peak


def test_a_real_default_group_is_set_aside_and_restored(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        predicted = _predict(CASES[0], 4)
        assert not isinstance(predicted, NotTraced), predicted
        assert dist.group.WORLD is group and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_collective_returns_once_the_backends_thread_has_let_go_of_its_tensors(monkeypatch, tmp_path):
    """gloo wakes the caller before its worker drops the tensors: a buffer the program frees next would die later,
    in that thread (a real rank's peak one reduce-scatter buffer high under load). Here a stand-in collective
    whose thread lets go 50 ms after the caller wakes, on a gloo group and on none (NCCL's case: untouched)."""
    import threading
    import time

    from lmledger.ledger.sharding.rankstate import _holders, collectives_let_go

    def late(tensor, *args, **kwargs):
        held = [tensor.detach()]  # the worker's tensor, on the caller's storage
        threading.Thread(target=lambda: (time.sleep(0.05), held.clear())).start()

    monkeypatch.setattr(dist, "all_reduce", late)
    buffer = torch.ones(4)
    before = _holders(buffer)
    with collectives_let_go():
        dist.all_reduce(buffer)  # no gloo group: returned at once
        assert _holders(buffer) > before
    time.sleep(0.2)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist.all_reduce(buffer)
        assert _holders(buffer) > before  # unwrapped: still held when the call returns
        time.sleep(0.2)
        with collectives_let_go():
            dist.all_reduce(buffer)
            assert _holders(buffer) == before
            dist.all_reduce(buffer, async_op=True)  # an async call's tensors stay with its Work until wait()
            assert _holders(buffer) > before
        time.sleep(0.2)
        assert dist.all_reduce is late  # restored
    finally:
        dist.destroy_process_group()


def test_a_functional_collective_returns_once_the_backends_thread_has_let_go(monkeypatch, tmp_path):
    """Tensor parallelism's collectives are DTensor's functional ones, whose Work holds the output (and the inputs)
    in torch's registry until the wait, then in gloo's thread a moment longer. A stand-in wait whose thread keeps
    as many references 50 ms more: under collectives_let_go the collective returns once they are gone."""
    import threading
    import time

    import torch.distributed._functional_collectives as funcol

    from lmledger.ledger.sharding.rankstate import _holders, collectives_let_go

    real = funcol.wait_tensor

    def late(tensor):
        holding = _holders(tensor)  # the Work's references among them
        out = real(tensor)  # the registry lets go of the Work
        held = [tensor.detach() for _ in range(holding - _holders(tensor))]  # gloo's thread, holding as many
        threading.Thread(target=lambda: (time.sleep(0.05), held.clear())).start()
        return out

    monkeypatch.setattr(funcol, "wait_tensor", late)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        fresh = _holders(torch.ones(4))
        funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()  # gloo's first collective sets up for a second
        returned_held = []
        for let_go in (False, True):
            with collectives_let_go() if let_go else contextlib.nullcontext():
                reduced = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
                funcol.wait_tensor(reduced.elem)  # under collectives_let_go, already done as it was issued
                returned_held.append(_holders(reduced.elem) > fresh)
            time.sleep(0.2)
            assert reduced.tolist() == [1.0] * 4 and _holders(reduced.elem) == fresh
        assert returned_held == [True, False]
        with collectives_let_go():  # one Work for a list: the first wait cannot free it, so it is not waited so
            started = time.monotonic()
            pair = funcol.all_reduce_coalesced([torch.ones(2), torch.ones(3)], "sum", dist.group.WORLD)
            assert [t.tolist() for t in pair] == [[1.0] * 2, [1.0] * 3] and time.monotonic() - started < 1.0
        assert funcol.wait_tensor is late and funcol._maybe_wrap_tensor.__module__ == funcol.__name__  # restored
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["tensor_parallel", "pipeline"])
def test_strategies_not_modelled_are_one_line(strategy):
    result = predict_sharded(ToyLM(TOY), _batch(), strategy=strategy, world_size=2)
    assert isinstance(result, NotTraced) and "\n" not in result.reason and "measured only" in result.reason


def test_bad_world_size_and_missing_fake_group_are_one_line(monkeypatch):
    assert isinstance(predict_sharded(ToyLM(TOY), _batch(), strategy="fsdp2", world_size=0), NotTraced)

    def no_fake_group(*args):
        raise fsdp2._Unavailable("torch X has no fake process group")

    monkeypatch.setattr(fsdp2, "fake_process_group", _raising(no_fake_group))
    result = predict_sharded(ToyLM(TOY), _batch(), strategy="fsdp2", world_size=2)
    assert isinstance(result, NotTraced) and "no fake process group" in result.reason
    assert "measured only" in result.reason


def _raising(fn):
    from contextlib import contextmanager

    @contextmanager
    def manager(*args):
        fn(*args)
        yield

    return manager


def test_state_only_strategies_say_their_peak_is_unchecked():
    result = predict_sharded(ToyLM(TOY), _batch(), optimizer=_adamw, strategy="deepspeed_stage_3", world_size=4)
    assert not result.peak_checked
    assert result.params < predict_sharded(ToyLM(TOY), _batch(), optimizer=_adamw).params


# Canaries: what ledger.sharding.fsdp2's and ledger.sharding.rankstate's workarounds rely on in the installed torch.


def test_canary_dtensor_storage_is_the_global_size():
    with fsdp2.fake_process_group(2) as mesh:
        from torch.distributed.tensor import Shard, distribute_tensor

        t = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        assert t.untyped_storage().nbytes() == 8 * 4 * 4  # why local_state_bytes reads _local_tensor
        assert t._local_tensor.untyped_storage().nbytes() == 4 * 4 * 4


def test_canary_storage_resize_is_not_an_operator():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    t = torch.empty(16)
    with Record():
        t.untyped_storage().resize_(0)  # FSDP2's free_storage
    assert seen == []  # why rankstate.sharded_tracking patches UntypedStorage.resize_


def test_canary_fsdp2_frees_unsharded_params_with_storage_resize():
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    assert "resize_(0)" in _source(_fsdp_param.free_storage)
    assert os.path.basename(_fsdp_param.__file__) == "_fsdp_param.py"


def _source(fn) -> str:
    import inspect

    return inspect.getsource(fn)


def test_canary_fsdp2_reads_two_chunks():
    # ledger.sharding.fsdp2._RankChunks makes a chunk only when read: FSDP2 must read no chunk but its rank's and the
    # 0th.
    import re

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    reads = set(re.findall(r"\bchunks\[([^\]]+)\]", _source(_fsdp_param)))
    assert reads <= {"shard_rank", "0", "mesh_info.shard_mesh_rank"}, reads
    assert "for chunk in chunks" not in _source(_fsdp_param)


def test_rank_chunks_are_torchs_chunks():
    t = torch.arange(10 * 3).view(10, 3)
    for n in (1, 3, 4, 7, 16):
        lazy = fsdp2._RankChunks(t, n, 0)
        real = list(torch.chunk(t, n, 0))
        assert len(lazy) == n
        for i in range(n):
            expected = real[i] if i < len(real) else real[0].new_empty(0)
            assert torch.equal(lazy[i], expected) and lazy[i].shape == expected.shape


def _measure_hsdp(shard_size: int):
    model, _ = _model("toy", 0)
    settings = FSDPSettings(shard_size=shard_size)
    return measure_sharded(model, _batch(), optimizer=_adamw, strategy="fsdp2", fsdp=settings)


def test_hsdp_matches_real_ranks_and_a_mesh_that_does_not_divide_is_one_line(four_ranks):
    # Hybrid sharding over 4 ranks: 2 replicas of 2 shards; each rank holds what FSDP2 over 2 ranks holds.
    ranks = [rank["hsdp"] for rank in four_ranks]
    model, _ = _model("toy", 0)
    hsdp = predict_sharded(model, _batch(), optimizer=_adamw, strategy="fsdp2", world_size=4,
                           fsdp=FSDPSettings(shard_size=2))  # fmt: skip
    two = _predicted(CASES[0], 2)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (two.params, two.grads, two.optimizer)
    for measured in ranks:
        assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (measured.params, measured.grads, measured.optimizer)
        assert abs(hsdp.peak / measured.peak - 1) <= 0.03, (hsdp.peak, measured.peak)
    odd = predict_sharded(model, _batch(), strategy="fsdp2", world_size=6, fsdp=FSDPSettings(shard_size=4))
    assert isinstance(odd, NotTraced) and "does not divide" in odd.reason and "\n" not in odd.reason


def test_deepspeed_state_per_rank_is_deepspeeds_estimate_for_any_module():
    # A Hugging Face model, not the toy LM: the largest layer comes from the module tree, as DeepSpeed counts it.
    stage_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2", reason="deepspeed is an optional dependency")
    stage_3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    model, step = _model("llama", 0)
    n, layer = stage_3.model_to_params(model)
    for stage in (2, 3):
        ledger = predict_sharded(model, _batch(), step=step, optimizer=_adamw, precision="bf16-mixed",
                                 strategy=f"deepspeed_stage_{stage}", world_size=8)  # fmt: skip
        state = ledger.params + ledger.grads + ledger.optimizer
        if stage == 2:
            _, gpu = stage_2.estimate_zero2_model_states_mem_needs(n, 8, 1, cpu_offload=False)
        else:
            _, gpu, _ = stage_3.estimate_zero3_model_states_mem_needs(
                n, layer, 8, 1, cpu_offload=False, cpu_offload_params=False
            )
        assert 0 <= state - gpu < 18 and not ledger.peak_checked  # each rank's share rounded up, DeepSpeed's down
