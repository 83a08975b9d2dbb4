"""Why a step predicted on a GPU reaches the MFU it does: three factors whose product is the MFU (model FLOPs over
the dense peak times the step), then what holds the step outside the FLOP-heavy kernels.

    MFU = model FLOPs / FLOPs run  x  FLOPs run / (peak x kernel seconds)  x  kernel seconds / step

    model / run     what the kernels compute beyond the MFU's numerator: activation checkpointing's recompute, and
                    attention's backward recomputing its scores (FlashAttention's), which PaLM's count leaves out
                    (MFU over HFU)
    kernel rate     the FLOPs run over the seconds of the matmul and attention kernels, where all but a sliver of
                    them are, against the peak: tile and wave quantization, small and skinny shapes, attention
                    below its GEMMs' rate, the clock a loaded chip holds
    kernel share    the step's share in those kernels; the rest, per category (other compute: the memory-bound
                    elementwise ops, norms and loss; the optimizer; exposed communication and host; a pipeline's
                    bubble), each with the MFU the step would reach without it

Pure arithmetic: no torch.
"""

from __future__ import annotations

from lmledger.ledger.count.ops import ATTENTION, MATMUL

__all__ = ["KERNELS", "explain_mfu"]

KERNELS = (MATMUL, ATTENTION)  # the FLOP-heavy kernels: matmuls (fp8's too) and attention


def explain_mfu(seconds: dict[str, float], model_flops: float, run_flops: float, peak: float) -> dict | None:
    """The factors of a step's MFU (module doc) from its seconds per category, its model FLOPs (the MFU's
    numerator), the FLOPs its kernels run (recompute included) and the dense peak the MFU divides by; None for an
    empty step or one with no FLOPs."""
    step = sum(seconds.values())
    kernel_s = sum(seconds.get(c, 0.0) for c in KERNELS)
    if step <= 0 or kernel_s <= 0 or model_flops <= 0 or run_flops <= 0 or peak <= 0:
        return None
    rest = {c: s / step for c, s in seconds.items() if c not in KERNELS and s > 0}
    mfu = model_flops / (peak * step)
    return {
        "mfu": mfu,
        "model_over_run": model_flops / run_flops,
        "kernel_rate": run_flops / (peak * kernel_s),
        "kernel_share": kernel_s / step,
        "rest": rest,  # category: its share of the step
        "without": {c: mfu / (1 - share) for c, share in rest.items() if share < 1},  # the MFU were it free
    }
