"""`lmledger sweep EXPERIMENT.yaml [--dry-run] [--jobs N] [--out DIR] [--launcher local|slurm ...]`.

It runs an experiment grid as local processes, or as one SLURM job array (lmledger.sweep.slurm).
With --dry-run it lists the points and their predicted cost. lmledger.sweep.spec has the file format.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmledger.commands.argparser import run_command
from lmledger.commands.terminal import console
from lmledger.errors import UserError
from lmledger.sweep import Experiment, Point, PointResult, load_experiment, plan_sweep, run_sweep
from lmledger.sweep.listing import DRY_RUN_COLUMNS, PLAN_COLUMNS, dry_run_rows, plain_table, plan_rows

__all__ = ["main"]


# rich lays out a table in about 2 ms a row: 10,000 rows took 21 s of a 54 s dry run (profiled
# 2026-11-30, a shared 2-core CPU). Longer listings print as plain aligned columns.
_RICH_TABLE_ROWS = 200


def _dry_run_listing(experiment: Experiment, out_dir: Path) -> int:
    """List each point, what a run would do, and its predicted cost. 2 if any point's arguments are bad."""
    rows, checked = dry_run_rows(experiment, out_dir)
    title = f"sweep {experiment.name}: {len(experiment.points)} points (dry run: nothing is run)"
    if len(rows) <= _RICH_TABLE_ROWS:
        table = Table(title=title)
        for i, column in enumerate(DRY_RUN_COLUMNS):
            table.add_column(column, justify="left" if i < 3 else "right")
        for row in rows:
            table.add_row(*row)
        console(piped_width=200).print(table)
    else:
        print(title)
        print(plain_table(DRY_RUN_COLUMNS, rows, left=3))
    print(f"results would go to {out_dir}")
    return _bad_points(experiment, checked.errors)


def _bad_points(experiment: Experiment, errors: dict) -> int:
    """2 and one line on stderr if a listing marked points fail (their arguments are bad), else 0."""
    if not errors:
        return 0
    print(
        f"lmledger sweep: error: {len(errors)} of {len(experiment.points)} points have bad arguments (marked fail "
        "above); fix them before running the sweep",
        file=sys.stderr,
    )
    return 2


def _plan_listing(experiment: Experiment) -> int:
    """Each point's predicted peak and step time, before any runs (--plan): a CPU point's on this machine, a GPU
    point's (or one that requires a GPU) on its GPU by the GPU op model."""
    from lmledger.accounting.gpustep import DEFAULT_GPU

    rows, checked = plan_rows(experiment)
    print(f"sweep {experiment.name}: {len(experiment.points)} points, predicted before any runs (a CPU point on "
          f"this machine; a GPU point, or one that requires a GPU, on its GPU by the GPU op model: {DEFAULT_GPU} "
          "where this machine has none)")  # fmt: skip
    print(plain_table(PLAN_COLUMNS, rows, left=2))
    return _bad_points(experiment, checked.errors)


