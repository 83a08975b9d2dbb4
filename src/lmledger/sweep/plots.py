"""The PNGs of a sweep.

Memory per component, predicted beside measured. MFU and tokens/s against the swept variable.
Activations against each numeric grid key.

matplotlib's Figure is used directly (the Agg canvas): no pyplot state shared between threads.
"""

from __future__ import annotations

import io
from pathlib import Path

from lmledger.atomic import atomic_write
from lmledger.ledger.units import MB, MEMORY_COMPONENTS
from lmledger.sweep.collect import PointResult
from lmledger.sweep.spec import Experiment, short_key, slug_value

__all__ = ["draw_plots"]


_COMPONENT_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _x_value(result: PointResult, x: str | None):
    if x is None:
        return result.point.label
    if x in result.point.swept:
        value = result.point.swept[x]
        return value if _is_number(value) else slug_value(x, value)
    return result.metric(x)


def _series(results: list[PointResult], x: str | None, keys: tuple[str, ...]) -> dict[str, list[PointResult]]:
    """Results grouped by their values of the swept keys other than x. One line per group."""
    groups: dict[str, list[PointResult]] = {}
    for result in results:
        label = " ".join(
            f"{short_key(k)}={slug_value(k, result.point.swept[k])}" for k in keys if k != x and k in result.point.swept
        )
        groups.setdefault(label, []).append(result)
    return groups


def _tick_at_values(ax, xs: list) -> None:
    """Numeric x with a few swept values: a tick at each value. Not at matplotlib's fractions."""
    values = sorted({x for x in xs if _is_number(x)})
    if values and len(values) == len(set(xs)) and len(values) <= 12:
        ax.set_xticks(values, [f"{v:g}" for v in values])


def _save(figure, path: Path) -> Path:
    """Render in memory, then write atomically. A full disk leaves the previous PNG whole (one line)."""
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=90)
    atomic_write(path, png.getvalue())
    return path


def _plot_memory_bars(results: list[PointResult], path: Path) -> Path:
    """Per point, stacked bars of bytes per component: predicted beside measured. Peak as a tick."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure = Figure(figsize=(max(7.0, 0.75 * len(results) + 4.0), 4.5))
    ax = figure.subplots()
    width = 0.38
    for i, result in enumerate(results):
        for offset, kind, hatch in ((-width / 2, "predicted", None), (width / 2, "measured", "//")):
            bottom = 0.0
            for component in MEMORY_COMPONENTS:
                value = result.metrics.get(f"memory/{kind}/{component}")
                if value is None:
                    continue
                mb = value / MB
                ax.bar(
                    i + offset,
                    mb,
                    width,
                    bottom=bottom,
                    color=_COMPONENT_COLORS[component],
                    hatch=hatch,
                    edgecolor="white",
                    linewidth=0.5,
                )
                bottom += mb
            peak = result.metrics.get(f"memory/{kind}/peak")
            if peak is not None:
                ax.plot([i + offset - width / 2, i + offset + width / 2], [peak / MB] * 2, color="black", linewidth=2)
    many = len(results) > 3
    ax.set_xticks(
        range(len(results)),
        [r.point.label for r in results],
        rotation=30 if many else 0,
        ha="right" if many else "center",
        fontsize=8,
    )
    ax.set_ylabel("MB (1e6 bytes)")
    ax.set_title("memory per component: predicted (solid) | measured (hatched)")
    handles = [Patch(color=c, label=k) for k, c in _COMPONENT_COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="measured"))
    handles.append(Line2D([], [], color="black", linewidth=2, label="peak"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(figure, path)


def _plot_perf(results: list[PointResult], experiment: Experiment, path: Path) -> Path:
    """MFU and tokens/s against the swept variable. One line per value of the other swept keys."""
    from matplotlib.figure import Figure

    panels = [m for m in ("perf/tokens_per_sec", "perf/mfu") if any(r.metrics.get(m) is not None for r in results)]
    figure = Figure(figsize=(5 * len(panels), 4))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, metric in zip(axes, panels, strict=True):
        for label, members in _series(results, experiment.x, experiment.swept_keys).items():
            points = [
                (_x_value(r, experiment.x), r.metrics.get(metric)) for r in members if r.metrics.get(metric) is not None
            ]
            if all(_is_number(x) for x, _ in points):
                points.sort(key=lambda p: p[0])
            if points:
                ax.plot(
                    [x if _is_number(x) else str(x) for x, _ in points],
                    [y for _, y in points],
                    marker="o",
                    label=label or None,
                )
        _tick_at_values(ax, [_x_value(r, experiment.x) for r in results])
        ax.set_xlabel(short_key(experiment.x) if experiment.x else "point")
        ax.set_ylabel(metric)
        ax.set_title(metric)
        if any(not line.get_label().startswith("_") for line in ax.get_lines()):
            ax.legend(fontsize=8)
    return _save(figure, path)


def _plot_memory_line(results: list[PointResult], experiment: Experiment, key: str, path: Path) -> Path:
    """Activations (and peak, where measured) against one numeric grid key.

    The prediction is a line, the measurements are points on it."""
    from matplotlib.figure import Figure

    rows = [
        row
        for row in ("activations", "peak")
        if any(r.metrics.get(f"memory/measured/{row}") is not None for r in results)
    ]
    rows = rows or ["activations"]
    figure = Figure(figsize=(5 * len(rows), 4))
    axes = figure.subplots(1, len(rows), squeeze=False)[0]
    for ax, row in zip(axes, rows, strict=True):
        for n, (label, members) in enumerate(_series(results, key, experiment.grid_keys).items()):
            color = f"C{n % 10}"
            members = sorted(members, key=lambda r: r.point.swept[key])
            xs = [r.point.swept[key] for r in members]
            predicted = [r.metrics.get(f"memory/predicted/{row}") for r in members]
            if all(v is not None for v in predicted):
                ax.plot(xs, [v / MB for v in predicted], color=color, label=f"predicted {label}".strip())
            measured = [(x, r.metrics.get(f"memory/measured/{row}")) for x, r in zip(xs, members, strict=True)]
            measured = [(x, v) for x, v in measured if v is not None]
            if measured:
                ax.plot(
                    [x for x, _ in measured],
                    [v / MB for _, v in measured],
                    "o",
                    color=color,
                    label=f"measured {label}".strip(),
                )
        _tick_at_values(ax, [r.point.swept[key] for r in results])
        ax.set_xlabel(key)
        ax.set_ylabel("MB (1e6 bytes)")
        ax.set_title(f"{row}: predicted (line), measured (points)")
        ax.legend(fontsize=7)
    return _save(figure, path)


def draw_plots(experiment: Experiment, results: list[PointResult], out_dir: Path) -> list[Path]:
    """memory.png, perf.png and memory_vs_<key>.png, each drawn when the results hold its data."""
    done = [r for r in results if r.status == "done"]
    written: list[Path] = []
    if any(r.metrics.get(f"memory/predicted/{c}") is not None for r in done for c in MEMORY_COMPONENTS):
        written.append(_plot_memory_bars(done, out_dir / "memory.png"))
    if any(r.metrics.get(m) is not None for r in done for m in ("perf/tokens_per_sec", "perf/mfu")):
        written.append(_plot_perf(done, experiment, out_dir / "perf.png"))
    if any(r.metrics.get("memory/predicted/activations") is not None for r in done):
        for key in experiment.grid_keys:
            values = {r.point.swept.get(key) for r in done}
            if len(values) >= 2 and all(_is_number(v) for v in values):
                written.append(_plot_memory_line(done, experiment, key, out_dir / f"memory_vs_{short_key(key)}.png"))
    return written
