"""The peak of one steady-state training step of ToyLM, phase by phase, and its CUDA twin.

The function peak_bytes walks one step after the first. Its docstring lists the phases. It has two measured
twins. One is live tensor bytes (ledger.count.memtrack), within 2% on CPU. The other is the CUDA
allocator's peak (measure_peak_cuda), within 15%. Workspaces and rounding are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.closedform.activations import (
    FP32,
    ActivationReport,
    Widths,
    activation_bytes,
    activation_widths,
    block_saved,
    check_architecture,
    check_device,
    check_shape,
    matmul_weights_per_block,
    norm_saved,
)
from lmledger.ledger.closedform.memory import (
    DEEPSPEED_STAGES,
    FP32_MASTER,
    largest_layer_params,
    model_precision,
    optimizer_states,
    state_bytes,
)
from lmledger.model import ModelConfig, count_parameters

__all__ = ["PeakReport", "measure_peak_cuda", "optimizer_kernel", "peak_bytes"]


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

    Terms:

        P, O, G         params, optimizer state, grads
        A               activation_bytes().total
        Wall, Wsaved    autocast copies of all matmul weights, and of those saved for backward
        NV              tokens x vocab
        c               compute bytes

    The largest of these totals wins:

    1. forward end: P + O + [G] + A + Wsaved + NV*(c + 4 if c < 4 else 4). [G]: Lightning zeroes
       grads after forward (grads_held_in_forward). Wsaved, not Wall: Lightning's autocast keeps no
       weight cache (Wall with autocast_cache=True). The logits and their fp32 copy live through
       log_softmax. Canaries: test_lightning_zeroes_grads_after_the_forward,
       test_lightning_autocast_keeps_no_weight_cache.
    2. loss backward: P + O + A + Wsaved + 2*NV*4 (nll's and log_softmax's fp32 gradients).
    3. recompute, per checkpointed block top down: the saved set below it + grads made above it.
       Plus its recomputed saved set and weight copies. Plus its SwiGLU backward's gradients:
       tokens x d and two of tokens x d_ff.
    4. embedding backward: P + O + G, plus 2*V*d for a tied embedding. (AccumulateGrad adds the
       head's and the embedding's gradients out of place.)
    5. optimizer step: P + O + G + the AdamW kernel's temporaries (optimizer_kernel). Foreach:
       sqrt(v) of every tensor (one state). For-loop: two of the largest tensor's state. Fused and
       SGD: none.

    Between these points, totals lie between the endpoints. Not modelled: per-op gradient
    temporaries, library workspaces, allocator rounding, FSDP's gathered parameters. `batch` is per
    rank. DeepSpeed runs *-mixed as its 16-bit model without autocast: activations of the *-true
    counterpart. The default architecture only (activations.check_architecture).
    """
    check_architecture(cfg)
    check_shape(cfg, batch, seq)
    precision = model_precision(precision, strategy)
    widths = activation_widths(precision)
    kind = check_device(device)
    n = count_parameters(cfg)
    state = state_bytes(
        n, precision, optimizer, strategy, world_size, momentum=momentum, largest_layer=largest_layer_params(cfg)
    )
    params, grads, opt = state["params"], state["grads"], state["optimizer"]
    resident = params + opt  # alive through the whole step
    grad_per_param = grads / n
    acts = activation_bytes(cfg, batch, seq, precision, kind)
    held = grads if grads_held_in_forward else 0
    candidates = {
        **_head_peaks(cfg, batch * seq, widths, acts, resident, held, autocast_cache),
        **_recompute_peaks(cfg, batch, seq, widths, kind, acts, resident, grad_per_param),
    }
    tied_grads = 2 * cfg.vocab_size * cfg.d_model * grad_per_param if cfg.tie_embeddings else 0
    candidates["embedding backward"] = resident + grads + tied_grads
    if strategy in DEEPSPEED_STAGES:  # the wrapped optimizer steps one flat fp32 partition per param group
        one_state = largest_tensor = FP32_MASTER * math.ceil(n / world_size)
    else:
        one_state = opt // max(optimizer_states(optimizer, momentum), 1)
        largest_tensor = largest_layer_params(cfg) * precision_table.precision(precision).state_bytes
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


