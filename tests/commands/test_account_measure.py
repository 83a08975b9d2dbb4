"""`account --measure` and `fit` measure one step the same way (issue 33 §2): account runs the dry run's
measured twin (dryrun.measure_step) on the config's ToyLM, the fit's Ledger reads the Lightning step."""

from pathlib import Path

import pytest

from conftest import MICRO_OVERRIDES, figures_of, read_scalars, run_json
from lmledger.cli import main as lmledger
from lmledger.ledger.units import MEMORY_ROWS


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_account_and_fit_show_the_same_predicted_and_measured_bytes(workdir, capsys, precision):
    """account's columns are fit's (issue 33 §2): the dry run first, the closed forms beside it, the measured step."""
    config = ["--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.precision", precision]
    account = run_json(capsys, "account", *config, "--measure", "--json")
    fit = [*config, "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", "runs"]
    assert lmledger(["fit", *fit, "--trainer.callbacks", "[]"]) == 0
    scalars = read_scalars(next(Path("runs").rglob("events.out.tfevents.*")).parent)
    measured = figures_of(account, "measured")
    for row in MEMORY_ROWS[:-1]:  # params, grads, optimizer, activations: bytes, exact
        assert measured[row] > 0 and scalars[f"memory/measured/{row}"][-1][1] == measured[row], row
    # The peak: the fit's real Lightning step also keeps LitLM's loss (`_last_loss`), its grad norm and the
    # logged scalars through the step, 4 bytes each (8-16 B here); the model's own step is the same.
    assert 0 <= scalars["memory/measured/peak"][-1][1] - measured["peak"] <= 32
    assert scalars["flops/measured_per_step"][-1][1] == pytest.approx(account["flops"]["measured"], rel=1e-6)
    # Before step 1: fit's dry run of LitLM's step and its closed forms, at fit start; the same rows, the
    # same FLOPs. The dry-run peak differs only by what LitLM's step keeps (its loss, 4 B).
    assert account["sources"]["predicted"] == "dry run" and account["sources"]["closed_form"] == "closed form"
    for source in ("predicted", "closed_form"):
        figures = figures_of(account, source)
        for row in MEMORY_ROWS[:-1]:
            assert scalars[f"memory/{source}/{row}"][0][1] == figures[row], (source, row)
        assert 0 <= scalars[f"memory/{source}/peak"][0][1] - figures["peak"] <= 32, source
    for kind in ("hardware", "model", "closed_form"):
        assert scalars[f"flops/{kind}_per_step"][0][1] == account["flops"][kind], kind


# GPT-2 / Megatron GPT's options, and Llama's grouped-query attention with a GeLU MLP and biases (model.ModelConfig)
GPT = {"mlp": "gelu", "norm": "layer", "positions": "learned", "bias": True}
GQA = {"n_heads": 4, "n_kv_heads": 2, "mlp": "gelu", "bias": True}


@pytest.mark.parametrize(
    "precision, arch", [("32-true", {}), ("bf16-true", {}), ("32-true", GPT), ("bf16-true", GQA)],
    ids=["32-true", "bf16-true", "32-true-gpt", "bf16-true-gqa"],
)  # fmt: skip
def test_the_toy_dry_run_is_account_measures_twin_byte_for_byte(precision, arch):
    """predict.toy_dry_run (the dry run account can show as its main column, issue 33 §2) predicts exactly
    what predict.measure (account --measure) then measures: every byte line, its phase and the FLOPs. So for
    the architecture options, where the closed forms' activations and peak are absent."""
    from lmledger.ledger.predict import measure, toy_dry_run
    from lmledger.ledger.run import Run
    from lmledger.model import ModelConfig

    shape = {"vocab_size": 256, "context_length": 16, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
    config = ModelConfig(**{**shape, **arch})
    run = Run(config, batch_size=2, seq_len=16, precision=precision)
    dry, real = toy_dry_run(run), measure(run)
    for row in ("params", "grads", "optimizer", "activations", "autocast_weight_copies", "peak", "peak_phase"):
        assert getattr(dry, row) == getattr(real, row), row
    assert dry.flops == real.flops > 0 and dry.peak > dry.params + dry.grads + dry.optimizer
