"""Bytes a rank holds between steps: parameters, gradients and optimizer state, under any sharding.

The memory ledger is three modules, each predicted figure beside its measured twin:

    module       predicted                          measured
    memory       state_bytes / bytes_per_param      measure_state_bytes(model, optimizer)   (exact)
    activations  activation_bytes                   measure_saved_activations(model)        (exact on CPU)
    peak         peak_bytes                         ledger.count.memtrack.MemoryTracker          (any device; 2% on CPU)
                                                    measure_peak_cuda(step_fn)              (CUDA allocator)

State, per rank before sharding. Each parameter, its gradient and each optimizer state tensor take
bytes per element from the precision's row in ledger.precision_table. Optimizer states per parameter:
"AdamW" 2; "SGD" 1 momentum buffer, 0 if momentum == 0; "none" 0. So 32-true AdamW is
4 + 4 + 2 * 4 = 16 per parameter. Under *-mixed, the low-precision weight copies autocast makes are
transient (ledger.closedform.activations). Transformer Engine keeps weights in its plugin's weights_dtype. For an
fp32-master setup pass weights_dtype=torch.float32: 16 with AdamW.

Sharding over `world_size` ranks, by `strategy`:

    ddp, auto, single_device    everything replicated
    zero1                       the optimizer state divided
    zero2                       also the grads
    zero3, fsdp                 also the params

A divided term is ceil(n_params / world_size) elements per rank. (FSDP pads its flat parameter to a
multiple of the world size.)

DeepSpeed follows what its ZeRO optimizers allocate, not the rule above. (Lightning names it
"deepspeed_stage_{1,2,3}".) For any 16-bit precision, Lightning hands DeepSpeed its "fp16" / "bf16"
section. DeepSpeed converts the model (no autocast). Then it keeps fp32 copies of each rank's
partition: a master, gradients, optimizer states. Per parameter, with N params and W ranks:

    s   optimizer states
    w   2 (4 under 32-true)
    L   the largest layer's parameters

    stage  params        grads                      optimizer            16-bit AdamW total
    1      w N           w N + 4N/W                 4N/W + 4sN/W         4N + 16N/W
    2      w N           w N/W + 4N/W               4N/W + 4sN/W         2N + 18N/W
    3      w N/W + w L   4N/W + w L                 4N/W + 4sN/W         18N/W + 4L

Source: DeepSpeed 0.19.8, deepspeed/runtime/zero/. stage_1_and_2.py keeps the 16-bit params whole
(bit16_groups). It keeps an fp32 master of each rank's partition (single_partition_of_fp32_groups).
For the step, it keeps fp32 gradients of it. Stage 2 partitions the 16-bit gradients; stage 1 does
not. Under 32-true the gradient cast is a no-op, and the master still a clone. The file stage3.py
keeps 16-bit param, fp32 gradient and fp32 master partitions. Under 32-true the master is shared
with the params. It gathers one layer at a time (largest_layer_memory = 4L). Without offload, the
totals equal DeepSpeed's estimates. These are estimate_zero2_ (2N + 18N/W, DeepSpeed PR #5099) and
estimate_zero3_model_states_mem_needs (18N/W + 4L). Tests hold them equal. Offload is not modelled.

AdamW's 0-dim `step` counters are not counted, here or in measure_state_bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.units import STATE_COMPONENTS
from lmledger.model import ModelConfig, block_linears

__all__ = [
    "DEEPSPEED_STAGES",
    "FP32_MASTER",
    "OPTIMIZERS",
    "bytes_per_param",
    "largest_layer_params",
    "measure_state_bytes",
    "model_precision",
    "optimizer_states",
    "state_bytes",
    "storage_key",
    "unique_storage_bytes",
]

_STRATEGY_SHARDS: dict[str, frozenset[str]] = {
    "ddp": frozenset(),
    "auto": frozenset(),  # Lightning's default: one device, or DDP over several
    "single_device": frozenset(),
    "zero1": frozenset({"optimizer"}),
    "zero2": frozenset({"grads", "optimizer"}),
    "zero3": frozenset({"params", "grads", "optimizer"}),
    "fsdp": frozenset({"params", "grads", "optimizer"}),
    "fsdp2": frozenset({"params", "grads", "optimizer"}),  # exact per-parameter shards: ledger.sharding.sharded
    "deepspeed_stage_1": frozenset({"optimizer"}),
    "deepspeed_stage_2": frozenset({"grads", "optimizer"}),
    "deepspeed_stage_3": frozenset({"params", "grads", "optimizer"}),
}

# The strategies whose state follows DeepSpeed's ZeRO optimizers, and their stage.
DEEPSPEED_STAGES = {"deepspeed_stage_1": 1, "deepspeed_stage_2": 2, "deepspeed_stage_3": 3}
FP32_MASTER = 4  # DeepSpeed's master weights, fp32 gradients for the step and optimizer states

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


def _state_widths(precision: str | int, weights_dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes per element of a param, a grad and one optimizer state tensor.

    A Transformer Engine plugin's weights_dtype sets all three.
    """
    row = precision_table.precision(precision)
    if weights_dtype is None:
        return {"params": row.param_bytes, "grads": row.grad_bytes, "optimizer": row.state_bytes}
    if not row.transformer_engine:
        raise UserError(f"weights_dtype only applies to transformer-engine precisions, not {row.name}")
    return dict.fromkeys(STATE_COMPONENTS, torch.empty((), dtype=weights_dtype).element_size())


