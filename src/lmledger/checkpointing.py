"""Checkpoints that survive a kill, load without running code, and say clearly when they do not fit.

- `AtomicCheckpointIO` is Lightning's checkpoint plugin over `lmledger.atomic.atomic_write` (a kill leaves
  the previous file or the complete new one, never a torn one); it loads with weights_only=True.
- `open_checkpoint` / `check_checkpoint_fits` turn a missing, corrupt or mismatched checkpoint into one UserError line.
- `StepSeeder` makes each training batch's random state a function of (seed, rank, batch), so a resumed run
  draws the same random numbers as an uninterrupted one without saving generator states.
- `PreemptionCheckpoint` turns SIGTERM into "finish this step, save last.ckpt, stop" (`Preempted`).
- `newest_checkpoint` / `claim_version_dir`: which checkpoint `--ckpt_path last` means; a run directory
  of one's own even when two runs of the same name start together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import signal
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lmledger.atomic import atomic_write
from lmledger.errors import UserError
from lmledger.lightning_private import (
    accumulating,
    batches_fetched,
    is_local_path,
    save_last_checkpoint,
    take_received_sigterm,
)
from lmledger.model import ModelConfig

# Objects besides tensors and containers that our checkpoints may hold: a LitLM built in Python (not through
# the CLI, which stores plain dicts) keeps its ModelConfig dataclass in hyper_parameters.
SAFE_CHECKPOINT_GLOBALS = [ModelConfig]


# ------------------------------------------------------------------------------------- writing


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save/torch.load checkpoints; local saves are atomic and loads refuse to run pickled code.

    Lightning's own local save writes a temp file in the system temp dir and moves it into place without
    fsync (canary test_lightning_saves_through_the_system_temp_dir_without_fsync): a copy when /tmp is
    another filesystem, and a killed save leaves a checkpoint-sized orphan there. URLs keep Lightning's path.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_local_path(path):
            # Lightning reads weights_only=None as False for URLs; keep it safe unless asked otherwise
            # (canary test_remote_checkpoints_load_unsafely_by_default).
            safe = True if weights_only is None else weights_only
            return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=safe)
        if weights_only is False:
            # Only code can ask for this (the CLI never does); say once that it unpickles arbitrary objects.
            rank_zero_warn(f"loading {path} with weights_only=False runs any code pickled into it")
            return torch.load(path, map_location=map_location or "cpu", weights_only=False)
        return open_checkpoint(path, map_location=map_location or "cpu")


def make_last_checkpoint_atomic(callbacks: list[pl.Callback]) -> None:
    """Keep last.ckpt whole across a kill for every ModelCheckpoint among `callbacks`.

    With save_last="link" Lightning removes last.ckpt before linking the new one (canary
    test_link_last_removes_the_old_link_before_making_the_new_one): a kill in between leaves it missing or
    dangling. A full save through AtomicCheckpointIO never does, so "link" becomes a full save.
    """
    for callback in callbacks:
        # Lightning links only when it also keeps top-k files; with save_top_k=0 "link" already saves in full.
        if isinstance(callback, ModelCheckpoint) and callback.save_last == "link" and callback.save_top_k != 0:
            callback.save_last = True
            rank_zero_warn("ModelCheckpoint(save_last='link') is not crash-safe; saving last.ckpt in full instead")


# ------------------------------------------------------------------------------------- reading


def open_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True; a missing, unreadable or non-Lightning file is one UserError line.

    mmap=True reads only the pickled structure (tensors stay on disk until touched): a cheap check.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass a .ckpt file written by `lmledger fit`")
    try:
        with torch.serialization.safe_globals(SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, OSError, ... for damaged files
        if not zipfile.is_zipfile(path):
            # A truncated archive gives a bare "[Errno 22] Invalid argument" from torch.
            reason = "not a complete zip archive: truncated, or not written by torch.save"
        elif "Weights only load failed" in str(err):
            reason = "it holds pickled objects other than tensors and plain containers, refused for safety"
        else:  # torch's messages run to several sentences of advice; the first names the damage
            reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"checkpoint {path} cannot be read ({reason}); pass a .ckpt file written by `lmledger fit`"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"checkpoint {path} has no state_dict: it is not a Lightning checkpoint from `lmledger fit`")
    return checkpoint


def _as_dict(config: Any) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config) if isinstance(config, dict) else {}


def check_checkpoint_fits(path: str | os.PathLike, module: pl.LightningModule) -> None:
    """UserError unless `path` holds exactly the tensors `module` has, with the same shapes."""
    checkpoint = open_checkpoint(path, mmap=True)
    theirs = checkpoint["state_dict"]
    ours = module.state_dict()
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    wrong_shape = [k for k in ours if k in theirs and tuple(theirs[k].shape) != tuple(ours[k].shape)]
    if not (missing or unexpected or wrong_shape):
        return
    if wrong_shape:
        k = wrong_shape[0]
        problem = f"{k} is {list(theirs[k].shape)} there but {list(ours[k].shape)} here"
    elif missing:
        problem = f"it lacks {len(missing)} tensors of this model (e.g. {missing[0]})"
    else:
        problem = f"it holds {len(unexpected)} tensors this model lacks (e.g. {unexpected[0]})"
    saved = _as_dict(checkpoint.get("hyper_parameters", {}).get("config"))
    current = _as_dict(module.hparams.get("config")) if hasattr(module, "hparams") else {}
    differences = [f"{k}={saved[k]} there, {current[k]} here" for k in current if k in saved and saved[k] != current[k]]
    trained_with = f" (model.config: {'; '.join(differences)})" if differences else ""
    raise UserError(
        f"checkpoint {path} does not fit this model: {problem}{trained_with}; use the config it was trained "
        "with (config.yaml in its run directory) or start a fresh run"
    )


# ------------------------------------------------------------------------------------- randomness


def step_seed(seed: int, rank: int, batch: int) -> int:
    """A 63-bit seed for training batch `batch` on `rank`, well mixed by SeedSequence."""
    state = np.random.SeedSequence(seed, spawn_key=(rank, batch)).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class StepSeeder(pl.Callback):
    """Reseeds torch (CPU and every CUDA device), numpy and `random` before each training batch.

    Lightning checkpoints model, optimizer, schedule and loop progress but no generator states. Even saved
    states would not make resume exact: dataloader iterators, validation and measurement callbacks draw from
    the global generators between steps, differently in a resumed run. Keying each batch's random state
    on (seed, rank, batch index) instead makes dropout masks and other draws in batch i the same however
    the run got there. The seed is the one `seed_everything` set (LightningCLI's `seed_everything:`);
    without one, nothing is reseeded.
    """

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        seed = os.environ.get("PL_GLOBAL_SEED")
        if seed is None:
            return
        batch_index = batches_fetched(trainer) - 1
        value = step_seed(int(seed), trainer.global_rank, batch_index)
        random.seed(value)
        np.random.seed(value % 2**32)
        # torch.manual_seed would also queue lazy seeds for CUDA, MPS, XPU and MTIA, each capturing a stack
        # trace: 234 us a step on a CPU-only torch against 9 us for the generators a run has (2026-12-01).
        torch.default_generator.manual_seed(value)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(value)
        if torch.backends.mps.is_available():
            torch.mps.manual_seed(value)


# ------------------------------------------------------------------------------------- run directories


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The global_step recorded in a checkpoint (read through mmap: cheap), or None if it cannot be read."""
    try:
        with torch.serialization.safe_globals(SAFE_CHECKPOINT_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # a damaged file is reported when it is opened for real, if it is the one chosen
        return None


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint in `checkpoint_dir` that has trained furthest: the largest recorded global_step, the
    newest modification time among equals (last.ckpt, last-v1.ckpt after a moved run directory, top-k files)."""
    found = []
    for path in Path(checkpoint_dir).glob("*.ckpt"):
        if path.is_file():
            step = checkpoint_step(path)
            found.append((-1 if step is None else step, path.stat().st_mtime_ns, path))
    return max(found)[2] if found else None


_VERSION = re.compile(r"version_(\d+)")


def versions(run_root: str | os.PathLike) -> list[int]:
    """The N of every `run_root/version_N` directory."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir())


def claim_version_dir(run_root: str | os.PathLike) -> int:
    """Create `run_root/version_N` for the next free N and return N.

    mkdir is atomic: of two runs that pick the same N at the same moment, one creates it and the other
    moves on to N+1 (TensorBoardLogger lists the directory and creates the version later: both took N).
    """
    root = Path(run_root)
    root.mkdir(parents=True, exist_ok=True)
    n = max(versions(root), default=-1) + 1
    while True:
        try:
            (root / f"version_{n}").mkdir()
            return n
        except FileExistsError:
            n += 1


# ------------------------------------------------------------------------------------- SLURM


def slurm_job_key(env=None) -> str | None:
    """The SLURM job this process runs in, as `scontrol requeue` names it: "ARRAYJOB_TASK" for an array
    task, else the job id; None outside SLURM."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def slurm_line(env=None) -> str | None:
    """ "SLURM job 12 (array task 3 of job 9), restart 1" for a run's first line and its TensorBoard text."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    array = env.get("SLURM_ARRAY_JOB_ID")
    task = f" (array task {env.get('SLURM_ARRAY_TASK_ID')} of job {array})" if array else ""
    return f"SLURM job {job}{task}, restart {env.get('SLURM_RESTART_COUNT') or 0}"


def _slurm_job_state(job: str) -> str | None:
    """The job's state as scontrol reports it (RUNNING, COMPLETING, CANCELLED, ...), None if unknown."""
    import subprocess

    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bJobState=(\S+)", out)
    return match.group(1) if match else None


def requeue_slurm_job(signum: int | None) -> str | None:
    """Requeue the job this process runs in, after its checkpoint is saved; returns a few words on the outcome.

    SIGUSR1 is SLURM's warning (`--signal=B:USR1@N` before the time limit, `scancel --signal=USR1`): the job
    would end, so it is requeued here. On SIGTERM the job is requeued only while SLURM still counts it
    RUNNING (`scancel --signal=TERM`): after `scontrol requeue` or a preemption SLURM requeues it itself, and
    after a plain `scancel` (CANCELLED) the user asked it to end.
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
    """Training stopped on SIGTERM/SIGUSR1 after a complete step; `checkpoint` holds it (None: nothing was
    saved); `requeued` says what became of the SLURM job (None outside SLURM)."""

    def __init__(self, step: int, checkpoint: str | None, requeued: str | None = None) -> None:
        super().__init__(143)
        self.step, self.checkpoint, self.requeued = step, checkpoint, requeued


_EARLY_SIGNALS: list[int] = []


def _note_early(signum, frame) -> None:
    _EARLY_SIGNALS.append(signum)


@contextlib.contextmanager
def noted_stop_signals():
    """While `lmledger fit` parses and builds, before PreemptionCheckpoint takes over: a SIGUSR1 is noted
    (and acted on at the first step boundary) rather than ending the process, its default action. A
    handler someone else installed stays."""
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


# The signals that mean "save and stop": SLURM and Kubernetes send SIGTERM before killing a job, SLURM sends
# SIGUSR1 as its warning before a time limit (`#SBATCH --signal=B:USR1@90`) or on `scancel --signal=USR1`.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM or SIGUSR1 finish the current optimizer step, save last.ckpt atomically, requeue the SLURM
    job the run is in (requeue_slurm_job), and stop the fit with `Preempted`.

    Lightning's own SIGTERM handler stops after the current batch without saving, mid-accumulation alike,
    and exits 0 (canary test_lightning_stops_on_sigterm_without_saving); its SLURM requeue (SIGUSR1) works
    only when SLURMEnvironment is detected (srun or --ntasks), saves an hpc_ckpt_N.ckpt that `--ckpt_path
    last` does not see, and saves mid-accumulation. This is the one path instead: the handler only takes
    note; the decision to stop is made at the step boundary, reduced over the ranks (any rank signalled:
    all stop at the same step), the save follows the optimizer step (where ModelCheckpoint saves), and the
    stop comes at the next batch's start, after that step's logging and validation.
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
        for signum in STOP_SIGNALS:
            self._install(signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._saved_step == trainer.global_step:
            raise Preempted(trainer.global_step, self.saved, self.requeued)

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
            self.requeued = requeue_slurm_job(self.signum)

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


# ------------------------------------------------------------------------------------- one writer, no litter

# Beside the lock in a version directory: the SLURM job (slurm_job_key) that trains there, so that the
# job's requeued runs find it with --ckpt_path auto, and another job does not.
SLURM_JOB_FILE = "slurm_job"
# Files this small are restored byte for byte when a refused run rewrote them (hparams.yaml, a config).
_RESTORE_AT_MOST = 1 << 20


def slurm_job_version(run_root: str | os.PathLike, job: str) -> int | None:
    """The version directory of `run_root` that SLURM job `job` trains in, if any (the newest, should two)."""
    root = Path(run_root)
    for version in sorted(versions(root), reverse=True):
        try:
            if (root / f"version_{version}" / SLURM_JOB_FILE).read_text().strip() == job:
                return version
        except OSError:
            continue
    return None


class RunClaim(pl.Callback):
    """The run directory a fit trains in: held under a lock (lmledger.runlock) while the process lives, and,
    if the run is refused before its first step is through every check, left as it was found.

    `claim()` snapshots the directory and takes its lock; until the run is committed (its second optimizer
    step starts, a checkpoint is saved, or training ends), `undo()` removes whatever this process created
    there (a version directory it made, in full; in an existing one, only the new files) and restores the
    small files it rewrote. Nothing that was there before is removed.
    """

    def __init__(self) -> None:
        self.version_dir: Path | None = None
        self.lock = None
        self.committed = False
        self._made = False  # whether this process made version_dir
        self._created: list[Path] = []  # the directories above it this process made, outermost first
        self._before: dict[str, tuple[int, int, bytes | None]] = {}
        self._start_step: int | None = None

    def claim(self, version_dir: str | os.PathLike, made: bool, parents_made: list[Path] = ()) -> None:
        """Lock `version_dir` (made by this process if `made`, under the `parents_made` it made too)."""
        from lmledger.runlock import RUN_LOCK, DirLock

        self.version_dir = Path(version_dir)
        self._made, self._created = made, list(parents_made)
        self.version_dir.mkdir(parents=True, exist_ok=True)
        self._before = {}
        for path in self.version_dir.rglob("*"):
            if path.is_file() and not path.is_symlink():
                stat = path.stat()
                small = stat.st_size <= _RESTORE_AT_MOST and path.suffix != ".ckpt"
                self._before[str(path.relative_to(self.version_dir))] = (
                    stat.st_size,
                    stat.st_mtime_ns,
                    path.read_bytes() if small else None,
                )
            elif path.is_dir():
                self._before[str(path.relative_to(self.version_dir))] = (-1, 0, None)

        def busy(who: str) -> UserError:
            return UserError(
                f"{self.version_dir} is being trained in by {who} (it holds {self.version_dir / RUN_LOCK}): "
                "one writer per run; wait for it to end or stop it, or start a fresh run without --ckpt_path"
            )

        try:
            self.lock = DirLock(self.version_dir / RUN_LOCK).acquire(busy)
        except UserError:
            self.undo()
            raise
        _CLAIMS.append(self)

    def mark_slurm_job(self, job: str) -> None:
        if self.version_dir is not None:
            atomic_write(self.version_dir / SLURM_JOB_FILE, job + "\n")

    # Any of these means the run has trained: what it wrote is the run's, not litter.
    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # A later optimizer step begins: the first one, and every check made at its end, went through.
        if self._start_step is not None and trainer.global_step > self._start_step:
            self.committed = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.committed = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.committed = True

    def undo(self) -> None:
        """Put the run directory back as claim() found it (nothing, if claim made it); then release it."""
        import shutil

        try:
            if self.committed or self.version_dir is None:
                return
            if self._made:
                shutil.rmtree(self.version_dir, ignore_errors=True)
            elif self.version_dir.is_dir():
                for path in sorted(self.version_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    key = str(path.relative_to(self.version_dir))
                    before = self._before.get(key)
                    try:
                        if before is None:
                            path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
                        elif before[2] is not None and path.is_file() and path.read_bytes() != before[2]:
                            atomic_write(path, before[2])
                    except OSError:
                        pass
            for directory in reversed(self._created):
                try:
                    directory.rmdir()  # only if empty: another run may have started there meanwhile
                except OSError:
                    pass
        finally:
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self in _CLAIMS:
            _CLAIMS.remove(self)


_CLAIMS: list[RunClaim] = []


def undo_uncommitted_claims() -> None:
    """A refused run (UserError before its first step passed every check): undo this process's claims."""
    for claim in list(_CLAIMS):
        claim.undo()


def release_claims() -> None:
    for claim in list(_CLAIMS):
        claim.release()
