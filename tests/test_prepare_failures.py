"""Issue 16 §3 for `lmledger prepare` and the CPU memory preflight: hostile sources (a file name that is
not UTF-8, a FIFO), an absurd BPE vocabulary, a full or read-only disk, temp files a killed prepare left
behind, and a CPU run whose predicted peak exceeds the machine's RAM. Each ends in one line or works."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmledger import atomic
from lmledger import corpus as prep
from lmledger.cli import main as lmledger


def one_error_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert lmledger(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def source(tmp_path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i}\n" * (5 + i))
    return root


# ------------------------------------------------------------------------------------- hostile sources


def test_a_file_name_that_is_not_utf8_is_read_like_any_other(source, tmp_path, capsys):
    name = os.fsencode(source) + b"/caf\xe9.txt"  # Latin-1 é: not UTF-8
    with open(name, "wb") as f:
        f.write(b"a file whose name is Latin-1\n" * 4)
    out = tmp_path / "out"
    capsys.readouterr()
    assert lmledger(["prepare", "--source", str(source), "--out", str(out)]) == 0
    assert "Prepared" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == 7 and meta["skipped_files"] == 0
    tokens = (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()
    assert b"a file whose name is Latin-1" in tokens

    # a --source directory whose own name is not UTF-8: its name is printed with U+FFFD, not a traceback
    odd = os.fsencode(tmp_path) + b"/d\xe9p\xf4t"
    os.rename(os.fsencode(source), odd)
    capsys.readouterr()
    assert lmledger(["prepare", "--source", os.fsdecode(odd), "--out", str(tmp_path / "out2")]) == 0
    assert "d\ufffdp\ufffdt" in capsys.readouterr().out
    assert json.loads((tmp_path / "out2" / "meta.json").read_text())["source"].endswith("d\ufffdp\ufffdt")


def test_a_fifo_in_a_source_directory_is_skipped_not_read_forever(source, tmp_path):
    os.mkfifo(source / "pipe.txt")
    out = tmp_path / "out"
    # In a child process with a deadline: prepare used to block on the FIFO forever.
    done = subprocess.run(
        [sys.executable, "-m", "lmledger.cli", "prepare", "--source", str(source), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == 6


def test_a_fifo_named_as_the_source_is_one_line(source, tmp_path, capsys):
    os.mkfifo(source / "pipe")
    err = one_error_line(capsys, ["prepare", "--source", str(source / "pipe"), "--out", str(tmp_path / "out")])
    assert "is not a regular file or a directory" in err
    assert not (tmp_path / "out").exists()


def test_an_absurd_bpe_vocabulary_is_refused_before_training(source, tmp_path, capsys):
    started = time.perf_counter()
    err = one_error_line(
        capsys,
        ["prepare", "--source", str(source), "--tokenizer", "bpe", "--vocab-size", "500000000", "--out", "o"],
    )  # a count the flag takes (under 2**31), far past what a tokenizer may have
    assert "--vocab-size 500,000,000 is larger than lmledger allows (1,048,576)" in err
    assert time.perf_counter() - started < 30  # refused up front, not after training a tokenizer
    assert not Path("o").exists()


# ------------------------------------------------------------------------------------- full disks


REAL_FSYNC = os.fsync


def _failing(monkeypatch, error: int, after: int = 0):
    """os.fsync raises OSError(error) from its (after+1)-th call: how a full disk or a read-only file
    system reaches a write that has been buffered (running as root, chmod would not stop us)."""
    calls = {"n": 0}
    real = REAL_FSYNC

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(error, os.strerror(error))
        return real(fd)

    monkeypatch.setattr(prep.os, "fsync", fsync)


@pytest.mark.parametrize(
    "error, after, writing, reason",
    [
        (errno.ENOSPC, 0, "train.bin", "no space left on device"),
        (errno.ENOSPC, 1, "val.bin", "no space left on device"),
        (errno.EROFS, 2, "meta.json", "read-only file system"),
    ],
)
def test_a_full_or_read_only_disk_is_one_line_and_the_old_data_is_intact(
    source, tmp_path, capsys, monkeypatch, error, after, writing, reason
):
    out = tmp_path / "out"
    assert lmledger(["prepare", "--source", str(source), "--out", str(out)]) == 0
    before = snapshot(out)
    (source / "new.txt").write_text("a new document\n" * 9)
    _failing(monkeypatch, error, after)
    err = one_error_line(capsys, ["prepare", "--source", str(source), "--out", str(out), "--overwrite"])
    assert f"{reason} while writing {out / writing}; the previous {writing} is intact" in err
    assert snapshot(out) == before  # nothing replaced, no temp file left

    fresh = tmp_path / "fresh"
    _failing(monkeypatch, error, after)
    err = one_error_line(capsys, ["prepare", "--source", str(source), "--out", str(fresh)])
    assert err.endswith(f"{reason} while writing {fresh / writing}; nothing was written")
    assert not fresh.exists()  # not even the directory: the refused prepare removes the one it made


# ---------------------------------------------------------------------------------- stale temp files


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temp_files_of_a_killed_prepare_are_cleaned_and_nothing_else(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = _dead_pid()
        stale = [
            f".train.bin.{dead}.0123456789ab.tmp",  # its writer is gone
            ".val.bin.abcdefabcdef.tmp",  # the old name without a pid, two days old
        ]
        kept = [
            f".train.bin.{alive.pid}.0123456789ab.tmp",  # a writer still running
            ".meta.json.abcdefabcdef.tmp",  # no pid and fresh: it may be someone's
            ".train.bin.notes.tmp",  # not our pattern
            f".results.csv.{dead}.0123456789ab.tmp",  # our pattern, but not one of prepare's files
            "notes.txt",
        ]
        for name in stale + kept:
            (out / name).write_bytes(b"x" * 10)
        two_days_ago = time.time() - 2 * 24 * 3600
        os.utime(out / stale[1], (two_days_ago, two_days_ago))

        renamed = []
        real_replace = os.replace

        def replace(src, dst):
            renamed.append(Path(src).name)
            real_replace(src, dst)

        monkeypatch.setattr(prep.os, "replace", replace)
        prep.prepare([str(source)], out)
        remaining = {p.name for p in out.iterdir()}
        assert remaining == set(kept) | {"train.bin", "val.bin", "meta.json"}
        # our own temp files carry our pid, so a later prepare can tell when their writer is gone
        assert renamed and all(atomic.TEMP_NAME.fullmatch(n)["pid"] == str(os.getpid()) for n in renamed)
    finally:
        alive.kill()
        alive.wait()


# ------------------------------------------------------------------------------------- CPU preflight


def test_a_cpu_run_larger_than_the_machine_ram_stops_before_step_one(workdir, capsys):
    from conftest import read_scalars

    # batch 10^7 x 128 tokens: tens of TB predicted, more RAM than any machine has
    capsys.readouterr()
    assert (
        lmledger(["fit", "--config", "configs/tiny.yaml", "--data.batch_size", "10000000",
                  "--trainer.enable_progress_bar", "false"]) == 2
    )  # fmt: skip
    # (only our lines: a logging handler an earlier in-process test bound to its captured stderr may add noise)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger fit: error")]
    assert len(errors) == 1, errors
    err = errors[0]
    assert "predicted peak memory" in err and "(MemAvailable in /proc/meminfo)" in err
    assert "largest part: activations" in err and "--data.batch_size" in err
    for events in workdir.rglob("events.out.tfevents.*"):
        assert "train/loss" not in read_scalars(events.parent)
    assert not list(workdir.rglob("*.ckpt"))


def test_cpu_capacity_is_available_ram_shared_and_the_setting_overrides(workdir, capsys, monkeypatch, tmp_path):
    from lmledger.callbacks import preflight
    from lmledger.ledger.hardware import memory

    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16000000 kB\nMemAvailable:       1000 kB\n")  # 1 MB free
    monkeypatch.setattr(memory, "MEMINFO", str(fake))
    import torch

    capacity = preflight.available_memory(torch.device("cpu"), None, torch.nn.Linear(10, 10), processes_here=2)
    assert capacity.bytes == 1000 * 1024 // 2 + 110 * 4 and "MemAvailable" in capacity.source
    assert preflight.available_memory(torch.device("cpu"), 2.5).bytes == 2_500_000_000

    micro = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
             "--model.config.d_model", "32", "--model.config.n_layers", "1", "--model.config.d_ff", "64",
             "--trainer.enable_progress_bar", "false"]  # fmt: skip
    capsys.readouterr()
    assert lmledger(micro) == 2  # a 1 MB machine cannot hold it
    assert "MemAvailable in /proc/meminfo" in capsys.readouterr().err
    assert lmledger([*micro, "--ledger.device_memory_gb", "50"]) == 0  # the user's figure wins on CPU

    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "absent"))  # no /proc (macOS): psutil, if any
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert preflight.available_ram() is None
    assert lmledger(micro) == 0  # nothing says: no check, as before