def optimizer_states(optimizer: str, momentum: float = 0.9) -> int:
    """Optimizer state tensors kept per parameter tensor, each of the parameter's shape."""
    name = optimizer.lower()
    if name in ("adamw", "adam"):
        return 2  # exp_avg (m) and exp_avg_sq (v)
    if name == "sgd":
        return 1 if momentum else 0
    if name == "none":
        return 0
    raise UserError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")


def _sharded_terms(strategy: str, world_size: int) -> frozenset[str]:
    if strategy not in _STRATEGY_SHARDS:
        raise UserError(f"unknown strategy {strategy!r}: use one of {', '.join(_STRATEGY_SHARDS)}")
    if world_size < 1:
        raise UserError(f"world_size must be >= 1, got {world_size}")
    return _STRATEGY_SHARDS[strategy]


def state_bytes(
    n_params: int,
    precision: str | int,
    optimizer: str = "adamw",
    strategy: str = "ddp",
    world_size: int = 1,
    *,
    momentum: float = 0.9,
    weights_dtype: torch.dtype | None = None,
    largest_layer: int = 0,
) -> dict[str, int]:
    """Bytes one rank holds for params, grads and optimizer state (conventions: module docstring).

    The argument largest_layer is the parameters of the biggest module. ZeRO-3 gathers it whole.
    DeepSpeed only; for ToyLM, largest_layer_params(cfg).
    """
    if n_params < 0:
        raise UserError(f"n_params must be >= 0, got {n_params}")
    width = _state_widths(precision, weights_dtype)
    sharded = _sharded_terms(strategy, world_size)
    if strategy in DEEPSPEED_STAGES:
        states = optimizer_states(optimizer, momentum)
        return _deepspeed_state_bytes(
            n_params, precision, states, DEEPSPEED_STAGES[strategy], world_size, largest_layer
        )
    per_rank = math.ceil(n_params / world_size)
    elements = {term: per_rank if term in sharded else n_params for term in STATE_COMPONENTS}
    elements["optimizer"] *= optimizer_states(optimizer, momentum)
    return {term: elements[term] * width[term] for term in STATE_COMPONENTS}


def bytes_per_param(
    precision: str | int,
    optimizer: str = "adamw",
    strategy: str = "ddp",
    world_size: int = 1,
    *,
    momentum: float = 0.9,
    weights_dtype: torch.dtype | None = None,
) -> float:
    """params + grads + optimizer bytes per parameter on one rank (32-true AdamW DDP: 16).

    Under DeepSpeed ZeRO-3 the gathered largest layer is left out: it is not per parameter.
    """
    width = _state_widths(precision, weights_dtype)
    sharded = _sharded_terms(strategy, world_size)
    if strategy in DEEPSPEED_STAGES:
        stage, states = DEEPSPEED_STAGES[strategy], optimizer_states(optimizer, momentum)
        terms = _deepspeed_terms(precision, states, stage)
        return sum(whole + split / world_size for whole, split, _layer in terms.values())
    share = {term: 1 / world_size if term in sharded else 1.0 for term in STATE_COMPONENTS}
    share["optimizer"] *= optimizer_states(optimizer, momentum)
    return sum(width[term] * share[term] for term in STATE_COMPONENTS)


