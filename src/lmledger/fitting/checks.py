"""What `lmledger fit|validate` refuses before a run starts: config files, class paths, trainer values.

What a checkpoint may resume (--ckpt_path) is fitting.resume's; the devices, nodes and strategy a trainer asks
for are fitting.trainerscale's (resolve_strategy, which check_trainer_values calls). check_fit_values is the one
check of a parsed config's values that fit and planning (account, plan, sweeps) share.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import io
import logging
import math
import re
import sys
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator

from lmledger.callbacks.settings import LedgerSettings
from lmledger.errors import ConfigError, UserError
from lmledger.fitting.trainerscale import TrainerScale, resolve_strategy
from lmledger.ledger.predict import configured_optimizer, steps_by_hand

__all__ = [
    "SUBCOMMANDS",
    "DropAdverts",
    "build_failure",
    "check_accelerator",
    "check_class_paths",
    "check_config_files",
    "check_fit_values",
    "check_trainer_values",
    "check_trains_something",
    "config_files",
    "named_classes",
    "parse_error_line",
    "read_config",
    "refuse_empty_train_loader",
    "refuse_automatic_features_by_hand",
    "refuse_several_optimizers",
]

SUBCOMMANDS = ("fit", "validate")


class DropAdverts(logging.Filter):
    """Drop Lightning's "💡 Tip" for a cloud logger, on every run (canary test_lightning_advertises_a_cloud_logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def build_failure(err: BaseException) -> UserError | None:
    """One line for an exception a class's own __init__ raised while jsonargparse built it; or None.

    Builds are `--model X`, `--data.init_args.*`, a callback. A failed one is a ValueError from
    jsonargparse. It lists every Union subtype it tried. It is raised `from` the original exception
    (canary test_jsonargparse_chains_a_failed_build). The deepest cause is the class's own error.
    The innermost traceback frame holding `class_type` names the class. (Those frames are
    jsonargparse's and Lightning's instantiators.) The kit's UserError comes through as it is.
    Anything else becomes `building pkg.Class failed (Type: ...)`.
    """
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
    """(where, class path) per model or data class named by the command line or its --config files.

    Forms: `--model X`, `--data=X`, `--model.class_path X`. In a file: `model: {class_path: X}` or `model: X`.
    """
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
    """importlib.import_module, naming as the cause a module that exits while being imported.

    An example is argparse's parse_args() at module level, run on lmledger's command line. Its usage
    and `lmledger: error:` lines would otherwise read as lmledger's own. What the import prints is held
    back, and shown if it succeeds.
    """
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
    """The nearest directory at or above a config file holding a class path's top-level package.

    Only for class paths named in a config file. The configs/examples/*.yaml name `examples.*`. That
    lives at the repository root.
    """
    if not where.startswith("config "):
        return None
    top = module_name.split(".")[0]
    config = Path(where.removeprefix("config ").split(": ")[0]).resolve()
    for directory in config.parents:
        if (directory / top / "__init__.py").exists() or (directory / f"{top}.py").exists():
            return directory
    return None


def check_class_paths(named: list[tuple[str, str]]) -> None:
    """Each dotted class path imports and names a LightningModule (--model) or LightningDataModule (--data).

    The report jsonargparse gives of either runs to several lines about every type it tried.
    """
    keys = ["data" if where.startswith("--data") or where.split(": ")[-1].startswith("data") else "model"
            for where, _ in named]  # fmt: skip
    if "model" not in keys:
        raise UserError(f"{named[0][0]} names a data module but no model: add --model CLASS_PATH (a LightningModule)")
    for (where, value), key in zip(named, keys, strict=True):
        base = _BASES[key]
        if not isinstance(value, str) or "." not in value:
            # Nothing of the user's is imported here. A bare name could only resolve to Lightning's own.
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
    """Refuse sections of a --config file that are not mappings.

    Version 4 of jsonargparse resets `data: [1, 2]` to the class defaults without a word. `model: {config: 5}`
    ends in a message about a missing context_length.
    """
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


