"""Analytic FLOPs of the toy LM against what FlopCounterMode measures, and the model/hardware relations."""

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from lmledger.errors import UserError
from lmledger.ledger.closedform.flops import (
    COMPONENTS,
    MFU_CONVENTIONS,
    analytic_flops,
    count_flops_meta,
    flops_per_token_by_convention,
    matmul_parameters,
    measure_flops,
    model_flops_per_token,
    nanogpt_flops_per_token,
    six_n_flops_per_token,
    torchtitan_flops_per_token,
)
from lmledger.ledger.count.flopcounter import flop_counter
from lmledger.model import ModelConfig, ToyLM, count_parameters

TOLERANCE = 0.005  # the ledger's contract: analytic hardware FLOPs within 0.5% of measured

SDPA_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward"

# Odd sizes on purpose: d_model not a power of 2, head dims 24 and 40, vocab 1000 and 256, tied and untied.
# Each comes with (batch, seq) shapes, seq shorter than, and equal to, the context length.
MODELS = {
    "d120-h5-v1000": (
        dict(vocab_size=1000, context_length=64, d_model=120, n_layers=3, n_heads=5, d_ff=328),
        [(3, 37), (2, 64), (1, 1)],
    ),
    "d200-h5-v256-tied": (
        dict(vocab_size=256, context_length=128, d_model=200, n_layers=2, n_heads=5, d_ff=536, tie_embeddings=True),
        [(2, 128), (1, 50), (4, 9)],
    ),
    "d96-h4-v1000-tied": (
        dict(vocab_size=1000, context_length=48, d_model=96, n_layers=3, n_heads=4, d_ff=256, tie_embeddings=True),
        [(5, 17), (1, 48), (2, 2)],
    ),
    "d256-h8-v256": (
        dict(vocab_size=256, context_length=128, d_model=256, n_layers=1, n_heads=8, d_ff=688),
        [(1, 100), (2, 31), (3, 64)],
    ),
    "d120-h3-v256": (
        dict(vocab_size=256, context_length=32, d_model=120, n_layers=3, n_heads=3, d_ff=320),
        [(2, 32), (6, 7), (1, 19)],
    ),
}
CHECKPOINTING = (0, 1, 2)
DTYPES = {"fp32": None, "bf16-autocast": torch.bfloat16}

# The matrix: every model x checkpointing x training/forward x dtype, cycling through each model's shapes.
MATRIX = [
    pytest.param(name, ac, training, dtype, MODELS[name][1][i % 3], id=f"{name}-ac{ac}-{mode}-{dtype}")
    for name in MODELS
    for i, (ac, (training, mode), dtype) in enumerate(
        itertools.product(CHECKPOINTING, ((True, "train"), (False, "fwd")), DTYPES)
    )
]


# FLOP counts do not depend on threading; tiny matmuls on a shared 2-core box run faster on one.
pytestmark = pytest.mark.usefixtures("one_thread")


def make_config(name: str, activation_checkpointing: int = 0) -> ModelConfig:
    return ModelConfig(**MODELS[name][0], activation_checkpointing=activation_checkpointing)


def make_model(cfg: ModelConfig) -> ToyLM:
    torch.manual_seed(0)
    return ToyLM(cfg)


