"""The devices, nodes and strategy a fit config's trainer asks for, read once for fit, account, plan and sweeps.

resolve_strategy reads them into a TrainerScale, or refuses in one ConfigError line what fit would fail on
(an unknown accelerator, FSDP without a GPU, a world over MAX_WORLD_SIZE, tensor parallelism the ledger does not
model, a strategy class's bad init_args). fitting.checks.check_trainer_values calls it before anything is built.
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
from dataclasses import dataclass, field

from lmledger.errors import ConfigError
from lmledger.ledger.run import sharding

__all__ = ["MAX_WORLD_SIZE", "TrainerScale", "config_strategy", "refuse_tensor_parallel", "resolve_strategy"]


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
    # ModelParallelStrategy's tensor_parallel_size (ledger.sharding.tp); data parallel is the rest
    tensor_parallel: int = 1
    auto_gpus: bool = False  # devices `auto` on a GPU: every GPU of the machine it runs on (`devices` plans 1)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def devices_here(self) -> int:
        """The ranks a node runs on this machine, as Lightning counts them: `auto` on a GPU is every GPU here."""
        if self.auto_gpus:
            import torch

            return max(1, torch.cuda.device_count())
        return self.devices


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
    auto_gpus = accelerator == "gpu" and str(get("devices", "auto")).strip().lower() == "auto"
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
        return TrainerScale(devices, num_nodes, _registered_strategy(strategy, model), auto_gpus=auto_gpus)
    class_path = str(getattr(strategy, "class_path", "") or "")
    init = getattr(strategy, "init_args", None)
    init = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
    cls = _import_class(class_path)
    _refuse_fsdp_without_gpu(strategy, cls, get("accelerator", "auto"))
    tensor = _check_strategy_init(class_path, cls, init, devices, world, model)
    return TrainerScale(devices, num_nodes, config_strategy(strategy), init, tensor, auto_gpus)


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
        if tensor_size > 1 and _model_class(model) is _litlm():  # fit's configure_model splits the toy LM's heads
            from lmledger.ledger.sharding.tp import check_toy_plan

            check_toy_plan(model.config, tensor_size, bool(model.get("sequence_parallel")))
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
    return _litlm() if class_path is None else _import_class(str(class_path))


def _litlm() -> type:
    from lmledger.lit import LitLM

    return LitLM


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