def _head_peaks(
    cfg: ModelConfig,
    tokens: int,
    widths: Widths,
    acts: ActivationReport,
    resident: int,
    held_grads: int,
    autocast_cache: bool,
) -> dict[str, int]:
    """Phases 1 and 2: the end of forward, and the loss's backward."""
    logits, c, d, v = tokens * cfg.vocab_size, widths.compute, cfg.d_model, cfg.vocab_size
    copy_width = c if widths.autocast else 0
    logits_alive = logits * c + (logits * FP32 if c < FP32 else 0)  # the logits and their fp32 copy
    copies_alive = (
        (cfg.n_layers * matmul_weights_per_block(cfg) + v * d) * copy_width
        if autocast_cache
        else acts.autocast_weight_copies
    )
    return {
        "forward": resident + held_grads + acts.total + copies_alive + logits_alive,
        "loss backward": resident + acts.total + acts.autocast_weight_copies + 2 * logits * FP32,
    }


def _recompute_peaks(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    widths: Widths,
    device: str,
    acts: ActivationReport,
    resident: int,
    grad_per_param: float,
) -> dict[str, float]:
    """Phase 3: each checkpointed block's recompute, the blocks walked top down."""
    # Once the head's backward is done, its saved tensors are freed. The lm_head and final-norm
    # grads exist.
    tokens, d, v, c = batch * seq, cfg.d_model, cfg.vocab_size, widths.compute
    copy_width = c if widths.autocast else 0
    block_weights = matmul_weights_per_block(cfg)
    block_set = sum(block_saved(cfg, batch, seq, widths, device).values())
    block_copies = block_weights * copy_width
    still_saved = acts.total - acts.by_component["logits_loss"] - norm_saved(tokens, d, widths, device)
    copies_saved = acts.autocast_weight_copies - v * d * copy_width
    grads_made = (v * d + d) * grad_per_param
    # In a recomputed block's SwiGLU backward, alive together once w2's backward has freed the
    # product: the residual gradient, and the gradients of the product, of silu(w1 x) and of w3 x.
    mlp_backward = tokens * d * widths.residual + 2 * tokens * cfg.d_ff * c
    peaks = {}
    for layer in reversed(range(cfg.n_layers)):
        if cfg.is_checkpointed(layer):
            recomputed = block_set + block_copies
            live = resident + still_saved + copies_saved + grads_made
            peaks[f"recompute block {layer}"] = live + recomputed + mlp_backward
            still_saved -= tokens * d * widths.residual
        else:
            still_saved -= block_set
            copies_saved -= block_copies
        grads_made += (block_weights + 2 * d) * grad_per_param
    return peaks


def optimizer_kernel(device: str, fused: bool = False, foreach: bool | None = None) -> str:
    """The implementation torch.optim's AdamW / SGD run: "fused", "foreach" or "for-loop".

    As torch.optim.optimizer._default_to_fused_or_foreach decides when neither flag is given.
    Foreach on the devices torch lists for foreach kernels, CUDA among them. The per-tensor loop
    everywhere else, the CPU included. Fused only when asked for.
    """
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
    """Bytes AdamW's step holds beyond its state at its high-water mark (peak_bytes docstring).

    Foreach: sqrt(v) of every tensor at once, one state's worth. The per-tensor loop: sqrt(v_i) and
    its quotient for the largest tensor.
    """
    if optimizer.lower() not in ("adamw", "adam"):
        return 0
    kernel = optimizer_kernel(device, fused, foreach)
    if kernel == "foreach":
        return one_state
    if kernel == "for-loop":
        return 2 * largest_tensor
    return 0


def measure_peak_cuda(step_fn: Callable[[], object], device: torch.device | int | None = None) -> int:
    """Peak bytes allocated on a CUDA device while step_fn runs.

    It includes everything allocated before, such as parameters and optimizer state.
    """
    if not torch.cuda.is_available():
        raise UserError(
            "measure_peak_cuda needs a CUDA device; elsewhere ledger.count.memtrack.MemoryTracker measures the peak"
        )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step_fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
