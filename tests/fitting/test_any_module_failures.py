"""Issue 23 §1 and §4: a checkpoint may not choose the code that runs, and the any-model paths' bad input is
one line, exit 2, with nothing written (docs/reliability.md, "Round 3").

Bad inputs go through `lmledger.cli.main` in-process, as in test_fit_failures.py. Modules with import-time
side effects are written into the test's working directory, which the CLI puts on sys.path, each under a
name of its own so that no earlier test has imported it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import textwrap
import uuid
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import MICRO_OVERRIDES
from lmledger import atomic
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `examples` lives at the repository root

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

CONVNET = "examples.byte_convnet.ByteConvNet"
SEED_LINE = re.compile(r"^Seed set to \d+$")
QUIET = [
    "--trainer.limit_val_batches", "0",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip
SMALL_DATA = ["--data.init_args.batch_size", "2", "--data.init_args.context_length", "16"]
SMALL_CONVNET = ["--model.init_args.width", "16", "--model.init_args.num_layers", "1"]


def one_error_line(capsys, command: str = "fit") -> str:
    """The single line on stderr (Lightning's `Seed set to N` and its warnings before a fit aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not SEED_LINE.match(line)]
    mine = [line for line in lines if line.startswith("lmledger ")]
    assert len(mine) == 1 and mine[0] == lines[-1], err
    assert mine[0].startswith(f"lmledger {command}: error: "), mine[0]
    return mine[0]


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def write_module(directory: Path, stem: str, source: str) -> str:
    """A module named stem_<random> in `directory`; returns its name."""
    name = f"{stem}_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return name


# A module whose import leaves a file behind: the evidence that it ran.
SIDE_EFFECT = """
    import pathlib

    pathlib.Path(__file__).with_suffix(".imported").write_text("imported")

    import lightning.pytorch as pl
    import torch


    class Other(pl.LightningModule):
        def __init__(self, **kwargs):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)


    def act(x):
        return x
"""


def fake_checkpoint(path: Path, hparams: dict) -> Path:
    torch.save({"state_dict": {}, "global_step": 0, "hyper_parameters": hparams}, path)
    return path


# ------------------------------------------------------------------- §1 a checkpoint picks the class


@pytest.mark.parametrize("command", ["validate", "fit"])
def test_a_checkpoints_class_path_is_refused_before_it_is_imported(workdir, capsys, command):
    module = write_module(workdir, "sidefx", SIDE_EFFECT)
    ckpt = fake_checkpoint(workdir / "other.ckpt", {"_class_path": f"{module}.Other", "width": 16})
    before = files_under(workdir)
    args = [command, "--model", CONVNET, *SMALL_CONVNET, *SMALL_DATA, *QUIET, "--ckpt_path", str(ckpt)]
    assert lmledger([*args, "--trainer.max_steps", "2"]) == 2
    line = one_error_line(capsys, command)
    assert f"saved from class '{module}.Other', but this command builds {CONVNET}" in line, line
    assert "refused before importing it" in line
    assert not (workdir / f"{module}.imported").exists()  # the module never ran
    assert module not in sys.modules
    assert files_under(workdir) == before


def test_a_class_path_into_the_standard_library_imports_nothing(workdir, capsys):
    # `import this` prints the Zen of Python: the proof that the checkpoint's module was imported.
    ckpt = fake_checkpoint(workdir / "zen.ckpt", {"_class_path": "this.Nothing"})
    had_this = "this" in sys.modules
    assert lmledger(["validate", "--model", CONVNET, "--ckpt_path", str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert "Beautiful is better than ugly" not in captured.out + captured.err
    assert ("this" in sys.modules) == had_this
    line = [x for x in captured.err.splitlines() if x.startswith("lmledger ")]
    assert len(line) == 1 and "saved from class 'this.Nothing'" in line[0], captured.err


def test_a_litlm_run_refuses_a_checkpoint_of_another_class(workdir, capsys):
    module = write_module(workdir, "sidefx", SIDE_EFFECT)
    ckpt = fake_checkpoint(workdir / "other.ckpt", {"_class_path": f"{module}.Other"})
    assert lmledger(["validate", "--config", "configs/tiny.yaml", "--ckpt_path", str(ckpt)]) == 2
    line = one_error_line(capsys, "validate")
    assert f"saved from class '{module}.Other', but this command builds lmledger.lit.LitLM" in line, line
    assert not (workdir / f"{module}.imported").exists()


# A module with a callable-typed argument: jsonargparse imports whatever dotted path it is given.
WITH_CALLABLE = """
    from typing import Callable

    import lightning.pytorch as pl
    import torch


    class WithAct(pl.LightningModule):
        def __init__(self, act: Callable = torch.tanh, width: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Embedding(256, width)
"""


def test_an_import_path_among_a_checkpoints_hyperparameters_is_refused_before_import(workdir, capsys):
    module = write_module(workdir, "sidefx", SIDE_EFFECT)
    model = write_module(workdir, "withact", WITH_CALLABLE)
    ckpt = fake_checkpoint(workdir / "act.ckpt", {"_class_path": f"{model}.WithAct", "act": f"{module}.act"})
    assert lmledger(["validate", "--model", f"{model}.WithAct", "--ckpt_path", str(ckpt)]) == 2
    line = one_error_line(capsys, "validate")
    assert f"sets model act to '{module}.act', an import path this command does not name" in line, line
    assert not (workdir / f"{module}.imported").exists()
    # The class's own default, saved as its import path, is no foreign code: the check lets it through
    # (this checkpoint then fails for holding no weights, a later check).
    same = fake_checkpoint(workdir / "same.ckpt", {"_class_path": f"{model}.WithAct", "act": "torch.tanh"})
    assert lmledger(["validate", "--model", f"{model}.WithAct", "--ckpt_path", str(same)]) == 2
    assert "does not fit this model" in one_error_line(capsys, "validate")


# ------------------------------------------------------------------- §4 one line, exit 2, nothing written


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data.init_args.batch_size", "0"], "lmledger fit: error: data.batch_size must be >= 1, got 0"),
        (["--data.init_args.path", "nowhere"], "lmledger fit: error: data dir nowhere does not exist: run"),
    ],
)
def test_data_module_arguments_in_class_path_mode_are_one_line(workdir, capsys, args, expected):
    before = files_under(workdir)
    assert lmledger(["fit", "--model", CONVNET, *SMALL_CONVNET, *QUIET, *args]) == 2
    assert one_error_line(capsys).startswith(expected)
    assert files_under(workdir) == before


def test_the_convnet_example_before_prepare_says_to_prepare(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    assert lmledger(["fit", "--config", "configs/examples/byte-convnet.yaml"]) == 2
    line = one_error_line(capsys)
    assert line == "lmledger fit: error: data dir data/stdlib does not exist: run `lmledger prepare --out data/stdlib`"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


RAISES = """
    import lightning.pytorch as pl


    class Raises(pl.LightningModule):
        def __init__(self, width: int = 3):
            super().__init__()
            raise ValueError(f"width must be even,\\n got {width}")
"""


@pytest.mark.parametrize("command", ["fit", "account"])
def test_a_module_whose_init_raises_is_one_line(workdir, capsys, command):
    module = write_module(workdir, "raises", RAISES)
    before = files_under(workdir)
    assert lmledger([command, "--model", f"{module}.Raises", *SMALL_DATA]) == 2
    line = one_error_line(capsys, command)
    assert line == f"lmledger {command}: error: building {module}.Raises failed (ValueError: width must be even, got 3)"
    assert files_under(workdir) == before


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 4)
        self.other = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.other(self.embed(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(Tiny):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.embed.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]


class NoBatches(pl.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 8, dtype=torch.long)))


