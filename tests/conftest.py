"""Shared fixtures: one prepared stdlib corpus per test session, and a scratch working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmledger.cli import main as lmledger

# A model small enough that a CLI fit takes a few seconds on 2 cores.
TINY_OVERRIDES = [
    "--model.config.d_model", "64",
    "--model.config.n_layers", "2",
    "--model.config.n_heads", "2",
    "--model.config.d_ff", "128",
    "--model.config.context_length", "64",
    "--data.batch_size", "8",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    assert lmledger(["prepare", "--source", "stdlib", "--out", str(out)]) == 0
    return out


@pytest.fixture
def workdir(tmp_path, stdlib_data, monkeypatch) -> Path:
    """cwd = a fresh directory with configs/ and data/stdlib as a fresh checkout would see them."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stdlib").symlink_to(stdlib_data)
    (tmp_path / "configs").symlink_to(repo / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def read_scalars(run_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in a TensorBoard run directory as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


os.environ.setdefault("PYTHONWARNINGS", "ignore")
