"""`lmledger account` and `lmledger plan max-batch`: fit configs read without building anything, and
one real step measured beside the prediction."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import figures_of, run_json
from lmledger.cli import main as lmledger
from lmledger.ledger.closedform.peak import peak_bytes
from lmledger.run_config import load_run

SMALL = ["--model.config.d_model", "96", "--model.config.n_layers", "2", "--model.config.n_heads", "4",
         "--model.config.d_ff", "200", "--model.config.context_length", "48", "--data.batch_size", "3"]  # fmt: skip


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_account_measure_matches_prediction(workdir, capsys, precision):
    result = run_json(
        capsys, "account", "--config", "configs/tiny.yaml", *SMALL, "--trainer.precision", precision,
        "--measure", "--json",
    )  # fmt: skip
    assert result["run"]["vocab_size"] == 256 and result["run"]["vocab_from_data"]
    from lmledger.model import count_parameters

    assert result["params"] == count_parameters(load_run(["--config", "configs/tiny.yaml", *SMALL]).config)
    flops = result["flops"]
    assert abs(flops["hardware"] - flops["measured"]) <= 0.005 * flops["measured"]
    assert flops["model"] < flops["hardware"]  # the attention backward's score recompute
    predicted, measured = figures_of(result, "predicted"), figures_of(result, "measured")
    for row in ("params", "grads", "optimizer"):
        assert predicted[row] == measured[row], row
    assert abs(predicted["activations"] - measured["activations"]) <= 0.03 * measured["activations"]
    # CPU: live tensor bytes over a steady step (ledger.count.memtrack), where the prediction says
    assert abs(predicted["peak"] - measured["peak"]) <= 0.02 * measured["peak"]
    assert result["run"]["measured_peak_phase"] == {"embedding backward": "backward"}.get(
        result["run"]["peak_phase"], result["run"]["peak_phase"]
    )
    state_bytes = sum(measured[row] for row in ("params", "grads", "optimizer"))
    bytes_per_param = state_bytes / result["params"]
    assert bytes_per_param == pytest.approx(8 if precision == "bf16-true" else 16)
    assert result["state_bytes_per_param"]["measured"] == pytest.approx(bytes_per_param)


def test_account_without_measure_sizes_a_3b_config_instantly(workdir, capsys):
    result = run_json(capsys, "account", "--config", "configs/cs336-2.7b.yaml", "--json")
    assert result["params"] > 3e9
    assert result["flops"]["measured"] is None and result["sources"]["measured"] is None
    assert all(value is None for value in figures_of(result, "measured").values())
    # 6N per token is most of the model FLOPs of a 3B model at ctx 1024
    n = result["params"]
    assert 6 * n * 4 * 1024 < result["flops"]["model"] < 1.1 * 6 * n * 4 * 1024


def test_plan_max_batch_is_the_largest_that_fits(workdir, capsys):
    result = run_json(
        capsys, "plan", "max-batch", "--config", "configs/cs336-small.yaml", "--gpu", "h100-sxm", "--json"
    )
    spec = load_run(["--config", "configs/cs336-small.yaml"])
    best = result["max_batch"]
    assert best > 1

    def peak(b: int) -> int:
        return peak_bytes(spec.config, b, spec.seq_len, spec.precision, spec.optimizer, device="cuda").total

    assert peak(best) <= result["capacity_bytes"] < peak(best + 1)
    checkpointed = run_json(
        capsys, "plan", "max-batch", "--config", "configs/cs336-small.yaml", "--gpu", "h100-sxm",
        "--model.config.activation_checkpointing", "1", "--json",
    )  # fmt: skip
    assert checkpointed["max_batch"] > 2 * best  # recompute trades FLOPs for a much larger batch


@pytest.mark.parametrize(
    "argv, message",
    [
        (["account"], "needs --config"),
        (["account", "--config", "configs/tiny.yaml", "--model.config.nope", "1"], "nope"),
        (
            ["account", "--config", "configs/tiny.yaml", "--trainer.precision", "64-true", "--measure"],
            "--measure supports",
        ),
        (["plan", "max-batch", "--config", "configs/tiny.yaml", "--gpu", "no-such-gpu"], "no-such-gpu"),
    ],
)
def test_bad_input_is_one_line(workdir, capsys, argv, message):
    capsys.readouterr()
    assert lmledger(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("stage", [2, 3])
def test_account_follows_deepspeed_for_a_deepspeed_strategy(workdir, capsys, stage):
    result = run_json(
        capsys, "account", "--config", "configs/cs336-xl.yaml", "--trainer.strategy", f"deepspeed_stage_{stage}",
        "--trainer.devices", "8", "--trainer.precision", "bf16-mixed", "--json",
    )  # fmt: skip
    assert result["run"]["strategy"] == f"deepspeed_stage_{stage}" and result["run"]["world_size"] == 8
    n = result["params"]
    state = sum(result["memory"][row]["predicted"] for row in ("params", "grads", "optimizer"))
    # DeepSpeed's estimators: 2N + 18N/8 (ZeRO-2), 18N/8 + 4 x the largest layer (ZeRO-3: the
    # 10,000 x 1,600 embedding, above the 6,400 x 1,600 MLP matrices); its bf16 mode has no
    # autocast, so no weight copies
    largest = 10_000 * 1_600 if stage == 3 else 0
    expected = (2 * n if stage == 2 else 0) + 18 * -(-n // 8) + 4 * largest
    assert state == expected
    assert result["memory"]["autocast_weight_copies"]["predicted"] == 0
    # the GPU step: ZeRO-3 as FSDP's sharded layout; ZeRO-2 as DDP's, and the note says so
    step = result["time"]["predicted"]
    assert step["layout"]["sharding"] == ("fsdp" if stage == 3 else "ddp")
    assert any("deepspeed_stage_2 priced as ddp" in note for note in step["notes"]) == (stage == 2)


def test_account_measures_a_checkpointed_bf16_mixed_step_as_lightning_runs_it(workdir, capsys):
    # Lightning's autocast keeps no weight cache: a checkpointed block's casts die with its forward
    result = run_json(
        capsys, "account", "--config", "configs/tiny.yaml", *SMALL, "--trainer.precision", "bf16-mixed",
        "--model.config.activation_checkpointing", "1", "--measure", "--json",
    )  # fmt: skip
    peak = result["memory"]["peak"]  # {source: bytes}: the dry run, the closed forms, the measured step
    assert result["sources"]["predicted"] == "dry run"
    for source in ("predicted", "closed_form"):
        assert abs(peak[source] - peak["measured"]) <= 0.02 * peak["measured"], source


# Any LightningModule (issue 12 §3): a config whose model is a class_path, here the examples' Hugging Face
# Llama, shrunk. account and plan max-batch dry-run its training_step on its data's first batch.
HF_LLAMA = [
    "--config", "configs/examples/hf-llama.yaml", "--model.init_args.hidden_size", "64",
    "--model.init_args.num_layers", "1", "--model.init_args.intermediate_size", "128",
    "--model.init_args.context_length", "32", "--data.init_args.context_length", "32",
]  # fmt: skip


@pytest.fixture
def examples_importable(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # `examples` is at the repository root


def test_account_of_an_hf_config_puts_the_dry_run_beside_the_real_step(workdir, capsys, examples_importable):
    result = run_json(capsys, "account", *HF_LLAMA, "--data.init_args.batch_size", "3", "--measure", "--json")
    assert result["run"]["model"] == "examples.hf_lm.LlamaLM" and result["run"]["tokens_per_step"] == 3 * 32
    flops = result["flops"]
    assert flops["model"] is None and flops["hardware"] == flops["measured"]
    predicted, measured = figures_of(result, "predicted"), figures_of(result, "measured")
    assert result["sources"] == {"predicted": "dry run", "measured": "measured"}
    for row in ("params", "grads", "optimizer"):
        assert predicted[row] == measured[row] > 0, row
    assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.01)
    assert predicted["peak"] == pytest.approx(measured["peak"], rel=0.03)
    assert result["params"] * 4 == predicted["params"]  # fp32, no tied weights in Llama


@pytest.mark.parametrize("flag", ["--ledger.device_memory_gb", "--device-memory-gb"])
def test_plan_max_batch_of_an_hf_model_fits_under_the_cap_measured(workdir, capsys, examples_importable, flag):
    """Issue 12: under --ledger.device_memory_gb X on a CPU, the measured peak (ledger.count.memtrack on the real step)
    of the predicted largest batch fits under X, and one more sample's does not."""
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger.predict import measure_module as measure

    capacity_gb = 0.0035
    result = run_json(capsys, "plan", "max-batch", *HF_LLAMA, flag, str(capacity_gb), "--json")
    best = result["max_batch"]
    assert 2 <= best < 64 and result["peak_bytes"] <= capacity_gb * 1e9 < result["next_peak_bytes"]
    module, data, _ = build_model_and_data([*HF_LLAMA, "--data.init_args.batch_size", str(best + 1)])
    inputs, targets = first_batch(data)
    for size, fits in ((best, True), (best + 1, False)):
        measured = measure(module, (inputs[:size], targets[:size]))
        assert (measured.peak <= capacity_gb * 1e9) == fits, (size, measured.peak)