def _run(experiment: Experiment, out_dir: Path, jobs: int) -> int:
    plan = plan_sweep(experiment, out_dir)  # bad points or a point still running: one line, nothing run
    stderr = Console(stderr=True)
    running: set[str] = set()
    lock = threading.Lock()
    with Progress(
        TextColumn("[bold]{task.fields[name]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=stderr,
        disable=not stderr.is_terminal,  # logs and pipes get the failed points and the summary only
    ) as progress:
        task = progress.add_task("", total=len(experiment.points), name=f"sweep {experiment.name}")

        def show_running() -> None:
            progress.update(task, description=", ".join(sorted(running)))

        def on_start(point: Point) -> None:
            with lock:
                running.add(point.id)
                show_running()

        def on_done(result: PointResult) -> None:
            with lock:
                running.discard(result.point.id)
                show_running()
                progress.advance(task)
                if result.status == "failed":
                    progress.console.print(f"[red]failed[/red] {result.point.id}: {result.error}")
                elif result.status == "skipped":
                    progress.console.print(f"[yellow]skipped[/yellow] {result.point.id}: {result.error}")

        results = run_sweep(experiment, out_dir, jobs, on_start=on_start, on_done=on_done, plan=plan)
    return _summary(experiment, out_dir, results)


def _summary(experiment: Experiment, out_dir: Path, results: list[PointResult]) -> int:
    done = [r for r in results if r.status == "done"]
    reused = sum(r.reused for r in done)
    failed = [r for r in results if r.status == "failed"]
    interrupted = [r for r in results if r.status == "interrupted"]
    skipped = sum(r.status == "skipped" for r in results)
    print(
        f"sweep {experiment.name}: {len(done)} done ({reused} from an earlier run), {len(failed)} failed, "
        f"{len(interrupted)} interrupted, {skipped} skipped -> {out_dir / 'results.md'}"
    )
    if any(p.subcommand in ("fit", "validate") for p in experiment.points):
        print(f"compare the runs: tensorboard --logdir {out_dir / 'runs'}")
    if failed or interrupted:
        logs = out_dir / "points"
        print(
            f"re-run the same command to retry the {len(failed)} failed and resume the {len(interrupted)} "
            f"interrupted point(s); their logs are in {logs}"
        )
    return 1 if failed or interrupted else 0


class _Terminated(BaseException):
    """SIGTERM reached the sweep (a scheduler preempting it). Stop the points, as Ctrl-C does."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def _run_slurm(experiment: Experiment, out_dir: Path, jobs: int | None, request) -> int:
    from lmledger.sweep.slurm import require_slurm, run_slurm_sweep

    require_slurm()  # before the checks: the one line that says what is missing
    plan = plan_sweep(experiment, out_dir)

    def on_submit(job: str, count: int, mem_mib: int | None) -> None:
        mem = f", --mem={mem_mib}M each" if mem_mib is not None else ""
        print(f"sweep {experiment.name}: submitted {count} point(s) as SLURM job array {job}{mem}; waiting for them "
              f"(Ctrl-C stops only the waiting: the same command later collects the results)", flush=True)  # fmt: skip

    def on_done(result: PointResult) -> None:
        if result.status in ("failed", "interrupted", "skipped"):
            print(f"{result.status} {result.point.id}: {result.error}", file=sys.stderr, flush=True)

    results = run_slurm_sweep(experiment, out_dir, request, jobs or 0, on_done=on_done, on_submit=on_submit, plan=plan)
    return _summary(experiment, out_dir, results)


def _sweep(
    experiment: str,
    dry_run: bool = False,
    plan: bool = False,
    jobs: int | None = None,
    out: str | None = None,
    launcher: Literal["local", "slurm"] = "local",
    partition: str | None = None,
    time: str | None = None,
    cpus_per_task: int | None = None,
    mem: str | None = None,
    gres: str | None = None,
) -> int:
    """Run an experiment grid. Each point runs through the real CLI, in its own process and run directory.

    Re-running skips finished points and redoes failed ones.

    Args:
        experiment: an experiment YAML file, e.g. experiments/batch_memory.yaml
        dry_run: list the points with their predicted memory and FLOPs; run nothing
        plan: list each point's predicted peak and step time on this machine (docs/time.md); run nothing
        jobs: points run at once (default 1; with slurm: the job array's throttle, default none)
        out: results directory (default runs/sweeps/<experiment name>)
        launcher: local: processes on this machine (default); slurm: one sbatch job array, a task per point
        partition (P): slurm: the partition to queue in
        time (T): slurm: each task's time limit (SLURM's forms, e.g. 30 or 1:00:00); SIGUSR1 comes 120 s before
        cpus_per_task (C): slurm: CPUs per task
        mem (M): slurm: memory per task (e.g. 8G); a point predicted not to fit is refused; default: from the
            largest point's predicted peak (+25 percent and 2 GiB for the process)
        gres (G): slurm: generic resources, e.g. gpu:h100:1 (each point's predicted peak is held against that
            GPU's memory)
    """
    if jobs is not None and jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    from lmledger.sweep.slurmscript import SlurmRequest

    request = SlurmRequest(partition, time, cpus_per_task, mem, gres)
    given = [f"--{f.replace('_', '-')}" for f in ("partition", "time", "cpus_per_task", "mem", "gres")
             if getattr(request, f) is not None]  # fmt: skip
    if launcher == "local" and given:
        raise UserError(f"{', '.join(given)} configure SLURM jobs: add --launcher slurm, or drop them")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise UserError(f"--cpus-per-task must be >= 1, got {cpus_per_task}")
    path = experiment
    loaded = load_experiment(path)
    out_dir = Path(out) if out else Path("runs") / "sweeps" / loaded.name
    if dry_run:
        return _dry_run_listing(loaded, out_dir)
    if plan:
        return _plan_listing(loaded)
    if launcher == "slurm":
        try:
            return _run_slurm(loaded, out_dir, jobs, request)
        except KeyboardInterrupt:
            print(f"lmledger sweep: stopped waiting; the queued points stay queued, and the same command collects "
                  f"them (squeue -n lmledger-{loaded.name})", file=sys.stderr)  # fmt: skip
            return 130
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(loaded, out_dir, jobs or 1)
    except _Terminated:
        print(
            f"lmledger sweep: stopped by SIGTERM; the running points were stopped too, and the next "
            f"`lmledger sweep {path}` resumes them",
            file=sys.stderr,
        )
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str]) -> int:
    return run_command("lmledger sweep", _sweep, argv)
