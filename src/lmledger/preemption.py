"""Save and stop on SIGTERM/SIGUSR1 at a step boundary; requeue the run's SLURM job.

    PreemptionCheckpoint    SIGTERM or SIGUSR1 -> finish this step, save last.ckpt, stop (Preempted)
    noted_stop_signals      keeps a SIGUSR1 that comes while the run is built, for the first step boundary

`slurm_job_key`, `slurm_line` and `_requeue_slurm_job` deal with the SLURM job this process runs in;
`run_key` and `elastic_line` with the SLURM job or torchrun run that restarts it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lmledger.lightning_private import accumulating, save_last_checkpoint, take_received_sigterm

__all__ = [
    "Preempted",
    "PreemptionCheckpoint",
    "elastic_line",
    "elastic_run_id",
    "noted_stop_signals",
    "run_key",
    "slurm_job_key",
    "slurm_line",
]

# ------------------------------------------------------------------------------------- SLURM


def slurm_job_key(env=None) -> str | None:
    """This process's SLURM job, as `scontrol requeue` names it; None outside SLURM.

    An array task is "ARRAYJOB_TASK"; any other job, its id.
    """
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def slurm_line(env=None) -> str | None:
    """A run's SLURM line, for its first line and TensorBoard text.

    For example: "SLURM job 12 (array task 3 of job 9), restart 1".
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    array = env.get("SLURM_ARRAY_JOB_ID")
    task = f" (array task {env.get('SLURM_ARRAY_TASK_ID')} of job {array})" if array else ""
    return f"SLURM job {job}{task}, restart {env.get('SLURM_RESTART_COUNT') or 0}"


def elastic_run_id(env=None) -> str | None:
    """torchrun's run id (TORCHELASTIC_RUN_ID: its --rdzv-id), the same for every restart of its workers.

    None outside torchrun. torchrun's default id is "none", shared by every torchrun not given one.
    """
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_RUN_ID") or None


def run_key(env=None) -> tuple[str, str] | None:
    """What keys `--ckpt_path auto` to this run across restarts: (key, words), or None outside a launcher.

    A SLURM job (slurm_job_key): ("812", "SLURM job 812"). Under torchrun: ("torchrun:ID", "torchrun run ID").
    The key is written in the version directory's slurm_job file; the prefix keeps the two apart.
    """
    job = slurm_job_key(env)
    if job is not None:
        return job, f"SLURM job {job}"
    run = elastic_run_id(env)
    if run is not None:
        return f"torchrun:{run}", f"torchrun run {run}"
    return None


def elastic_line(env=None) -> str | None:
    """A torchrun worker's first line: "torchrun run ID (TORCHELASTIC_RUN_ID), this node's restart 1 of at most 2".

    The count is the node's agent's: an agent whose workers did not fail restarts them uncounted.
    """
    env = os.environ if env is None else env
    run = elastic_run_id(env)
    if run is None:
        return None
    most = env.get("TORCHELASTIC_MAX_RESTARTS")
    restarts = f"this node's restart {env.get('TORCHELASTIC_RESTART_COUNT') or 0}" + (
        f" of at most {most}" if most else ""
    )
    shared = "; torchrun's default --rdzv-id, which every torchrun without one shares" if run == "none" else ""
    return f"torchrun run {run} (TORCHELASTIC_RUN_ID{shared}), {restarts}"


def _slurm_job_state(job: str) -> str | None:
    """The job's state from scontrol (RUNNING, COMPLETING, CANCELLED, ...); None if unknown."""
    import subprocess

    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bJobState=(\S+)", out)
    return match.group(1) if match else None


def _requeue_slurm_job(signum: int | None) -> str | None:
    """Requeue this process's job once its checkpoint is saved; a few words on the outcome.

    SIGUSR1 is SLURM's warning: `--signal=B:USR1@N` before the time limit, or `scancel --signal=USR1`.
    The job would end, so it is requeued here. On SIGTERM it is requeued only while SLURM counts it
    RUNNING (`scancel --signal=TERM`). After `scontrol requeue` or a preemption, SLURM requeues it
    itself. After a plain `scancel` (CANCELLED), the user asked it to end.
    """
    import subprocess

    job = slurm_job_key()
    if job is None:
        return None
    if signum != getattr(signal, "SIGUSR1", None):
        state = _slurm_job_state(job)
        if state != "RUNNING":
            return f"not requeued by lmledger (job {job} is {state or 'unknown to scontrol'})"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"requeue of job {job} failed ({err})"
    if done.returncode != 0:
        return f"requeue of job {job} failed ({' '.join(done.stderr.split()) or done.returncode})"
    return f"job {job} requeued"


# ------------------------------------------------------------------------------------- preemption


class Preempted(SIGTERMException):
    """Training stopped on SIGTERM/SIGUSR1 after a complete step.

    `checkpoint` holds that step (None: nothing was saved). `requeued` says what became of the SLURM
    job (None outside SLURM).
    """

    def __init__(self, step: int, checkpoint: str | None, requeued: str | None = None) -> None:
        super().__init__(143)
        self.step, self.checkpoint, self.requeued = step, checkpoint, requeued


