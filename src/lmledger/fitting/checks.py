"""What `lmledger fit|validate` refuses before a run starts: config files, class paths, trainer values.

What a checkpoint may resume (--ckpt_path) is fitting.resume's.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import io
import logging
import math
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.predict import configured_optimizer
from lmledger.ledger.run import sharding

__all__ = [
    "MAX_WORLD_SIZE",
    "SUBCOMMANDS",
    "DropAdverts",
    "TrainerScale",
    "build_failure",
    "check_accelerator",
    "check_class_paths",
    "check_config_files",
    "check_trainer_values",
    "check_trains_something",
    "config_files",
    "config_strategy",
    "named_classes",
    "read_config",
    "refuse_empty_train_loader",
    "refuse_several_optimizers",
    "refuse_tensor_parallel",
    "resolve_strategy",
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


def check_trainer_values(trainer, model=None) -> None:
    """Refuse values Lightning accepts and then misuses (canary test_trainer_accepts_values_that_train_wrongly).

    Negative clipping ascends the gradient. Zero accumulation trains nothing. Devices, nodes and the
    strategy are resolve_strategy's, the one reading that account and plan share with fit.
    `model` is the config's model section (FSDP2 needs its configure_model).
    """
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise ConfigError(f"--trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ConfigError(f"--trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate}")
    resolve_strategy(trainer, model)


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


# The largest world size a config may ask for: 2**20 ranks. No one job has that many accelerators: the
# largest reported training clusters hold about 200,000 GPUs (xAI's Colossus, 2025), Llama 3 405B trained
# on 16,384 H100s (Meta, "The Llama 3 Herd of Models", 2024). Planning builds torch's fake process group of
# W ranks, whose rank tables cost about 150 bytes a rank (160 MB at 2**20, measured 2026-12-01 on a shared
# 2-core CPU); 10**9 ranks would take 150 GB (issue 28: OOM-killed at 23 GB).
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class TrainerScale:
    """What a fit config's trainer asks for, read as `lmledger fit` reads it (resolve_strategy)."""

    devices: int  # ranks per node
    num_nodes: int
    strategy: str  # the ledger.run.sharding name
    init_args: dict = field(default_factory=dict)  # the strategy's init_args (class_path form), else {}
    tensor_parallel: int = 1  # ModelParallelStrategy's tensor_parallel_size (ledger.tp); data parallel is the rest

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_strategy(trainer, model=None) -> TrainerScale:
    """The devices, nodes and strategy of a parsed fit config's trainer, or a ConfigError in one line.

    One function for every reader: `fit` refuses with it before anything is built
    (fitting.checks.check_trainer_values), and `account`, `plan max-batch` and `sweep --dry-run` plan
    with it. So planning answers exactly what fit would run, and refuses the rest in fit's words.
    `trainer` is the config's trainer section; `model` its model section (or a class), for the
    strategies that need a method of the module (FSDP2's configure_model).
    """
    get = trainer.get if hasattr(trainer, "get") else lambda key, default=None: getattr(trainer, key, default)
    _refuse_unknown_accelerator(get("accelerator", "auto"))
    accelerator = _accelerator_kind(get("accelerator", "auto"))
    devices = _devices_per_node(get("devices", "auto"), accelerator)
    num_nodes = get("num_nodes", 1)
    num_nodes = 1 if num_nodes is None else num_nodes
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"--trainer.num_nodes must be a whole number of nodes >= 1, got {num_nodes!r}")
    world = devices * num_nodes
    if world > MAX_WORLD_SIZE:
        raise ConfigError(
            f"--trainer.devices {devices:,} x --trainer.num_nodes {num_nodes:,} is a world size of {world:,} ranks, "
            f"beyond any cluster: at most {MAX_WORLD_SIZE:,} (2**20; the largest clusters hold about 200,000 GPUs)"
        )
    strategy = get("strategy", "auto")
    strategy = "auto" if strategy is None else strategy
    if isinstance(strategy, str):
        _refuse_fsdp_without_gpu(strategy, None, get("accelerator", "auto"))
        return TrainerScale(devices, num_nodes, _registered_strategy(strategy, model))
    class_path = str(getattr(strategy, "class_path", "") or "")
    init = getattr(strategy, "init_args", None)
    init = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
    cls = _import_class(class_path)
    _refuse_fsdp_without_gpu(strategy, cls, get("accelerator", "auto"))
    tensor = _check_strategy_init(class_path, cls, init, devices, world, model)
    return TrainerScale(devices, num_nodes, config_strategy(strategy), init, tensor)


