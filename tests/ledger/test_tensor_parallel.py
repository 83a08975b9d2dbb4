"""Tensor parallelism beside FSDP2 (issue 30): LitLM's TP plan trains as one process does, and one rank's
step is predicted from one process on a fake (data_parallel x tensor_parallel) mesh, held to real gloo
ranks. The real-rank tests are few and tiny (2 and 4 processes); they run in CI on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.sharding.sharded import FSDPSettings, measure_sharded, predict_sharded
from lmledger.model import ModelConfig, ToyLM

HERE = Path(__file__).resolve()
STATE = ("params", "grads", "optimizer")
ACTIVATIONS_TOLERANCE = 0.01  # issue 30: state exact, activations 1%, peak 3%
PEAK_TOLERANCE = 0.03
LINES = ("params", "grads", "optimizer", "activations", "peak", "flops_forward", "flops_backward", "comm_buffers")

# Heads and the MLP divide by 2; vocabulary 64 divides too (sequence parallel splits the embedding by rows).
CFG = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
# GPT's options: a learned position table (sequence parallel adds each rank's shard of its rows), GeLU, LayerNorm
GPT = ModelConfig(**{**CFG.__dict__, "positions": "learned", "mlp": "gelu", "norm": "layer", "bias": True})
CONFIGS = {"llama": CFG, "gpt": GPT}
STEPS = 4
TP2 = ["--trainer.strategy", "lmledger.strategies.FSDP2Strategy", "--trainer.strategy.tensor_parallel_size", "2"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.context_length), generator=g)
    return x, torch.roll(x, -1, 1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _losses(model: torch.nn.Module) -> list[float]:
    optimizer = _adamw(model.parameters())
    x, y = _batch()
    out = []
    for _ in range(STEPS):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


# (tensor parallel, sequence parallel, checkpointing, accumulate, precision, model): the matrix each rank measures.
# Sequence parallel "regather": toy_tp_plan's regather, Megatron-LM's gathers fused with the column linears.
CASES = {
    2: [(2, False, False, 1, "32-true", "llama"), (2, True, True, 2, "bf16-mixed", "llama"),
        (2, True, False, 1, "32-true", "gpt"), (2, "regather", True, 2, "bf16-mixed", "llama"),
        (2, "regather", False, 1, "32-true", "gpt")],
    4: [(2, False, True, 2, "bf16-mixed", "llama")],
}  # fmt: skip
# Context parallel 2 beside TP 2 on the 4 ranks (ledger.sharding.context): (FSDP2 over the cp ranks or replicated,
# the ring's rotate method, precision, checkpointing, sequence parallel)
CONTEXT = [(True, "allgather", "32-true", False, False), (False, "alltoall", "bf16-mixed", True, True)]


def _settings(tp: int, sp: bool | str) -> FSDPSettings:
    """A case's FSDP2 x TP settings: the ToyLM plan, with sequence parallel, or with it regathered."""
    if sp == "regather":
        from lmledger.ledger.sharding.tp import toy_tp_plan

        return FSDPSettings(tensor_parallel=tp, tp_plan=lambda m, mesh: toy_tp_plan(m, mesh, True, regather=True))
    return FSDPSettings(tensor_parallel=tp, sequence_parallel=sp)


def _figures(ledger) -> dict:
    return {line: getattr(ledger, line) for line in LINES}


