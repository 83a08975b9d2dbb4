"""A point's metrics, and the PointResult that holds them.

Metrics are the scalars of its TensorBoard run, or the JSON object a command printed.
Both go under one set of names: the TensorBoard tags `fit` logs. `account --json` and fit's per-rank
record are the one JSON shape (ledger.report.Report.to_json); ledger.report.ledger_tags names its figures by
their tags (memory.peak.predicted is memory/predicted/peak), the one translation (output_tags).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from lmledger.ledger.report import ledger_tags
from lmledger.ledger.units import MEMORY_ROWS
from lmledger.sweep.spec import Experiment, Point

__all__ = [
    "DEFAULT_METRICS",
    "RANK_COLUMNS",
    "PointResult",
    "flatten",
    "output_tags",
    "json_path",
    "metric_columns",
    "newest_run_dir",
    "rank_tags",
    "read_tensorboard",
    "with_ranks",
]


_LEDGER_TAGS = (
    *(f"memory/{kind}/{row}" for kind in ("predicted", "measured") for row in MEMORY_ROWS),
    "flops/model_per_step",
    "flops/hardware_per_step",
    "flops/measured_per_step",
)
DEFAULT_METRICS = {
    "fit": ("train/loss", "val/loss", "perf/tokens_per_sec", "perf/mfu", *_LEDGER_TAGS),
    "validate": ("val/loss", "val/ppl"),
    "account": (
        "params",
        *_LEDGER_TAGS,
        "state_bytes_per_param/predicted",
        "state_bytes_per_param/measured",
        "run/tokens_per_step",
    ),
}

# TensorBoard tags summarised by their median over the run (steady-state speed, robust to the first,
# slow step); every other tag by its last value.
_MEDIAN_PREFIX = "perf/"


@dataclass
class PointResult:
    point: Point
    status: str  # "done", "failed", "interrupted" or "skipped"
    metrics: dict[str, object] = field(default_factory=dict)
    error: str = ""
    seconds: float | None = None
    run_dir: str | None = None
    reused: bool = False  # finished by an earlier invocation of the sweep
    argv: list[str] = field(default_factory=list)  # the `lmledger` arguments it ran with
    output: dict | None = None  # the JSON object a JSON command printed

    def metric(self, name: str):
        """A collected metric, or a path into the printed JSON such as "results/-1/mfu"."""
        value = self.metrics.get(name)
        return json_path(self.output, name) if value is None and self.output is not None else value

    def to_json(self) -> dict:
        return {
            "point": self.point.id,
            "status": self.status,
            "argv": self.argv,
            "metrics": self.metrics,
            "error": self.error,
            "seconds": self.seconds,
            "run_dir": self.run_dir,
            "output": self.output,
        }


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """A JSON object's scalar leaves as {"a/b/0/c": value} (list items by index)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else None
    if items is None:
        return {prefix: obj}
    flat: dict[str, object] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def output_tags(output: object) -> dict[str, object]:
    """A command's JSON object as metric names: the one ledger shape's figures by their TensorBoard tags
    (ledger.report.ledger_tags), every other value by its path."""
    if isinstance(output, dict) and "schema" in output and isinstance(output.get("memory"), dict):
        rest = {k: v for k, v in output.items() if k not in ("memory", "flops")}
        return {**flatten(rest), **ledger_tags(output)}
    return flatten(output)


def json_path(obj, path: str):
    """The value at "a/b/-1/c" in a JSON object, or None. List items go by index, negative from the end."""
    for part in path.split("/"):
        if isinstance(obj, dict):
            obj = obj.get(part)
        elif isinstance(obj, list) and re.fullmatch(r"-?\d+", part) and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return None if isinstance(obj, (dict, list)) else obj


