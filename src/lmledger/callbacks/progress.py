"""Progress as plain lines, for logs that are not a terminal: batch jobs, CI, `make demo > log`.

Lightning's bars redraw in place and show nothing useful in a file. `PlainProgress` is a progress
bar in Lightning's sense. It receives the `prog_bar` values: loss, tok/s, mfu. It prints one line per
logging interval and one per validation:

    step 100/600  loss 2.3456  tok/s 12,345  mfu 0.457  elapsed 0:21  eta 1:45
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

from lmledger.lightning_private import accumulating

__all__ = ["PlainProgress", "plain_progress_if_not_a_terminal"]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _value(name: str, value: float) -> str:
    if name == "tok/s":
        return f"{value:,.0f}"
    if name in ("mfu", "hfu"):  # a tiny model's MFU is ~1e-4: never printed as 0.000 while it is not 0
        return f"{value:.3f}" if value >= 1e-3 or value == 0 else f"{value:.1e}"
    return f"{value:.4f}"


class PlainProgress(ProgressBar):
    """One line to `stream` every `log_every_n_steps` optimizer steps, and after each validation."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self._stream = stream
        self._enabled = True
        self._start: float | None = None
        self._start_step = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, line: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(line, file=self._stream or sys.stdout, flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # ETA from this session's own rate: a resumed run starts the clock at its first new step.
        self._start, self._start_step = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._start_step or step % trainer.log_every_n_steps or accumulating(trainer):
            return
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        parts = [f"step {step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        # Validation's values stay in the bar's metrics between validations. They get their own line.
        parts += [f"{k} {_value(k, v)}" for k, v in metrics.items() if not k.startswith("val/")]
        elapsed = time.perf_counter() - self._start
        parts.append(f"elapsed {_clock(elapsed)}")
        if trainer.max_steps > 0:
            remaining = (trainer.max_steps - step) * elapsed / (step - self._start_step)
            parts.append(f"eta {_clock(remaining)}")
        self._print("  ".join(parts))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        values = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        # `validate` restores a checkpoint's weights, not its loops: its global_step is 0 whatever step it holds
        where = f"step {trainer.global_step}" if trainer.state.fn == "fit" else f"validate {trainer.ckpt_path}".strip()
        if values:
            self._print(f"{where}  " + "  ".join(f"{k} {float(v):.4f}" for k, v in values.items()))


def plain_progress_if_not_a_terminal(enable_progress_bar: bool | None) -> list[pl.Callback]:
    """[PlainProgress()] if stdout is no terminal and the config keeps a progress bar; else []."""
    if enable_progress_bar is False or sys.stdout.isatty():
        return []
    return [PlainProgress()]
