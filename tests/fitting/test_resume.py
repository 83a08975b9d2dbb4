"""Exact resume and reproducibility through the real CLI.

A fit killed with SIGKILL and resumed with `--ckpt_path last` logs, from the restored step on, the same
train/loss and train/lr bit for bit as an uninterrupted run (CPU, fp32); the same seed gives the same curve.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from conftest import MICRO_OVERRIDES, event_files, read_scalars
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger

TESTS = Path(__file__).resolve().parents[1]
MAX_STEPS = 12
FAST = [
    *MICRO_OVERRIDES,
    "--trainer.max_steps", str(MAX_STEPS),
    "--trainer.callbacks.init_args.every_n_train_steps", "4",
]  # fmt: skip
TAGS = ("train/loss", "train/lr")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread


class Throttle(pl.Callback):
    """Test-only: sleeps before each batch after `after_step`, so a kill lands mid-run however fast the steps."""

    def __init__(self, after_step: int, seconds: float) -> None:
        self.after_step, self.seconds = after_step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step > self.after_step:
            time.sleep(self.seconds)


def fit_args(name: str, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/tiny.yaml", *FAST, "--trainer.logger.init_args.name", name, *extra]


def fit_process(cwd: Path, name: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"  # as one_thread() does in this process
    log = open(cwd / f"{name}.log", "ab")
    command = [sys.executable, "-m", "lmledger.cli", *fit_args(name, *extra)]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def scalars_of(event_file: Path) -> dict[str, dict[int, float]]:
    return {tag: dict(points) for tag, points in read_scalars(event_file).items() if tag in TAGS}


# 1: the configs' choice; -1: Lightning's default with max_steps; "by epochs": no max_steps, one epoch of
# MAX_STEPS batches (the LR schedule's length then comes from Lightning's estimate).
BY_EPOCHS = ["1", "--trainer.max_steps", "-1", "--trainer.limit_train_batches", str(MAX_STEPS)]


@pytest.mark.parametrize("max_epochs", [["-1"], ["1"], BY_EPOCHS], ids=["max_epochs -1", "max_epochs 1", "by epochs"])
def test_killed_run_resumes_bit_for_bit(workdir, max_epochs):
    run = workdir / "runs" / "cut" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    # The throttle only slows the steps after the first checkpoint, so the poll below has time to kill mid-run.
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 4, "seconds": 0.5}}'
    epochs = ("--trainer.max_epochs", *max_epochs)
    victim = fit_process(workdir, "cut", *epochs, "--trainer.callbacks+=" + throttle)
    assert lmledger(fit_args("whole", *epochs)) == 0  # the uninterrupted reference, in this process meanwhile
    deadline = time.monotonic() + 120
    while not ckpt.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ckpt.exists(), (workdir / "cut.log").read_text()[-2000:]
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL  # killed mid-run, not finished
    resumed_from = open_checkpoint(ckpt)["global_step"]
    assert 0 < resumed_from < MAX_STEPS
    first_config = (run / "config.yaml").read_bytes()
    before = set(run.glob("events.out.tfevents.*"))

    assert lmledger(fit_args("cut", *epochs, "--ckpt_path", "last")) == 0

    (resumed_file,) = set(run.glob("events.out.tfevents.*")) - before  # the resumed run appends a new file
    (killed_file,) = before
    whole = scalars_of(workdir / "runs/whole/version_0")
    resumed, killed = scalars_of(resumed_file), scalars_of(killed_file)
    for tag in TAGS:
        assert sorted(resumed[tag]) == list(range(resumed_from, MAX_STEPS)), tag
        assert resumed[tag] == {s: whole[tag][s] for s in resumed[tag]}, tag  # exact float equality
        # What the killed run flushed before dying matches too: same seed, same curve.
        assert killed[tag] and killed[tag] == {s: whole[tag][s] for s in killed[tag]}, tag
    # The resumed run saved its config beside the first one, not over it.
    assert (run / "config.yaml").read_bytes() == first_config
    assert (run / "config-resumed.yaml").is_file()


def losses(version: int) -> list[tuple[int, float]]:
    return read_scalars(Path(f"runs/tiny/version_{version}"))["train/loss"]


def test_same_seed_same_curve_and_the_saved_config_reproduces_a_run(workdir):
    ten_steps = ["--trainer.max_steps", "10"]
    # A random seed is drawn and written into the run's config.yaml...
    assert lmledger(fit_args("tiny", *ten_steps, "--seed_everything", "true")) == 0
    config = Path("runs/tiny/version_0/config.yaml")
    seed = yaml.safe_load(config.read_text())["seed_everything"]
    assert isinstance(seed, int) and not isinstance(seed, bool)
    # ...and that file alone reproduces the run, loss for loss.
    assert lmledger(["fit", "--config", str(config)]) == 0
    assert len(losses(0)) == 10 and losses(1) == losses(0)
    # The control: another seed (tiny.yaml's 1234) gives other initial weights, so another curve.
    assert seed != 1234
    assert lmledger(fit_args("tiny", *ten_steps)) == 0
    assert losses(2) != losses(0)


# ------------------------------------------------------------------------------------- resume, every time


def curve(run_dir: Path) -> list[dict[int, float]]:
    """train/loss per event file of a run directory, oldest first."""
    files = event_files(run_dir)
    return [dict(read_scalars(f).get("train/loss", [])) for f in files]


def self_term(step: int) -> str:
    return "--trainer.callbacks+=" + f'{{"class_path": "test_preemption.SelfTerm", "init_args": {{"at_step": {step}}}}}'


def test_a_moved_run_resumes_from_its_newest_checkpoint(workdir, capsys):
    assert lmledger(fit_args("whole")) == 0
    assert lmledger(fit_args("A", self_term(5))) == 143  # saved at step 6
    Path("runs/A").rename("runs/B")
    # Lightning no longer recognises its last.ckpt (the recorded path moved) and saves last-v1.ckpt beside it.
    assert lmledger(fit_args("B", self_term(8), "--ckpt_path", "last")) == 143  # saved at step 9
    checkpoints = Path("runs/B/version_0/checkpoints")
    steps = {p.name: open_checkpoint(p)["global_step"] for p in checkpoints.glob("*.ckpt")}
    assert steps == {"last.ckpt": 6, "last-v1.ckpt": 9}
    capsys.readouterr()
    assert lmledger(fit_args("B", "--ckpt_path", "last")) == 0
    # One line, before training, names the run and the step it resumes.
    out = capsys.readouterr().out.splitlines()
    assert f"lmledger fit: resuming {Path('runs/B/version_0')} at step 9 from last-v1.ckpt" in out
    pieces = curve(Path("runs/B/version_0"))
    whole = dict(read_scalars(Path("runs/whole/version_0"))["train/loss"])
    assert sorted(s for piece in pieces for s in piece) == list(range(MAX_STEPS))  # no step repeated or lost
    assert all(piece == {s: whole[s] for s in piece} for piece in pieces)


def test_a_finished_run_says_so_and_a_longer_one_trains_the_extra_steps(workdir, capsys):
    from test_fit_failures import snapshot

    assert lmledger(fit_args("done")) == 0
    run = Path("runs/done/version_0")
    before = snapshot(workdir)
    capsys.readouterr()
    assert lmledger(fit_args("done", "--ckpt_path", "last")) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"lmledger fit: {run} finished at step {MAX_STEPS}; nothing to resume" in out[-1]
    assert snapshot(workdir) == before  # nothing written, not even a resumed config

    assert lmledger(fit_args("done", "--trainer.max_steps", str(MAX_STEPS + 4), "--ckpt_path", "last")) == 0
    first, extension = curve(run)
    assert sorted(first) == list(range(MAX_STEPS))
    assert sorted(extension) == list(range(MAX_STEPS, MAX_STEPS + 4))
    assert open_checkpoint(run / "checkpoints/last.ckpt")["global_step"] == MAX_STEPS + 4


def test_validate_last_then_resume_again(workdir, capsys):
    """validate --ckpt_path last writes nothing into the run, so the run resumes as before."""
    assert lmledger(fit_args("v", self_term(3))) == 143
    run = Path("runs/v/version_0")
    files = sorted(p.name for p in run.rglob("*"))
    validate = ["validate", "--config", "configs/tiny.yaml", *FAST, "--trainer.logger.init_args.name", "v"]
    assert lmledger([*validate, "--ckpt_path", "last"]) == 0
    assert sorted(p.name for p in run.rglob("*")) == files and sorted(Path("runs/v").iterdir()) == [run]
    assert lmledger(fit_args("v", "--ckpt_path", "last")) == 0
    assert sorted(s for piece in curve(run) for s in piece) == list(range(MAX_STEPS))
