"""Precision, fp8, activation checkpointing and compile: the ledger's figures against real runs."""

from __future__ import annotations

import copy
import functools
import math
import shutil
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import lightning as L
import lightning.fabric.plugins.precision.transformer_engine as lightning_te
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, TransformerEnginePrecision
from torch import nn

import lmledger.precision as precision_module
from conftest import MICRO_OVERRIDES, TINY_OVERRIDES, read_scalars
from lmledger.cli import main as lmledger
from lmledger.data import TokenDataModule
from lmledger.errors import UserError
from lmledger.fitting.cli import parse_fit_config
from lmledger.ledger.closedform.activations import activation_bytes, measure_saved_activations
from lmledger.ledger.closedform.flops import analytic_flops, measure_flops
from lmledger.ledger.closedform.memory import measure_state_bytes, state_bytes
from lmledger.lit import LitLM
from lmledger.model import ModelConfig, ToyLM, count_parameters
from lmledger.precision import (
    TiedTransformerEnginePrecision,
    check_precision,
    check_trainer_config,
    requested_precision,
    trainer_precision_kwargs,
)

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=256, context_length=64, d_model=64, n_layers=2, n_heads=2, d_ff=128)
PARAM_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread


@dataclass
class StateAfterStep(L.Callback):
    """Bytes of params, grads and optimizer state right after the last optimizer step."""

    measured: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.measured = measure_state_bytes(pl_module.model, trainer.optimizers[0])


def fit_tiny(data_dir: Path, precision: str, steps: int = 3, **lit_kwargs) -> tuple[L.Trainer, LitLM, StateAfterStep]:
    data = TokenDataModule(path=str(data_dir), batch_size=4, context_length=TINY.context_length)
    lit = LitLM(replace(TINY, vocab_size=data.vocab_size), warmup_steps=1, **lit_kwargs)
    probe = StateAfterStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_precision_kwargs(precision, "cpu"),
    )  # fmt: skip
    trainer.fit(lit, data)
    return trainer, lit, probe


# ----------------------------------------------------------------------------------------------
# Bytes per parameter: the ledger against a real optimizer step


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_state_bytes_match_the_ledger_after_real_steps(stdlib_data, precision):
    trainer, lit, probe = fit_tiny(stdlib_data, precision)
    n = lit.model.num_parameters()
    assert n == count_parameters(lit.config)
    assert probe.measured is not None and probe.measured["optimizer"] > 0, "no optimizer step was taken"
    assert probe.measured == state_bytes(n, precision, "adamw")
    assert {p.dtype for p in lit.model.parameters()} == {PARAM_DTYPE[precision]}
    if precision == "16-mixed":
        # Real fp16 autocast with loss scaling on CPU, not Lightning's substitute (bf16-mixed).
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"
        assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler.get_scale() > 0


# ----------------------------------------------------------------------------------------------
# Config fragments


def parse_with(fragment: str):
    return parse_fit_config(["--config", "configs/tiny.yaml", "--config", f"configs/{fragment}"])


def parse_with_args(args: list[str]):
    return parse_fit_config(["--config", "configs/tiny.yaml", *args])


def test_every_fragment_parses_on_top_of_tiny(workdir):
    expected = {
        "precision/32-true.yaml": ("32-true", None),
        "precision/bf16-mixed.yaml": ("bf16-mixed", None),
        "precision/16-mixed.yaml": ("16-mixed", None),
        "precision/bf16-true.yaml": ("bf16-true", None),
        "precision/fp8-te.yaml": ("transformer-engine", None),
        "precision/fp8-te-fp32-master.yaml": (None, None),
        "precision/fp8-torchao.yaml": ("bf16-mixed", "torchao"),
    }
    fragments = sorted(f"precision/{p.name}" for p in (REPO / "configs" / "precision").glob("*.yaml"))
    assert fragments == sorted(expected)
    for fragment, (precision, fp8) in expected.items():
        config = parse_with(fragment)
        assert (config.trainer.precision, config.model.fp8) == (precision, fp8), fragment
    (plugin,) = parse_with("precision/fp8-te-fp32-master.yaml").trainer.plugins
    assert plugin.class_path == "lmledger.precision.TiedTransformerEnginePrecision"
    assert plugin.init_args.weights_dtype == "float32"
    for fragment, every in (("ac/every-block.yaml", 1), ("ac/every-2nd-block.yaml", 2)):
        assert parse_with(fragment).model.config.activation_checkpointing == every
    assert parse_with("compile/on.yaml").model.compile is True
    assert parse_with("compile/blocks.yaml").model.compile == "blocks"


# ----------------------------------------------------------------------------------------------
# Checks: one line, before anything is built


