"""The precision registry (ledger.precision_table) held against what Lightning's plugins and torch do: each row's
names, bytes per element, autocast, conversion, GradScaler and LitLM's fused rule, and the activation widths,
measured on a tiny model stepped as the plugin runs it."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import precision as lightning_precision
from test_levers import transformer_engine  # noqa: F401 (the stand-in Transformer Engine fixture)
from torch import nn

from lmledger.errors import ConfigError
from lmledger.ledger import precision_table
from lmledger.ledger.hardware.gpus import dtype_name
from lmledger.lit import LitLM
from lmledger.model import ModelConfig
from lmledger.precision import trainer_precision_kwargs

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
TORCH_RUNS = [row for row in precision_table.ROWS.values() if not row.transformer_engine]


def test_the_registry_has_lightnings_precision_names_and_aliases():
    assert set(precision_table.PRECISIONS) == set(get_args(lightning_precision._PRECISION_INPUT_STR))
    assert precision_table.ALIASES == lightning_precision._PRECISION_INPUT_STR_ALIAS_CONVERSION
    for alias, name in precision_table.ALIASES.items():
        assert precision_table.precision(alias) is precision_table.precision(name)
    assert precision_table.precision(32).name == "32-true"  # Lightning's int flags


def test_an_unknown_precision_is_one_line_listing_the_valid_names():
    with pytest.raises(ConfigError) as raised:
        precision_table.precision("8-true")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("unknown precision '8-true'")
    assert all(name in message for name in (*precision_table.PRECISIONS, *precision_table.ALIASES))


def test_a_transformer_engine_run_is_traced_as_the_module_its_plugin_converts():
    """te.Linear runs on a CUDA GPU only, so its step is traced at what Lightning's plugin converts the module to:
    bf16-true, 16-true, and bf16-mixed for fp32 master weights (the bf16 fallback autocast); others as themselves,
    a plugin the table lacks as bf16-mixed."""
    traced = precision_table.traced_precision
    assert [traced(name) for name in ("transformer-engine", "transformer-engine-float16", "bf16", 32)] == [
        "bf16-true", "16-true", "bf16-mixed", "32-true"]  # fmt: skip
    assert traced("transformer-engine", torch.float32) == "bf16-mixed" and traced("MyPlugin") == "bf16-mixed"
    assert traced("transformer-engine", torch.float16) == "16-true"
    te = precision_table.transformer_engine
    assert (te("transformer-engine-float16"), te("bf16-true"), te(None), te("MyPlugin")) == (True, False, False, False)


def _trainer(name: str) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **trainer_precision_kwargs(name, "cpu"),
    )  # fmt: skip


@pytest.mark.parametrize("row", TORCH_RUNS, ids=lambda row: row.name)
def test_a_row_matches_a_real_step_under_lightnings_plugin(row):
    trainer = _trainer(row.name)
    plugin = trainer.precision_plugin
    assert str(trainer.precision) == row.name
    assert (getattr(plugin, "scaler", None) is not None) == row.grad_scaler

    torch.manual_seed(0)
    model = plugin.convert_module(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    assert {p.dtype for p in model.parameters()} == {row.convert_dtype or torch.float32}
    x = plugin.convert_input(torch.randn(4, 16))
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") == (row.autocast is not None)
        if row.autocast is not None:
            assert torch.get_autocast_dtype("cpu") == row.autocast_dtype
        hidden = model[0](x)
        residual = x + hidden
        loss = model[1](residual).float().pow(2).mean()
    assert dtype_name(hidden.dtype) == row.compute_dtype  # the dtype whose peak MFU is measured against
    if row.activation_bytes is not None:
        assert (hidden.element_size(), residual.element_size()) == row.activation_bytes

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=row.fused_optimizer)
    (plugin.scaler.scale(loss) if row.grad_scaler else loss).backward()
    optimizer.step()
    for p in model.parameters():
        assert p.element_size() == row.param_bytes
        assert p.grad.element_size() == row.grad_bytes
        state = optimizer.state[p]
        assert state["exp_avg"].element_size() == state["exp_avg_sq"].element_size() == row.state_bytes


@pytest.mark.parametrize("row", TORCH_RUNS, ids=lambda row: row.name)
def test_litlm_picks_the_fused_optimizer_the_row_says(row):
    lit = LitLM(TINY)
    lit.trainer = _trainer(row.name)
    optimizer = lit.configure_optimizers()["optimizer"]
    assert {group["fused"] for group in optimizer.param_groups} == {row.fused_optimizer}


def test_weight_decay_is_on_the_matmul_weights_only():
    """GPT-style options: the learned position table, biases and LayerNorm's parameters are not decayed."""
    gpt = replace(TINY, mlp="gelu", norm="layer", positions="learned", bias=True)
    lit = LitLM(gpt)
    lit.trainer = _trainer("32-true")
    decay, no_decay = lit.configure_optimizers()["optimizer"].param_groups
    names = {id(p): n for n, p in lit.model.named_parameters()}
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "blocks.0.attn.out.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.w1.weight", "blocks.0.mlp.w2.weight",
        "lm_head.weight",
    ]  # fmt: skip
    assert len(no_decay["params"]) == len(names) - 5  # the tables, every bias, the norms


@pytest.mark.parametrize("name", ["transformer-engine", "transformer-engine-float16"])
def test_transformer_engine_rows_match_lightnings_plugin(transformer_engine, name):  # noqa: F811
    # The fp8 matmuls (compute_dtype) need an fp8 GPU; on CPU the weights, the layer swap and the scaler are checked.
    row = precision_table.precision(name)
    (plugin,) = trainer_precision_kwargs(name, "gpu")["plugins"]
    assert plugin.precision == name and plugin.weights_dtype == row.convert_dtype
    assert (getattr(plugin, "scaler", None) is not None) == row.grad_scaler
    model = plugin.convert_module(LitLM(replace(TINY, tie_embeddings=True))).model
    assert isinstance(model.blocks[0].mlp.w1, transformer_engine) == row.transformer_engine
    assert {p.element_size() for p in model.parameters()} == {row.param_bytes}
