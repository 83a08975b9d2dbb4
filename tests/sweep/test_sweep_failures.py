"""Issue 16 for `lmledger sweep`: points that die with the sweep and are resumed, a point still running,
every point's arguments checked before any runs, the same point twice, hostile names, a huge grid, and
a full disk. Each bad case is one line on stderr, exit 2, nothing run."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from lmledger.cli import main as lmledger
from lmledger.sweep import MAX_POINTS, CheckedPoints, check_points, fit_args, launch, load_experiment

PLAN = {"command": "plan max-params", "gpu": "h100-sxm"}  # a point that runs in a second, no Lightning


def write_experiment(path: Path, **spec) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def one_error_line(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert lmledger(["sweep", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("lmledger sweep: error: "), err
    return err


# ------------------------------------------------------------------------------ the experiment file


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "runs/../x", ""])
def test_names_that_are_not_a_plain_directory_name_are_refused(workdir, capsys, name):
    path = write_experiment(workdir / "e.yaml", name=name, points=[PLAN])
    assert "name must be a plain directory name" in one_error_line(capsys, str(path), "--dry-run")
    assert not (workdir / "runs").exists()


def test_the_same_run_twice_is_refused(workdir, capsys):
    path = write_experiment(
        workdir / "e.yaml", command="account", configs=["configs/tiny.yaml"], grid={"data.batch_size": [4, "4"]}
    )
    err = one_error_line(capsys, str(path), "--dry-run")
    assert "grid key 'data.batch_size' lists the same value twice (4 and '4'" in err
    # across grid and points: the command lines decide, not the YAML types
    path = write_experiment(
        workdir / "e.yaml",
        command="account",
        configs=["configs/tiny.yaml"],
        grid={"data.batch_size": [4, 8]},
        points=[{"data.batch_size": "8"}],
    )
    assert "duplicate point (batch_size=8)" in one_error_line(capsys, str(path), "--dry-run")
    # two fragments with the same file name in different directories are different runs
    for folder in ("a", "b"):
        (workdir / folder).mkdir()
        (workdir / folder / "bs.yaml").write_text(f"data:\n  batch_size: {2 if folder == 'a' else 3}\n")
    path = write_experiment(
        workdir / "e.yaml",
        command="account",
        configs=["configs/tiny.yaml"],
        grid={"config": ["a/bs.yaml", "b/bs.yaml"]},
    )
    assert len(load_experiment(path).points) == 2


def test_a_grid_over_the_limit_is_refused_before_it_is_expanded(workdir, capsys):
    # 10^6 points: refused from the sizes alone (expanding it took 70 s and 650 MB)
    grid = {f"model.config.k{i}": list(range(10)) for i in range(6)}
    path = write_experiment(workdir / "e.yaml", command="account", configs=["configs/tiny.yaml"], grid=grid)
    err = one_error_line(capsys, str(path), "--dry-run")
    assert f"the grid has 1,000,000 points, more than a sweep may have ({MAX_POINTS:,})" in err
    # the limit itself is allowed
    grid = {"data.batch_size": list(range(1, 101)), "model.config.context_length": list(range(MAX_POINTS // 100))}
    path = write_experiment(workdir / "e.yaml", command="account", configs=["configs/tiny.yaml"], grid=grid)
    assert len(load_experiment(path).points) == MAX_POINTS


# ------------------------------------------------------------------- arguments checked before running


def test_a_bad_grid_key_stops_the_sweep_before_any_point_runs(workdir, capsys):
    path = write_experiment(
        workdir / "e.yaml",
        command="fit",
        configs=["configs/tiny.yaml"],
        grid={"data.batch_size": [2, 4], "model.config.d_modle": [32, 64]},
    )
    err = one_error_line(capsys, str(path), "--out", "sweeps/e")
    assert "4 of 4 points have bad arguments, nothing was run" in err and "--model.config.d_modle" in err
    assert not (workdir / "sweeps").exists() and not (workdir / "runs").exists()

    # a combination no single key shows: 3 heads do not divide d_model 32
    path = write_experiment(
        workdir / "e.yaml",
        command="account",
        configs=["configs/tiny.yaml"],
        fixed={"model.config.d_model": 32},
        grid={"model.config.n_heads": [2, 3]},
    )
    err = one_error_line(capsys, str(path), "--out", "sweeps/e")
    assert "1 of 2 points have bad arguments" in err and "n_heads=3" in err and "divisible" in err
    assert not (workdir / "sweeps").exists()

    # no logger to set the run directory on: each point failed as it ran, "--trainer.logger auto takes no arguments"
    for logger, shown in ((False, "false"), (None, "null"), (True, "true"), ([], "[]")):
        path = write_experiment(workdir / "e.yaml", command="fit", configs=["configs/tiny.yaml"],
                                fixed={"trainer.logger": logger}, grid={"data.batch_size": [2, 4]})  # fmt: skip
        err = one_error_line(capsys, str(path), "--out", "sweeps/e")
        assert "2 of 2 points have bad arguments" in err, err
        assert f"trainer.logger {shown}: a sweep logs each fit and validate" in err
        assert not (workdir / "sweeps").exists()
    # nor under barebones, which allows none (fit's own line would have asked to drop the sweep's logger)
    path = write_experiment(workdir / "e.yaml", command="fit", configs=["configs/tiny.yaml"],
                            fixed={"trainer.barebones": True}, grid={"data.batch_size": [2, 4]})  # fmt: skip
    err = one_error_line(capsys, str(path), "--out", "sweeps/e")
    assert "2 of 2 points have bad arguments" in err and "trainer.barebones true: a sweep reads each" in err, err
    assert not (workdir / "sweeps").exists()


def test_points_are_checked_with_one_parse_per_value_not_per_point(workdir, capsys, monkeypatch):
    """A 10 x 10 x 2 grid costs 1 + 22 parses of the fit parser, not 200 (a parse is ~0.1 s; the
    rest of a point, milliseconds)."""
    from lmledger.fitting import cli as fit_cli

    calls = []
    real = fit_cli.parse_fit_config

    def counting(args):
        calls.append(args)
        return real(args)

    monkeypatch.setattr(fit_cli, "parse_fit_config", counting)
    path = write_experiment(
        workdir / "e.yaml",
        command="account",
        configs=["configs/tiny.yaml"],
        grid={
            "data.batch_size": list(range(1, 11)),
            "model.config.context_length": [16 * 2**i for i in range(10)],
            "model.optimizer": ["adamw", "sgd"],
        },
    )
    experiment = load_experiment(path)
    checked = check_points(experiment)
    assert len(calls) == 23 and not checked.errors and len(checked.specs) == 200
    # each combined spec is what parsing the point's whole command line gives
    from lmledger.run_config import load_run

    for point in (experiment.points[0], experiment.points[57], experiment.points[-1]):
        assert checked.specs[point.id] == load_run(fit_args(point))
    spec = checked.specs[experiment.points[57].id]  # batch 3, context 16 * 2**8, sgd
    assert (spec.batch_size, spec.seq_len, spec.optimizer) == (3, 4096, "sgd")


# -------------------------------------------------------------------------- a point still running


def test_a_point_still_running_stops_a_second_sweep(workdir, capsys):
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    point = load_experiment(path).points[0]
    lock = workdir / "sweeps" / "e" / "points" / point.id / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("4242\n")  # a lock file nobody holds is stale: ignored
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the point's process holds it while it lives
        err = one_error_line(capsys, str(path), "--out", "sweeps/e")
        assert f"point {point.id} of sweeps/e is still running (pid 4242)" in err and "kill 4242" in err
        assert not (workdir / "sweeps" / "e" / "sweep.json").exists()
        capsys.readouterr()
        assert lmledger(["sweep", str(path), "--out", "sweeps/e", "--dry-run"]) == 0
        assert "still running (pid 4242)" in capsys.readouterr().out
    assert lmledger(["sweep", str(path), "--out", "sweeps/e"]) == 0


def _wait_for(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its exit status waits to be collected


def _point_pid(lock: Path, not_pid: int | None = None) -> int | None:
    try:
        text = lock.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) != not_pid else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_point_dies_with_its_sweep_and_the_next_sweep_resumes_it(workdir, capsys):
    """SIGKILL the sweep after its fit point saved a checkpoint: the point dies too (it ran in its own
    process group, so nothing else would have stopped it), and the next sweep resumes it from the
    checkpoint into the same run directory, to the end."""
    config = (workdir / "configs" / "tiny.yaml").read_text()
    (workdir / "tiny5.yaml").write_text(config.replace("every_n_train_steps: 100", "every_n_train_steps: 5"))
    fixed = {
        "model.config.d_model": 32,
        "model.config.n_layers": 1,
        "model.config.n_heads": 2,
        "model.config.d_ff": 64,
        "model.config.context_length": 32,
        "trainer.max_steps": 100,
        "trainer.val_check_interval": 100,
        "trainer.limit_val_batches": 1,
        "trainer.log_every_n_steps": 5,
    }
    path = write_experiment(
        workdir / "k.yaml", command="fit", configs=["tiny5.yaml"], fixed=fixed, grid={"data.batch_size": [4]}
    )
    point = load_experiment(path).points[0]
    out = workdir / "sweeps" / "k"
    lock = out / "points" / point.id / "lock"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "lmledger.cli", "sweep", str(path), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pid = _wait_for(lambda: _point_pid(lock), "the point to start")
        assert os.getpgid(pid) == pid != os.getpgid(sweep.pid)  # its own process group
        _wait_for(lambda: list((out / "runs" / point.id).glob("version_*/checkpoints/*.ckpt")), "a checkpoint")
        sweep.kill()
        sweep.wait()
        # dead, and every thread of it gone: the lock is free (the main thread is a zombie a moment earlier)
        _wait_for(
            lambda: not _alive(pid) and launch.running_pid(out, point) is None,
            "the point to die with its sweep",
            timeout=60,
        )
    finally:
        sweep.kill()
        sweep.wait()
    assert json.loads((out / "points" / point.id / "status.json").read_text())["status"] == "running"
    (run_dir,) = (out / "runs" / point.id).iterdir()

    capsys.readouterr()
    assert lmledger(["sweep", str(path), "--out", str(out)]) == 0
    status = json.loads((out / "points" / point.id / "status.json").read_text())
    assert status["status"] == "done" and status["argv"][-2:] == ["--ckpt_path", "last"]
    assert status["run_dir"] == str(run_dir) and [run_dir] == list((out / "runs" / point.id).iterdir())
    from conftest import read_scalars

    losses = read_scalars(run_dir)["train/loss"]
    assert losses[-1][0] >= 95  # trained to the end (100 steps, a loss logged every 5)
    assert float(status["metrics"]["train/loss"]) == pytest.approx(losses[-1][1], rel=1e-6)


@pytest.mark.parametrize("code", [143, -signal.SIGTERM, 130])
def test_a_point_stopped_by_a_signal_is_interrupted_and_resumed_from_its_checkpoint(workdir, monkeypatch, code):
    """A point that exits 143 (a fit saved last.ckpt on SIGTERM), or dies of SIGTERM, or exits 130 (Ctrl-C)
    is recorded interrupted, not done; the next sweep runs it again with `--ckpt_path last` when its run
    directory holds a checkpoint, and from the start when it does not."""
    launched: list[list[str]] = []
    exits = iter([code, code, 0])

    def fake_point(args):  # the point's process: exit with the code under test, then succeed
        launched.append(args)
        status = next(exits)
        kill = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)" if status < 0 else ""
        return [sys.executable, "-c", f"{kill}\nimport sys; sys.exit({max(status, 0)})"]

    monkeypatch.setattr(launch, "point_command", fake_point)
    monkeypatch.setattr(launch, "check_points", lambda e: CheckedPoints({}, {}))
    path = write_experiment(
        workdir / "e.yaml", command="fit", configs=["configs/tiny.yaml"], grid={"seed_everything": [1]}
    )
    experiment = load_experiment(path)
    out = workdir / "sweeps" / "e"
    (result,) = launch.run_sweep(experiment, out)
    assert result.status == "interrupted" and "the next sweep runs it again" in result.error
    assert json.loads((out / "points" / result.point.id / "status.json").read_text())["status"] == "interrupted"

    (result,) = launch.run_sweep(experiment, out)  # no checkpoint yet: from the start
    assert "--ckpt_path" not in launched[1]
    checkpoints = out / "runs" / result.point.id / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"")
    (result,) = launch.run_sweep(experiment, out)
    assert launched[2][-2:] == ["--ckpt_path", "last"] and result.status == "done"
    assert result.reused is False and launch.run_sweep(experiment, out)[0].reused  # done is done


def test_sigterm_to_the_sweep_stops_its_points_and_records_them_interrupted(workdir, capsys, monkeypatch):
    """A scheduler preempting the sweep (SIGTERM) reaches the points too, though they run in their own
    process groups; the sweep waits for them, records them interrupted and exits 143."""
    started = []

    def sleeping_point(args):
        started.append(args)
        return [sys.executable, "-c", "import time; time.sleep(120)"]

    monkeypatch.setattr(launch, "point_command", sleeping_point)
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    point = load_experiment(path).points[0]
    lock = workdir / "sweeps" / "e" / "points" / point.id / "lock"

    def preempt():
        pid = _wait_for(lambda: _point_pid(lock), "the point to start", timeout=60)
        os.kill(os.getpid(), signal.SIGTERM)  # to the sweep (this process) alone, not to the point's group
        return pid

    pids = []
    timer = threading.Thread(target=lambda: pids.append(preempt()))
    timer.start()
    capsys.readouterr()
    assert lmledger(["sweep", str(path), "--out", "sweeps/e"]) == 143
    timer.join()
    assert "stopped by SIGTERM" in capsys.readouterr().err
    status = json.loads((lock.parent / "status.json").read_text())
    assert status["status"] == "interrupted" and "SIGTERM" in status["error"]
    assert not _alive(pids[0]) and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ------------------------------------------------------------------------------------- a full disk


REAL_FSYNC = os.fsync


def test_a_full_disk_during_a_sweep_is_one_line_and_the_old_results_are_intact(workdir, capsys, monkeypatch):
    path = write_experiment(workdir / "e.yaml", points=[PLAN, {**PLAN, "num-gpus": 8}])
    assert lmledger(["sweep", str(path), "--out", "sweeps/e"]) == 0
    out = workdir / "sweeps" / "e"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    err = one_error_line(capsys, str(path), "--out", "sweeps/e")
    assert err.endswith(f"no space left on device while writing {Path('sweeps/e/results.csv')}; "
                        "the previous results.csv is intact")  # fmt: skip
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # no temp file either

    err = one_error_line(capsys, str(path), "--out", "sweeps/new")
    assert err.endswith("no space left on device while writing sweeps/new/sweep.json; nothing was written")
    monkeypatch.setattr(os, "fsync", REAL_FSYNC)


def test_a_long_dry_run_listing_is_plain_aligned_columns():
    from lmledger.sweep.listing import plain_table

    text = plain_table(
        ("point", "would", "peak MB"), [("a-1", "run", "1.50"), ("long-point-2", "fail: x", "12,345.00")], 2
    )
    header, rule, *rows = text.splitlines()
    assert rule.split() == ["-" * 12, "-" * 7, "-" * 9]
    assert [row.index("run") if "run" in row else row.index("fail") for row in rows] == [14, 14]  # left-aligned
    assert {len(row) for row in rows} == {len(header)} and rows[0].endswith("     1.50")  # right-aligned numbers
