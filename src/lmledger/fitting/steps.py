"""Checks on a run's first real step. The name of the event file a full disk refused."""

from __future__ import annotations

import errno
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lmledger.errors import UserError
from lmledger.ledger.dryrun.fakecopy import batch_tensors

__all__ = ["NameTheEventFile", "StepChecks", "disk_error"]

_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EIO}


def disk_error(err: BaseException | None) -> OSError | None:
    """The OSError of a refused write (_DISK_ERRNOS) that `err` is, or was raised from; or None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _DISK_ERRNOS:
            return err
        err = err.__cause__
    return None


class NameTheEventFile(pl.Callback):
    """Name the run's newest event file on a bare disk OSError from TensorBoard.

    An event file that cannot be written fails in the logger's writer thread. The error is a bare
    `OSError: [Errno 28]`, with no file named. It is re-raised in the training loop at the next write.
    Named, main reports it as one line, like a failed checkpoint write.
    """

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning's log_metrics raises it as the cause of a ValueError ("you tried to log 6.17 which
        # is currently not supported"). Its logger.finalize then re-raises the OSError itself.
        exception = disk_error(exception)
        if exception is None or exception.filename:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and logger.log_dir and Path(logger.log_dir).is_dir():
                events = sorted(Path(logger.log_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
                if events:
                    exception.filename = str(events[-1])
                    return


class StepChecks(pl.Callback):
    """On the first training batch, refuse in one line what Lightning lets pass for any module.

    That is three things. A training_step that returns no loss: Lightning skips the step, so nothing
    trains. A loss that is not a scalar that needs grad: a traceback in backward. And, with the ledger
    on, a batch holding no tensor. The ledger reads batch shapes from tensors; without them its
    samples/s would be wrong.
    """

    def __init__(self, read_batches: bool = True) -> None:
        self.read_batches = read_batches
        self._checked_start = self._checked_loss = self._checked_end = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._checked_start:
            return
        self._checked_start = True
        if self.read_batches and not batch_tensors(batch):
            raise UserError(
                f"the first training batch is a {type(batch).__name__} holding no tensor: the ledger reads "
                "batches of tensors (a tensor, or tuples, lists or dicts of them); return tensors from the "
                "data module's collate_fn, or run with --ledger.enabled false"
            )

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._checked_loss:
            return
        self._checked_loss = True
        if loss.numel() != 1 or not loss.requires_grad:
            got = f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a loss that needs no grad"
            raise UserError(
                f"{type(pl_module).__name__}.training_step returned {got}: return a scalar loss computed from "
                "the model's parameters (reduce it with .mean(); do not detach it or compute it under no_grad)"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._checked_end:
            return
        self._checked_end = True
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # Lightning passes {} for a skip
        if pl_module.automatic_optimization and loss is None:
            raise UserError(
                f"{type(pl_module).__name__}.training_step returned None on the first batch, so Lightning skipped "
                "the step and nothing trains: return the loss (a scalar tensor, or a dict with a 'loss' key)"
            )