def _refuse_unknown_accelerator(accelerator) -> None:
    """An accelerator name Lightning's registry lacks (its Trainer refuses it; planning would read it as a CPU)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if not isinstance(accelerator, str):
        return  # an Accelerator class_path: jsonargparse resolved it
    names = ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())]
    if accelerator.lower() not in names:
        close = difflib.get_close_matches(accelerator.lower(), names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"--trainer.accelerator {accelerator!r} is not an accelerator Lightning knows{hint}: use {', '.join(names)}"
        )


def _accelerator_kind(accelerator) -> str:
    """The accelerator as Lightning resolves it here: cpu, gpu or other (auto: gpu where CUDA is, else cpu)."""
    import torch

    name = str(accelerator if accelerator is not None else "auto").lower()
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "mps": "gpu"}.get(name, "other")


def _refuse_fsdp_without_gpu(strategy, cls, accelerator) -> None:
    """Lightning's FSDP (FSDP1) runs on CUDA only: its accelerator connector refuses anything else, in these words."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    name = str(accelerator if accelerator is not None else "auto").lower()
    if name in ("cuda", "gpu") or (name == "auto" and torch.cuda.is_available()):
        return
    named = isinstance(strategy, str) and strategy.lower() in FSDPStrategy.get_registered_strategies()
    if named or cls is FSDPStrategy:
        raise ConfigError(
            f"The strategy `fsdp` requires a GPU accelerator, but received `accelerator={name}`: set "
            "--trainer.accelerator gpu, or shard on a CPU with --trainer.strategy fsdp2"
        )