def random_tokens(cfg: ModelConfig, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def total(report, *names, phases=("forward", "backward", "recompute")) -> int:
    return sum(report.by_component[n][p] for n in names for p in phases)


@pytest.mark.parametrize("name, ac, training, dtype, shape", MATRIX)
def test_analytic_hardware_flops_match_flop_counter(name, ac, training, dtype, shape):
    cfg = make_config(name, ac)
    batch, seq = shape
    measured = measure_flops(
        make_model(cfg), random_tokens(cfg, batch, seq), training=training, autocast_dtype=DTYPES[dtype]
    )
    predicted = analytic_flops(cfg, batch, seq, training=training)
    assert measured.total > 0
    assert abs(predicted.hardware - measured.total) / measured.total <= TOLERANCE


@pytest.mark.parametrize("ac", CHECKPOINTING)
@pytest.mark.parametrize("name", MODELS)
def test_meta_count_equals_cpu_count(name, ac):
    cfg = make_config(name, ac)
    batch, seq = MODELS[name][1][ac]
    cpu = measure_flops(make_model(cfg), random_tokens(cfg, batch, seq))
    meta = count_flops_meta(cfg, batch, seq)
    assert meta.by_op == cpu.by_op
    assert meta.total == cpu.total


@pytest.mark.parametrize("name", MODELS)
def test_meta_forward_only_count(name):
    cfg = make_config(name, activation_checkpointing=1)  # no_grad: checkpointing must not apply
    batch, seq = MODELS[name][1][0]
    meta = count_flops_meta(cfg, batch, seq, training=False)
    predicted = analytic_flops(cfg, batch, seq, training=False)
    assert abs(meta.total - predicted.hardware) / predicted.hardware <= TOLERANCE


def test_meta_sdpa_math_fallback_misses_the_score_recompute():
    # Why measure_flops reroutes SDPA on meta: left alone, meta SDPA runs the math fallback, whose
    # backward is 4 bmm per layer where the fused kernels count 5 (the recompute of Q·Kᵀ).
    cfg = make_config("d120-h5-v1000")
    batch, seq = 2, 40
    with torch.device("meta"):
        model = ToyLM(cfg)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    with flop_counter() as counter:
        torch.autograd.grad(model(idx, idx), list(model.parameters()))
    score_recompute = 2 * batch * cfg.n_heads * seq * seq * cfg.head_dim
    expected = analytic_flops(cfg, batch, seq).hardware - cfg.n_layers * score_recompute
    assert counter.get_total_flops() == expected
    assert "aten.bmm" in {str(op) for op in counter.get_flop_counts()["Global"]}


def test_cpu_sdpa_ops_are_the_ones_given_formulas():
    # torch 2.13 runs CPU SDPA as these two ops; without our formulas FlopCounterMode counts them as 0.
    cfg = make_config("d96-h4-v1000-tied")
    measured = measure_flops(make_model(cfg), random_tokens(cfg, 2, 16))
    assert set(measured.by_op) == {"aten.mm", SDPA_FORWARD, SDPA_BACKWARD}
    assert measured.by_op[SDPA_FORWARD] > 0 and measured.by_op[SDPA_BACKWARD] > 0


@pytest.mark.parametrize("ac", CHECKPOINTING)
def test_sdpa_op_counts_match_attention_components(ac):
    cfg = make_config("d120-h3-v256", ac)
    batch, seq = 3, 29
    measured = measure_flops(make_model(cfg), random_tokens(cfg, batch, seq))
    predicted = analytic_flops(cfg, batch, seq)
    attention = ("attn_scores", "attn_values")
    assert measured.by_op[SDPA_FORWARD] == total(predicted, *attention, phases=("forward", "recompute"))
    assert measured.by_op[SDPA_BACKWARD] == total(predicted, *attention, phases=("backward",))
    assert measured.by_op["aten.mm"] == predicted.hardware - total(predicted, *attention)


# Analytic components and the module FlopCounterMode credits them to ("" = block-level total).
LEAF_MODULES = {
    "qkv": "attn.qkv",
    "attn_out": "attn.out",
    "mlp_w1": "mlp.w1",
    "mlp_w3": "mlp.w3",
    "mlp_w2": "mlp.w2",
}


@pytest.mark.parametrize("name", ["d120-h5-v1000", "d200-h5-v256-tied"])
def test_per_component_forward_only(name):
    cfg = make_config(name)
    batch, seq = 2, 21
    measured = measure_flops(make_model(cfg), random_tokens(cfg, batch, seq), training=False)
    predicted = analytic_flops(cfg, batch, seq, training=False)
    for layer in range(cfg.n_layers):
        for component, module in LEAF_MODULES.items():
            assert measured.by_module[f"ToyLM.blocks.{layer}.{module}"] == total(predicted, component) // cfg.n_layers
    assert measured.by_module["ToyLM.lm_head"] == total(predicted, "lm_head")
    assert measured.by_op[SDPA_FORWARD] == total(predicted, "attn_scores", "attn_values")


def test_per_component_training():
    # In backward FlopCounterMode's module tracker credits w3 with w1's backward too (they share an
    # input), so compare the modules it does attribute cleanly: the LM head, attention and MLP per block.
    cfg = make_config("d120-h5-v1000")
    batch, seq = 3, 37
    measured = measure_flops(make_model(cfg), random_tokens(cfg, batch, seq))
    predicted = analytic_flops(cfg, batch, seq)
    per_layer = {
        "attn": total(predicted, "qkv", "attn_scores", "attn_values", "attn_out") // cfg.n_layers,
        "mlp": total(predicted, "mlp_w1", "mlp_w3", "mlp_w2") // cfg.n_layers,
        "attn.qkv": total(predicted, "qkv") // cfg.n_layers,
        "attn.out": total(predicted, "attn_out") // cfg.n_layers,
        "mlp.w2": total(predicted, "mlp_w2") // cfg.n_layers,
    }
    for layer in range(cfg.n_layers):
        for module, flops in per_layer.items():
            assert measured.by_module[f"ToyLM.blocks.{layer}.{module}"] == flops
    assert measured.by_module["ToyLM.lm_head"] == total(predicted, "lm_head")


@pytest.mark.parametrize("name", ["d120-h5-v1000", "d96-h4-v1000-tied"])
@pytest.mark.parametrize("training", [True, False])
def test_model_flops_closed_form(name, training):
    cfg = make_config(name)
    batch, seq = 4, 30
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    norms = (2 * L + 1) * d
    lookup_table = 0 if cfg.tie_embeddings else V * d  # a tied table is the LM head and stays in N
    n_matmul = count_parameters(cfg) - norms - lookup_table
    assert matmul_parameters(cfg) == n_matmul
    attention = 12 * L * cfg.n_heads * cfg.head_dim * seq if training else 4 * L * cfg.n_heads * cfg.head_dim * seq
    per_token = (6 if training else 2) * n_matmul + attention
    assert model_flops_per_token(cfg, seq, training) == per_token
    report = analytic_flops(cfg, batch, seq, training)
    assert report.model == per_token * batch * seq
    assert report.tokens == batch * seq


@pytest.mark.parametrize("ac", CHECKPOINTING)
def test_hardware_minus_model_is_score_recompute_plus_checkpoint_recompute(ac):
    # Linear layers: model and hardware both count 2 (fwd) + 4 (bwd) FLOPs per weight per token.
    # Attention: model counts 2 + 4 T×T bmm per layer, the fused backward 5: one score bmm more.
    # Checkpointed blocks rerun their forward in backward, except w2, where early stop halts.
    cfg = make_config("d120-h5-v1000", ac)
    batch, seq = 2, 45
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    tokens = batch * seq
    score_bmm = 2 * batch * seq * seq * d  # 2·B·H·T·T·Q with H·Q = d
    checkpointed = math.ceil(L / ac) if ac else 0
    block_recompute = 2 * tokens * (3 * d * d + d * d + 2 * d * f) + 2 * score_bmm
    report = analytic_flops(cfg, batch, seq)
    assert report.hardware - report.model == L * score_bmm + checkpointed * block_recompute
    if ac:
        assert report.model < report.hardware - L * score_bmm
    forward_only = analytic_flops(cfg, batch, seq, training=False)
    assert forward_only.hardware == forward_only.model


def test_checkpoint_recompute_without_early_stop_includes_w2():
    cfg = make_config("d96-h4-v1000-tied", activation_checkpointing=1)
    batch, seq = 2, 24
    model, idx = make_model(cfg), random_tokens(cfg, batch, seq)
    with set_checkpoint_early_stop(False):
        measured = measure_flops(model, idx)
    predicted = analytic_flops(cfg, batch, seq, checkpoint_early_stop=False)
    assert measured.total == predicted.hardware
    assert predicted.by_component["mlp_w2"]["recompute"] == predicted.by_component["mlp_w2"]["forward"]
    assert predicted.hardware > analytic_flops(cfg, batch, seq).hardware


def test_phases_sum_to_hardware_and_forward_only_has_no_backward():
    cfg = make_config("d200-h5-v256-tied", 1)
    train = analytic_flops(cfg, 2, 40)
    assert set(train.by_component) == set(COMPONENTS)
    assert sum(sum(p.values()) for p in train.by_component.values()) == train.hardware
    assert train.by_component["lm_head"]["recompute"] == 0
    fwd = analytic_flops(cfg, 2, 40, training=False)
    assert all(p["backward"] == 0 and p["recompute"] == 0 for p in fwd.by_component.values())


def test_measure_leaves_model_as_found():
    cfg = make_config("d120-h3-v256", activation_checkpointing=1)
    model, idx = make_model(cfg), random_tokens(cfg, 2, 16)
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 7.0)
    model.eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    measured = measure_flops(model, idx)
    assert not model.training
    assert torch.equal(model.lm_head.weight.grad, torch.full_like(model.lm_head.weight, 7.0))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "lm_head.weight")
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    # Measured as a training step even though the model was in eval mode: the recompute is in.
    assert measured.total == analytic_flops(cfg, 2, 16).hardware


