"""_Running a checked sweep, each point through the real CLI in its own process.

Results live in one directory:

    runs/<point-id>/        TensorBoard, one parent for all points
    points/<point-id>/      status.json, stdout.log, stderr.log, lock
    results.csv, results.md and the PNGs

Every point's arguments are parsed before any point runs (check.py, nothing built). A point runs in
its own session and process group. It is sent SIGTERM when the sweep dies, even by SIGKILL. A held
lock on points/<id>/lock tells a later sweep that it is still running. A training point stopped by
SIGTERM (exit 143) is `interrupted`. The next sweep resumes it with `--ckpt_path last`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from lmledger.atomic import atomic_write, write_error
from lmledger.errors import UserError
from lmledger.lifetime import die_with_parent
from lmledger.sweep.check import bad_points_error, check_points
from lmledger.sweep.collect import PointResult, newest_run_dir, output_tags, read_tensorboard
from lmledger.sweep.report import write_results
from lmledger.sweep.spec import TRAINING_COMMANDS, Experiment, Point, cli_args

__all__ = [
    "SWEEP_RECORD",
    "SweepWork",
    "check_out_dir",
    "claim_out_dir",
    "cuda_available",
    "finished_result",
    "plan_sweep",
    "point_command",
    "point_main",
    "point_outcome",
    "resumable",
    "run_point",
    "run_sweep",
    "running_pid",
    "saved_status",
    "status_path",
]

# Exit codes of a point stopped by a signal it handled: 128 + signal number, as the shell reports them.
# And the negative codes subprocess gives for one it did not handle.
_INTERRUPTED_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)


def _write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=1, default=str) + "\n")


def status_path(out_dir: Path, point: Point | str) -> Path:
    """points/<id>/status.json of a point (or of a point id)."""
    return out_dir / "points" / (point if isinstance(point, str) else point.id) / "status.json"


def _lock_path(out_dir: Path, point: Point) -> Path:
    return out_dir / "points" / point.id / "lock"


def saved_status(out_dir: Path, point: Point) -> dict:
    try:
        saved = json.loads(status_path(out_dir, point).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def finished_result(out_dir: Path, point: Point) -> PointResult | None:
    """The point's result if an earlier invocation finished it. Failed and interrupted points run again."""
    saved = saved_status(out_dir, point)
    if saved.get("status") != "done":
        return None
    return PointResult(
        point,
        "done",
        saved.get("metrics", {}),
        "",
        saved.get("seconds"),
        saved.get("run_dir"),
        reused=True,
        argv=saved.get("argv", []),
        output=saved.get("output"),
    )


def resumable(out_dir: Path, point: Point) -> bool:
    """Whether the point's next run continues its last one (`--ckpt_path last`).

    It does for a fit stopped by a signal, or whose sweep died under it ("running"). Its newest run
    directory must hold a checkpoint.
    """
    if point.subcommand != "fit" or saved_status(out_dir, point).get("status") not in ("interrupted", "running"):
        return False
    run_dir = newest_run_dir(out_dir, point)
    return run_dir is not None and any((run_dir / "checkpoints").glob("*.ckpt"))


def running_pid(out_dir: Path, point: Point) -> int | None:
    """The pid of the point's process that holds its lock, from this or an earlier sweep; else None."""
    path = _lock_path(out_dir, point)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _check_nothing_running(experiment: Experiment, out_dir: Path) -> None:
    for point in experiment.points:
        pid = running_pid(out_dir, point)
        if pid is not None:
            kill = f" (kill {pid})" if pid > 0 else ""
            raise UserError(
                f"point {point.id} of {out_dir} is still running (pid {pid}), from an earlier `lmledger sweep`: "
                f"wait for it to finish or stop it{kill}, then run the sweep again"
            )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _subprocess_env(jobs: int) -> dict[str, str]:
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        # N torch processes each spawning a thread per core would oversubscribe the CPU N times.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