class NoParameters(pl.LightningModule):
    """Issue 49 §3: a module with nothing to train, whose configure_optimizers is the usual one line."""

    def training_step(self, batch, batch_idx):
        return batch[0].float().mean().requires_grad_()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("words", [["fit"], ["account"], ["plan", "max-batch", "--gpu", "h100-sxm"]])
def test_a_module_with_no_parameters_is_one_line_naming_it(workdir, capsys, words):
    """fit ended in torch's traceback ("optimizer got an empty parameter list"); account and plan reach the same
    call in their dry run."""
    before = files_under(workdir)
    args = [*words, "--model", f"{__name__}.NoParameters", *SMALL_DATA, *QUIET, "--trainer.max_steps", "2"]
    assert lmledger(args) == 2
    line = one_error_line(capsys, words[0])
    assert line.endswith(
        "NoParameters.configure_optimizers builds an optimizer over no parameters (torch: optimizer got an empty "
        "parameter list): NoParameters holds no parameters (no layer with weights, no nn.Parameter); give the module "
        "something to train, or return None from configure_optimizers"
    ), line
    assert files_under(workdir) == before and not (workdir / "runs").exists()


def test_two_optimizers_under_automatic_optimization_are_one_line(workdir, capsys):
    args = ["fit", "--model", f"{__name__}.TwoOptimizers", *SMALL_DATA, *QUIET, "--trainer.max_steps", "2"]
    assert lmledger(args) == 2
    line = one_error_line(capsys)
    assert "TwoOptimizers.configure_optimizers returns 2 optimizers, which Lightning steps only under manual" in line
    assert "self.automatic_optimization = False" in line
    assert not (workdir / "runs").exists()