def test_compiled_module_is_counted_eagerly():
    cfg = make_config("d96-h4-v1000-tied")
    model, idx = make_model(cfg), random_tokens(cfg, 2, 12)
    compiled = torch.compile(model)  # lazy: nothing compiles unless it is called
    assert measure_flops(compiled, idx).total == measure_flops(model, idx).total == analytic_flops(cfg, 2, 12).hardware


def test_bad_input_is_a_user_error():
    cfg = make_config("d120-h3-v256")
    with pytest.raises(UserError, match="context_length"):
        analytic_flops(cfg, 2, cfg.context_length + 1)
    with pytest.raises(UserError, match="batch size"):
        analytic_flops(cfg, 0, 8)
    with pytest.raises(UserError, match="context_length"):
        count_flops_meta(cfg, 1, 0)
    model = make_model(cfg)
    with pytest.raises(UserError, match="batch, seq"):
        measure_flops(model, torch.zeros(8, dtype=torch.long))
    with torch.no_grad(), pytest.raises(UserError, match="autograd"):
        measure_flops(model, random_tokens(cfg, 1, 8))


# --- MFU conventions (docs/mfu.md): each numerator beside what FlopCounterMode counts -----------------


@pytest.mark.parametrize("name", ["d120-h5-v1000", "d200-h5-v256-tied"])
@pytest.mark.parametrize("training", [True, False])
def test_6n_is_the_counted_matmuls_and_palm_adds_the_counted_attention(name, training):
    # Without checkpointing, every aten.mm is a weight matmul (6N per token in training), and the
    # model convention's attention is the SDPA forward three times over: forward, and a backward of
    # twice its bmm, with no recompute.
    cfg = make_config(name)
    batch, seq = MODELS[name][1][0]
    measured = measure_flops(make_model(cfg), random_tokens(cfg, batch, seq), training=training)
    report = analytic_flops(cfg, batch, seq, training=training)
    assert measured.by_op["aten.mm"] == report.model_6n == six_n_flops_per_token(cfg, training) * batch * seq
    passes = 3 if training else 1
    assert measured.by_op["aten.mm"] + passes * measured.by_op[SDPA_FORWARD] == report.model


