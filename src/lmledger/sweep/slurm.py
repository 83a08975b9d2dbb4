"""`lmledger sweep EXPERIMENT.yaml --launcher slurm`: the points as the tasks of one SLURM job array.

Why `sbatch --array` directly, not submitit? submitit is not installed with the kit. It would be one
more dependency for a handful of sbatch lines. It pickles a Python callable per task, where a point is
already a command line. It reads job states from `sacct`, which a cluster without accounting lacks
(our CI's does).

Before anything is queued, each point's predicted peak is held against what the job asks for.
(The prediction is the one `--plan` and `lmledger account` give: per rank at the point's world size,
num_nodes x devices, from the per-rank dry run where account uses it, ledger.sharding.sharded.) CPU jobs: `--mem`,
which is per node, so a node's ranks each need theirs. `--gres=gpu:TYPE:N`: the GPU's memory, per rank.
A point that cannot fit is refused in one line. Without `--mem`, the largest point's need sets it
(sweep.slurmfit, the fit check).

A point whose trainer asks for several nodes (`trainer.num_nodes: 2`) cannot share an array with one-node
points: an array's tasks all ask for the same resources. Points are queued as one array per shape. A
multi-node array asks `--nodes N --ntasks-per-node D` (D = trainer.devices) and `srun`s the task, one
process a rank, as Lightning's SLURM environment expects; rank 0 keeps the point's status and logs, rank R
its own points/<id>/rank<R>.stdout.log and .stderr.log. A one-node point runs as before: one task, and
Lightning starts its devices' ranks itself.

out_dir/slurm/ holds each submission. array-N.sh is the batch script. tasks-N.json maps task index ->
point and its command line. experiment-N.yaml is the experiment file as submitted: the tasks read it,
so an edit of the original while they are pending changes nothing they run. logs/ has SLURM's own
--output, one file per task. Every value in array-N.sh is quoted for its reader: shlex for the shell
lines, sbatch's own quoting for the #SBATCH lines (directive()); a value no #SBATCH line can carry (a
newline) is refused in one line before anything is written. An sbatch refusal removes what the
submission wrote: the files, sweep.json if it was new, and the folders it made.

The #SBATCH lines' quoting and refusals are sweep.slurmscript's.

A task runs `python -m lmledger.sweep slurm-task TASKS.json INDEX` (sweep.slurmtask), exec'd so SLURM's signals
reach it.
It records points/<id>/status.json: "running", then done/failed/interrupted, as a local point does.
It sends the point's stdout and stderr to points/<id>/stdout.log and stderr.log.

Statuses: squeue says which tasks are pending or running. (Without accounting, a finished job leaves
squeue, and `sacct` knows nothing.) A point's own status.json says how it ended. A task that left the
queue without one is failed with the last error line of its SLURM log (ended_result). A re-run submits
only the points that are neither done nor in the queue.

A fit point runs with `--ckpt_path auto`, so a requeued task resumes its own run
(preemption, time limit).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.sweep.collect import PointResult
from lmledger.sweep.launch import (
    SWEEP_RECORD,
    SweepWork,
    claim_out_dir,
    plan_sweep,
    resumable,
    saved_status,
    status_path,
)
from lmledger.sweep.report import write_results
from lmledger.sweep.slurmfit import memory_request
from lmledger.sweep.slurmscript import SlurmRequest, directive, output_pattern
from lmledger.sweep.spec import Experiment, Point, cli_args, load_experiment

__all__ = ["ended_result", "in_queue", "require_slurm", "run_slurm_sweep"]


# squeue states in which a task still holds or waits for a node (squeue --states=all would add finished ones).
_ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"}  # fmt: skip
_POLL_S = 2.0


def require_slurm() -> None:
    """SLURM's client tools on PATH, or one line naming the missing ones."""
    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise UserError(
            f"--launcher slurm needs SLURM's {' and '.join(missing)} on PATH, and this machine has "
            f"{'neither' if len(missing) > 1 else 'no ' + missing[0]}: run the sweep on a SLURM login node, or "
            "use --launcher local"
        )


# ------------------------------------------------------------------------------------- the queue


def _queued_tasks(array_jobs: set[str]) -> dict[str, str]:
    """ "JOB_TASK" -> state, for each task of these array jobs that squeue still lists (pending, running)."""
    if not array_jobs:
        return {}
    try:
        done = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(sorted(array_jobs))],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise UserError(f"squeue failed ({err}); is SLURM's controller reachable?") from None
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise UserError(f"squeue failed: {' '.join(done.stderr.split()) or done.returncode}")
    states = {}
    for line in done.stdout.splitlines():
        task, _, state = line.strip().partition(" ")
        if state in _ACTIVE_STATES:
            states[task] = state
    return states


