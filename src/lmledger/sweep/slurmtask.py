"""Inside a SLURM task: `python -m lmledger.sweep slurm-task TASKS.json INDEX` runs one point of the array.

Rank 0 records points/<id>/status.json ("running", then done/failed/interrupted, as a local point does) and
sends the point's stdout and stderr to points/<id>/stdout.log and stderr.log; rank R > 0 of a multi-node
point writes its own rank<R>.stdout.log and .stderr.log. A requeued task appends to its logs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.sweep.launch import point_outcome, status_path
from lmledger.sweep.spec import load_experiment

__all__ = ["task_main"]


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
