"""The memory ledger during a fit: predicted bytes at fit start, their measured twins on the first steps.

Predicted (lmledger.ledger.memory, for the run's precision, optimizer, sharding and per-device batch):
params, grads, optimizer state, saved activations and the peak of one steady-state step.
Measured, each once:
- params / grads / optimizer: the bytes the real tensors hold, after the first optimizer step;
- activations: every tensor autograd saves during the first training forward (saved-tensor hooks,
  closed before backward so nothing is held longer than the step holds it). Not measured under
  torch.compile: the compiled graph saves a different (fused) set than the eager model predicted;
- peak: over the second training step (the first allocates the optimizer state and is not the
  steady state the prediction describes): on CUDA torch.cuda.max_memory_allocated (stats reset when
  it starts); elsewhere, the CPU included, the high-water mark of live tensor bytes that
  ledger.memtrack.MemoryTracker counts (parameters, gradients, optimizer state and the batch, plus
  every tensor the step makes), with the phase it fell in (forward, zero_grad, backward, optimizer
  step). Manual optimization: not measured.

The hooks and the tracker run as `with` blocks inside their step's LightningModule.optimizer_step
call, which in automatic optimization holds the whole step (the closure: forward, zero_grad,
backward; then the step): they leave when the step ends or raises. Later steps run without them.

Under *-mixed precision, the low-precision weight copies autocast makes are counted in neither
params nor activations: they are their own line, `autocast_weight_copies` (the copies the linear
layers save for backward), and the predicted peak includes every copy alive at the end of forward.

Everything is written as scalars (`memory/predicted/*`, `memory/measured/*`, bytes), as a text
table (`memory/table`), and as one bar chart with predicted and measured side by side
(`memory/predicted_vs_measured`). A bar chart rather than a custom-scalars layout: these are
one-off values, and a custom-scalars chart plots tags against steps, which would show ten isolated
dots told apart only by a legend; bars put each component's two figures next to each other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from lmledger.callbacks.run import (
    LedgerRun,
    log_scalars,
    log_text,
    logging_step,
    markdown_table,
    tensorboard_writers,
)
from lmledger.ledger import precisions
from lmledger.ledger.memory import (
    measure_saved_activations,
    measure_state_bytes,
)
from lmledger.ledger.memtrack import MemoryTracker
from lmledger.ledger.predict import predict
from lmledger.ledger.units import MB, MEMORY_COMPONENTS, MEMORY_ROWS, format_bytes

COPIES = "autocast_weight_copies"


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes per device. activations / peak are None where ledger.memory has no model for
    the precision or device (`unmodelled` says why)."""

    params: int
    grads: int
    optimizer: int
    activations: int | None
    autocast_weight_copies: int | None
    peak: int | None
    peak_phase: str | None
    unmodelled: str | None = None

    def as_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in (*MEMORY_ROWS, COPIES)}

    def largest_component(self) -> tuple[str, int]:
        """The biggest term the peak is made of."""
        terms = {name: getattr(self, name) for name in (*MEMORY_COMPONENTS, COPIES)}
        name = max((n for n, v in terms.items() if v is not None), key=lambda n: terms[n])
        return name, terms[name]


def uses_autocast(precision: str) -> bool:
    return precisions.precision(precision).autocast is not None


def predict_memory(run: LedgerRun, batch_size: int | None = None) -> MemoryPrediction:
    """The ledger's prediction for `run`, or for the same run at another per-device batch size
    (ledger.predict.predict, the one account, plan and the sweeps show too)."""
    p = predict(run, batch_size=batch_size)
    if p.peak is None:
        return MemoryPrediction(**p.state, activations=None, autocast_weight_copies=None, peak=None,
                                peak_phase=None, unmodelled=p.unmodelled)  # fmt: skip
    copies = p.autocast_weight_copies if uses_autocast(p.forward_precision) else None
    return MemoryPrediction(**p.state, activations=p.activations, autocast_weight_copies=copies, peak=p.peak,
                            peak_phase=p.peak_phase)  # fmt: skip


@dataclass
class MemoryMeasurement:
    values: dict[str, int] = field(default_factory=dict)
    why_missing: dict[str, str] = field(default_factory=dict)  # component -> "n/a (compiled)", ...
    peak_phase: str | None = None  # where the measured peak fell (tracker only; CUDA's has no phase)


def memory_rows(
    run: LedgerRun, predicted: MemoryPrediction, measured: MemoryMeasurement | None
) -> list[tuple[str, int | None, str, str]]:
    """(component, predicted bytes, measured text, measured/predicted text) per table line."""
    names = list(MEMORY_ROWS)
    if uses_autocast(run.precision):
        names.insert(4, COPIES)
    rows = []
    for name in names:
        pred = getattr(predicted, name)
        if measured is None:
            shown, ratio = "after the first steps", ""
        elif name in measured.values:
            value = measured.values[name]
            shown = format_bytes(value)
            ratio = f"{value / pred:.3f}" if pred else ""
        else:
            shown, ratio = measured.why_missing.get(name, "not measured"), ""
        rows.append((name, pred, shown, ratio))
    return rows