def in_queue(out_dir: Path, points: list[Point]) -> dict[str, str]:
    """Point id -> SLURM task ("JOB_TASK"), for points whose task is pending or running now."""
    tasks = {p.id: saved_status(out_dir, p).get("slurm_task") for p in points}
    tasks = {pid: t for pid, t in tasks.items() if t}
    active = _queued_tasks({t.split("_")[0] for t in tasks.values()})
    return {pid: task for pid, task in tasks.items() if task in active}


def _refuse_beyond_every_node(request: SlurmRequest, groups: list) -> None:
    """One line when a task asks a node for more CPUs than any node of its partition has: SLURM queues such an
    array, and it pends forever. The node sizes are sinfo's; where sinfo cannot say, sbatch decides."""
    if request.cpus_per_task is None or not groups:
        return
    sizes = _node_cpus(request.partition)
    for group in groups:
        tasks = group.per_node if group.nodes > 1 else 1  # a one-node point is one task; its ranks are its processes
        need = request.cpus_per_task * tasks
        if sizes and need > max(sizes):
            where = f"partition {request.partition}" if request.partition else "the default partition"
            per = f" ({tasks} tasks of {request.cpus_per_task})" if tasks > 1 else ""
            raise UserError(
                f"--cpus-per-task {request.cpus_per_task}: a node would need {need} CPUs{per}, but the largest node of "
                f"{where} has {max(sizes)} (sinfo), so the array would pend forever; ask for at most "
                f"{max(sizes) // tasks}, or a partition with larger nodes; nothing was queued"
            )


