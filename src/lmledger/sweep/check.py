"""Every point's arguments parsed by `lmledger fit`'s own parser, nothing built, before any point runs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lmledger.errors import UserError
from lmledger.sweep.spec import (
    CONFIG_COMMANDS,
    TRAINING_COMMANDS,
    Experiment,
    config_args,
    fit_args,
    format_value,
    override_flags,
)

__all__ = ["CheckedPoints", "bad_points_error", "check_points"]


@dataclass
class CheckedPoints:
    specs: dict[str, object]  # point id -> its Run (fit, validate and account points)
    errors: dict[str, str]  # point id -> the one line its arguments give
    # point id -> (nodes, ranks per node) its trainer asks for (fit and validate points, any model): the SLURM
    # launcher's --nodes and --ntasks-per-node
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)


def check_points(experiment: Experiment) -> CheckedPoints:
    """Parse every config-reading point's arguments with `lmledger fit`'s own parser, building nothing.

    A parse costs ~0.1 s, so a point is not parsed whole. Its base (configs and fixed overrides) is
    parsed once per distinct base. Each (key, value) is parsed once on top of that base. A point then
    combines the parsed values in place, in milliseconds.
    Some points are parsed whole once, to confirm: those whose combination fails, or that use a value
    that failed on its own. (A value may be valid only beside another, e.g. a class_path.)
    Other commands (plan, bench, gpus) are checked when they run: they fail in a second.
    """
    from lmledger.fitting.checks import check_fit_values
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.run_config import run_from_config

    def spec_of(config, subcommand: str):
        # A config naming any LightningModule parses but has no closed forms to list (its dry run needs the
        # module built): checked, not predicted. Either has a shape: its nodes and ranks per node.
        if subcommand in TRAINING_COMMANDS:
            _refuse_no_logger(config.trainer.get("logger"), bool(config.trainer.get("barebones")))
        scale = check_fit_values(config)
        run = _ANY_MODEL if "class_path" in config.model else run_from_config(config, scale)
        return run, (scale.num_nodes, scale.devices)

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
    shapes: dict[str, tuple[int, int]] = {}
    # Parsing a config seeds the RNG, and Lightning says so once per parse: noise in a listing.
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        for point in experiment.points:
            if point.subcommand not in CONFIG_COMMANDS:
                continue
            base_args = config_args(point) + override_flags(point.fixed)
            group = tuple(base_args)
            if group not in bases:
                bases[group] = parse(base_args)
            overrides = {k: format_value(v) for k, v in point.swept.items() if k != "config"}
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
                    spec = _combined_spec(base, {key[1]: values[key] for key in keys},
                                          lambda config, p=point: spec_of(config, p.subcommand))  # fmt: skip
            if spec is None:  # the whole command line decides
                parsed = parse(fit_args(point))
                try:
                    spec = parsed if isinstance(parsed, Exception) else spec_of(parsed, point.subcommand)
                except (UserError, ValueError, TypeError) as err:
                    spec = UserError(str(err))
                if isinstance(spec, Exception) and failed_alone is not None:
                    confirmed_bad[failed_alone] = str(values[failed_alone])
            if isinstance(spec, Exception):
                errors[point.id] = str(spec)
                continue
            run, shapes[point.id] = spec
            if run is not _ANY_MODEL:
                specs[point.id] = run
    finally:
        seed_log.setLevel(level)
    return CheckedPoints(specs, errors, shapes)


_ANY_MODEL = object()  # check_points: a point whose model is a class_path (no Run)


def _refuse_no_logger(logger, barebones: bool = False) -> None:
    """A fit or validate point logs under the sweep's runs/ (its logger's save_dir, set by the sweep), where the sweep
    reads its metrics: with no logger, or Lightning's default one (null or true: no class to set it on), every point
    would fail. So with barebones, which allows no logger (fit's own check would ask to drop the sweep's)."""
    if barebones:
        raise UserError(
            "trainer.barebones true: a sweep reads each fit and validate point's metrics from its logger, which "
            "barebones turns off; drop trainer.barebones from the experiment"
        )
    if logger is False or logger is True or logger is None or logger == []:
        shown = "[]" if logger == [] else str(logger).lower() if logger is not None else "null"
        raise UserError(
            f"trainer.logger {shown}: a sweep logs each fit and validate point under its runs/ directory, with the "
            "logger's save_dir, and reads the point's metrics there; name a logger class (the configs' "
            "TensorBoardLogger, as configs/tiny.yaml does) or drop trainer.logger from the experiment"
        )


def _combined_spec(base, values: dict[str, object], build):
    """build(base with `values` set at their dotted keys), or None if that fails. base is restored."""
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
