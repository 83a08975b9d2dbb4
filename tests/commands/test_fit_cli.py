"""`lmledger fit` / `validate` through the real CLI on the stdlib corpus."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from conftest import MICRO_OVERRIDES, TINY_OVERRIDES, read_scalars
from lmledger.cli import main as lmledger
from lmledger.lit import LitLM
from lmledger.model import ModelConfig


def fit(*extra: str) -> int:
    return lmledger(["fit", "--config", "configs/tiny.yaml", *TINY_OVERRIDES, *extra])


def test_fit_loss_drops_and_validate_reads_checkpoint(workdir, capsys):
    code = fit("--trainer.max_steps", "50", "--trainer.val_check_interval", "50", "--trainer.log_every_n_steps", "5")
    assert code == 0
    run = workdir / "runs" / "tiny" / "version_0"
    scalars = read_scalars(run)
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 10
    # Uniform over 256 bytes is ln 256 = 5.55; 50 steps of a byte LM on Python source get well below.
    assert losses[0] > 3.0 and losses[-1] < losses[0] - 1.0, losses
    for tag in ("train/lr", "train/grad_norm", "val/loss", "val/ppl"):
        assert tag in scalars, tag
    val_loss = scalars["val/loss"][-1][1]
    assert abs(scalars["val/ppl"][-1][1] - 2.718281828**val_loss) < 1e-3 * 2.718281828**val_loss

    # The resolved config is saved; the model's vocabulary came from the data's meta.json (a link
    # target, so it appears in hparams.yaml rather than config.yaml).
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["config"]["d_model"] == 64 and config["seed_everything"] == 1234
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["config"]["vocab_size"] == 256
    assert hparams["context_length"] == hparams["config"]["context_length"] == 64

    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    capsys.readouterr()
    assert lmledger(["validate", "--config", "configs/tiny.yaml", *TINY_OVERRIDES, "--ckpt_path", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "val/loss" in out
    # validate evaluates the same weights on the same windows as the fit's final validation
    reported = float(out.split("val/loss")[1].split()[1].strip("│"))
    assert abs(reported - val_loss) < 1e-4


def test_rerun_takes_a_new_version(workdir):
    assert fit("--trainer.max_steps", "2", "--trainer.limit_val_batches", "0") == 0
    first = (workdir / "runs/tiny/version_0/config.yaml").read_bytes()
    assert fit("--trainer.max_steps", "3", "--trainer.limit_val_batches", "0") == 0
    assert (workdir / "runs/tiny/version_1/config.yaml").is_file()
    assert (workdir / "runs/tiny/version_0/config.yaml").read_bytes() == first


def test_fit_under_ddp_destroys_its_process_group_at_the_end(workdir, restored_environ):
    """Left to interpreter exit, gloo's threads can abort a finished run (SIGABRT): fit destroys the group."""
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "1"]
    assert fit("--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--ledger.enabled", "false", *ddp) == 0
    assert (workdir / "runs/tiny/version_0/checkpoints/last.ckpt").is_file()
    assert torch.distributed.is_available() and not torch.distributed.is_initialized()


