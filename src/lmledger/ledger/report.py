"""One device's ledger: a training step's figures from each source, side by side.

`Figures` is one source's reading of one optimizer step on one device. The source is the dry run,
the toy LM's closed forms, or the real step. `Report` holds the predictors' Figures beside the
measured ones: the one row representation every mode fills (`lmledger account` in each of its modes,
`fit`'s Ledger and its per-rank record). It renders them three ways, each from the same rows: a table
(`render`: rich for the terminal, or markdown), a JSON object (`to_json`: the one shape, SCHEMA, whose
paths are the TensorBoard tags) and TensorBoard scalars (one tag per line and source). Every ratio
divides the measurement by the first predictor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.table import Table

from lmledger.ledger.units import MB, ROW_LABELS, ROWS, format_bytes, format_count

__all__ = [
    "BYTE_LINES", "FLOP_LINES", "LINES", "RUN_KEYS", "SCHEMA", "TOLERANCE", "Figures", "Miss", "Report", "bar_chart",
    "figures_of_step", "ledger_tags", "markdown_table", "misses", "render", "source_slug",
]  # fmt: skip

# The lines of every ledger table, in order (units.ROWS, the one list): bytes per device, then FLOPs per step.
LINES = ROWS
FLOP_LINES = tuple(line for line in LINES if line.startswith("flops_"))
BYTE_LINES = tuple(line for line in LINES if line not in FLOP_LINES)
LABELS = ROW_LABELS

# The version of the one JSON shape (Report.to_json, docs/commands.md "The JSON shape"): a reader checks it.
SCHEMA = 1
# The facts under its "run", in every mode (account's, fit's rank record); None where a mode does not know one.
RUN_KEYS = ("model", "batch_size", "seq_len", "tokens_per_step", "precision", "optimizer", "strategy", "world_size",
            "device", "peak_phase", "measured_peak_phase", "not_predicted")  # fmt: skip

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
    # "step time" (seconds) and "tokens/s" or "samples/s": (predicted, measured), ledger/timing/steptime beside the fit
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
        return render(self.header(), self.rows(), title=title, caption="; ".join(self.notes))

    def markdown(self) -> str:
        return render(self.header(), self.rows(), markdown=True) + "\n\n" + "; ".join(self.notes)

    def slugs(self) -> dict[str, str]:
        """{JSON and TensorBoard key: source name}: "predicted" is the first predictor, "measured" the step."""
        out = {source_slug(name, i == 0): name for i, name in enumerate(self.predicted)}
        return {**out, "measured": "measured"} if self.measured is not None else out

    def to_json(self, run: Mapping[str, object] | None = None, params: int | None = None) -> dict[str, object]:
        """The one JSON shape (SCHEMA; shared/DESIGN.md, docs/commands.md): every mode fills these keys, extra
        modes add keys.

        {"schema", "run", "params", "sources": {key: source}, "memory": {byte line: {key: bytes}},
        "flops": {"model", "hardware", "measured", "<key>"} per step, "state_bytes_per_param": {"predicted",
        "measured"}, "why_missing": {key: {line: why}}, "notes", "rates", "times"}. "predicted" and "measured"
        are always there (null where that source has none). ledger_tags gives a figure's TensorBoard tag."""
        slugs = {"predicted": None, **self.slugs()}
        slugs.setdefault("measured", None)
        figures = {slug: (self.measured if slug == "measured" else self.predicted.get(name)) for slug, name in
                   slugs.items()}  # fmt: skip
        primary = figures["predicted"]
        flops = {
            "model": primary.flops_model if primary else None,
            "hardware": primary.flops_hardware if primary else None,
            "measured": figures["measured"].flops_hardware if figures["measured"] else None,
        }
        for slug, f in figures.items():
            if slug not in ("predicted", "measured"):
                flops[slug] = f.flops_hardware
        return {
            "schema": SCHEMA,
            "run": dict(run or {}),
            "params": params,
            "sources": slugs,
            "memory": {line: {slug: f.get(line) if f else None for slug, f in figures.items()} for line in BYTE_LINES},
            "flops": flops,
            "state_bytes_per_param": {slug: _state_per_param(figures[slug], params) for slug in ("predicted",
                                                                                                 "measured")},
            "why_missing": {slug: dict(f.why_missing) for slug, f in figures.items() if f and f.why_missing},
            "notes": list(self.notes),
            "rates": dict(self.rates),
            "times": {k: {"predicted": p, "measured": m} for k, (p, m) in self.times.items()},
        }  # fmt: skip

    def scalars(self, which: str = "all") -> dict[str, float]:
        """TensorBoard tags. `which`: "predicted", "measured" or "all". The same keys as to_json's paths.

        memory/{predicted,closed_form,measured}/<line> (bytes), flops/{hardware,model,closed_form,measured}_per_step.
        """
        sources: dict[str, Figures] = {}
        if which in ("predicted", "all"):
            sources.update({source_slug(n, i == 0): f for i, (n, f) in enumerate(self.predicted.items())})
        if which in ("measured", "all") and self.measured is not None:
            sources["measured"] = self.measured
        tags: dict[str, float] = {}
        for slug, f in sources.items():
            for line in BYTE_LINES:
                if f.get(line) is not None:
                    tags[f"memory/{slug}/{line}"] = f.get(line)
            if slug == "measured":
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


def ledger_tags(doc: Mapping[str, object]) -> dict[str, float]:
    """The TensorBoard tags of the one JSON shape's figures (Report.scalars' names): memory.<line>.<key> is
    memory/<key>/<line>, flops.<kind> is flops/<kind>_per_step. Null figures have no tag."""
    tags: dict[str, float] = {}
    for line, by_source in (doc.get("memory") or {}).items():
        for slug, value in (by_source or {}).items():
            if value is not None:
                tags[f"memory/{slug}/{line}"] = value
    for kind, value in (doc.get("flops") or {}).items():
        if value is not None:
            tags[f"flops/{kind}_per_step"] = value
    return tags


def source_slug(name: str, first: bool = False) -> str:
    """A source's key in JSON and TensorBoard: the first predictor is "predicted"; "closed form" -> closed_form."""
    return "predicted" if first else _SOURCE_TAGS.get(name, name.replace(" ", "_"))


def _state_per_param(figures: Figures | None, params: int | None) -> float | None:
    """Bytes of params, grads and optimizer state per parameter (16 for fp32 AdamW), or None."""
    state = [figures.get(n) for n in ("params", "grads", "optimizer")] if figures else [None]
    return sum(state) / params if params and all(v is not None for v in state) else None


def render(header: list[str], rows: list[tuple[str, ...]], *, title: str = "", caption: str = "",
           markdown: bool = False) -> Table | str:  # fmt: skip
    """The one table renderer: a rich Table for the terminal, or markdown text (TensorBoard, docs).

    The first column is the label, left-aligned; the others are figures, right-aligned."""
    if markdown:
        return markdown_table(header, [list(r) for r in rows])
    table = Table(title=title or None, title_justify="left")
    for i, column in enumerate(header):
        table.add_column(column, justify="right" if i else "left")
    for row in rows:
        table.add_row(*row)
    table.caption = caption or None
    return table


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
