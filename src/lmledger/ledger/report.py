"""One device's ledger: a training step's figures from each source, side by side.

`Figures` is one source's reading of one optimizer step on one device. The source is the dry run,
the toy LM's closed forms, or the real step. `Report` holds the predictors' Figures beside the
measured ones. It renders them three ways: a rich table, a JSON object and TensorBoard scalars (one
tag per line and source). Every ratio divides the measurement by the first predictor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.table import Table

from lmledger.ledger.units import MB, format_bytes, format_count

__all__ = [
    "BYTE_LINES", "FLOP_LINES", "LINES", "TOLERANCE", "Figures", "Miss", "Report", "bar_chart", "figures_of_step",
    "markdown_table", "misses",
]  # fmt: skip

# The lines of every ledger table, in order: bytes per device, then FLOPs per optimizer step.
BYTE_LINES = ("params", "grads", "optimizer", "activations", "autocast_weight_copies", "peak")
FLOP_LINES = ("flops_hardware", "flops_model")
LINES = (*BYTE_LINES, *FLOP_LINES)
LABELS = {"flops_hardware": "FLOPs/step (hardware)", "flops_model": "FLOPs/step (model)"}

# How far a measurement may sit from the first prediction, |measured/predicted - 1|, before the ledger says so.
# State and FLOPs come out exact in the tests (test_ledger_callback, test_dryrun), activations within 1%, the
# peak within 3% (5% on an FSDP2 rank that held one more small buffer: test_ledger_fsdp2); 10% leaves room.
TOLERANCE = {"params": 0.02, "grads": 0.02, "optimizer": 0.02, "activations": 0.10, "autocast_weight_copies": 0.10,
             "peak": 0.10, "flops_hardware": 0.02}  # fmt: skip

# TensorBoard: memory/<source>/<line> for bytes; FLOPs keep the tags the kit has always written.
_SOURCE_TAGS = {"measured": "measured", "dry run": "predicted", "closed form": "closed_form"}


@dataclass(frozen=True)
class Figures:
    """One source's figures for one optimizer step on one device.

    None is not known; `why_missing` says why. activations are what one micro-batch saves for backward.
    FLOPs cover every micro-batch of the step. Model FLOPs (flops_model) are the MFU numerator, with no
    recompute. Hardware FLOPs (flops_hardware) are what the kernels do.
    """

    params: int | None = None
    grads: int | None = None
    optimizer: int | None = None
    activations: int | None = None
    autocast_weight_copies: int | None = None
    peak: int | None = None
    peak_phase: str | None = None
    flops_hardware: int | None = None
    flops_model: int | None = None
    why_missing: Mapping[str, str] = field(default_factory=dict)

    def get(self, line: str) -> int | None:
        return getattr(self, line)

    def largest_component(self) -> tuple[str, int]:
        """The biggest term the peak is made of."""
        terms = {n: self.get(n) for n in ("params", "grads", "optimizer", "activations", "autocast_weight_copies")}
        name = max((n for n, v in terms.items() if v is not None), key=lambda n: terms[n])
        return name, terms[name]


def figures_of_step(step: object, flops_model: int | None = None) -> Figures:
    """Figures from a dryrun.StepLedger (dry or measured)."""
    return Figures(
        params=step.params, grads=step.grads, optimizer=step.optimizer, activations=step.activations,
        autocast_weight_copies=step.autocast_weight_copies, peak=step.peak, peak_phase=step.peak_phase,
        flops_hardware=step.flops, flops_model=flops_model,
    )  # fmt: skip


@dataclass
class Report:
    """Predictors' Figures beside the measured ones, and the latest rates (tokens/s, MFU, ...).

    Its fields:
        predicted   {source: Figures}; ratios divide by the first ("dry run" where it traced)
        measured    the real step's Figures (None before the first measurement)
        rates       {"tokens/s" or "samples/s", "TFLOP/s", "MFU", "HFU": value} of the latest window
        notes       caption lines: per device, per-batch size, where the peak fell, why a source is missing
    """

    predicted: dict[str, Figures]
    measured: Figures | None = None
    rates: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # "step time" (seconds) and "tokens/s" or "samples/s": (predicted, measured), ledger/steptime beside the fit
    times: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    @property
    def primary(self) -> Figures | None:
        return next(iter(self.predicted.values()), None)

    def lines(self) -> list[str]:
        """The lines some source has a figure for (autocast copies only where one has them)."""
        sources = [*self.predicted.values(), *([self.measured] if self.measured else [])]
        shown = []
        for line in LINES:
            values = [s.get(line) for s in sources]
            if line == "autocast_weight_copies" and not any(values):
                continue
            if line == "flops_model" and all(v is None for v in values):
                continue
            shown.append(line)
        return shown

    def rows(self) -> list[tuple[str, ...]]:
        """The table's rows: (line, one text per predictor, measured, measured/first predictor)."""
        rows = []
        primary = self.primary
        for line in self.lines():
            show = format_count if line in FLOP_LINES else format_bytes
            cells = [_cell(f, line, show) for f in self.predicted.values()]
            if self.measured is None:
                measured = ""
            elif self.measured.get(line) is None:
                measured = self.measured.why_missing.get(line, "")
            else:
                measured = show(self.measured.get(line))
            rows.append((LABELS.get(line, line), *cells, measured, _ratio(self.measured, primary, line)))
        for name, (predicted, measured) in self.times.items():
            show = (lambda s: f"{s * 1e3:.4g} ms") if name == "step time" else (lambda r: f"{r:.4g}")  # noqa: E731
            cells = [show(predicted) if predicted is not None else "n/a", *([""] * (len(self.predicted) - 1))]
            ratio = f"{measured / predicted:.3f}" if predicted and measured is not None else ""
            rows.append((name, *cells[: len(self.predicted)], show(measured) if measured is not None else "", ratio))
        for name, value in self.rates.items():
            if name in self.times:
                continue
            text = f"{value:.2%}" if name in ("MFU", "HFU") else f"{value:.4g}"
            rows.append((name, *([""] * len(self.predicted)), text, ""))
        return rows

    def header(self) -> list[str]:
        first = next(iter(self.predicted), "predicted")
        return ["", *self.predicted, "measured", f"measured/{first}"]

    def table(self, title: str) -> Table:
        table = Table(title=title, title_justify="left")
        for column in self.header():
            table.add_column(column, justify="right" if column else "left")
        for row in self.rows():
            table.add_row(*row)
        table.caption = "; ".join(self.notes)
        return table

    def markdown(self) -> str:
        return markdown_table(self.header(), [list(r) for r in self.rows()]) + "\n\n" + "; ".join(self.notes)

    def to_json(self) -> dict[str, object]:
        """{line: {"predicted": {source: value}, "measured": value}} plus "rates" and "notes"."""
        out: dict[str, object] = {}
        for line in LINES:
            out[line] = {
                "predicted": {source: f.get(line) for source, f in self.predicted.items()},
                "measured": self.measured.get(line) if self.measured else None,
            }
        out["rates"] = dict(self.rates)
        out["times"] = {k: {"predicted": p, "measured": m} for k, (p, m) in self.times.items()}
        out["notes"] = list(self.notes)
        return out

    def scalars(self, which: str = "all") -> dict[str, float]:
        """TensorBoard tags. `which`: "predicted", "measured" or "all".

        memory/{predicted,closed_form,measured}/<line> (bytes), flops/{hardware,model,closed_form,measured}_per_step.
        """
        sources: dict[str, Figures] = {}
        if which in ("predicted", "all"):
            sources.update(self.predicted)
        if which in ("measured", "all") and self.measured is not None:
            sources["measured"] = self.measured
        tags: dict[str, float] = {}
        for source, f in sources.items():
            slug = _SOURCE_TAGS.get(source, source.replace(" ", "_"))
            for line in BYTE_LINES:
                if f.get(line) is not None:
                    tags[f"memory/{slug}/{line}"] = f.get(line)
            if source == "measured":
                if f.flops_hardware is not None:
                    tags["flops/measured_per_step"] = f.flops_hardware
            elif slug == "predicted":
                for line, tag in (
                    ("flops_hardware", "flops/hardware_per_step"),
                    ("flops_model", "flops/model_per_step"),
                ):
                    if f.get(line) is not None:
                        tags[tag] = f.get(line)
            elif f.flops_hardware is not None:
                tags[f"flops/{slug}_per_step"] = f.flops_hardware
        return tags