def test_resume_last_without_a_run_is_one_line(workdir, capsys):
    # In this process: the real CLI's refusals are test_bad_values' (its SUBPROCESS_CASES), a process's start-up here
    # was 5 CPU-s of this test's 5.4
    capsys.readouterr()
    assert lmledger(["fit", "--config", "configs/tiny.yaml", "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert "Traceback" not in err
    assert len(errors) == 1 and "no runs/tiny/version_*/checkpoints/last.ckpt" in errors[0]
    assert not (workdir / "runs").exists()


def test_val_loss_is_token_weighted_and_a_nan_batch_shows():
    lit = LitLM(ModelConfig(vocab_size=256, context_length=32, d_model=32, n_layers=1, n_heads=2, d_ff=64))
    for loss, tokens in ((2.0, 3), (1.0, 1)):
        lit.val_loss.update(torch.tensor(loss), weight=tokens)
    assert lit.val_loss.compute().item() == pytest.approx(1.75)
    lit.val_loss.reset()
    for loss, tokens in ((math.nan, 3), (1.0, 1)):
        lit.val_loss.update(torch.tensor(loss), weight=tokens)
    assert math.isnan(lit.val_loss.compute().item())  # not 1.0, the mean of the finite batch alone


def test_progress_bar_loss_is_the_training_loss_under_accumulation(stdlib_data):
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lmledger.data import TokenDataModule

    data = TokenDataModule(path=str(stdlib_data), batch_size=4, context_length=32)
    lit = LitLM(ModelConfig(vocab_size=data.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2, d_ff=64))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, accumulate_grad_batches=2, log_every_n_steps=2, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[TQDMProgressBar()],
    )  # fmt: skip
    trainer.fit(lit, data)
    # The bar shows the last micro-batch's loss as training_step returned it (Lightning's own outputs["loss"]
    # is divided by accumulate_grad_batches), as a host value.
    assert trainer.progress_bar_metrics["loss"] == pytest.approx(trainer.callback_metrics["train/loss"].item())


class WidenVersionWindow(pl.Callback):
    """Test-only: Lightning's TensorBoardLogger picks the next free version by listing the directory and creates
    it later; this waits in between (as a slow shared file system would), so two runs both see it free."""

    def __init__(self) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        pick = TensorBoardLogger._get_next_version

        def slow_pick(logger):
            version = pick(logger)
            time.sleep(3)
            return version

        TensorBoardLogger._get_next_version = slow_pick


def test_two_fits_started_together_get_their_own_versions(workdir):
    widen = '{"class_path": "test_fit_cli.WidenVersionWindow"}'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lmledger.cli", "fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES,
               "--trainer.max_steps", "2", "--trainer.logger.init_args.name", "race",
               "--trainer.callbacks+=" + widen]  # fmt: skip
    pipes = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    runs = [subprocess.Popen(command, env=env, **pipes) for _ in "ab"]
    results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    assert [code for code, _ in results] == [0, 0], [err[-1500:] for _, err in results]
    versions = sorted(p.name for p in (workdir / "runs/race").iterdir())
    assert versions == ["version_0", "version_1"]
    for version in versions:
        assert len(list((workdir / "runs/race" / version).glob("events.out.tfevents.*"))) == 1, version


def test_validate_writes_no_run_directory(workdir, capsys):
    assert lmledger(["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "2"]) == 0
    before = sorted(str(p) for p in workdir.rglob("*") if "data" not in p.parts)
    ckpt = "runs/tiny/version_0/checkpoints/last.ckpt"
    for path in (ckpt, "last"):
        validate = ["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.limit_val_batches", "2"]
        assert lmledger([*validate, "--ckpt_path", path]) == 0
        assert "val/loss" in capsys.readouterr().out
    assert sorted(str(p) for p in workdir.rglob("*") if "data" not in p.parts) == before
    # Given a place to log (as `lmledger sweep` gives each point), it logs the validation there, and only that.
    assert lmledger([*validate, "--ckpt_path", ckpt, "--trainer.logger.init_args.save_dir", "evals"]) == 0
    (run,) = (workdir / "evals/tiny").iterdir()
    # lmledger.lock: the run lock (runlock.RUN_LOCK), a file the kernel's flock is taken on, left in place.
    names = sorted(p.name.split(".")[0] for p in run.iterdir())
    assert run.name == "version_0" and names == ["events", "hparams", "lmledger"]
    assert "val/loss" in read_scalars(run)


def test_the_cli_builds_the_parser_of_the_subcommand_it_runs_alone(workdir):
    """FitCLI.subcommands: `fit` builds fit's parser, not validate's, test's and predict's too (LightningCLI's
    default, read here from its private `_subcommand_parsers`); the config parses as before."""
    from lmledger.fitting.cli import FitCLI, _run_cli

    class Parsed(Exception):
        pass

    class StopAfterParsing(FitCLI):
        def before_instantiate_classes(self) -> None:
            raise Parsed(self)

    with pytest.raises(Parsed) as parsed:
        _run_cli(StopAfterParsing, ["fit", "--config", "configs/tiny.yaml", "--model.config.n_layers", "3"], run=True)
    cli = parsed.value.args[0]
    assert list(cli._subcommand_parsers) == ["fit"]
    assert cli.config.subcommand == "fit" and cli.config.fit.model.config.n_layers == 3