def test_a_data_module_without_batches_is_refused(workdir, capsys):
    before = files_under(workdir)
    args = ["fit", "--model", f"{__name__}.Tiny", "--data", f"{__name__}.NoBatches", *QUIET, "--trainer.max_steps", "2"]
    assert lmledger(args) == 2
    assert "NoBatches.train_dataloader() yields no batch" in one_error_line(capsys)
    # Refused when Lightning asks for the loader, inside fit: the run directory claimed by then is undone.
    assert files_under(workdir) == before and not (workdir / "runs").exists()


@pytest.mark.parametrize("flag", ["--trainer.max_steps", "--trainer.max_epochs"])
def test_a_fit_of_no_steps_is_refused(workdir, capsys, flag):
    extra = ["--trainer.max_steps", "-1"] if flag == "--trainer.max_epochs" else []
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *extra, flag, "0"]
    assert lmledger(args) == 2
    assert one_error_line(capsys).startswith(f"lmledger fit: error: {flag} 0 trains nothing")
    assert not (workdir / "runs").exists()


def test_a_read_only_runs_directory_is_one_line(workdir, capsys, monkeypatch):
    # As root (CI containers) a mode-0555 directory is still writable, so the file system's refusal is
    # made here: every mkdir below ro-runs fails as on a read-only mount.
    (workdir / "ro-runs").mkdir()
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if "ro-runs" in os.fspath(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "1"]
    assert lmledger([*args, "--trainer.logger.init_args.save_dir", "ro-runs"]) == 2
    line = one_error_line(capsys)
    assert re.fullmatch(
        r"lmledger fit: error: read-only file system while writing ro-runs/\S+; nothing was written; "
        r"pass a writable --trainer.logger.init_args.save_dir",
        line,
    ), line