def _node_cpus(partition: str | None) -> list[int]:
    """The CPU count of each node of `partition` (a comma-separated list; None: the default one), from sinfo;
    [] when sinfo cannot say."""
    try:
        done = subprocess.run(["sinfo", "--noheader", "--Node", "--format", "%c %P"], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    sizes = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        cpus, _, name = line.strip().partition(" ")
        ours = name.endswith("*") if partition is None else name.rstrip("*") in partition.split(",")
        if ours and cpus.isdigit():
            sizes.append(int(cpus))
    return sizes


class _NothingQueued(UserError):
    """sbatch refused the array (or its files could not be written), and _submit removed what it wrote."""


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and each parent of it that does not exist yet, deepest first: what a refusal removes again."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


def _remove_made(files: list[Path], folders: list[Path]) -> None:
    """Undo a refused submission: the files it wrote, then the folders it made, each only while empty."""
    for path in files:
        path.unlink(missing_ok=True)
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty: someone else's files are in it, and so in its parents


def _freeze_experiment(experiment: Experiment, points: list[Point], frozen: Path) -> None:
    """Copy the experiment file to `frozen`, which the tasks read: an edit of the original while they
    are pending changes nothing they run. The copy must hold the points being submitted (it is read
    after them, so the file may have been edited in between)."""
    try:
        text = Path(experiment.source).read_bytes()
    except OSError as err:
        raise UserError(f"cannot read the experiment file {experiment.source} to submit it ({err.strerror})") from None
    atomic_write(frozen, text)
    ids = {p.id for p in load_experiment(frozen).points}
    if missing := [p.id for p in points if p.id not in ids]:
        raise UserError(
            f"{experiment.source} changed while the sweep was being submitted (point {missing[0]} is gone from "
            "it); nothing was queued: run the sweep again"
        )


def _submit(experiment: Experiment, out_dir: Path, points: list[Point], request: SlurmRequest, jobs: int,
           mem_mib: int | None, nodes: int = 1, per_node: int = 1) -> str:  # fmt: skip
    """sbatch one array over `points`; returns its job id. Each point's status.json says "queued" in task i.

    nodes > 1: each task asks for `nodes` nodes of `per_node` tasks, and the batch shell srun's the point's
    task_main once a rank.

    A refusal (sbatch's, or a failed write) removes every file and folder this call made, and raises
    _NothingQueued."""
    slurm_dir = out_dir / "slurm"
    n = 1 + max([int(m.group(1)) for p in slurm_dir.glob("array-*.sh") if (m := re.search(r"-(\d+)\.sh$", p.name))]
                or [0])  # fmt: skip
    logs = (slurm_dir / "logs").resolve()
    output = output_pattern(logs)  # before anything is written
    record, path = slurm_dir / f"tasks-{n}.json", slurm_dir / f"array-{n}.sh"
    frozen = slurm_dir / f"experiment-{n}.yaml"  # the experiment as submitted: what the tasks read
    made = _missing_dirs(slurm_dir / "logs")
    try:
        tasks = {}
        for index, point in enumerate(points):
            args = cli_args(point, out_dir)
            if point.subcommand == "fit":
                # A requeued task resumes its own run; a point an earlier sweep left interrupted resumes that run.
                args += ["--ckpt_path", "last" if resumable(out_dir, point) else "auto"]
            tasks[str(index)] = {"point": point.id, "argv": args}
        (slurm_dir / "logs").mkdir(parents=True, exist_ok=True)
        _freeze_experiment(experiment, points, frozen)
        atomic_write(record, json.dumps({
            "experiment": str(frozen.resolve()), "source": str(Path(experiment.source).resolve()),
            "out_dir": str(out_dir.resolve()), "tasks": tasks,
        }, indent=1) + "\n")  # fmt: skip
        throttle = f"%{jobs}" if jobs else ""
        task = (f"{shlex.quote(sys.executable)} -m lmledger.sweep slurm-task {shlex.quote(str(record.resolve()))} "
                '"$SLURM_ARRAY_TASK_ID"')  # fmt: skip
        if nodes > 1:
            shape = [f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={per_node}"]
            # srun starts a task_main a rank (SLURM_PROCID); --kill-on-bad-exit: a rank that dies ends the others,
            # so none is left waiting in a collective. exec: SLURM's signals reach srun, which passes them on.
            run = [f"exec srun --kill-on-bad-exit=1 {task}"]
        else:
            shape = []
            run = ["# exec: the task is the batch shell, so SLURM's signals (SIGTERM, --signal=B:USR1) reach it",
                   f"exec {task}"]  # fmt: skip
        script = "\n".join([
            "#!/bin/bash",
            directive("job-name", f"lmledger-{experiment.name}"),
            f"#SBATCH --array=0-{len(points) - 1}{throttle}",
            directive("output", output),
            "#SBATCH --open-mode=append",  # a requeued task adds to its log
            "#SBATCH --requeue",
            *shape,
            *request.sbatch_lines(mem_mib),
            # The shell, not a directive, changes directory: a shell-quoted path may hold any character.
            f"cd -- {shlex.quote(str(Path.cwd()))} || exit 1",
            *run,
            "",
        ])  # fmt: skip
        atomic_write(path, script.encode("utf-8", "surrogateescape"))  # a path's own bytes, even if not UTF-8
    except BaseException as err:
        _remove_made([path, record, frozen], made)
        if isinstance(err, UserError):
            raise _NothingQueued(str(err)) from None
        raise
    try:
        done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise UserError(
            f"sbatch {path} did not answer in 120 s, and may have queued the array: see `squeue -n "
            f"lmledger-{experiment.name}` before running the sweep again"
        ) from None
    except (OSError, subprocess.SubprocessError) as err:
        _remove_made([path, record, frozen], made)
        raise _NothingQueued(f"sbatch could not be run ({err}); nothing was queued") from None
    if done.returncode != 0:
        _remove_made([path, record, frozen], made)
        said = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise _NothingQueued(f"sbatch refused the array: {said}; nothing was queued, and nothing was left behind")
    job = done.stdout.strip().split(";")[0]
    for index, point in enumerate(points):
        if saved_status(out_dir, point).get("slurm_task") == f"{job}_{index}":
            continue  # the task started (or even ended) already, and its status is newer than "queued"
        atomic_write(status_path(out_dir, point), json.dumps({
            "point": point.id, "status": "queued", "slurm_task": f"{job}_{index}", "argv": tasks[str(index)]["argv"],
        }, indent=1) + "\n")  # fmt: skip
    return job


def run_slurm_sweep(
    experiment: Experiment,
    out_dir: Path,
    request: SlurmRequest,
    jobs: int = 0,
    on_done: Callable[[PointResult], None] | None = None,
    on_submit: Callable[[str, int, int | None], None] | None = None,
    plan: SweepWork | None = None,
    poll_s: float = _POLL_S,
) -> list[PointResult]:
    """Submit the points neither done nor queued as one array, and wait for them. One result per point.

    It waits until none is queued or running. Then it writes results.csv, results.md and the plots,
    as the local launcher does."""
    require_slurm()
    plan = plan_sweep(experiment, out_dir) if plan is None else plan
    queued = in_queue(out_dir, plan.pending)
    to_submit = [p for p in plan.pending if p.id not in queued]
    groups = memory_request(experiment, to_submit, request) if to_submit else []  # every refusal before any sbatch
    _refuse_beyond_every_node(request, groups)
    if to_submit:
        output_pattern((out_dir / "slurm" / "logs").resolve())  # a path no #SBATCH line can carry: before any write
    made = _missing_dirs(out_dir)
    claimed = claim_out_dir(experiment, out_dir)
    results = dict(plan.results)
    submitted: list[str] = []
    for group in groups:
        try:
            job = _submit(experiment, out_dir, list(group.points), request, jobs, group.mem_mib, group.nodes,
                          group.per_node)  # fmt: skip
        except _NothingQueued as refused:
            if submitted:  # the arrays queued before it stay queued: the same command later queues only the rest
                raise UserError(
                    f"{refused} (the array of {len(group.points)} point(s) on {group.nodes} nodes); "
                    f"job array(s) {', '.join(submitted)} of this sweep stay queued: fix it and run the same "
                    "command again, which queues only the rest"
                ) from None
            # A refusal leaves nothing: the sweep's record if this call wrote it, and the folders it made.
            _remove_made([out_dir / SWEEP_RECORD] if claimed else [], made)
            raise
        submitted.append(job)
        if on_submit:
            on_submit(job, len(group.points), group.mem_mib)
    if on_done:
        for point in experiment.points:
            if point.id in results:
                on_done(results[point.id])
    waiting = {p.id: p for p in plan.pending}
    while waiting:
        active = in_queue(out_dir, list(waiting.values()))
        for pid in [pid for pid in waiting if pid not in active]:
            point = waiting.pop(pid)
            result = ended_result(out_dir, point)
            results[pid] = result
            if on_done:
                on_done(result)
        if waiting:
            time.sleep(poll_s)
    ordered = [results[p.id] for p in experiment.points]
    write_results(experiment, ordered, out_dir)
    return ordered


# A line that says why a task died. SLURM's own (`slurmstepd: error: *** JOB 12 ON node CANCELLED AT ... DUE
# TO TIME LIMIT ***`, `... oom_kill event ...`), the last line of a Python traceback (`StopIteration`,
# `ValueError: ...`), or any line that says "error".
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Iteration|Warning)\b(:.*)?")
_CAUSE_CHARS = 300  # a cause is quoted in one line of the summary; longer ones are cut


def last_error_line(text: str) -> str:
    """The last line of a log that says why the process died, or "" when none does."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and (_EXCEPTION_LINE.fullmatch(line) or "error" in line.lower() or "killed" in line.lower()):
            return line if len(line) <= _CAUSE_CHARS else line[: _CAUSE_CHARS - 3] + "..."
    return ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def ended_result(out_dir: Path, point: Point) -> PointResult:
    """A point whose task left the queue: its status.json, or "failed" with the cause its logs give.

    The cause is the last error line of the task's SLURM log (SLURM's own messages, and anything the
    task printed before its point's logs were open), else of the point's stderr.log."""
    saved = saved_status(out_dir, point)
    if saved.get("status") in ("done", "failed", "interrupted"):
        return PointResult(point, saved["status"], saved.get("metrics", {}), saved.get("error", ""),
                           saved.get("seconds"), saved.get("run_dir"), argv=saved.get("argv", []),
                           output=saved.get("output"))  # fmt: skip
    task = saved.get("slurm_task", "?")
    job, _, index = task.partition("_")
    log = out_dir / "slurm" / "logs" / f"{job}_{index}.out"
    stderr = status_path(out_dir, point).parent / "stderr.log"
    slurm_text = _read(log)
    # A requeued task appends to its log (--open-mode=append): read only its last start's part.
    starts = [m.start() for m in re.finditer(r"^lmledger sweep: point ", slurm_text, re.M)]
    slurm_text = slurm_text[starts[-1] :] if starts else slurm_text
    if cause := last_error_line(slurm_text) or (saved.get("status") == "running" and last_error_line(_read(stderr))):
        error = f"SLURM task {task} ended without a result: {cause} (the last error in {log})"
    elif slurm_text.strip():
        error = f"SLURM task {task} ended without a result, and its log names no error: see {log}"
    else:
        error = (f"SLURM task {task} ended without a result or a log: cancelled (or refused a node) before it "
                 f"started; {log} does not exist")  # fmt: skip
    return PointResult(point, "failed", error=error, argv=saved.get("argv", []))