@pytest.mark.parametrize("shape", [(5, 5), (3, 5), (7, 4)])
def test_causal_entries_are_what_sdpa_keeps(shape):
    # With zero queries and keys every kept score is equal, so with V = I the output is the attention
    # matrix itself, positive exactly where the causal mask keeps an entry.
    from lmledger.ledger.count.flopcounter import _causal_entries

    s_q, s_k = shape
    probe = torch.nn.functional.scaled_dot_product_attention(
        torch.zeros(1, 1, s_q, 8), torch.zeros(1, 1, s_k, 8), torch.eye(s_k).expand(1, 1, s_k, s_k), is_causal=True
    )
    assert _causal_entries((1, 1, s_q, 8), (1, 1, s_k, 8), True) == (int((probe > 0).sum()), s_q * s_k)


@pytest.mark.parametrize("name", ["d120-h5-v1000", "d96-h4-v1000-tied"])
def test_causal_convention_against_the_counted_causal_step(name):
    # FlopCounterMode over the real step, SDPA counted over the entries the model's causal mask keeps:
    # T(T+1)/2 per head where the convention says T²/2, so the twin is larger by exactly the diagonal,
    # 6·L·H·Q FLOPs per token, a (T+1)/T share of the convention's attention term.
    cfg = make_config(name)
    batch, seq = 3, 40
    model, idx = make_model(cfg), random_tokens(cfg, batch, seq)
    causal = measure_flops(model, idx, causal_attention=True)
    full = measure_flops(model, idx)
    report = analytic_flops(cfg, batch, seq)
    counted = causal.by_op["aten.mm"] + 3 * causal.by_op[SDPA_FORWARD]
    diagonal = 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * batch * seq
    assert counted - report.model_causal == diagonal
    attention = report.model_causal - report.model_6n
    assert (counted - report.model_6n) / attention == pytest.approx((seq + 1) / seq, rel=1e-12)
    assert causal.by_op[SDPA_BACKWARD] * seq * seq == full.by_op[SDPA_BACKWARD] * seq * (seq + 1) // 2
    with torch.device("meta"):
        meta_model, meta_idx = ToyLM(cfg), torch.zeros(batch, seq, dtype=torch.long)
    assert measure_flops(meta_model, meta_idx, causal_attention=True).by_op == causal.by_op


