"""One description of a training run, per device: the facts every ledger figure depends on.

It is built at the edges and nowhere else. The callbacks build it from a live Trainer (callbacks/trainer_io.py).
Account, plan and sweep build it from a `lmledger fit` config (run_config.py). Both name the strategy
through `sharding`, so a run has one strategy name either way. Pure: torch and the toy LM's config only,
no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmledger.ledger import precision_table
from lmledger.model import ModelConfig

__all__ = ["Run", "sharding"]


@dataclass(frozen=True)
class Run:
    """The shape of one training run, per device.

    Its fields:
        config           the toy LM's ModelConfig; None for another module (predicted by a dry run)
        module           the eager module of a live run (never a torch.compile wrapper), else None
        precision        Lightning's name: "32-true", "bf16-mixed", "transformer-engine", ...
        weights_dtype    a Transformer Engine plugin's weights dtype, else None
        optimizer        a ledger.closedform.memory optimizer name: "adamw", "sgd" or "none"
        momentum         SGD's momentum (0 keeps no state); LitLM's SGD uses 0.9
        fused_optimizer  torch's fused kernels (no foreach temporaries in the step); LitLM's choice,
                         except under fp16's GradScaler
        strategy         a ledger.closedform.memory strategy name (`sharding`): ddp, fsdp (FSDP1), fsdp2, zero2,
                         deepspeed_stage_N
        tensor_parallel  ModelParallelStrategy's tensor-parallel size (fsdp2 x TP); 1 for every other strategy
        sequence_parallel  LitLM's sequence parallel beside TP (only with tensor_parallel above 1)
        compiled / fp8   LitLM's compile and fp8 switches
        accelerator, data_path, vocab_from_data
                         what a config said (account and sweep print them)
    """

    config: ModelConfig | None
    batch_size: int
    seq_len: int
    precision: str = "32-true"
    optimizer: str = "adamw"
    strategy: str = "ddp"
    world_size: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    device: torch.device = torch.device("cpu")
    weights_dtype: torch.dtype | None = None
    momentum: float = 0.9
    fused_optimizer: bool | None = None  # None: LitLM's rule (_fused_by_default)
    compiled: bool = False
    fp8: str | None = None
    module: nn.Module | None = None
    accelerator: str = "auto"
    data_path: str | None = None
    vocab_from_data: bool = False

    def __post_init__(self) -> None:
        if self.fused_optimizer is None:
            object.__setattr__(self, "fused_optimizer", _fused_by_default(self.precision))
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len


def _fused_by_default(precision: str) -> bool:
    """LitLM's choice (lmledger.lit): fused optimizer kernels, except under fp16's GradScaler."""
    return precision_table.precision(precision).fused_optimizer


# Lightning 2.6.6's DeepSpeedStrategy(stage=2) default: the registry's plain "deepspeed" is ZeRO-2
# (lightning/pytorch/strategies/deepspeed.py, DeepSpeedStrategy.__init__).
_DEEPSPEED_DEFAULT_STAGE = 2


def sharding(name: str, *, fsdp_sharding: str | None = None, deepspeed_stage: int | None = None) -> str:
    """The ledger.closedform.memory strategy name of a Lightning strategy.

    `name` is a registry or class name ("fsdp", "deepspeed_stage_3_offload", "FSDPStrategy", ...).
    `fsdp_sharding` is a torch.distributed.fsdp.ShardingStrategy name; `deepspeed_stage` a ZeRO stage.
    Anything that does not shard (one device, DDP and its variants) replicates the state: "ddp".
    """
    name = name.rsplit(".", 1)[-1].lower()
    if name.endswith("strategy"):
        name = name[: -len("strategy")]
    if name.startswith("deepspeed"):
        if deepspeed_stage is None:
            digits = name.removeprefix("deepspeed_stage_")[:1]
            deepspeed_stage = int(digits) if digits.isdigit() else _DEEPSPEED_DEFAULT_STAGE
        return f"deepspeed_stage_{deepspeed_stage}" if deepspeed_stage else "ddp"
    if name in ("modelparallel", "model_parallel", "fsdp2"):
        return "fsdp2"  # torch's fully_shard: per-parameter DTensor shards, dry-run by ledger.sharding.sharded
    if name.startswith("fsdp"):
        # SHARD_GRAD_OP keeps whole params (ZeRO-2). NO_SHARD is DDP.
        # FULL_SHARD and the hybrids shard all three within a shard group.
        kind = str(fsdp_sharding or "FULL_SHARD").rsplit(".", 1)[-1].upper()
        return {"SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp"}.get(kind, "fsdp")
    return "ddp"
