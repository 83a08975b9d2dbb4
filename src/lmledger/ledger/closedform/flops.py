"""FLOPs of one step of the toy LM: on paper (two conventions) and measured with FlopCounterMode.

Two figures, never mixed.

Model FLOPs are the MFU convention (PaLM appendix B, nanoGPT, torchtitan). Per token:

    training step   6·N_matmul + 12·L·H·Q·T
    forward only    2·N_matmul + 4·L·H·Q·T
    N_matmul        L·(4·d² + 3·d·f) + V·d: the weights in matmuls (attention, SwiGLU, LM head)

The embedding table is a lookup, not a matmul. It counts only when tied, and then as the LM head.
So N_matmul is the same tied or untied. No recompute, no causal discount.

Every architecture option (model.ModelConfig) is covered. N_matmul is the weights of each block's Linears
(model.block_linears): GQA's smaller k and v make qkv d·(d + 2·kv_dim); a GeLU MLP has 2·d·f. Biases,
norms and a learned position table do no matmul and count nothing, as FlopCounterMode counts an addmm
as its matmul. GQA's attention is H query heads over repeated k and v: the same 4·L·H·Q·T.

Hardware FLOPs are what the kernels do, as torch.utils.flop_counter.FlopCounterMode counts them.
A matmul is 2·m·k·n. Its backward is twice that: grad of input and of weight. SDPA forward is 2
full T×T bmm: scores, and attention·V. There is no causal discount. Its backward is 5 bmm, as the
fused kernels recompute the scores. Elementwise ops are free: norms, RoPE, SiLU, softmax, loss.
Activation checkpointing adds the forward it recomputes in backward.

For the toy LM the two differ exactly. In training, with T = seq_len, Q = head dim, H·Q = d_model:

    hardware = model + 2·B·L·H·Q·T²          (one score recompute per SDPA backward)
                     + Σ over checkpointed blocks of their recomputed forward

Forward only, hardware = model.

Other MFU figures use other numerators (MFU_CONVENTIONS, docs/mfu.md). 6N alone (Kaplan,
Chinchilla). Causal attention counted half (Megatron-LM). And what nanoGPT's and torchtitan's
formulas give for this model. Each has a counted twin. FlopCounterMode's aten.mm total is 6N. With
causal_attention=True, its SDPA count covers only the unmasked entries. The counter itself, for any
step, is ledger/count/flopcounter.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.count.flopcounter import flop_counter
from lmledger.model import ModelConfig, ToyLM, block_linears, count_parameters

__all__ = [
    "COMPONENTS",
    "MFU_CONVENTIONS",
    "FlopReport",
    "MeasuredFlops",
    "analytic_flops",
    "causal_flops_per_token",
    "flops_per_token_by_convention",
    "matmul_parameters",
    "measure_flops",
    "count_flops_meta",
    "model_flops_per_token",
    "nanogpt_flops_per_token",
    "six_n_flops_per_token",
    "torchtitan_flops_per_token",
]

aten = torch.ops.aten

_BLOCK_COMPONENTS = ("qkv", "attn_scores", "attn_values", "attn_out", "mlp_w1", "mlp_w3", "mlp_w2")
COMPONENTS = (*_BLOCK_COMPONENTS, "lm_head")
# The block's matmul components and their Linear (model.block_linears): a GeLU MLP has no w3.
_LINEAR_COMPONENTS = {
    "qkv": "attn.qkv",
    "attn_out": "attn.out",
    "mlp_w1": "mlp.w1",
    "mlp_w3": "mlp.w3",
    "mlp_w2": "mlp.w2",
}

# Backward FLOPs as a multiple of forward FLOPs, per FlopCounterMode's formulas.
_BACKWARD_MULTIPLIER = {
    "qkv": 2,  # a linear layer: grad of input and grad of weight, one matmul each
    "attn_scores": 3,  # dQ = dS·K and dK = dSᵀ·Q, plus the kernel's recompute of S = Q·Kᵀ
    "attn_values": 2,  # dP = dO·Vᵀ and dV = Pᵀ·dO
    "attn_out": 2,
    "mlp_w1": 2,
    "mlp_w3": 2,
    "mlp_w2": 2,
    "lm_head": 2,
}


@dataclass(frozen=True)
class FlopReport:
    """FLOPs of one step.

    `by_component[name][phase]` is hardware FLOPs summed over layers. The phases "forward",
    "backward" and "recompute" (activation checkpointing) sum to `hardware`. The SDPA kernels' own
    score recompute is part of attn_scores' backward.
    """

    model: int
    hardware: int
    by_component: dict[str, dict[str, int]]
    tokens: int
    model_6n: int  # the 6N convention (no attention), see six_n_flops_per_token
    model_causal: int  # causal attention counted half, see causal_flops_per_token


@dataclass(frozen=True)
class MeasuredFlops:
    """What FlopCounterMode counted. `total` and `by_op` (keyed "aten.mm", ...) are exact.

    `by_module` is keyed by FlopCounterMode's module names ("ToyLM.blocks.0.mlp"). It is exact for a
    forward. In backward its module tracker leaks between siblings that share an input (w3 also gets
    w1's backward). It credits the root module with its forward only. It loses track under
    activation checkpointing.
    """

    total: int
    by_module: dict[str, int]
    by_op: dict[str, int]


def matmul_parameters(cfg: ModelConfig) -> int:
    """N_matmul: attention (qkv + out) and MLP weights of every layer, plus the LM head (biases left out)."""
    per_layer = sum(i * o for i, o in block_linears(cfg).values())
    return cfg.n_layers * per_layer + cfg.vocab_size * cfg.d_model


def _position_table(cfg: ModelConfig) -> int:
    """Parameters of a learned position table (0 under RoPE)."""
    return cfg.context_length * cfg.d_model if cfg.positions == "learned" else 0


def model_flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> int:
    """MFU-convention FLOPs per token: 6·N_matmul + 12·L·H·Q·T; forward only 2·N_matmul + 4·L·H·Q·T.

    Source: PaLM (Chowdhery et al. 2022) appendix B.
    """
    _check_seq_len(cfg, seq_len)
    attention = 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len  # scores and attention·V
    forward = 2 * matmul_parameters(cfg) + attention
    return 3 * forward if training else forward


# MFU conventions (docs/mfu.md). Published MFU figures count different FLOPs. Each function here is one
# numerator, per token of a training step (forward only: a third). perf/mfu is "palm".


def six_n_flops_per_token(cfg: ModelConfig, training: bool = True) -> int:
    """6·N_matmul per token (2·N_matmul forward only): attention's T×T products left out.

    Sources: Kaplan et al. 2020 §2.1, C ≈ 6N without the context-dependent term. Hoffmann et al. 2022
    (Chinchilla), C = 6ND. Kaplan's N also leaves out the LM head. Ours keeps it (a matmul), so
    this differs from "palm" by attention alone.
    """
    return (6 if training else 2) * matmul_parameters(cfg)


def causal_flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> int:
    """6·N_matmul + 6·L·H·Q·T per token (2·N_matmul + 2·L·H·Q·T forward only).

    PaLM's attention term halved: a causal mask leaves half of each T×T product to compute.
    Source: Megatron-LM, megatron/training/training.py num_floating_point_operations (core attention
    `seq_length / 2`, "only half of the mask is non-zero"). FlashAttention's
    benchmarks/benchmark_flash_attention.py counts causal attention at half for the same reason.
    The exact lower triangle has T(T+1)/2 entries, (T+1)/T of this term.
    measure_flops(..., causal_attention=True) counts it.
    """
    _check_seq_len(cfg, seq_len)
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len  # half of PaLM's 4·L·H·Q·T
    forward = 2 * matmul_parameters(cfg) + attention
    return 3 * forward if training else forward


def nanogpt_flops_per_token(cfg: ModelConfig) -> int:
    """What nanoGPT's GPT.estimate_mfu (karpathy/nanoGPT model.py) counts per token for this model.

    It counts 6·N + 12·L·H·Q·T, with N every parameter. Its get_num_params drops only the learned
    position table (wpe; ToyLM has one with positions "learned"). T is the model's context length
    (block_size), whatever the batch's sequence length. Against ours it adds the norms' gains and any
    biases. Untied, it also adds the token embedding table. (nanoGPT always ties it to the LM head.)
    """
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.context_length
    return 6 * (count_parameters(cfg) - _position_table(cfg)) + attention


def torchtitan_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """What torchtitan's get_dense_model_nparams_and_flops counts per token.

    Source: pytorch/torchtitan torchtitan/models/utils.py, the llama3 model's get_nparams_and_flops.
    Per token: 6·(N − the token embedding, unless tied) + 6·L·H·(2·Q)·T. T is the training sequence
    length. Against ours it adds the norms' gains and any biases. It drops every nn.Embedding child,
    so a learned position table too.
    """
    _check_seq_len(cfg, seq_len)
    embedding = (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model) + _position_table(cfg)
    attention = 6 * cfg.n_layers * cfg.n_heads * (2 * cfg.head_dim) * seq_len
    return 6 * (count_parameters(cfg) - embedding) + attention


# Each convention's numerator, in the order `account` prints them. perf/mfu is "palm", perf/hfu "hfu".
MFU_CONVENTIONS = {
    "6n": "6N (Kaplan, Chinchilla)",
    "palm": "6N + attention (PaLM)",
    "causal": "6N + attention / 2, causal (Megatron)",
    "hfu": "hardware, with recompute (HFU)",
    "nanogpt": "nanoGPT estimate_mfu",
    "torchtitan": "torchtitan",
}


def flops_per_token_by_convention(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """FLOPs per token of a training step on `seq_len` sequences, per MFU_CONVENTIONS entry.

    The "hfu" entry counts what the kernels do: analytic_flops' hardware figure. It includes
    attention's score recompute and activation checkpointing. It does not depend on the batch size.
    """
    hardware = analytic_flops(cfg, 1, seq_len, training=True).hardware
    return {
        "6n": six_n_flops_per_token(cfg),
        "palm": model_flops_per_token(cfg, seq_len),
        "causal": causal_flops_per_token(cfg, seq_len),
        "hfu": hardware // seq_len,
        "nanogpt": nanogpt_flops_per_token(cfg),
        "torchtitan": torchtitan_flops_per_token(cfg, seq_len),
    }


def analytic_flops(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    training: bool = True,
    checkpoint_early_stop: bool = True,
) -> FlopReport:
    """Model and hardware FLOPs of one step on `batch_size` sequences of `seq_len` tokens.

    With training=False it is a forward-only (validation) step. No backward, no checkpointing, as in
    ToyLM.forward under no_grad. `checkpoint_early_stop` mirrors torch.utils.checkpoint's default.
    The non-reentrant recompute stops once the last tensor saved for backward is back. The block's
    last matmul (w2) saves its inputs before it runs, so w2 is not recomputed.
    """
    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    _check_seq_len(cfg, seq_len)
    forward = {
        **_forward_flops_per_layer(cfg, batch_size, seq_len),
        "lm_head": 2 * batch_size * seq_len * cfg.d_model * cfg.vocab_size,
    }

    recomputed = set(_BLOCK_COMPONENTS)
    if checkpoint_early_stop:
        recomputed.discard("mlp_w2")
    checkpointed_layers = sum(cfg.is_checkpointed(i) for i in range(cfg.n_layers)) if training else 0

    by_component = {}
    for name in (n for n in COMPONENTS if n in forward):  # a GeLU MLP has no w3
        layers = cfg.n_layers if name in _BLOCK_COMPONENTS else 1
        by_component[name] = {
            "forward": layers * forward[name],
            "backward": layers * forward[name] * _BACKWARD_MULTIPLIER[name] if training else 0,
            "recompute": checkpointed_layers * forward[name] if name in recomputed else 0,
        }
    tokens = batch_size * seq_len
    return FlopReport(
        model=model_flops_per_token(cfg, seq_len, training) * tokens,
        hardware=sum(sum(phases.values()) for phases in by_component.values()),
        by_component=by_component,
        tokens=tokens,
        model_6n=six_n_flops_per_token(cfg, training) * tokens,
        model_causal=causal_flops_per_token(cfg, seq_len, training) * tokens,
    )


def _forward_flops_per_layer(cfg: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    tokens = batch_size * seq_len
    # One (T×Q)·(Q×T) or (T×T)·(T×Q) bmm per query head, the full square. Kernels skip the masked half;
    # the counting convention does not.
    attention = 2 * batch_size * cfg.n_heads * seq_len * seq_len * cfg.head_dim
    linears = block_linears(cfg)
    matmuls = {c: 2 * tokens * math.prod(linears[m]) for c, m in _LINEAR_COMPONENTS.items() if m in linears}
    return {**matmuls, "attn_scores": attention, "attn_values": attention}


def _check_seq_len(cfg: ModelConfig, seq_len: int) -> None:
    if not 1 <= seq_len <= cfg.context_length:
        raise UserError(
            f"sequence length {seq_len} is outside 1..context_length={cfg.context_length}: "
            "use a shorter sequence or raise model.context_length"
        )


@contextmanager
def _fused_sdpa_on_meta() -> Iterator[None]:
    """Route SDPA on meta tensors to the CPU flash op while counting.

    On meta tensors SDPA takes the math fallback: torch's fused-kernel chooser has no meta entry.
    Its autograd backward is 4 bmm, where the fused kernels count 5. The CPU flash op has meta
    kernels. Routed to it, a meta count follows the CPU/CUDA convention. This patches the
    attribute while counting, not a TorchFunctionMode. A mode is popped while torch.autograd.grad runs
    and would miss the checkpoint recompute in backward.
    """
    eager_sdpa = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or enable_gqa:
            return eager_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        output, _logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return output

    with mock.patch.object(F, "scaled_dot_product_attention", sdpa):
        yield


def measure_flops(
    model: nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor | None = None,
    training: bool = True,
    autocast_dtype: torch.dtype | None = None,
    causal_attention: bool = False,
) -> MeasuredFlops:
    """Count the FLOPs of one step of `model(idx, targets)` with FlopCounterMode.

    With training=True: forward in train mode, so activation checkpointing applies. Then the loss's
    backward, recompute included. Targets default to idx: FLOPs do not depend on token values. With
    training=False: forward under no_grad in eval mode. Works on CPU, CUDA and meta tensors.
    A torch.compile'd module is unwrapped to its eager module. The counter cannot see inside compiled
    graphs. Gradients go through torch.autograd.grad, so no .grad is written. The train/eval mode is
    restored. With causal_attention=True (CPU and meta only), causal SDPA calls count only the
    unmasked entries (flop_counter).
    """
    model = getattr(model, "_orig_mod", model)
    if training and not torch.is_grad_enabled():
        raise UserError("measuring a training step needs autograd: call measure_flops outside no_grad/inference_mode")
    if idx.ndim != 2:
        raise UserError(f"idx must be (batch, seq) token ids, got shape {tuple(idx.shape)}")
    if autocast_dtype is not None and idx.device.type not in ("cpu", "cuda"):
        raise UserError(f"autocast is not available on {idx.device.type} tensors: drop autocast_dtype")
    if causal_attention and idx.device.type not in ("cpu", "meta"):
        raise UserError(f"causal_attention counts CPU and meta SDPA only, not {idx.device.type}: count on the CPU")
    autocast = torch.autocast(idx.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    meta_routing = _fused_sdpa_on_meta() if idx.device.type == "meta" else nullcontext()
    was_training = model.training
    model.train(training)
    try:
        with flop_counter(causal_attention) as counter, meta_routing:
            if training:
                with autocast:
                    loss = model(idx, idx if targets is None else targets)
                params = [p for p in model.parameters() if p.requires_grad]
                if not params:
                    raise UserError("model has no trainable parameters: measure with training=False")
                torch.autograd.grad(loss, params)
            else:
                with torch.no_grad(), autocast:
                    model(idx, targets)
    finally:
        model.train(was_training)
    counts = counter.get_flop_counts()
    return MeasuredFlops(
        total=counter.get_total_flops(),
        by_module={name: sum(ops.values()) for name, ops in counts.items() if name != "Global"},
        by_op={str(op): n for op, n in counts.get("Global", {}).items()},
    )


def count_flops_meta(cfg: ModelConfig, batch_size: int, seq_len: int, training: bool = True) -> MeasuredFlops:
    """measure_flops on a ToyLM on the meta device: shapes only, no memory, no math."""
    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    _check_seq_len(cfg, seq_len)
    with torch.device("meta"):
        model = ToyLM(cfg)
        idx = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return measure_flops(model, idx, training=training)