_EARLY_SIGNALS: list[int] = []


def _note_early(signum, frame) -> None:
    _EARLY_SIGNALS.append(signum)


@contextlib.contextmanager
def noted_stop_signals():
    """Note a SIGUSR1 while `lmledger fit` parses and builds, before PreemptionCheckpoint takes over.

    Its default action would end the process. Noted, it is acted on at the first step boundary. A
    handler someone else installed stays.
    """
    usr1 = getattr(signal, "SIGUSR1", None)
    try:
        previous = signal.getsignal(usr1) if usr1 is not None else None
        if previous == signal.SIG_DFL:
            signal.signal(usr1, _note_early)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        _EARLY_SIGNALS.clear()
        if previous == signal.SIG_DFL:
            signal.signal(usr1, signal.SIG_DFL)


# The signals that mean "save and stop". SLURM and Kubernetes send SIGTERM before killing a job. SLURM
# sends SIGUSR1 as its warning before a time limit (`#SBATCH --signal=B:USR1@90`) or on `scancel --signal=USR1`.
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM or SIGUSR1: finish the optimizer step, save last.ckpt, requeue, stop with `Preempted`.

    The save is atomic. The requeue is of the run's SLURM job (_requeue_slurm_job).

    Lightning's own SIGTERM handler stops after the current batch without saving, even
    mid-accumulation. It exits 0 (canary test_lightning_stops_on_sigterm_without_saving). Its SLURM
    requeue (SIGUSR1) works only when SLURMEnvironment is detected (srun or --ntasks). It saves an
    hpc_ckpt_N.ckpt that `--ckpt_path last` does not see, and saves mid-accumulation.

    This is the one path instead. The handler only takes note. The decision to stop is made at the
    step boundary, reduced over the ranks. If any rank is signalled, all stop at the same step. The
    save follows the optimizer step, where ModelCheckpoint saves. The stop comes at the next batch's
    start, after that step's logging and validation.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self.saved: str | None = None
        self.requeued: str | None = None
        self._saved_step = -1
        self._previous: dict[int, Any] = {}  # installed over these, restored at the end of the fit
        self._original: dict[int, Any] = {}  # kept: what a stale handler defers to
        self._active = False

    def _on_signal(self, signum, frame) -> None:
        if not self._active:  # left installed by Lightning's teardown after this fit: act as before it
            previous = self._original.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.signum = self.signum or signum

    def _install(self, signum: int) -> None:
        if signum in self._previous:
            return
        try:
            self._previous[signum] = signal.signal(signum, self._on_signal)
            self._original.setdefault(signum, self._previous[signum])
        except ValueError:  # not the main thread: leave the handlers as they are
            pass

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # SIGUSR1 from now on: its default action ends the process, and SLURM may send it during set-up.
        # (Lightning registers its own SIGUSR1 handler only for SLURMEnvironment(auto_requeue=True), which
        # lmledger fit turns off, and only where none is installed.)
        if stage == "fit" and hasattr(signal, "SIGUSR1"):
            self._active = True
            self._install(signal.SIGUSR1)
            if _EARLY_SIGNALS:  # SLURM's warning came while the run was being built (noted_stop_signals)
                self.requested, self.signum = True, self.signum or _EARLY_SIGNALS[0]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(signal, "SIGTERM"):
            return
        self._active = True
        # A SIGTERM during set-up or the sanity check reached Lightning's handler: take it over.
        if take_received_sigterm(trainer):
            self.requested, self.signum = True, self.signum or signal.SIGTERM
        for signum in _STOP_SIGNALS:
            self._install(signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._saved_step == trainer.global_step:
            raise Preempted(trainer.global_step, self.saved, self.requeued)

    def collectives_per_step(self, trainer: pl.Trainer) -> int:
        """The all-reduces this callback runs each optimizer step: the ranks' stop decision, where there are several
        (the step-time prediction prices it: callbacks.steptime.fit_ops)."""
        return 1 if trainer.world_size > 1 else 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if accumulating(trainer):
            return  # mid-accumulation: the step is not complete yet
        stop = self.requested
        if trainer.world_size > 1:  # every rank takes part at every step boundary, signalled or not
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        self.saved = self._save_last(trainer)  # every rank calls it: Lightning's save is collective
        self._saved_step = trainer.global_step
        if trainer.is_global_zero:
            self.requeued = _requeue_slurm_job(self.signum)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        self._active = False
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous)
            except (ValueError, TypeError):
                pass
        self._previous = {}

    @staticmethod
    def _save_last(trainer: pl.Trainer) -> str:
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        for callback in checkpoints:
            if callback.save_last and callback.dirpath:
                return save_last_checkpoint(callback, trainer)
        if checkpoints and checkpoints[0].dirpath:
            directory = Path(checkpoints[0].dirpath)
        elif trainer.log_dir is not None:
            directory = Path(trainer.log_dir) / "checkpoints"
        else:
            directory = Path(trainer.default_root_dir) / "checkpoints"
        path = str(directory / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}")
        trainer.save_checkpoint(path)
        return path
