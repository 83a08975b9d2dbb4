"""A run's version directory: the next free one, the SLURM job training there, one writer, no litter.

`claim_version_dir` makes `version_N` atomically. `RunClaim` locks it for the fit (lmledger.runlock).
A run refused before its first step passes every check leaves it as it was found.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import lightning.pytorch as pl

from lmledger.atomic import atomic_write
from lmledger.errors import UserError

__all__ = [
    "SLURM_JOB_FILE",
    "RunClaim",
    "claim_version_dir",
    "release_claims",
    "slurm_job_version",
    "undo_uncommitted_claims",
    "versions",
]

_VERSION = re.compile(r"version_(\d+)")


def versions(run_root: str | os.PathLike) -> list[int]:
    """The N of every `run_root/version_N` directory."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir())


def claim_version_dir(run_root: str | os.PathLike) -> int:
    """Create `run_root/version_N` for the next free N and return N.

    The mkdir is atomic. Two runs may pick the same N at once. One creates it; the other moves on to
    N+1. (TensorBoardLogger lists the directory and creates the version later: both took N.)
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


# ------------------------------------------------------------------------------------- one writer, no litter

# Beside the lock in a version directory: the SLURM job (slurm_job_key) that trains there.
# The job's requeued runs find it with --ckpt_path auto; another job does not.
SLURM_JOB_FILE = "slurm_job"
# A refused run's rewrites of files this small are undone byte for byte (hparams.yaml, a config).
_RESTORE_AT_MOST = 1 << 20


def slurm_job_version(run_root: str | os.PathLike, job: str) -> int | None:
    """The version of `run_root` that SLURM job `job` trains in, if any (the newest, should two)."""
    root = Path(run_root)
    for version in sorted(versions(root), reverse=True):
        try:
            if (root / f"version_{version}" / SLURM_JOB_FILE).read_text().strip() == job:
                return version
        except OSError:
            continue
    return None


class RunClaim(pl.Callback):
    """The run directory a fit trains in, locked while the process lives (lmledger.runlock).

    A run refused before its first step passes every check leaves it as it was found.
    `claim()` takes the directory's lock, then snapshots it. The run is committed when its second
    optimizer step starts, a checkpoint is saved, or training ends. Until then, `undo()` removes what
    this process created there. A version directory it made goes in full. In an existing one, only
    the new files go. It restores the small files it rewrote. Nothing that was there before is removed.
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
        """Lock `version_dir` (made by this process if `made`, under the `parents_made` it made too).

        The lock comes first, the snapshot after it: what another process writes there is never in
        this one's undo. A claim the lock refuses removes only the empty directories this process made.
        """
        from lmledger.runlock import RUN_LOCK, DirLock

        self.version_dir = Path(version_dir)
        self._made, self._created = made, list(parents_made)
        self.version_dir.mkdir(parents=True, exist_ok=True)

        def busy(who: str) -> UserError:
            return UserError(
                f"{self.version_dir} is being trained in by {who} (it holds {self.version_dir / RUN_LOCK}): "
                "one writer per run; wait for it to end or stop it, or start a fresh run without --ckpt_path"
            )

        try:
            self.lock = DirLock(self.version_dir / RUN_LOCK).acquire(busy)
        except UserError:
            for directory in ([self.version_dir] if made else []) + list(reversed(self._created)):
                try:
                    directory.rmdir()  # only if empty: never what another process wrote
                except OSError:
                    pass
            raise
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
        _CLAIMS.append(self)

    def still_held(self, trainer) -> None:
        """Stop the run (UserError) if its lock no longer keeps others out of its directory (DirLock.lost).

        Called at every step and right before every save. A run whose directory was moved or taken
        would write by path into another writer's run, and report that writer's checkpoint as its own.
        """
        reason = self.lock.lost() if self.lock is not None else None
        if reason is not None:
            raise UserError(
                f"{self.version_dir}: this run lost its lock ({reason}): stopped at step {trainer.global_step} "
                "without saving, so it writes nothing into a run another process may hold now; resume from "
                "the checkpoint it saved last, wherever its directory went"
            )

    def mark_slurm_job(self, job: str) -> None:
        if self.version_dir is not None:
            atomic_write(self.version_dir / SLURM_JOB_FILE, job + "\n")

    # Any of these means the run has trained: what it wrote is the run's, not litter.
    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.still_held(trainer)
        # A later optimizer step begins: the first one, and every check made at its end, went through.
        if self._start_step is not None and trainer.global_step > self._start_step:
            self.committed = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.still_held(trainer)  # Lightning calls this before it writes the checkpoint
        self.committed = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.committed = True

    def undo(self) -> None:
        """Put the run directory back as claim() found it, then release it. If claim made it: remove it."""
        import shutil

        try:
            if self.committed or self.version_dir is None:
                return
            if self.lock is None or self.lock.lost() is not None:
                return  # the directory is not ours alone (any more): what is there may be another's
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
    """Undo this process's claims, for a refused run.

    Refused means a UserError before its first step passed every check.
    """
    for claim in list(_CLAIMS):
        claim.undo()


def release_claims() -> None:
    for claim in list(_CLAIMS):
        claim.release()