def check_fit_values(config) -> TrainerScale:
    """The values of a parsed fit config that fit refuses, refused in one line: its trainer's and the ledger's.

    `fit` and every planner (account, plan max-batch and train-time, sweeps) call it, so planning refuses what
    fit refuses, in its words. What the machine can run (a GPU, a precision's kernels) is not checked here:
    planning answers for other machines. Returns the devices, nodes and strategy the trainer asks for.
    """
    ledger = config.get("ledger")
    if ledger is not None:  # the Ledger's own checks: the links, the device memory cap
        LedgerSettings(**(ledger.as_dict() if hasattr(ledger, "as_dict") else dict(ledger)))
    return check_trainer_values(config.trainer, config.model)


def check_trainer_values(trainer, model=None) -> TrainerScale:
    """Refuse values Lightning accepts and then misuses (canary test_trainer_accepts_values_that_train_wrongly).

    Negative clipping ascends the gradient. Zero accumulation trains nothing. A clipping algorithm other than norm or
    value is refused by Lightning only when fit builds its Trainer, which planning never does. Devices, nodes and the
    strategy are resolve_strategy's, the one reading that account and plan share with fit.
    `model` is the config's model section (FSDP2 needs its configure_model; TP must split its heads).
    """
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise ConfigError(f"--trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
    algorithm = trainer.get("gradient_clip_algorithm")  # Lightning refuses another only as its Trainer is built
    if algorithm is not None and str(algorithm).lower() not in ("norm", "value"):
        raise ConfigError(f"--trainer.gradient_clip_algorithm must be norm or value (null: norm), got {algorithm!r}")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ConfigError(f"--trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate}")
    if trainer.get("barebones") and (clashes := _barebones_clashes(trainer)):
        raise ConfigError(f"--trainer.barebones true turns off logging, checkpoints and the other features that slow "
                          f"a step, and this config asks for some: {'; '.join(clashes)}")  # fmt: skip
    return resolve_strategy(trainer, model)


def _barebones_clashes(trainer) -> list[str]:
    """What Trainer(barebones=True) refuses as it is built (Lightning 2.6), each with the flag that turns it off.
    Left to Lightning: one a try, the logger by its object's repr, and a config's ModelCheckpoint as an
    `enable_checkpointing=False` the user never set."""
    clashes = []
    if trainer.get("logger") not in (None, False, []):
        clashes.append("a logger (--trainer.logger false)")
    for flag in ("log_every_n_steps", "num_sanity_val_steps"):
        if trainer.get(flag):
            clashes.append(f"--trainer.{flag} {trainer.get(flag)} (set it to 0)")
    for flag in ("enable_checkpointing", "enable_progress_bar", "enable_model_summary", "detect_anomaly",
                 "fast_dev_run"):  # fmt: skip
        if trainer.get(flag):
            clashes.append(f"--trainer.{flag} {str(trainer.get(flag)).lower()} (set it to false)")
    if trainer.get("profiler") is not None:
        clashes.append("--trainer.profiler (set it to null)")
    callbacks = trainer.get("callbacks") or []
    names = [str(c.get("class_path", "")) for c in (callbacks if isinstance(callbacks, list) else [callbacks])
             if hasattr(c, "get")]  # fmt: skip
    if any(name.rsplit(".", 1)[-1] == "ModelCheckpoint" for name in names):
        clashes.append("a ModelCheckpoint in --trainer.callbacks (drop it: --trainer.callbacks '[]' drops them all)")
    return clashes


def refuse_several_optimizers(model: pl.LightningModule, trainer: Trainer) -> None:
    """Refuse several optimizers under automatic optimization, before Lightning does.

    Lightning refuses them with a RuntimeError traceback once the strategy sets up. By then the run
    directory is claimed. So configure_optimizers is asked here first. The trainer is attached, for a
    method that reads it. A method needing more than the trainer's settings is left to Lightning.
    One reading estimated_stepping_batches is such a method.
    """
    if not model.automatic_optimization:
        return
    model.trainer = trainer
    try:
        configured_optimizer(model)
    except UserError:  # SeveralOptimizers, or an optimizer over no parameters: said before Lightning's traceback
        raise
    except Exception:
        return  # Lightning reports its own way when it calls the method
    finally:
        model.trainer = None


def refuse_automatic_features_by_hand(model: pl.LightningModule, trainer) -> None:
    """Refuse Lightning's accumulation and clipping for a module that steps its optimizers itself: Lightning refuses
    both under manual optimization as the fit starts, and a planner that took them would plan a step no fit runs.
    `trainer` is a built Trainer or the config's trainer section."""
    if not steps_by_hand(model):
        return
    get = trainer.get if hasattr(trainer, "get") else lambda key: getattr(trainer, key, None)
    name = type(model).__name__
    accumulate, clip = get("accumulate_grad_batches"), get("gradient_clip_val")
    if accumulate not in (None, 1):
        raise UserError(
            f"--trainer.accumulate_grad_batches {accumulate}: {name} steps its optimizers itself "
            "(automatic_optimization = False), and Lightning accumulates only for automatic optimization: "
            "accumulate in its training_step"
        )
    if clip not in (None, 0, 0.0):
        raise UserError(
            f"--trainer.gradient_clip_val {clip}: {name} steps its optimizers itself (automatic_optimization = "
            "False), and Lightning clips only for automatic optimization: call self.clip_gradients in its "
            "training_step"
        )


def refuse_empty_train_loader(datamodule) -> None:
    """Make the data module's train_dataloader refuse a loader of no batches.

    The refusal comes when Lightning asks for the loader. Lightning says "No training batches",
    trains nothing and exits 0. The loader exists only once the module is prepared and set up,
    inside Trainer.fit. So the check rides on the call. The run directory claimed by then is undone
    for a refusal (RunClaim).
    """
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
    """Refuse max_steps 0, or max_epochs 0 with no step limit.

    Lightning stops at once ("`max_steps=0` reached"). It exits 0 with a run directory of nothing.
    """
    max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if max_steps == 0 or (max_epochs == 0 and max_steps in (None, -1)):
        flag = "max_steps" if max_steps == 0 else "max_epochs"
        raise ConfigError(
            f"--trainer.{flag} 0 trains nothing; pass a count >= 1 (or -1 for no limit), or use "
            "`lmledger validate` / `lmledger account` to evaluate or measure without training"
        )


def check_accelerator(accelerator) -> None:
    """Refuse a missing GPU. Lightning says "No supported gpu backend found!", with a traceback."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if accelerator == "gpu" and MPSAccelerator.is_available():
        return
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    raise UserError(
        f"--trainer.accelerator {accelerator}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
        f"{build}); use --trainer.accelerator cpu"
    )


# jsonargparse's report of a value no type of an Optional/Union accepted, e.g. `--ledger.device_memory_gb abc`.
_UNION_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)": Does not validate against any of the Union subtypes Subtypes: '
    r"\[(?P<types>.*?)\] Errors:.*Given value:\s?(?P<value>.*)$"
)
# ... and of a value its one type refuses, e.g. `--trainer.max_steps abc`.
_TYPE_ERROR = re.compile(r'^Parser key "(?P<key>[^"]+)": Expected a (?P<type>.+?)\. Got value: (?P<value>.*)$')
# ... and of an argument of a class given as `--key.name value` (a NestedArg), e.g. a strategy's init argument.
_NESTED = re.compile(
    r"""^Parser key "(?P<key>[^"]+)":.* Given value: NestedArg\(key='(?P<name>[^']*)', val=(?P<value>.*)\)$"""
)
_CLASS_REFUSED = re.compile(r"Problem with given class_path '(?P<cls>[^']+)': (?P<why>.*?) Given value")
_A_NAME = re.compile(r"Expected a dot import path string: (?P<name>\S+)")


