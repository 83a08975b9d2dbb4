"""Bytes autograd saves for backward: ToyLM's closed form, and the measured twin for any model.

The function activation_bytes counts what lmledger.model saves, as it implements the toy LM. It is
exact against measure_saved_activations on CPU. It is built from widths and one block's saved set.
Those helpers are shared with ledger.closedform.peak, which walks the same tensors through a step.
Both follow the default architecture only; any other ModelConfig option is refused (check_architecture),
and the dry run, exact for every option, predicts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.closedform.memory import storage_key
from lmledger.model import ModelConfig, block_linears

__all__ = [
    "COMPONENTS",
    "FP32",
    "ActivationReport",
    "SavedActivations",
    "Widths",
    "activation_bytes",
    "activation_widths",
    "block_saved",
    "check_architecture",
    "check_device",
    "check_shape",
    "matmul_weights_per_block",
    "measure_saved_activations",
    "norm_saved",
]

COMPONENTS = ("embedding", "attention", "mlp", "norms", "logits_loss", "checkpoint_inputs")
# What the saved-set closed forms follow, said where they are absent.
MODELLED = "the default toy LM (RMSNorm, SwiGLU, RoPE, MHA, no bias)"
_INDEX_BYTES = 8  # token ids and targets are int64, as the data module hands them over
FP32 = 4


@dataclass(frozen=True)
class ActivationReport:
    """Bytes autograd holds for backward once forward has finished.

    `by_component` are activations proper. `autocast_weight_copies` are the low-precision weight
    casts that linear layers save under autocast. They are parameters in another dtype. So they are
    kept apart from activations, and are not in `total`.
    """

    by_component: dict[str, int]
    autocast_weight_copies: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_component.values())


@dataclass(frozen=True)
class Widths:
    """Bytes per element of a precision's activations."""

    compute: int  # matmul operands, attention, MLP intermediates
    residual: int  # the residual stream between blocks
    autocast: bool


def activation_widths(precision: str | int) -> Widths:
    """The precision's activation widths; refused where none are modelled."""
    row = precision_table.precision(precision)
    if row.activation_bytes is None:
        modelled = [r.name for r in precision_table.ROWS.values() if r.activation_bytes is not None]
        raise UserError(f"activation bytes are modelled for {', '.join(modelled)}, not {row.name}")
    compute, residual = row.activation_bytes
    return Widths(compute=compute, residual=residual, autocast=row.autocast is not None)