def _rank(world: int) -> dict:
    """One real rank: LitLM's plan trained (with and without sequence parallel), then the measured matrix."""
    from torch.distributed.device_mesh import init_device_mesh

    from lmledger.ledger.sharding.fsdp2 import TP_DIMS, shard_blocks
    from lmledger.ledger.sharding.sharded import _with_checkpointed_blocks
    from lmledger.ledger.sharding.tp import toy_tp_plan

    losses = {}
    runs = (("llama", False, False), ("llama", True, False), ("gpt", True, False), ("llama", True, True),
            ("gpt", True, True))  # fmt: skip
    # the plans' variants on 2 ranks; over the (data, tensor) mesh of 4, the plan with and without sequence parallel
    for name, sequence_parallel, regather in runs if world == 2 else runs[:2]:
        torch.manual_seed(0)
        model = ToyLM(CONFIGS[name])
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=TP_DIMS)
        toy_tp_plan(model, mesh["tensor_parallel"], sequence_parallel, regather=regather)
        shard_blocks(model, mesh["data_parallel"], FSDPSettings())
        losses[f"{name} sp={sequence_parallel}{' regather' if regather else ''}"] = _losses(model)
    norm = _norm_collectives(model)
    measured = []
    for tp, sp, ac, accumulate, precision, name in CASES[world]:
        torch.manual_seed(0)
        kwargs = dict(optimizer=_adamw, precision=precision, strategy="fsdp2", accumulate=accumulate,
                      fsdp=_settings(tp, sp))  # fmt: skip
        module = ToyLM(CONFIGS[name])
        ledger = (
            _with_checkpointed_blocks(lambda m, b, **k: measure_sharded(m, b, **k), module, _batch(), **kwargs)
            if ac
            else measure_sharded(module, _batch(), **kwargs)
        )
        measured.append(_figures(ledger))
    return {"losses": losses, "measured": measured, "context": _context_rank() if world == 4 else [], "norm": norm}


def _norm_collectives(model: torch.nn.Module) -> tuple[int, int]:
    """(all-reduces a gradient norm over the model's DTensor grads ran, what tp.norm_collectives declares): the
    step-time prediction prices the declared ones (LitLM.collectives_per_step)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from lmledger.ledger.sharding.tp import norm_collectives, norm_over_meshes

    model(*_batch()).backward()
    with CommDebugMode() as comm:
        norm_over_meshes([p.grad for p in model.parameters()])
    return comm.get_total_counts(), norm_collectives(list(model.parameters()))


def _context_rank() -> list:
    """This real rank's CONTEXT steps on a (cp 2, tp 2) mesh: (its ledger, the two steps' losses over the ranks)."""
    from lmledger.ledger.sharding.context import measure_context

    out = []
    for fsdp, rotate, precision, ac, sp in CONTEXT:
        torch.manual_seed(0)
        out.append(measure_context(ToyLM(CFG), _batch(), rotate=rotate, optimizer=_adamw, precision=precision,
                                   fsdp=fsdp, tp=2, sequence_parallel=sp, activation_checkpointing=ac))  # fmt: skip
    return out


_LAUNCHED: dict[int, list] = {}


def _launched(world: int, gloo_ranks) -> list:
    """Each real rank's _rank(world): one launch a world size, which the tests of that size share."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = gloo_ranks(_rank, world, world)
    return _LAUNCHED[world]


def _predicted(world: int, case: tuple) -> dict:
    tp, sp, ac, accumulate, precision, name = case
    with torch.device("meta"):
        model = ToyLM(CONFIGS[name])
    ledger = predict_sharded(
        model, _batch(), optimizer=_adamw, precision=precision, strategy="fsdp2", world_size=world,
        fsdp=_settings(tp, sp), activation_checkpointing=ac or None,
        accumulate=accumulate,
    )  # fmt: skip
    assert ledger.tensor_parallel == tp and ledger.world_size == world
    return _figures(ledger)


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "dp2xtp2"])
def test_tp_trains_as_one_process_and_is_predicted_per_rank(world, gloo_ranks):
    reference = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        reference[name] = _losses(ToyLM(cfg))
    ranks = _launched(world, gloo_ranks)
    predictions = [_predicted(world, case) for case in CASES[world]]  # one rank's step, which every rank runs
    for rank in ranks:
        ran, declared = rank["norm"]
        assert ran == declared > 0
        for run, losses in rank["losses"].items():
            assert losses == pytest.approx(reference[run.split()[0]], rel=1e-5), (run, losses, reference)
        for case, predicted, measured in zip(CASES[world], predictions, rank["measured"], strict=True):
            for line in (*STATE, "flops_forward", "flops_backward", "comm_buffers"):
                assert predicted[line] == measured[line] > 0 or line == "comm_buffers", (case, line)
            assert abs(measured["activations"] / predicted["activations"] - 1) <= ACTIVATIONS_TOLERANCE, case
            assert abs(measured["peak"] / predicted["peak"] - 1) <= PEAK_TOLERANCE, (case, predicted, measured)