def read_tensorboard(run_dir: Path) -> dict[str, float]:
    """Each scalar tag of a run, summarised. perf/* tags by their median, the rest by their last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    summary: dict[str, float] = {}
    for tag in accumulator.Tags()["scalars"]:
        values = [event.value for event in accumulator.Scalars(tag) if math.isfinite(event.value)]
        if values:
            summary[tag] = statistics.median(values) if tag.startswith(_MEDIAN_PREFIX) else values[-1]
    return summary


def newest_run_dir(out_dir: Path, point: Point) -> Path | None:
    versions = []
    for path in (out_dir / "runs" / point.id).glob("version_*"):
        match = re.fullmatch(r"version_(\d+)", path.name)
        if match and path.is_dir():
            versions.append((int(match.group(1)), path))
    return max(versions)[1] if versions else None


def metric_columns(experiment: Experiment, results: Iterable[PointResult]) -> list[str]:
    if experiment.metrics is not None:
        columns = list(experiment.metrics)
    else:
        columns = []
        for point in experiment.points:
            columns += DEFAULT_METRICS.get(point.subcommand, ())
        for result in results:  # other JSON commands: every field they printed
            if result.point.subcommand not in DEFAULT_METRICS:
                columns += result.metrics
    if experiment.x and experiment.x not in experiment.swept_keys:
        columns.append(experiment.x)
    return list(dict.fromkeys(columns))


# ------------------------------------------------------------------------------------- per-rank records

# A point on several ranks: whose ledger lines its memory/ and flops/ columns are, and how many rank records were
# read (each node's disk holds its own ranks' records: without a shared filesystem, fewer than the world size).
RANK_COLUMNS = ("rank", "ranks")


def rank_tags(record: dict) -> tuple[dict[str, float], int | None]:
    """A per-rank record (callbacks/ranks.py) as the TensorBoard tags `fit` logs, and the run's world size.

    The one reader of the record's shape (ledger.report's JSON, whose paths are the tags): a change of it
    changes this function only."""
    tags = ledger_tags(record)
    world = (record.get("run") or {}).get("world_size")
    numbers = {k: v for k, v in tags.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return numbers, world if isinstance(world, int) else None


def _worst(tags: dict[int, dict[str, float]]) -> int:
    """The rank with the largest measured peak (the predicted one where no rank measured it); the lowest on a tie."""
    for kind in ("measured", "predicted"):
        peaks = {r: t[f"memory/{kind}/peak"] for r, t in tags.items() if f"memory/{kind}/peak" in t}
        if peaks:
            return max(peaks, key=lambda r: (peaks[r], -r))
    return min(tags)


def with_ranks(experiment: Experiment, results: Iterable[PointResult]) -> list[PointResult]:
    """The results, each point on several ranks marked with whose ledger lines its columns hold.

    experiment.ranks "rank0": TensorBoard's lines, rank 0's (Lightning's loggers write on rank 0 only).
    "worst": the lines of the rank whose peak is largest, from its version_N/ranks/rank<R>.json, in place of
    every memory/ and flops/ metric. Records are read when the table is written, so a finished sweep's table
    changes with the option without running anything again."""
    out = []
    for result in results:
        ranks_dir = Path(result.run_dir) / "ranks" if result.run_dir else None
        if result.status != "done" or ranks_dir is None or not ranks_dir.is_dir():
            out.append(result)
            continue
        from lmledger.callbacks.ranks import read_rank_records  # Lightning: only for a run with rank records

        tags, worlds = {}, set()
        for rank, record in read_rank_records(ranks_dir.parent).items():
            tags[rank], world = rank_tags(record)
            worlds.add(world)
        world = max((w for w in worlds if w), default=len(tags))
        if not tags or world <= 1:
            out.append(result)
            continue
        metrics = {**result.metrics, "rank": 0, "ranks": len(tags)}
        if experiment.ranks == "worst":
            rank = _worst(tags)
            metrics = {k: v for k, v in metrics.items() if not k.startswith(("memory/", "flops/"))}
            metrics.update(tags[rank], rank=rank)
        out.append(replace(result, metrics=metrics))
    return out
