"""`lmledger sweep EXPERIMENT.yaml [--dry-run] [--jobs N] [--out DIR]`: run an experiment grid (see
lmledger.sweep for the file format), or with --dry-run list its points with their predicted cost."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmledger.commands.argparser import ArgumentParser
from lmledger.errors import UserError
from lmledger.ledger.units import MB
from lmledger.sweep import (
    CONFIG_COMMANDS,
    Experiment,
    Point,
    PointResult,
    check_out_dir,
    cuda_available,
    finished_result,
    fit_args,
    load_experiment,
    run_sweep,
)


def _mb(n) -> str:
    return "—" if n is None else f"{n / MB:,.2f}"


def predicted_cost(point: Point) -> dict:
    """`account`'s prediction for a point (in-process, nothing built or run); {} for other commands."""
    if point.subcommand not in CONFIG_COMMANDS:
        return {}
    from lmledger.commands.account import account
    from lmledger.runspec import load_run_spec

    # Parsing a config seeds the RNG, and Lightning says so once per point: noise in a listing.
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        return account(load_run_spec(fit_args(point)), False)
    finally:
        seed_log.setLevel(level)


def dry_run(experiment: Experiment, out_dir: Path) -> int:
    check_out_dir(experiment, out_dir)
    table = Table(title=f"sweep {experiment.name}: {len(experiment.points)} points (dry run: nothing is run)")
    for column in (
        "point",
        "command",
        "would",
        "params",
        "model FLOPs/step",
        "state MB",
        "activations MB",
        "peak MB",
    ):
        table.add_column(column, justify="left" if column in ("point", "command", "would") else "right")
    have_gpu = cuda_available() if any(p.requires_gpu for p in experiment.points) else False
    for point in experiment.points:
        if point.requires_gpu and not have_gpu:
            would = "skip (needs a GPU)"
        elif finished_result(out_dir, point) is not None:
            would = "skip (done)"
        else:
            would = "run"
        try:
            cost = predicted_cost(point)
        except UserError as err:
            table.add_row(point.id, point.subcommand, f"fail: {err}", "", "", "", "", "")
            continue
        if not cost:
            table.add_row(point.id, " ".join(point.command), would, "", "", "", "", "")
            continue
        memory = {row: cost["memory"][row]["predicted"] for row in cost["memory"]}
        parts = [memory["params"], memory["grads"], memory["optimizer"]]
        state = None if None in parts else sum(parts)
        table.add_row(
            point.id,
            point.subcommand,
            would,
            f"{cost['params']:,}",
            f"{cost['flops']['model']:.4g}",
            _mb(state),
            _mb(memory["activations"]),
            _mb(memory["peak"]),
        )
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)
    print(f"results would go to {out_dir}")
    return 0


def run(experiment: Experiment, out_dir: Path, jobs: int) -> int:
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

        results = run_sweep(experiment, out_dir, jobs, on_start=on_start, on_done=on_done)
    done = [r for r in results if r.status == "done"]
    reused = sum(r.reused for r in done)
    failed = [r for r in results if r.status == "failed"]
    skipped = sum(r.status == "skipped" for r in results)
    print(
        f"sweep {experiment.name}: {len(done)} done ({reused} from an earlier run), {len(failed)} failed, "
        f"{skipped} skipped -> {out_dir / 'results.md'}"
    )
    if any(p.subcommand in ("fit", "validate") for p in experiment.points):
        print(f"compare the runs: tensorboard --logdir {out_dir / 'runs'}")
    if failed:
        logs = out_dir / "points"
        print(f"re-run the same command to retry the {len(failed)} failed point(s); their logs are in {logs}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="lmledger sweep",
        description="Run an experiment grid: each point through the real CLI in its own process and run "
        "directory; re-running skips finished points and redoes failed ones.",
    )
    parser.add_argument("experiment", help="an experiment YAML file, e.g. experiments/batch_memory.yaml")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the points with their predicted memory and FLOPs; run nothing"
    )
    parser.add_argument("--jobs", type=int, default=1, help="points run at once (default 1)")
    parser.add_argument("--out", help="results directory (default runs/sweeps/<experiment name>)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    experiment = load_experiment(args.experiment)
    out_dir = Path(args.out) if args.out else Path("runs") / "sweeps" / experiment.name
    if args.dry_run:
        return dry_run(experiment, out_dir)
    return run(experiment, out_dir, args.jobs)
