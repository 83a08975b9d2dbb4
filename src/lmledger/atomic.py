"""Files written whole or not at all: a temp file beside the target, fsynced, renamed over it.

A kill at any moment leaves the previous file or the complete new one. A disk that refuses the write
(full, read-only, over quota) becomes one `DiskWriteError` line saying what is intact.
Temp files are named ".<final name>.<writer pid>.<12 hex>.tmp". So a later writer can tell a dead
writer's leftovers (`remove_stale_temps`) from a live one's.
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
    "fsync_dir",
    "printable",
    "remove_stale_temps",
    "stage",
    "temp_path",
    "write_error",
]


# Names without the pid come from lmledger versions that did not record it; they go by age alone.
TEMP_NAME = re.compile(r"\.(?P<name>.+?)\.(?:(?P<pid>\d+)\.)?[0-9a-f]{12}\.tmp")
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


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


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

    Only names of our exact pattern go. And only when their writer's pid is dead on this machine,
    or they are a day old."""
    wanted = set(names)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = TEMP_NAME.fullmatch(entry.name)
        if not match or match["name"] not in wanted or not entry.is_file(follow_symlinks=False):
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        pid = int(match["pid"]) if match["pid"] else None
        if age > STALE_TEMP_SECONDS or (pid is not None and pid != os.getpid() and not _pid_alive(pid)):
            try:
                os.unlink(entry.path)
            except OSError:
                continue
            removed.append(Path(entry.path))
    return removed


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
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as err:
        raise write_error(err, path) from None
