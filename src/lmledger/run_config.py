"""Read a `fit` config (YAML files + dotted overrides) into the numbers the ledger needs.

Nothing is built: no model, data or trainer. So `account` and `plan max-batch` can size a
3B-parameter config on a laptop.

The arguments go through `lmledger fit`'s own LightningCLI parser. Configs, overrides and error
messages are exactly a real run's.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

# The trainer's devices, nodes and strategy are read as fit's checks read them, in one place this module shares.
from lmledger.fitting.trainerscale import (
    MAX_WORLD_SIZE,
    TrainerScale,
    config_strategy,
    refuse_tensor_parallel,
    resolve_strategy,
)
from lmledger.ledger.run import Run
from lmledger.model import ModelConfig
from lmledger.precision import predicted_device, requested_precision

__all__ = [
    "MAX_WORLD_SIZE",
    "TrainerScale",
    "config_strategy",
    "load_run",
    "refuse_tensor_parallel",
    "resolve_strategy",
    "run_from_config",
]


def load_run(argv: list[str]) -> Run:
    """Parse `--config FILE [--config FILE2] [--a.b value ...]` as `lmledger fit` would."""
    from lmledger.fitting.cli import parse_fit_config  # imports Lightning

    return run_from_config(parse_fit_config(argv))


def run_from_config(config, scale: TrainerScale | None = None) -> Run:
    """The Run of a parsed `fit` config (a jsonargparse Namespace, as parse_fit_config returns).

    `scale`: the config's check_fit_values, where the caller has it already (else it is made here)."""
    from lmledger.data import check_data_values  # TokenDataModule's own check, as fit builds it
    from lmledger.fitting.checks import check_fit_values  # imports Lightning

    scale = scale or check_fit_values(config)  # fit's own checks of the config's values, in its words, in its order
    data = config.data
    check_data_values(data.batch_size, data.context_length, data.num_workers, data.seed, data.val_batches)
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
        strategy=scale.strategy,
        world_size=scale.world_size,
        tensor_parallel=scale.tensor_parallel,
        sequence_parallel=scale.tensor_parallel > 1 and bool(config.model.get("sequence_parallel")),
        device=predicted_device(trainer.accelerator),
        fp8=config.model.get("fp8"),
        compiled=bool(config.model.get("compile")),
        accelerator=str(trainer.accelerator),
        data_path=config.data.path,
        vocab_from_data=vocab_from_data,
    )