class _Running:
    """The point processes running now, for a stopping sweep to stop.

    They are in their own process groups, out of reach of the terminal's Ctrl-C.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.stopping = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)
            stop = self.stopping
        if stop:
            _signal_group(proc, signal.SIGTERM)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop_all(self) -> None:
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the point and whatever it started (start_new_session: pgid == pid)
    except (ProcessLookupError, PermissionError):
        pass


def point_command(args: list[str]) -> list[str]:
    """The process of a point: `lmledger ARGS`, through point_main so it dies with this process."""
    return [sys.executable, "-m", "lmledger.sweep", "point", str(os.getpid()), *args]


def run_point(point: Point, out_dir: Path, jobs: int = 1, running: _Running | None = None) -> PointResult:
    """Run one point through the real CLI in its own process group. Record its status atomically."""
    import fcntl

    logs = status_path(out_dir, point).parent
    args = cli_args(point, out_dir)
    if resumable(out_dir, point):
        args += ["--ckpt_path", "last"]
    argv = point_command(args)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        lock = os.open(_lock_path(out_dir, point), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise write_error(err, _lock_path(out_dir, point)) from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return PointResult(point, "failed", error="already running (another sweep holds its lock)", argv=args)
        _write_json(status_path(out_dir, point), {"point": point.id, "status": "running", "argv": args})
        start = time.perf_counter()
        try:
            stdout, stderr = open(logs / "stdout.log", "w"), open(logs / "stderr.log", "w")
        except OSError as err:
            raise write_error(err, logs / "stdout.log") from None
        with stdout, stderr:
            # The child inherits the locked descriptor. The lock is held as long as the point (or anything
            # it started) lives, whatever happens to this process.
            proc = subprocess.Popen(
                argv,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=_subprocess_env(jobs),
                start_new_session=True,
                pass_fds=(lock,),
            )
            if running is not None:
                running.add(proc)
            try:
                os.ftruncate(lock, 0)
                os.pwrite(lock, f"{proc.pid}\n".encode(), 0)
            except OSError:
                pass  # the pid is for the message only
            try:
                code = proc.wait()
            finally:
                if running is not None:
                    running.discard(proc)
    finally:
        os.close(lock)
    outcome = point_outcome(point, out_dir, code, time.perf_counter() - start, args)
    _write_json(status_path(out_dir, point), outcome.to_json())
    return outcome


def point_outcome(point: Point, out_dir: Path, code: int, seconds: float | None, args: list[str]) -> PointResult:
    """A finished point's result, the same for either launcher.

    It comes from its exit code and logs (points/<id>/stdout.log, stderr.log). For fit and validate,
    also from its newest run directory's TensorBoard events.
    """
    logs = status_path(out_dir, point).parent
    out_text = (logs / "stdout.log").read_text(errors="replace")
    status, error, metrics, output = "done", "", {}, None
    run_dir = newest_run_dir(out_dir, point) if point.subcommand in TRAINING_COMMANDS else None
    if code in _INTERRUPTED_CODES:
        status = "interrupted"
        name = signal.Signals(-code if code < 0 else code - 128).name
        resumes = ", from its last checkpoint if it saved one" if point.subcommand == "fit" else ""
        error = f"stopped by {name} (exit code {code}); the next sweep runs it again{resumes}"
    elif code != 0:
        status = "failed"
        error = _last_line((logs / "stderr.log").read_text(errors="replace"))
        if code < 0:  # killed by a signal: SIGKILL is what the kernel's OOM killer sends
            reason = "out of memory?" if code == -9 else "signal"
            error = f"killed by signal {-code} ({reason}){': ' + error if error else ''}"
        error = error or f"exit code {code}"
    elif point.subcommand in TRAINING_COMMANDS:
        metrics = read_tensorboard(run_dir) if run_dir else {}
    else:
        try:
            output = json.loads(_last_line(out_text))
        except ValueError:
            status, error = "failed", "printed no JSON object on stdout (see its stdout.log)"
        else:
            metrics = output_tags(output)  # account's figures under fit's TensorBoard tags
    return PointResult(
        point, status, metrics, error, seconds, str(run_dir) if run_dir else None, argv=args, output=output
    )


def point_main(argv: list[str], run_command: Callable[[list[str]], int]) -> int:
    """The process of one point: `python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS...`.

    `run_command` is the lmledger command line's main. The entry point passes it: commands sit above sweeps.
    A point on several devices is this command line again in each rank Lightning starts (its subprocess
    launcher sets LOCAL_RANK >= 1 in theirs): such a rank dies with rank 0, its parent, not with the sweep.
    """
    parent = int(argv[0])
    if int(os.environ.get("LOCAL_RANK") or 0) > 0:
        parent = os.getppid()
    die_with_parent(parent)
    return run_command(argv[1:])


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


SWEEP_RECORD = "sweep.json"


def check_out_dir(experiment: Experiment, out_dir: Path) -> bool:
    """Whether out_dir is already this experiment's. Raises if it holds anything else's results."""
    record = out_dir / SWEEP_RECORD
    if record.is_file():
        try:
            owner = json.loads(record.read_text()).get("name")
        except ValueError:
            owner = None
        if owner != experiment.name:
            raise UserError(
                f"{out_dir} holds the results of sweep {owner!r}, not {experiment.name!r}: choose another --out"
            )
        return True
    for name in ("results.csv", "results.md"):
        if (out_dir / name).exists():
            raise UserError(f"{out_dir / name} exists and is not from a sweep: choose another --out")
    return False


def claim_out_dir(experiment: Experiment, out_dir: Path) -> bool:
    """Make out_dir this experiment's (sweep.json). True when this call wrote the record."""
    if check_out_dir(experiment, out_dir):
        return False
    _write_json(out_dir / SWEEP_RECORD, {"name": experiment.name, "experiment": str(experiment.source)})
    return True


