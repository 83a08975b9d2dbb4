"""Read a `fit` config (YAML files + dotted overrides) into the numbers the ledger needs.

Nothing is built: no model, data or trainer. So `account` and `plan max-batch` can size a
3B-parameter config on a laptop.

The arguments go through `lmledger fit`'s own LightningCLI parser. Configs, overrides and error
messages are exactly a real run's.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from lmledger.ledger.run import Run, sharding
from lmledger.model import ModelConfig
from lmledger.precision import predicted_device, requested_precision

__all__ = ["config_strategy", "config_world_size", "load_run", "run_from_config"]


def config_world_size(devices, num_nodes) -> int:
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        per_node = int(devices)
    else:
        per_node = 1  # "auto" / -1: one device as far as this machine-independent ledger is concerned
    return per_node * (num_nodes or 1)


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


def load_run(argv: list[str]) -> Run:
    """Parse `--config FILE [--config FILE2] [--a.b value ...]` as `lmledger fit` would."""
    from lmledger.fitting.cli import parse_fit_config  # imports Lightning

    return run_from_config(parse_fit_config(argv))


def run_from_config(config) -> Run:
    """The Run of a parsed `fit` config (a jsonargparse Namespace, as parse_fit_config returns)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    model_args = {k: v for k, v in vars(config.model.config).items() if k in model_fields}
    meta = Path(config.data.path) / "meta.json"
    vocab_from_data = meta.is_file()
    if vocab_from_data:
        from lmledger.data import load_meta

        model_args["vocab_size"] = load_meta(config.data.path)["vocab_size"]
    trainer = config.trainer
    precision, weights_dtype = requested_precision(trainer)
    return Run(
        config=ModelConfig(**model_args),
        batch_size=config.data.batch_size,
        seq_len=config.model.config.context_length,
        precision=precision,
        weights_dtype=weights_dtype,
        optimizer=config.model.optimizer,
        strategy=config_strategy(trainer.strategy),
        world_size=config_world_size(trainer.devices, trainer.num_nodes),
        device=predicted_device(trainer.accelerator),
        fp8=config.model.get("fp8"),
        compiled=bool(config.model.get("compile")),
        accelerator=str(trainer.accelerator),
        data_path=config.data.path,
        vocab_from_data=vocab_from_data,
    )
