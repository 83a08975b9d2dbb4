"""A sweep's results: results.csv, results.md, then the plots.

results.csv has every column, raw. results.md has human units, each prediction beside its measured twin.
A point on several ranks has a `rank` column: whose lines its ledger columns are (the experiment's `ranks`).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from lmledger.atomic import atomic_write
from lmledger.ledger.report import markdown_table
from lmledger.ledger.units import MB
from lmledger.sweep.collect import RANK_COLUMNS, PointResult, metric_columns, with_ranks
from lmledger.sweep.spec import Experiment, short_key, slug_value

__all__ = ["results_markdown", "write_results"]


def _table_columns(experiment: Experiment, results: list[PointResult]) -> list[str]:
    ranks = RANK_COLUMNS if any("rank" in r.metrics for r in results) else ()
    columns = ["point", "status", *experiment.swept_keys, *ranks, *metric_columns(experiment, results), "seconds"]
    return list(dict.fromkeys([*columns, "error"]))


def _result_row(result: PointResult, columns: list[str]) -> dict[str, object]:
    values = {c: result.metric(c) for c in columns}
    values.update(
        point=result.point.id,
        status=result.status,
        **{k: slug_value(k, v) for k, v in result.point.swept.items()},
        seconds=None if result.seconds is None else round(result.seconds, 2),
        error=result.error,
    )
    return {c: values.get(c) for c in columns}


def write_results(experiment: Experiment, results: list[PointResult], out_dir: Path) -> list[Path]:
    results = with_ranks(experiment, results)  # each multi-rank point's lines: rank 0's, or the worst rank's
    columns = _table_columns(experiment, results)
    rows = [_result_row(r, columns) for r in results]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    atomic_write(out_dir / "results.csv", buffer.getvalue())
    atomic_write(out_dir / "results.md", results_markdown(experiment, columns, rows))
    from lmledger.sweep.plots import draw_plots  # matplotlib loads only when there is something to draw

    return draw_plots(experiment, results, out_dir)


def _format_cell(column: str, value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    if column.startswith("memory/"):
        return f"{value / MB:,.3f}"
    if column.endswith(("mfu", "hfu")):
        return f"{value:.3f}"
    if "loss" in column or "ppl" in column or "per_param" in column:
        return f"{value:.4g}"
    if column.startswith("flops/") or abs(value) >= 1e7:
        return f"{value:.4g}"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return f"{value:,}"


def results_markdown(experiment: Experiment, columns: list[str], rows: list[dict]) -> str:
    """The results' non-empty columns, human-formatted.

    Memory is in MB (1e6 bytes). Each prediction shares a "predicted / measured" cell with its twin."""
    shown = [c for c in columns if c != "point" and any(row.get(c) not in (None, "") for row in rows)]
    short = [short_key(k) for k in experiment.swept_keys]
    short_names = {k: s for k, s in zip(experiment.swept_keys, short, strict=True) if short.count(s) == 1}
    cells: list[tuple[str, str, str | None]] = []  # (header, column, its measured twin in the same cell)
    for column in shown:
        if not column.startswith("memory/"):
            cells.append((short_names.get(column, column), column, None))
            continue
        _, kind, component = column.split("/", 2)
        twin = f"memory/measured/{component}"
        if kind == "measured" and f"memory/predicted/{component}" in shown:
            continue  # shown beside its prediction
        if kind == "predicted" and twin in shown:
            cells.append((f"{component} MB (predicted / measured)", column, twin))
        else:
            cells.append((f"{component} MB ({kind})", column, None))

    def render(row: dict, column: str, twin: str | None) -> str:
        text = _format_cell(column, row.get(column))
        if twin is None:
            return text
        measured = _format_cell(twin, row.get(twin))
        return f"{text or '—'} / {measured or '—'}" if text or measured else ""

    lines = [f"# sweep {experiment.name}", ""]
    if experiment.description:
        lines += [experiment.description, ""]
    header = [h for h, _, _ in cells]
    table = markdown_table(header, [[render(row, column, twin) for _, column, twin in cells] for row in rows])
    return "\n".join([*lines, table]) + "\n"
