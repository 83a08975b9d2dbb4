"""`lmledger sweep --dry-run`'s listing: what each point would do, and its predicted cost.

Nothing runs. Each point's arguments are parsed (check.py). A point that would run is accounted on
paper (lmledger.accounting), in milliseconds. The listing is rows of text the command prints.
"""

from __future__ import annotations

from pathlib import Path

from lmledger.errors import UserError
from lmledger.ledger.units import format_mb
from lmledger.sweep.check import CheckedPoints, check_points
from lmledger.sweep.launch import check_out_dir, cuda_available, finished_result, resumable, running_pid
from lmledger.sweep.spec import Experiment, Point

__all__ = ["DRY_RUN_COLUMNS", "PLAN_COLUMNS", "dry_run_rows", "plain_table", "plan_rows"]


DRY_RUN_COLUMNS = ("point", "command", "would", "params", "model FLOPs/step", "state MB", "activations MB", "peak MB")


def plain_table(columns: tuple[str, ...], rows: list[tuple[str, ...]], left: int) -> str:
    """Columns padded to their widest cell: the first `left` left-aligned, the rest right-aligned."""
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]

    def line(cells) -> str:
        return "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(columns), line("-" * w for w in widths), *(line(row) for row in rows)])


def _would(out_dir: Path, point: Point, have_gpu: bool) -> str:
    """What running the sweep now would do with `point`."""
    if point.requires_gpu and not have_gpu:
        return "skip (needs a GPU)"
    if finished_result(out_dir, point) is not None:
        return "skip (done)"
    if (pid := running_pid(out_dir, point)) is not None:
        return f"still running (pid {pid})"
    return "resume" if resumable(out_dir, point) else "run"


def _cost_cells(spec) -> tuple[str, ...]:
    """A point's predicted params, model FLOPs per step, and state, activations and peak MB."""
    from lmledger.accounting import account

    cost = account(spec, False)
    memory = {row: cost["memory"][row]["predicted"] for row in cost["memory"]}
    parts = [memory["params"], memory["grads"], memory["optimizer"]]
    state = None if None in parts else sum(parts)
    cells = (state, memory["activations"], memory["peak"])
    return (f"{cost['params']:,}", f"{cost['flops']['model']:.4g}", *(format_mb(n, ",.2f", "") for n in cells))


PLAN_COLUMNS = ("point", "command", "peak MB", "step ms", "tokens/s")


def plan_rows(experiment: Experiment) -> tuple[list[tuple[str, ...]], CheckedPoints]:
    """`sweep --plan`: each point's predicted peak and step time, before any point runs: on this machine for a CPU
    point (ledger.timing.steptime), on its GPU by the GPU op-time model for a GPU one (accounting.gpustep), a point
    that `requires: gpu` included (on a machine without one the sweep skips it, so here it is planned on
    gpustep.DEFAULT_GPU, not on this CPU). Points of another command, or that fail their checks, say why. A point
    naming any LightningModule is its own dry run (accounting.account_module)."""
    from lmledger.accounting import account, account_module
    from lmledger.accounting.gpustep import DEFAULT_GPU
    from lmledger.sweep.spec import fit_args

    checked = check_points(experiment)
    have_gpu = cuda_available() if any(p.requires_gpu for p in experiment.points) else False
    rows: list[tuple[str, ...]] = []
    for point in experiment.points:
        spec = checked.specs.get(point.id)
        if point.id in checked.errors:
            rows.append((point.id, point.subcommand, f"fail: {checked.errors[point.id]}", "", ""))
            continue
        if point.subcommand not in ("fit", "account"):
            rows.append((point.id, " ".join(point.command), "—", "—", "not a fit or account point: not planned"))
            continue
        gpu = DEFAULT_GPU if point.requires_gpu and not have_gpu else None
        if spec is None:  # any LightningModule: its own dry run, one rank's at its world size, as account gives it
            try:
                cost = account_module(fit_args(point), gpu)
            except UserError as err:
                rows.append((point.id, point.subcommand, f"fail: {err}", "", ""))
                continue
            peak, world = cost["predictors"]["dry run"].peak, (cost.get("run") or {}).get("world_size", 1)
        else:
            cost = account(spec, False, fit_args(point), step_time=True, gpu=gpu)
            peak, world = cost["memory"]["peak"]["predicted"], spec.world_size
        predicted = (cost.get("time") or {}).get("predicted") or {}
        if "total_s" in predicted:  # here, or on the point's GPU by the GPU op model (its key beside the rate)
            step, rate = f"{predicted['total_s'] * 1e3:.4g}", f"{predicted['tokens_per_s'] or 0:,.0f}"
            rate += f" on {predicted['priced_on']}" if predicted.get("priced_on") else ""
        else:
            step, rate = "—", predicted.get("none", f"per rank at world size {world}: not predicted")
        rows.append((point.id, point.subcommand, format_mb(peak, ",.2f", ""), step, rate))
    return rows, checked


def dry_run_rows(experiment: Experiment, out_dir: Path) -> tuple[list[tuple[str, ...]], CheckedPoints]:
    """One row of DRY_RUN_COLUMNS per point, and the checked points. Their errors mark rows `fail`."""
    check_out_dir(experiment, out_dir)
    checked = check_points(experiment)  # every point parsed, nothing built: milliseconds a point
    rows: list[tuple[str, ...]] = []
    have_gpu = cuda_available() if any(p.requires_gpu for p in experiment.points) else False
    for point in experiment.points:
        if point.id in checked.errors:
            rows.append((point.id, point.subcommand, f"fail: {checked.errors[point.id]}", "", "", "", "", ""))
            continue
        would = _would(out_dir, point, have_gpu)
        spec = checked.specs.get(point.id)
        if spec is None:
            rows.append((point.id, " ".join(point.command), would, "", "", "", "", ""))
            continue
        rows.append((point.id, point.subcommand, would, *_cost_cells(spec)))
    return rows, checked
