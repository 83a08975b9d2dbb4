"""One writer per directory: a process writing there holds an `fcntl.flock` lock on it and on a file inside it.

The kernel drops a flock lock when its holder dies, however it dies (SIGKILL included).
So a lock never goes stale. The file holds the holder's "PID@HOST", for the refusal's one line.
The directory is locked too, so deleting the file lets no second writer in. Where the filesystem
refuses a directory's flock (NFSv4 wants write access for an exclusive lock: EBADF, in Linux's
fs/nfs/nfs4proc.c nfs4_proc_lock), the file alone excludes. `lost()` then sees a deleted or replaced
file, and the holder stops before it writes.
On NFS, Linux (2.6.12 and later) turns flock into a POSIX byte-range lock the server arbitrates.
So the lock excludes writers on other machines too. The mount option `local_lock=flock`
(or `local_lock=all`) makes it local to each client. Then it excludes only writers on the same
machine (docs/reliability.md).
The lock file is opened without following a symlink and never truncated. A name that is a link, a
FIFO, a directory or someone else's file is refused in one line, and left as it was.

No torch or Lightning here: `lmledger prepare` takes the same lock.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from pathlib import Path

from lmledger.errors import UserError

__all__ = ["RUN_LOCK", "DirLock", "held_locks_lost"]


# The lock file in a run's version directory (runs/NAME/version_N/) and in a prepared-data directory.
RUN_LOCK = "lmledger.lock"
# What a lock file of ours holds: "PID@HOST" on its first line (or nothing yet). Anything else is not ours.
_OURS = re.compile(rb"\d+@[^\n]*(\n|$)")
_OURS_AT_MOST = 4096
# Never follow a link; never block on a FIFO; never take a terminal.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)

_HELD: list[DirLock] = []  # this process's locks, for held_locks_lost()


def _holder(path: str | os.PathLike) -> str:
    """ "pid N" from a lock file (plus "on HOST" for another machine), or "another process"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "another process"
    try:
        text = os.read(fd, 256).decode(errors="replace") if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    except OSError:
        text = ""
    finally:
        os.close(fd)
    pid, _, host = text.strip().partition("\n")[0].partition("@")
    if not pid.isdigit():
        return "another process"
    return f"pid {pid}" if not host or host == socket.gethostname() else f"pid {pid} on {host}"


