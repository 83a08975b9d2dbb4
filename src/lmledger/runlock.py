"""One writer per directory: a process writing there holds an `fcntl.flock` lock on a file inside it.

The kernel drops a flock lock when its holder dies, however it dies (SIGKILL included).
So a lock never goes stale. The file holds the holder's "PID@HOST", for the refusal's one line.
On NFS, Linux (2.6.12 and later) turns flock into a POSIX byte-range lock the server arbitrates.
So the lock excludes writers on other machines too. The mount option `local_lock=flock`
(or `local_lock=all`) makes it local to each client. Then it excludes only writers on the same
machine (docs/reliability.md).

No torch or Lightning here: `lmledger prepare` takes the same lock.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from lmledger.errors import UserError

__all__ = ["RUN_LOCK", "DirLock"]


# The lock file in a run's version directory (runs/NAME/version_N/) and in a prepared-data directory.
RUN_LOCK = "lmledger.lock"


def _holder(path: str | os.PathLike) -> str:
    """ "pid N" from a lock file (plus "on HOST" for another machine), or "another process"."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        text = ""
    pid, _, host = text.partition("@")
    if not pid.isdigit():
        return "another process"
    return f"pid {pid}" if not host or host == socket.gethostname() else f"pid {pid} on {host}"


class DirLock:
    """An exclusive flock on `path`, taken without waiting; `busy(holder)` builds the refusal.

    The file is created when missing. Release leaves it in place unless `remove=True`.
    Why the care? Unlinking a lock file another process has just opened would let two processes hold
    "the" lock, on two inodes. So a taker checks, once locked, that the path still names the inode it
    locked. If not, it starts over.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.created = False

    def acquire(self, busy) -> DirLock:
        import fcntl

        while True:
            existed = self.path.exists()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (PEP 446)
            except OSError as err:
                raise UserError(f"cannot create the lock file {self.path} ({err.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise busy(_holder(self.path)) from None
            except OSError as err:  # e.g. ENOLCK: an NFS mount without a lock manager
                os.close(fd)
                raise UserError(
                    f"cannot lock {self.path} ({err.strerror}); on NFS, mount with a lock manager (nolock "
                    "refuses locks) or run on a local filesystem"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed it between our open and our lock: take the new one
        self.fd, self.created = fd, not existed
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the holder's name is for the message only
        return self

    def release(self, remove: bool = False) -> None:
        if self.fd is None:
            return
        if remove:
            try:
                self.path.unlink()
            except OSError:
                pass
        os.close(self.fd)  # closing the last descriptor drops the lock
        self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None
