"""Experiment sweeps: a YAML grid of `lmledger` runs, each point in its own process and run directory,
collected into one table and a few plots.

An experiment file (experiments/*.yaml; docs/sweeps.md has the full story):

    name: precision                   # default: the file's stem; results go to runs/sweeps/<name>
    description: one line for the results table
    command: fit                      # fit | validate | account --measure | any lmledger command with --json
    configs: [configs/tiny.yaml]      # base config file(s), passed as --config in this order
    fixed: {trainer.max_steps: 100}   # overrides every point gets
    grid:                             # the cartesian product of these overrides ...
      trainer.precision: [32-true, bf16-mixed]
    points:                           # ... and/or an explicit list of points
      - {trainer.precision: transformer-engine, trainer.accelerator: gpu, requires: gpu}
      - {command: plan max-params, gpu: h100-sxm, precision: bf16-true}
    metrics: [train/loss, val/loss]   # default: DEFAULT_METRICS of the command
    x: trainer.precision              # the swept variable on the plots (default: the first grid key)
    requires: gpu                     # every point needs a CUDA GPU

Override keys are the dotted names `lmledger fit` takes (`model.config.d_model`) or, for the other
commands, their flag names (`num-gpus`); each becomes `--key value`. A point (in `grid` or `points`)
may also set `config`: one more config file (or a list), read after the base `configs` and before
the overrides, e.g. a fragment such as configs/precision/bf16-true.yaml. A `points` entry may also set
`requires` and `command`; a point with its own command takes neither `configs` nor `fixed` from the
top level.

Results live in one directory: runs/<point-id>/ (TensorBoard, one parent for all points),
points/<point-id>/ (status.json, stdout.log, stderr.log, lock), results.csv, results.md and the PNGs.

Every point's arguments are parsed (by the `fit` parser, nothing built) before any point runs. A point
runs in its own session and process group and is sent SIGTERM when the sweep dies, even by SIGKILL; a
held lock on points/<id>/lock tells a later sweep that it is still running. A training point stopped by
SIGTERM (exit 143) is `interrupted`, and the next sweep resumes it with `--ckpt_path last`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from lmledger.corpus import write_atomically, write_failed
from lmledger.errors import UserError
from lmledger.ledger.units import MB

TOP_LEVEL_KEYS = ("name", "description", "command", "configs", "fixed", "grid", "points", "metrics", "x", "requires")
POINT_ONLY_KEYS = ("command", "requires")  # allowed in `points` entries, not as grid keys
TRAINING_COMMANDS = ("fit", "validate")  # metrics come from the run's TensorBoard events
JSON_COMMANDS = ("account", "plan", "gpus", "bench")  # metrics come from the one JSON object on stdout
CONFIG_COMMANDS = TRAINING_COMMANDS + ("account",)  # need --config

MEMORY_COMPONENTS = ("params", "grads", "optimizer", "activations")
MEMORY_ROWS = MEMORY_COMPONENTS + ("peak",)
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
# A sweep this large is a mistake or a job for a scheduler: each point is a process, and 10^6 points took
# 70 s and 650 MB to list (issue 16 §4). The check runs before the grid is expanded.
MAX_POINTS = 10_000
# A plain directory name: no '/', and not '.', '..' or hidden.
_DIR_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# Exit codes of a point stopped by a signal it handled (128 + signal number, as the shell reports them),
# and the negative codes subprocess gives for one it did not handle.
INTERRUPTED_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)

# TensorBoard tags summarised by their median over the run (steady-state speed, robust to the first,
# slow step); every other tag by its last value.
_MEDIAN_PREFIX = "perf/"


# ---------------------------------------------------------------------------------------------
# The experiment file


@dataclass(frozen=True)
class Point:
    """One run of the sweep: a command line, named by a readable slug of its overrides and a hash."""

    id: str
    command: tuple[str, ...]  # lmledger subcommand words and flags, e.g. ("account", "--measure")
    configs: tuple[str, ...]
    fixed: dict[str, object]  # the experiment's `fixed` overrides
    swept: dict[str, object]  # this point's own overrides (grid values or an explicit entry)
    requires_gpu: bool = False

    @property
    def subcommand(self) -> str:
        return self.command[0]

    @property
    def label(self) -> str:
        """The swept values, short: "precision=bf16-mixed batch_size=4"."""
        return " ".join(f"{short_key(k)}={slug_value(k, v)}" for k, v in self.swept.items()) or self.id


@dataclass(frozen=True)
class Experiment:
    name: str
    source: Path
    description: str
    points: tuple[Point, ...]
    metrics: tuple[str, ...] | None  # None: each command's defaults (and every JSON field for other commands)
    x: str | None
    swept_keys: tuple[str, ...]  # every override key that varies between points, in order of appearance
    grid_keys: tuple[str, ...]


def _fail(source: Path, message: str) -> UserError:
    return UserError(f"{source}: {message}")


def _parse_command(source: Path, where: str, value) -> tuple[str, ...]:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, f"{where} must be a string such as `fit` or `account --measure`, got {value!r}")
    words = tuple(shlex.split(value))
    allowed = TRAINING_COMMANDS + JSON_COMMANDS
    if words[0] not in allowed:
        raise _fail(source, f"{where}: unknown command {words[0]!r}; use one of {', '.join(allowed)}")
    return words


def _parse_configs(source: Path, where: str, value) -> tuple[str, ...]:
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise _fail(source, f"{where} must be a config file path or a non-empty list of them, got {value!r}")
    for file in files:
        if not Path(file).is_file():
            raise _fail(
                source, f"{where}: config file {file} does not exist (paths are relative to the working directory)"
            )
    return tuple(files)


def _check_override_keys(source: Path, where: str, overrides: dict, allowed_extra: tuple[str, ...] = ()) -> None:
    for key in overrides:
        if not isinstance(key, str) or not key:
            raise _fail(source, f"{where}: override keys must be strings, got {key!r}")
        if key.startswith("-"):
            raise _fail(source, f"{where}: write override {key!r} without leading dashes, e.g. trainer.max_steps")
        if key in POINT_ONLY_KEYS and key not in allowed_extra:
            raise _fail(source, f"{where}: {key!r} can only be set in a `points` entry")


def _config_files(value) -> list[str]:
    """A point's `config` as a list of file names (checked later, by _parse_configs)."""
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def slug_value(key: str, value) -> str:
    if key == "config":
        return "+".join(Path(f).stem for f in _config_files(value))
    return _format_value(value)


