"""The toy LM itself: causality, the closed-form parameter count, init scale, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from lmledger.errors import ConfigError
from lmledger.model import ModelConfig, ToyLM, count_parameters

CONFIGS = [
    ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128),
    ModelConfig(vocab_size=1000, context_length=48, d_model=120, n_layers=3, n_heads=5, d_ff=328, tie_embeddings=True),
    ModelConfig(
        vocab_size=300, context_length=16, d_model=80, n_layers=1, n_heads=2, d_ff=200, activation_checkpointing=1
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.d_model}-h{c.n_heads}-tied{c.tie_embeddings}")
def test_num_parameters_matches_the_closed_form(cfg):
    model = ToyLM(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    by_hand = n * (3 * d * d + d * d + 3 * d * f + 2 * d) + v * d + (0 if cfg.tie_embeddings else v * d) + d
    assert count_parameters(cfg) == by_hand
    assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.d_model}-h{c.n_heads}-tied{c.tie_embeddings}")
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
    ],
)
def test_bad_configs_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


def test_sequence_longer_than_the_context_is_refused():
    cfg = CONFIGS[0]
    with pytest.raises(ConfigError, match="context_length"):
        ToyLM(cfg)(torch.zeros(1, cfg.context_length + 1, dtype=torch.long))
