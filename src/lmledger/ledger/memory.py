"""Bytes a training step holds: parameters, gradients, optimizer state, saved activations, peak.

Each analytic figure has a measured twin here:

    predicted                          measured
    state_bytes / bytes_per_param      measure_state_bytes(model, optimizer)   (exact)
    activation_bytes                   measure_saved_activations(model)        (exact on CPU)
    peak_bytes                         ledger.memtrack.MemoryTracker          (any device; 2% on CPU)
                                       measure_peak_cuda(step_fn)              (CUDA allocator)

State, per rank before sharding: each parameter, its gradient and each optimizer state tensor
("AdamW" = 2, "SGD" = 1 momentum buffer, 0 if momentum == 0, "none" = 0) take the bytes per element
of the precision's row in ledger.precisions (32-true AdamW: 4 + 4 + 2 * 4 = 16 per parameter).
Under *-mixed the low-precision weight copies autocast makes are transient (activation_bytes);
Transformer Engine keeps weights in its plugin's weights_dtype (pass weights_dtype=torch.float32
for an fp32-master setup: 16 with AdamW).

Sharding over `world_size` ranks (`strategy`): "ddp" (also "auto", "single_device") replicates
everything; "zero1" divides the optimizer state, "zero2" also the grads, "zero3" / "fsdp" also the
params. A divided term is ceil(n_params / world_size) elements per rank (FSDP pads its flat
parameter to a multiple of the world size).

DeepSpeed (Lightning's "deepspeed_stage_{1,2,3}") follows what its ZeRO optimizers allocate, not the
rule above: for any 16-bit precision Lightning hands DeepSpeed its "fp16" / "bf16" section, and
DeepSpeed converts the model (no autocast), then keeps an fp32 master copy, fp32 gradients and fp32
optimizer states of each rank's partition. Per parameter, N params, W ranks, s optimizer states,
w = 2 (4 under 32-true); L = the largest layer's parameters:

    stage  params        grads                      optimizer            16-bit AdamW total
    1      w N           w N + 4N/W                 4N/W + 4sN/W         4N + 16N/W
    2      w N           w N/W + 4N/W               4N/W + 4sN/W         2N + 18N/W
    3      w N/W + w L   4N/W + w L                 4N/W + 4sN/W         18N/W + 4L

Source: DeepSpeed 0.19.8, deepspeed/runtime/zero/. stage_1_and_2.py keeps the 16-bit params whole
(bit16_groups), an fp32 master of each rank's partition (single_partition_of_fp32_groups) and fp32
gradients of it for the step; stage 2 partitions the 16-bit gradients, stage 1 does not (under
32-true the gradient cast is a no-op, the master still a clone). stage3.py keeps 16-bit param, fp32
gradient and fp32 master partitions (the master shared with the params under 32-true) and gathers one
layer at a time (largest_layer_memory = 4L). The totals equal DeepSpeed's estimate_zero2_ (2N + 18N/W,
DeepSpeed PR #5099) and estimate_zero3_model_states_mem_needs (18N/W + 4L) without offload (tests hold
them equal); offload is not modelled.

Peak: peak_bytes walks one steady-state step. Measured twins: live tensor bytes (ledger.memtrack,
within 2% on CPU) and the CUDA allocator's peak (within 15%: workspaces and rounding not modelled).

AdamW's 0-dim `step` counters are not counted, here or in measure_state_bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger import precisions
from lmledger.ledger.units import STATE_COMPONENTS
from lmledger.model import ModelConfig, count_parameters

# --------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state
# --------------------------------------------------------------------------------------------

_STRATEGY_SHARDS: dict[str, frozenset[str]] = {
    "ddp": frozenset(),
    "auto": frozenset(),  # Lightning's default: one device, or DDP over several
    "single_device": frozenset(),
    "zero1": frozenset({"optimizer"}),
    "zero2": frozenset({"grads", "optimizer"}),
    "zero3": frozenset({"params", "grads", "optimizer"}),
    "fsdp": frozenset({"params", "grads", "optimizer"}),
    "fsdp2": frozenset({"params", "grads", "optimizer"}),  # exact per-parameter shards: ledger.sharded
    "deepspeed_stage_1": frozenset({"optimizer"}),
    "deepspeed_stage_2": frozenset({"grads", "optimizer"}),
    "deepspeed_stage_3": frozenset({"params", "grads", "optimizer"}),
}

_DEEPSPEED_STAGES = {"deepspeed_stage_1": 1, "deepspeed_stage_2": 2, "deepspeed_stage_3": 3}
FP32_MASTER = 4  # DeepSpeed's master weights, fp32 gradients for the step and optimizer states

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


def _state_widths(precision: str | int, weights_dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes per element of a param, a grad and one optimizer state tensor; a Transformer Engine
    plugin's weights_dtype sets all three."""
    row = precisions.precision(precision)
    if weights_dtype is None:
        return {"params": row.param_bytes, "grads": row.grad_bytes, "optimizer": row.state_bytes}
    if not row.transformer_engine:
        raise UserError(f"weights_dtype only applies to transformer-engine precisions, not {row.name}")
    return dict.fromkeys(STATE_COMPONENTS, torch.empty((), dtype=weights_dtype).element_size())


