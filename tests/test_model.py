"""The toy LM itself: causality, the closed-form parameter count, init scale, config checks, architecture options."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lmledger.errors import ConfigError
from lmledger.ledger.closedform.memory import largest_layer_params
from lmledger.model import ModelConfig, ToyLM, count_parameters

GPT = dict(mlp="gelu", norm="layer", positions="learned", bias=True)  # GPT-2 / Megatron GPT
CONFIGS = [
    ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128),
    ModelConfig(vocab_size=1000, context_length=48, d_model=120, n_layers=3, n_heads=5, d_ff=328, tie_embeddings=True),
    ModelConfig(
        vocab_size=300, context_length=16, d_model=80, n_layers=1, n_heads=2, d_ff=200, activation_checkpointing=1
    ),
    ModelConfig(vocab_size=256, context_length=24, d_model=60, n_layers=2, n_heads=4, d_ff=240, **GPT),  # head dim 15
    ModelConfig(vocab_size=256, context_length=24, d_model=64, n_layers=2, n_heads=8, d_ff=96, n_kv_heads=2),  # GQA
]


def _id(cfg: ModelConfig) -> str:
    return "-".join([f"d{cfg.d_model}-h{cfg.n_heads}-tied{cfg.tie_embeddings}", *cfg.non_default_architecture])


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=_id)
def test_num_parameters_matches_the_closed_form(cfg):
    model = ToyLM(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    by_hand = n * (3 * d * d + d * d + 3 * d * f + 2 * d) + v * d + (0 if cfg.tie_embeddings else v * d) + d
    assert count_parameters(cfg) == by_hand
    assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings


# Every combination of the architecture options (and tying): 96 tiny models (a few ms each on the CPU).
ARCH_GRID = list(
    itertools.product(("swiglu", "gelu"), ("rms", "layer"), ("rope", "learned"), (None, 3, 1), (False, True), (0, 1))
)


def test_num_parameters_matches_the_closed_form_for_every_architecture_option():
    for mlp, norm, positions, kv, bias, tied in ARCH_GRID:
        options = dict(mlp=mlp, norm=norm, positions=positions, n_kv_heads=kv, bias=bias, tie_embeddings=bool(tied))
        cfg = ModelConfig(vocab_size=37, context_length=11, d_model=36, n_layers=2, n_heads=6, d_ff=52, **options)
        assert ToyLM(cfg).num_parameters() == count_parameters(cfg), cfg
        # By hand, GPT-2's way: qkv (d + 2 kv_dim) x d, out d x d, MLP 2 or 3 d x f, their biases; norms' gains and
        # biases; tables. The LM head has no bias.
        d, f, kv_dim = 36, 52, (kv or 6) * 6
        mlp_weights = (3 if mlp == "swiglu" else 2) * d * f
        biases = (d + 2 * kv_dim) + d + ((2 * f if mlp == "swiglu" else f) + d) if bias else 0
        norm_params = d * (2 if norm == "layer" and bias else 1)
        per_layer = d * (d + 2 * kv_dim) + d * d + mlp_weights + biases + 2 * norm_params
        tables = 37 * d * (1 if tied else 2) + (11 * d if positions == "learned" else 0)
        assert count_parameters(cfg) == 2 * per_layer + tables + norm_params, cfg


# d_model 120, 5 heads, d_ff 200, vocabulary 256, context 64: each option below makes another module the largest.
SMALL = dict(vocab_size=256, context_length=64, d_model=120, n_layers=2, n_heads=5, d_ff=200)


@pytest.mark.parametrize(
    "arch",
    [{"positions": "learned", "context_length": 2000}, {"bias": True, "d_ff": 600}, {"n_kv_heads": 1, "bias": True},
     {"mlp": "gelu", "norm": "layer", "bias": True, "vocab_size": 30}],
)  # fmt: skip
def test_largest_layer_is_the_largest_modules_own_parameters_for_the_architecture_options(arch):
    """DeepSpeed's model_to_params rule (each module's own parameters, a Linear's bias with it), held over options
    whose largest module is each time another: the position table, w1 with its bias, the embedding, qkv."""
    cfg = ModelConfig(**{**SMALL, **arch})
    model = ToyLM(cfg)
    own = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    assert largest_layer_params(cfg) == max(own.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_changing_a_later_token_never_changes_earlier_logits(cfg):
    torch.manual_seed(0)
    model = ToyLM(cfg).eval()
    t = cfg.context_length
    idx = torch.randint(0, cfg.vocab_size, (2, t))
    with torch.no_grad():
        base = model(idx)
        for pos in (1, t // 2, t - 1):
            changed = idx.clone()
            changed[:, pos] = (changed[:, pos] + 1) % cfg.vocab_size
            out = model(changed)
            assert torch.equal(out[:, :pos], base[:, :pos]), pos  # bitwise: the past cannot see the future
            assert not torch.allclose(out[:, pos], base[:, pos])  # ... but the changed position does move


def test_loss_at_init_is_near_uniform_and_checkpointing_gives_the_same_grads():
    cfg = CONFIGS[0]
    torch.manual_seed(0)
    model = ToyLM(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.context_length))
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1.0  # 1/sqrt(fan_in) init keeps logits O(1)
    checkpointed = ToyLM(ModelConfig(**{**cfg.__dict__, "activation_checkpointing": 1}))
    checkpointed.load_state_dict(model.state_dict())
    loss_ckpt = checkpointed(idx, idx)
    loss.backward()
    loss_ckpt.backward()
    assert torch.allclose(loss, loss_ckpt)
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_init_stds_follow_fan_in():
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, d_ff=1024)
    model = ToyLM(cfg)
    w2 = model.blocks[0].mlp.w2.weight  # fan_in d_ff
    qkv = model.blocks[0].attn.qkv.weight  # fan_in d_model
    # truncation at 3 sigma shrinks the std by ~1.3%
    assert w2.std().item() == pytest.approx(1 / math.sqrt(cfg.d_ff), rel=0.05)
    assert qkv.std().item() == pytest.approx(1 / math.sqrt(cfg.d_model), rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert qkv.abs().max().item() <= 3 / math.sqrt(cfg.d_model) + 1e-6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 30, "n_heads": 4}, "divisible by n_heads"),
        ({"d_model": 30, "n_heads": 10}, "must be even for RoPE"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"activation_checkpointing": -1}, "activation_checkpointing"),
        ({"mlp": "geglu"}, "model mlp must be one of swiglu, gelu, got 'geglu'"),
        ({"norm": "batch"}, "model norm must be one of rms, layer, got 'batch'"),
        ({"positions": "alibi"}, "model positions must be one of rope, learned, got 'alibi'"),
        ({"n_kv_heads": 3}, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        ({"n_kv_heads": 0}, "n_kv_heads must be a positive whole number or null"),
        ({"n_kv_heads": 1 << 30}, "n_kv_heads must be a positive whole number or null"),
        ({"bias": "yes"}, "model bias must be true or false"),
        ({"d_model": 30, "n_heads": 10, "positions": "learned", "mlp": "x"}, "model mlp must be one of"),
    ],
)
def test_bad_configs_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_default_options_keep_the_parameter_names_and_the_others_add_theirs():
    """The defaults are today's model (checkpoints load); GPT-style options add biases and a position table only."""
    cfg = CONFIGS[0]
    names = set(ToyLM(cfg).state_dict())
    block = {"attn_norm.weight", "attn.qkv.weight", "attn.out.weight", "mlp_norm.weight", "mlp.w1.weight",
             "mlp.w3.weight", "mlp.w2.weight"}  # fmt: skip
    top = {"embed.weight", "norm.weight", "lm_head.weight"}
    assert names == top | {f"blocks.{i}.{n}" for i in range(cfg.n_layers) for n in block}
    assert ModelConfig(n_kv_heads=cfg.n_heads) == ModelConfig(n_kv_heads=cfg.n_heads)  # an explicit MHA is MHA
    assert ToyLM(ModelConfig(**{**cfg.__dict__, "n_kv_heads": cfg.n_heads})).state_dict().keys() == names
    gpt = set(ToyLM(ModelConfig(**{**cfg.__dict__, **GPT})).state_dict())
    gpt_block = {n for n in block if n != "mlp.w3.weight"}
    gpt_block |= {n.replace("weight", "bias") for n in gpt_block}
    assert gpt == top | {"norm.bias", "pos_embed.weight"} | {f"blocks.{i}.{n}" for i in range(2) for n in gpt_block}


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_qkv_columns_are_grouped_per_kv_head(kv_heads):
    """The attention's output equals one computed by hand from the documented layout: per KV group, its query heads
    then its k then its v (with one KV head per query head, today's per-head (q|k|v)); query head i reads group
    i // (n_heads / n_kv_heads). So a column split gives each TP rank whole groups."""
    cfg = ModelConfig(vocab_size=16, context_length=8, d_model=32, n_layers=1, n_heads=4, d_ff=32, n_kv_heads=kv_heads)
    torch.manual_seed(0)
    attn = ToyLM(cfg).blocks[0].attn
    x = torch.randn(2, 8, 32)
    per_group, hd = 4 // kv_heads, 8
    cols = attn.qkv(x).unflatten(-1, (kv_heads, per_group + 2, hd))  # (b, t, group, slot, head dim)
    heads = []
    for i in range(4):  # each head as (b, 1, t, head dim)
        group = i // per_group
        q, k, v = (cols[:, :, group, slot, None].transpose(1, 2) for slot in (i % per_group, per_group, per_group + 1))
        y = torch.nn.functional.scaled_dot_product_attention(attn.rope(q), attn.rope(k), v, is_causal=True)
        heads.append(y[:, 0])
    by_hand = attn.out(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x), by_hand, rtol=1e-5, atol=1e-6)


def test_sequence_longer_than_the_context_is_refused():
    cfg = CONFIGS[0]
    with pytest.raises(ConfigError, match="context_length"):
        ToyLM(cfg)(torch.zeros(1, cfg.context_length + 1, dtype=torch.long))
