"""The per-rank record: every rank's predicted and measured ledger lines in `version_N/ranks/rank<R>.json`.

Lightning's loggers write on rank 0 only, so TensorBoard holds rank 0's lines; the others would be lost.
Each rank writes its own file beside the run's `checkpoints/` (the ModelCheckpoint's directory, which
Lightning resolves on rank 0 and broadcasts, so every rank knows it without a collective here). With
several nodes and no shared filesystem, each node's disk holds its own ranks' files.

    write_rank_record   this rank's Report as JSON (atomic), with its rank, node and step
    read_rank_records   {rank: record} of a run directory; worst_rank picks the rank with the largest line
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from lmledger.atomic import atomic_write
from lmledger.ledger.report import Report

__all__ = ["RANKS_DIR", "read_rank_records", "record_path", "worst_rank", "write_rank_record"]

RANKS_DIR = "ranks"


def record_path(trainer: pl.Trainer) -> Path | None:
    """version_N/ranks/rank<R>.json for this rank; None without a checkpoint directory to sit beside."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    if not dirpath:
        return None
    return Path(dirpath).parent / RANKS_DIR / f"rank{trainer.global_rank}.json"


def write_rank_record(trainer: pl.Trainer, report: Report) -> Path | None:
    """Write this rank's ledger (predicted and measured, every line) beside the checkpoints; its path."""
    path = record_path(trainer)
    if path is None:
        return None
    record = {
        "rank": trainer.global_rank,
        "node": trainer.node_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "step": trainer.global_step,
        "ledger": report.to_json(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def read_rank_records(run_dir: str | Path) -> dict[int, dict]:
    """{rank: record} of every ranks/rank<R>.json in a run directory."""
    out = {}
    for path in sorted(Path(run_dir, RANKS_DIR).glob("rank*.json")):
        record = json.loads(path.read_text())
        out[int(record["rank"])] = record
    return out


def worst_rank(records: dict[int, dict], line: str = "peak") -> int | None:
    """The rank whose measured `line` (bytes or FLOPs) is largest; None when no rank measured it."""
    measured = {r: rec["ledger"].get(line, {}).get("measured") for r, rec in records.items()}
    measured = {r: v for r, v in measured.items() if isinstance(v, (int, float))}
    return max(measured, key=lambda r: (measured[r], -r)) if measured else None