def check_device(device: str) -> str:
    """The device's type, cpu or cuda: the two the saved sets are modelled for."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise UserError(f"activation bytes are modelled for cpu and cuda, not {device!r}")
    return kind


def norm_saved(tokens: int, d: int, widths: Widths, device: str) -> int:
    """One nn.RMSNorm's saved tensors. Its output is charged to the linear that consumes it.

    F.rms_norm dispatches to aten._fused_rms_norm (aten/src/ATen/native/layer_norm.cpp). On CPU
    that falls back to the composite. It saves three fp32 tensors: the upcast input, the rsqrt per
    token, and the normalized input that multiplies the weight. On CUDA, the fused kernel's autograd
    formula saves the input as it is, and the fp32 rsqrt (tools/autograd/derivatives.yaml).
    """
    if device == "cuda":
        return tokens * d * widths.residual + tokens * FP32
    return 2 * tokens * d * FP32 + tokens * FP32


def _attention_stats_bytes(batch: int, seq: int, heads: int, widths: Widths, device: str) -> int:
    """What SDPA saves besides q, k, v and its output.

    That is the fp32 log-sum-exp of every query row. On CUDA, also the dropout RNG seed and offset.
    Those are two 0-dim int64 tensors, even at dropout 0.
    """
    if device == "cpu":
        return batch * heads * seq * FP32
    rng_state = 2 * 8
    if widths.compute == FP32:
        # fp32 runs the memory-efficient kernel: flash and cuDNN take only 16-bit inputs.
        # Its log-sum-exp rows are padded to a multiple of 32.
        return batch * heads * math.ceil(seq / 32) * 32 * FP32 + rng_state
    return batch * heads * seq * FP32 + rng_state


def block_saved(cfg: ModelConfig, batch: int, seq: int, widths: Widths, device: str) -> dict[str, int]:
    """Saved bytes of one block that is not checkpointed."""
    tokens, d, c = batch * seq, cfg.d_model, widths.compute
    # Rotary tables: `.to(x.dtype)` is a no-op (the saved tensor is the buffer), unless autocast
    # runs q, k in a lower precision than the fp32 tables. Then cos and sin are cast afresh for
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
    # Autocast casts the norm's output separately for w1 and for w3. (Its cache only keeps casts
    # of leaf tensors, i.e. weights.) Without autocast both save the same tensor.
    mlp_inputs = 2 if widths.autocast else 1
    mlp = mlp_inputs * tokens * d * c + 4 * tokens * cfg.d_ff * c  # w1 x, w3 x, silu(w1 x), their product
    norms = 2 * norm_saved(tokens, d, widths, device)
    return {"attention": attention, "mlp": mlp, "norms": norms}


def matmul_weights_per_block(cfg: ModelConfig) -> int:
    """Parameters of one block's matmul weights: qkv, out projection, the MLP's (SwiGLU's three)."""
    return sum(i * o for i, o in block_linears(cfg).values())


def check_architecture(cfg: ModelConfig) -> None:
    """Refuse, in one line, a model with an architecture option set: the saved sets here are the default's tensors."""
    changed = cfg.non_default_architecture
    if changed:
        raise UserError(f"the closed forms model {MODELLED}, not {', '.join(changed)}: the dry run predicts it")


def check_shape(cfg: ModelConfig, batch: int, seq: int) -> None:
    """Refuse batch or seq below 1, or seq beyond the model's context."""
    if batch < 1 or seq < 1:
        raise UserError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if seq > cfg.context_length:
        raise UserError(f"seq {seq} > context_length {cfg.context_length}: lower seq or raise model.context_length")


def activation_bytes(
    cfg: ModelConfig, batch: int, seq: int, precision: str | int = "32-true", device: str = "cpu"
) -> ActivationReport:
    """Bytes autograd saves in one training forward of ToyLM(cfg) on (batch, seq) token ids.

    Counted as implemented in lmledger.model: each storage once, parameters and buffers left out.
    Checked exactly against measure_saved_activations on CPU.

    By component:

      embedding        the int64 token ids
      norms            every RMSNorm's saved tensors (norm_saved)
      attention        qkv input, the (q|k|v) storage, roped q and k, SDPA output and log-sum-exp,
                       rotary-table casts under autocast
      mlp              w1/w3 input(s) and the four (tokens, d_ff) tensors of SwiGLU
      logits_loss      lm_head input, the fp32 log_softmax output (the loss upcasts the logits;
                       the logits themselves are not saved), int64 targets, nll's 4-byte weight sum
      checkpoint_inputs  a checkpointed block keeps only its input (residual dtype); what its
                       recompute rebuilds in backward is a transient, counted in peak_bytes

    Autocast weight copies (precision *-mixed) are those of the lm_head and of blocks not
    checkpointed. Checkpointed blocks do not save theirs. The default architecture only (check_architecture).
    """
    check_architecture(cfg)
    check_shape(cfg, batch, seq)
    widths = activation_widths(precision)
    kind = check_device(device)
    tokens, d = batch * seq, cfg.d_model
    components = dict.fromkeys(COMPONENTS, 0)
    components["embedding"] = tokens * _INDEX_BYTES
    block = block_saved(cfg, batch, seq, widths, kind)
    copied_weights = cfg.vocab_size * d  # lm_head, tied or not
    for layer in range(cfg.n_layers):
        if cfg.is_checkpointed(layer):
            components["checkpoint_inputs"] += tokens * d * widths.residual
        else:
            for name, nbytes in block.items():
                components[name] += nbytes
            copied_weights += matmul_weights_per_block(cfg)
    components["norms"] += norm_saved(tokens, d, widths, kind)  # final norm
    components["logits_loss"] = (
        tokens * d * widths.compute  # lm_head input
        + tokens * cfg.vocab_size * FP32  # log_softmax output
        + tokens * _INDEX_BYTES  # targets
        + FP32  # nll_loss total_weight
    )
    weight_copies = copied_weights * widths.compute if widths.autocast else 0
    return ActivationReport(by_component=components, autocast_weight_copies=weight_copies)


# --------------------------------------------------------------------------------------------
# The measured twin
# --------------------------------------------------------------------------------------------

# Autograd nodes between an autocast weight copy and its parameter: the cast itself, and the
# views linear takes of it.
_COPY_OR_VIEW_NODES = frozenset(
    {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "AliasBackward0"}
)


def _copied_parameter(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf tensor that t is a cast/view of (an autocast weight copy); else None.

    The chain of autograd nodes leading to it must hold only casts and views.
    """
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
    """What measure_saved_activations saw. Bytes are unique storages.

    The field by_module charges each storage to the innermost module running when it was first saved.
    "" is the model's own forward: the loss, and the inputs torch.utils.checkpoint keeps.
    """

    activations: int = 0
    autocast_weight_copies: int = 0
    by_module: dict[str, int] = field(default_factory=dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (autograd saves a DTensor op's DTensors; untyped_storage() is their global size)."""
    shard = getattr(t, "_local_tensor", None)
    return shard if isinstance(shard, torch.Tensor) else t


@contextmanager
def measure_saved_activations(model: nn.Module) -> Iterator[SavedActivations]:
    """Record every tensor autograd saves while the block runs: forward inside, backward after.

    Storages of the model's parameters and buffers are left out. Casts of parameters (autocast
    weight copies) are totalled apart. A reference to each saved tensor is held until exit. So a
    freed storage's address cannot be reused and miscounted.

    Tensors saved by torch.utils.checkpoint's recompute in backward are not seen. Checkpoint packs
    them with its own hooks. The figure is the steady state held between forward and
    backward. That is what activation_bytes predicts.
    """
    result = SavedActivations()
    own = {storage_key(_local(t)) for t in (*model.parameters(), *model.buffers())}
    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}
    running = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(_local(t))
        nbytes = _local(t).untyped_storage().nbytes()
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
