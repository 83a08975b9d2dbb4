"""lmledger.atomic, the one writer of whole files: what reaches the disk, what a failure says, which
temp files a later writer removes."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from conftest import file_size_limit
from lmledger import atomic
from lmledger.atomic import DiskWriteError, atomic_write
from lmledger.errors import UserError


def test_bytes_text_and_a_writer_callback_land_whole_with_the_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, "é\n")
    assert path.read_bytes() == "é\n".encode()
    atomic_write(path, lambda f: (f.write(b"ab"), f.write(b"cd")))
    assert path.read_bytes() == b"abcd"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]


def test_the_file_and_then_its_directory_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "f", b"x")
    assert synced == [False, True]


def test_a_disk_error_is_one_line_saying_what_is_intact(tmp_path):
    path = tmp_path / "results.csv"

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(DiskWriteError) as caught:
        atomic_write(path, full)
    assert str(caught.value) == f"no space left on device while writing {path}; nothing was written"
    assert isinstance(caught.value, UserError) and not path.exists()

    atomic_write(path, b"old")

    def hidden(f):  # how torch.save reports a failed write: a RuntimeError that has lost the errno
        try:
            f.write(b"x" * (1 << 16))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:1] unexpected pos") from None

    with pytest.raises(DiskWriteError, match=r"^file too large while writing .*; the previous results\.csv is intact$"):
        with file_size_limit(1 << 12):
            atomic_write(path, hidden)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def test_an_error_that_is_not_the_disks_passes_through_and_leaves_nothing(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"old")

    def bug(f):
        f.write(b"new")
        raise ValueError("not a disk problem")

    with pytest.raises(ValueError, match="not a disk problem"):
        atomic_write(path, bug)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_write_clears_only_the_temp_files_a_dead_writer_of_that_name_left(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = child.pid
    leftovers = {
        f".last.ckpt.{dead}.0123456789ab.tmp": False,  # a dead writer of this file: removed
        f".last.ckpt.{os.getpid()}.0123456789ab.tmp": True,  # ours (another thread may be writing)
        f".last.ckpt.{os.getppid()}.0123456789ab.tmp": True,  # a live writer
        ".last.ckpt.0123456789ab.tmp": True,  # no pid and fresh
        f".other.ckpt.{dead}.0123456789ab.tmp": True,  # another file's
        ".last.ckpt.notes.tmp": True,  # not our pattern
    }
    for name in leftovers:
        (tmp_path / name).write_bytes(b"x")
    atomic_write(tmp_path / "last.ckpt", b"new")
    kept = {name for name, keep in leftovers.items() if keep}
    assert {p.name for p in tmp_path.iterdir()} == kept | {"last.ckpt"}
    temp = atomic.temp_path(tmp_path / "last.ckpt").name
    assert atomic.TEMP_NAME.fullmatch(temp)["pid"] == str(os.getpid())
