"""The run lock against a planted lock file, a deleted one, a moved run, and a refused claim (issue 28 §2, §3).

A lock file that is a symlink, a hard link, a FIFO or someone else's file is refused in one line and left as it
was. Deleting lmledger.lock while a run trains lets no second writer in: the lock is held on the version
directory too. A run whose directory was moved or replaced under it saves nothing and says so. A claim refused
by the lock changes nothing the holder wrote. Every case runs a real holder process beside the claimant.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MICRO_OVERRIDES, read_scalars
from lmledger.cli import main as lmledger
from lmledger.errors import UserError
from lmledger.rundir import RunClaim
from lmledger.runlock import RUN_LOCK, DirLock

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

TESTS = Path(__file__).resolve().parent
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}


def refusal(err: BaseException | str) -> str:
    text = str(err)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text


# ------------------------------------------------------------------------------------- a planted lock file


def plant(kind: str, lock: Path, victim: Path) -> None:
    victim.write_text("the victim's own bytes\n")
    if kind == "symlink to a file":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":  # O_CREAT through it would create the target
        victim.unlink()
        lock.symlink_to(victim)
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    elif kind == "foreign file":  # a regular file that does not hold a lock's "PID@HOST" line
        lock.write_text("notes the user keeps here\n")


PLANTED = ["symlink to a file", "dangling symlink", "hard link", "fifo", "directory", "foreign file"]


@pytest.mark.parametrize("kind", PLANTED)
def test_a_planted_lock_file_is_refused_in_one_line_and_left_as_it_was(tmp_path, kind):
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    lock = run / RUN_LOCK
    plant(kind, lock, victim)
    before = (victim.exists() and victim.read_bytes(), lock.is_file() and not lock.is_symlink() and lock.read_bytes())
    with pytest.raises(UserError) as err:
        DirLock(lock).acquire(lambda who: AssertionError(f"busy: {who}"))
    assert str(lock) in refusal(err.value) and "remove it" in str(err.value), err.value
    after = (victim.exists() and victim.read_bytes(), lock.is_file() and not lock.is_symlink() and lock.read_bytes())
    assert after == before
    assert os.path.lexists(lock)  # ours to refuse, not to remove


def test_a_resume_through_a_planted_symlink_lock_is_refused_and_writes_nothing(workdir, capsys):
    """Issue 28 §2's case: lmledger.lock a symlink to victim.txt, then `fit --ckpt_path last`."""
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.logger.init_args.name", "s",
            "--trainer.max_steps", "2"]  # fmt: skip
    assert lmledger(args) == 0
    run = workdir / "runs" / "s" / "version_0"
    victim = workdir / "victim.txt"
    victim.write_text("keep me\n")
    (run / RUN_LOCK).unlink()
    (run / RUN_LOCK).symlink_to(victim)
    listing = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert lmledger([*args[:-1], "4", "--ckpt_path", "last"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
    assert len(lines) == 1 and "symbolic link" in lines[0], lines
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in run.iterdir()) == listing  # no config-resumed.yaml, no event file


# ------------------------------------------------------------------------------------- a deleted lock file

# A holder process: locks a directory as RunClaim does, then obeys lines on stdin. (DirLock alone: a holder that
# imports no Lightning starts in a fraction of the time.)
HOLDER = """
import os, sys
from pathlib import Path
from lmledger.runlock import RUN_LOCK, DirLock
run = Path(sys.argv[1])
lock = DirLock(run / RUN_LOCK).acquire(lambda who: SystemExit(f"busy: {who}"))
print("held", flush=True)
for line in sys.stdin:
    if line.strip() == "write":  # what a training holder does meanwhile: append events, stage a checkpoint
        with open(run / "events.out.tfevents.1", "ab") as f:
            f.write(b"step 2\\n")
        (run / f".last.ckpt.{os.getpid()}.0123456789ab.tmp").write_bytes(b"half a checkpoint")
        print("wrote", flush=True)
    elif line.strip() == "lost":
        print(f"lost: {lock.lost()}", flush=True)
"""


def holder(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def ask(proc: subprocess.Popen, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_deleting_the_lock_file_lets_no_second_claim_in(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    proc = holder(run)
    try:
        (run / RUN_LOCK).unlink()
        with pytest.raises(UserError, match="one writer per run") as err:
            RunClaim().claim(run, made=False)
        refusal(err.value)
        assert ask(proc, "lost") == "lost: None"  # the holder still excludes everyone
    finally:
        proc.kill()
        proc.wait(timeout=30)
    claim = RunClaim()  # the holder gone, the run is free again
    claim.claim(run, made=False)
    claim.release()


def test_a_claim_refused_by_the_lock_changes_nothing_the_holder_wrote(tmp_path, monkeypatch):
    """Issue 28 §3: the window forced. The holder writes while the claimant is between looking and locking."""
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "events.out.tfevents.1").write_bytes(b"step 1\n")
    proc = holder(run)
    acquire = DirLock.acquire

    def holder_writes_first(self, busy):
        assert ask(proc, "write") == "wrote"
        return acquire(self, busy)

    monkeypatch.setattr(DirLock, "acquire", holder_writes_first)
    events = run / "events.out.tfevents.1"
    try:
        inode = events.stat().st_ino
        with pytest.raises(UserError, match=f"pid {proc.pid}"):
            RunClaim().claim(run, made=False)
        assert events.stat().st_ino == inode and events.read_bytes() == b"step 1\nstep 2\n"
        assert (run / f".last.ckpt.{proc.pid}.0123456789ab.tmp").read_bytes() == b"half a checkpoint"
    finally:
        proc.kill()
        proc.wait(timeout=30)


# The same holder on a filesystem that refuses a directory's flock (NFSv4 wants a file open for writing):
# the lock file alone excludes, so a deleted one is a stolen one, and the holder knows.
FILE_ONLY = """
import fcntl, os, stat, sys
real = fcntl.flock
def flock(fd, op):
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        raise OSError(9, "Bad file descriptor")
    return real(fd, op)
fcntl.flock = flock
"""


def test_a_holder_that_cannot_lock_its_directory_knows_when_its_lock_file_is_taken(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", FILE_ONLY + HOLDER, str(run)], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "held"
        assert ask(proc, "lost") == "lost: None"
        (run / RUN_LOCK).unlink()
        thief = DirLock(run / RUN_LOCK).acquire(lambda who: AssertionError(who))
        try:
            said = ask(proc, "lost")
        finally:
            thief.release()
        assert said.startswith("lost: ") and str(run / RUN_LOCK) in said and "None" not in said, said
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------- a run that trains


def fit_args(*extra: str) -> list[str]:
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 1, "seconds": 0.25}}'
    return ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.logger.init_args.name", "t",
            "--trainer.callbacks.init_args.every_n_train_steps", "2", "--trainer.callbacks+=" + throttle,
            *extra]  # fmt: skip


def training(workdir: Path, log: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A `fit` in another process, returned once it has saved its first checkpoint (it trains until stopped)."""
    ckpt = workdir / "runs" / "t" / "version_0" / "checkpoints" / "last.ckpt"
    mtime = ckpt.stat().st_mtime_ns if ckpt.exists() else None
    out = workdir / log
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lmledger.cli", *fit_args("--trainer.max_steps", "400", *extra)],
                                cwd=workdir, env=ENV, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 180
    while not ckpt.exists() or ckpt.stat().st_mtime_ns == mtime:
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.05)
    return proc, out


def stopped(proc: subprocess.Popen, log: Path) -> tuple[int, list[str]]:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=180)
    return code, [line for line in log.read_text().splitlines() if line.startswith("lmledger fit:")]


def test_a_run_whose_lock_file_is_deleted_keeps_the_run_and_its_saves_its_own(workdir, capsys):
    """Issue 28 §3's case: lmledger.lock deleted mid-run, then a second `fit --ckpt_path last`.

    Before: the second trained in the same directory, and the first's "saved last.ckpt at step 65" named a file
    holding the other's step 55."""
    proc, log = training(workdir, "holder.log")
    run = workdir / "runs" / "t" / "version_0"
    try:
        (run / RUN_LOCK).unlink()
        capsys.readouterr()
        assert lmledger(fit_args("--trainer.max_steps", "1000", "--ckpt_path", "last")) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("lmledger")]
        assert "one writer per run" in line, line
    finally:
        code, said = stopped(proc, log)
    assert code == 143, log.read_text()[-3000:]
    (preempted,) = [line for line in said if "preempted at step" in line]
    step = int(preempted.split("preempted at step ")[1].split(":")[0])
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == step, (preempted, saved["global_step"])
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]  # no second writer's config