def _deepspeed_terms(precision: str | int, states: int, stage: int) -> dict[str, tuple[int, int, int]]:
    """Per term, under DeepSpeed ZeRO `stage` (module docstring), three bytes per parameter.

    They are (on every rank, divided over the ranks, of the largest layer).
    """
    row = precision_table.precision(precision)
    w = row.deepspeed_model_bytes
    if w is None:
        runs = [r.name for r in precision_table.ROWS.values() if r.deepspeed_model_bytes is not None]
        raise UserError(f"DeepSpeed runs precisions {', '.join(runs)}, not {row.name}: choose one of them")
    grad_cast = FP32_MASTER if w < FP32_MASTER else 0  # fp32 copy of this rank's gradient partition
    master = FP32_MASTER if stage < 3 or w < FP32_MASTER else 0  # stage 3 reuses fp32 params as master
    optimizer = (master, FP32_MASTER * states)
    if stage == 1:
        return {"params": (w, 0, 0), "grads": (w, grad_cast, 0), "optimizer": (0, sum(optimizer), 0)}
    if stage == 2:
        return {"params": (w, 0, 0), "grads": (0, w + grad_cast, 0), "optimizer": (0, sum(optimizer), 0)}
    return {"params": (0, w, w), "grads": (0, FP32_MASTER, w), "optimizer": (0, sum(optimizer), 0)}


def _deepspeed_state_bytes(
    n_params: int, precision: str | int, states: int, stage: int, world_size: int, largest_layer: int
) -> dict[str, int]:
    per_rank = math.ceil(n_params / world_size)
    return {
        term: whole * n_params + split * per_rank + layer * largest_layer
        for term, (whole, split, layer) in _deepspeed_terms(precision, states, stage).items()
    }


def model_precision(precision: str | int, strategy: str = "ddp") -> str:
    """The precision the model's forward runs in.

    DeepSpeed takes a *-mixed precision as its own 16-bit mode. Lightning's _format_precision_config
    writes an "fp16" / "bf16" section, and DeepSpeedPrecision adds no autocast. So its activations
    are those of the *-true counterpart.
    """
    name = precision_table.normalize_precision(precision)
    if strategy in DEEPSPEED_STAGES and name.endswith("-mixed"):
        return name.replace("-mixed", "-true")
    return name


def largest_layer_params(cfg: ModelConfig) -> int:
    """Parameters of ToyLM's biggest module: the embedding / LM head, a learned position table, or a block Linear.

    Counted as DeepSpeed's model_to_params counts them: each module's own parameters (a Linear's bias too).
    """
    linears = [i * o + (o if cfg.bias else 0) for i, o in block_linears(cfg).values()]
    tables = [cfg.vocab_size * cfg.d_model, cfg.context_length * cfg.d_model if cfg.positions == "learned" else 0]
    return max(*tables, *linears)


def storage_key(t: torch.Tensor) -> int:
    """Identity of t's storage, shared by all its views; unique while the storage is alive.

    It is the StorageImpl's address. data_ptr() is 0 for every meta tensor.
    """
    return t.untyped_storage()._cdata


def unique_storage_bytes(tensors: Iterable[object]) -> int:
    """Sum of the tensors' storage sizes, each storage once.

    Views and tied tensors are free. Anything that is not a tensor counts nothing.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def measure_state_bytes(model: nn.Module, optimizer: object = None) -> dict[str, int]:
    """Bytes the real tensors hold: parameters, their .grad, and optimizer state.

    `optimizer` is one, None, or a list (manual optimization's). The 0-dim `step` counters are excluded, as
    in state_bytes. Each storage counts once.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        for per_param in opt.state.values() if opt is not None else ():
            states += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "params": unique_storage_bytes(params),
        "grads": unique_storage_bytes(grads),
        "optimizer": unique_storage_bytes(states),
    }
