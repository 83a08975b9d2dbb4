"""Everything `lmledger fit|validate` refuses before a run starts (fitting package docstring)."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import math
import sys
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator

from lmledger.checkpointing import (
    newest_checkpoint,
    slurm_job_key,
    slurm_job_version,
    versions,
)
from lmledger.errors import ConfigError, UserError
from lmledger.ledger.predict import configured_optimizer
from lmledger.lightning_private import is_local_path
from lmledger.lit import LitLM, check_hyperparameters

SUBCOMMANDS = ("fit", "validate")
# --ckpt_path values Lightning resolves itself rather than reading as a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry", "auto")  # auto: ours (fit resumes if it can)


class DropAdverts(logging.Filter):
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


def checked_hyperparameters(checkpoint: dict, path, litlm: bool = True) -> dict:
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


def refuse_checkpoint_code(hparams: dict, model_config, path, any_model: bool) -> None:
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


def build_failure(err: BaseException) -> UserError | None:
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


def config_files(args) -> list[str]:
    args = list(args or [])
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"] + [
        a.split("=", 1)[1] for a in args if a.startswith("--config=")
    ]


def read_config(name: str) -> dict | None:
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
    for name in config_files(args):
        doc = read_config(name) or {}
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


def _package_home(where: str, module_name: str) -> Path | None:
    """For a class path named in a config file: the nearest directory at or above the file that holds its
    top-level package (configs/examples/*.yaml name `examples.*`, which lives at the repository root)."""
    if not where.startswith("config "):
        return None
    top = module_name.split(".")[0]
    config = Path(where.removeprefix("config ").split(": ")[0]).resolve()
    for directory in config.parents:
        if (directory / top / "__init__.py").exists() or (directory / f"{top}.py").exists():
            return directory
    return None


def check_class_paths(named: list[tuple[str, str]]) -> None:
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
            home = _package_home(where, module_name) if isinstance(err, ModuleNotFoundError) else None
            fix = (
                f"{module_name.split('.')[0]} is in {home}: run from there, or add it to PYTHONPATH"
                if home is not None
                else f"name a {base.__name__} class as package.module.Class, importable from the working directory"
            )
            raise UserError(f"{where} {value}: cannot import it ({type(err).__name__}: {err}); {fix}") from None
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


def check_config_files(args, any_model: bool = False) -> None:
    """Sections of a --config file that are not mappings: jsonargparse 4 resets `data: [1, 2]` to the class
    defaults without a word, and `model: {config: 5}` ends in a message about a missing context_length."""
    for name in config_files(args):
        doc = read_config(name)
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


def check_trainer_values(trainer) -> None:
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


def refuse_several_optimizers(model: pl.LightningModule, trainer: Trainer) -> None:
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


def refuse_empty_train_loader(datamodule) -> None:
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


def check_trains_something(trainer) -> None:
    """max_steps 0 (or max_epochs 0 with no step limit): Lightning stops at once, "`max_steps=0` reached",
    and exits 0 with a run directory of nothing."""
    max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if max_steps == 0 or (max_epochs == 0 and max_steps in (None, -1)):
        flag = "max_steps" if max_steps == 0 else "max_epochs"
        raise ConfigError(
            f"--trainer.{flag} 0 trains nothing; pass a count >= 1 (or -1 for no limit), or use "
            "`lmledger validate` / `lmledger account` to evaluate or measure without training"
        )


def ckpt_path_form(ckpt: str, subcommand: str, default_root_dir) -> None:
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


def run_dir_of(config) -> tuple[Path, object] | None:
    """(save_dir/name, the logger's init_args) for our TensorBoard/CSV layout; None for another logger."""
    logger = config.trainer.get("logger")
    init = logger.init_args if logger is not None and hasattr(logger, "init_args") else None
    if init is None or "save_dir" not in init:
        return None
    return Path(init.save_dir, init.get("name") or "lightning_logs"), init


def resolve_last(config, subcommand: str) -> tuple[Path, int] | None:
    """--ckpt_path last: the newest checkpoint of the newest version of this run (None: not our layout)."""
    found = run_dir_of(config)
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


def resolve_auto(config) -> tuple[Path | None, int | None, str]:
    """--ckpt_path auto: (checkpoint, version, what happens in words). Under SLURM "this run" is the version
    directory this job (or array task) trains in (its slurm_job file): a requeued job resumes it, another job
    never does; elsewhere (a pod restarted, a script run again) it is the newest version with a checkpoint.
    No checkpoint: (None, the job's version or None for a new one, the reason)."""
    found = run_dir_of(config)
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


def free_name(directory: Path, stem: str) -> str:
    """stem.yaml, else stem-2.yaml, stem-3.yaml, ...: the first that does not exist in `directory`."""
    n = 1
    while (directory / (name := f"{stem}.yaml" if n == 1 else f"{stem}-{n}.yaml")).exists():
        n += 1
    return name


def check_accelerator(accelerator) -> None:
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
