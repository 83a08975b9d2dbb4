"""Every read or write of Lightning's private state, in one place.

Each function was read from Lightning 2.6.6. A canary in tests/test_canaries.py (named beside it)
holds it to the installed version. So an upgrade that moves one fails there, not mid-run.
FitCLI also overrides LightningCLI._parse_ckpt_path (canary: test_cli_parses_ckpt_path_in_a_private_hook).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI

__all__ = [
    "accumulating",
    "batches_fetched",
    "batches_that_stepped",
    "cli_value",
    "is_local_path",
    "observe_child_ranks",
    "pin_logger_version",
    "save_last_checkpoint",
    "should_update_logs",
    "take_received_sigterm",
]


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether Lightning treats `path` as a local file (no s3://, http://, ...).
    Canary: test_local_file_protocol."""
    return _is_local_file_protocol(path)


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes train metrics after this batch (every log_every_n_steps).
    Canary: test_should_update_logs_follows_log_every_n_steps."""
    return trainer._logger_connector.should_update_logs


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning's own train metrics are logged at: optimizer steps taken (LearningRateMonitor's).
    Canary: test_epoch_loop_counts_batches_that_stepped."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def batches_fetched(trainer: pl.Trainer) -> int:
    """Training batches the fit loop has fetched, across epochs. Restored from a checkpoint on resume.
    Canary: test_epoch_loop_counts_batches_that_stepped."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether the batch just run only accumulates gradients (no optimizer step follows it).
    Canary: test_epoch_loop_counts_batches_that_stepped."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def take_received_sigterm(trainer: pl.Trainer) -> bool:
    """Whether Lightning's SIGTERM handler has fired. Clears its flag, so Lightning does not stop too.
    Canary: test_signal_connector_keeps_a_sigterm_flag."""
    connector = trainer._signal_connector
    received = connector.received_sigterm
    connector.received_sigterm = False
    return received


def save_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """Have `callback` save its "last" checkpoint now, unless it saved this step. Return its path.
    ModelCheckpoint's own save keeps its naming (last-vN.ckpt) and its record of the last path.
    Canary: test_model_checkpoint_saves_last_through_private_methods."""
    if callback._last_global_step_saved != trainer.global_step or not callback.last_model_path:
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
    return callback.last_model_path


def pin_logger_version(logger: Any, claim: Callable[[str], int]) -> None:
    """Pin the version of a TensorBoardLogger / CSVLogger that has not chosen one yet.
    It gets what `claim(root_dir)` returns, not the next free one it would list the directory for later.
    Canary: test_logger_picks_its_version_lazily."""
    if logger._version is None:
        logger._version = claim(logger.root_dir)


def cli_value(cli: LightningCLI, config: Any, key: str, default: Any = None) -> Any:
    """`key` of a LightningCLI config, under the running subcommand if there is one.
    Canary: test_cli_get_reads_under_the_subcommand."""
    return cli._get(config, key, default=default)


def observe_child_ranks(on_start: Callable[[list], None], on_death: Callable[[list], bool]) -> None:
    """Hooks on Lightning's _ChildProcessObserver, the thread its subprocess launcher (rank 0) starts to watch
    local ranks 1..N-1: on_start(procs) when it starts; on_death(procs) when a child has failed, before the
    observer SIGKILLs every rank, the launcher included, with nothing on screen (on_death returns False to let
    the launcher end by itself). Canary: test_lightning_observer_kills_the_launcher_when_a_child_dies."""
    from lightning.fabric.strategies.launchers import subprocess_script

    base = subprocess_script._ChildProcessObserver
    if getattr(base, "lmledger_hooked", False):
        return

    class Observer(base):
        lmledger_hooked = True

        def __init__(self, main_pid: int, child_processes: list, sleep_period: int = 5) -> None:
            super().__init__(main_pid, child_processes, sleep_period)
            on_start(child_processes)

        def _terminate_all(self) -> None:
            if on_death(self._child_processes):
                super()._terminate_all()

    subprocess_script._ChildProcessObserver = Observer