def test_context_parallel_beside_tp_is_predicted_per_rank(gloo_ranks):
    """CP 2 x TP 2 on 4 real ranks (torchtitan's mesh, TP innermost): the ring passes each rank's own heads, and the
    whole batch's loss is one process's; each rank's state, saved activations, FLOPs and FSDP2's buffers equal
    the prediction of its CP rank on fakes, its peak and each phase's within 3 %."""
    from lmledger.ledger.sharding.context import predict_context

    ranks = _launched(4, gloo_ranks)
    with torch.device("meta"):
        model = ToyLM(CFG)
    torch.manual_seed(0)
    expected = _losses(ToyLM(CFG))[:2]  # one process in fp32: bf16-mixed's within 2e-3 of it
    for index, (fsdp, rotate, precision, ac, sp) in enumerate(CONTEXT):
        predictions = [  # one per CP rank: a TP group's ranks run the same step
            predict_context(model, _batch(), cp=2, rank=cp_rank, tp=2, rotate=rotate, optimizer=_adamw,
                            precision=precision, fsdp=fsdp, sequence_parallel=sp, activation_checkpointing=ac)
            for cp_rank in range(2)
        ]  # fmt: skip
        for rank, result in enumerate(ranks):
            real, losses = result["context"][index]
            case = (fsdp, rotate, precision, ac, sp, rank)
            predicted = predictions[rank // 2]
            assert not isinstance(predicted, NotTraced), (case, predicted)
            assert (predicted.world_size, predicted.tensor_parallel) == (real.world_size, 2) == (4, 2), case
            for line in (*STATE, "activations", "flops_forward", "flops_backward", "comm_buffers"):
                assert getattr(predicted, line) == getattr(real, line), (case, line)
            assert abs(predicted.peak / real.peak - 1) <= PEAK_TOLERANCE, case
            for phase, peak in real.phase_peaks.items():
                assert abs(predicted.phase_peaks[phase] / peak - 1) <= PEAK_TOLERANCE, (case, phase)
            assert losses == pytest.approx(expected, rel=1e-5 if precision == "32-true" else 2e-3), case


def test_tp_divides_the_state_and_the_block_flops():
    """Per rank at TP 2 over 4 ranks: every TP weight is half, FSDP halves the rest, the blocks' matmul FLOPs halve."""
    from lmledger.ledger.dryrun.engine import dry_run

    with torch.device("meta"):
        model = ToyLM(CFG)
    one = dry_run(model, _batch(), optimizer=_adamw)
    fsdp = predict_sharded(model, _batch(), optimizer=_adamw, strategy="fsdp2", world_size=2)
    both = predict_sharded(model, _batch(), optimizer=_adamw, strategy="fsdp2", world_size=4,
                           fsdp=FSDPSettings(tensor_parallel=2))  # fmt: skip
    assert fsdp.params == one.params // 2
    assert both.params < fsdp.params  # the blocks' matmuls are split twice
    head = 2 * 2 * CFG.context_length * CFG.d_model * CFG.vocab_size  # the LM head's forward, replicated
    assert both.flops_forward - head == pytest.approx((one.flops_forward - head) / 2, rel=0.02)
    # The op records (what the time ledger and the GPU op model price) are the rank's own: an op on DTensors is
    # recorded at its local shards, so its FLOPs sum to the rank's and qkv's output columns are halved.
    for ledger in (fsdp, both):
        assert ledger.ops.flops_in("forward") == ledger.flops_forward
        assert ledger.ops.flops_in("forward", "backward") == ledger.flops_forward + ledger.flops_backward
    qkv = [op.shapes[-1] for op in both.ops.ops if op.category == "matmul" and op.phase == "forward"][0]
    assert qkv == (CFG.d_model, 3 * CFG.d_model // 2)
    optimizer = [op for op in fsdp.ops.ops if op.category == "optimizer" and op.bytes]
    assert sum(op.bytes_written for op in optimizer) < sum(
        op.bytes_written for op in one.ops.ops if op.category == "optimizer"
    )  # AdamW steps the rank's shards, not the whole model


@pytest.mark.parametrize("name, precision, casts", [("llama", "32-true", 0), ("gpt", "bf16-true", 0),
                                                     ("llama", "bf16-mixed", 1)])  # fmt: skip
def test_regather_saves_the_sequence_shard_and_gathers_it_again_in_backward(name, precision, casts):
    """toy_tp_plan's regather (Megatron-LM's sequence-parallel column linears) against torch's styles, one rank of TP
    t = 2 on fake ranks: the same state and FLOPs, the same forward collectives, one more all-gather in backward a
    gather site (attn's and the MLP's: 2 a layer), and fewer saved bytes by exactly the gathered inputs less the
    shards now saved: torch's styles save the (b, s, d) input of qkv and of w1 (w3 shares it) whole, the regather
    the rank's (b, s / t, d) shard, n_layers x 2 x b s d x bytes x (1 - 1 / t). Under bf16-mixed SwiGLU (`casts`),
    autocast casts the gathered input for w1 and for w3 apart (the dry run, as Lightning, keeps no cast cache), so
    torch's styles save the MLP's bf16 input twice: one b s d x bytes a layer more; the regather casts the shard
    once, before it is gathered."""
    from collections import Counter

    from lmledger.ledger.hardware.interconnect import collective_kind

    cfg, t = CONFIGS[name], 2
    ledgers = {sp: _predicted_ledger(cfg, precision, sp, t) for sp in (True, "regather")}
    torch_styles, regathered = ledgers[True], ledgers["regather"]
    for line in (*STATE, "flops_forward", "flops_backward"):
        assert getattr(regathered, line) == getattr(torch_styles, line) > 0, line
    width = 4 if precision == "32-true" else 2
    b, s, d = 2, CFG.context_length, cfg.d_model
    saved = cfg.n_layers * (2 * b * s * d * width * (t - 1) // t + casts * b * s * d * width)
    assert torch_styles.activations - regathered.activations == saved

    def collectives(ledger, phase):
        return Counter(collective_kind(op.name) for op in ledger.ops.ops if op.category == "communication"
                       and op.phase == phase and collective_kind(op.name))  # fmt: skip

    assert collectives(regathered, "forward") == collectives(torch_styles, "forward")
    more = collectives(regathered, "backward") - collectives(torch_styles, "backward")
    assert more == {"all_gather": 2 * cfg.n_layers}, more
    assert collectives(torch_styles, "backward") - collectives(regathered, "backward") == Counter()
    with pytest.raises(UserError, match="regather fuses sequence parallel's all-gathers"):
        from lmledger.ledger.sharding.tp import toy_tp_plan

        toy_tp_plan(ToyLM(cfg), None, sequence_parallel=False, regather=True)


def _predicted_ledger(cfg: ModelConfig, precision: str, sp: bool | str, tp: int):
    with torch.device("meta"):
        model = ToyLM(cfg)
    return predict_sharded(model, _batch(), optimizer=_adamw, precision=precision, strategy="fsdp2", world_size=tp,
                           fsdp=_settings(tp, sp))  # fmt: skip


# The architecture options (model.ModelConfig) under TP, with sequence parallel where the plan takes it: (options,
# TP size, sequence parallel). Heads 4, KV heads 2, d_ff 64 and vocabulary 64 divide by the TP sizes.
TP_ARCHS = [
    ({"mlp": "gelu", "norm": "layer", "positions": "learned", "bias": True}, 2, False),  # GPT: positions replicated
    ({"mlp": "gelu", "norm": "layer", "positions": "learned", "bias": True}, 2, True),  # the table whole under SP too
    ({"n_kv_heads": 2}, 2, True),  # Llama's GQA
    ({"n_kv_heads": 2, "mlp": "gelu", "norm": "layer", "bias": True}, 2, True),
    ({"mlp": "gelu", "norm": "layer"}, 4, True),  # MPT
]


TP_IDS = ["gpt-tp2", "gpt-tp2-sp", "gqa-tp2-sp", "gqa-gelu-bias-tp2-sp", "mpt-tp4-sp"]


@pytest.mark.parametrize("arch, tp, sp", TP_ARCHS, ids=TP_IDS)
def test_tp_traces_the_architecture_options_and_splits_what_the_plan_splits(arch, tp, sp):
    """One rank of a TP-only mesh on the fake process group: every block Linear's weight and a colwise bias split
    by TP, a rowwise bias, the norms and a position table whole, the embedding and LM head split under sequence
    parallel only; the forward's block FLOPs split by TP, the LM head's too under sequence parallel."""
    from lmledger.ledger.closedform.flops import analytic_flops
    from lmledger.model import block_linears, count_parameters

    cfg = ModelConfig(**{**CFG.__dict__, **arch})
    with torch.device("meta"):
        model = ToyLM(cfg)
    ledger = predict_sharded(model, _batch(), optimizer=_adamw, strategy="fsdp2", world_size=tp,
                             fsdp=FSDPSettings(tensor_parallel=tp, sequence_parallel=sp))  # fmt: skip
    assert ledger.tensor_parallel == tp and ledger.world_size == tp, ledger
    linears = block_linears(cfg)
    weights = sum(i * o for i, o in linears.values())
    colwise_bias = sum(o for name, (i, o) in linears.items() if name not in ("attn.out", "mlp.w2")) if cfg.bias else 0
    rowwise_bias = 2 * cfg.d_model if cfg.bias else 0
    tables = 2 * cfg.vocab_size * cfg.d_model
    rest = count_parameters(cfg) - cfg.n_layers * (weights + colwise_bias + rowwise_bias) - (tables if sp else 0)
    per_rank = cfg.n_layers * ((weights + colwise_bias) // tp + rowwise_bias) + rest + (tables // tp if sp else 0)
    assert ledger.params == 4 * per_rank
    forward = {
        name: phases["forward"] for name, phases in analytic_flops(cfg, 2, CFG.context_length).by_component.items()
    }
    head = forward.pop("lm_head")
    assert ledger.flops_forward == sum(forward.values()) // tp + (head // tp if sp else head)


@pytest.mark.parametrize("n_kv_heads, tp", [(2, 2), (4, 2), (4, 4)])
def test_a_column_split_of_qkv_gives_each_rank_whole_kv_groups(n_kv_heads, tp):
    """What ColwiseParallel(qkv) and RowwiseParallel(out) compute, by hand in one process: each rank's attention on
    its contiguous chunk of qkv's output columns (bias included), with n_heads / tp query heads over n_kv_heads / tp
    KV groups, then its slice of out's input columns; summed over ranks it is the whole attention."""
    import copy

    cfg = ModelConfig(**{**CFG.__dict__, "n_kv_heads": n_kv_heads, "bias": True})
    torch.manual_seed(0)
    attn = ToyLM(cfg).blocks[0].attn
    x = torch.randn(2, CFG.context_length, CFG.d_model)
    rows, cols = attn.qkv.out_features // tp, CFG.d_model // tp
    total = attn.out.bias.detach().clone()
    for rank in range(tp):
        local = copy.deepcopy(attn)
        local.n_heads, local.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        local.qkv.weight.data = attn.qkv.weight[rank * rows : (rank + 1) * rows].detach().clone()
        local.qkv.bias.data = attn.qkv.bias[rank * rows : (rank + 1) * rows].detach().clone()
        local.out.weight.data = attn.out.weight[:, rank * cols : (rank + 1) * cols].detach().clone()
        local.out.bias.data.zero_()  # a rowwise bias is added once, after the sum
        total = total + local(x)
    torch.testing.assert_close(total, attn(x), rtol=1e-5, atol=1e-5)


def test_megatron_closed_forms_follow_korthikanti_table_2():
    """Our code of Megatron-LM's formulas: per layer 34 s b h / t with sequence parallel, s b h (10 + 24 / t)
    without (equal at t = 1), plus 5 a s^2 b / t without selective recompute; 18 bytes a parameter."""
    from lmledger.ledger.sharding.tp import megatron_memory

    shape = dict(layers=1, hidden=4096, heads=32, ffn=4 * 4096, vocab=51200, seq=2048, micro_batch=1)
    rest = lambda t: (8 * 2048 + 2048 * 4096 + 4 * 2048 * 4096 * (1 + 51200 / 4096)) / t  # noqa: E731
    sbh = 2048 * 4096
    for t in (1, 8):
        sp = megatron_memory(**shape, tp=t, sequence_parallel=True)["activations"] - rest(t)
        tp = megatron_memory(**shape, tp=t, sequence_parallel=False)["activations"] - rest(t)
        assert sp == pytest.approx(34 * sbh / t) and tp == pytest.approx(sbh * (10 + 24 / t))
    full = megatron_memory(**shape, tp=8, sequence_parallel=True, selective_recompute=False)["activations"]
    assert full - rest(8) == pytest.approx(34 * sbh / 8 + 5 * 32 * 2048 * 2048 / 8)
    weights = megatron_memory(**shape, tp=1, sequence_parallel=True)["weights_and_optimizer"]
    params = 12 * 4096**2 + 4 * 4096 + 2 * 4096 + 2 * 4096 * 51200  # Megatron's count: a layer, final norm, embeddings
    assert weights == pytest.approx(18 * params)


# --------------------------------------------------------------------------------------------
# Bad input, one line each
# --------------------------------------------------------------------------------------------


def test_heads_or_hidden_not_dividing_by_tp_are_one_line():
    from lmledger.ledger.sharding.tp import check_tensor_parallel

    with pytest.raises(ConfigError, match="n_heads 4 does not divide by tensor_parallel_size 3"):
        check_tensor_parallel(4, 64, 3)
    with pytest.raises(ConfigError, match="hidden size 65 does not divide"):
        check_tensor_parallel(4, 65, 2)
    with pytest.raises(ConfigError, match="n_kv_heads 2 does not divide by tensor_parallel_size 4: each TP rank keeps"):
        check_tensor_parallel(4, 64, 4, n_kv_heads=2)
    check_tensor_parallel(8, 64, 4, n_kv_heads=4)  # whole KV groups on each rank


def test_tp_refuses_kv_heads_it_cannot_split_and_sequence_parallel_tied_embeddings_in_one_line():
    for arch, sp, message in [
        ({"n_kv_heads": 1}, False, "n_kv_heads 1 does not divide by tensor_parallel_size 2"),
        ({"tie_embeddings": True}, True, "sequence parallel splits the embedding and the LM head apart"),
    ]:
        with torch.device("meta"):
            model = ToyLM(ModelConfig(**{**CFG.__dict__, **arch}))
        with pytest.raises(ConfigError, match=message) as err:
            predict_sharded(model, _batch(), strategy="fsdp2", world_size=2,
                            fsdp=FSDPSettings(tensor_parallel=2, sequence_parallel=sp))  # fmt: skip
        assert "\n" not in str(err.value)


def test_a_plan_naming_a_missing_module_is_one_line():
    from lmledger.ledger.sharding.tp import check_plan

    model = ToyLM(CFG).blocks[0]
    with pytest.raises(ConfigError, match="names 'attn.wq', which Block has no module of") as err:
        check_plan(model, {"attn.qkv": None, "attn.wq": None})
    assert "\n" not in str(err.value)
    check_plan(model, {"attn.*": None, "mlp.w1": None})  # globs, as parallelize_module takes them


def test_tp_not_dividing_the_ranks_is_one_line():
    with torch.device("meta"):
        model = ToyLM(CFG)
    with pytest.raises(UserError, match="tensor_parallel_size 3 does not divide the 4 ranks"):
        predict_sharded(model, _batch(), strategy="fsdp2", world_size=4, fsdp=FSDPSettings(tensor_parallel=3))


def _trainer(devices: int, strategy) -> dict:
    return {"accelerator": "cpu", "devices": devices, "num_nodes": 1, "strategy": strategy}


def _fsdp2(**init_args):
    from types import SimpleNamespace

    return SimpleNamespace(class_path="lmledger.strategies.FSDP2Strategy", init_args=init_args)


def test_the_strategy_takes_tp_and_refuses_what_it_cannot_run_in_one_line():
    from lmledger.run_config import resolve_strategy

    scale = resolve_strategy(_trainer(8, _fsdp2(tensor_parallel_size=4)))
    assert (scale.strategy, scale.world_size, scale.tensor_parallel) == ("fsdp2", 8, 4)
    assert resolve_strategy(_trainer(8, _fsdp2())).tensor_parallel == 1  # fsdp2's default: every rank data-parallel
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide --trainer.devices 8") as err:
        resolve_strategy(_trainer(8, _fsdp2(tensor_parallel_size=3)))
    with pytest.raises(ConfigError, match="pipeline parallelism is not supported") as pipe:
        resolve_strategy(_trainer(8, "pipeline_parallel"))
    assert "\n" not in str(err.value) + str(pipe.value)


def test_account_takes_the_2d_shape(workdir, capsys):
    """`lmledger account` with tensor_parallel_size: one rank of a (2 x 2) mesh, state below FSDP2 over 2 ranks."""
    from conftest import run_json

    def account(*strategy: str) -> dict:
        config = ["--config", "configs/tiny.yaml", "--trainer.devices", "4" if len(strategy) > 2 else "2"]
        return run_json(capsys, "account", *config, *strategy, "--json")

    doc = account(*TP2)
    both, fsdp = doc["per_rank"], account("--trainer.strategy", "fsdp2")["per_rank"]
    # A sweep's listing accounts the Run without the fit's arguments: the Run's TP size shapes the same mesh.
    from lmledger.accounting import account as account_run
    from lmledger.run_config import load_run

    listed = account_run(load_run(["--config", "configs/tiny.yaml", "--trainer.devices", "4", *TP2]), False)
    assert listed["per_rank"].tensor_parallel == 2
    assert listed["memory"]["params"]["predicted"] == doc["memory"]["params"]["predicted"]
    # Issue 49 §2: the closed forms (no TP in them) showed the whole model over 4 ranks; now absent, and said why.
    for line in ("params", "activations", "peak"):
        assert doc["memory"][line]["closed_form"] is None and doc["memory"][line]["predicted"] > 0, line
        assert "do not model tensor parallelism" in doc["why_missing"]["closed_form"][line]
    assert (both["tensor_parallel"], both["world_size"], fsdp["tensor_parallel"]) == (2, 4, 1)
    for label, case in both["cases"].items():
        assert case["not_predicted"] is None, label
        assert 0 < case["params"] < fsdp["cases"][label]["params"]  # the blocks split by TP, then by FSDP


# --------------------------------------------------------------------------------------------
# A live fit: LitLM through `lmledger fit`, TP 2 on 2 gloo ranks, predicted beside measured per rank
# --------------------------------------------------------------------------------------------


def test_litlm_tp_fit_is_predicted_per_rank(workdir):
    from test_ledger_fsdp2 import _check_predicted_equals_measured, _env, _ranks

    from conftest import TINY_OVERRIDES

    out = workdir / "dump"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "lmledger.cli", "fit", "--config", "configs/tiny.yaml", *TINY_OVERRIDES, *TP2,
        "--trainer.devices", "2", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
        "--ledger.warmup_steps", "1", "--trainer.callbacks+=test_ledger_fsdp2.DumpLedger",
    ]  # fmt: skip
    env = _env(out)
    del env["OMP_NUM_THREADS"]  # as a user's shell has it: each rank's threads are the strategy's to set
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(out)
    _check_predicted_equals_measured(ranks)
    for rank in ranks:
        assert abs(rank["measured"]["activations"] / rank["predicted"]["activations"] - 1) <= ACTIVATIONS_TOLERANCE
        # Issue 49 §2: the fit's closed-form column, which models no TP, holds no figure (it held FSDP2's over 2)
        assert set(rank["closed_form"].values()) == {None}, rank["closed_form"]
        # Issue 50: every rank runs cores / ranks threads, as DDP's do (Lightning left rank 1 at every core's)
        assert rank["threads"] == max(1, len(os.sched_getaffinity(0)) // 2), rank
    print(json.dumps(ranks))


# --------------------------------------------------------------------------------------------
# A user's module in Lightning's TP-tutorial form (examples/tensor_parallel.py), under Ledger()
# --------------------------------------------------------------------------------------------


def _tutorial_fit() -> None:
    """One rank of a 2-rank TP 2 fit of the tutorial's FeedForwardTP, with the Ledger (run as a script)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from test_ledger_fsdp2 import DumpLedger

    from examples.tensor_parallel import FeedForwardTP
    from lmledger.callbacks import Ledger

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        callbacks=[Ledger(warmup_steps=1), DumpLedger()],
    )  # fmt: skip
    trainer.fit(FeedForwardTP(), torch.utils.data.DataLoader(data, batch_size=8))


def test_a_tp_tutorial_module_is_predicted_per_rank(tmp_path):
    from test_ledger_fsdp2 import _check_predicted_equals_measured, _env, _ranks

    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join((str(HERE.parents[2]), env["PYTHONPATH"]))  # examples/
    proc = subprocess.run(
        [sys.executable, str(HERE), "tutorial"], capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(tmp_path)
    _check_predicted_equals_measured(ranks)
    whole = 4 * 3 * 32 * 64  # w1, w2, w3 in fp32: each rank holds half of each
    for rank in ranks:
        assert rank["measured"]["params"] == whole // 2
        assert abs(rank["measured"]["activations"] / rank["predicted"]["activations"] - 1) <= ACTIVATIONS_TOLERANCE


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    _tutorial_fit()


def test_dtensors_dispatch_is_probed_in_a_process_of_its_own_and_cached(tmp_path):
    """steptime/dtensor.py: torch's TP plan on fake ranks beside plain tensors, per DTensor op; a forward or backward
    op pays sharding propagation and the plan's hooks, an optimizer op only the dispatch (60 and 13 us on the 2-core
    VM, 2026-12-04). Bounds an order of magnitude wide: a busy machine slows both."""
    from lmledger.ledger.timing.steptime.cache import StepTimeCache
    from lmledger.ledger.timing.steptime.dtensor import dtensor_overhead

    cache = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json")
    value, how = dtensor_overhead(cache)
    assert how == "measured now"
    assert 1e-6 < value["optimizer_s"] < value["step_s"] < 1e-3, value
    assert dtensor_overhead(StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json"))[1].endswith("(cache)")
