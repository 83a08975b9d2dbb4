"""The experiment file: its schema, checked into an Experiment of Points; each point's command line.

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
    metrics: [train/loss, val/loss]   # default: the command's collect.DEFAULT_METRICS
    x: trainer.precision              # the swept variable on the plots (default: the first grid key)
    requires: gpu                     # every point needs a CUDA GPU
    ranks: worst                      # a point on several ranks: the table shows the rank with the largest
                                      # peak (its ranks/rank<R>.json), and names it; default rank0

Override keys are the dotted names `lmledger fit` takes (`model.config.d_model`). For the other
commands they are flag names (`num-gpus`). Each becomes `--key value`.

A point in `grid` or `points` may also set `config`: one more config file, or a list. It is read
after the base `configs` and before the overrides. An example is a fragment such as
configs/precision/bf16-true.yaml. A `points` entry may also set `requires` and `command`. A point with
its own command takes neither `configs` nor `fixed` from the top level.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmledger.errors import UserError

__all__ = [
    "CONFIG_COMMANDS",
    "MAX_POINTS",
    "RANK_CHOICES",
    "TRAINING_COMMANDS",
    "Experiment",
    "Point",
    "cli_args",
    "config_args",
    "fit_args",
    "format_value",
    "load_experiment",
    "override_flags",
    "short_key",
    "slug_value",
]

_TOP_LEVEL_KEYS = ("name", "description", "command", "configs", "fixed", "grid", "points", "metrics", "x", "requires",
                   "ranks")  # fmt: skip
# Whose ledger lines a point on several ranks shows in the results (collect.with_ranks): rank 0's, as TensorBoard
# holds them, or those of the rank with the largest peak, read from the run's per-rank records.
RANK_CHOICES = ("rank0", "worst")
_POINT_ONLY_KEYS = ("command", "requires")  # allowed in `points` entries, not as grid keys
TRAINING_COMMANDS = ("fit", "validate")  # metrics come from the run's TensorBoard events
_JSON_COMMANDS = ("account", "plan", "gpus", "bench")  # metrics come from the one JSON object on stdout
CONFIG_COMMANDS = TRAINING_COMMANDS + ("account",)  # need --config
# A sweep this large is a mistake, or a job for a scheduler. Each point is a process. 10^6 points took
# 70 s and 650 MB to list (2026-11-30, 2-core CPU). The check runs before the grid is expanded.
MAX_POINTS = 10_000
# A plain directory name: no '/', and not '.', '..' or hidden.
_DIR_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")

# ---------------------------------------------------------------------------------------------
# The experiment file


@dataclass(frozen=True)
class Point:
    """One run of the sweep: a command line. Its name is a readable slug of its overrides, and a hash."""

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
    metrics: tuple[str, ...] | None  # None: each command's defaults; every JSON field for other commands
    x: str | None
    swept_keys: tuple[str, ...]  # each override key that varies between points, in order of appearance
    grid_keys: tuple[str, ...]
    ranks: str = "rank0"  # one of RANK_CHOICES


def _fail(source: Path, message: str) -> UserError:
    return UserError(f"{source}: {message}")


def _parse_command(source: Path, where: str, value) -> tuple[str, ...]:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, f"{where} must be a string such as `fit` or `account --measure`, got {value!r}")
    words = tuple(shlex.split(value))
    allowed = TRAINING_COMMANDS + _JSON_COMMANDS
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
        if key in _POINT_ONLY_KEYS and key not in allowed_extra:
            raise _fail(source, f"{where}: {key!r} can only be set in a `points` entry")


def _config_files(value) -> list[str]:
    """A point's `config` as a list of file names (checked later, by _parse_configs)."""
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def slug_value(key: str, value) -> str:
    if key == "config":
        return "+".join(Path(f).stem for f in _config_files(value))
    return format_value(value)


