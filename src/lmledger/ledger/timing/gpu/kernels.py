"""One kernel's seconds on a GPU: the GPU op-time model's price of a single op, from its shapes and bytes.

    matmul      tile and wave quantization: for each tile shape a GEMM library picks between (arch.TILES), the tiles
                of the output spread over the SMs in waves, each tile at the architecture's matmul efficiency and
                paying a fixed depth (arch.GEMM_K_FILL); split-K where too few tiles fill the SMs; the fastest choice,
                never faster than a full tile at the clock the chip sustains at its power limit (sustained_share),
                plus a launch floor, and never faster than moving its operands at the HBM share
    attention   FlashAttention-style kernels at their published efficiency (arch.Arch.attention), falling for short
                sequences and small head dims, counting the FLOPs the kernel does (causal: half), and held to the
                same sustained share; "unfused"
                (Megatron-era) attention as its two batched matmuls and a softmax
    streaming   everything else: bytes read and written at the architecture's HBM share, plus a floor per kernel

Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmledger.ledger.hardware.gpus import GpuSpec, datasheet_peak
from lmledger.ledger.timing.gpu.arch import (
    ARCHES,
    GEMM_FLOOR_S,
    GEMM_K_FILL,
    KERNEL_FLOOR_S,
    TENSOR_DTYPES,
    TILES,
    Arch,
)

__all__ = [
    "EAGER_SOFTMAX_LAUNCHES",
    "Chip",
    "attention_seconds",
    "chip_of",
    "matmul_seconds",
    "megatron_fused_softmax",
    "stream_seconds",
    "sustained_share",
    "unfused_attention_seconds",
]

_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# Sequence length at which a FlashAttention-style kernel runs at half its long-sequence efficiency: few query
# blocks per head leave SMs idle, and a causal mask's diagonal blocks do partial work (FlashAttention-2 and -3's
# throughput curves rise from 512 to 16k tokens, the causal ones more slowly). Head dim 64 runs at 0.8 of 128, 256 at
# 1.15 (FlashAttention-3's forward: about 497, 648 and 756 TFLOP/s at head dims 64, 128 and 256).
_SEQ_HALF = {False: 128, True: 512}
_HEAD_DIM = ((64, 0.8), (128, 1.0), (256, 1.15))
# Kernels whose share was measured at one head dim only (arch._FA1_AMPERE), taken at every head dim
_FLAT_HEAD_DIM = ("triton",)


@dataclass(frozen=True)
class Chip:
    """A GPU as the op-time model sees it: its datasheet (gpus.GpuSpec) and its architecture's shares (arch.Arch)."""

    spec: GpuSpec
    arch: Arch

    @property
    def sms(self) -> int:
        return self.spec.sms or 1

    @property
    def bandwidth(self) -> float:
        """The bytes/s a streaming kernel reaches."""
        return self.spec.bandwidth_bytes_per_s * self.arch.hbm

    def peak(self, dtype: str) -> float:
        found = datasheet_peak(self.spec, dtype, float32_matmul_precision="highest")
        if found is None:
            raise ValueError(f"{self.spec.name} has no dense {dtype} peak in the table")
        return found.flops_per_s


def chip_of(spec: GpuSpec) -> Chip:
    """The Chip of a GPU table entry; ValueError (one line) where the table lacks what the model needs."""
    if spec.sms is None or spec.arch not in ARCHES:
        raise ValueError(f"{spec.name} has no SM count or architecture in the GPU table, which the op model needs")
    return Chip(spec, ARCHES[spec.arch])


def sustained_share(dtype: str, chip: Chip) -> float:
    """The share of the dense peak a tensor-core kernel in `dtype` sustains at the chip's power limit: a full tile
    (arch.Arch.matmul) at the clock it holds under sustained load (arch.Arch.sustained_clock); 1.0 where none is set
    or the dtype runs on the CUDA cores. Power grows with FLOP/s, so a kernel slower than this never throttles."""
    clock = chip.arch.sustained_clock
    if clock is None or dtype not in TENSOR_DTYPES:
        return 1.0
    return chip.arch.matmul.get(dtype, chip.arch.matmul["fp32"]) * clock


