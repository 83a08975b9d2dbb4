"""`lmledger sweep EXPERIMENT.yaml --launcher slurm`: the points as the tasks of one SLURM job array.

Why `sbatch --array` directly, not submitit? submitit is not installed with the kit. It would be one
more dependency for a handful of sbatch lines. It pickles a Python callable per task, where a point is
already a command line. It reads job states from `sacct`, which a cluster without accounting lacks
(our CI's does).

Before anything is queued, each point's predicted peak is held against what the job asks for.
(The prediction is the one `--dry-run` lists.) CPU jobs: `--mem`. `--gres=gpu:TYPE:N`: the GPU's memory.
A point that cannot fit is refused in one line. Without `--mem`, the largest point's need sets it
(_need_bytes).

out_dir/slurm/ holds each submission. array-N.sh is the batch script. tasks-N.json maps task index ->
point and its command line. logs/ has SLURM's own --output, one file per task.

A task runs `python -m lmledger.sweep slurm-task TASKS.json INDEX`, exec'd so SLURM's signals reach it.
It records points/<id>/status.json: "running", then done/failed/interrupted, as a local point does.
It sends the point's stdout and stderr to points/<id>/stdout.log and stderr.log.

Statuses: squeue says which tasks are pending or running. (Without accounting, a finished job leaves
squeue, and `sacct` knows nothing.) A point's own status.json says how it ended. A re-run submits only
the points that are neither done nor in the queue.

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
from lmledger.sweep.check import check_points
from lmledger.sweep.collect import PointResult
from lmledger.sweep.report import write_results
from lmledger.sweep.runner import (
    SweepPlan,
    claim_out_dir,
    plan_sweep,
    point_outcome,
    resumable,
    saved_status,
    status_path,
)
from lmledger.sweep.spec import Experiment, Point, cli_args, load_experiment

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


@dataclass(frozen=True)
class SlurmRequest:
    """What each task of the array asks SLURM for (None: the cluster's default)."""

    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    gres: str | None = None

    def sbatch_lines(self, mem_mib: int | None) -> list[str]:
        lines = []
        for flag, value in (("partition", self.partition), ("time", self.time), ("cpus-per-task", self.cpus_per_task),
                            ("gres", self.gres)):  # fmt: skip
            if value is not None:
                lines.append(f"#SBATCH --{flag}={value}")
        if mem_mib is not None:
            lines.append(f"#SBATCH --mem={mem_mib}M")
        if self.time is not None:
            lines.append(f"#SBATCH --signal=B:USR1@{_SIGNAL_BEFORE_END_S}")
        return lines


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
    return f"{n / 1e9:,.2f} GB"


def _predicted_peaks(experiment: Experiment, points: list[Point]) -> dict[str, float]:
    """Point id -> predicted peak bytes per rank, for points predictable without building."""
    from lmledger.ledger.predict import predict

    specs = check_points(replace(experiment, points=tuple(points))).specs
    peaks = {}
    for point in points:
        spec = specs.get(point.id)
        if spec is not None:
            peak = predict(spec).peak  # what `lmledger account` shows for it
            if peak is not None:
                peaks[point.id] = float(peak)
    return peaks


def _memory_request(experiment: Experiment, points: list[Point], request: SlurmRequest) -> int | None:
    """The --mem (MiB) to ask for, after holding every point's predicted peak against the request.

    A point that cannot fit is refused in one line, before anything is queued."""
    peaks = _predicted_peaks(experiment, points)
    gpu = _gres_gpu(request.gres)
    if gpu is not None:
        kind, _ = gpu
        if kind is None:
            return None if request.mem is None else max(1, _parse_mem(request.mem) // _MIB)
        spec = _gres_gpu_spec(kind)
        for point in points:
            if peaks.get(point.id, 0) > spec.memory_bytes:
                raise UserError(
                    f"point {point.id}: predicted peak {_gb(peaks[point.id])} per GPU does not fit the "
                    f"{_gb(spec.memory_bytes)} of a {spec.name} (--gres {request.gres}); nothing was queued: shrink "
                    "the point or ask for a larger GPU"
                )
        return None if request.mem is None else max(1, _parse_mem(request.mem) // _MIB)
    if request.mem is not None:
        asked = _parse_mem(request.mem)
        for point in points:
            if point.id in peaks and _need_bytes(peaks[point.id]) > asked:
                raise UserError(
                    f"point {point.id}: predicted peak {_gb(peaks[point.id])} (+{_PEAK_MARGIN - 1:.0%} and "
                    f"{_gb(_PROCESS_BYTES)} for the process: {_gb(_need_bytes(peaks[point.id]))}) does not fit "
                    f"--mem {request.mem} ({_gb(asked)}); nothing was queued: ask for more, or leave --mem out "
                    "and the prediction sets it"
                )
        return max(1, asked // _MIB)
    if not peaks:
        return None  # nothing predicted: the cluster's default
    return math.ceil(max(_need_bytes(p) for p in peaks.values()) / _MIB)


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


def _submit(experiment: Experiment, out_dir: Path, points: list[Point], request: SlurmRequest, jobs: int,
           mem_mib: int | None) -> str:  # fmt: skip
    """sbatch one array over `points`; returns its job id. Each point's status.json says "queued" in task i."""
    slurm_dir = out_dir / "slurm"
    n = 1 + max([int(m.group(1)) for p in slurm_dir.glob("array-*.sh") if (m := re.search(r"-(\d+)\.sh$", p.name))]
                or [0])  # fmt: skip
    tasks = {}
    for index, point in enumerate(points):
        args = cli_args(point, out_dir)
        if point.subcommand == "fit":
            # A requeued task resumes its own run; a point an earlier sweep left interrupted resumes that run.
            args += ["--ckpt_path", "last" if resumable(out_dir, point) else "auto"]
        tasks[str(index)] = {"point": point.id, "argv": args}
    record = slurm_dir / f"tasks-{n}.json"
    (slurm_dir / "logs").mkdir(parents=True, exist_ok=True)
    source = Path(experiment.source).resolve()
    atomic_write(record, json.dumps({"experiment": str(source), "out_dir": str(out_dir.resolve()), "tasks": tasks},
                                    indent=1) + "\n")  # fmt: skip
    throttle = f"%{jobs}" if jobs else ""
    script = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=lmledger-{experiment.name}",
        f"#SBATCH --array=0-{len(points) - 1}{throttle}",
        f"#SBATCH --output={(slurm_dir / 'logs').resolve()}/%A_%a.out",
        "#SBATCH --open-mode=append",  # a requeued task adds to its log
        "#SBATCH --requeue",
        f"#SBATCH --chdir={Path.cwd()}",
        *request.sbatch_lines(mem_mib),
        "# exec: the task is the batch shell, so SLURM's signals (SIGTERM, --signal=B:USR1) reach it",
        f"exec {shlex.quote(sys.executable)} -m lmledger.sweep slurm-task {shlex.quote(str(record.resolve()))} "
        '"$SLURM_ARRAY_TASK_ID"',
        "",
    ])  # fmt: skip
    path = slurm_dir / f"array-{n}.sh"
    atomic_write(path, script)
    try:
        done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise UserError(f"sbatch {path} failed ({err})") from None
    if done.returncode != 0:
        raise UserError(f"sbatch {path} refused the array: {' '.join(done.stderr.split())}")
    job = done.stdout.strip().split(";")[0]
    for index, point in enumerate(points):
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
    mem_mib = _memory_request(experiment, to_submit, request) if to_submit else None
    claim_out_dir(experiment, out_dir)
    results = dict(plan.results)
    if on_done:
        for point in experiment.points:
            if point.id in results:
                on_done(results[point.id])
    if to_submit:
        job = _submit(experiment, out_dir, to_submit, request, jobs, mem_mib)
        if on_submit:
            on_submit(job, len(to_submit), mem_mib)
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


def ended_result(out_dir: Path, point: Point) -> PointResult:
    """A point whose task left the queue: its status.json, or "failed" if the task died first."""
    saved = saved_status(out_dir, point)
    if saved.get("status") in ("done", "failed", "interrupted"):
        return PointResult(point, saved["status"], saved.get("metrics", {}), saved.get("error", ""),
                           saved.get("seconds"), saved.get("run_dir"), argv=saved.get("argv", []),
                           output=saved.get("output"))  # fmt: skip
    task = saved.get("slurm_task", "?")
    job, _, index = task.partition("_")
    log = out_dir / "slurm" / "logs" / f"{job}_{index}.out"
    return PointResult(point, "failed", error=f"SLURM task {task} ended without a result (killed by SLURM: time "
                       f"limit, memory, cancelled?); see {log}", argv=saved.get("argv", []))  # fmt: skip


# ------------------------------------------------------------------------------------- inside a task


def task_main(argv: list[str], run_command: Callable[[list[str]], int]) -> int:
    """`python -m lmledger.sweep slurm-task TASKS.json INDEX`: one point, as the SLURM task runs it.

    `run_command` is the lmledger command line's main. The entry point passes it: commands sit above
    sweeps."""
    record = json.loads(Path(argv[0]).read_text())
    task = record["tasks"][argv[1]]
    out_dir = Path(record["out_dir"])
    experiment = load_experiment(record["experiment"])
    point = next(p for p in experiment.points if p.id == task["point"])
    args = task["argv"]
    logs = status_path(out_dir, point).parent
    logs.mkdir(parents=True, exist_ok=True)
    key = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
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