def optimizer_states(optimizer: str, momentum: float = 0.9) -> int:
    """Optimizer state tensors kept per parameter tensor (each the parameter's shape)."""
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

    largest_layer: parameters of the biggest module, which ZeRO-3 gathers whole (DeepSpeed only;
    largest_layer_params(cfg) for ToyLM)."""
    if n_params < 0:
        raise UserError(f"n_params must be >= 0, got {n_params}")
    width = _state_widths(precision, weights_dtype)
    sharded = _sharded_terms(strategy, world_size)
    if strategy in _DEEPSPEED_STAGES:
        states = optimizer_states(optimizer, momentum)
        return _deepspeed_state_bytes(
            n_params, precision, states, _DEEPSPEED_STAGES[strategy], world_size, largest_layer
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
    """params + grads + optimizer bytes per parameter on one rank (32-true AdamW DDP: 16). Under
    DeepSpeed ZeRO-3 the gathered largest layer is left out (it is not per parameter)."""
    width = _state_widths(precision, weights_dtype)
    sharded = _sharded_terms(strategy, world_size)
    if strategy in _DEEPSPEED_STAGES:
        stage, states = _DEEPSPEED_STAGES[strategy], optimizer_states(optimizer, momentum)
        terms = _deepspeed_terms(precision, states, stage)
        return sum(whole + split / world_size for whole, split, _layer in terms.values())
    share = {term: 1 / world_size if term in sharded else 1.0 for term in STATE_COMPONENTS}
    share["optimizer"] *= optimizer_states(optimizer, momentum)
    return sum(width[term] * share[term] for term in STATE_COMPONENTS)


def _deepspeed_terms(precision: str | int, states: int, stage: int) -> dict[str, tuple[int, int, int]]:
    """Per term: (bytes per parameter on every rank, bytes per parameter divided over the ranks,
    bytes per parameter of the largest layer) under DeepSpeed ZeRO `stage` (module docstring)."""
    row = precisions.precision(precision)
    w = row.deepspeed_model_bytes
    if w is None:
        runs = [r.name for r in precisions.ROWS.values() if r.deepspeed_model_bytes is not None]
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
    """The precision the model's forward runs in: DeepSpeed takes a *-mixed precision as its own
    16-bit mode (Lightning's _format_precision_config writes an "fp16" / "bf16" section, and
    DeepSpeedPrecision adds no autocast), so its activations are those of the *-true counterpart."""
    name = precisions.normalize_precision(precision)
    if strategy in _DEEPSPEED_STAGES and name.endswith("-mixed"):
        return name.replace("-mixed", "-true")
    return name


def largest_layer_params(cfg: ModelConfig) -> int:
    """Parameters of ToyLM's biggest module, as DeepSpeed's model_to_params counts them (each
    module's own parameters): the embedding / LM head, qkv, or an MLP matrix."""
    return max(cfg.vocab_size * cfg.d_model, 3 * cfg.d_model**2, cfg.d_model * cfg.d_ff)


def _storage_key(t: torch.Tensor) -> int:
    """Identity of t's storage, shared by all its views. The StorageImpl's address rather than
    data_ptr(), which is 0 for every meta tensor; unique while the storage is alive."""
    return t.untyped_storage()._cdata


def unique_storage_bytes(tensors: Iterable[object]) -> int:
    """Sum of the tensors' storage sizes, each storage once (views and tied tensors are free; anything that
    is not a tensor counts nothing)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def measure_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes the real tensors hold: parameters, their .grad, and optimizer state (0-dim `step`
    counters excluded, as in state_bytes). Each storage counts once."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            states += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "params": unique_storage_bytes(params),
        "grads": unique_storage_bytes(grads),
        "optimizer": unique_storage_bytes(states),
    }


# --------------------------------------------------------------------------------------------
# Activations saved for backward, as lmledger.model implements the toy LM
# --------------------------------------------------------------------------------------------

COMPONENTS = ("embedding", "attention", "mlp", "norms", "logits_loss", "checkpoint_inputs")
INDEX_BYTES = 8  # token ids and targets are int64, as the data module hands them over
FP32 = 4


@dataclass(frozen=True)
class ActivationReport:
    """Bytes autograd holds for backward once forward has finished.

    `by_component` are activations proper; `autocast_weight_copies` (the low-precision weight
    casts that linear layers save under autocast) are parameters in another dtype, so they are
    kept apart from activations and are not in `total`.
    """

    by_component: dict[str, int]
    autocast_weight_copies: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_component.values())


@dataclass(frozen=True)
class _Widths:
    compute: int  # matmul operands, attention, MLP intermediates
    residual: int  # the residual stream between blocks
    autocast: bool


def _activation_widths(precision: str | int) -> _Widths:
    row = precisions.precision(precision)
    if row.activation_bytes is None:
        modelled = [r.name for r in precisions.ROWS.values() if r.activation_bytes is not None]
        raise UserError(f"activation bytes are modelled for {', '.join(modelled)}, not {row.name}")
    compute, residual = row.activation_bytes
    return _Widths(compute=compute, residual=residual, autocast=row.autocast is not None)


def _check_device(device: str) -> str:
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise UserError(f"activation bytes are modelled for cpu and cuda, not {device!r}")
    return kind


def _norm_saved(tokens: int, d: int, widths: _Widths, device: str) -> int:
    """One nn.RMSNorm's saved tensors (its output is charged to the linear that consumes it).

    F.rms_norm dispatches to aten._fused_rms_norm (aten/src/ATen/native/layer_norm.cpp). On CPU
    that falls back to the composite: it saves the fp32 (upcast) input, the fp32 rsqrt per token
    and the fp32 normalized input that multiplies the weight. On CUDA the fused kernel's autograd
    formula (tools/autograd/derivatives.yaml) saves the input as it is and the fp32 rsqrt.
    """
    if device == "cuda":
        return tokens * d * widths.residual + tokens * FP32
    return 2 * tokens * d * FP32 + tokens * FP32


def _attention_stats_bytes(batch: int, seq: int, heads: int, widths: _Widths, device: str) -> int:
    """What SDPA saves besides q, k, v and its output: the fp32 log-sum-exp of every query row,
    and on CUDA the dropout RNG seed and offset (two 0-dim int64 tensors even at dropout 0)."""
    if device == "cpu":
        return batch * heads * seq * FP32
    rng_state = 2 * 8
    if widths.compute == FP32:
        # fp32 runs the memory-efficient kernel (flash and cuDNN take only 16-bit inputs),
        # whose log-sum-exp rows are padded to a multiple of 32.
        return batch * heads * math.ceil(seq / 32) * 32 * FP32 + rng_state
    return batch * heads * seq * FP32 + rng_state


def _block_saved(cfg: ModelConfig, batch: int, seq: int, widths: _Widths, device: str) -> dict[str, int]:
    """Saved bytes of one block that is not checkpointed."""
    tokens, d, c = batch * seq, cfg.d_model, widths.compute
    # Rotary tables: `.to(x.dtype)` is a no-op (the saved tensor is the buffer) unless autocast
    # runs q, k in a lower precision than the fp32 tables; then cos and sin are cast afresh for
    # q and for k: four (seq, head_dim) tensors.
    rope_casts = 4 * seq * cfg.head_dim * c if widths.autocast else 0
    attention = (
        tokens * d * c  # qkv input (the norm's output, or its autocast cast)
        + 3 * tokens * d * c  # qkv output: v is a view, so SDPA keeps the whole (q|k|v) storage
        + 2 * tokens * d * c  # q and k after RoPE
        + tokens * d * c  # SDPA output, which the out projection also saves (same storage)
        + _attention_stats_bytes(batch, seq, cfg.n_heads, widths, device)
        + rope_casts
    )
    # Autocast casts the norm's output separately for w1 and for w3 (its cache only keeps casts
    # of leaf tensors, i.e. weights); without autocast both save the same tensor.
    mlp_inputs = 2 if widths.autocast else 1
    mlp = mlp_inputs * tokens * d * c + 4 * tokens * cfg.d_ff * c  # w1 x, w3 x, silu(w1 x), their product
    norms = 2 * _norm_saved(tokens, d, widths, device)
    return {"attention": attention, "mlp": mlp, "norms": norms}


def _matmul_weights_per_block(cfg: ModelConfig) -> int:
    return 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff


def _check_shape(cfg: ModelConfig, batch: int, seq: int) -> None:
    if batch < 1 or seq < 1:
        raise UserError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if seq > cfg.context_length:
        raise UserError(f"seq {seq} > context_length {cfg.context_length}: lower seq or raise model.context_length")


def activation_bytes(
    cfg: ModelConfig, batch: int, seq: int, precision: str | int = "32-true", device: str = "cpu"
) -> ActivationReport:
    """Bytes autograd saves in one training forward of ToyLM(cfg) on (batch, seq) token ids.

    Counted as implemented in lmledger.model (each storage once, parameters and buffers left
    out), checked exactly against measure_saved_activations on CPU:
      embedding        the int64 token ids
      norms            every RMSNorm's saved tensors (_norm_saved)
      attention        qkv input, the (q|k|v) storage, roped q and k, SDPA output and log-sum-exp,
                       rotary-table casts under autocast
      mlp              w1/w3 input(s) and the four (tokens, d_ff) tensors of SwiGLU
      logits_loss      lm_head input, the fp32 log_softmax output (the loss upcasts the logits;
                       the logits themselves are not saved), int64 targets, nll's 4-byte weight sum
      checkpoint_inputs  a checkpointed block keeps only its input (residual dtype); what its
                       recompute rebuilds in backward is a transient, counted in peak_bytes
    Autocast weight copies (precision *-mixed) are those of the lm_head and the blocks that are
    not checkpointed: checkpointed blocks do not save theirs.
    """
    _check_shape(cfg, batch, seq)
    widths = _activation_widths(precision)
    kind = _check_device(device)
    tokens, d = batch * seq, cfg.d_model
    components = dict.fromkeys(COMPONENTS, 0)
    components["embedding"] = tokens * INDEX_BYTES
    block = _block_saved(cfg, batch, seq, widths, kind)
    copied_weights = cfg.vocab_size * d  # lm_head, tied or not
    for layer in range(cfg.n_layers):
        if cfg.is_checkpointed(layer):
            components["checkpoint_inputs"] += tokens * d * widths.residual
        else:
            for name, nbytes in block.items():
                components[name] += nbytes
            copied_weights += _matmul_weights_per_block(cfg)
    components["norms"] += _norm_saved(tokens, d, widths, kind)  # final norm
    components["logits_loss"] = (
        tokens * d * widths.compute  # lm_head input
        + tokens * cfg.vocab_size * FP32  # log_softmax output
        + tokens * INDEX_BYTES  # targets
        + FP32  # nll_loss total_weight
    )
    weight_copies = copied_weights * widths.compute if widths.autocast else 0
    return ActivationReport(by_component=components, autocast_weight_copies=weight_copies)


# --------------------------------------------------------------------------------------------
# Peak of one training step
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakReport:
    """Predicted peak of allocated bytes in one steady-state training step, and where it falls."""

    total: int
    phase: str  # "forward", "loss backward", "recompute block N", "embedding backward", "optimizer step"
    params: int
    grads: int
    optimizer: int
    activations: int
    autocast_weight_copies: int


def peak_bytes(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    precision: str | int = "32-true",
    optimizer: str = "adamw",
    strategy: str = "ddp",
    world_size: int = 1,
    *,
    momentum: float = 0.9,
    device: str = "cpu",
    grads_held_in_forward: bool = True,
    fused: bool = False,
    foreach: bool | None = None,
    autocast_cache: bool = False,
) -> PeakReport:
    """Largest allocation total during one training step after the first.

    P, O, G = params, optimizer state, grads; A = activation_bytes().total; Wall / Wsaved = autocast
    copies of all matmul weights / of those saved for backward; NV = tokens x vocab; c = compute bytes.
    The largest of these totals wins:

    1. forward end: P + O + [G] + A + Wsaved + NV*(c + 4 if c < 4 else 4). [G]: Lightning zeroes grads
       after forward (grads_held_in_forward); Wsaved, not Wall: Lightning's autocast keeps no weight
       cache (Wall with autocast_cache=True); the logits and their fp32 copy live through log_softmax.
       (Canaries test_lightning_zeroes_grads_after_the_forward, test_lightning_autocast_keeps_no_weight_cache.)
    2. loss backward: P + O + A + Wsaved + 2*NV*4 (nll's and log_softmax's fp32 gradients).
    3. recompute, per checkpointed block top down: the saved set below it + grads made above it + its
       recomputed saved set and weight copies + its SwiGLU backward's gradients (tokens x d and two of
       tokens x d_ff).
    4. embedding backward: P + O + G, plus 2*V*d for a tied embedding (AccumulateGrad adds the head's
       and the embedding's gradients out of place).
    5. optimizer step: P + O + G + the AdamW kernel's temporaries (optimizer_kernel): foreach, sqrt(v)
       of every tensor (one state); for-loop, two of the largest tensor's state; fused and SGD, none.

    Between these points totals lie between the endpoints. Not modelled: per-op gradient temporaries,
    library workspaces, allocator rounding, FSDP's gathered parameters. `batch` is per rank. DeepSpeed
    runs *-mixed as its 16-bit model without autocast (activations of the *-true counterpart).
    """
    _check_shape(cfg, batch, seq)
    deepspeed = strategy in _DEEPSPEED_STAGES
    precision = model_precision(precision, strategy)
    widths = _activation_widths(precision)
    kind = _check_device(device)
    n = count_parameters(cfg)
    state = state_bytes(
        n, precision, optimizer, strategy, world_size, momentum=momentum, largest_layer=largest_layer_params(cfg)
    )
    params, grads, opt = state["params"], state["grads"], state["optimizer"]
    resident = params + opt  # alive through the whole step
    grad_per_param = grads / n
    acts = activation_bytes(cfg, batch, seq, precision, kind)
    tokens, d, v, c = batch * seq, cfg.d_model, cfg.vocab_size, widths.compute
    logits = tokens * v
    copy_width = c if widths.autocast else 0
    block_weights = _matmul_weights_per_block(cfg)

    logits_alive = logits * c + (logits * FP32 if c < FP32 else 0)  # the logits and their fp32 copy
    copies_alive = (
        (cfg.n_layers * block_weights + v * d) * copy_width if autocast_cache else acts.autocast_weight_copies
    )
    candidates = {
        "forward": resident + (grads if grads_held_in_forward else 0) + acts.total + copies_alive + logits_alive,
        "loss backward": resident + acts.total + acts.autocast_weight_copies + 2 * logits * FP32,
    }

    # Blocks, top down, once the head's backward is done: its saved tensors are freed and the
    # lm_head and final-norm grads exist.
    block_saved = sum(_block_saved(cfg, batch, seq, widths, kind).values())
    block_copies = block_weights * copy_width
    still_saved = acts.total - acts.by_component["logits_loss"] - _norm_saved(tokens, d, widths, kind)
    copies_saved = acts.autocast_weight_copies - v * d * copy_width
    grads_made = (v * d + d) * grad_per_param
    # In a recomputed block's SwiGLU backward: the residual gradient, and the gradients of the
    # product, of silu(w1 x) and of w3 x alive together once w2's backward has freed the product.
    mlp_backward = tokens * d * widths.residual + 2 * tokens * cfg.d_ff * c
    for layer in reversed(range(cfg.n_layers)):
        if cfg.is_checkpointed(layer):
            recomputed = block_saved + block_copies
            live = resident + still_saved + copies_saved + grads_made
            candidates[f"recompute block {layer}"] = live + recomputed + mlp_backward
            still_saved -= tokens * d * widths.residual
        else:
            still_saved -= block_saved
            copies_saved -= block_copies
        grads_made += (block_weights + 2 * d) * grad_per_param

    tied_grads = 2 * v * d * grad_per_param if cfg.tie_embeddings else 0
    candidates["embedding backward"] = resident + grads + tied_grads
    if deepspeed:  # the wrapped optimizer steps one flat fp32 partition per param group
        one_state = largest_tensor = FP32_MASTER * math.ceil(n / world_size)
    else:
        one_state = opt // max(optimizer_states(optimizer, momentum), 1)
        largest_tensor = largest_layer_params(cfg) * precisions.precision(precision).state_bytes
    step_temporaries = _optimizer_step_temporaries(optimizer, one_state, largest_tensor, kind, fused, foreach)
    candidates["optimizer step"] = resident + grads + step_temporaries

    phase = max(candidates, key=candidates.__getitem__)
    return PeakReport(
        total=int(candidates[phase]),
        phase=phase,
        params=params,
        grads=grads,
        optimizer=opt,
        activations=acts.total,
        autocast_weight_copies=acts.autocast_weight_copies,
    )


def optimizer_kernel(device: str, fused: bool = False, foreach: bool | None = None) -> str:
    """The implementation torch.optim's AdamW / SGD run: "fused", "foreach" or "for-loop".

    As torch.optim.optimizer._default_to_fused_or_foreach decides when neither flag is given:
    foreach on the devices torch lists for foreach kernels (CUDA among them), the per-tensor loop
    everywhere else, the CPU included; fused only when asked for."""
    if fused:
        return "fused"
    if foreach is None:
        foreach = torch.device(device).type in _foreach_devices()
    return "foreach" if foreach else "for-loop"


def _foreach_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:  # private (canary test_foreach_supported_devices_helper_exists): torch 2.13's list
        return ["cuda", "xpu", "mtia"]
    return _get_foreach_kernels_supported_devices()


def _optimizer_step_temporaries(
    optimizer: str, one_state: int, largest_tensor: int, device: str, fused: bool, foreach: bool | None
) -> int:
    """Bytes AdamW's step holds beyond its state at its high-water mark (peak_bytes docstring):
    sqrt(v) of every tensor at once (foreach: one state's worth), or sqrt(v_i) and its quotient for
    the largest tensor (the per-tensor loop)."""
    if optimizer.lower() not in ("adamw", "adam"):
        return 0
    kernel = optimizer_kernel(device, fused, foreach)
    if kernel == "foreach":
        return one_state
    if kernel == "for-loop":
        return 2 * largest_tensor
    return 0


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------

# Autograd nodes between an autocast weight copy and its parameter: the cast itself and the
# views linear takes of it.
_COPY_OR_VIEW_NODES = frozenset(
    {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "AliasBackward0"}
)


def _copied_parameter(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf tensor t is a cast/view of, if the chain of autograd nodes leading to it
    contains only casts and views (an autocast weight copy); else None."""
    node = t.grad_fn
    for _ in range(8):
        if node is None:
            return None
        if type(node).__name__ == "AccumulateGrad":
            return node.variable
        if type(node).__name__ not in _COPY_OR_VIEW_NODES:
            return None
        parents = [fn for fn, _ in node.next_functions if fn is not None]
        if len(parents) != 1:
            return None
        node = parents[0]
    return None


@dataclass
class SavedActivations:
    """What measure_saved_activations saw; bytes are unique storages.

    by_module charges each storage to the innermost module running when it was first saved
    ("" = the model's own forward: the loss, and the inputs torch.utils.checkpoint keeps).
    """

    activations: int = 0
    autocast_weight_copies: int = 0
    by_module: dict[str, int] = field(default_factory=dict)


@contextmanager
def measure_saved_activations(model: nn.Module) -> Iterator[SavedActivations]:
    """Record every tensor autograd saves while the block runs (run forward inside, backward
    after). Storages of the model's parameters and buffers are left out; casts of parameters
    (autocast weight copies) are totalled apart. A reference to each saved tensor is held until
    exit, so a freed storage's address cannot be reused and miscounted.

    Tensors saved by torch.utils.checkpoint's recompute during backward are not seen (checkpoint
    packs them with its own hooks): the figure is the steady state held between forward and
    backward, which is what activation_bytes predicts.
    """
    result = SavedActivations()
    own = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}
    running = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key in own or key in seen or nbytes == 0:
            return t
        seen[key] = t
        source = _copied_parameter(t)
        if source is not None and id(source) in params:
            result.autocast_weight_copies += nbytes
        else:
            result.activations += nbytes
            result.by_module[running[-1]] = result.by_module.get(running[-1], 0) + nbytes
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            running.append(name)

        return hook

    def leave(module: nn.Module, args: object, output: object) -> None:
        running.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        for handle in handles:
            handle.remove()
        seen.clear()


def measure_peak_cuda(step_fn: Callable[[], object], device: torch.device | int | None = None) -> int:
    """Peak bytes allocated on a CUDA device while step_fn runs (everything already allocated
    before it, such as parameters and optimizer state, included)."""
    if not torch.cuda.is_available():
        raise UserError(
            "measure_peak_cuda needs a CUDA device; elsewhere ledger.memtrack.MemoryTracker measures the peak"
        )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step_fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
