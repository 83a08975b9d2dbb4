"""Files written whole or not at all: a temp file beside the target, fsynced, renamed over it.

A kill at any moment leaves the previous file or the complete new one. A disk that refuses the write
(full, read-only, over quota) becomes one `DiskWriteError` line saying what is intact.
Temp files are named ".<final name>.<writer pid>.<12 hex>.tmp". So a later writer can tell a dead
writer's leftovers (`remove_stale_temps`) from a live one's. A directory (a sharded checkpoint) is put in
place by `publish` the same way: staged whole beside the target, then swapped in by one rename.
No torch, no Lightning: `prepare` and `plan` import this.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from lmledger.errors import UserError

__all__ = [
    "STALE_TEMP_SECONDS",
    "TEMP_NAME",
    "DiskWriteError",
    "atomic_write",
    "exchange",
    "fsync_dir",
    "printable",
    "publish",
    "remove_stale_temps",
    "stage",
    "temp_path",
    "write_error",
]


# Names without the pid come from lmledger versions that did not record it; they go by age alone.
# ".old": a directory `publish` moved aside (only where the file system cannot swap two names in one rename).
TEMP_NAME = re.compile(r"\.(?P<name>.+?)\.(?:(?P<pid>\d+)\.)?[0-9a-f]{12}\.(?P<kind>tmp|old)")
STALE_TEMP_SECONDS = 24 * 3600  # a temp file whose writer we cannot see is stale after a day

_Content = bytes | bytearray | memoryview | str | Callable[[IO[bytes]], object]


class DiskWriteError(UserError):
    """Writing a file failed (full disk, read-only file system). One line says what is intact."""


def printable(text: str) -> str:
    """A path fit for messages and meta.json.

    Python keeps a non-UTF-8 name as surrogate escapes. Here its bad bytes show as U+FFFD,
    instead of failing to print."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def write_error(err: OSError, path: Path, after: str | None = None) -> DiskWriteError:
    """One line for an OSError while writing `path`.

    E.g. "no space left on device while writing runs/x/results.csv; the previous results.csv is intact".
    `after` replaces the part after the ';'."""
    reason = err.strerror or str(err) or os.strerror(err.errno or 5)  # 5: EIO
    reason = reason[:1].lower() + reason[1:]
    if after is None:
        after = f"the previous {path.name} is intact" if path.exists() else "nothing was written"
    return DiskWriteError(f"{reason} while writing {printable(str(path))}; {after}")


def temp_path(path: Path, kind: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.{kind}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_temps(directory: Path, names: Iterable[str]) -> list[Path]:
    """Delete the temp files that killed writers of `names` left in `directory`.

    Only names of our exact pattern go (files, and the directories a sharded save staged). And only
    when their writer's pid is dead on this machine, or they are a day old."""
    wanted = set(names)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = TEMP_NAME.fullmatch(entry.name)
        if not match or match["name"] not in wanted or entry.is_symlink():
            continue
        if match["kind"] == "old" and not os.path.lexists(os.path.join(directory, match["name"])):
            continue  # moved aside by a publish cut short: the one whole copy until a new one is in place
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        pid = int(match["pid"]) if match["pid"] else None
        if age > STALE_TEMP_SECONDS or (pid is not None and pid != os.getpid() and not _pid_alive(pid)):
            try:
                remove_path(Path(entry.path))
            except OSError:
                continue
            removed.append(Path(entry.path))
    return removed


def remove_path(path: Path) -> None:
    """Delete a file, or a directory with everything in it (never following a symlink)."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    # A rename lives in the directory entry; without this a power cut can forget it.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecordingFile:
    """A binary file that keeps its first OSError.

    torch.save reports a failed write as a RuntimeError ("[enforce fail at inline_container.cc:...]").
    That error has lost the errno saying why."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except (OSError, KeyboardInterrupt) as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def _interrupted(err: BaseException) -> bool:
    """Whether `err` was raised from, or while handling, a KeyboardInterrupt."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def stage(path: Path, content: _Content) -> Path:
    """Write `content` to a fsynced temp file beside `path`; return the temp file's path.

    `content` is bytes, str (as UTF-8), or a callable given the open binary file.
    On any failure the temp file is removed and the error raised. An OSError hidden inside a
    callback's other exception comes out as that OSError."""
    tmp = temp_path(path)
    try:
        # "xb", not tempfile.mkstemp: the file gets the umask's permissions, not 0600.
        with open(tmp, "xb") as raw:
            if callable(content):
                f = _RecordingFile(raw)
                try:
                    content(f)
                except OSError:
                    raise
                except Exception as err:
                    if f.error is None and _interrupted(err):
                        # Ctrl-C inside torch.save's writer comes out as "[enforce fail at inline_container.cc]",
                        # the KeyboardInterrupt its context (canary test_torch_save_turns_a_ctrl_c_in_a_write_*).
                        raise KeyboardInterrupt from None
                    if f.error is None:
                        raise
                    raise f.error from None
            else:
                raw.write(content.encode("utf-8") if isinstance(content, str) else content)
            raw.flush()
            os.fsync(raw.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


_RENAME_EXCHANGE = 2  # linux/fs.h: renameat2() swaps the two names atomically
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one atomic rename (Linux renameat2 RENAME_EXCHANGE).

    False where this system or file system cannot (no renameat2, NFS, not Linux) or `b` does not exist."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOENT, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


def publish(staged: Path, path: Path) -> None:
    """Put the whole `staged` (a file or a directory beside `path`) at `path`, replacing what is there.

    A file over a file (or nothing) is one os.replace. Where either is a directory, the two names are
    swapped atomically (`exchange`) and the old one deleted. Where the file system cannot swap, the old
    one is first moved aside to ".NAME.PID.HEX.old": a kill in between leaves that whole copy, which
    `lmledger.checkpointing.newest_checkpoint` reads. Nothing is ever written into the old one."""
    if not (staged.is_dir() or path.is_dir()):
        os.replace(staged, path)
        fsync_dir(path.parent)
        return
    if exchange(staged, path):
        fsync_dir(path.parent)
        remove_path(staged)  # it holds the old one now
        return
    if not path.exists() and not path.is_symlink():
        os.rename(staged, path)
        fsync_dir(path.parent)
        return
    aside = temp_path(path, "old")
    os.rename(path, aside)
    fsync_dir(path.parent)
    os.rename(staged, path)
    fsync_dir(path.parent)
    remove_path(aside)


def atomic_write(path: str | os.PathLike, content: _Content) -> None:
    """Put `content` at `path` whole.

    Clear dead writers' temp files, stage it beside `path`, os.replace it over `path`, fsync the
    directory. Any OSError becomes one DiskWriteError line, with `path` left as it was."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, [path.name])
        tmp = stage(path, content)
        try:
            publish(tmp, path)  # over a sharded checkpoint's directory too (a resume of it on one device)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as err:
        raise write_error(err, path) from None