def memory_table(run: LedgerRun, predicted: MemoryPrediction, measured: MemoryMeasurement | None, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("component", "predicted", "measured", "measured/predicted"):
        table.add_column(column, justify="left" if column == "component" else "right")
    for name, pred, shown, ratio in memory_rows(run, predicted, measured):
        table.add_row(name, format_bytes(pred), shown, ratio)
    table.caption = memory_caption(run, predicted, measured)
    return table


def memory_caption(run: LedgerRun, predicted: MemoryPrediction, measured: MemoryMeasurement | None = None) -> str:
    where = (
        f"{run.precision}, {run.optimizer}, {run.strategy} x{run.world_size}, batch {run.batch_size} x {run.seq_len}"
    )
    notes = [f"per device ({where})"]
    if predicted.peak_phase:
        notes.append(f"peak during {predicted.peak_phase}")
    if measured is not None and measured.peak_phase:
        notes.append(f"measured peak (live tensor bytes) during {measured.peak_phase}")
    if uses_autocast(run.precision):
        notes.append(f"{COPIES}: autocast's low-precision weight casts, in neither params nor activations; in the peak")
    if predicted.unmodelled:
        notes.append(f"activations/peak n/a: {predicted.unmodelled}")
    return "; ".join(notes)


def print_memory_table(table: Table, stderr: bool = False) -> None:
    Console(stderr=stderr).print(table)


class MemoryLedger(pl.Callback):
    """Predicted memory at fit start; measured twins on the first steps; a summary at the end.

    Args:
        measure: measure on the first two steps (False: predictions only).
    """

    def __init__(self, measure: bool = True) -> None:
        self.measure = measure
        self.run: LedgerRun | None = None
        self.predicted: MemoryPrediction | None = None
        self.measured = MemoryMeasurement()
        self._pending: set[str] = set()
        self._reported = False
        self._first_step = 0
        self._hooks: contextlib.ExitStack | None = None  # the open saved-tensor hooks
        self._saved = None
        self._peak_armed = False
        self._tracker: MemoryTracker | None = None  # live-tensor peak off CUDA, over one step

    # -- fit start: the prediction ------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run = LedgerRun.from_trainer(trainer, pl_module)
        self.predicted = predict_memory(self.run)
        self.measured = MemoryMeasurement()
        self._reported = False
        self._pending = {"state", "activations", "peak"} if self.measure else set()
        if self.run.compiled:
            self._skip("activations", "n/a (compiled)")
        if trainer.is_global_zero:
            print_memory_table(memory_table(self.run, self.predicted, None, "memory ledger (predicted)"))
        predicted = {f"memory/predicted/{k}": v for k, v in self.predicted.as_dict().items() if v is not None}
        log_scalars(trainer, predicted)

    def _skip(self, what: str, why: str) -> None:
        self._pending.discard(what)
        self.measured.why_missing[what] = why

    # -- the first steps: measurement ---------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # > 0 when resuming

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        steps_done = trainer.global_step - self._first_step
        if "activations" in self._pending and steps_done == 0 and self._hooks is None:
            if pl_module.automatic_optimization:
                self._around_next_optimizer_step(pl_module, self._record_saved_tensors)
            else:  # forward runs before any optimizer step: open the hooks now
                self._open_saved_tensor_hooks()
        if "peak" in self._pending and steps_done == 1 and not self._peak_armed:
            if self.run.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.run.device)
            elif not pl_module.automatic_optimization:
                self._skip("peak", "n/a (manual optimization)")
                return
            else:
                optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
                self._tracker = MemoryTracker().track(self.run.model, optimizers, batch)
                self._around_next_optimizer_step(pl_module, self._run_tracker)
            self._peak_armed = True

    @staticmethod
    def _around_next_optimizer_step(pl_module, context) -> None:
        """Run the next pl_module.optimizer_step call (in automatic optimization the whole step:
        module docstring) inside `with context():`, through an instance attribute that removes
        itself when called. An exception in the step unwinds the block whatever the callbacks do."""
        optimizer_step = pl_module.optimizer_step

        def measured_optimizer_step(*args, **kwargs):
            vars(pl_module).pop("optimizer_step", None)  # this step only
            with context():
                return optimizer_step(*args, **kwargs)

        pl_module.optimizer_step = measured_optimizer_step

    def _open_saved_tensor_hooks(self) -> None:
        self._hooks = contextlib.ExitStack()
        self._saved = self._hooks.enter_context(measure_saved_activations(self.run.model))

    @contextlib.contextmanager
    def _record_saved_tensors(self):
        """The saved-tensor hooks, from here until on_before_backward (or the end of the block)."""
        self._open_saved_tensor_hooks()
        try:
            yield
        finally:
            self._close_hooks()

    @contextlib.contextmanager
    def _run_tracker(self):
        self._tracker.phase("forward")
        with self._tracker:
            yield

    def _untrack(self, pl_module) -> None:
        if pl_module is not None:
            vars(pl_module).pop("optimizer_step", None)
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None

    def _phase(self, name: str) -> None:
        if self._tracker is not None and self._tracker.running:
            self._tracker.phase(name)

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self._phase("zero_grad")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._phase("optimizer step")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # Forward is over: everything backward needs has been saved. Stop recording here, so the
        # hooks' references do not keep activations alive into backward.
        self._close_hooks()
        self._phase("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._close_hooks()  # a step that skipped backward
        if self._saved is not None:
            self.measured.values["activations"] = self._saved.activations
            if uses_autocast(self.run.precision):
                self.measured.values[COPIES] = self._saved.autocast_weight_copies
            self._saved = None
            self._pending.discard("activations")
        if self._peak_armed and self._tracker is not None and self._tracker.stopped:
            self.measured.values["peak"] = self._tracker.peak_bytes
            self.measured.peak_phase = self._tracker.peak_phase
            self._tracker = None
            self._peak_armed = False
            self._pending.discard("peak")
        elif self._peak_armed and self._tracker is None:
            torch.cuda.synchronize(self.run.device)
            self.measured.values["peak"] = torch.cuda.max_memory_allocated(self.run.device)
            self._peak_armed = False
            self._pending.discard("peak")
        # else: a tracker still waits for its optimizer step (gradient accumulation)
        if "state" in self._pending and trainer.global_step > self._first_step:
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            self.measured.values.update(measure_state_bytes(self.run.model, getattr(optimizer, "optimizer", optimizer)))
            self._pending.discard("state")
        if self.measure and not self._pending and not self._reported:
            self._report_measured(trainer)

    def _close_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    # -- the end: a summary -------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.predicted is None:
            return
        for what in self._pending:
            self.measured.why_missing.setdefault(what, "not measured (run too short)")
        if self.measure and not self._reported:
            self._report_measured(trainer)
        if trainer.is_global_zero:
            measured = self.measured if self.measure else None
            print_memory_table(memory_table(self.run, self.predicted, measured, "memory ledger (summary)"))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close_hooks()
        self._untrack(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._untrack(pl_module)  # a run that ended before its tracked step

    def _report_measured(self, trainer: pl.Trainer) -> None:
        self._reported = True
        scalars = {f"memory/measured/{k}": v for k, v in self.measured.values.items() if k in (*MEMORY_ROWS, COPIES)}
        log_scalars(trainer, scalars)
        rows = []
        for name, pred, shown, ratio in memory_rows(self.run, self.predicted, self.measured):
            measured_bytes = str(self.measured.values[name]) if name in self.measured.values else ""
            rows.append([name, format_bytes(pred), shown, ratio, "n/a" if pred is None else str(pred), measured_bytes])
        text = markdown_table(
            ["component", "predicted", "measured", "measured/predicted", "predicted bytes", "measured bytes"], rows
        )
        text += "\n\n" + memory_caption(self.run, self.predicted, self.measured)
        log_text(trainer, "memory/table", text)
        for writer in tensorboard_writers(trainer):
            writer.add_figure("memory/predicted_vs_measured", self._bar_chart(), global_step=logging_step(trainer))

    def _bar_chart(self) -> Figure:
        rows = memory_rows(self.run, self.predicted, self.measured)
        names = [name for name, *_ in rows]
        predicted = [(getattr(self.predicted, n) or 0) / MB for n in names]
        measured = [self.measured.values.get(n, 0) / MB for n in names]
        figure = Figure(figsize=(7, 0.6 * len(names) + 1.2), layout="constrained")
        axes = figure.add_subplot()
        ys = range(len(names))
        height = 0.38
        axes.barh([y - height / 2 for y in ys], predicted, height, label="predicted", color="#4c72b0")
        axes.barh([y + height / 2 for y in ys], measured, height, label="measured", color="#dd8452")
        for y, name in zip(ys, names, strict=True):
            if name not in self.measured.values:
                axes.text(0, y + height / 2, " " + self.measured.why_missing.get(name, "not measured"),
                          va="center", fontsize=8)  # fmt: skip
        axes.set_yticks(list(ys), names)
        axes.invert_yaxis()
        axes.set_xlabel("MB per device (1 MB = 1e6 bytes)")
        axes.set_title(f"memory ledger: {self.run.precision}, batch {self.run.batch_size} x {self.run.seq_len}")
        figure.legend(loc="outside lower center", ncols=2)
        return figure
