"""`lmledger fit|validate`: LightningCLI over LitLM and TokenDataModule, or over any LightningModule.

`--model CLASS_PATH` / `--data CLASS_PATH` (or a --config whose `model:` / `data:` has a `class_path`) switch
LightningCLI to subclass mode: any LightningModule and LightningDataModule (data defaults to TokenDataModule),
with lmledger.callbacks.Ledger as the ledger and the same run directories, checkpoints and resume. Class paths
import from the working directory too, as under `python -m`.

Runs live under `runs/<name>/version_<n>/` (TensorBoard events, the resolved config.yaml, checkpoints/);
each new run takes the next version, so nothing from an earlier run is overwritten.
`--ckpt_path last` resumes the newest run of that name that has a last.ckpt, logging into the same version.

`validate` needs --ckpt_path (a file or `last`) and writes nothing: no config, and no run directory unless the
command line names one to log in (`--trainer.logger.init_args.save_dir DIR`, as `lmledger sweep` does).

Every run also gets, without configuring anything: checkpoints written atomically (AtomicCheckpointIO),
a NaN/Inf guard (`--nonfinite.max_skips K`, default 0 = stop at the first non-finite step), per-batch
reseeding for exact resume (StepSeeder), a save-and-stop on SIGTERM (PreemptionCheckpoint, exit 143),
and checks that a --ckpt_path is readable, fits the model, was trained with the same settings and data,
and has steps left to train, before Lightning touches it. docs/reliability.md lists every case.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import logging
import math
import os
import secrets
import sys
import threading
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lmledger.atomic import write_error
from lmledger.callbacks import Ledger, LedgerSettings, ledger_callbacks
from lmledger.callbacks.nonfinite import NonFiniteGuard
from lmledger.callbacks.progress import plain_progress_if_not_a_terminal
from lmledger.checkpointing import (
    AtomicCheckpointIO,
    PreemptionCheckpoint,
    RunClaim,
    StepSeeder,
    check_checkpoint_fits,
    claim_version_dir,
    make_last_checkpoint_atomic,
    newest_checkpoint,
    noted_stop_signals,
    open_checkpoint,
    release_claims,
    slurm_job_key,
    slurm_job_version,
    slurm_line,
    undo_uncommitted_claims,
    versions,
)
from lmledger.data import TokenDataModule, load_meta
from lmledger.errors import ConfigError, UserError
from lmledger.ledger.dryrun import batch_tensors
from lmledger.ledger.predict import configured_optimizer
from lmledger.lightning_private import cli_value, is_local_path, pin_logger_version
from lmledger.lit import LitLM, check_hyperparameters
from lmledger.precision import check_trainer_config, trainer_precision_kwargs

SUBCOMMANDS = ("fit", "validate")
# --ckpt_path values Lightning resolves itself rather than reading as a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry", "auto")  # auto: ours (fit resumes if it can)


class _DropAdverts(logging.Filter):
    """Lightning's "💡 Tip" for a cloud logger, on every run (canary test_lightning_advertises_a_cloud_logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


class NothingToResume(Exception):
    """--ckpt_path names a run that already trained every step asked for: say so and exit 0, writing nothing."""


# Model settings that may differ on resume: they change how the same function is computed, not which.
# (Top-level `activation_checkpointing` is the examples' and other modules' name for the same switch.)
RESUME_MAY_CHANGE = ("compile", "config.activation_checkpointing", "config.vocab_size", "activation_checkpointing")


def find_last_checkpoint(save_dir: str, name: str) -> tuple[Path, int] | None:
    """The newest checkpoint (newest_checkpoint) of the newest `save_dir/name/version_N` that has one, and N."""
    root = Path(save_dir, name)
    for version in sorted(versions(root), reverse=True):
        ckpt = newest_checkpoint(root / f"version_{version}" / "checkpoints")
        if ckpt is not None:
            return ckpt, version
    return None


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, (list, tuple)):
        value = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return {prefix[:-1]: value}


def hyperparameter_differences(saved: dict, current) -> list[str]:
    """'model.KEY: A in the checkpoint, B now' for each model setting that differs (RESUME_MAY_CHANGE aside).
    Only settings both sides know are compared: a checkpoint from before a setting existed ran its default.
    `current` in subclass mode is {class_path, init_args}: the class and its arguments are compared (a module
    that saves no hyperparameters has none to compare)."""
    differences = []
    if isinstance(current, Namespace):
        current = current.as_dict()
    if isinstance(current, dict) and "class_path" in current:
        then = saved.get("_class_path")
        if then is not None and then != current["class_path"]:
            differences.append(f"model.class_path: {then} in the checkpoint, {current['class_path']} now")
        current = {**(current.get("init_args") or {}), **(current.get("dict_kwargs") or {})}
    theirs, ours = _flatten({k: v for k, v in saved.items() if not k.startswith("_")}), _flatten(current)
    for key in sorted(set(theirs) & set(ours)):
        if key in RESUME_MAY_CHANGE or key.startswith("_"):
            continue
        then, now = theirs[key], ours[key]
        if then != now:
            differences.append(f"model.{key}: {_show(then)} in the checkpoint, {_show(now)} now")
    return differences