def test_a_full_disk_while_writing_tensorboard_events_is_one_line(workdir, capsys):
    # The event file is the first of the run to pass 6 kB; checkpoints are saved at step 100 and at the end.
    limit = {"class_path": "test_fit_failures.FileSizeLimit", "init_args": {"limit": 6_000}}
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "80"]
    assert lmledger([*args, "--trainer.callbacks+=" + json.dumps(limit)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"lmledger fit: error: file too large while writing runs/tiny/version_0/events\.out\.tfevents\.\S+; "
        r"the checkpoints saved before it are intact",
        line,
    ), line


def test_ctrl_c_while_a_checkpoint_is_written_exits_130(workdir, capsys, monkeypatch):
    """SIGINT delivered from inside torch.save's writer: torch turns the KeyboardInterrupt into
    "RuntimeError: [enforce fail at inline_container.cc]" (the 2-in-9 race of issue 23, made certain)."""
    real_write = atomic._RecordingFile.write
    writes, sent = [], []

    def write_then_interrupt(self, data):
        writes.append(self.f.name)
        # The second record: a KeyboardInterrupt in the first comes out of torch.save as it is.
        if not sent and ".last.ckpt." in self.f.name and writes.count(self.f.name) == 2:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: inside this callback
        return real_write(self, data)

    monkeypatch.setattr(atomic._RecordingFile, "write", write_then_interrupt)
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "2"]
    assert lmledger(args) == 130
    assert sent
    err = capsys.readouterr().err
    assert "Traceback" not in err and "enforce fail" not in err, err
    assert err.splitlines()[-1] == "lmledger fit: interrupted"
    checkpoints = workdir / "runs/tiny/version_0/checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []  # no temp file left behind


ARGV_AT_IMPORT = """
    import argparse

    import lightning.pytorch as pl

    argparse.ArgumentParser().parse_args()


    class Model(pl.LightningModule):
        pass
"""


def test_a_module_that_parses_argv_at_import_is_named_as_the_cause(workdir, capsys, monkeypatch):
    module = write_module(workdir, "argvparse", ARGV_AT_IMPORT)
    argv = ["fit", "--model", f"{module}.Model", "--trainer.max_steps", "1"]
    monkeypatch.setattr(sys, "argv", ["lmledger", *argv])  # as the console script runs
    assert lmledger(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"lmledger fit: error: --model {module}.Model: importing {module} exited (SystemExit 2)")
    assert "unrecognized arguments: fit --model" in line and "if __name__ == " in line, line


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_checkpoint_path_that_is_a_directory_says_so(workdir, capsys, command):
    (workdir / "ckpts").mkdir()
    (workdir / "ckpts" / "last.ckpt").write_bytes(b"")
    args = [command, "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--ckpt_path", "ckpts"]
    assert lmledger(args) == 2
    line = one_error_line(capsys, command)
    assert line.startswith(f"lmledger {command}: error: --ckpt_path ckpts is a directory (it holds last.ckpt)"), line


def test_a_checkpoint_of_the_named_class_still_resumes(workdir, capsys):
    """The class-path check refuses nothing of the user's own: a convnet checkpoint validates with --model."""
    fit = ["fit", "--model", CONVNET, *SMALL_CONVNET, *SMALL_DATA, *QUIET, "--trainer.max_steps", "1"]
    assert lmledger([*fit, "--trainer.logger.init_args.name", "own"]) == 0
    ckpt = next((workdir / "runs/own/version_0/checkpoints").glob("*.ckpt"))
    assert open_checkpoint(ckpt)["hyper_parameters"]["_class_path"] == CONVNET
    capsys.readouterr()
    validate = ["validate", "--model", CONVNET, *SMALL_DATA, "--trainer.limit_val_batches", "1"]
    validate += ["--ledger.enabled", "false"]  # the ledger's own validate path is another test's
    assert lmledger([*validate, "--ckpt_path", str(ckpt)]) == 0
    assert "val/loss" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["abc", "1e300"])
def test_a_ledger_setting_that_is_no_number_is_one_line_naming_the_flag(workdir, capsys, value):
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--ledger.device_memory_gb", value]
    assert lmledger(args) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "ledger.device_memory_gb" in line and "Subtypes" not in line and "NoneType" not in line, line
    assert not (workdir / "runs").exists()
