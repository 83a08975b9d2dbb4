"""Plain progress lines when stdout is not a terminal (pytest's captured stdout is not one)."""

from __future__ import annotations

import re
import warnings

import pytest

from conftest import MICRO_OVERRIDES, read_scalars
from lmledger.cli import main as lmledger

pytestmark = pytest.mark.usefixtures("one_thread")
LINE = re.compile(r"^step (\d+)/6  loss ([\d.]+)  tok/s ([\d,]+)  mfu ([\d.]+(?:e-\d+)?)  elapsed \S+  eta \S+$")


def test_a_line_per_logging_interval_with_the_logged_loss(workdir, capsys):
    argv = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.enable_progress_bar", "true"]
    argv += ["--trainer.max_steps", "6", "--trainer.log_every_n_steps", "2", "--ledger.warmup_steps", "0"]
    assert lmledger(argv) == 0
    lines = [m for line in capsys.readouterr().out.splitlines() if (m := LINE.match(line))]
    assert [int(m[1]) for m in lines] == [2, 4, 6]
    assert all(int(m[3].replace(",", "")) > 0 and 0 < float(m[4]) for m in lines)
    # The printed loss is the one TensorBoard got for that logging step.
    logged = [v for _, v in read_scalars(next((workdir / "runs" / "tiny").glob("version_*")))["train/loss"]]
    assert [float(m[2]) for m in lines] == pytest.approx(logged, abs=1e-4)
    # validate restores the weights of step 6, not its loops: the line names the checkpoint, not "step 0"
    argv = ["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.enable_progress_bar", "true",
            "--trainer.limit_val_batches", "1", "--ckpt_path", "last"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lmledger(argv) == 0
    # nor Lightning's advice to add the fit's ModelCheckpoint, which a validation does not use
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("validate ", "step "))]
    assert len(said) == 1 and re.match(r"validate \S+last\.ckpt  val/loss [\d.]+  val/ppl", said[0]), said


def test_no_plain_lines_without_a_bar(workdir, capsys):
    argv = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "2"]
    assert lmledger(argv) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_a_tiny_mfu_is_never_printed_as_zero():
    from lmledger.callbacks.progress import _value

    assert [_value("mfu", v) for v in (0.457, 0.0012, 4.1e-4, 0.0)] == ["0.457", "0.001", "4.1e-04", "0.000"]
    assert float(_value("hfu", 3e-6)) == pytest.approx(3e-6)
