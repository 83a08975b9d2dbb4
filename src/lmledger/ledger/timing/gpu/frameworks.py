"""Which kernels a training framework runs for the ops a dry run records: a setting of the GPU op model, per framework,
never a correction factor per source of measurements.

    attention         the kernel an attention op runs: "flash2" (FlashAttention-2, torch's SDPA flash backend),
                      "flash3" (FlashAttention-3), "cudnn" (cuDNN's fused attention), "efficient" (memory-efficient,
                      xformers' cutlass kernels) or "unfused" (two batched matmuls and a fused softmax, as Megatron-LM
                      and Megatron-DeepSpeed ran it before FlashAttention); "auto" takes torch's SDPA pick: flash2
    fuse_elementwise  runs of elementwise and reduction ops between two matmuls run as one kernel that moves only
                      what enters and leaves the run (torch.compile's Inductor; llm.c's and Megatron's hand-fused
                      layernorm, bias-GeLU and bias-dropout-add kernels)
    host_forward_s, host_backward_s
                      the host's time to launch one kernel in the forward pass (Python, module calls, the dispatcher)
                      and in the backward pass (autograd's C++ engine), and per optimizer launch
    host_free_s       an op with no kernel (a view, a metadata query)
    ddp_overlap       DDP's gradient buckets all-reduce while backward runs (torch's DDP, FSDP); False: after it
                      (Megatron-LM's local DDP without --overlap-grad-reduce, as vTrain's runs were configured)

Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmledger.errors import UserError

__all__ = ["FRAMEWORKS", "Kernels", "kernels_for"]

# An eager aten op launched from Python: 8.6 us a call in torch.utils.benchmark (pytorch/pytorch#114860); a
# Python-dispatched Triton kernel about 15 us (meta-pytorch/torchcomms#2455). Autograd's engine launches backward
# kernels from C++, with no Python per op: taken at half the forward's. C/CUDA programs: "a couple of microseconds"
# a launch (ggml-org/llama.cpp#1192).
_EAGER_FORWARD_S, _EAGER_BACKWARD_S, _VIEW_S = 8.6e-6, 4.3e-6, 1.5e-6
_C_LAUNCH_S = 3e-6


@dataclass(frozen=True)
class Kernels:
    name: str
    attention: str = "auto"
    fuse_elementwise: bool = False
    host_forward_s: float = _EAGER_FORWARD_S
    host_backward_s: float = _EAGER_BACKWARD_S
    host_free_s: float = _VIEW_S
    ddp_overlap: bool = True
    description: str = ""
    serial_host: bool = False  # the host waits for each kernel before launching the next

    def compiled(self) -> Kernels:
        """The same framework under torch.compile: elementwise runs fused, launched from Inductor's wrapper code."""
        if self.fuse_elementwise:
            return self
        return Kernels(f"{self.name}+compile", self.attention, True, _C_LAUNCH_S, _C_LAUNCH_S, 0.0,
                       self.ddp_overlap, f"{self.description}, under torch.compile")  # fmt: skip


FRAMEWORKS: dict[str, Kernels] = {
    k.name: k
    for k in (
        Kernels("pytorch", description="eager PyTorch (Lightning, HF Trainer): torch's SDPA, one kernel per op"),
        Kernels(
            "compile",
            "auto",
            True,
            _C_LAUNCH_S,
            _C_LAUNCH_S,
            0.0,
            description="torch.compile: SDPA, elementwise runs fused by Inductor",
        ),
        Kernels(
            "megatron",
            "unfused",
            True,
            _EAGER_FORWARD_S,
            _EAGER_BACKWARD_S,
            _VIEW_S,
            False,
            "Megatron-LM before FlashAttention: batched-matmul attention with a fused softmax, fused layernorm, "
            "bias-GeLU and bias-dropout-add kernels, gradients all-reduced after backward",
        ),
        Kernels(
            "megatron-deepspeed",
            "unfused",
            True,
            _EAGER_FORWARD_S,
            _EAGER_BACKWARD_S,
            _VIEW_S,
            False,
            "Megatron-DeepSpeed: Megatron-LM's kernels (vTrain's runs: no gradient bucketing)",
        ),
        Kernels(
            "megatron-core",
            "flash3",
            True,
            description="Megatron-Core with Transformer Engine: cuDNN/FA3 attention and fused kernels",
        ),
        Kernels("nemo", "flash3", True, description="NeMo (Megatron-Core, Transformer Engine)"),
        Kernels("llm-foundry", "flash2", description="MosaicML llm-foundry: flash-attn 2, eager elementwise ops"),
        Kernels("torchtitan", "flash2", description="torchtitan: torch's SDPA (flash backend), eager unless compiled"),
        Kernels("nanogpt", "flash2", description="nanoGPT: torch's SDPA (flash backend), eager unless compiled"),
        Kernels(
            "llm.c",
            "cudnn",
            True,
            _C_LAUNCH_S,
            _C_LAUNCH_S,
            0.0,
            description="llm.c: C/CUDA, cuDNN attention, hand-fused kernels, no Python",
        ),
    )
}


def kernels_for(framework: str, compiled: bool = False) -> Kernels:
    """The Kernels of a framework name (FRAMEWORKS), under torch.compile when `compiled`; UserError when unknown."""
    found = FRAMEWORKS.get(framework.strip().lower())
    if found is None:
        raise UserError(f"unknown framework {framework!r}: choose one of {', '.join(FRAMEWORKS)}")
    return found.compiled() if compiled else found
