"""SIGTERM, as SLURM and Kubernetes send it before preempting a job: the run finishes its step, saves
last.ckpt, says so in one line and exits 143; `--ckpt_path last` then continues the same loss curve bit for
bit, with no step lost or repeated, however many times the run is stopped."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import lightning.pytorch as pl
import pytest
from test_resume import MAX_STEPS, TAGS, fit_args, fit_process

from conftest import event_files, read_scalars
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

PREEMPTED = re.compile(r"^lmledger fit: preempted at step (\d+): saved (\S+); resume with --ckpt_path last$")


class SelfTerm(pl.Callback):
    """Test-only: sends this process SIGTERM as training batch `at_step` starts, i.e. in the middle of a step."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def self_term(step: int) -> str:
    return "--trainer.callbacks+=" + f'{{"class_path": "test_preemption.SelfTerm", "init_args": {{"at_step": {step}}}}}'


def curves(run_dir) -> list[dict[str, dict[int, float]]]:
    """Per event file of a run directory, oldest first: {tag: {step: value}}."""
    files = event_files(run_dir)
    return [{tag: dict(points) for tag, points in read_scalars(f).items() if tag in TAGS} for f in files]


def assert_same_curve_no_step_lost(pieces: list[dict[str, dict[int, float]]], whole_dir) -> None:
    whole = {tag: dict(points) for tag, points in read_scalars(whole_dir).items() if tag in TAGS}
    for tag in TAGS:
        steps = [s for piece in pieces for s in piece[tag]]
        assert sorted(steps) == list(range(MAX_STEPS)), (tag, steps)  # every step once: none lost, none twice
        for piece in pieces:
            assert piece[tag] == {s: whole[tag][s] for s in piece[tag]}, tag  # exact float equality


def test_sigterm_saves_the_step_and_resume_continues_bit_for_bit(workdir):
    run = workdir / "runs" / "cut" / "version_0"
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 4, "seconds": 0.4}}'
    victim = fit_process(workdir, "cut", "--trainer.callbacks+=" + throttle)
    assert lmledger(fit_args("whole")) == 0  # the uninterrupted reference, in this process meanwhile
    first_save = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 120
    while not first_save.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first_save.exists(), (workdir / "cut.log").read_text()[-2000:]
    time.sleep(random.uniform(0.0, 2.0))  # somewhere in steps 4..9, whatever the machine's speed
    victim.send_signal(signal.SIGTERM)
    assert victim.wait(timeout=120) == 143
    lines = (workdir / "cut.log").read_text().splitlines()
    (line,) = [line for line in lines if line.startswith("lmledger fit:")]
    match = PREEMPTED.match(line)
    assert match, line
    step, saved = int(match.group(1)), workdir / match.group(2)
    assert saved == first_save and open_checkpoint(saved)["global_step"] == step
    assert 4 <= step < MAX_STEPS  # stopped mid-run, after the step it was in

    assert lmledger(fit_args("cut", "--ckpt_path", "last")) == 0
    killed, resumed = curves(run)
    assert min(resumed["train/loss"]) == step
    assert_same_curve_no_step_lost([killed, resumed], workdir / "runs/whole/version_0")


def test_three_preemptions_in_one_run_give_the_uninterrupted_curve(workdir, capsys):
    assert lmledger(fit_args("whole")) == 0
    # The first stop saves step 4, which the regular every-4-steps save has just written; the others are random.
    stops = [3, *sorted(random.sample(range(4, MAX_STEPS - 1), 2))]
    for i, at in enumerate(stops):
        capsys.readouterr()
        resume = ["--ckpt_path", "last"] if i else []
        assert lmledger(fit_args("cut", self_term(at), *resume)) == 143, stops
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
        assert len(err) == 1 and PREEMPTED.match(err[0]), err
        assert int(PREEMPTED.match(err[0]).group(1)) == at + 1  # the step the signal came in was finished
    assert lmledger(fit_args("cut", "--ckpt_path", "last")) == 0
    run = workdir / "runs" / "cut" / "version_0"
    pieces = curves(run)
    assert len(pieces) == 4
    assert_same_curve_no_step_lost(pieces, workdir / "runs/whole/version_0")
    # Each resume saved its config beside the earlier ones, never over one.
    assert sorted(p.name for p in run.glob("config*.yaml")) == [
        "config-resumed-2.yaml",
        "config-resumed-3.yaml",
        "config-resumed.yaml",
        "config.yaml",
    ]


class SelfTermInValidation(pl.Callback):
    """Test-only: sends this process SIGTERM as the first validation batch after step `at_step` starts."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.at_step and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


VAL = ["--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "4", "--trainer.num_sanity_val_steps", "0"]
ACCUMULATE = ["--trainer.accumulate_grad_batches", "2"]
CASES = {
    # The validation due after step 4 completes, step 5 runs, and the run stops with step 5 saved.
    "during validation": (
        VAL,
        '{"class_path": "test_preemption.SelfTermInValidation", "init_args": {"at_step": 4}}',
        5,
    ),
    # The signal comes in the first of step 6's two micro-batches; the step finishes both before saving.
    "mid-accumulation": (ACCUMULATE, '{"class_path": "test_preemption.SelfTerm", "init_args": {"at_step": 6}}', 7),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sigterm_waits_for_a_whole_step(workdir, capsys, case):
    extra, callback, saved_step = CASES[case]
    assert lmledger(fit_args("whole", *extra)) == 0
    capsys.readouterr()
    assert lmledger(fit_args("cut", *extra, "--trainer.callbacks+=" + callback)) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
    assert int(PREEMPTED.match(line).group(1)) == saved_step, line
    assert lmledger(fit_args("cut", *extra, "--ckpt_path", "last")) == 0
    run = workdir / "runs/cut/version_0"
    assert_same_curve_no_step_lost(curves(run), workdir / "runs/whole/version_0")
    if "--trainer.val_check_interval" in extra:  # every validation ran once, with the uninterrupted values
        val = sorted(point for f in run.glob("events.*") for point in read_scalars(f).get("val/loss", []))
        assert val == read_scalars(workdir / "runs/whole/version_0")["val/loss"]
