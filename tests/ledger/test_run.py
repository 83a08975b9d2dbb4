"""ledger.run: one description of a run, the same whether built from a config (run_config) or from a live
Lightning strategy (callbacks.trainer_io), and ledger.predict.predict, the prediction `fit` and `account` show for the
toy LM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

from lmledger.callbacks.closedform import closed_form
from lmledger.callbacks.trainer_io import _strategy_name as live_strategy
from lmledger.errors import UserError
from lmledger.ledger.closedform.peak import peak_bytes
from lmledger.ledger.predict import predict
from lmledger.ledger.run import Run
from lmledger.model import ModelConfig
from lmledger.run_config import config_strategy


def _class(path: str, **init_args) -> Namespace:
    return Namespace(class_path=path, init_args=Namespace(**init_args))


@pytest.mark.parametrize(
    ("config", "live", "expected"),
    [
        ("ddp", lambda: DDPStrategy(), "ddp"),
        ("fsdp", lambda: FSDPStrategy(), "fsdp"),
        (
            _class("lightning.pytorch.strategies.FSDPStrategy", sharding_strategy="SHARD_GRAD_OP"),
            lambda: FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
            "zero2",  # the config read "fsdp" before: whole params, sharded grads and optimizer state
        ),
        ("deepspeed", lambda: DeepSpeedStrategy(), "deepspeed_stage_2"),  # was "ddp" from a config
        ("deepspeed_stage_3", lambda: DeepSpeedStrategy(stage=3), "deepspeed_stage_3"),
        (
            _class("lightning.pytorch.strategies.DeepSpeedStrategy", stage=1),
            lambda: DeepSpeedStrategy(stage=1),
            "deepspeed_stage_1",
        ),
    ],
)
def test_a_config_and_the_live_strategy_name_the_same_sharding(config, live, expected):
    if expected.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    assert config_strategy(config) == expected
    assert live_strategy(live()) == expected


CFG = ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=2, d_ff=128)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_predict_is_the_closed_forms_the_fit_tables_show(precision, optimizer):
    run = Run(CFG, batch_size=4, seq_len=32, precision=precision, optimizer=optimizer)
    p = predict(run)
    table = closed_form(run, dry=None)
    assert (table.params, table.grads, table.optimizer, table.peak) == (p.params, p.grads, p.optimizer, p.peak)
    assert closed_form(run, dry=None, accumulate=2).flops_hardware == 2 * p.flops_hardware
    expected = peak_bytes(CFG, 4, 32, precision, optimizer, fused=True).total  # LitLM's fused kernels
    assert p.peak == expected
    assert predict(run, batch_size=8).peak == predict(dataclasses.replace(run, batch_size=8)).peak > p.peak
    assert p.flops_model < p.flops_hardware  # attention's score recompute counts as hardware FLOPs only


def test_predict_dry_runs_any_other_module():
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.cross_entropy(self.head(self.embed(inputs)).flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Tiny()
    batch = (torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8)))
    p = predict(Run(None, 4, 8, module=module), batch)
    n = sum(t.numel() for t in module.parameters())
    assert (p.params, p.grads, p.optimizer) == (4 * n, 4 * n, 8 * n) and p.flops_model is None
    assert predict(Run(None, 4, 8, module=module), batch, batch_size=8).activations > p.activations
    with pytest.raises(UserError, match="pass its batch"):
        predict(Run(None, 4, 8, module=module))


def test_the_architecture_options_are_read_from_yaml_and_the_command_line(tmp_path):
    """`fit`'s own parser takes them (a config file, then an override), and the Run carries them."""
    from lmledger.run_config import load_run

    options = tmp_path / "gpt.yaml"
    options.write_text("model:\n  config:\n    mlp: gelu\n    norm: layer\n    positions: learned\n    bias: true\n")
    run = load_run(["--config", "configs/tiny.yaml", "--config", str(options), "--model.config.n_kv_heads", "2"])
    cfg = run.config
    assert (cfg.mlp, cfg.norm, cfg.positions, cfg.bias, cfg.n_kv_heads) == ("gelu", "layer", "learned", True, 2)
    default = load_run(["--config", "configs/tiny.yaml", "--model.config.n_kv_heads", "null"]).config
    assert default.non_default_architecture == [] and default.kv_heads == default.n_heads