def short_key(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _point_id(command: tuple[str, ...], own_command: bool, configs: tuple[str, ...], fixed: dict, swept: dict) -> str:
    parts = ["-".join(w for w in command if not w.startswith("-"))] if own_command else []
    parts += [f"{short_key(k)}={slug_value(k, v)}" for k, v in swept.items()]
    slug = re.sub(r"[^A-Za-z0-9._=+-]+", "-", "_".join(parts)).strip("-_")[:60] or "point"
    # The hash covers everything that makes the run. Edit `fixed` and every point becomes a new one.
    overrides = {k: v for k, v in swept.items() if k != "config"}
    identity = json.dumps(
        {"command": command, "configs": configs, "fixed": fixed, "swept": overrides}, sort_keys=True, default=str
    )
    return f"{slug}-{hashlib.sha1(identity.encode()).hexdigest()[:6]}"


# (own command?, command, configs, swept overrides, requires_gpu) of one point, before it is built
_Spec = tuple[bool, tuple[str, ...] | None, tuple[str, ...], dict, bool]


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file. Every problem is one UserError line naming the key."""
    # Checked by hand, not by jsonargparse dataclasses. Its type errors are 8-line union dumps without the fix.
    source = Path(path)
    raw = _read_mapping(source)
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

    grid, points = raw.get("grid"), raw.get("points")
    specs = _grid_specs(source, grid, len(points or []), command, configs, requires) if grid is not None else []
    if points is not None:
        specs += _listed_specs(source, points, command, configs, requires)
    if grid is None and points is None:
        raise _fail(source, "no points: add a `grid` of overrides or a `points` list")
    built = _build_points(source, specs, fixed)

    grid_keys = tuple(grid) if grid is not None else ()
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
    ranks = raw.get("ranks", "rank0")
    if ranks not in RANK_CHOICES:
        raise _fail(
            source, f"ranks must be {' or '.join(RANK_CHOICES)} (whose ledger lines the table shows), got {ranks!r}"
        )
    return Experiment(name, source, description.strip(), tuple(built), metrics, x, tuple(swept_keys), grid_keys, ranks)


def _read_mapping(source: Path) -> dict:
    """The experiment file's YAML: a mapping of known top-level keys."""
    if not source.is_file():
        raise UserError(f"experiment file {source} does not exist")
    try:
        raw = yaml.safe_load(source.read_text())
    except yaml.YAMLError as err:
        raise _fail(source, f"not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict):
        raise _fail(source, "an experiment file is a mapping with keys such as command, configs, grid, metrics")
    unknown = [k for k in raw if k not in _TOP_LEVEL_KEYS]
    if unknown:
        raise _fail(source, f"unknown top-level key {unknown[0]!r}; allowed: {', '.join(_TOP_LEVEL_KEYS)}")
    return raw


def _grid_specs(
    source: Path, grid, n_listed: int, command: tuple[str, ...] | None, configs: tuple[str, ...], requires
) -> list[_Spec]:
    """One spec per combination of the grid's values. The limit also counts n_listed `points` entries."""
    if not isinstance(grid, dict):
        raise _fail(source, f"grid must be a mapping of override keys to lists of values, got {grid!r}")
    if not grid:
        raise _fail(source, "grid is empty: give it at least one key with a list of values")
    _check_override_keys(source, "grid", grid)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _fail(source, f"grid key {key!r} needs a non-empty list of values, got {values!r}")
        seen_values: dict[str, object] = {}
        for value in values:
            text = " ".join(_config_files(value)) if key == "config" else format_value(value)
            if text in seen_values:
                raise _fail(
                    source,
                    f"grid key {key!r} lists the same value twice ({seen_values[text]!r} and {value!r} are "
                    f"both `{text}` on the command line): remove one",
                )
            seen_values[text] = value
    n_points = math.prod(len(values) for values in grid.values()) + n_listed
    if n_points > MAX_POINTS:
        raise _fail(
            source,
            f"the grid has {n_points:,} points, more than a sweep may have ({MAX_POINTS:,}): "
            "split it into several experiment files or list the points you need under `points`",
        )
    specs = []
    for combo in itertools.product(*grid.values()):
        swept = dict(zip(grid, combo, strict=True))
        point_configs = configs + (_parse_configs(source, "grid config", swept["config"]) if "config" in swept else ())
        specs.append((False, command, point_configs, swept, requires == "gpu"))
    return specs


def _listed_specs(
    source: Path, points, command: tuple[str, ...] | None, configs: tuple[str, ...], requires
) -> list[_Spec]:
    """One spec per `points` entry."""
    if not isinstance(points, list) or not points:
        raise _fail(source, "points must be a non-empty list of mappings of overrides")
    if len(points) > MAX_POINTS:
        raise _fail(source, f"{len(points):,} points, more than a sweep may have ({MAX_POINTS:,}): split the file")
    specs = []
    for i, entry in enumerate(points):
        where = f"points[{i}]"
        if not isinstance(entry, dict) or not entry:
            raise _fail(source, f"{where} must be a non-empty mapping of overrides, got {entry!r}")
        _check_override_keys(source, where, entry, allowed_extra=_POINT_ONLY_KEYS)
        # A point with its own command is a different kind of run. It takes no configs or fixed
        # overrides from the top level: those belong to the top-level command.
        own = "command" in entry
        point_command = _parse_command(source, f"{where}.command", entry["command"]) if own else command
        inherited = () if own else configs
        extra = _parse_configs(source, f"{where}.config", entry["config"]) if "config" in entry else ()
        point_configs = inherited + extra
        point_requires = entry.get("requires", requires)
        if point_requires not in (None, "gpu"):
            raise _fail(source, f"{where}.requires must be `gpu`, got {point_requires!r}")
        swept = {k: v for k, v in entry.items() if k not in _POINT_ONLY_KEYS}
        specs.append((own, point_command, point_configs, swept, point_requires == "gpu"))
    return specs


def _build_points(source: Path, specs: list[_Spec], fixed: dict) -> list[Point]:
    """The Points of the specs, each with a command and its config files. No two are the same run."""
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
    return built


# ---------------------------------------------------------------------------------------------
# Command lines


def format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def override_flags(overrides: dict) -> list[str]:
    args: list[str] = []
    for key, value in overrides.items():
        args += [f"--{key}", format_value(value)]
    return args


def _run_dir_args(point: Point, out_dir: Path) -> list[str]:
    """Log a training point under out_dir/runs/<point id>/version_N: one TensorBoard parent for all."""
    return ["--trainer.logger.init_args.save_dir", str(out_dir / "runs"), "--trainer.logger.init_args.name", point.id]


def config_args(point: Point) -> list[str]:
    return [arg for config in point.configs for arg in ("--config", config)]


def _override_args(point: Point) -> list[str]:
    return override_flags(point.fixed) + override_flags({k: v for k, v in point.swept.items() if k != "config"})


def cli_args(point: Point, out_dir: Path | None = None) -> list[str]:
    """The point's `lmledger` arguments, without the program, in the order that makes later win.

    The order: config files, our quiet defaults, fixed overrides, the point's overrides, its run directory.
    """
    args = [*point.command, *config_args(point)]
    if point.subcommand in TRAINING_COMMANDS:
        args += ["--trainer.enable_progress_bar", "false"]  # the log is a file, not a terminal
    args += _override_args(point)
    if point.subcommand in TRAINING_COMMANDS and out_dir is not None:
        args += _run_dir_args(point, out_dir)
    if point.subcommand in _JSON_COMMANDS and "--json" not in args:
        args.append("--json")
    return args


def fit_args(point: Point) -> list[str]:
    """The point's arguments as `load_run` reads them: configs and overrides, no command words."""
    return config_args(point) + _override_args(point)