def short_key(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _point_id(command: tuple[str, ...], own_command: bool, configs: tuple[str, ...], fixed: dict, swept: dict) -> str:
    parts = ["-".join(w for w in command if not w.startswith("-"))] if own_command else []
    parts += [f"{short_key(k)}={slug_value(k, v)}" for k, v in swept.items()]
    slug = re.sub(r"[^A-Za-z0-9._=+-]+", "-", "_".join(parts)).strip("-_")[:60] or "point"
    # The hash covers everything that makes the run: edit `fixed` and every point becomes a new one.
    overrides = {k: v for k, v in swept.items() if k != "config"}
    identity = json.dumps(
        {"command": command, "configs": configs, "fixed": fixed, "swept": overrides}, sort_keys=True, default=str
    )
    return f"{slug}-{hashlib.sha1(identity.encode()).hexdigest()[:6]}"


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file; every problem is one UserError line naming the key."""
    source = Path(path)
    if not source.is_file():
        raise UserError(f"experiment file {source} does not exist")
    try:
        raw = yaml.safe_load(source.read_text())
    except yaml.YAMLError as err:
        raise _fail(source, f"not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict):
        raise _fail(source, "an experiment file is a mapping with keys such as command, configs, grid, metrics")
    unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise _fail(source, f"unknown top-level key {unknown[0]!r}; allowed: {', '.join(TOP_LEVEL_KEYS)}")

    name = raw.get("name", source.stem)
    if not isinstance(name, str) or not _DIR_NAME.fullmatch(name):
        raise _fail(
            source,
            f"name must be a plain directory name (letters, digits, '.', '_' or '-', not starting with '.'), "
            f"got {name!r}",
        )
    command = _parse_command(source, "command", raw["command"]) if "command" in raw else None
    configs = _parse_configs(source, "configs", raw["configs"]) if "configs" in raw else ()
    fixed = raw.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise _fail(source, f"fixed must be a mapping of overrides, got {fixed!r}")
    _check_override_keys(source, "fixed", fixed)
    if "config" in fixed:
        raise _fail(source, "fixed: set the base config files with the top-level `configs` key")
    requires = raw.get("requires")
    if requires not in (None, "gpu"):
        raise _fail(source, f"requires must be `gpu` (or left out), got {requires!r}")

    # (own command?, command, configs, swept overrides, requires_gpu) for every point
    specs: list[tuple[bool, tuple[str, ...] | None, tuple[str, ...], dict, bool]] = []
    grid = raw.get("grid")
    grid_keys: tuple[str, ...] = ()
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise _fail(source, "grid is empty: give it at least one key with a list of values")
        _check_override_keys(source, "grid", grid)
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise _fail(source, f"grid key {key!r} needs a non-empty list of values, got {values!r}")
            seen_values: dict[str, object] = {}
            for value in values:
                text = " ".join(_config_files(value)) if key == "config" else _format_value(value)
                if text in seen_values:
                    raise _fail(
                        source,
                        f"grid key {key!r} lists the same value twice ({seen_values[text]!r} and {value!r} are "
                        f"both `{text}` on the command line): remove one",
                    )
                seen_values[text] = value
        n_points = math.prod(len(values) for values in grid.values()) + len(raw.get("points") or [])
        if n_points > MAX_POINTS:
            raise _fail(
                source,
                f"the grid has {n_points:,} points, more than a sweep may have ({MAX_POINTS:,}): "
                "split it into several experiment files or list the points you need under `points`",
            )
        grid_keys = tuple(grid)
        for combo in itertools.product(*grid.values()):
            swept = dict(zip(grid_keys, combo, strict=True))
            point_configs = configs + (
                _parse_configs(source, "grid config", swept["config"]) if "config" in swept else ()
            )
            specs.append((False, command, point_configs, swept, requires == "gpu"))
    points = raw.get("points")
    if points is not None:
        if not isinstance(points, list) or not points:
            raise _fail(source, "points must be a non-empty list of mappings of overrides")
        if len(points) > MAX_POINTS:
            raise _fail(source, f"{len(points):,} points, more than a sweep may have ({MAX_POINTS:,}): split the file")
        for i, entry in enumerate(points):
            where = f"points[{i}]"
            if not isinstance(entry, dict) or not entry:
                raise _fail(source, f"{where} must be a non-empty mapping of overrides, got {entry!r}")
            _check_override_keys(source, where, entry, allowed_extra=POINT_ONLY_KEYS)
            # A point with its own command is a different kind of run: it takes no configs or fixed
            # overrides from the top level (those belong to the top-level command).
            own = "command" in entry
            point_command = _parse_command(source, f"{where}.command", entry["command"]) if own else command
            inherited = () if own else configs
            extra = _parse_configs(source, f"{where}.config", entry["config"]) if "config" in entry else ()
            point_configs = inherited + extra
            point_requires = entry.get("requires", requires)
            if point_requires not in (None, "gpu"):
                raise _fail(source, f"{where}.requires must be `gpu`, got {point_requires!r}")
            swept = {k: v for k, v in entry.items() if k not in POINT_ONLY_KEYS}
            specs.append((own, point_command, point_configs, swept, point_requires == "gpu"))
    if grid is None and points is None:
        raise _fail(source, "no points: add a `grid` of overrides or a `points` list")

    built: list[Point] = []
    for own, point_command, point_configs, swept, needs_gpu in specs:
        if point_command is None:
            raise _fail(source, "command is missing: set it at the top level or in every `points` entry")
        if point_command[0] in CONFIG_COMMANDS and not point_configs:
            raise _fail(
                source, f"configs is missing: `{point_command[0]}` points need a config file (`configs` or `config`)"
            )
        point_fixed = {} if own else dict(fixed)
        point_id = _point_id(point_command, own, point_configs, point_fixed, swept)
        built.append(Point(point_id, point_command, point_configs, point_fixed, swept, needs_gpu))
    # Two points are the same run when their command lines are (`4` and `"4"` both give `--key 4`).
    seen: dict[tuple[str, ...], Point] = {}
    for point in built:
        line = tuple(cli_args(point))
        if line in seen:
            raise _fail(
                source, f"duplicate point ({point.label}): two entries make the same run ({' '.join(line)}); remove one"
            )
        seen[line] = point

    swept_keys = list(dict.fromkeys(k for p in built for k in p.swept))
    metrics = raw.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
            raise _fail(
                source, f"metrics must be a non-empty list of names (TensorBoard tags or JSON paths), got {metrics!r}"
            )
        metrics = tuple(metrics)
    x = raw.get("x", grid_keys[0] if grid_keys else (swept_keys[0] if swept_keys else None))
    if x is not None and not isinstance(x, str):
        raise _fail(source, f"x must be an override key or a metric name, got {x!r}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise _fail(source, "description must be a string")
    return Experiment(name, source, description.strip(), tuple(built), metrics, x, tuple(swept_keys), grid_keys)


# ---------------------------------------------------------------------------------------------
# Command lines


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _flags(overrides: dict) -> list[str]:
    args: list[str] = []
    for key, value in overrides.items():
        args += [f"--{key}", _format_value(value)]
    return args


def run_dir_args(point: Point, out_dir: Path) -> list[str]:
    """Every training point logs under out_dir/runs/<point id>/version_N, one TensorBoard parent."""
    return ["--trainer.logger.init_args.save_dir", str(out_dir / "runs"), "--trainer.logger.init_args.name", point.id]


def _config_args(point: Point) -> list[str]:
    return [arg for config in point.configs for arg in ("--config", config)]


def _override_args(point: Point) -> list[str]:
    return _flags(point.fixed) + _flags({k: v for k, v in point.swept.items() if k != "config"})


def cli_args(point: Point, out_dir: Path | None = None) -> list[str]:
    """The point's `lmledger` arguments (without the program), in the order that makes later win:
    config files, our quiet defaults, fixed overrides, the point's overrides, then its run directory."""
    args = [*point.command, *_config_args(point)]
    if point.subcommand in TRAINING_COMMANDS:
        args += ["--trainer.enable_progress_bar", "false"]  # the log is a file, not a terminal
    args += _override_args(point)
    if point.subcommand in TRAINING_COMMANDS and out_dir is not None:
        args += run_dir_args(point, out_dir)
    if point.subcommand in JSON_COMMANDS and "--json" not in args:
        args.append("--json")
    return args


def fit_args(point: Point) -> list[str]:
    """The point's arguments as `load_run_spec` reads them (configs and overrides, no command words)."""
    return _config_args(point) + _override_args(point)


# ---------------------------------------------------------------------------------------------
# Metrics


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """A JSON object's scalar leaves as {"a/b/0/c": value} (list items by index)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else None
    if items is None:
        return {prefix: obj}
    flat: dict[str, object] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def json_path(obj, path: str):
    """The value at "a/b/-1/c" in a JSON object (list items by index, negative from the end), or None."""
    for part in path.split("/"):
        if isinstance(obj, dict):
            obj = obj.get(part)
        elif isinstance(obj, list) and re.fullmatch(r"-?\d+", part) and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return None if isinstance(obj, (dict, list)) else obj


def account_metrics(result: dict) -> dict[str, object]:
    """`account --json` under the TensorBoard tag names `fit` logs, so both feed the same columns."""
    metrics = flatten(result)
    for row, pair in result.get("memory", {}).items():
        for kind in ("predicted", "measured"):
            metrics[f"memory/{kind}/{row}"] = pair.get(kind)
    for kind in ("model", "hardware", "measured"):
        metrics[f"flops/{kind}_per_step"] = result.get("flops", {}).get(kind)
    params = result.get("params")
    for kind in ("predicted", "measured"):
        state = [metrics.get(f"memory/{kind}/{row}") for row in ("params", "grads", "optimizer")]
        if params and all(v is not None for v in state):
            metrics[f"state_bytes_per_param/{kind}"] = sum(state) / params
    return metrics


def read_tensorboard(run_dir: Path) -> dict[str, float]:
    """Each scalar tag of a run, summarised: the median of perf/* tags, the last value of the rest."""
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


# ---------------------------------------------------------------------------------------------
# Checking every point before any runs


@dataclass
class CheckedPoints:
    specs: dict[str, object]  # point id -> its RunSpec (fit, validate and account points)
    errors: dict[str, str]  # point id -> the one line its arguments give


def check_points(experiment: Experiment) -> CheckedPoints:
    """Parse every config-reading point's arguments with `lmledger fit`'s own parser, building nothing.

    A parse costs ~0.1 s, so a point is not parsed whole: its base (configs and fixed overrides) is parsed
    once per distinct base, each (key, value) once on top of that base, and a point combines the parsed
    values in place (milliseconds). A point whose combination fails, or that uses a value that failed on
    its own, is parsed whole once to confirm (a value may be valid only beside another, e.g. a class_path).
    Other commands (plan, bench, gpus) are checked when they run: they fail in a second.
    """
    from lmledger.commands.train import parse_fit_config
    from lmledger.runspec import run_spec_from_config

    def spec_of(config):
        # A config naming any LightningModule parses but has no closed forms to list (its dry run needs the
        # module built): checked, not predicted.
        return _ANY_MODEL if "class_path" in config.model else run_spec_from_config(config)

    def parse(args: list[str]):
        try:
            return parse_fit_config(args)
        except UserError as err:
            return err

    bases: dict[tuple[str, ...], object] = {}
    values: dict[tuple[tuple[str, ...], str, str], object] = {}
    confirmed_bad: dict[tuple[tuple[str, ...], str, str], str] = {}
    specs: dict[str, object] = {}
    errors: dict[str, str] = {}
    # Parsing a config seeds the RNG, and Lightning says so once per parse: noise in a listing.
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        for point in experiment.points:
            if point.subcommand not in CONFIG_COMMANDS:
                continue
            base_args = _config_args(point) + _flags(point.fixed)
            group = tuple(base_args)
            if group not in bases:
                bases[group] = parse(base_args)
            overrides = {k: _format_value(v) for k, v in point.swept.items() if k != "config"}
            keys = [(group, k, text) for k, text in overrides.items()]
            known_bad = next((confirmed_bad[key] for key in keys if key in confirmed_bad), None)
            if known_bad is not None:
                errors[point.id] = known_bad
                continue
            spec = failed_alone = None
            base = bases[group]
            if not isinstance(base, Exception):
                for key in keys:
                    if key not in values:
                        parsed = parse([*base_args, f"--{key[1]}", key[2]])
                        values[key] = parsed if isinstance(parsed, Exception) else parsed.get(key[1])
                failed_alone = next((key for key in keys if isinstance(values[key], Exception)), None)
                if failed_alone is None:
                    spec = _combined_spec(base, {key[1]: values[key] for key in keys}, spec_of)
            if spec is None:  # the whole command line decides
                parsed = parse(fit_args(point))
                try:
                    spec = parsed if isinstance(parsed, Exception) else spec_of(parsed)
                except (UserError, ValueError, TypeError) as err:
                    spec = UserError(str(err))
                if isinstance(spec, Exception) and failed_alone is not None:
                    confirmed_bad[failed_alone] = str(values[failed_alone])
            if isinstance(spec, Exception):
                errors[point.id] = str(spec)
            elif spec is not _ANY_MODEL:
                specs[point.id] = spec
    finally:
        seed_log.setLevel(level)
    return CheckedPoints(specs, errors)


_ANY_MODEL = object()  # check_points: a point whose model is a class_path (no RunSpec)


def _combined_spec(base, values: dict[str, object], build):
    """build(base with `values` set at their dotted keys), or None when that fails; base is restored."""
    missing = object()
    saved: dict[str, object] = {}
    try:
        for key, value in values.items():
            saved[key] = base.get(key, missing)
            base[key] = value
        return build(base)
    except Exception:  # a combination the parts do not predict: the caller parses the whole line
        return None
    finally:
        for key, old in reversed(saved.items()):
            if old is missing:
                base.pop(key, None)
            else:
                base[key] = old


def bad_points_error(experiment: Experiment, errors: dict[str, str]) -> UserError:
    first = next(p for p in experiment.points if p.id in errors)
    return UserError(
        f"{len(errors)} of {len(experiment.points)} points have bad arguments, nothing was run; "
        f"first, {first.id}: {errors[first.id]} (--dry-run lists them all)"
    )


# ---------------------------------------------------------------------------------------------
# Running


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


def _write_json(path: Path, obj: dict) -> None:
    write_atomically(path, json.dumps(obj, indent=1, default=str) + "\n")


def status_path(out_dir: Path, point: Point) -> Path:
    return out_dir / "points" / point.id / "status.json"


def lock_path(out_dir: Path, point: Point) -> Path:
    return out_dir / "points" / point.id / "lock"


def saved_status(out_dir: Path, point: Point) -> dict:
    try:
        saved = json.loads(status_path(out_dir, point).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def finished_result(out_dir: Path, point: Point) -> PointResult | None:
    """The point's result if an earlier invocation finished it (failed and interrupted points run again)."""
    saved = saved_status(out_dir, point)
    if saved.get("status") != "done":
        return None
    return PointResult(
        point,
        "done",
        saved.get("metrics", {}),
        "",
        saved.get("seconds"),
        saved.get("run_dir"),
        reused=True,
        argv=saved.get("argv", []),
        output=saved.get("output"),
    )


def resumable(out_dir: Path, point: Point) -> bool:
    """Whether the point's next run continues its last one (`--ckpt_path last`): a fit stopped by a
    signal, or whose sweep died under it ("running"), whose newest run directory holds a checkpoint."""
    if point.subcommand != "fit" or saved_status(out_dir, point).get("status") not in ("interrupted", "running"):
        return False
    run_dir = newest_run_dir(out_dir, point)
    return run_dir is not None and any((run_dir / "checkpoints").glob("*.ckpt"))


def running_pid(out_dir: Path, point: Point) -> int | None:
    """The pid of the point's process if one (from this or an earlier sweep) holds its lock, else None."""
    path = lock_path(out_dir, point)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_nothing_running(experiment: Experiment, out_dir: Path) -> None:
    for point in experiment.points:
        pid = running_pid(out_dir, point)
        if pid is not None:
            kill = f" (kill {pid})" if pid > 0 else ""
            raise UserError(
                f"point {point.id} of {out_dir} is still running (pid {pid}), from an earlier `lmledger sweep`: "
                f"wait for it to finish or stop it{kill}, then run the sweep again"
            )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _subprocess_env(jobs: int) -> dict[str, str]:
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        # N torch processes each spawning a thread per core would oversubscribe the CPU N times.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


class Running:
    """The point processes running now, so that a stopping sweep can stop them (they are in their own
    process groups, out of reach of the terminal's Ctrl-C)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.stopping = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)
            stop = self.stopping
        if stop:
            _signal_group(proc, signal.SIGTERM)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop_all(self) -> None:
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the point and whatever it started (start_new_session: pgid == pid)
    except (ProcessLookupError, PermissionError):
        pass


def point_command(args: list[str]) -> list[str]:
    """The process of a point: `lmledger ARGS`, through point_main so that it dies with this process."""
    return [sys.executable, "-m", "lmledger.sweep", "point", str(os.getpid()), *args]


def run_point(point: Point, out_dir: Path, jobs: int = 1, running: Running | None = None) -> PointResult:
    """Run one point through the real CLI in its own process group; record its status atomically."""
    import fcntl

    logs = status_path(out_dir, point).parent
    args = cli_args(point, out_dir)
    if resumable(out_dir, point):
        args += ["--ckpt_path", "last"]
    argv = point_command(args)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        lock = os.open(lock_path(out_dir, point), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise write_failed(err, lock_path(out_dir, point)) from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return PointResult(point, "failed", error="already running (another sweep holds its lock)", argv=args)
        _write_json(status_path(out_dir, point), {"point": point.id, "status": "running", "argv": args})
        start = time.perf_counter()
        try:
            stdout, stderr = open(logs / "stdout.log", "w"), open(logs / "stderr.log", "w")
        except OSError as err:
            raise write_failed(err, logs / "stdout.log") from None
        with stdout, stderr:
            # The child inherits the locked descriptor: the lock is held as long as the point (or anything
            # it started) lives, whatever happens to this process.
            proc = subprocess.Popen(
                argv,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=_subprocess_env(jobs),
                start_new_session=True,
                pass_fds=(lock,),
            )
            if running is not None:
                running.add(proc)
            try:
                os.ftruncate(lock, 0)
                os.pwrite(lock, f"{proc.pid}\n".encode(), 0)
            except OSError:
                pass  # the pid is for the message only
            try:
                code = proc.wait()
            finally:
                if running is not None:
                    running.discard(proc)
    finally:
        os.close(lock)
    seconds = time.perf_counter() - start
    out_text = (logs / "stdout.log").read_text(errors="replace")
    status, error, metrics, output = "done", "", {}, None
    run_dir = newest_run_dir(out_dir, point) if point.subcommand in TRAINING_COMMANDS else None
    if code in INTERRUPTED_CODES:
        status = "interrupted"
        name = signal.Signals(-code if code < 0 else code - 128).name
        resumes = ", from its last checkpoint if it saved one" if point.subcommand == "fit" else ""
        error = f"stopped by {name} (exit code {code}); the next sweep runs it again{resumes}"
    elif code != 0:
        status = "failed"
        error = _last_line((logs / "stderr.log").read_text(errors="replace"))
        if code < 0:  # killed by a signal: SIGKILL is what the kernel's OOM killer sends
            reason = "out of memory?" if code == -9 else "signal"
            error = f"killed by signal {-code} ({reason}){': ' + error if error else ''}"
        error = error or f"exit code {code}"
    elif point.subcommand in TRAINING_COMMANDS:
        metrics = read_tensorboard(run_dir) if run_dir else {}
    else:
        try:
            output = json.loads(_last_line(out_text))
        except ValueError:
            status, error = "failed", "printed no JSON object on stdout (see its stdout.log)"
        else:
            metrics = account_metrics(output) if point.subcommand == "account" else flatten(output)
    outcome = PointResult(
        point, status, metrics, error, seconds, str(run_dir) if run_dir else None, argv=args, output=output
    )
    _write_json(status_path(out_dir, point), outcome.to_json())
    return outcome


def _die_with_parent(parent: int) -> None:
    """Make this process receive SIGTERM when `parent` dies, however it dies (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>; prctl(2): the signal comes when the parent *thread* exits
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the call: nobody will send the signal
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def watch() -> None:  # elsewhere: poll; an orphan is adopted by another process
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="lmledger-sweep-parent-watch", daemon=True).start()


def point_main(argv: list[str]) -> int:
    """The process of one point: `python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS...`."""
    _die_with_parent(int(argv[0]))
    from lmledger.cli import main

    return main(argv[1:])


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


SWEEP_RECORD = "sweep.json"


def check_out_dir(experiment: Experiment, out_dir: Path) -> bool:
    """Whether out_dir is already this experiment's; raises if it holds anything else's results."""
    record = out_dir / SWEEP_RECORD
    if record.is_file():
        try:
            owner = json.loads(record.read_text()).get("name")
        except ValueError:
            owner = None
        if owner != experiment.name:
            raise UserError(
                f"{out_dir} holds the results of sweep {owner!r}, not {experiment.name!r}: choose another --out"
            )
        return True
    for name in ("results.csv", "results.md"):
        if (out_dir / name).exists():
            raise UserError(f"{out_dir / name} exists and is not from a sweep: choose another --out")
    return False


def claim_out_dir(experiment: Experiment, out_dir: Path) -> None:
    if not check_out_dir(experiment, out_dir):
        _write_json(out_dir / SWEEP_RECORD, {"name": experiment.name, "experiment": str(experiment.source)})


@dataclass
class SweepPlan:
    """What a checked sweep will do: results known already (reused, skipped) and the points to run."""

    results: dict[str, PointResult]
    pending: list[Point]


def plan_sweep(experiment: Experiment, out_dir: Path) -> SweepPlan:
    """Everything a sweep checks before it writes or runs anything: the results directory is this
    experiment's, no point of an earlier sweep still runs, and every point to run has good arguments."""
    check_out_dir(experiment, out_dir)
    check_nothing_running(experiment, out_dir)
    have_gpu = cuda_available() if any(p.requires_gpu for p in experiment.points) else False
    results: dict[str, PointResult] = {}
    pending: list[Point] = []
    for point in experiment.points:
        if point.requires_gpu and not have_gpu:
            results[point.id] = PointResult(point, "skipped", error="needs a CUDA GPU; torch sees none")
        elif (done := finished_result(out_dir, point)) is not None:
            results[point.id] = done
        else:
            pending.append(point)
    errors = check_points(replace(experiment, points=tuple(pending))).errors
    if errors:
        raise bad_points_error(experiment, errors)
    return SweepPlan(results, pending)


def run_sweep(
    experiment: Experiment,
    out_dir: Path,
    jobs: int = 1,
    on_start: Callable[[Point], None] | None = None,
    on_done: Callable[[PointResult], None] | None = None,
    plan: SweepPlan | None = None,
) -> list[PointResult]:
    """Run every unfinished point of a checked sweep (plan_sweep, unless `plan` is given) `jobs` at a
    time, skip finished ones and GPU-only ones without a GPU, then write results.csv, results.md and the
    plots. Returns one result per point, in order."""
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    plan = plan_sweep(experiment, out_dir) if plan is None else plan
    results, pending = dict(plan.results), plan.pending
    claim_out_dir(experiment, out_dir)
    if on_done:
        for point in experiment.points:
            if point.id in results:
                on_done(results[point.id])

    running = Running()

    def work(point: Point) -> PointResult:
        if running.stopping:
            return PointResult(point, "interrupted", error="not started: the sweep was stopped")
        if on_start:
            on_start(point)
        return run_point(point, out_dir, jobs, running)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for future in as_completed([pool.submit(work, point) for point in pending]):
            result = future.result()
            results[result.point.id] = result
            if on_done:
                on_done(result)
    except BaseException:
        # Ctrl-C, SIGTERM or a failed write: stop the running points (SIGTERM: a fit saves last.ckpt and
        # is recorded interrupted), start no new ones, and wait for them. The next sweep resumes them.
        running.stop_all()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    ordered = [results[p.id] for p in experiment.points]
    write_results(experiment, ordered, out_dir)
    return ordered


# ---------------------------------------------------------------------------------------------
# Results: results.csv, results.md


def table_columns(experiment: Experiment, results: list[PointResult]) -> list[str]:
    return ["point", "status", *experiment.swept_keys, *metric_columns(experiment, results), "seconds", "error"]


def result_row(result: PointResult, columns: list[str]) -> dict[str, object]:
    values = {c: result.metric(c) for c in columns}
    values.update(
        point=result.point.id,
        status=result.status,
        **{k: slug_value(k, v) for k, v in result.point.swept.items()},
        seconds=None if result.seconds is None else round(result.seconds, 2),
        error=result.error,
    )
    return {c: values.get(c) for c in columns}


def write_results(experiment: Experiment, results: list[PointResult], out_dir: Path) -> list[Path]:
    columns = table_columns(experiment, results)
    rows = [result_row(r, columns) for r in results]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    write_atomically(out_dir / "results.csv", buffer.getvalue())
    write_atomically(out_dir / "results.md", markdown_table(experiment, columns, rows))
    from lmledger.sweep_plots import draw_plots  # matplotlib loads only when there is something to draw

    return draw_plots(experiment, results, out_dir)


def format_cell(column: str, value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    if column.startswith("memory/"):
        return f"{value / MB:,.3f}"
    if column.endswith(("mfu", "hfu")):
        return f"{value:.3f}"
    if "loss" in column or "ppl" in column or "per_param" in column:
        return f"{value:.4g}"
    if column.startswith("flops/") or abs(value) >= 1e7:
        return f"{value:.4g}"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return f"{value:,}"


def markdown_table(experiment: Experiment, columns: list[str], rows: list[dict]) -> str:
    """The non-empty columns of the results, human-formatted: memory in MB (1e6 bytes), each predicted figure
    and its measured twin in one "predicted / measured" cell."""
    shown = [c for c in columns if c != "point" and any(row.get(c) not in (None, "") for row in rows)]
    short = [short_key(k) for k in experiment.swept_keys]
    short_names = {k: s for k, s in zip(experiment.swept_keys, short, strict=True) if short.count(s) == 1}
    cells: list[tuple[str, str, str | None]] = []  # (header, column, its measured twin in the same cell)
    for column in shown:
        if not column.startswith("memory/"):
            cells.append((short_names.get(column, column), column, None))
            continue
        _, kind, component = column.split("/", 2)
        twin = f"memory/measured/{component}"
        if kind == "measured" and f"memory/predicted/{component}" in shown:
            continue  # shown beside its prediction
        if kind == "predicted" and twin in shown:
            cells.append((f"{component} MB (predicted / measured)", column, twin))
        else:
            cells.append((f"{component} MB ({kind})", column, None))

    def render(row: dict, column: str, twin: str | None) -> str:
        text = format_cell(column, row.get(column))
        if twin is None:
            return text
        measured = format_cell(twin, row.get(twin))
        return f"{text or '—'} / {measured or '—'}" if text or measured else ""

    lines = [f"# sweep {experiment.name}", ""]
    if experiment.description:
        lines += [experiment.description, ""]
    lines += ["| " + " | ".join(h for h, _, _ in cells) + " |", "|" + "|".join("---" for _ in cells) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(render(row, column, twin) for _, column, twin in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] != ["point"]:
        sys.exit("usage: python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS... (run by `lmledger sweep`)")
    sys.exit(point_main(sys.argv[2:]))