def test_account_predicts_and_measures_every_micro_batch_of_an_accumulated_step(workdir):
    """accumulate_grad_batches 2, as fit's Ledger takes it: the dry run (the main column) and the real step both
    run two micro-batches, so FLOPs double; activations stay one micro-batch's; the closed forms have no peak."""
    from lmledger.accounting import account

    one_argv = ["--config", "configs/tiny.yaml", *SMALL]
    two_argv = [*one_argv, "--trainer.accumulate_grad_batches", "2"]
    one = account(load_run(one_argv), False, one_argv)
    two = account(load_run(two_argv), True, two_argv)
    assert list(two["predictors"]) == ["dry run", "closed form"] and two["accumulate"] == 2
    dry, closed, measured = two["predictors"]["dry run"], two["predictors"]["closed form"], two["measured"]
    assert dry.flops_hardware == 2 * one["flops"]["hardware"] and closed.flops_hardware == dry.flops_hardware
    assert dry.activations == one["memory"]["activations"]["predicted"]
    assert closed.peak is None and "micro-batch" in closed.why_missing["peak"]
    assert measured.flops_hardware == pytest.approx(dry.flops_hardware, rel=0.005)
    for row in ("params", "grads", "optimizer"):
        assert measured.get(row) == dry.get(row), row
    assert measured.peak == pytest.approx(dry.peak, rel=0.02)


