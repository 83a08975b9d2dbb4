"""The per-rank record: every rank's predicted and measured ledger lines in `version_N/ranks/rank<R>.json`.

Lightning's loggers write on rank 0 only, so TensorBoard holds rank 0's lines; the others would be lost.
Each rank writes its own file beside the run's `checkpoints/` (the ModelCheckpoint's directory, which
Lightning resolves on rank 0 and broadcasts, so every rank knows it without a collective here). With
several nodes and no shared filesystem, each node's disk holds its own ranks' files.

    write_rank_record   this rank's Report in the one JSON shape (atomic), with its rank, node and step
    read_rank_records   {rank: record} of a run directory; worst_rank picks the rank with the largest line
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from lmledger.atomic import atomic_write
from lmledger.ledger.report import RUN_KEYS, Report

__all__ = ["RANKS_DIR", "read_rank_records", "record_path", "run_facts", "worst_rank", "write_rank_record"]

RANKS_DIR = "ranks"


def record_path(trainer: pl.Trainer) -> Path | None:
    """version_N/ranks/rank<R>.json for this rank; None without a checkpoint directory to sit beside, and under
    fast_dev_run, which writes no run files (Lightning suppresses its logging and checkpoints)."""
    if trainer.fast_dev_run:
        return None
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    if not dirpath:
        return None
    return Path(dirpath).parent / RANKS_DIR / f"rank{trainer.global_rank}.json"


def write_rank_record(trainer: pl.Trainer, report: Report) -> Path | None:
    """Write this rank's ledger (predicted and measured, every line) beside the checkpoints; its path.

    The record is the one JSON shape (Report.to_json, docs/commands.md), as `account --json` prints it, with
    the rank's place added: "rank", "node", "num_nodes", "step"."""
    path = record_path(trainer)
    if path is None:
        return None
    record = {
        **report.to_json(run_facts(trainer, report), _parameter_count(trainer)),
        "rank": trainer.global_rank,
        "node": trainer.node_rank,
        "num_nodes": trainer.num_nodes,
        "step": trainer.global_step,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def run_facts(trainer: pl.Trainer, report: Report) -> dict[str, object]:
    """The record's "run": the facts `account --json` gives under the same keys (docs/commands.md).

    The batch comes from the Ledger that holds `report` (its tokens and samples per batch)."""
    from lmledger.callbacks.trainer_io import _strategy_name  # the ledger.run.sharding name, as `account` prints it

    module = trainer.lightning_module
    ledger = next((c for c in trainer.callbacks if getattr(c, "report", None) is report), None)
    run = getattr(ledger, "run", None)  # a ledger.run.Run for lmledger's ToyLM, else None
    tokens, samples = getattr(ledger, "tokens", None), getattr(ledger, "samples", None) or None
    measured = report.measured
    facts = {
        "model": f"{type(module).__module__}.{type(module).__qualname__}",
        "batch_size": samples,
        "seq_len": getattr(run, "seq_len", None) or (tokens // samples if tokens and samples else None),
        "tokens_per_step": tokens,
        "precision": str(trainer.precision),
        "optimizer": getattr(run, "optimizer", None),
        "strategy": getattr(run, "strategy", None) or _strategy_name(trainer.strategy),  # account's names: ddp, fsdp2
        "world_size": trainer.world_size,
        "device": module.device.type,
        "peak_phase": report.primary.peak_phase if report.primary else None,
        "measured_peak_phase": measured.peak_phase if measured else None,
        "not_predicted": getattr(ledger, "why_not_predicted", None) if report.primary is None else None,
    }
    return {key: facts[key] for key in RUN_KEYS}


def _parameter_count(trainer: pl.Trainer) -> int:
    """The module's parameters, the whole model's (an FSDP2 shard is a DTensor, whose numel is the global one)."""
    return sum(p.numel() for p in trainer.lightning_module.parameters())


def read_rank_records(run_dir: str | Path) -> dict[int, dict]:
    """{rank: record} of every ranks/rank<R>.json in a run directory."""
    out = {}
    for path in sorted(Path(run_dir, RANKS_DIR).glob("rank*.json")):
        record = json.loads(path.read_text())
        out[int(record["rank"])] = record
    return out


def worst_rank(records: dict[int, dict], line: str = "peak") -> int | None:
    """The rank whose measured `line` (bytes or FLOPs) is largest; None when no rank measured it."""

    def measured(record: dict):  # the one JSON shape: memory.<line>.measured, flops.measured
        if line.startswith("flops"):
            return record.get("flops", {}).get("measured")
        return (record.get("memory", {}).get(line) or {}).get("measured")

    values = {r: measured(rec) for r, rec in records.items()}
    values = {r: v for r, v in values.items() if isinstance(v, (int, float))}
    return max(values, key=lambda r: (values[r], -r)) if values else None
