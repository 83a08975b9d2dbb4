"""`lmledger fit|validate` over any LightningModule (issue 12 §3): --model / --data class paths or a config
whose model: / data: name a class_path, with the ledger, run directories, checkpoints and exact resume."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import read_scalars
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `examples` lives at the repository root

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

CONVNET = "examples.byte_convnet.ByteConvNet"
TRAINER = [
    "--trainer.limit_val_batches", "0",
    "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip
SMALL = ["--data.init_args.batch_size", "2", "--data.init_args.context_length", "32", *TRAINER]
SMALL_CONVNET = ["--model.init_args.width", "32", "--model.init_args.num_layers", "1", *SMALL]


def convnet_fit(name: str, *extra: str) -> list[str]:
    return [
        "fit", "--config", "configs/examples/byte-convnet.yaml", *SMALL_CONVNET,
        "--trainer.logger.init_args.name", name, *extra,
    ]  # fmt: skip


def save_every(steps: int) -> list[str]:
    return ["--trainer.callbacks.init_args.every_n_train_steps", str(steps)]


def test_a_config_naming_classes_trains_with_the_ledger_and_saves_a_checkpoint(workdir):
    assert lmledger(convnet_fit("conv", "--trainer.max_steps", "3", *save_every(3))) == 0
    run = workdir / "runs" / "conv" / "version_0"
    assert (run / "config.yaml").is_file()
    assert open_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 3
    scalars = read_scalars(run)
    assert scalars["memory/measured/peak"][0][1] == pytest.approx(scalars["memory/predicted/peak"][0][1], rel=0.03)
    assert scalars["flops/measured_per_step"][0][1] == scalars["flops/hardware_per_step"][0][1]
    assert len(scalars["train/loss"]) == 3
    assert "perf/samples_per_sec" not in scalars  # token ids in the batch: tokens/s, never samples/s


def test_model_flag_alone_trains_on_lmledgers_token_data(workdir):
    args = ["fit", "--model", CONVNET, "--model.init_args.width", "16", "--model.init_args.num_layers", "1",
            "--trainer.max_steps", "2", "--trainer.logger.init_args.name", "flag", *SMALL]  # fmt: skip
    assert lmledger(args) == 0
    scalars = read_scalars(workdir / "runs" / "flag" / "version_0")
    assert [step for step, _ in scalars["train/loss"]] == [0, 1]
    assert "memory/predicted/params" in scalars


def test_hf_llama_config_through_lmledger_fit(workdir):
    pytest.importorskip("transformers")
    args = ["fit", "--config", "configs/examples/hf-llama.yaml", "--model.init_args.hidden_size", "32",
            "--model.init_args.num_layers", "1", "--model.init_args.context_length", "32",
            "--trainer.max_steps", "2", *SMALL]  # fmt: skip
    assert lmledger(args) == 0
    scalars = read_scalars(workdir / "runs" / "examples-hf-llama" / "version_0")
    assert scalars["memory/measured/activations"][0][1] == pytest.approx(
        scalars["memory/predicted/activations"][0][1], rel=0.01
    )


def test_preempted_any_model_run_resumes_bit_for_bit(workdir, capsys):
    steps = ["--trainer.max_steps", "6"]
    assert lmledger(convnet_fit("whole", *steps)) == 0
    term = '{"class_path": "test_preemption.SelfTerm", "init_args": {"at_step": 3}}'
    assert lmledger(convnet_fit("cut", *steps, "--trainer.callbacks+=" + term)) == 143
    assert "preempted at step" in capsys.readouterr().err
    assert lmledger(convnet_fit("cut", *steps, "--ckpt_path", "last")) == 0
    assert "resuming runs/cut/version_0 at step" in capsys.readouterr().out
    whole = dict(read_scalars(workdir / "runs/whole/version_0")["train/loss"])
    cut = dict(read_scalars(workdir / "runs/cut/version_0")["train/loss"])
    assert sorted(cut) == list(range(6)) and cut == whole  # exact float equality, every step once


def test_resume_refuses_another_class_or_other_settings_in_one_line(workdir, capsys):
    assert lmledger(convnet_fit("r", "--trainer.max_steps", "2", *save_every(2))) == 0
    capsys.readouterr()
    more = ["--trainer.max_steps", "4", "--ckpt_path", "last"]
    assert lmledger(convnet_fit("r", *more, "--model.init_args.kernel_size", "4")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.kernel_size: 8 in the checkpoint, 4 now" in err
    # validate on the same run builds the model from the checkpoint's class and arguments
    validate = ["validate", "--config", "configs/examples/byte-convnet.yaml", *SMALL, "--trainer.limit_val_batches",
                "2", "--trainer.logger.init_args.name", "r", "--ckpt_path", "last"]  # fmt: skip
    assert lmledger(validate) == 0
    assert "val/loss" in capsys.readouterr().out


class NotAModule:
    pass


class NoLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Embedding(256, 8)

    def training_step(self, batch, batch_idx):
        self.layer(batch[0]).sum()  # computes and forgets the loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TokenLoss(NoLoss):
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).mean(-1)  # not reduced to a scalar


class Strings(pl.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(["some text"] * 8, batch_size=2)


@pytest.mark.parametrize(
    ("model", "data", "expected"),
    [
        ("test_any_model_cli.NotAModule", None, "is a class that is not a LightningModule"),
        ("test_any_model_cli.nn", None, "is a module"),
        ("no_such_package.Model", None, "cannot import it"),
        (CONVNET, "test_any_model_cli.NoLoss", "is a class that is not a LightningDataModule"),
        ("test_any_model_cli.NoLoss", None, "training_step returned None on the first batch"),
        ("test_any_model_cli.TokenLoss", None, "training_step returned a tensor of shape (2, 32)"),
        ("test_any_model_cli.NoLoss", "test_any_model_cli.Strings", "first training batch is a list holding no tensor"),
    ],
)
def test_bad_modules_and_batches_are_one_line(workdir, capsys, model, data, expected):
    data_args = ["--data", data] if data else SMALL[:4]
    args = ["fit", "--model", model, *data_args, "--trainer.max_steps", "2", *TRAINER]
    assert lmledger(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lmledger fit: error:") and expected in err, err


def test_plain_litlm_config_is_untouched_by_subclass_mode(monkeypatch):
    from lmledger.fitting.checks import named_classes
    from lmledger.fitting.cli import parse_fit_config

    assert named_classes(["--config", "configs/tiny.yaml"]) == []
    monkeypatch.chdir(REPO)
    config = parse_fit_config(["--config", "configs/tiny.yaml"])
    assert config.model.config.d_model == 128 and "class_path" not in config.model
    config = parse_fit_config(["--config", "configs/examples/byte-convnet.yaml"])
    assert config.model.class_path == CONVNET and config.data.class_path == "lmledger.data.TokenDataModule"


def test_sweep_of_account_points_over_an_any_model_config(workdir, capsys):
    """Sweeps take configs naming a class_path: a --dry-run lists the points (no closed forms to show), and an
    `account --measure` grid runs each point's dry run beside its real step."""
    import csv

    import yaml

    from lmledger.sweep import load_experiment, run_sweep

    (workdir / "examples").symlink_to(REPO / "examples")  # points import it from their working directory
    spec = {
        "name": "conv",
        "command": "account --measure",
        "configs": ["configs/examples/byte-convnet.yaml"],
        "fixed": {"model.init_args.width": 16, "model.init_args.num_layers": 1, "data.init_args.context_length": 16},
        "grid": {"data.init_args.batch_size": [1, 3]},
    }
    path = workdir / "conv.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert lmledger(["sweep", str(path), "--dry-run", "--out", "sweeps/conv"]) == 0
    assert "fail:" not in capsys.readouterr().out
    # --plan prices each point's own dry run as account does (it said "not a toy-LM fit: not planned"): on an H100
    # under Transformer Engine, whatever the config's accelerator; its peak grows with the batch
    te = workdir / "conv-te.yaml"
    te.write_text(yaml.safe_dump({**spec, "fixed": {**spec["fixed"], "trainer.precision": "transformer-engine"}}))
    assert lmledger(["sweep", str(te), "--plan"]) == 0
    planned = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("batch_size=")]
    assert len(planned) == 2 and all(row[-2:] == ["on", "h100-sxm"] for row in planned), planned
    assert float(planned[1][2]) > float(planned[0][2]) > 0
    results = run_sweep(load_experiment(path), workdir / "sweeps" / "conv", jobs=1)
    assert [r.status for r in results] == ["done", "done"], [r.error for r in results]
    with open(workdir / "sweeps" / "conv" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        predicted, measured = float(row["memory/predicted/activations"]), float(row["memory/measured/activations"])
        assert predicted == pytest.approx(measured, rel=0.01)
    assert float(rows[1]["memory/measured/activations"]) > 2.5 * float(rows[0]["memory/measured/activations"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data", "lmledger.data.TokenDataModule"], "names a data module but no model: add --model CLASS_PATH"),
        (["--model", "ByteConvNet"], "name the class by its import path, package.module.Class"),
    ],
)
def test_a_data_module_alone_or_a_bare_class_name_is_one_line(workdir, capsys, args, expected):
    assert lmledger(["fit", *args, "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_an_example_config_run_from_elsewhere_names_where_its_package_is(tmp_path):
    """configs/examples/*.yaml name `examples.*`, which imports from the repository root only: from any other
    directory the one line says where the package is (a fresh process: this one has imported it already)."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-m", "lmledger.cli", "fit", "--config", str(repo / "configs/examples/hf-llama.yaml")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-1000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]
    assert f"examples is in {repo}: run from there, or add it to PYTHONPATH" in line, line
    assert not (tmp_path / "runs").exists()