def _show(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _checked_hyperparameters(checkpoint: dict, path, litlm: bool = True) -> dict:
    """The checkpoint's model hyperparameters, refused in one line naming the checkpoint when they are not
    a mapping or hold a value LitLM would refuse (LightningCLI merges them into the config, where the
    error would otherwise blame the command line)."""
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(hparams, dict):
        raise UserError(
            f"checkpoint {path} stores its hyperparameters as a {type(hparams).__name__}, not a mapping of names "
            "to values: it was not written by `lmledger fit`; pass a checkpoint of this kit"
        )
    if litlm and "_class_path" not in hparams:  # our LitLM's; another class checks its own
        try:
            check_hyperparameters(**{k: v for k, v in hparams.items() if not k.startswith("_")})
        except (ConfigError, TypeError) as err:
            raise UserError(
                f"checkpoint {path} holds a bad hyperparameter ({err}); it was edited or written by other code: "
                "pass another checkpoint"
            ) from None
    return hparams


def _is_import_path(value) -> bool:
    return isinstance(value, str) and "." in value and all(part.isidentifier() for part in value.split("."))


def _import_paths(value, key: str = ""):
    """(key, path) for each value in a checkpoint's hyperparameters that jsonargparse would import when
    LightningCLI merges them into the config: a `_class_path`/`class_path` entry at any depth, or any
    string of the form package.module.name (a callable- or class-typed argument imports it)."""
    if isinstance(value, dict):
        for name, item in value.items():
            if name in ("_class_path", "class_path"):
                if item is not None:
                    yield (f"{key}.{name}" if key else name), item
            elif name != "_instantiator":  # Lightning's own key, popped before the merge
                yield from _import_paths(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _import_paths(item, f"{key}.{i}")
    elif _is_import_path(value):
        yield key, value


def _already_names(path: str, obj) -> bool:
    """Whether `path` names `obj` (a default given as the function or class itself) among the modules already
    imported; nothing new is imported to find out, so a path into a module not yet loaded names nothing."""
    module, _, attr = path.rpartition(".")
    while module:
        if module in sys.modules:
            target = sys.modules[module]
            for part in attr.split("."):
                target = getattr(target, part, None)
            return target is obj
        module, _, head = module.rpartition(".")
        attr = f"{head}.{attr}"
    return False


def _shown(value) -> str:
    """A config value for a message: a function or class by its import path, anything else as repr()."""
    name, module = getattr(value, "__name__", None), getattr(value, "__module__", None)
    return f"{module}.{name}" if callable(value) and name and module else repr(value)


def _lookup(namespace, key: str):
    """The value at dotted `key` in a (possibly nested) mapping, list or Namespace; None if absent."""
    value = namespace.as_dict() if isinstance(namespace, Namespace) else namespace
    for part in key.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _refuse_checkpoint_code(hparams: dict, model_config, path, any_model: bool) -> None:
    """A --ckpt_path file names no code the command line does not: LightningCLI builds the model from the
    checkpoint's `_class_path` and merges its other hyperparameters into the config, and jsonargparse
    imports every class path and dotted callable among them, so a checkpoint could pick the class (or
    function) that runs. Each such value must equal what the command line and config files name at the same
    place; checked on the weights-only load, before anything is imported."""
    current = model_config.as_dict() if isinstance(model_config, Namespace) else dict(model_config or {})
    named = current.get("class_path") if any_model else f"{LitLM.__module__}.{LitLM.__qualname__}"
    saved_class = hparams.get("_class_path")
    if saved_class is not None and saved_class != named:
        flag = f"--model {saved_class}" if any_model else f"--model {saved_class} (a class-path run)"
        raise UserError(
            f"checkpoint {path} was saved from class {saved_class!r}, but this command builds {named}: refused "
            f"before importing it (a checkpoint does not choose the code that runs); pass {flag} if you trust "
            f"that class, or a checkpoint of {named}"
        )
    init = (current.get("init_args") or {}) | (current.get("dict_kwargs") or {}) if any_model else current
    prefix = "--model.init_args." if any_model else "--model."
    for key, value in _import_paths({k: v for k, v in hparams.items() if k != "_class_path"}):
        now = _lookup(init, key.removesuffix("._class_path"))
        if isinstance(now, dict):
            now = now.get("class_path")
        if value != now and not (now is not None and _already_names(value, now)):
            raise UserError(
                f"checkpoint {path} sets model {key} to {value!r}, an import path this command does not name "
                f"(it has {_shown(now)}): refused before importing it (a checkpoint does not choose the code that "
                f"runs); pass {prefix}{key.removesuffix('.class_path')} {value} if you trust it"
            )


def _build_failure(err: BaseException) -> UserError | None:
    """One line for an exception a class's own __init__ raised while jsonargparse built it, or None.

    jsonargparse reports a failed subclass build (`--model X`, `--data.init_args.*`, a callback) as a
    ValueError listing every Union subtype it tried, raised `from` the original exception (canary
    test_jsonargparse_chains_a_failed_build). The deepest cause is the class's own error; the innermost
    traceback frame holding `class_type` (jsonargparse's and Lightning's instantiators) names the class.
    The kit's UserError comes through as it is, anything else as `building pkg.Class failed (Type: ...)`."""
    original = err
    while original.__cause__ is not None:
        original = original.__cause__
    built = None
    for frame, _ in traceback.walk_tb(original.__traceback__):
        candidate = frame.f_locals.get("class_type")
        if isinstance(candidate, type):
            built = candidate
    if built is None:
        return None
    if isinstance(original, UserError):
        return original
    reason = " ".join(str(original).split()) or "no message"
    return UserError(f"building {built.__module__}.{built.__qualname__} failed ({type(original).__name__}: {reason})")


def _config_files(args) -> list[str]:
    args = list(args or [])
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"] + [
        a.split("=", 1)[1] for a in args if a.startswith("--config=")
    ]


def _read_config(name: str) -> dict | None:
    path = Path(name)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # jsonargparse reports an unreadable config in its own words
    return doc if isinstance(doc, dict) else None


def named_classes(args) -> list[tuple[str, str]]:
    """(where, class path) for each model or data class the command line or its --config files name:
    `--model X`, `--data=X`, `--model.class_path X`, or `model: {class_path: X}` / `model: X` in a file."""
    args = [str(a) for a in args or []]
    found = []
    for i, arg in enumerate(args):
        for key in ("model", "data"):
            for flag in (f"--{key}", f"--{key}.class_path"):
                if arg == flag and i + 1 < len(args):
                    found.append((flag, args[i + 1]))
                elif arg.startswith(flag + "="):
                    found.append((flag, arg.split("=", 1)[1]))
    for name in _config_files(args):
        doc = _read_config(name) or {}
        for key in ("model", "data"):
            section = doc.get(key)
            if isinstance(section, dict) and "class_path" in section:
                found.append((f"config {name}: {key}.class_path", section["class_path"]))
            elif isinstance(section, str):
                found.append((f"config {name}: {key}", section))
    return found


_BASES = {"model": pl.LightningModule, "data": pl.LightningDataModule}


def _import_quitting_aloud(where: str, value: str, module_name: str):
    """importlib.import_module, with a module that exits while being imported (argparse's parse_args() at
    module level, run on lmledger's command line) named as the cause: its usage and `lmledger: error:` lines
    would otherwise read as lmledger's own. What the import prints is held back and shown if it succeeds."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            module = importlib.import_module(module_name)
    except SystemExit as stop:
        said = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
        quoted = f", printing {said[-1][:160]!r}" if said else ""
        raise UserError(
            f"{where} {value}: importing {module_name} exited (SystemExit {stop.code}){quoted}; the module runs "
            'code at import (e.g. argparse on sys.argv): move it under `if __name__ == "__main__":`'
        ) from None
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())
    return module


def _check_class_paths(named: list[tuple[str, str]]) -> None:
    """Each dotted class path imports and names a LightningModule (--model) or LightningDataModule (--data);
    jsonargparse's own report of either runs to several lines about every type it tried."""
    keys = ["data" if where.startswith("--data") or where.split(": ")[-1].startswith("data") else "model"
            for where, _ in named]  # fmt: skip
    if "model" not in keys:
        raise UserError(f"{named[0][0]} names a data module but no model: add --model CLASS_PATH (a LightningModule)")
    for (where, value), key in zip(named, keys, strict=True):
        base = _BASES[key]
        if not isinstance(value, str) or "." not in value:
            # Nothing of the user's is imported here, so a bare name could only resolve to Lightning's own.
            raise UserError(
                f"{where} {value!r}: name the class by its import path, package.module.Class (e.g. "
                "examples.byte_convnet.ByteConvNet), importable from the working directory"
            )
        module_name, _, attr = value.rpartition(".")
        try:
            obj = getattr(_import_quitting_aloud(where, value, module_name), attr)
        except (ImportError, AttributeError) as err:
            raise UserError(
                f"{where} {value}: cannot import it ({type(err).__name__}: {err}); name a {base.__name__} class "
                "as package.module.Class, importable from the working directory"
            ) from None
        except UserError:
            raise
        except Exception as err:  # the module itself fails on import
            raise UserError(f"{where} {value}: importing {module_name} failed ({type(err).__name__}: {err})") from None
        if not (isinstance(obj, type) and issubclass(obj, base)):
            what = f"a {type(obj).__name__}" if not isinstance(obj, type) else f"a class that is not a {base.__name__}"
            raise UserError(
                f"{where} {value} is {what}; `--{key}` takes a {base.__name__} subclass "
                f"({'lightning.pytorch.' + base.__name__})"
            )


def _check_config_files(args, any_model: bool = False) -> None:
    """Sections of a --config file that are not mappings: jsonargparse 4 resets `data: [1, 2]` to the class
    defaults without a word, and `model: {config: 5}` ends in a message about a missing context_length."""
    for name in _config_files(args):
        doc = _read_config(name)
        if doc is None:
            continue
        sections = [(key, doc.get(key)) for key in ("model", "data", "trainer")]
        if any_model:  # `model: package.Class` is a class path there
            sections = [(key, value) for key, value in sections if not (key != "trainer" and isinstance(value, str))]
        elif isinstance(doc.get("model"), dict):
            sections.append(("model.config", doc["model"].get("config")))
        for key, value in sections:
            if value is not None and not isinstance(value, dict):
                raise UserError(
                    f"config {name}: `{key}` must be a mapping of settings (`{key.split('.')[-1]}:` followed by "
                    f"indented `name: value` lines), got {type(value).__name__} {value!r}"
                )


def _check_trainer_values(trainer) -> None:
    """Values Lightning accepts and then misuses (canary test_trainer_accepts_values_that_train_wrongly):
    negative clipping ascends the gradient, zero accumulation trains nothing, negative devices crash."""
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise ConfigError(f"--trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ConfigError(f"--trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate}")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < -1:
        raise ConfigError(
            f"--trainer.devices must be a count >= 1, a list of device indices, -1 (all) or auto, got {devices}"
        )


def _refuse_several_optimizers(model: pl.LightningModule, trainer: Trainer) -> None:
    """Lightning refuses several optimizers under automatic optimization with a RuntimeError traceback once the
    strategy sets up, after the run directory is claimed; configure_optimizers is asked here first, with the
    trainer attached for a method that reads it (one that needs more than the trainer's settings, e.g.
    estimated_stepping_batches, is left to Lightning)."""
    if not model.automatic_optimization:
        return
    model.trainer = trainer
    try:
        configured_optimizer(model)
    except UserError:
        raise UserError(
            f"{type(model).__name__}.configure_optimizers returns more than one optimizer, which Lightning steps "
            "only under manual optimization: set self.automatic_optimization = False and step them in "
            "training_step, or return one optimizer"
        ) from None
    except Exception:
        return  # Lightning reports its own way when it calls the method
    finally:
        model.trainer = None


def _refuse_empty_train_loader(datamodule) -> None:
    """Make the data module's train_dataloader refuse a loader of no batches when Lightning asks for it:
    Lightning says "No training batches", trains nothing and exits 0. The loader only exists once the
    module is prepared and set up, inside Trainer.fit, so the check rides on the call (the run directory
    claimed by then is undone for a refusal, RunClaim)."""
    own = getattr(type(datamodule), "train_dataloader", None)
    if own is None or own is pl.LightningDataModule.train_dataloader:
        return  # Lightning's own message for a data module without one

    def train_dataloader(*args, **kwargs):
        loader = own(datamodule, *args, **kwargs)
        try:
            empty = len(loader) == 0
        except TypeError:  # an iterable without a length: Lightning's rules for it apply
            empty = False
        if empty:
            raise UserError(
                f"{type(datamodule).__name__}.train_dataloader() yields no batch (an empty dataset, or fewer "
                "samples than one batch with drop_last): nothing would train"
            )
        return loader

    datamodule.train_dataloader = train_dataloader


def _check_trains_something(trainer) -> None:
    """max_steps 0 (or max_epochs 0 with no step limit): Lightning stops at once, "`max_steps=0` reached",
    and exits 0 with a run directory of nothing."""
    max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if max_steps == 0 or (max_epochs == 0 and max_steps in (None, -1)):
        flag = "max_steps" if max_steps == 0 else "max_epochs"
        raise ConfigError(
            f"--trainer.{flag} 0 trains nothing; pass a count >= 1 (or -1 for no limit), or use "
            "`lmledger validate` / `lmledger account` to evaluate or measure without training"
        )


def _ckpt_path_form(ckpt: str, subcommand: str, default_root_dir) -> None:
    """--ckpt_path values we refuse before anything is built: remote URLs, and Lightning's names that
    need state this process does not have ("best": a fit earlier in the same process; "registry": a
    model registry; "hpc": Lightning's SLURM requeue checkpoint, hpc_ckpt_N.ckpt, when there is none)."""
    if not is_local_path(ckpt):
        raise UserError(
            f"--ckpt_path {ckpt}: remote checkpoints are not supported here; copy it to a local file and pass that"
        )
    if ckpt == "hpc" and any(Path(default_root_dir or ".").glob("hpc_ckpt_*.ckpt")):
        return
    if ckpt == "auto" and subcommand != "fit":
        raise UserError(f"--ckpt_path auto is for `lmledger fit` (resume if there is a checkpoint, else start); "
                        f"`lmledger {subcommand}` needs `last` or a checkpoint file")  # fmt: skip
    if ckpt in ("best", "hpc", "registry"):
        raise UserError(
            f"--ckpt_path {ckpt}: there is no {ckpt!r} checkpoint to resolve in a fresh `lmledger {subcommand}`; "
            "pass `last` or a checkpoint file (runs/NAME/version_N/checkpoints/*.ckpt)"
        )
    if ckpt not in SPECIAL_CKPT_PATHS + ("auto",) and Path(ckpt).is_dir():
        inside = sorted(p.name for p in Path(ckpt).glob("*.ckpt"))
        hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        raise UserError(
            f"--ckpt_path {ckpt} is a directory{hint}; pass a checkpoint file in it, or `last` for the newest "
            "checkpoint of this run's name"
        )


def _run_dir_of(config) -> tuple[Path, object] | None:
    """(save_dir/name, the logger's init_args) for our TensorBoard/CSV layout; None for another logger."""
    logger = config.trainer.get("logger")
    init = logger.init_args if logger is not None and hasattr(logger, "init_args") else None
    if init is None or "save_dir" not in init:
        return None
    return Path(init.save_dir, init.get("name") or "lightning_logs"), init


def _resolve_last(config, subcommand: str) -> tuple[Path, int] | None:
    """--ckpt_path last: the newest checkpoint of the newest version of this run (None: not our layout)."""
    found = _run_dir_of(config)
    if found is None:
        return None
    root, init = found
    last = find_last_checkpoint(init.save_dir, init.get("name") or "lightning_logs")
    if last is None:
        raise UserError(
            f"--ckpt_path last: no {root}/version_*/checkpoints/last.ckpt to resume; "
            + ("start a fresh run without --ckpt_path" if subcommand == "fit" else "train one with `lmledger fit`")
        )
    return last


def _resolve_auto(config) -> tuple[Path | None, int | None, str]:
    """--ckpt_path auto: (checkpoint, version, what happens in words). Under SLURM "this run" is the version
    directory this job (or array task) trains in (its slurm_job file): a requeued job resumes it, another job
    never does; elsewhere (a pod restarted, a script run again) it is the newest version with a checkpoint.
    No checkpoint: (None, the job's version or None for a new one, the reason)."""
    found = _run_dir_of(config)
    if found is None:
        raise UserError(
            "--ckpt_path auto finds checkpoints in the TensorBoardLogger/CSVLogger layout (save_dir/name/version_N); "
            "with another logger pass --ckpt_path FILE"
        )
    root, init = found
    job = slurm_job_key()
    if job is None:
        last = find_last_checkpoint(init.save_dir, init.get("name") or "lightning_logs")
        if last is None:
            return None, None, f"no checkpoint under {root} yet: starting fresh"
        return last[0], last[1], ""
    version = slurm_job_version(root, job)
    if version is None:
        return None, None, f"SLURM job {job} has no run under {root} yet: starting fresh"
    ckpt = newest_checkpoint(root / f"version_{version}" / "checkpoints")
    if ckpt is None:
        why = f"SLURM job {job} stopped in {root}/version_{version} before its first checkpoint: starting over"
        return None, version, why
    return ckpt, version, ""


def _free_name(directory: Path, stem: str) -> str:
    """stem.yaml, else stem-2.yaml, stem-3.yaml, ...: the first that does not exist in `directory`."""
    n = 1
    while (directory / (name := f"{stem}.yaml" if n == 1 else f"{stem}-{n}.yaml")).exists():
        n += 1
    return name


def _check_accelerator(accelerator) -> None:
    """Lightning says "No supported gpu backend found!" (with a traceback) when asked for a missing GPU."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if accelerator == "gpu" and MPSAccelerator.is_available():
        return
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    raise UserError(
        f"--trainer.accelerator {accelerator}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
        f"{build}); use --trainer.accelerator cpu"
    )


class LedgerCLI(LightningCLI):
    @property
    def any_model(self) -> bool:
        """Subclass mode: the model is any LightningModule (LitLM-specific checks and links are skipped)."""
        return bool(self.subclass_mode_model)

    def add_arguments_to_parser(self, parser) -> None:
        if self.any_model:
            # The data a module trains on, unless the command line names another: lmledger's token windows.
            parser.set_defaults({"data": {"class_path": "lmledger.data.TokenDataModule"}})
        else:
            # The vocabulary comes from the data's meta.json; the window length from the model config.
            parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
            parser.link_arguments("model.config.context_length", "data.context_length")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        parser.add_class_arguments(LedgerSettings, "ledger")

        parser.add_argument(
            "--allow_other_data",
            type=bool,
            default=False,
            help="Resume a checkpoint onto data whose sha256 differs from the data it was trained on.",
        )

    def parse_arguments(self, parser, args) -> None:
        self._argv = [str(a) for a in args or []]
        _check_config_files(args, self.any_model)
        super().parse_arguments(parser, args)
        # LightningCLI reads a --ckpt_path file's hyperparameters right after parsing; a missing or damaged
        # file would fail there with a traceback, so check it first.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        ckpt = config.get("ckpt_path")
        if subcommand == "validate" and not ckpt:
            raise UserError(
                "validate needs --ckpt_path (a checkpoint file, or `last` for the newest of this run's name); "
                "without one it would evaluate untrained weights"
            )
        if ckpt:
            _ckpt_path_form(str(ckpt), subcommand, config.trainer.get("default_root_dir"))
        if ckpt == "last" and subcommand == "validate":
            # Resolved here so that LightningCLI builds the model from the checkpoint's hyperparameters.
            found = _resolve_last(config, subcommand)
            if found is not None:
                config.ckpt_path = ckpt = str(found[0])
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS:
            hparams = _checked_hyperparameters(open_checkpoint(ckpt, mmap=True), ckpt, litlm=not self.any_model)
            _refuse_checkpoint_code(hparams, config.model, ckpt, self.any_model)
        # `--seed_everything true` promises a random seed; Lightning would use 0 (canary
        # test_seed_everything_none_without_environment_is_zero). Drawn here, it is saved in config.yaml.
        if config.get("seed_everything") is True:
            config.seed_everything = secrets.randbelow(2**32)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI merges a checkpoint file's hyperparameters into the config; a value that does not
        # parse would be reported as if the command line held it.
        try:
            super()._parse_ckpt_path()
        except ArgumentError as err:
            ckpt = self.config[self.config.subcommand].get("ckpt_path")
            reason = " ".join(line.strip() for line in str(err).strip().splitlines())
            raise UserError(
                f"checkpoint {ckpt} holds hyperparameters this model does not accept ({reason}); "
                "pass another checkpoint"
            ) from None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        _check_accelerator(config.trainer.get("accelerator"))
        check_trainer_config(config.trainer, fp8=config.model.get("fp8"))  # fp8/bf16 need library + hardware
        _check_trainer_values(config.trainer)
        if self.subcommand == "fit":
            _check_trains_something(config.trainer)
        self._resume, self._fresh = None, False
        if self.subcommand == "validate":
            # Evaluating writes no config and, unless the command line names a directory to log in (as
            # `lmledger sweep` does for each point), no run directory: the metrics are printed. (A logger
            # name alone only says which run `--ckpt_path last` means.)
            self.save_config_callback = None
            if not any(arg.startswith("--trainer.logger.init_args.save_dir") for arg in self._argv):
                config.trainer.logger = False
            return
        ckpt = config.get("ckpt_path")
        if not ckpt:
            return
        run_dir, auto = None, ckpt == "auto"
        if auto:
            path, version, fresh = _resolve_auto(config)
            if path is None:  # nothing to resume: a fresh start (in the SLURM job's own version, if it has one)
                config.ckpt_path = None
                if version is not None:
                    _run_dir_of(config)[1].version = version
                self._resume = f"--ckpt_path auto: {fresh}"
                self._fresh = True  # before_fit names the version directory claimed
                return
            ckpt = "last"  # checked as --ckpt_path last checks the checkpoint it finds
        if ckpt == "last":
            found = (path, version) if config.ckpt_path == "auto" else _resolve_last(config, self.subcommand)
            if found is None:
                return  # not our TensorBoard layout; let Lightning resolve "last" itself
            path, version = found
            run_dir = path.parent.parent
            checkpoint = open_checkpoint(path, mmap=True)
            hparams = _checked_hyperparameters(checkpoint, path, litlm=not self.any_model)
            differences = hyperparameter_differences(hparams, config.model)
            if differences:
                raise UserError(
                    f"checkpoint {path} was trained with other settings ({'; '.join(differences)}); resume with "
                    f"the run's own (its {run_dir / 'config.yaml'}), or start a fresh run without --ckpt_path"
                )
        else:
            path, version = Path(ckpt), None
            checkpoint = open_checkpoint(path, mmap=True)
        step = int(checkpoint.get("global_step", 0))
        self._check_not_finished(config.trainer, checkpoint, run_dir or path, step)
        self._check_same_data(config, checkpoint, path)
        config.ckpt_path = str(path)
        if version is not None:
            # Log into the run's own version; its config is saved beside the first one, never over it.
            _run_dir_of(config)[1].version = version
            self.save_config_kwargs["config_filename"] = _free_name(run_dir, "config-resumed")
            self._resume = f"{'--ckpt_path auto: ' if auto else ''}resuming {run_dir} at step {step} from {path.name}"
        else:
            self._resume = f"resuming from {path} at step {step}, in a new run directory"

    @staticmethod
    def _check_not_finished(trainer, checkpoint: dict, run: Path, step: int) -> None:
        max_steps = trainer.get("max_steps")
        max_epochs = trainer.get("max_epochs")
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        epochs_done = fit_loop.get("epoch_progress", {}).get("current", {}).get("completed", 0)
        if fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
            epochs_done += 1  # saved at the epoch's last batch: Lightning counts that epoch done on restore
        if max_steps is not None and max_steps > 0:
            if step >= max_steps:
                raise NothingToResume(
                    f"{run} finished at step {step}; nothing to resume (a larger --trainer.max_steps trains further)"
                )
            if max_epochs is not None and 0 <= max_epochs <= epochs_done:
                # The data module sizes one epoch to max_steps, so a run extended past its old max_steps would
                # stop at once on its completed epoch; the epoch count does not bound such a run.
                trainer.max_epochs = epochs_done + 1
        elif max_epochs is not None and 0 <= max_epochs <= epochs_done:
            raise NothingToResume(
                f"{run} finished at step {step} ({epochs_done} epochs); nothing to resume "
                "(a larger --trainer.max_epochs trains further)"
            )

    @staticmethod
    def _check_same_data(config, checkpoint: dict, path: Path) -> None:
        trained_on = (checkpoint.get(TokenDataModule.__qualname__) or {}).get("sha256")
        data_path = _setting(config.data, "path")
        if not trained_on or config.get("allow_other_data") or not isinstance(data_path, (str, os.PathLike)):
            return  # another data module: its state (if any) is Lightning's to restore
        try:
            now = load_meta(data_path).get("sha256")
        except UserError:
            return  # the data module reports a bad directory in its own words
        if now and now != trained_on:
            changed = ", ".join(sorted(k for k in set(now) | set(trained_on) if now.get(k) != trained_on.get(k)))
            raise UserError(
                f"checkpoint {path} was trained on other data than {data_path} holds now ({changed} differ "
                "by sha256); resume onto the same data, or pass --allow_other_data true to continue on this data"
            )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except UserError:
            raise
        except Exception as err:
            failure = _build_failure(err)
            if failure is None:
                raise
            raise failure from None

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # Our plugins for transformer-engine (tied weights) and 16-mixed on CPU (lmledger.precision).
        config = cli_value(self, self.config_init, "trainer", default={})
        precision = trainer_precision_kwargs(config.get("precision"), config.get("accelerator"), config.get("plugins"))
        # The ledger callbacks ride along with whatever callbacks the config lists (--ledger.enabled false: none).
        callbacks = config.get("callbacks") or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks])]
        settings = cli_value(self, self.config_init, "ledger")
        if self.any_model:
            callbacks.append(StepChecks(read_batches=settings.enabled))
        # One Ledger, the same for LitLM and any module; a config that lists its own runs that one alone.
        if not any(isinstance(c, Ledger) for c in callbacks):
            callbacks += ledger_callbacks(settings)
        # Last, so the line it prints carries the values the ledger callbacks logged for this step.
        callbacks += plain_progress_if_not_a_terminal(config.get("enable_progress_bar"))
        self._claim = RunClaim()  # the run directory's lock; a refused run's files undone (before_fit)
        callbacks.append(self._claim)
        precision = _slurm_plugins(precision, config.get("plugins"))
        try:
            trainer = super().instantiate_trainer(**{**precision, "callbacks": callbacks, **kwargs})
        except ValueError as err:  # Lightning's checks of accelerator, strategy and devices, e.g. FSDP on CPU
            raise ConfigError(" ".join(str(err).split())) from None
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a chosen plugin stays
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        make_last_checkpoint_atomic(trainer.callbacks)
        if self.subcommand == "fit":
            trainer.callbacks.append(PreemptionCheckpoint())
        else:  # validate saves nothing; a ModelCheckpoint there only warns that its directory differs
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        trainer.callbacks.append(NameTheEventFile())
        return trainer

    def _check_checkpoint(self) -> None:
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS and is_local_path(ckpt):
            check_checkpoint_fits(ckpt, self.model)

    def _claim_run_dir(self) -> None:
        # The run directory is claimed now, after the checks made before training, and locked (one writer
        # per run: RunClaim); what a run refused in its first step wrote there is undone (main). Rank 0
        # only: DDP's launcher re-runs the CLI for the other ranks, which log nothing.
        if rank_zero_only.rank != 0:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                root = Path(logger.root_dir)
                parents = [p for p in (*reversed(root.parents[: len(root.parts) - 1]), root) if not p.exists()]
                claimed: list[int] = []

                def claim(run_root, claimed=claimed) -> int:
                    claimed.append(claim_version_dir(run_root))
                    return claimed[-1]

                pin_logger_version(logger, claim)
                if self._claim.version_dir is not None:
                    continue  # one lock per process: the first logger's directory is the run's
                self._claim.claim(Path(logger.log_dir), bool(claimed) or not Path(logger.log_dir).exists(), parents)
                if slurm_job_key() and self.subcommand == "fit":
                    self._claim.mark_slurm_job(slurm_job_key())
        run = self._claim.version_dir
        for callback in self.trainer.callbacks:
            # The config name was chosen before the lock was held; a run that ended meanwhile may have taken it.
            if isinstance(callback, SaveConfigCallback) and run and (run / callback.config_filename).exists():
                callback.config_filename = _free_name(run, "config-resumed")

    def before_fit(self) -> None:
        self._check_checkpoint()
        if self.any_model:
            _refuse_several_optimizers(self.model, self.trainer)
        if self.datamodule is not None:
            _refuse_empty_train_loader(self.datamodule)
        self._claim_run_dir_or_say_why()
        if rank_zero_only.rank == 0:
            if self._fresh and self._claim.version_dir is not None:
                self._resume += f" in {self._claim.version_dir}"
            if self._resume:
                print(f"lmledger fit: {self._resume}", flush=True)
            if slurm_line() is not None:  # the job in TensorBoard too, one text entry per (re)start
                for logger in self.trainer.loggers:
                    if isinstance(logger, TensorBoardLogger):
                        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
                        logger.experiment.add_text("slurm", slurm_line(), global_step=restart)

    def before_validate(self) -> None:
        self._check_checkpoint()
        self._claim_run_dir_or_say_why()

    def _claim_run_dir_or_say_why(self) -> None:
        try:
            self._claim_run_dir()
        except OSError as err:  # a read-only or full runs directory: mkdir of the version fails
            where = Path(err.filename) if err.filename else Path(self.trainer.default_root_dir)
            raise write_error(
                err, where, after="nothing was written; pass a writable --trainer.logger.init_args.save_dir"
            ) from None


def _slurm_plugins(kwargs: dict, plugins) -> dict:
    """Trainer kwargs with SLURMEnvironment(auto_requeue=False) among the plugins when Lightning detects SLURM
    (srun, or --ntasks) and the config names no cluster environment: PreemptionCheckpoint saves, requeues
    and stops on SIGUSR1 for every rank count; Lightning's requeue would save a second, hpc_ckpt checkpoint."""
    if not SLURMEnvironment.detect():
        return kwargs
    plugins = kwargs.get("plugins", plugins)
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if any(isinstance(p, ClusterEnvironment) for p in plugins):
        return kwargs
    return {**kwargs, "plugins": [*plugins, SLURMEnvironment(auto_requeue=False)]}


def _slurm_tasks_per_node(env=os.environ) -> None:
    """`srun --ntasks N` on one node: Lightning's SLURMEnvironment refuses it with a traceback ("Use
    --ntasks-per-node"; canary test_slurm_environment_refuses_ntasks_without_per_node), though on one node the two
    mean the same. There it is given SLURM_NTASKS_PER_NODE=N; over several nodes the count per node is the user's
    to say, in one line."""
    ntasks = env.get("SLURM_NTASKS", "1")
    if not ntasks.isdigit() or int(ntasks) <= 1 or "SLURM_NTASKS_PER_NODE" in env:
        return
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if nodes == "1":
        env["SLURM_NTASKS_PER_NODE"] = ntasks
        return
    raise UserError(
        f"srun --ntasks {ntasks} over {nodes} nodes: add --ntasks-per-node (Lightning's SLURMEnvironment needs the "
        "same number of tasks on every node, one per device)"
    )


def _run_claimed(argv: list[str]) -> None:
    """The fit or validate; a run refused (UserError) before its first step passed every check leaves its
    run directory as it found it (RunClaim.undo), and every run directory lock is released at the end."""
    try:
        with noted_stop_signals():  # a SIGUSR1 while the run is built: saved and stopped at step 1, not fatal
            _run_cli(LedgerCLI, argv, run=True)
    except UserError:
        undo_uncommitted_claims()
        raise
    except torch.cuda.OutOfMemoryError as oom:
        if hasattr(oom, "ledger_line"):  # the preflight's refusal, reported as a UserError by main
            undo_uncommitted_claims()
        raise
    finally:
        release_claims()


def _setting(section, name: str):
    """A class's argument from its config section: `section.name`, or `section.init_args.name` in subclass mode."""
    if section is None:
        return None
    if "init_args" in section and isinstance(section.get("init_args"), Namespace):
        return section.init_args.get(name)
    return section.get(name)


# What a failed write is, as atomic.write_error words it: a full disk, a read-only one, over quota, too large.
DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _disk_error(err: BaseException | None) -> OSError | None:
    """The OSError of a refused write (DISK_ERRNOS) that `err` is or was raised from, if any."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
            return err
        err = err.__cause__
    return None


class NameTheEventFile(pl.Callback):
    """A TensorBoard event file that cannot be written fails in the logger's writer thread with a bare
    `OSError: [Errno 28]`, no file named, re-raised in the training loop at the next write. Name the newest
    event file of the run on it, so that main reports it as one line like a failed checkpoint write."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning's log_metrics raises it as the cause of a ValueError ("you tried to log 6.17 which is
        # currently not supported"); its logger.finalize then re-raises the OSError itself.
        exception = _disk_error(exception)
        if exception is None or exception.filename:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and logger.log_dir and Path(logger.log_dir).is_dir():
                events = sorted(Path(logger.log_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
                if events:
                    exception.filename = str(events[-1])
                    return


class StepChecks(pl.Callback):
    """What Lightning lets pass for any module and lmledger refuses in one line, on the first training batch:
    a training_step that returns no loss (Lightning skips the step: nothing trains), a loss that is not a
    scalar that needs grad (a traceback in backward), and, with the ledger on, a batch holding no tensor
    (the ledger reads batch shapes from tensors; without them its samples/s would be wrong)."""

    def __init__(self, read_batches: bool = True) -> None:
        self.read_batches = read_batches
        self._checked_start = self._checked_loss = self._checked_end = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._checked_start:
            return
        self._checked_start = True
        if self.read_batches and not batch_tensors(batch):
            raise UserError(
                f"the first training batch is a {type(batch).__name__} holding no tensor: the ledger reads "
                "batches of tensors (a tensor, or tuples, lists or dicts of them); return tensors from the "
                "data module's collate_fn, or run with --ledger.enabled false"
            )

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._checked_loss:
            return
        self._checked_loss = True
        if loss.numel() != 1 or not loss.requires_grad:
            got = f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a loss that needs no grad"
            raise UserError(
                f"{type(pl_module).__name__}.training_step returned {got}: return a scalar loss computed from "
                "the model's parameters (reduce it with .mean(); do not detach it or compute it under no_grad)"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._checked_end:
            return
        self._checked_end = True
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # Lightning passes {} for a skip
        if pl_module.automatic_optimization and loss is None:
            raise UserError(
                f"{type(pl_module).__name__}.training_step returned None on the first batch, so Lightning skipped "
                "the step and nothing trains: return the loss (a scalar tensor, or a dict with a 'loss' key)"
            )


def _run_cli(cli_class: type[LedgerCLI], argv: list[str], run: bool) -> LedgerCLI:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropAdverts())
    # LightningCLI warns when it gets `args` while sys.argv also holds arguments, as it does when we run
    # as the console script. sys.argv must stay as it is: DDP's launcher re-runs it for ranks 1..N-1.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # From Lightning's own code, nothing to act on (canary test_lightning_pytree_uses_the_deprecated_leafspec).
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Lightning warns on every mid-epoch resume that a loader without state_dict() "can cause unreliable
    # results". TokenDataModule's resumes exactly (its sampler starts at the restored batch count; tested).
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    # Lightning warns on every run outside SLURM where `srun` is installed (a login node, our CI); a job that
    # is not started by srun is still handled (PreemptionCheckpoint, --ckpt_path auto; docs/cluster.md).
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    named = named_classes(argv[1:] if argv and argv[0] in SUBCOMMANDS else argv)
    if named:
        # Class paths import from the working directory, as under `python -m` (the console script's
        # sys.path lacks it); DDP's launcher re-runs the same command there.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        _check_class_paths(named)
    try:
        return cli_class(
            pl.LightningModule if named else LitLM,
            pl.LightningDataModule if named else TokenDataModule,
            args=argv,
            run=run,
            subclass_mode_model=bool(named),
            subclass_mode_data=bool(named),
            save_config_kwargs={"overwrite": False},
            parser_kwargs={"exit_on_error": False},
            trainer_defaults={
                "callbacks": [StepSeeder()],
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                },
            },
        )
    except (ArgumentError, MisconfigurationException) as err:
        # MisconfigurationException is Lightning's "bad settings" error, e.g. `--trainer.accelerator gpu`
        # on a machine without one.
        raise UserError(" ".join(line.strip() for line in str(err).strip().splitlines())) from None


class _ParseOnlyCLI(LedgerCLI):
    """Parses a fit config and stops: builds no model, data or trainer."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


class _BuildCLI(LedgerCLI):
    """Parses a fit config and builds its model and data module; no trainer, nothing run or written."""

    def before_instantiate_classes(self) -> None:
        _check_accelerator(self.config.trainer.get("accelerator"))

    def instantiate_trainer(self, **kwargs) -> None:
        return None


def build_model_and_data(argv: list[str]):
    """(model, data module, parsed config) of `lmledger fit ARGV` (argv without the `fit`), built as fit
    builds them, for account and plan max-batch."""
    # LightningCLI seeds while parsing (the model's initial weights follow the config's seed); its
    # "Seed set to N" line means nothing here: no run.
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    seed_log.addFilter(_drop_seed_line)
    try:
        cli = _run_cli(_BuildCLI, argv, run=False)
    finally:
        seed_log.removeFilter(_drop_seed_line)
    return cli.model, cli.datamodule, cli.config


def _drop_seed_line(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Seed set to")


def first_batch(datamodule) -> object:
    """The first training batch of a data module (set up for fit, no trainer attached), read once."""
    try:
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        return next(iter(loader))
    except StopIteration:
        raise UserError(f"{type(datamodule).__name__}.train_dataloader() yields no batch") from None


def parse_fit_config(argv: list[str]):
    """The parsed (not instantiated) config of `lmledger fit ARGV`, as a jsonargparse Namespace."""
    return _run_cli(_ParseOnlyCLI, argv, run=False).config


def _quiet_event_writer(excepthook):
    """threading.excepthook without the traceback of TensorBoard's event writer thread failing on a full disk:
    the training loop re-raises the same OSError at its next write (canary
    test_tensorboard_writer_thread_reraises_its_error), and main reports it in one line."""

    def hook(args) -> None:
        if issubclass(args.exc_type, OSError) and "tensorboard" in type(args.thread).__module__.lower():
            return
        excepthook(args)

    return hook


def main(argv: list[str]) -> int:
    subcommand = argv[0] if argv else None
    if subcommand not in SUBCOMMANDS:
        raise UserError(f"unknown subcommand {subcommand!r}; choose from {', '.join(SUBCOMMANDS)}")
    if subcommand == "fit" and rank_zero_only.rank == 0:
        if not sys.stdout.isatty():  # a batch job's --output file gets each line as it is printed
            sys.stdout.reconfigure(line_buffering=True)
        if slurm_line() is not None:
            print(f"lmledger fit: {slurm_line()}", flush=True)
    excepthook, threading.excepthook = threading.excepthook, _quiet_event_writer(threading.excepthook)
    try:
        _slurm_tasks_per_node()
        _run_claimed(argv)
    except NothingToResume as done:
        print(f"lmledger {subcommand}: {done}")
        return 0
    except SIGTERMException as stop:  # PreemptionCheckpoint's Preempted, or Lightning's own (DDP, set-up)
        saved = getattr(stop, "checkpoint", None)
        if saved and rank_zero_only.rank != 0:
            pass  # every rank stopped at the same step (PreemptionCheckpoint); rank 0 says so
        elif saved:
            requeued = f"; {stop.requeued}" if getattr(stop, "requeued", None) else ""
            print(f"lmledger {subcommand}: preempted at step {stop.step}: saved {saved}; resume with --ckpt_path last"
                  f"{requeued}", file=sys.stderr)  # fmt: skip
        elif subcommand == "fit":
            print(f"lmledger {subcommand}: preempted (SIGTERM) before a step could be saved; --ckpt_path last "
                  "resumes from the run's newest checkpoint, if it has one", file=sys.stderr)  # fmt: skip
        else:
            print(f"lmledger {subcommand}: stopped by SIGTERM", file=sys.stderr)
        return 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
    except torch.cuda.OutOfMemoryError as oom:  # the Ledger explains it in one line
        if not hasattr(oom, "ledger_line"):
            raise
        raise UserError(oom.ledger_line) from oom
    except SystemExit as exit_:
        # Lightning turns Ctrl-C into sys.exit(1) after its graceful shutdown; cli.py reports it as 130.
        if isinstance(exit_.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
    except UserError:
        raise
    except Exception as err:  # a disk that refused a run's file (NameTheEventFile names an event file)
        refused = _disk_error(err)
        if refused is None or not refused.filename:
            raise
        kept = "the checkpoints saved before it are intact"
        raise write_error(refused, Path(refused.filename), after=kept) from None
    finally:
        threading.excepthook = excepthook
    return 0