def test_the_clipping_a_step_is_priced_with_is_the_one_lightning_runs():
    """Lightning reads the algorithm's name in any case (`Value` clips by value); the prediction read it as written."""
    from lmledger.accounting.steptime import trainer_time_settings

    def clip(*flags):
        return trainer_time_settings(["--config", "configs/tiny.yaml", *flags])["clip"]

    assert clip() == ("norm", 1.0)  # tiny.yaml clips at 1.0, by norm when no algorithm is named
    assert clip("--trainer.gradient_clip_algorithm", "Value") == ("value", 1.0)
    assert clip("--trainer.gradient_clip_algorithm", "NORM", "--trainer.gradient_clip_val", "0.5") == ("norm", 0.5)
    assert clip("--trainer.gradient_clip_val", "0") is None


def test_a_module_stepping_two_optimizers_by_hand_is_planned_as_its_fit_runs_it(workdir, capsys):
    """Manual optimization with two optimizers: account, plan max-batch and plan layout dry-run the module's own
    training_step, as the fit's Ledger does (they refused 'returns 2 optimizers' before); --measure, which runs
    Lightning's automatic step, refuses it in one line."""
    from manual_lm import TwoOptimizerLM

    Path("manual.yaml").write_text(
        "model: {class_path: manual_lm.TwoOptimizerLM}\n"
        "data: {class_path: lmledger.data.TokenDataModule, init_args: {path: data/stdlib, batch_size: 2, "
        "context_length: 32, val_batches: 1}}\n"
        "trainer: {accelerator: cpu, max_steps: 10, max_epochs: 1}\n"
    )
    config = ["--config", "manual.yaml"]
    result = run_json(capsys, "account", *config, "--gpu", "h100-sxm", "--json")
    predicted = figures_of(result, "predicted")
    module = TwoOptimizerLM()
    ends = sum(p.numel() for m in (module.embed, module.head) for p in m.parameters())
    blocks = sum(p.numel() for p in module.blocks.parameters())
    assert predicted["params"] == predicted["grads"] == 4 * (ends + blocks)
    assert predicted["optimizer"] == 4 * (2 * ends + blocks)  # AdamW's two moments, SGD's momentum buffer
    step = result["time"]["predicted"]
    assert step["priced_on"] == "h100-sxm" and step["seconds"]["optimizer"] > 0 and step["seconds"]["matmul"] > 0
    batch = run_json(capsys, "plan", "max-batch", *config, "--ledger.device_memory_gb", "0.002", "--json")
    assert batch["max_batch"] > 2
    layouts = run_json(capsys, "plan", "layout", *config, "--gpu", "h100-sxm", "--num-gpus", "2", "--json")
    assert layouts["ranked"] and all("peak_bytes" in r for r in layouts["ranked"])
    # Lightning's fsdp is dry-run without manual optimization: dropped with why, not ranked without a peak
    assert {r["sharding"] for r in layouts["ranked"]} == {"ddp"}
    assert all("manual optimization" in r["dropped"] for r in layouts["dropped"] if r["sharding"] == "fsdp")
    capsys.readouterr()
    assert lmledger(["account", *config, "--measure"]) == 2
    assert "steps its optimizers itself" in capsys.readouterr().err
    # Lightning's accumulation and clipping, which it refuses for such a module as the fit starts: every command
    # refuses them in the same words (account had planned two micro-batches a step that no fit would run)
    for flag, value in (("--trainer.accumulate_grad_batches", "2"), ("--trainer.gradient_clip_val", "1.0")):
        said = []
        for words in (["fit"], ["account"], ["plan", "max-batch", "--gpu", "h100-sxm"]):
            assert lmledger([*words, *config, flag, value]) == 2
            said.append(capsys.readouterr().err.strip().split(": error: ", 1)[1])
        assert said[0] == said[1] == said[2] and said[0].startswith(f"{flag} {value}: TwoOptimizerLM steps its")
    assert not Path("runs").exists()  # the fit refused before claiming a run directory