def _devices_per_node(devices, accelerator: str) -> int:
    """trainer.devices as a count per node, by Lightning's rules for the accelerator (its connector's parsing).

    A count >= 1, or auto (one device: the count planning can know without the machine; a CPU's auto is
    1). With a GPU accelerator also a list of indices ([0, 1], or "0,1") and -1, every GPU here."""
    wanted = (
        "--trainer.devices must be a count >= 1, a list of GPU indices ([0, 1] or 0,1), -1 (every GPU) or auto, "
        f"got {devices!r}"
    )
    value = devices.strip() if isinstance(devices, str) else devices
    if isinstance(value, str) and value.lower() == "auto":
        return 1
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value):
        value = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\d+(\s*,\s*\d+)*\s*,?", value):
        value = [int(i) for i in value.split(",") if i.strip()]  # Lightning's "0,1": GPU indices
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise ConfigError(wanted)
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, int) and value != -1:
        raise ConfigError(wanted)
    if accelerator == "cpu":
        raise ConfigError(
            f"--trainer.devices {devices!r} with accelerator cpu: a CPU run takes a count of processes >= 1 or auto "
            "(GPU indices and -1, every GPU, need --trainer.accelerator gpu)"
        )
    if isinstance(value, int):  # -1: every GPU of this machine
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(
                "--trainer.devices -1 means every GPU of this machine, which has none: pass --trainer.devices N"
            )
        return count
    indices = [i for i in value if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    if not value or len(indices) < len(value) or len(set(indices)) < len(indices):
        raise ConfigError(f"--trainer.devices {devices!r}: a list of GPU indices names each GPU once, each >= 0")
    return len(value)


def _registered_strategy(name: str, model) -> str:
    """The ledger.run.sharding name of a strategy named by Lightning's registry, which fit's Trainer looks up."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lmledger.strategies import FSDP2, register

    register()  # "fsdp2", as the fit CLI registers it
    key = name.lower()
    if "pipe" in key:
        raise ConfigError(
            f"--trainer.strategy {name!r}: pipeline parallelism is not supported (Lightning has no pipeline-parallel "
            "strategy); use --trainer.strategy fsdp2, with tensor_parallel_size for tensor parallelism"
        )
    if key != "auto" and key not in StrategyRegistry:
        names = ["auto", *StrategyRegistry.available_strategies()]
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if "." in name or key.endswith("strategy"):
            hint += f"; a class is named with --trainer.strategy.class_path {name}"
        raise ConfigError(
            f"--trainer.strategy {name!r} is not a strategy Lightning knows{hint}: use a registered name (auto, ddp, "
            "fsdp, fsdp2, deepspeed_stage_2, ...: lightning.pytorch.strategies.StrategyRegistry) or a class_path"
        )
    if key == FSDP2:
        _refuse_without_configure_model(name, model)
    return config_strategy(name)


def _import_class(class_path: str) -> type | None:
    module, _, attr = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None  # jsonargparse resolved it, so this does not happen for a parsed config


def _check_strategy_init(class_path: str, cls, init: dict, devices: int, world: int, model) -> int:
    """Refuse init_args the strategy would take and then fail on, or run as something the ledger cannot follow.

    Returns the tensor-parallel size (1 for any strategy but a ModelParallelStrategy)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    name = class_path.rsplit(".", 1)[-1]
    if isinstance(cls, type) and issubclass(cls, DDPStrategy):
        cap = init.get("bucket_cap_mb")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ConfigError(
                f"--trainer.strategy.bucket_cap_mb must be a positive number of MiB (null: torch's 25 MiB), got {cap}"
            )
    if isinstance(cls, type) and issubclass(cls, ModelParallelStrategy):
        from lmledger.strategies import FSDP2Strategy

        tensor = init.get("tensor_parallel_size", 1 if issubclass(cls, FSDP2Strategy) else "auto")
        data = init.get("data_parallel_size", "auto")
        for key, size in (("tensor_parallel_size", tensor), ("data_parallel_size", data)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ConfigError(f"--trainer.strategy.{key} must be a whole number >= 1 or auto, got {size!r}")
        # Lightning's ModelParallelStrategy: auto is every device of a node (tensor) and the node count (data).
        tensor_size = devices if tensor == "auto" else tensor
        refuse_tensor_parallel(name, tensor, tensor_size, devices)
        if data != "auto" and data * tensor_size != world:
            raise ConfigError(
                f"--trainer.strategy.data_parallel_size {data} x tensor_parallel_size {tensor_size} must equal the "
                f"world size {world} (devices x num_nodes): set data_parallel_size {world // tensor_size} or auto"
            )
        _refuse_without_configure_model(name, model)
        return tensor_size
    return 1


def refuse_tensor_parallel(strategy: str, asked, size: int, devices: int) -> None:
    """Refuse a tensor_parallel_size that does not divide a node's devices (issue 30).

    Lightning's mesh puts the TP ranks innermost, so dividing the devices keeps each TP group inside one
    node: the ledger prices TP's collectives at intra-node bandwidth. Sizes that do are accepted.
    """
    if size <= 1 or devices % size == 0:
        return
    shown = f"auto ({size})" if asked == "auto" else str(size)
    raise ConfigError(
        f"--trainer.strategy {strategy} with tensor_parallel_size {shown} does not divide --trainer.devices {devices} "
        "(each tensor-parallel group must fit in one node): choose a tensor_parallel_size that divides the devices"
    )


def _refuse_without_configure_model(strategy: str, model) -> None:
    """FSDP2 shards a module in its configure_model. Lightning's ModelParallelStrategy raises a TypeError without."""
    cls = _model_class(model)
    if cls is None:
        return
    from lightning.pytorch import LightningModule

    if getattr(cls, "configure_model", None) is LightningModule.configure_model:
        raise ConfigError(
            f"--trainer.strategy {strategy}: {cls.__name__} has no configure_model(), where FSDP2 shards the module "
            "(Lightning's ModelParallelStrategy needs one): add a configure_model that calls "
            "torch.distributed.fsdp.fully_shard on its blocks, or use --trainer.strategy ddp"
        )


def _model_class(model) -> type | None:
    """The LightningModule class of a config's model section (a class_path), LitLM's for a ToyLM config."""
    if model is None or isinstance(model, type):
        return model
    class_path = model.get("class_path") if hasattr(model, "get") else None
    if class_path is None:
        from lmledger.lit import LitLM

        return LitLM
    return _import_class(str(class_path))


def config_strategy(strategy) -> str:
    """The ledger.run.sharding name of a config's trainer.strategy.

    The strategy is a registry name ("fsdp", "deepspeed_stage_2"), or a class_path with init_args
    (FSDP's sharding_strategy, DeepSpeed's stage)."""
    if isinstance(strategy, str):
        return sharding(strategy)
    name = getattr(strategy, "class_path", "") or ""
    init = getattr(strategy, "init_args", None)
    init = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
    stage = init.get("stage", None)
    return sharding(
        name,
        fsdp_sharding=init.get("sharding_strategy"),
        deepspeed_stage=int(stage) if isinstance(stage, int) and not isinstance(stage, bool) else None,
    )