def _cell(figures: Figures, line: str, show) -> str:
    value = figures.get(line)
    return show(value) if value is not None else "n/a"


def _ratio(measured: Figures | None, predicted: Figures | None, line: str) -> str:
    if measured is None or predicted is None:
        return ""
    m, p = measured.get(line), predicted.get(line)
    return f"{m / p:.3f}" if m is not None and p else ""


@dataclass(frozen=True)
class Miss:
    """A line whose measurement sits beyond TOLERANCE from its prediction."""

    line: str
    predicted: int
    measured: int

    @property
    def ratio(self) -> float:
        """measured / predicted (inf where nothing was predicted)."""
        return self.measured / self.predicted if self.predicted else math.inf


def misses(report: Report, tolerance: Mapping[str, float] = TOLERANCE) -> list[Miss]:
    """The lines where the measurement and the first prediction differ beyond `tolerance`, in LINES order.

    Only lines both sides have; none before a measurement or without a prediction."""
    primary, measured = report.primary, report.measured
    if primary is None or measured is None:
        return []
    found = []
    for line in LINES:
        p, m = primary.get(line), measured.get(line)
        if line not in tolerance or p is None or m is None or (p == 0 and m == 0):
            continue
        if p == 0 or abs(m / p - 1) > tolerance[line]:
            found.append(Miss(line, p, m))
    return found


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def bar_chart(report: Report):
    """memory/predicted_vs_measured: each memory line's first prediction and measurement side by side (a
    bar chart: one-off values, where a custom-scalars chart would plot isolated dots against steps).
    With no prediction (measured only), the measured bars alone."""
    from matplotlib.figure import Figure

    names = [n for n in report.lines() if not n.startswith("flops")]
    measured = [((report.measured.get(n) if report.measured else None) or 0) / MB for n in names]
    figure = Figure(figsize=(7, 0.6 * len(names) + 1.2), layout="constrained")
    axes = figure.add_subplot()
    ys = range(len(names))
    primary = report.primary
    if primary is None:  # measured only (a module the dry run cannot trace): one bar per line
        axes.barh(list(ys), measured, 0.6, label="measured", color="#dd8452")
    else:
        height = 0.38
        predicted = [(primary.get(n) or 0) / MB for n in names]
        axes.barh([y - height / 2 for y in ys], predicted, height, label=next(iter(report.predicted)), color="#4c72b0")
        axes.barh([y + height / 2 for y in ys], measured, height, label="measured", color="#dd8452")
    axes.set_yticks(list(ys), names)
    axes.invert_yaxis()
    axes.set_xlabel("MB per device (1 MB = 1e6 bytes)")
    figure.legend(loc="outside lower center", ncols=2)
    return figure