def test_the_conventions_order_and_hfu_is_the_hardware_count():
    cfg = make_config("d120-h5-v1000", activation_checkpointing=2)
    batch, seq = 2, 50
    per_token = flops_per_token_by_convention(cfg, seq)
    assert set(per_token) == set(MFU_CONVENTIONS)
    report = analytic_flops(cfg, batch, seq)
    assert per_token["hfu"] * batch * seq == report.hardware
    assert per_token["palm"] * batch * seq == report.model
    assert per_token["6n"] < per_token["causal"] < per_token["palm"] < per_token["hfu"]
    assert 2 * (per_token["causal"] - per_token["6n"]) == per_token["palm"] - per_token["6n"]


def _meta_model(cfg: ModelConfig) -> ToyLM:
    with torch.device("meta"):
        return ToyLM(cfg)


@pytest.mark.parametrize("name", ["d120-h5-v1000", "d200-h5-v256-tied"])
def test_nanogpt_and_torchtitan_counts_follow_their_parameter_rules_on_the_real_module(name):
    # Their parameter counts taken the way their code takes them, from our module: nanoGPT every
    # parameter (it subtracts only a learned position table; RoPE has none), torchtitan every parameter
    # minus the nn.Embedding children's unless tied. T: nanoGPT the context length, torchtitan the batch's.
    cfg = make_config(name)
    seq = MODELS[name][1][1][1]
    model = _meta_model(cfg)
    n_all = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.children() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    attention_per_t = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert nanogpt_flops_per_token(cfg) == 6 * n_all + attention_per_t * cfg.context_length
    titan_params = n_all if cfg.tie_embeddings else n_all - embedding
    assert torchtitan_flops_per_token(cfg, seq) == 6 * titan_params + attention_per_t * seq


def test_cs336_medium_nanogpt_and_torchtitan_differ_from_ours_as_the_issue_says():
    # Issue 11 §5: at context 1024, nanoGPT's count is +2.22% and torchtitan's +0.011% of ours; held
    # to the issue's printed digits (half a unit in the last place: ±0.005% and ±0.0005%).
    import yaml

    with open(Path(__file__).parent.parent.parent / "configs" / "cs336-medium.yaml") as f:
        cfg = ModelConfig(**yaml.safe_load(f)["model"]["config"])
    assert (cfg.vocab_size, cfg.context_length, cfg.tie_embeddings) == (10000, 1024, False)
    ours = model_flops_per_token(cfg, 1024)
    model = _meta_model(cfg)
    assert nanogpt_flops_per_token(cfg) == 6 * sum(p.numel() for p in model.parameters()) + 12 * 24 * 1024 * 1024
    assert abs(100 * (nanogpt_flops_per_token(cfg) / ours - 1) - 2.22) <= 0.005
    assert abs(100 * (torchtitan_flops_per_token(cfg, 1024) / ours - 1) - 0.011) <= 0.0005


