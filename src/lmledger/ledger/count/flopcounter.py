"""FlopCounterMode for any step: the formulas torch's registry lacks, and a counter that changes nothing.

flop_counter() is FlopCounterMode with CPU SDPA (torch counts it 0) and torch._grouped_mm (MoE experts)
counted, optionally over the entries a causal mask keeps. StepFlopCounter counts a real training step
without decomposing an op or hooking modules, so the step computes what it computes unmeasured. The toy
LM's formulas and its counted twin are ledger/closedform/flops.py. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["CPU_SDPA_FLOP_FORMULAS", "GROUPED_MM_FLOP_FORMULAS", "StepFlopCounter", "flop_counter"]

aten = torch.ops.aten


# FlopCounterMode counts CPU SDPA as 0: the CPU flash-attention ops have no formula (pytorch issue
# 195460; canary test_cpu_flash_attention_has_no_flop_formula). Give them torch's own SDPA formulas.
def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_attention_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_SDPA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flop,
}


def _causal_entries(query_shape, key_shape, is_causal: bool) -> tuple[int, int]:
    """(entries a causal mask leaves, all entries) of one head's score matrix.

    PyTorch's is_causal mask is lower triangular from the top-left corner. Query row i sees
    min(i + 1, S) keys.
    """
    s_q, s_k = query_shape[2], key_shape[2]
    if not is_causal:
        return s_q * s_k, s_q * s_k
    return sum(min(i + 1, s_k) for i in range(s_q)), s_q * s_k


def _causal_flash_attention_flop(query_shape, key_shape, value_shape, dropout_p=0.0, is_causal=False, *args,
                                 out_shape=None, **kwargs) -> int:  # fmt: skip
    kept, full = _causal_entries(query_shape, key_shape, is_causal)
    return sdpa_flop_count(query_shape, key_shape, value_shape) * kept // full


def _causal_flash_attention_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, out=None, logsumexp=None, dropout_p=0.0, is_causal=False,
    *args, out_shape=None, **kwargs,
) -> int:  # fmt: skip
    kept, full = _causal_entries(query_shape, key_shape, is_causal)
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) * kept // full


# The same ops counted over the entries a causal mask keeps: the work as the causal convention sees
# it, read off the real step's SDPA calls and their is_causal flag. Every bmm in the formulas is
# linear in the number of score entries, so scaling by kept / full is exact.
_CAUSAL_CPU_SDPA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _causal_flash_attention_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _causal_flash_attention_backward_flop,
}


def _grouped_mm_flop(a_shape, b_shape, offs_shape=None, *args, out_shape=None, **kwargs) -> int:
    """2 · rows · contraction · columns over all groups.

    Each row (2D × 3D) or contraction slice (2D × 2D, the weight gradient) meets one group's matrix.
    Exact when the offsets cover every row, as in transformers' grouped_mm experts. The kernel skips
    rows past the last offset.
    """
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


# FlopCounterMode has no formula for _grouped_mm: it counts 0. flop_counter's mapping
# takes this one (torch/utils/flop_counter.py, custom_mapping).
GROUPED_MM_FLOP_FORMULAS: dict[object, Callable[..., int]] = {aten._grouped_mm: _grouped_mm_flop}


def flop_counter(causal_attention: bool = False) -> FlopCounterMode:
    """A silent FlopCounterMode that also counts CPU SDPA.

    With `causal_attention`, CPU (and meta) SDPA calls made with is_causal count only the unmasked
    entries. That is what the causal convention counts, not what every kernel executes. PyTorch's CPU
    flash kernel skips key blocks of 512 past the diagonal. Below 512 tokens it computes the full
    square. FlashAttention's CUDA kernels skip the tiles above it.
    """
    formulas = _CAUSAL_CPU_SDPA_FLOP_FORMULAS if causal_attention else CPU_SDPA_FLOP_FORMULAS
    # torch._grouped_mm (transformers' MoE experts) has no formula in torch's registry
    return FlopCounterMode(display=False, custom_mapping={**formulas, **GROUPED_MM_FLOP_FORMULAS})


class _CountWithoutDecomposing(TorchDispatchMode):
    """Counts registered ops as FlopCounterMode does; runs every op as it is."""

    def __init__(self, counter: FlopCounterMode) -> None:
        super().__init__()
        self.counter = counter

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile'd code run compiled under the count (its runtime's ops are counted): by default
        dynamo runs a frame met under a dispatch mode eager for good (canary
        test_dynamo_runs_a_frame_eager_for_good_under_a_dispatch_mode)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet in self.counter.flop_registry:
            self.counter.flop_counts["Global"][packet] += self.counter.flop_registry[packet](
                *args, **(kwargs or {}), out_val=out
            )
        return out


class StepFlopCounter(FlopCounterMode):
    """FlopCounterMode for a real training step: the same registry (CPU SDPA included), total only.

    FlopCounterMode runs an op without a FLOP formula through its decomposition (`func.decompose()`).
    A fused kernel is then replaced by its parts. The step computes other bits (canary
    test_flop_counter_decomposes_what_it_cannot_count). Its ModuleTracker hooks every module into the
    autograd graph. A measurement must not change training. So this counter runs each op as it is,
    and keeps no per-module breakdown.
    """

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping={**CPU_SDPA_FLOP_FORMULAS, **GROUPED_MM_FLOP_FORMULAS})

    def __enter__(self) -> StepFlopCounter:
        self.flop_counts.clear()
        self.mode = _CountWithoutDecomposing(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        mode, self.mode = self.mode, None
        mode.__exit__(*args)