def fit_cli(*extra: str) -> int:
    return lmledger(["fit", "--config", "configs/tiny.yaml", *TINY_OVERRIDES, *extra])


def test_fp8_te_on_cpu_is_one_line_exit_2(workdir, capsys):
    capsys.readouterr()  # in this process, as test_fp8_on_cpu_through_the_cli_is_one_line: no start-up to pay
    assert lmledger(["fit", "--config", "configs/tiny.yaml", "--config", "configs/precision/fp8-te.yaml"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    assert "transformer_engine is not installed" in errors[0] and "on cpu" in errors[0] and "8.9" in errors[0]
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize(
    "fragment, names",
    [("fp8-torchao.yaml", ("torchao", "on cpu", "8.9")), ("fp8-te-fp32-master.yaml", ("Transformer Engine", "on cpu"))],
)
def test_fp8_on_cpu_through_the_cli_is_one_line(workdir, capsys, fragment, names):
    capsys.readouterr()
    assert fit_cli("--config", f"configs/precision/{fragment}") == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and all(name in lines[0] for name in names), err
    assert not (workdir / "runs").exists()


@pytest.fixture
def fp8_libraries(monkeypatch):
    """Pretend transformer_engine and torchao are installed (the checks only ask for their presence)."""
    monkeypatch.setattr(lightning_te, "_TRANSFORMER_ENGINE_AVAILABLE", True)
    monkeypatch.setattr(precision_module, "_TORCHAO_AVAILABLE", True)


@pytest.mark.parametrize("fp8, precision", [(None, "transformer-engine"), ("torchao", "bf16-mixed")])
def test_fp8_needs_sm89(fp8_libraries, fp8, precision):
    check_precision(precision, "gpu", fp8, capability=(9, 0))  # H100: fine
    check_precision(precision, "gpu", fp8, capability=(8, 9))  # L4 / RTX 4090: fine
    with pytest.raises(UserError, match=r"this GPU is sm_80, without fp8 tensor cores .*>= 8\.9") as err:
        check_precision(precision, "gpu", fp8, capability=(8, 0))  # A100
    assert "\n" not in str(err.value)


def test_fp8_names_the_missing_library(monkeypatch):
    monkeypatch.setattr(lightning_te, "_TRANSFORMER_ENGINE_AVAILABLE", False)
    monkeypatch.setattr(precision_module, "_TORCHAO_AVAILABLE", False)
    with pytest.raises(UserError, match=r"transformer_engine is not installed \(pip install 'lmledger\[fp8-te\]'\)\."):
        check_precision("transformer-engine-float16", "gpu", capability=(9, 0))
    with pytest.raises(UserError, match=r"torchao is not installed \(pip install 'lmledger\[fp8-ao\]'\)\."):
        check_precision("bf16-true", "gpu", "torchao", capability=(9, 0))
    with pytest.raises(UserError, match="torchao is not installed"):
        LitLM(TINY, fp8="torchao")  # direct use, without the CLI's check


def test_torchao_pairing_and_bf16_hardware(fp8_libraries):
    with pytest.raises(UserError, match="bf16-mixed or bf16-true"):
        check_precision("32-true", "gpu", "torchao", capability=(9, 0))
    with pytest.raises(UserError, match="two fp8 paths"):
        check_precision("transformer-engine", "gpu", "torchao", capability=(9, 0))
    with pytest.raises(UserError, match="unknown model.fp8 'te'"):
        check_precision("bf16-mixed", "gpu", "te", capability=(9, 0))
    with pytest.raises(UserError, match=r"bf16-true needs bfloat16 .* sm_70: use --trainer.precision 16-mixed"):
        check_precision("bf16-true", "gpu", capability=(7, 0))  # V100
    check_precision("16-mixed", "gpu", capability=(7, 0))
    check_precision("bf16-mixed", "cpu")  # CPU autocast runs bf16
    check_precision("bf16-mixed", "gpu", capability=(8, 0))


def test_te_plugin_spec_counts_as_fp8_and_conflicts_with_a_precision(fp8_libraries):
    spec = {
        "class_path": "lmledger.precision.TiedTransformerEnginePrecision",
        "init_args": {"weights_dtype": "float32"},
    }
    with pytest.raises(UserError, match="on cpu"):
        check_trainer_config({"precision": None, "accelerator": "cpu", "plugins": [spec]})
    with pytest.raises(UserError, match="set --trainer.precision null"):
        check_trainer_config({"precision": "32-true", "accelerator": "cpu", "plugins": [spec]})
    check_trainer_config({"precision": "32-true", "accelerator": "cpu", "plugins": None})
    # What the memory ledger is then asked for: 16 bytes per parameter with AdamW, not 8.
    assert requested_precision({"precision": None, "plugins": [spec]}) == ("transformer-engine", torch.float32)
    assert requested_precision({"precision": "bf16", "plugins": None}) == ("bf16-mixed", None)


# ----------------------------------------------------------------------------------------------
# Transformer Engine: tied weights stay tied (a stand-in te.Linear where TE is absent)


class StandInTELinear(nn.Module):
    """Shaped like te.Linear (not an nn.Linear subclass, as TE's is not): a weight (out, in)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@pytest.fixture
def transformer_engine(monkeypatch):
    """A stand-in transformer_engine package (te.Linear, te.LayerNorm, the recipe), in place of the
    real one even where it is installed: the real te.Linear wants a CUDA device."""
    te = types.ModuleType("transformer_engine.pytorch")
    te.Linear, te.LayerNorm, te.fp8_autocast = StandInTELinear, nn.LayerNorm, lambda **kwargs: nullcontext()
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.DelayedScaling = lambda **kwargs: types.SimpleNamespace(**kwargs)
    root, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    root.pytorch, root.common, common.recipe = te, common, recipe
    for module in (root, te, common, recipe):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(lightning_te, "_TRANSFORMER_ENGINE_AVAILABLE", True)
    return StandInTELinear


def test_te_conversion_keeps_the_embedding_tied(transformer_engine):
    torch.manual_seed(0)
    lit = LitLM(replace(TINY, tie_embeddings=True))
    reference = copy.deepcopy(lit.model).to(torch.bfloat16)
    (plugin,) = trainer_precision_kwargs("transformer-engine", "gpu")["plugins"]
    assert isinstance(plugin, TiedTransformerEnginePrecision) and plugin.weights_dtype == torch.bfloat16

    model = plugin.convert_module(lit).model
    assert isinstance(model.lm_head, transformer_engine)
    assert model.lm_head.weight is model.embed.weight
    assert all(isinstance(block.mlp.w1, transformer_engine) for block in model.blocks)
    assert model.num_parameters() == count_parameters(model.cfg)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)

    # The workaround is needed: Lightning's own plugin unties the head (a clone of the weight).
    untied = TransformerEnginePrecision(weights_dtype=torch.bfloat16).convert_module(
        LitLM(replace(TINY, tie_embeddings=True))
    )
    assert untied.model.lm_head.weight is not untied.model.embed.weight


def test_te_fp32_master_weights(transformer_engine):
    plugin = TiedTransformerEnginePrecision(weights_dtype="float32")
    assert plugin.fallback_compute_dtype == torch.bfloat16  # non-fp8 ops still run in bf16
    model = plugin.convert_module(LitLM(replace(TINY, tie_embeddings=True))).model
    n = model.num_parameters()
    assert n == count_parameters(model.cfg) and model.lm_head.weight is model.embed.weight
    predicted = state_bytes(n, "transformer-engine", weights_dtype=plugin.weights_dtype)
    assert measure_state_bytes(model)["params"] == predicted["params"] == 4 * n
    untied = plugin.convert_module(LitLM(TINY)).model  # nothing shared, nothing tied
    assert untied.lm_head.weight is not untied.embed.weight


# ----------------------------------------------------------------------------------------------
# torchao float8


def test_torchao_converts_eligible_linears_but_not_the_head():
    Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

    cfg = replace(TINY, d_ff=72, tie_embeddings=True)  # 72 is not a multiple of 16: the MLP stays
    model = LitLM(cfg, fp8="torchao").model
    block = model.blocks[0]
    assert isinstance(block.attn.qkv, Float8Linear) and isinstance(block.attn.out, Float8Linear)
    assert not any(isinstance(m, Float8Linear) for m in (block.mlp.w1, block.mlp.w2, block.mlp.w3, model.lm_head))
    assert model.lm_head.weight is model.embed.weight
    # torch 2.13 emulates fp8 matmuls on CPU, so a step runs here (CPU training refuses fp8 anyway).
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and block.attn.qkv.weight.grad is not None


# ----------------------------------------------------------------------------------------------
# Activation checkpointing: measured savings and recompute against the ledger


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_trades_memory_for_recompute(every):
    batch, seq = 4, TINY.context_length
    checkpointed_cfg = replace(TINY, activation_checkpointing=every)
    torch.manual_seed(0)
    plain = ToyLM(TINY).train()
    checkpointed = ToyLM(checkpointed_cfg).train()
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, TINY.vocab_size, (batch, seq))
    targets = torch.randint(0, TINY.vocab_size, (batch, seq))

    saved = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        with measure_saved_activations(model) as measured:
            loss = model(idx, targets)
        loss.backward()
        saved[name] = measured.activations
    predicted_saving = activation_bytes(TINY, batch, seq).total - activation_bytes(checkpointed_cfg, batch, seq).total
    measured_saving = saved["plain"] - saved["checkpointed"]
    assert predicted_saving > 0.2 * activation_bytes(TINY, batch, seq).total
    assert abs(measured_saving - predicted_saving) <= 0.02 * predicted_saving, (measured_saving, predicted_saving)

    predicted_recompute = (
        analytic_flops(checkpointed_cfg, batch, seq).hardware - analytic_flops(TINY, batch, seq).hardware
    )
    measured_recompute = measure_flops(checkpointed, idx, targets).total - measure_flops(plain, idx, targets).total
    assert predicted_recompute > 0
    assert abs(measured_recompute - predicted_recompute) <= 0.01 * predicted_recompute
    # Model FLOPs (the MFU convention) do not count the recompute.
    assert analytic_flops(checkpointed_cfg, batch, seq).model == analytic_flops(TINY, batch, seq).model


# ----------------------------------------------------------------------------------------------
# torch.compile


def check_compiled_run(lit: LitLM, trainer: L.Trainer) -> None:
    assert trainer.global_step == 3
    assert type(lit._forward).__name__ == "OptimizedModule" and isinstance(lit.model, ToyLM)
    # FLOPs are counted on the eager module the compiled one wraps.
    idx = torch.randint(0, lit.config.vocab_size, (2, 32))
    assert measure_flops(lit.model, idx).total == analytic_flops(lit.config, 2, 32).hardware
    # The compiled wrapper stays out of the module tree: a compiled run's weights load into an eager model.
    assert not any(key.startswith("_forward") for key in lit.state_dict())
    LitLM(lit.config).load_state_dict(lit.state_dict(), strict=True)


def test_compile_fit_graph_capture(stdlib_data, monkeypatch):
    """Dynamo + AOTAutograd around the fit (backend aot_eager: no inductor C++ build, so it is fast)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    trainer, lit, probe = fit_tiny(stdlib_data, "32-true", compile=True)
    check_compiled_run(lit, trainer)
    assert probe.measured == state_bytes(lit.model.num_parameters(), "32-true")


def test_compile_blocks_compiles_one_graph_for_every_block(stdlib_data, monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.manual_seed(0)
    trainer, lit, _ = fit_tiny(stdlib_data, "32-true", compile="blocks")
    assert trainer.global_step == 3 and lit._forward is lit.model and TINY.n_layers == 2
    assert all(block._compiled_call_impl is not None for block in lit.model.blocks)
    # Both blocks ran one compiled graph, traced and compiled once (a whole-model compile unrolls them all).
    assert counters["stats"]["unique_graphs"] == 1 and counters["aot_autograd"]["total"] == 1
    assert not any("_compiled" in key or "_orig_mod" in key for key in lit.state_dict())
    monkeypatch.undo()
    torch.manual_seed(0)
    _, eager, _ = fit_tiny(stdlib_data, "32-true")
    for name, weight in lit.model.state_dict().items():
        torch.testing.assert_close(weight, eager.model.state_dict()[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["true", "blocks"])
def test_compile_speedup_is_reported_and_training_goes_on_as_without_it(workdir, monkeypatch, mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    fit = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "4"]
    assert lmledger([*fit, "--model.compile", mode]) == 0
    # The probe's batch is laid out as training's: the graph it compiled and timed is the one training ran.
    assert counters["stats"]["unique_graphs"] == 1
    assert lmledger([*fit, "--model.compile", mode, "--ledger.enabled", "false"]) == 0
    probed, plain = read_scalars("runs/tiny/version_0"), read_scalars("runs/tiny/version_1")
    ((step, speedup),) = probed["perf/compile_speedup"]
    assert step == 0 and math.isfinite(speedup) and speedup > 0
    assert "perf/compile_speedup" not in plain
    # The probe's forward+backward passes moved no weight: training goes on exactly as without them.
    assert probed["train/loss"] == plain["train/loss"] and len(plain["train/loss"]) == 4


def test_compile_switch_parses_true_false_and_blocks(workdir):
    for value, expected in (("true", True), ("false", False), ("blocks", "blocks")):
        assert parse_with_args(["--model.compile", value]).model.compile == expected
    with pytest.raises(UserError, match="model.compile"):
        parse_with_args(["--model.compile", "layers"])


# Real inductor, in CI too: its first CPU build of this graph took 35 s on a shared 2-core machine
# (2026-11-30, empty inductor cache). It compiles C++, so it needs a compiler on PATH.
@pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")), reason="inductor on CPU needs a C++ compiler"
)
def test_compile_fit_with_inductor_on_cpu(stdlib_data):
    torch._dynamo.reset()
    trainer, lit, _ = fit_tiny(stdlib_data, "32-true", compile=True)
    check_compiled_run(lit, trainer)
