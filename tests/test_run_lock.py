"""One writer per run directory (issue 23 §2) and refusals that leave no files (issue 23 §5).

A fit holds an flock on runs/NAME/version_N/lmledger.lock while it trains there; a second writer is refused in
one line naming the holder's pid; the kernel drops the lock when the holder dies (SIGKILL included). A run
refused by a check made in its first step leaves the runs directory byte for byte as it was, a refused
resume included. `lmledger prepare` locks its --out directory the same way.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_any_model_cli import NoLoss

from conftest import MICRO_OVERRIDES, one_error_line
from lmledger.cli import main as lmledger
from lmledger.runlock import RUN_LOCK, DirLock

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

TESTS = Path(__file__).resolve().parent


def fit_args(name: str, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.logger.init_args.name", name,
            "--trainer.max_steps", "2", *extra]  # fmt: skip


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root: relative path -> sha256 of its bytes ("dir" for a directory)."""
    if not root.exists():
        return {}
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_a_second_writer_is_refused_naming_the_holder_and_nothing_changes(workdir, capsys):
    assert lmledger(fit_args("held", "--trainer.max_steps", "2")) == 0
    run = workdir / "runs" / "held" / "version_0"
    assert (run / RUN_LOCK).is_file()  # left in place, unlocked: the next writer takes it
    lock = DirLock(run / RUN_LOCK).acquire(lambda who: AssertionError(who))  # this process plays the holder
    try:
        before = tree(workdir / "runs")
        capsys.readouterr()
        assert lmledger(fit_args("held", "--trainer.max_steps", "4", "--ckpt_path", "last")) == 2
        err = one_error_line(capsys)
        assert f"pid {os.getpid()}" in err and "one writer per run" in err, err
        after = tree(workdir / "runs")
    finally:
        lock.release()
    before.pop(f"held/version_0/{RUN_LOCK}"), after.pop(f"held/version_0/{RUN_LOCK}")  # the pid it names
    assert after == before
    # With the holder gone, the same resume trains.
    assert lmledger(fit_args("held", "--trainer.max_steps", "4", "--ckpt_path", "last")) == 0


def test_two_resumes_started_together_one_trains_and_one_is_refused(workdir):
    """Issue 23 §2's case: the same `--ckpt_path last` twice at once (a requeued job while the old one is still
    being killed). Before the lock both trained into version_0, or the loser died in SaveConfigCallback."""
    assert lmledger(fit_args("twice", "--trainer.callbacks.init_args.every_n_train_steps", "2")) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    # The winner trains ~5 s, so the loser meets its lock however late it starts on a busy machine.
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 0, "seconds": 0.5}}'
    args = fit_args("twice", "--trainer.max_steps", "12", "--ckpt_path", "last", "--trainer.callbacks+=" + throttle)
    command = [sys.executable, "-m", "lmledger.cli", *args]
    procs = [subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    (refused,) = [err for code, _, err in results if code == 2]
    lines = [line for line in refused.splitlines() if line.startswith("lmledger")]
    assert len(lines) == 1 and "one writer per run" in lines[0] and "Traceback" not in refused, refused
    run = workdir / "runs" / "twice" / "version_0"
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config-resumed.yaml", "config.yaml"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # the first run's and the one resume's


HOLD = """
import sys, time
from lmledger.runlock import DirLock
DirLock(sys.argv[1]).acquire(lambda who: SystemExit(3))
print("held", flush=True)
time.sleep(60)
"""


def test_sigkill_leaves_no_stale_lock(tmp_path):
    path = tmp_path / RUN_LOCK
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"pid {holder.pid}"):
            DirLock(path).acquire(lambda who: RuntimeError(who))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    DirLock(path).acquire(lambda who: AssertionError(f"stale lock held by {who}")).release()


def test_two_prepares_into_one_directory_at_once_one_is_refused(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for i in range(40):  # enough text that the first is still writing when the second starts
        (source / f"f{i}.py").write_text(f"# file {i}\n" + "x = 1\n" * 20_000)
    out = tmp_path / "data"
    command = [sys.executable, "-m", "lmledger.cli", "prepare", "--source", str(source), "--out", str(out)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    (refused,) = [err.strip() for code, _, err in results if code == 2]
    assert len(refused.splitlines()) == 1, refused
    assert "lmledger prepare (pid" in refused or "already holds prepared data" in refused, refused
    assert not (out / ".prepare.lock").exists()


def test_prepare_refused_while_another_holds_the_directory(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    lock = DirLock(out / ".prepare.lock").acquire(lambda who: AssertionError(who))
    try:
        assert lmledger(["prepare", "--source", str(TESTS / "conftest.py"), "--out", str(out)]) == 2
        err = one_error_line(capsys)
        assert f"lmledger prepare (pid {os.getpid()})" in err, err
    finally:
        lock.release()
    assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]  # the holder's; nothing written beside it


class DictWithoutLoss(NoLoss):
    def training_step(self, batch, batch_idx):
        return {"total": self.layer(batch[0]).mean()}


class DetachedLoss(NoLoss):
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).mean().detach()


class BadTokens(NoLoss):
    tokens_per_batch = -1

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).mean()