def _holder_named(path: str | os.PathLike, wait_s: float = 1.0) -> str:
    """_holder, waiting up to `wait_s` for a holder that has just locked to write its pid: the directory and the
    file are locked a moment before the file is claimed, and a refusal in that moment would name no one."""
    import time

    deadline = time.monotonic() + wait_s
    while (who := _holder(path)) == "another process" and time.monotonic() < deadline:
        time.sleep(0.01)
    return who


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class DirLock:
    """An exclusive flock on `path` and on its directory, taken without waiting; `busy(holder)` builds the refusal.

    The file is created when missing. Release leaves it in place unless `remove=True`.
    Why the care? Unlinking a lock file another process has just opened would let two processes hold
    "the" lock, on two inodes. So a taker checks, once locked, that the path still names the inode it
    locked. If not, it starts over. The directory's lock makes that unlink harmless where it is held.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.dir_fd: int | None = None  # the directory, flocked; None where its filesystem refuses that
        self.created = False

    def acquire(self, busy) -> DirLock:
        import fcntl

        dir_fd = self._lock_directory(busy)
        try:
            while True:
                fd, created = self._open(dir_fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise busy(_holder_named(self.path)) from None
                except OSError as err:  # e.g. ENOLCK: an NFS mount without a lock manager
                    os.close(fd)
                    raise UserError(
                        f"cannot lock {self.path} ({err.strerror}); on NFS, mount with a lock manager (nolock "
                        "refuses locks) or run on a local filesystem"
                    ) from None
                try:
                    now = os.stat(self.path.name if dir_fd is not None else self.path, dir_fd=dir_fd,
                                  follow_symlinks=False)  # fmt: skip
                    same = _same(os.fstat(fd), now)
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)  # the holder removed it between our open and our lock: take the new one
            if dir_fd is not None and self._moved(dir_fd):
                os.close(fd)
                raise UserError(f"{self.path.parent} was moved or replaced while it was being locked; try again")
            self._claim_file(fd, created)
        except BaseException:
            if dir_fd is not None:
                os.close(dir_fd)
            raise
        self.fd, self.dir_fd, self.created = fd, dir_fd, created
        _HELD.append(self)
        return self

    def _lock_directory(self, busy) -> int | None:
        """The directory's descriptor, flocked; None where the filesystem cannot lock a directory."""
        import fcntl

        try:
            dir_fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as err:
            raise UserError(f"cannot open {self.path.parent} to lock it ({err.strerror})") from None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(dir_fd)
            raise busy(_holder_named(self.path)) from None
        except OSError:  # EBADF (NFSv4), ENOLCK, EINVAL: the lock file alone excludes (lost() checks it)
            os.close(dir_fd)
            return None
        return dir_fd

    def _moved(self, dir_fd: int) -> bool:
        """Whether the directory's path no longer names the directory `dir_fd` holds."""
        try:
            return not _same(os.stat(self.path.parent), os.fstat(dir_fd))
        except OSError:
            return True

    def _open(self, dir_fd: int | None) -> tuple[int, bool]:
        """The lock file's descriptor, and whether this call created it. Refuses what is not a lock of ours."""
        name, where = (self.path.name, dir_fd) if dir_fd is not None else (self.path, None)
        while True:
            try:
                return os.open(name, _OPEN | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=where), True
            except FileExistsError:
                pass
            except OSError as err:
                raise UserError(f"cannot create the lock file {self.path} ({err.strerror})") from None
            try:
                fd = os.open(name, _OPEN, dir_fd=where)  # no O_CREAT, no O_TRUNC: it is someone's file
            except FileNotFoundError:
                continue  # removed by its holder meanwhile: create it
            except OSError as err:
                raise self._not_a_lock(err) from None
            info = os.fstat(fd)
            problem = None
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 0:
                os.close(fd)  # unlinked by its holder between our open and our look: create it
                continue
            if not stat.S_ISREG(info.st_mode):
                problem = "is not a regular file"
            elif info.st_nlink != 1:
                problem = f"has {info.st_nlink} names (a hard link to another file)"
            if problem is None:
                return fd, False
            os.close(fd)
            raise UserError(f"{self.path} {problem}; lmledger writes only into a lock file of its own: remove it")

    def _not_a_lock(self, err: OSError) -> UserError:
        if err.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a symlink (Linux, macOS / FreeBSD)
            return UserError(f"{self.path} is a symbolic link; lmledger follows no link to its lock file: remove it")
        if err.errno == errno.EISDIR:
            return UserError(f"{self.path} is a directory, not a lock file; remove it")
        return UserError(f"cannot open the lock file {self.path} ({err.strerror})")

    def _claim_file(self, fd: int, created: bool) -> None:
        """Write our name into the locked file: only into one we created or one that holds a lock's line."""
        if not created:
            try:
                old = os.pread(fd, _OURS_AT_MOST + 1, 0)
            except OSError:
                old = b""
            if len(old) > _OURS_AT_MOST or (old and not _OURS.match(old)):
                os.close(fd)
                raise UserError(
                    f"{self.path} holds something other than a lock's PID@HOST line; lmledger writes only "
                    "into a lock file of its own: remove it (or move it away)"
                )
        line = f"{os.getpid()}@{socket.gethostname()}\n".encode()
        try:
            os.pwrite(fd, line, 0)
            os.ftruncate(fd, len(line))  # after the write: a reader never sees it empty
        except OSError:
            pass  # the holder's name is for the message only

    def lost(self) -> str | None:
        """Why this lock no longer keeps other writers out of its directory; None while it does."""
        if self.fd is None:
            return "it was released"
        if self.dir_fd is not None:
            if self._moved(self.dir_fd):
                return f"{self.path.parent} was moved, removed or replaced"
            return None  # the directory's lock holds, whatever became of the file
        try:
            if _same(os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)):
                return None
        except FileNotFoundError:
            pass
        return f"{self.path} was deleted or replaced on a filesystem that cannot lock a directory"

    def release(self, remove: bool = False) -> None:
        if self.fd is None:
            return
        if remove:
            try:
                if _same(os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)):  # only ours
                    self.path.unlink()
            except OSError:
                pass
        os.close(self.fd)  # closing the last descriptor drops the lock
        if self.dir_fd is not None:
            os.close(self.dir_fd)
        self.fd = self.dir_fd = None
        if self in _HELD:
            _HELD.remove(self)

    @property
    def held(self) -> bool:
        return self.fd is not None


def held_locks_lost() -> str | None:
    """Why a lock this process holds no longer excludes other writers (DirLock.lost), or None.

    Called right before a save: a run that lost its directory must not write by path into another's.
    """
    for lock in list(_HELD):
        reason = lock.lost()
        if reason is not None:
            return reason
    return None