# --- `lmledger account`: the conventions table -----------------------------------------------------

ACCOUNT_SMALL = [
    "--model.config.d_model", "96", "--model.config.n_layers", "2", "--model.config.n_heads", "4",
    "--model.config.d_ff", "200", "--model.config.context_length", "48", "--data.batch_size", "3",
]  # fmt: skip


def test_account_lists_the_conventions_at_the_step_predicted_on_its_gpu(workdir, capsys):
    """A GPU config on this CPU: its step is predicted on an H100 (the GPU op model), and each convention's MFU is
    that step's against the H100's bf16 datasheet peak; PaLM's is the predicted step's own MFU."""
    from conftest import run_json
    from lmledger.cli import main as lmledger
    from lmledger.ledger.hardware.gpus import require_gpu

    result = run_json(capsys, "account", "--config", "configs/cs336-medium.yaml", "--json")
    conv, predicted = result["mfu_conventions"], result["time"]["predicted"]
    assert conv["perf_mfu"] == "palm" and conv["seq_len"] == 1024 and conv["predicted_on"] == "h100-sxm"
    assert conv["step_seconds"] == predicted["total_s"] > 0
    assert conv["peak_flops_per_s"] == require_gpu("h100-sxm").peak_flops["bf16"]
    rows = conv["conventions"]
    assert list(rows) == list(MFU_CONVENTIONS) and rows["palm"]["mfu"] == predicted["mfu"] > 0
    for row in rows.values():  # one step, one peak: each MFU stands as its numerator does
        assert row["mfu"] / rows["palm"]["mfu"] == pytest.approx(1 + row["vs_perf_mfu"], rel=1e-12)
    assert rows["palm"]["vs_perf_mfu"] == 0
    assert round(100 * rows["nanogpt"]["vs_perf_mfu"], 2) == 2.22
    assert round(100 * rows["torchtitan"]["vs_perf_mfu"], 3) == 0.011
    assert conv["nanogpt_printed_mfu"] == pytest.approx(rows["nanogpt"]["mfu"] * conv["peak_flops_per_s"] / 312e12)

    assert lmledger(["account", "--config", "configs/cs336-medium.yaml"]) == 0
    out = capsys.readouterr().out
    assert "6N + attention (PaLM) = perf/mfu" in out and "+2.221%" in out and "+0.011%" in out
    assert f"{rows['palm']['mfu']:.4f}" in out and "MFU needs a measured step" not in out
    assert "MFU at the step predicted on h100-sxm by the GPU op model" in out and "989.4 TFLOP/s dense bf16" in out
    # and why it is that MFU (ledger.timing.gpu.explain): its factors, and what holds the rest of the step
    why = predicted["mfu_explained"]
    assert why["model_over_run"] * why["kernel_rate"] * why["kernel_share"] == pytest.approx(predicted["mfu"])
    assert f"  why MFU {predicted['mfu']:.2g}: the kernels run " in out and "other compute" in out.split("why MFU")[1]


def test_account_measure_gives_each_convention_its_mfu(workdir, capsys):
    from conftest import run_json
    from lmledger.run_config import load_run

    result = run_json(capsys, "account", "--config", "configs/tiny.yaml", *ACCOUNT_SMALL, "--measure", "--json")
    conv, tokens = result["mfu_conventions"], result["run"]["tokens_per_step"]
    cfg = load_run(["--config", "configs/tiny.yaml", *ACCOUNT_SMALL]).config
    per_token = flops_per_token_by_convention(cfg, 48)
    rows = conv["conventions"]
    assert {key: row["flops_per_token"] for key, row in rows.items()} == per_token
    assert conv["step_seconds"] > 0 and conv["peak_flops_per_s"] > 0 and conv["peak"]
    palm_mfu = per_token["palm"] * tokens / conv["step_seconds"] / conv["peak_flops_per_s"]
    assert rows["palm"]["mfu"] == pytest.approx(palm_mfu, rel=1e-9) and palm_mfu > 0
    for key, row in rows.items():  # one step time and one peak: MFUs stand as their numerators do
        assert row["mfu"] / rows["palm"]["mfu"] == pytest.approx(per_token[key] / per_token["palm"], rel=1e-9)
    # nanoGPT's own printout divides by an A100's bf16 peak whatever the device.
    assert conv["nanogpt_printed_mfu"] == pytest.approx(per_token["nanogpt"] * tokens / conv["step_seconds"] / 312e12)


