"""`lmledger sweep EXPERIMENT.yaml --launcher slurm`: the points as the tasks of one SLURM job array.

Why `sbatch --array` directly, not submitit? submitit is not installed with the kit. It would be one
more dependency for a handful of sbatch lines. It pickles a Python callable per task, where a point is
already a command line. It reads job states from `sacct`, which a cluster without accounting lacks
(our CI's does).

Before anything is queued, each point's predicted peak is held against what the job asks for.
(The prediction is the one `--plan` and `lmledger account` give: per rank at the point's world size,
num_nodes x devices, from the per-rank dry run where account uses it, ledger.sharded.) CPU jobs: `--mem`,
which is per node, so a node's ranks each need theirs. `--gres=gpu:TYPE:N`: the GPU's memory, per rank.
A point that cannot fit is refused in one line. Without `--mem`, the largest point's need sets it
(_need_bytes).

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

A task runs `python -m lmledger.sweep slurm-task TASKS.json INDEX`, exec'd so SLURM's signals reach it.
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
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.ledger.units import format_bytes
from lmledger.sweep.check import check_points
from lmledger.sweep.collect import PointResult
from lmledger.sweep.report import write_results
from lmledger.sweep.runner import (
    SWEEP_RECORD,
    SweepPlan,
    claim_out_dir,
    plan_sweep,
    point_outcome,
    resumable,
    saved_status,
    status_path,
)
from lmledger.sweep.spec import TRAINING_COMMANDS, Experiment, Point, cli_args, fit_args, load_experiment

__all__ = ["SlurmRequest", "ended_result", "in_queue", "require_slurm", "run_slurm_sweep", "task_main"]


_MIB = 1 << 20  # SLURM's --mem "M" (its default unit) is 2^20 bytes, as slurm.conf's RealMemory
# A CPU job's memory beside the predicted tensor peak: the Python process with torch and Lightning,
# its allocator's slack, and the data loader. `lmledger fit --config configs/tiny.yaml` (20 steps,
# 1.1 MB of predicted tensors) had a max RSS of 624 MiB (getrusage of the child; 2026-12-01, a shared
# 2-core CPU). 2 GiB leaves room for bigger imports (Hugging Face transformers) and loader workers.
_PROCESS_BYTES = 2 << 30
_PEAK_MARGIN = 1.25  # and a quarter over the predicted peak: the ledger's peaks are within 2% (tests)
# Seconds before a --time limit that SLURM sends SIGUSR1 (the kit saves, requeues and stops on it).
_SIGNAL_BEFORE_END_S = 120
# squeue states in which a task still holds or waits for a node (squeue --states=all would add finished ones).
_ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"}  # fmt: skip
_POLL_S = 2.0


# sbatch reads the #SBATCH lines of a script itself (src/sbatch/opt.c, _get_argument): a value may be
# double-quoted, with `\\` and `\"` escaped, so spaces, `;`, `$(...)`, backticks and `#` pass as written.
# But a line ends at a newline: the rest of a value with one would be a line of its own, and bash runs it.
# No partition, time, gres or path needs a newline or another control character, so those are refused.
# So is "hetjob" (or the older "packjob"), in any case: sbatch blanks that word out of an #SBATCH line and
# starts a heterogeneous job's next component at it.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)
_BARE = re.compile(r"[A-Za-z0-9_.,:/=@+-]+")  # written unquoted: what the cluster's own names look like


def check_directive_value(flag: str, value: str) -> None:
    """One line for a value no #SBATCH line can carry: a control character (a newline), sbatch's word
    "hetjob", or nothing."""
    if _CONTROL.search(value):
        raise UserError(
            f"{flag} {value!r} holds a control character (a newline, a tab...), which no #SBATCH line of the batch "
            "script can carry (sbatch reads those lines itself, one directive a line); give it without one"
        )
    if not value.strip():
        raise UserError(f"{flag} {value!r} is empty: give a value, or leave {flag} out for the cluster's default")
    if word := _HETJOB.search(value):
        raise UserError(
            f"{flag} {value!r} holds {word.group(0)!r}, which sbatch takes out of an #SBATCH line as the start of a "
            "heterogeneous job's next part; give it without that word"
        )


def directive(flag: str, value: object) -> str:
    """`#SBATCH --flag=value`, the value quoted as sbatch's directive parser reads it back.

    The value has passed check_directive_value."""
    text = str(value)
    if not _BARE.fullmatch(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"#SBATCH --{flag}={text}"


@dataclass(frozen=True)
class SlurmRequest:
    """What each task of the array asks SLURM for (None: the cluster's default).

    A value no #SBATCH line can carry is refused when the request is made, before anything is written."""

    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    gres: str | None = None

    def __post_init__(self) -> None:
        for name in ("partition", "time", "mem", "gres"):
            value = getattr(self, name)
            if value is not None:
                check_directive_value(f"--{name}", str(value))

    def sbatch_lines(self, mem_mib: int | None) -> list[str]:
        lines = []
        for flag, value in (("partition", self.partition), ("time", self.time), ("cpus-per-task", self.cpus_per_task),
                            ("gres", self.gres)):  # fmt: skip
            if value is not None:
                lines.append(directive(flag, value))
        if mem_mib is not None:
            lines.append(f"#SBATCH --mem={int(mem_mib)}M")
        if self.time is not None:
            lines.append(f"#SBATCH --signal=B:USR1@{_SIGNAL_BEFORE_END_S}")
        return lines


def output_pattern(logs: Path) -> str:
    """The --output pattern of the tasks' logs in `logs`: SLURM fills in %A_%a, so a '%' of the path is
    written '%%'. A backslash anywhere turns every pattern off (sbatch(1), filename pattern): refused."""
    text = str(logs)
    check_directive_value("--out", text)
    if "\\" in text:
        raise UserError(
            f"--out {text!r} holds a backslash, which turns off the %A_%a in SLURM's log names (sbatch's "
            "--output pattern); choose a results directory without one"
        )
    return text.replace("%", "%%") + "/%A_%a.out"


def require_slurm() -> None:
    """SLURM's client tools on PATH, or one line naming the missing ones."""
    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise UserError(
            f"--launcher slurm needs SLURM's {' and '.join(missing)} on PATH, and this machine has "
            f"{'neither' if len(missing) > 1 else 'no ' + missing[0]}: run the sweep on a SLURM login node, or "
            "use --launcher local"
        )


def _parse_mem(text: str) -> int:
    """Bytes of a `--mem` value, as sbatch reads it. A number with K, M (default), G or T (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--mem {text!r}: give a size as sbatch takes it, e.g. 8G, 8000M or 8000 (megabytes)")
    scale = {"K": 1 << 10, "": _MIB, "M": _MIB, "G": 1 << 30, "T": 1 << 40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def _gres_gpu(gres: str | None) -> tuple[str | None, int] | None:
    """(GPU type or None, count) of a `--gres gpu[:TYPE][:N]` request; None when it asks for no GPU."""
    if not gres:
        return None
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        rest = parts[1:]
        count = int(rest.pop()) if rest and rest[-1].isdigit() else 1
        return (rest[0] if rest else None), count
    return None


def _gres_gpu_spec(kind: str):
    """The kit's GPU entry for a gres type.

    Clusters name types their own way (`h100`, `a100`). A key of `lmledger gpus` is taken as it is.
    A prefix of several keys means the one with the least memory. (h100: the 80 GB SXM/PCIe, not the
    94 GB NVL.) So a point is never sent to a GPU it may not fit."""
    from lmledger.ledger.gpus import GPUS

    name = kind.lower().replace("_", "-")
    if name in GPUS:
        return GPUS[name]
    matches = [spec for key, spec in GPUS.items() if key.startswith(name + "-")]
    if not matches:
        raise UserError(
            f"--gres gpu:{kind}: no GPU of that type in the kit's table to hold the points' peaks against; name it "
            f"by a key of `lmledger gpus` ({', '.join(GPUS)}), or ask for gpu:N without a type (not checked)"
        )
    return min(matches, key=lambda spec: spec.memory_bytes)


def _need_bytes(peak: float) -> int:
    """A CPU task's --mem for a predicted peak of `peak` bytes: the margin over it, plus the process."""
    return int(math.ceil(peak * _PEAK_MARGIN)) + _PROCESS_BYTES


def _gb(n: float) -> str:
    """A memory request, as sizes the cluster is asked for (a peak is format_bytes: 4 digits, any size)."""
    return f"{n / 1e9:,.2f} GB"


@dataclass(frozen=True)
class _Shape:
    """Where a point's ranks run: `nodes` nodes of `per_node` ranks (trainer.num_nodes, trainer.devices)."""

    nodes: int = 1
    per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def words(self) -> str:
        """ "2 nodes x 1 rank" for the refusals; "" for one rank."""
        if self.world_size == 1:
            return ""
        ranks = f"{self.per_node} rank{'s' if self.per_node > 1 else ''}"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {ranks}"


@dataclass(frozen=True)
class _Group:
    """The points of one array: a shape, the --mem (MiB) each of its nodes asks for, and the points."""

    nodes: int  # > 1: --nodes, --ntasks-per-node and srun
    per_node: int
    mem_mib: int | None
    points: tuple[Point, ...]


def _fit_check(experiment: Experiment, points: list[Point]) -> tuple[dict[str, float], dict[str, _Shape]]:
    """Point id -> predicted peak bytes per rank at the point's shape (for points predictable without
    building), and point id -> its shape (every config-reading point; the rest run as one rank).

    The peak is what `lmledger account` (and `sweep --plan`) predicts for the point's arguments: at world size
    num_nodes x devices, one rank's dry run (ledger.sharded) where account traces the strategy (DDP over
    several ranks, FSDP2), else the closed forms."""
    from lmledger.accounting import account, traced_at_scale
    from lmledger.ledger.predict import predict

    checked = check_points(replace(experiment, points=tuple(points)))
    peaks, shapes = {}, {}
    for point in points:
        shapes[point.id] = _Shape(*checked.shapes.get(point.id, (1, 1)))
        spec = checked.specs.get(point.id)
        if spec is None:
            continue
        if traced_at_scale(spec):
            peak = account(spec, False, fit_args(point))["memory"]["peak"]["predicted"]
        else:
            peak = predict(spec).peak  # the closed forms: what account shows for it, in milliseconds
        if peak is not None:
            peaks[point.id] = float(peak)
    return peaks, shapes


def _per_rank(point: Point, shapes: dict[str, _Shape], each: str = "per rank") -> str:
    """ " per rank (2 nodes x 1 rank)" for a point on several ranks, else "" (" per GPU" for each="per GPU")."""
    words = shapes[point.id].words()
    return f" {each} ({words})" if words else f" {each}" if each != "per rank" else ""


def _memory_request(experiment: Experiment, points: list[Point], request: SlurmRequest) -> list[_Group]:
    """The arrays to queue: the points grouped by shape, each group with the --mem (MiB) its nodes ask for,
    after holding every point's predicted peak per rank, at its shape, against the request.

    A point that cannot fit is refused in one line, before anything is queued."""
    peaks, shapes = _fit_check(experiment, points)

    def node_need(point: Point) -> int:  # --mem is per node: each of its ranks needs its own process and peak
        return shapes[point.id].per_node * _need_bytes(peaks[point.id])

    gpu = _gres_gpu(request.gres)
    asked = None if request.mem is None else _parse_mem(request.mem)
    if gpu is not None and gpu[0] is not None:
        spec = _gres_gpu_spec(gpu[0])
        for point in points:
            if peaks.get(point.id, 0) > spec.memory_bytes:
                peak = format_bytes(peaks[point.id])
                raise UserError(
                    f"point {point.id}: predicted peak {peak}{_per_rank(point, shapes, 'per GPU')} "
                    f"does not fit the {_gb(spec.memory_bytes)} of a {spec.name} (--gres {request.gres}); nothing "
                    "was queued: shrink the point or ask for a larger GPU"
                )
    elif gpu is None and asked is not None:
        for point in points:
            if point.id in peaks and node_need(point) > asked:
                per_node = shapes[point.id].per_node
                ranks = f", x {per_node} ranks a node: {_gb(node_need(point))}" if per_node > 1 else ""
                raise UserError(
                    f"point {point.id}: predicted peak {format_bytes(peaks[point.id])}{_per_rank(point, shapes)} "
                    f"(+{_PEAK_MARGIN - 1:.0%} and {_gb(_PROCESS_BYTES)} for the process: "
                    f"{_gb(_need_bytes(peaks[point.id]))}{ranks}) does not fit --mem {request.mem} ({_gb(asked)}); "
                    "nothing was queued: ask for more, or leave --mem out and the prediction sets it"
                )
    by_shape: dict[tuple[int, int], list[Point]] = {}
    for point in points:
        shape = shapes[point.id]
        # Several nodes: one SLURM task a rank (srun). One node: one task; Lightning starts the ranks itself.
        many = shape.nodes > 1 and point.subcommand in TRAINING_COMMANDS
        by_shape.setdefault((shape.nodes, shape.per_node) if many else (1, 1), []).append(point)
    groups = []
    for (nodes, per_node), members in sorted(by_shape.items()):
        if asked is not None:
            mem = max(1, asked // _MIB)
        elif gpu is not None or not any(p.id in peaks for p in members):
            mem = None  # a GPU job, or nothing predicted: the cluster's default
        else:
            mem = math.ceil(max(node_need(p) for p in members if p.id in peaks) / _MIB)
        groups.append(_Group(nodes, per_node, mem, tuple(members)))
    return groups


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
    plan: SweepPlan | None = None,
    poll_s: float = _POLL_S,
) -> list[PointResult]:
    """Submit the points neither done nor queued as one array, and wait for them. One result per point.

    It waits until none is queued or running. Then it writes results.csv, results.md and the plots,
    as the local launcher does."""
    require_slurm()
    plan = plan_sweep(experiment, out_dir) if plan is None else plan
    queued = in_queue(out_dir, plan.pending)
    to_submit = [p for p in plan.pending if p.id not in queued]
    groups = _memory_request(experiment, to_submit, request) if to_submit else []  # every refusal before any sbatch
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


# ------------------------------------------------------------------------------------- inside a task


def _other_rank(record: dict, task: dict, rank: int, restart: int, run_command: Callable[[list[str]], int]) -> int:
    """Rank `rank` > 0 of a multi-node point: it runs the same command line and writes no status (rank 0 keeps
    it). Its output goes to points/<id>/rank<R>.stdout.log and rank<R>.stderr.log."""
    logs = status_path(Path(record["out_dir"]), task["point"]).parent
    logs.mkdir(parents=True, exist_ok=True)
    mode = "a" if restart else "w"
    with open(logs / f"rank{rank}.stdout.log", mode) as out, open(logs / f"rank{rank}.stderr.log", mode) as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        try:
            code = run_command(task["argv"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        sys.stdout.flush(), sys.stderr.flush()
    return code


def task_main(argv: list[str], run_command: Callable[[list[str]], int]) -> int:
    """`python -m lmledger.sweep slurm-task TASKS.json INDEX`: one point, as the SLURM task runs it.

    It reads the experiment from the frozen copy submitted with the array. `run_command` is the
    lmledger command line's main. The entry point passes it: commands sit above sweeps."""
    record = json.loads(Path(argv[0]).read_text())
    task = record["tasks"][argv[1]]
    out_dir = Path(record["out_dir"])
    args = task["argv"]
    key = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    rank = int(os.environ.get("SLURM_PROCID") or 0)  # a multi-node point's srun: one task_main a rank
    if rank > 0:
        return _other_rank(record, task, rank, restart, run_command)
    try:
        experiment = load_experiment(record["experiment"])
        point = next((p for p in experiment.points if p.id == task["point"]), None)
        if point is None:
            raise UserError(f"point {task['point']} is not in {record['experiment']}, which it was queued from")
    except Exception as err:  # any cause is named in the point's status, not only in a traceback
        cause = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
        error = f"the task could not start its point: {' '.join(cause.split())}"
        print(f"lmledger sweep: error: {error}", file=sys.stderr, flush=True)
        atomic_write(status_path(out_dir, task["point"]), json.dumps({
            "point": task["point"], "status": "failed", "error": error, "slurm_task": key, "restart": restart,
            "argv": args,
        }, indent=1) + "\n")  # fmt: skip
        return 2
    logs = status_path(out_dir, point).parent
    logs.mkdir(parents=True, exist_ok=True)
    atomic_write(status_path(out_dir, point), json.dumps({
        "point": point.id, "status": "running", "slurm_task": key, "restart": restart, "argv": args,
    }, indent=1) + "\n")  # fmt: skip
    print(f"lmledger sweep: point {point.id} in SLURM task {key} (restart {restart}); its output: {logs}", flush=True)
    mode = "a" if restart else "w"  # a requeued task adds to the point's logs
    with open(logs / "stdout.log", mode) as out, open(logs / "stderr.log", mode) as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)  # line by line, as a local point's log fills
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        start = time.perf_counter()
        try:
            code = run_command(args)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        sys.stdout.flush(), sys.stderr.flush()
    outcome = point_outcome(point, out_dir, code, time.perf_counter() - start, args)
    status = outcome.to_json() | {"slurm_task": key, "restart": restart}
    atomic_write(status_path(out_dir, point), json.dumps(status, indent=1, default=str) + "\n")
    return code