def matmul_seconds(m: int, n: int, k: int, batch: int, dtype: str, chip: Chip, element_bytes: int = 2) -> float:
    """A [m, k] @ [k, n] product, `batch` times (bmm), in `dtype` (module doc)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    efficiency = chip.arch.matmul.get(dtype, chip.arch.matmul["fp32"])
    per_sm = chip.peak(dtype) / chip.sms * efficiency
    best = math.inf
    for rows, cols, relative in TILES:
        tiles = math.ceil(m / rows) * math.ceil(n / cols) * batch
        for split in _SPLITS:
            if split > 1 and tiles * split > 2 * chip.sms:
                break  # split-K only while the tiles leave SMs idle
            depth = math.ceil(k / split)
            waves = math.ceil(tiles * split / chip.sms)
            seconds = waves * 2 * rows * cols * (depth + GEMM_K_FILL) / (per_sm * relative)
            if split > 1:  # the partial products, written and summed in fp32
                seconds += 2 * split * m * n * batch * 4 / chip.bandwidth
            best = min(best, seconds)
    best = max(best, 2 * m * n * k * batch / (chip.peak(dtype) * sustained_share(dtype, chip)))
    moved = (m * k + k * n + m * n) * batch * element_bytes
    return max(best, moved / chip.bandwidth) + GEMM_FLOOR_S


def stream_seconds(nbytes: int, chip: Chip, kernels: int = 1) -> float:
    """A streaming kernel (or `kernels` of them) moving `nbytes` in all."""
    return kernels * KERNEL_FLOOR_S + nbytes / chip.bandwidth


def _head_dim_factor(head_dim: int) -> float:
    points = _HEAD_DIM
    if head_dim <= points[0][0]:
        return points[0][1] * head_dim / points[0][0]
    for (d0, f0), (d1, f1) in zip(points, points[1:], strict=False):
        if head_dim <= d1:
            return f0 + (f1 - f0) * (head_dim - d0) / (d1 - d0)
    return points[-1][1]


def attention_seconds(
    flops: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, backward: bool, kernel: str, dtype: str,
    chip: Chip,
) -> float:  # fmt: skip
    """A FlashAttention-style kernel: `flops` as torch's FLOP counter counts them (the full score matrix, causal or
    not); the kernel skips the masked half of a causal one."""
    forward_eff, backward_eff = chip.arch.attention.get(kernel, chip.arch.attention["flash2"])
    seq = min(seq_q, seq_k)
    efficiency = (backward_eff if backward else forward_eff) * seq / (seq + _SEQ_HALF[causal])
    by_head_dim = 1.0 if kernel in _FLAT_HEAD_DIM else _head_dim_factor(head_dim)
    efficiency = min(efficiency * by_head_dim, sustained_share(dtype, chip))
    work = flops / 2 if causal and seq_q == seq_k else flops
    return work / (attention_peak(dtype, chip) * efficiency) + KERNEL_FLOOR_S


def attention_peak(dtype: str, chip: Chip) -> float:
    """The peak an attention kernel's matmuls run at. fp32 inputs: SDPA's memory-efficient kernel (xFormers' CUTLASS
    kernel), whose fp32 GEMMs are three TF32 products each (OpMultiplyAddFastF32) where the chip has TF32, else
    SIMT fp32 (Volta, Turing)."""
    if dtype in ("bf16", "fp16", "fp8"):
        return chip.peak(dtype)
    return chip.peak("tf32") / 3 if chip.spec.peak_flops.get("tf32") else chip.peak("fp32")


def megatron_fused_softmax(batch_heads: int, seq: int) -> bool:
    """Whether Megatron's FusedScaleMaskSoftmax runs its fused kernel on a rank's causal scores (is_kernel_available,
    megatron/model/fused_softmax.py, Megatron-LM and Megatron-DeepSpeed alike): 16 < seq <= 4096, seq a multiple of 4,
    and the rank's micro-batch x heads a multiple of the kernel's batches a block (get_batch_per_block: 8 rows of up to
    128 keys, else 4). Otherwise it runs torch's ops (forward_torch_softmax): TP 8 of 16 heads at micro-batch 1 does."""
    per_block = 8 if seq <= 128 else 4
    return 16 < seq <= 4096 and seq % 4 == 0 and batch_heads % per_block == 0


# forward_torch_softmax, five kernels for the fused one: to fp32 (read 2 bytes a score, write 4), scale, mask, softmax
# (read and write 4 each) and back to 16 bits (read 4, write 2): 36 bytes a score, 32 more than the fused kernel's
# 16-bit read and write; backward the five in reverse, the softmax's reading the gradient and its fp32 output: 40, 34
# more than the fused backward's 6
EAGER_SOFTMAX_LAUNCHES = 4
_EAGER_SOFTMAX_BYTES = {False: 32, True: 34}


def unfused_attention_seconds(
    batch_heads: int, seq: int, head_dim: int, backward: bool, dtype: str, chip: Chip, element_bytes: int = 2,
    dropout: bool = False, fused_softmax: bool = True,
) -> float:  # fmt: skip
    """Attention as Megatron-era trainers ran it: scores = q k^T and out = p v as batched matmuls, with a fused
    scale-mask-softmax between them (read and write the scores once); backward: four batched matmuls and the
    softmax's backward (read the probabilities and their gradient, write the scores' gradient). With `dropout`, the
    probabilities' dropout is a kernel of its own each way (torch's native_dropout: read them, write them and a
    one-byte mask; its backward reads the gradient and the mask and writes the gradient). Without `fused_softmax`
    (megatron_fused_softmax), the softmax is torch's eager ops in fp32."""
    scores = matmul_seconds(seq, seq, head_dim, batch_heads, dtype, chip, element_bytes)
    values = matmul_seconds(seq, head_dim, seq, batch_heads, dtype, chip, element_bytes)
    square = batch_heads * seq * seq * element_bytes
    drop = stream_seconds(2 * square + square // element_bytes, chip) if dropout else 0.0
    eager = 0.0
    if not fused_softmax:
        extra = batch_heads * seq * seq * _EAGER_SOFTMAX_BYTES[backward]
        eager = stream_seconds(extra, chip, EAGER_SOFTMAX_LAUNCHES)
    if not backward:
        return scores + values + stream_seconds(2 * square, chip) + drop + eager
    return 2 * (scores + values) + stream_seconds(3 * square, chip) + drop + eager