# --- The architecture options (model.ModelConfig): the closed forms against the counted step -------------

ARCHS = {
    "gpt": dict(mlp="gelu", norm="layer", positions="learned", bias=True),  # GPT-2 / Megatron GPT
    "mpt": dict(mlp="gelu", norm="layer"),
    "llama-gqa": dict(n_kv_heads=2),
    "mqa-gelu-bias": dict(n_kv_heads=1, mlp="gelu", bias=True, tie_embeddings=True),
}
ARCH_BASE = dict(vocab_size=300, context_length=40, d_model=96, n_layers=3, n_heads=4, d_ff=200)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_options_hardware_and_model_flops_equal_the_counted_step(arch):
    """Hardware FLOPs exact in training (every second block checkpointed), forward only and on the meta device;
    6N is the counted weight matmuls (addmm with biases) and PaLM's adds the counted attention; the qkv of GQA
    is smaller and a GeLU MLP has no w3, by module."""
    batch, seq = 3, 29
    plain = ModelConfig(**ARCH_BASE, **ARCHS[arch])
    checkpointed = ModelConfig(**ARCH_BASE, **ARCHS[arch], activation_checkpointing=2)
    idx = random_tokens(plain, batch, seq)
    train = measure_flops(make_model(checkpointed), idx)
    assert train.total == analytic_flops(checkpointed, batch, seq).hardware
    assert count_flops_meta(checkpointed, batch, seq).by_op == train.by_op
    forward = measure_flops(make_model(plain), idx, training=False)
    report = analytic_flops(plain, batch, seq, training=False)
    assert forward.total == report.hardware == report.model
    plain_train = measure_flops(make_model(plain), idx)
    matmuls = sum(n for op, n in plain_train.by_op.items() if op in ("aten.mm", "aten.addmm"))
    report = analytic_flops(plain, batch, seq)
    assert matmuls == report.model_6n and matmuls + 3 * plain_train.by_op[SDPA_FORWARD] == report.model
    assert ("aten.addmm" in plain_train.by_op) == plain.bias
    assert ("mlp_w3" in report.by_component) == (plain.mlp == "swiglu")
    for component, module in LEAF_MODULES.items():
        per_layer = report.by_component.get(component, {"forward": 0})["forward"] // 3
        assert forward.by_module.get(f"ToyLM.blocks.0.{module}", 0) == per_layer, component


@pytest.mark.parametrize("arch", ["gpt", "mqa-gelu-bias"])
def test_architecture_options_conventions_follow_their_parameter_rules(arch):
    # nanoGPT drops the learned position table (wpe) from N; torchtitan drops every nn.Embedding child (unless
    # tied, as for the default); both keep the biases and the norms' parameters.
    cfg = ModelConfig(**ARCH_BASE, **ARCHS[arch])
    model = _meta_model(cfg)
    n_all = sum(p.numel() for p in model.parameters())
    positions = model.pos_embed.weight.numel() if model.pos_embed is not None else 0
    tables = sum(p.numel() for m in model.children() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    attention_per_t = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert nanogpt_flops_per_token(cfg) == 6 * (n_all - positions) + attention_per_t * cfg.context_length
    titan = n_all - positions if cfg.tie_embeddings else n_all - tables
    assert torchtitan_flops_per_token(cfg, 20) == 6 * titan + attention_per_t * 20
    biases_and_norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert matmul_parameters(cfg) == n_all - biases_and_norms - positions - (0 if cfg.tie_embeddings else 300 * 96)
