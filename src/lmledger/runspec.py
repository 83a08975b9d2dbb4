"""Read a `fit` config (YAML files + dotted overrides) into the numbers the ledger needs, without
building the model, the data or the trainer — so `account` and `plan max-batch` can size a 3B-parameter
config on a laptop.

The same LightningCLI parser as `lmledger fit` reads the arguments, so configs, overrides and error
messages are exactly those of a real run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from lmledger.ledger.memory import normalize_precision
from lmledger.model import ModelConfig
from lmledger.precision import requested_precision

SHARDING_STRATEGIES = {
    "fsdp": "fsdp",
    # DeepSpeed keeps its own rows in ledger.memory (16-bit model, fp32 master in the optimizer)
    "deepspeed_stage_1": "deepspeed_stage_1",
    "deepspeed_stage_2": "deepspeed_stage_2",
    "deepspeed_stage_3": "deepspeed_stage_3",
}


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    batch_size: int  # per device
    seq_len: int
    precision: str
    weights_dtype: torch.dtype | None  # a Transformer Engine plugin's weights dtype (else None)
    optimizer: str
    strategy: str  # a ledger.memory strategy name: ddp, fsdp, deepspeed_stage_1/2/3
    world_size: int
    accelerator: str
    data_path: str
    vocab_from_data: bool

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def fused_optimizer(self) -> bool:
        """LitLM's choice (lmledger.lit): fused optimizer kernels, except under fp16's GradScaler."""
        return normalize_precision(self.precision) != "16-mixed"


def _world_size(devices, num_nodes) -> int:
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        per_node = int(devices)
    else:
        per_node = 1  # "auto" / -1: one device as far as this machine-independent ledger is concerned
    return per_node * (num_nodes or 1)


def _strategy_name(strategy) -> str:
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "") or ""
    name = name.rsplit(".", 1)[-1].lower()
    if name.endswith("strategy"):
        name = name[: -len("strategy")]
    return SHARDING_STRATEGIES.get(name, "ddp")


def _drop_seed_line(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Seed set to")


def load_run_spec(argv: list[str]) -> RunSpec:
    """Parse `--config FILE [--config FILE2] [--a.b value ...]` as `lmledger fit` would."""
    from lmledger.commands.train import parse_fit_config  # imports Lightning

    # Parsing runs LightningCLI's seed_everything, whose "Seed set to N" line means nothing here: no run.
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    seed_log.addFilter(_drop_seed_line)
    try:
        config = parse_fit_config(argv)
    finally:
        seed_log.removeFilter(_drop_seed_line)
    return run_spec_from_config(config)


def run_spec_from_config(config) -> RunSpec:
    """The RunSpec of a parsed `fit` config (a jsonargparse Namespace, as parse_fit_config returns)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    model_args = {k: v for k, v in vars(config.model.config).items() if k in model_fields}
    meta = Path(config.data.path) / "meta.json"
    vocab_from_data = meta.is_file()
    if vocab_from_data:
        from lmledger.data import load_meta

        model_args["vocab_size"] = load_meta(config.data.path)["vocab_size"]
    trainer = config.trainer
    precision, weights_dtype = requested_precision(trainer)
    return RunSpec(
        model=ModelConfig(**model_args),
        batch_size=config.data.batch_size,
        seq_len=config.model.config.context_length,
        precision=precision,
        weights_dtype=weights_dtype,
        optimizer=config.model.optimizer,
        strategy=_strategy_name(trainer.strategy),
        world_size=_world_size(trainer.devices, trainer.num_nodes),
        accelerator=str(trainer.accelerator),
        data_path=config.data.path,
        vocab_from_data=vocab_from_data,
    )


def split_flags(argv: list[str], flags: tuple[str, ...]) -> tuple[set[str], list[str]]:
    """Take our own boolean flags (e.g. --json) out of argv; the rest goes to the fit parser."""
    ours = {a for a in argv if a in flags}
    return ours, [a for a in argv if a not in flags]