@dataclass
class SweepWork:
    """What a checked sweep will do: results known already (reused, skipped), and the points to run."""

    results: dict[str, PointResult]
    pending: list[Point]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # point id -> (nodes, ranks per node)


def plan_sweep(experiment: Experiment, out_dir: Path) -> SweepWork:
    """Everything a sweep checks before it writes or runs anything.

    The results directory is this experiment's. No point of an earlier sweep still runs. Every point
    to run has good arguments.
    """
    check_out_dir(experiment, out_dir)
    _check_nothing_running(experiment, out_dir)
    have_gpu = cuda_available() if any(p.requires_gpu for p in experiment.points) else False
    results: dict[str, PointResult] = {}
    pending: list[Point] = []
    for point in experiment.points:
        if point.requires_gpu and not have_gpu:
            results[point.id] = PointResult(point, "skipped", error="needs a CUDA GPU; torch sees none")
        elif (done := finished_result(out_dir, point)) is not None:
            results[point.id] = done
        else:
            pending.append(point)
    checked = check_points(replace(experiment, points=tuple(pending)))
    if checked.errors:
        raise bad_points_error(experiment, checked.errors)
    return SweepWork(results, pending, checked.shapes)


def run_sweep(
    experiment: Experiment,
    out_dir: Path,
    jobs: int = 1,
    on_start: Callable[[Point], None] | None = None,
    on_done: Callable[[PointResult], None] | None = None,
    plan: SweepWork | None = None,
) -> list[PointResult]:
    """Run every unfinished point of a checked sweep, `jobs` at a time; one result per point, in order.

    The sweep is checked by plan_sweep, unless `plan` is given. Finished points are skipped, and
    GPU-only ones without a GPU. Then it writes results.csv, results.md and the plots.
    """
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    plan = plan_sweep(experiment, out_dir) if plan is None else plan
    results, pending = dict(plan.results), plan.pending
    for point in pending:
        nodes = plan.shapes.get(point.id, (1, 1))[0]
        if nodes > 1 and point.subcommand in TRAINING_COMMANDS:
            # Node 0 alone would wait at the rendezvous for nodes that are never started.
            raise UserError(
                f"point {point.id} asks for {nodes} nodes (trainer.num_nodes), and the local launcher runs each point "
                "on this machine alone: use --launcher slurm, which queues it on that many nodes; nothing was run"
            )
    claim_out_dir(experiment, out_dir)
    if on_done:
        for point in experiment.points:
            if point.id in results:
                on_done(results[point.id])

    running = _Running()

    def work(point: Point) -> PointResult:
        if running.stopping:
            return PointResult(point, "interrupted", error="not started: the sweep was stopped")
        if on_start:
            on_start(point)
        return run_point(point, out_dir, jobs, running)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for future in as_completed([pool.submit(work, point) for point in pending]):
            result = future.result()
            results[result.point.id] = result
            if on_done:
                on_done(result)
    except BaseException:
        # Ctrl-C, SIGTERM or a failed write: stop the running points, start no new ones, wait for them.
        # On SIGTERM a fit saves last.ckpt and is recorded interrupted. The next sweep resumes them.
        running.stop_all()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    ordered = [results[p.id] for p in experiment.points]
    write_results(experiment, ordered, out_dir)
    return ordered