# Refusals made in the first training step (StepChecks, the ledger's preflight): each leaves no trace.
REFUSALS = {
    "no loss": ["--model", "test_any_model_cli.NoLoss"],
    "dict without loss": ["--model", "test_run_lock.DictWithoutLoss"],
    "non-scalar loss": ["--model", "test_any_model_cli.TokenLoss"],
    "detached loss": ["--model", "test_run_lock.DetachedLoss"],
    "bad tokens_per_batch": ["--model", "test_run_lock.BadTokens"],
    "batch without a tensor": ["--model", "test_any_model_cli.NoLoss", "--data", "test_any_model_cli.Strings"],
    "device memory": ["--ledger.device_memory_gb", "1e-9"],
}


REFUSED = {  # a fragment of each one-line refusal
    "no loss": "training_step returned None",
    "dict without loss": "the 'loss' key needs to be present",
    "non-scalar loss": "returned a tensor of shape",
    "detached loss": "returned a loss that needs no grad",
    "bad tokens_per_batch": "tokens_per_batch gave -1",
    "batch without a tensor": "holding no tensor",
    "device memory": "exceeds the 1 B available",
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_a_refused_run_leaves_the_runs_directory_as_it_was(workdir, capsys, case):
    sys.path.insert(0, str(TESTS))
    extra = REFUSALS[case]
    if extra[0] == "--model":
        args = ["fit", *extra, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.name", "r"]  # fmt: skip
        if "--data" not in extra:
            args += ["--data.init_args.batch_size", "2", "--data.init_args.context_length", "32"]
    else:
        args = fit_args("r", *extra)
    (workdir / "runs" / "other").mkdir(parents=True)  # a runs directory that holds something already
    (workdir / "runs" / "other" / "keep.txt").write_text("mine")
    before = tree(workdir / "runs")
    capsys.readouterr()
    assert lmledger(args) == 2
    assert REFUSED[case] in one_error_line(capsys)
    assert tree(workdir / "runs") == before


def test_a_refused_resume_leaves_the_run_as_it_was(workdir, capsys):
    assert lmledger(fit_args("r")) == 0
    before = tree(workdir / "runs")
    capsys.readouterr()
    resume = fit_args("r", "--trainer.max_steps", "4", "--ckpt_path", "last", "--ledger.device_memory_gb", "1e-9")
    assert lmledger(resume) == 2
    one_error_line(capsys)
    assert tree(workdir / "runs") == before  # no config-resumed.yaml, no event file, hparams.yaml as it was


def test_a_fresh_refused_run_removes_the_runs_directory_it_made(workdir, capsys):
    assert not (workdir / "runs").exists()
    assert lmledger(fit_args("r", "--ledger.device_memory_gb", "1e-9")) == 2
    one_error_line(capsys)
    assert not (workdir / "runs").exists()


def test_ckpt_path_auto_starts_then_resumes_after_a_kill(workdir):
    """The same command three times, killed between runs: fresh, then two resumes of the same version."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 0, "seconds": 0.3}}'
    args = fit_args("auto", "--trainer.max_steps", "10", "--trainer.callbacks.init_args.every_n_train_steps", "2",
                    "--trainer.callbacks+=" + throttle, "--ckpt_path", "auto")  # fmt: skip
    command = [sys.executable, "-m", "lmledger.cli", *args]
    ckpt = workdir / "runs" / "auto" / "version_0" / "checkpoints" / "last.ckpt"
    firsts = []
    for attempt in range(3):
        log = workdir / f"auto{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
            if attempt < 2:
                mtime = ckpt.stat().st_mtime_ns if ckpt.exists() else 0
                deadline = time.monotonic() + 120
                while (not ckpt.exists() or ckpt.stat().st_mtime_ns == mtime) and time.monotonic() < deadline:
                    assert proc.poll() is None, log.read_text()[-2000:]
                    time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=180) == (-signal.SIGKILL if attempt < 2 else 0), log.read_text()[-2000:]
        firsts.append(next(line for line in log.read_text().splitlines() if "--ckpt_path auto" in line))
    assert "starting fresh in runs/auto/version_0" in firsts[0], firsts
    assert all("--ckpt_path auto: resuming runs/auto/version_0 at step" in line for line in firsts[1:]), firsts
    assert sorted(p.name for p in (workdir / "runs" / "auto").iterdir()) == ["version_0"]


def test_ckpt_path_auto_keys_the_run_to_its_slurm_job(workdir, capsys, monkeypatch):
    """Under SLURM, auto resumes the version of this job only: another job of the same name starts its own."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    auto = ["--trainer.callbacks.init_args.every_n_train_steps", "2", "--ckpt_path", "auto"]
    said = []
    for job, steps in (("111", 2), ("222", 2), ("111", 4)):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        capsys.readouterr()
        assert lmledger(fit_args("keyed", "--trainer.max_steps", str(steps), *auto)) == 0
        said.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("lmledger fit:")])
    assert said[0] == ["lmledger fit: SLURM job 111, restart 0",
                       "lmledger fit: --ckpt_path auto: SLURM job 111 has no run under runs/keyed yet: starting fresh "
                       "in runs/keyed/version_0"], said  # fmt: skip
    assert said[1][1].endswith("SLURM job 222 has no run under runs/keyed yet: starting fresh in runs/keyed/version_1")
    assert said[2][1] == "lmledger fit: --ckpt_path auto: resuming runs/keyed/version_0 at step 2 from last.ckpt"
    runs = workdir / "runs" / "keyed"
    assert [(runs / f"version_{n}" / "slurm_job").read_text().strip() for n in (0, 1)] == ["111", "222"]