def parse_error_line(err: BaseException) -> str:
    """A parse error in one line. A value no type of a Union accepts reads `--key value: expected ...`; a class's
    argument given as `--key.name value` names that flag, its value and what it takes (_nested_line)."""
    line = " ".join(part.strip() for part in str(err).strip().splitlines())
    if found := _NESTED.search(line):
        return _nested_line(line, found["key"], found["name"], _unquoted(found["value"]))
    if found := _UNION_ERROR.search(line) or _TYPE_ERROR.search(line):
        wanted = _wanted(found["types"] if "types" in found.re.groupindex else found["type"])
        return f"--{found['key']} {_unquoted(found['value'])}: expected {wanted}"
    return line


def _unquoted(value: str) -> str:
    value = value[1:-1] if len(value) >= 2 and value[0] == value[-1] == "'" else value
    return value if value.strip() else repr(value)


def _wanted(types: str) -> str:
    """ "<class 'int'>, <class 'NoneType'>, typing.Literal['auto']" as "an int, 'auto' or null": each type once,
    and a Literal's values once each however many Literals list them (precision's 64 and '64')."""
    names = [t.strip().removeprefix("<class '").removesuffix("'>") for t in re.split(r",\s*(?![^\[]*\])", types)]
    words = []
    for name in names:
        if literal := re.fullmatch(r"typing\.Literal\[(.*)\]", name):
            values = [v.strip() for v in literal[1].split(",")]
        else:
            values = ["null" if name == "NoneType" else f"a{'n' * (name[:1] in 'aeiou')} {name}"]
        words += [v for v in values if v not in words and v.strip("'") not in words]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _nested_line(line: str, key: str, name: str, value: str) -> str:
    """`--key.name value` refused, in one line: the class it was given to takes no such argument, or not that
    value; or `--key` is a registered name (ddp, fsdp2) or auto, which takes no arguments: name the class."""
    flag = f"--{key}.{name} {value}"
    tensor_parallel = (
        f"tensor parallelism is lmledger.strategies.FSDP2Strategy's: --{key} lmledger.strategies.FSDP2Strategy "
        f"--{key}.{name} N"
    )
    if refused := _CLASS_REFUSED.search(line):
        cls, why = refused["cls"], refused["why"]
        short = cls.rsplit(".", 1)[-1]
        if _is_base_type(cls, line):  # `--optimizer.lr 0.1` with no `--optimizer CLASS`: the base type was tried
            return f"{flag}: --{key} names no class to take {name}: name one first (--{key} CLASS_PATH --{flag[2:]})"
        if "is not accepted" in why:
            close = difflib.get_close_matches(name, _init_arguments(cls), n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; {tensor_parallel}" if name in _MESH_SIZES else ""
            return f"{flag}: {short} takes no {name}{hint}"
        types = re.search(r"Subtypes: \[(.*?)\] Errors", why) or re.search(r"Expected a (<class '[^']+'>)", why)
        wanted = _wanted(types[1]) if types else " ".join(why.split())
        return f"{flag}: expected {wanted} ({short}'s {name})"
    given = (_A_NAME.search(line) or {"name": "auto"})["name"]
    registered = _registered_class(given)
    if registered is None:
        fix = tensor_parallel if name in _MESH_SIZES else f"--{key} CLASS_PATH --{key}.{name} {value}"
        return f"{flag}: --{key} {given} takes no arguments: name a class to set them ({fix})"
    path = f"{registered.__module__}.{registered.__qualname__}"
    if name in _MESH_SIZES and name not in _init_arguments(path):
        return f"{flag}: --{key} {given} is {registered.__name__}, which takes no {name}; {tensor_parallel}"
    # (A class's **kwargs may take more than its signature names: DDPStrategy's reach torch's DDP.)
    return f"{flag}: --{key} {given} is a name, which takes no arguments: name its class, --{key} {path} --{flag[2:]}"


_MESH_SIZES = ("tensor_parallel_size", "data_parallel_size")


def _registered_class(name: str) -> type | None:
    """The class a registered strategy name stands for (ddp: DDPStrategy); None for auto or an unknown name."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lmledger.strategies import register

    register()
    return StrategyRegistry[name.lower()]["strategy"] if name.lower() in StrategyRegistry else None


def _class(class_path: str) -> type | None:
    module, _, attr = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def _is_base_type(class_path: str, line: str) -> bool:
    """Whether the refused class is the flag's own declared type (its Union's subtypes), not a class the user named."""
    cls = _class(class_path)
    subtypes = re.search(r"Subtypes: \[(.*?)\] Errors", line)
    return (
        cls is not None
        and subtypes is not None
        and any(_class(name) is cls for name in re.findall(r"<class '([^']+)'>", subtypes[1]))
    )


def _init_arguments(class_path: str) -> list[str]:
    cls = _class(class_path)
    if cls is None:
        return []
    names = []
    for klass in cls.__mro__:  # a subclass's **kwargs pass on to its parents' arguments
        init = klass.__dict__.get("__init__")
        if init is not None:
            names += [p for p in inspect.signature(init).parameters if p not in ("self", "args", "kwargs")]
    return list(dict.fromkeys(names))
