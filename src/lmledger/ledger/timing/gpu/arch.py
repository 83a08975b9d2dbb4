"""What a GPU architecture's kernels reach, as shares of the datasheet's dense peak and bandwidth: the figures the GPU
op-time model (ledger/timing/gpu) prices ops with. Each carries its source; a figure fitted to measurements says what
it was fitted on. The chip's own numbers (SMs, L2, peaks, bandwidth) are in ledger/hardware/gpus.py.

    matmul      dtype -> efficiency of a full-size tile at long K, of the dense peak (kernels.matmul_seconds adds the
                tile, wave, K and launch effects that take a real GEMM below it)
    hbm         the share of HBM bandwidth a streaming (elementwise, reduction) kernel reaches
    attention   kernel -> (forward, backward) efficiency of a FlashAttention-style kernel at head dim 128 and long
                sequences, of the dense peak, counting the FLOPs the kernel does (causal: half)
    sustained_clock
                the share of the clock the datasheet's peak is computed at that the chip holds through a training
                step, at its power limit; None where the shares above were measured under such load. A tensor-core
                kernel never runs faster than a full tile at that clock (kernels.sustained_share)

Pure data: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ARCHES",
    "Arch",
    "GEMM_FLOOR_S",
    "GEMM_K_FILL",
    "KERNEL_FLOOR_S",
    "TENSOR_DTYPES",
    "TILES",
    "attention_kernels",
]


@dataclass(frozen=True)
class Arch:
    name: str
    matmul: Mapping[str, float]
    hbm: float
    attention: Mapping[str, tuple[float, float]]
    source: str  # where the figures come from, one line, for the prediction's `how`
    sustained_clock: float | None = None


# The tile shapes a GEMM library chooses between, (rows, columns, efficiency relative to the largest). With the two
# constants below, fitted by grid search on XLA's measured H100 bf16 table (openxla/xla
# xla/service/gpu/model/matmul_interpolator_data.h, key sm_90: 375 shapes, m, n, k in 256..4096, batch 1-4), with
# the H100 matmul efficiency below: median |error| 2.8%, worst 28% (a skinny 256 x 512 x 4096). The same constants
# on XLA's B200 table (sm_100, 148 SMs), with only the efficiency refitted: median 3.9%.
TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 1.0), (128, 64, 0.8), (64, 128, 0.8), (64, 64, 0.6))
GEMM_K_FILL = 192  # a tile's fixed work (pipeline fill, epilogue), as K steps: a tile of depth K costs K + 192
GEMM_FLOOR_S = 5e-6  # a GEMM launch's fixed cost (library heuristics, launch, tail): the fit's
# A streaming kernel's fixed cost: about 1.2 us back to back inside a CUDA graph (pytorch/pytorch#161104: x + y on
# 1024 floats, 2,000 times); eager launches of dependent kernels add about a microsecond of ramp and tail.
KERNEL_FLOOR_S = 2e-6

# The dtypes a tensor core runs: a power-limited clock caps them (kernels.sustained_share). FP32 on the CUDA cores
# draws less: an 8xH100 node burning FP32 matmuls drew 580-650 W a GPU of its 700 W (huggingface/gpu-fryer#4).
TENSOR_DTYPES = ("bf16", "fp16", "fp8", "tf32")
# Hopper under sustained load. The 989 TFLOP/s peak is computed at 1830 MHz (stas00/ml-engineering,
# compute/accelerator, "Clock speed"); at its 700 W limit a busy GH100 does not hold it: H200 runners "cannot
# reliably sustain a locked 1830 MHz graphics/SM clock under full load ... 1500 MHz is a more realistic sustained
# locked-clock target" (tile-ai/TileOPs#1588), an H800's clock fell from 1980 to 1575 MHz when its power passed the
# limit (deepseek-ai/DeepGEMM#120), "matmuls on the H100 are primarily not compute or bandwidth limited, they are
# power limited" (Horace He, thonking.ai, 2024: random data throttles where zeros do not). The matmul shares below
# were measured on short GEMMs (XLA's table: up to 4096^3, a fifth of a millisecond each; stas00's MAMF: 100
# iterations of its best shape, about 0.14 ms each), which finish before the limit pulls the clock down; a training
# step's GEMMs run back to back for seconds. A GEMM loop alone, at about 1500 MHz, reaches 0.88 x 1500/1830 = 0.72
# of the peak: a square 10240 bf16 product measured 720 TFLOP/s on an H100 SXM (torch 2.7:
# zzc0721/torch-performance-test-data#79). A training step runs lower: its HBM and NVLink traffic draw on the same
# 700 W, and the published H100 runs' GEMM-bound steps are slower than the loop's rate in all four sources that have
# them. So the clock is fitted, the only Hopper constant fitted to runs: 1300 MHz minimises the mean of the median
# |error| of the two sources with ten or more H100 rows (benchmarks/published_runs.py on runs-dev.csv, 2026-12-05:
# llm-foundry's 39 and torchtitan's 15 rows, 6.3%; 1250, 1275, 1325 and 1350 MHz give 7.4%, 6.7%, 7.1% and 7.4%;
# 1500 gave 12.0%), where llm.c's and modded-nanogpt's H100 rows are 3.1% and 5.5% fast. 0.88 x 1300/1830 = 0.625 of
# the bf16 peak, 618 TFLOP/s.
_HOPPER_SUSTAINED_CLOCK = 1300 / 1830

# FlashAttention-2 on the A100 (Dao 2023, arXiv 2307.08691): 50-73% of the peak over head dims 64 and 128, causal
# and not, forward and backward; the forward at the top of that range, the backward lower.
_FA2_AMPERE = (0.70, 0.60)
# FlashAttention-2's kernels on Hopper use none of its features: torch's SDPA flash backend ran its forward at 287-304
# TFLOP/s on an H100 at head dim 128, sequence 1k-16k (pytorch/benchmark#2296), 0.29-0.31 of 989; FA2's paper says
# up to 335 TFLOP/s there. Backward: as on the A100, 0.85 of the forward.
_FA2_HOPPER = (0.31, 0.27)
# FlashAttention's Triton port (llm-foundry's attn_impl "triton", the default of its 2023 benchmarks), from Triton's
# own regression table of its fused attention on an A100 (openai/triton python/test/regression/test_performance.py,
# early 2023, the pre-MLIR kernels llm-foundry pinned): causal, fp16, head dim 64, 4096 tokens, 0.37 of the peak
# forward and 0.25 backward (the masked half not counted). Long sequences: 0.37 / (4096 / (4096 + 512)) = 0.42 and
# 0.25 / 0.889 = 0.28 (kernels._SEQ_HALF); no measurement at another head dim, so taken at every one
# (kernels._FLAT_HEAD_DIM). On Hopper, which it predates, at FlashAttention-2's share there scaled alike (0.31 / 0.70).
_FA1_AMPERE = (0.42, 0.28)
_FA1_HOPPER = (0.185, 0.125)
# FlashAttention-3 on the H100 (Shah et al. 2024, arXiv 2407.08608), head dim 128, non-causal, long sequences:
# forward about 648 TFLOP/s, backward about 561: 0.66 and 0.57. cuDNN's fused attention reaches the same there.
_FA3_HOPPER = (0.66, 0.57)

ARCHES: dict[str, Arch] = {
    arch.name: arch
    for arch in (
        # A100 bf16/fp16: two measurements bracket it, a square 8192 fp16 product at 74% of 312 TFLOP/s with PyTorch
        # in 2021 (mli/transformers-benchmarks; 0.76 puts kernels.matmul_seconds there) and the best shape of a
        # brute-force search at 86.9% in 2025 (stas00/ml-engineering, compute/accelerator, torch 2.6; 0.925). The
        # published A100 runs (2021-2024) sit at the lower end: 0.76 minimises the mean of five sources' median
        # |error| (vTrain, Korthikanti, torchtitan, llm-foundry, llm.c; benchmarks/published_runs.py on
        # shared/published/runs-dev.csv, 2026-12-04: 9.1%; 0.74 to 0.82 give 9.1% to 9.8%), a constant fitted to
        # those rows, which lands on mli's measurement. Rechecked 2026-12-06 with the model as it now stands: 0.74,
        # 0.76, 0.78, 0.80 and 0.82 give that mean 6.5%, 5.9%, 5.7%, 5.7% and 6.4%, and vTrain's 777 rows 6.0%, 5.7%,
        # 6.0%, 6.0% and 6.5%: flat from 0.76 to 0.80 (Korthikanti's 8 rows and llm.c's 4 pull up, torchtitan's 8
        # down); kept at 0.76, mli's measurement and vTrain's best. Again after Megatron's loss was priced (2026-12-06):
        # 0.74, 0.76 and 0.78 give 6.8%, 6.2% and 5.6%, vTrain 5.3%, 5.3% and 5.4%: kept.
        # TF32: mli's square 8192 at 74% of 156: 0.76.
        # HBM: `a * 1.2` at 79% of the A100's 2,039 GB/s and 89% of the A800's 1,935 (mli): 0.85. fp32 (no tensor
        # cores): none found.
        # No sustained clock: mli's square 8192 products take about 5 ms each, and the runs are training steps, so
        # 0.76 is a rate under sustained load already.
        Arch(
            "ampere",
            {"bf16": 0.76, "fp16": 0.76, "tf32": 0.76, "fp32": 0.85},
            0.85,
            {
                "flash2": _FA2_AMPERE,
                "flash3": _FA2_AMPERE,
                "cudnn": _FA2_AMPERE,
                "efficient": (0.50, 0.40),
                "triton": _FA1_AMPERE,
            },
            "A100 GEMMs per stas00's MAMF (86.9% best), HBM at 85%, FlashAttention-2 at 70%/60%",
        ),
        # H100/H200: bf16 fitted with the tiles above on XLA's sm_90 table and held to the best bf16 GEMM over a
        # shape search, 794.5 of 989 TFLOP/s (80.3%, stas00, "H200 is the same"): 0.88 puts that shape at 81%.
        # fp8: 1402.6 of 1979 (70.9%) at 1024 x 9216 x 14336 on the H100 (stas00): 0.845 (the H200's 73.4% at another
        # shape would give more; the H100's is kept). TF32: XLA's f32 entries (TF32) at 4096^3, 403 TFLOP/s of
        # 494.7: 0.89 (its smaller shapes run slower than the bf16-fitted tiles say: tf32 is rough). HBM: a
        # device-to-device copy moved 4.3 of the H200's 4.8 TB/s (this workplace's H200, 2026-10-28).
        Arch(
            "hopper",
            {"bf16": 0.88, "fp16": 0.88, "fp8": 0.845, "tf32": 0.89, "fp32": 0.85},
            0.90,
            {
                "flash2": _FA2_HOPPER,
                "flash3": _FA3_HOPPER,
                "cudnn": _FA3_HOPPER,
                "efficient": (0.25, 0.20),
                "triton": _FA1_HOPPER,
            },
            "Hopper GEMMs fitted on XLA's H100 table, at most a full tile at the clock a training step holds at the "
            "700 W limit (1300 of 1830 MHz, fitted), HBM at 90%, FlashAttention-2 at 31%/27% and -3 at 66%/57%",
            sustained_clock=_HOPPER_SUSTAINED_CLOCK,
        ),
        # B200: bf16 and fp8 (e4m3) refitted on XLA's sm_100 table (medians 3.9% and 8.5% over 375 shapes; its best
        # bf16 entry is 74% of 2.25 PFLOP/s). No attention, TF32 or HBM measurement found: Hopper's assumed. Its
        # clock falls under sustained load too (1965 to about 1580 MHz over back-to-back attention kernels,
        # flashinfer-ai/flashinfer#2899), but 0.70 already sits below its MAMF (77.6%, stas00) and no published B200
        # run checks a sustained share: none set.
        Arch(
            "blackwell",
            {"bf16": 0.70, "fp16": 0.70, "fp8": 0.60, "tf32": 0.70, "fp32": 0.85},
            0.90,
            {
                "flash2": _FA3_HOPPER,
                "flash3": _FA3_HOPPER,
                "cudnn": _FA3_HOPPER,
                "efficient": (0.25, 0.20),
                "triton": _FA1_HOPPER,
            },
            "B200 GEMMs fitted on XLA's B200 table; attention and HBM assumed as on Hopper",
        ),
    )
}
# No measurement found for Ada, Turing, Volta or CDNA 3: Ampere's shares are assumed, and the prediction says so.
for _name in ("ada", "turing", "volta", "cdna3"):
    ARCHES[_name] = Arch(_name, ARCHES["ampere"].matmul, ARCHES["ampere"].hbm, ARCHES["ampere"].attention,
                         f"{_name}: no measurement found, the A100's shares assumed")  # fmt: skip


def attention_kernels() -> tuple[str, ...]:
    """The attention kernels a framework setting may name (frameworks.Kernels.attention), besides "unfused"."""
    return tuple(ARCHES["hopper"].attention)