def test_a_run_whose_directory_is_moved_and_retaken_saves_nothing_there(workdir):
    """The run directory moved aside and a new one of the same name claimed by another process: what the old run
    would save by path lands in the other's. It stops without saving, in one line, and reports no save."""
    proc, log = training(workdir, "holder.log")
    run = workdir / "runs" / "t" / "version_0"
    moved = run.with_name("moved")
    try:
        run.rename(moved)
        run.mkdir()
        other = DirLock(run / RUN_LOCK).acquire(lambda who: AssertionError(who))
        try:
            code, said = stopped(proc, log)
            listing = sorted(p.name for p in run.iterdir())
        finally:
            other.release()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 2, log.read_text()[-3000:]
    assert not any("preempted at step" in line for line in said), said  # no "saved …/last.ckpt" report
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("lmledger fit: error")]
    assert "lost its lock" in line and "moved" in line, line
    # No checkpoint of the stopped run's in the other's directory. The run checks its lock once a step, so the
    # logger's writes of the step the move came in may land there by path: Lightning's hparams.yaml, and the
    # records TensorBoard's writer appends to its event file by name (tensorboard's gfile opens the path at
    # each write), in a file of the moved one's name. That step's alone (Lightning numbers it N-1 or N, where the
    # run says it stopped at step N), none after it.
    stray = [name for name in listing if name.startswith("events.out.tfevents.")]
    assert set(listing) - set(stray) <= {RUN_LOCK, "hparams.yaml"}, listing
    if stray:
        assert set(stray) <= {p.name for p in moved.iterdir()}, (stray, sorted(p.name for p in moved.iterdir()))
        steps = {step for points in read_scalars(run).values() for step, _ in points}
        stop = int(re.search(r"stopped at step (\d+)", line).group(1))
        assert steps and steps <= {stop - 1, stop}, (steps, line)
