"""Experiment sweeps: a YAML grid of `lmledger` runs, collected into one table and a few plots.

Each point runs in its own process and run directory (docs/sweeps.md).
Each module imports only the ones before it, in this order:
    spec     the file, points, command lines
    collect  metrics, PointResult
    check    arguments parsed before anything runs
    plots
    report   results.csv/md, then the plots (loaded only to draw them)
    launch   processes, locks, statuses
"""

from lmledger.sweep.check import CheckedPoints, bad_points_error, check_points
from lmledger.sweep.collect import DEFAULT_METRICS, PointResult, flatten, json_path, read_tensorboard
from lmledger.sweep.launch import (
    SweepWork,
    check_out_dir,
    cuda_available,
    finished_result,
    plan_sweep,
    resumable,
    run_point,
    run_sweep,
    running_pid,
)
from lmledger.sweep.report import results_markdown, write_results
from lmledger.sweep.spec import MAX_POINTS, Experiment, Point, cli_args, fit_args, load_experiment

__all__ = [
    "DEFAULT_METRICS",
    "MAX_POINTS",
    "CheckedPoints",
    "Experiment",
    "Point",
    "PointResult",
    "SweepWork",
    "bad_points_error",
    "check_out_dir",
    "check_points",
    "cli_args",
    "cuda_available",
    "finished_result",
    "fit_args",
    "flatten",
    "json_path",
    "load_experiment",
    "results_markdown",
    "plan_sweep",
    "read_tensorboard",
    "resumable",
    "run_point",
    "run_sweep",
    "running_pid",
    "write_results",
]
