"""examples/: Hugging Face Llama and GPT-2 and a byte convnet; the dry run against the real step on each."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from conftest import read_scalars
from lmledger.ledger.dryrun.engine import StepLedger, dry_run, largest_batch, measure_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` lives at the repository root

from examples.byte_convnet import ByteConvNet  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

BATCH, SEQ = 4, 32
TINY_LLAMA = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, context_length=SEQ)
TINY_GPT2 = dict(hidden_size=64, num_layers=2, num_heads=4, context_length=SEQ)


def hf_examples():
    pytest.importorskip("transformers")
    from examples.hf_lm import GPT2LM, LlamaLM

    return {"llama": (LlamaLM, TINY_LLAMA), "gpt2": (GPT2LM, TINY_GPT2)}


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def module_loss(module, batch):
    return module.loss(batch)


def dry_and_measured(module, precision: str) -> tuple[StepLedger, StepLedger]:
    """The dry run on the module with the optimizer it configures, and the same step measured on a copy."""
    dry = dry_run(module, token_batch(), step=module_loss, optimizer=module.configure_optimizers(), precision=precision)
    real = copy.deepcopy(module)
    measured = measure_step(
        real, token_batch(), step=module_loss, optimizer=real.configure_optimizers(), precision=precision
    )
    return dry, measured


def assert_twins(dry, measured: StepLedger) -> None:
    """Issue 12's tolerances: params, grads, optimizer and FLOPs exact; activations +-1%; peak +-3%."""
    assert isinstance(dry, StepLedger), dry
    for name in ("params", "grads", "optimizer", "flops_forward", "flops_backward"):
        assert getattr(dry, name) == getattr(measured, name), name
    assert dry.activations == pytest.approx(measured.activations, rel=0.01)
    assert dry.autocast_weight_copies == pytest.approx(measured.autocast_weight_copies, rel=0.01)
    assert dry.peak == pytest.approx(measured.peak, rel=0.03)
    assert dry.peak_phase == measured.peak_phase


@pytest.mark.parametrize("checkpointing", [0, 1])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_dry_run_matches_the_real_step(arch, precision, checkpointing):
    cls, sizes = hf_examples()[arch]
    torch.manual_seed(0)
    module = cls(activation_checkpointing=checkpointing, **sizes)
    dry, measured = dry_and_measured(module, precision)
    assert_twins(dry, measured)
    n = sum(p.numel() for p in module.parameters())
    assert dry.params == 4 * n and dry.grads == 4 * n and dry.optimizer == 8 * n  # AdamW, fp32 master weights
    if checkpointing:  # a checkpointed layer saves only its input: far fewer activations than without
        plain_module = cls(**sizes)
        plain = dry_run(plain_module, token_batch(), step=module_loss, optimizer=plain_module.configure_optimizers())
        assert dry.activations < plain.activations / 2


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_flops_are_6n_plus_attention(attention):
    """Model FLOPs as in ledger/closedform/flops.py (PaLM appendix B): 6 N_matmul + 12 L H Q T per token, from the
    config.

    Hardware FLOPs add what the kernels redo: SDPA's fused backward recomputes the scores, one
    2 B L H Q T^2 more (ledger/closedform/flops.py); eager attention (matmul, softmax, matmul) redoes nothing."""
    cls, sizes = hf_examples()["llama"]
    module = cls(**sizes)
    module.model.config._attn_implementation = attention
    cfg = module.hf_config
    d, f, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = d // heads
    # q, k, v (grouped: kv_heads), o, and SwiGLU's three matrices
    per_layer = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d + 3 * d * f
    n_matmul = layers * per_layer + v * d  # + the LM head; the embedding is a lookup
    tokens = BATCH * SEQ
    model_flops = (6 * n_matmul + 12 * layers * heads * head_dim * SEQ) * tokens
    recompute = 2 * BATCH * layers * heads * head_dim * SEQ**2 if attention == "sdpa" else 0

    dry = dry_run(module, token_batch(), step=module_loss, optimizer=module.configure_optimizers())
    assert isinstance(dry, StepLedger), dry
    assert dry.flops_forward == model_flops // 3
    assert dry.flops == model_flops + recompute


def test_byte_convnet_dry_run_matches_the_real_step():
    torch.manual_seed(0)
    module = ByteConvNet(width=32, num_layers=2, kernel_size=4)
    dry, measured = dry_and_measured(module, "32-true")
    assert_twins(dry, measured)
    # Convolutions are counted: depthwise conv forward is 2 x tokens x width x kernel per layer.
    assert dry.flops_by_op["aten.convolution"] == 2 * 2 * BATCH * SEQ * 32 * 4


def test_largest_batch_of_an_hf_model_fits_and_the_next_does_not():
    """Issue 12: the largest batch the dry run predicts fits under the limit when measured on the real
    step, and one more sample does not."""
    cls, sizes = hf_examples()["llama"]
    torch.manual_seed(0)
    module = cls(**{**sizes, "num_layers": 1})
    capacity = 1_900_000  # bytes

    def meta_batch(size: int):
        return tuple(torch.empty(size, SEQ, dtype=torch.long, device="meta") for _ in range(2))

    found = largest_batch(module, meta_batch, capacity, step=module_loss, optimizer=module.configure_optimizers())
    assert 1 < found.size < 64 and found.fits.peak <= capacity < found.over.peak
    g = torch.Generator().manual_seed(0)
    for size, fits in ((found.size, True), (found.size + 1, False)):
        real = copy.deepcopy(module)
        batch = tuple(torch.randint(0, 256, (size, SEQ), generator=g) for _ in range(2))
        measured = measure_step(real, batch, step=module_loss, optimizer=real.configure_optimizers())
        assert (measured.peak <= capacity) == fits, (size, measured.peak)


# Each example config, shrunk, trained for two steps by `lmledger fit` with the Ledger callback: the configs
# are valid, and the ledger's predicted and measured peaks land.
SHRINK = {
    "hf-llama": ["--model.init_args.hidden_size", "32", "--model.init_args.num_layers", "1"],
    "hf-gpt2": ["--model.init_args.hidden_size", "32", "--model.init_args.num_layers", "1"],
    "byte-convnet": ["--model.init_args.width", "32", "--model.init_args.num_layers", "1"],
}


@pytest.mark.parametrize("name", sorted(SHRINK))
def test_example_configs_train_with_the_ledger(name, workdir):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    from lmledger.cli import main

    context = [] if name == "byte-convnet" else ["--model.init_args.context_length", "32"]
    code = main(
        ["fit", "--config", f"configs/examples/{name}.yaml", *SHRINK[name], *context,
         "--data.init_args.batch_size", "2", "--data.init_args.context_length", "32",
         "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    assert code == 0
    (run,) = (workdir / "runs" / f"examples-{name}").iterdir()
    assert (run / "config.yaml").is_file()
    scalars = read_scalars(run)
    predicted, measured = scalars["memory/predicted/peak"][0][1], scalars["memory/measured/peak"][0][1]
    assert measured == pytest.approx(predicted, rel=0.03)
    assert scalars["flops/measured_per_step"][0][1] == scalars["flops/hardware_per_step"][0][1]
