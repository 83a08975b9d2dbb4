"""Which kernels a training framework runs for the ops a dry run records: a setting of the GPU op model, per framework,
never a correction factor per source of measurements.

    attention         the kernel an attention op runs: "flash2" (FlashAttention-2, torch's SDPA flash backend),
                      "triton" (FlashAttention v1's algorithm in Triton),
                      "flash3" (FlashAttention-3), "cudnn" (cuDNN's fused attention), "efficient" (memory-efficient,
                      xformers' cutlass kernels) or "unfused" (two batched matmuls and a fused softmax, as Megatron-LM
                      and Megatron-DeepSpeed ran it before FlashAttention); "auto" takes torch's SDPA pick: flash2
    fuse_elementwise  runs of elementwise and reduction ops between two matmuls run as one kernel that moves only
                      what enters and leaves the run (torch.compile's Inductor; llm.c's and Megatron's hand-fused
                      layernorm, bias-GeLU and bias-dropout-add kernels)
    loss              how the cross-entropy loss runs: "eager", op by op as the dry run records PyTorch's
                      (log-softmax, then the targets' gather; backward, the gradient zero-filled and scattered, then
                      log-softmax's backward); "fused", one kernel each way (Inductor, llm.c's fused classifier,
                      flash-attn's fused cross-entropy, which llm-foundry's MPT defaults to), and with
                      fuse_elementwise the embedding's runs at the pass's ends fuse too; "megatron", Megatron-LM's
                      vocab-parallel cross-entropy, eager over the fp32 logits (price.py: its passes and all-reduces;
                      its hand-fused kernels are the blocks')
    host_forward_s, host_backward_s
                      the host's time to launch one kernel in the forward pass (Python, module calls, the dispatcher)
                      and in the backward pass (autograd's C++ engine), and per optimizer launch
    host_free_s       an op with no kernel (a view, a metadata query)
    fp8_matmuls       the linear layers' matmuls run in fp8 (torchao's float8 training, Transformer Engine): each
                      16-bit matmul of the dry run but the LM head's runs as a scaled e4m3 one, after its operands'
                      casts
    fp8_head          with fp8_matmuls, the LM head's matmuls run in fp8 too: Lightning's Transformer Engine plugin
                      swaps every nn.Linear, the tied head's included (lmledger's TiedTransformerEnginePrecision
                      re-ties it); the frameworks keep it 16-bit (price._lm_head)
    fp8_casts         how an fp8 run casts: "dynamic" (torchao's dynamic scaling: each matmul reads each operand's
                      amax, then casts it), "te" (Transformer Engine's delayed scaling: one kernel a tensor casts it and
                      writes its transpose too, recording the amax as it goes; the input and weight once forward, the
                      output's gradient once backward, the backward's matmuls reading those casts)
    ddp_overlap       DDP's gradient buckets all-reduce while backward runs (torch's DDP, FSDP); False: after it
                      (Megatron-LM's local DDP without --overlap-grad-reduce, as vTrain's runs were configured)
    dtensor_tp        the framework's tensor parallelism is DTensor's, as the dry run's is (torch's parallelize_module:
                      torchtitan, Lightning); False: its own TP layers (Megatron-LM's), which call each collective once,
                      so the host does not dispatch DTensor's views around a collective nor the functional wait
    pipeline_schedule the schedule a pipelined run of the framework takes (ledger.sharding.schedule): "1f1b"
                      (Megatron-LM, torch's pipelining), "deepspeed" (DeepSpeed's PipelineEngine, which
                      Megatron-DeepSpeed trains with)
    grad_reduce       how replicated data parallelism all-reduces the gradients: "buckets" (torch DDP's 25 MiB)
                      or "one" (Megatron-LM's one contiguous buffer; DeepSpeed's engine without ZeRO flattens the
                      gradients into buffers of up to 500M elements, one all-reduce each: its
                      buffered_allreduce_fallback, which Megatron-DeepSpeed's runs take)
    async_tp          tensor parallelism's all-gathers and reduce-scatters run in chunks under the matmuls they feed or
                      drain (torch's micro-pipeline TP under compile: torchtitan's enable_async_tensor_parallel;
                      Megatron-Core's --tp-comm-overlap), the copies that reorder their sequence dimension folded in
    loss_sync         the host reads each micro-batch's loss back (a device sync) before its backward, so the
                      forward's last kernels (the LM head's, the loss's) do not hide under the backward's launches:
                      DeepSpeed's engine from v0.9.3 to early 2024 (below)

Pure data: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmledger.errors import UserError

__all__ = ["FP8_CASTS", "FRAMEWORKS", "LOSSES", "Kernels", "kernels_for", "lightning_kernels"]

LOSSES = ("eager", "fused", "megatron")  # how a framework runs the cross-entropy loss (module doc)
FP8_CASTS = ("dynamic", "te")  # how an fp8 run casts its matmuls' operands (module doc)

# An eager aten op launched from Python: 8.6 us a call in torch.utils.benchmark (pytorch/pytorch#114860); a
# Python-dispatched Triton kernel about 15 us (meta-pytorch/torchcomms#2455). Autograd's engine launches backward
# kernels from C++, with no Python per op: taken at half the forward's. C/CUDA programs: "a couple of microseconds"
# a launch (ggml-org/llama.cpp#1192).
_EAGER_FORWARD_S, _EAGER_BACKWARD_S, _VIEW_S = 8.6e-6, 4.3e-6, 1.5e-6
_C_LAUNCH_S = 3e-6
# Megatron-DeepSpeed's host per dispatched op, views and backward ops alike, fitted on vTrain's 777 single- and
# multi-node rows (A100s): at small batch and width their steps take about 3.1-3.5 ms a layer per micro-batch whatever
# the GPU does (hidden 1024 and 2048, TP 1 and 2, 165 ops a layer at TP 1), which Megatron's Python, its TP mappings
# and DeepSpeed's checkpointing cost on their hosts. The fit over all rows of the simulation, the DTensor-only ops
# left out (dtensor_tp), Megatron's loss (loss), the loss read back (loss_sync): 21 us (refitted 2026-12-05 on
# vTrain's 777 rows: 20, 21 and 22 us give medians of 7.3%, 5.7% and 6.4%; rechecked 2026-12-06 with Megatron's loss
# priced as its code runs it: 6.7%, 5.4% and 6.7%).
_MEGATRON_DEEPSPEED_S = 21e-6


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
    grad_reduce: str = "buckets"
    fp8_matmuls: bool = False  # linear layers in fp8 (torchao float8, Transformer Engine): see price._price_matmul
    fp8_casts: str = "dynamic"  # "dynamic" (torchao) or "te" (Transformer Engine's delayed scaling): module doc
    fp8_head: bool = False  # the LM head in fp8 too (Lightning's Transformer Engine swap): module doc
    # The unfused attention's dropout on its probabilities, a kernel each way: Megatron-LM's GPT default
    # (--attention-dropout 0.1), which vTrain's profiled GPT keeps (its src/model/gpt_model.py: attention_dropout_prob)
    attention_dropout: bool = False
    # 16-bit weights in the kernels, fp32 main weights and moments in the optimizer (Megatron-LM's, price.py)
    master_weights: bool = False
    dtensor_tp: bool = True
    loss: str = "eager"  # "eager", "fused" or "megatron" (module doc)
    pipeline_schedule: str = "1f1b"
    # DeepSpeed's engine from v0.9.3 (May 2023, #3428: `self.losses.append(loss.mean().item())` in
    # DeepSpeedEngine.backward outside the accumulation boundary, which the PipelineEngine never reaches mid-batch)
    # until #5135 (February 2024): Megatron-DeepSpeed's runs of that time, vTrain's (DeepSpeed v0.9.5)
    loss_sync: bool = False
    async_tp: bool = False  # opt-in in every framework that has it: a run says so (published_runs reads its notes)

    def __post_init__(self) -> None:
        for field, value, allowed in (("loss", self.loss, LOSSES), ("fp8_casts", self.fp8_casts, FP8_CASTS)):
            if value not in allowed:
                raise ValueError(f"{field} {value!r}: choose one of {', '.join(allowed)}")

    def compiled(self) -> Kernels:
        """The same framework under torch.compile: elementwise runs fused, launched from Inductor's wrapper code."""
        if self.fuse_elementwise:
            return self
        return dataclasses.replace(self, name=f"{self.name}+compile", fuse_elementwise=True, loss="fused",
                                   host_forward_s=_C_LAUNCH_S,
                                   host_backward_s=_C_LAUNCH_S, host_free_s=0.0,
                                   description=f"{self.description}, under torch.compile")  # fmt: skip


_MEGATRON_DEEPSPEED = Kernels(
    "megatron-deepspeed", attention="unfused", fuse_elementwise=True, ddp_overlap=False, grad_reduce="one",
    attention_dropout=True, master_weights=True, dtensor_tp=False, loss="megatron", pipeline_schedule="deepspeed",
    loss_sync=True,
    host_forward_s=_MEGATRON_DEEPSPEED_S, host_backward_s=_MEGATRON_DEEPSPEED_S, host_free_s=_MEGATRON_DEEPSPEED_S,
    description="Megatron-DeepSpeed: Megatron-LM's kernels, the gradients flattened and all-reduced after backward "
    "(DeepSpeed's engine without ZeRO; vTrain's runs: no overlap with backward)",
)  # fmt: skip

FRAMEWORKS: dict[str, Kernels] = {
    k.name: k
    for k in (
        Kernels("pytorch", description="eager PyTorch (Lightning, HF Trainer): torch's SDPA, one kernel per op"),
        Kernels("compile", fuse_elementwise=True, loss="fused", host_forward_s=_C_LAUNCH_S,
                host_backward_s=_C_LAUNCH_S, host_free_s=0.0,
                description="torch.compile: SDPA, elementwise runs fused by Inductor"),
        Kernels("megatron", attention="unfused", fuse_elementwise=True, ddp_overlap=False, grad_reduce="one",
                attention_dropout=True, master_weights=True, dtensor_tp=False, loss="megatron",
                description="Megatron-LM before FlashAttention: batched-matmul attention with a fused softmax, fused "
                "layernorm, bias-GeLU and bias-dropout-add kernels, its gradient buffer all-reduced after backward"),
        _MEGATRON_DEEPSPEED,
        dataclasses.replace(_MEGATRON_DEEPSPEED, name="gpt-neox", loss_sync=False, description="EleutherAI's GPT-NeoX "
                            "(2022): Megatron-LM's model code and fused kernels on DeepSpeed's engine and pipeline"),
        Kernels("megatron-core", attention="flash3", fuse_elementwise=True, loss="fused", fp8_casts="te",
                master_weights=True, dtensor_tp=False,
                description="Megatron-Core with Transformer Engine: cuDNN/FA3 attention and fused kernels"),
        Kernels("nemo", attention="flash3", fuse_elementwise=True, loss="fused", fp8_casts="te", master_weights=True,
                dtensor_tp=False, description="NeMo (Megatron-Core, Transformer Engine)"),
        Kernels("llm-foundry", attention="triton", loss="fused", fp8_casts="te",
                description="MosaicML llm-foundry: its 2023 benchmarks' attn_impl default, triton (FlashAttention "
                "ported to Triton; scripts/train/benchmarking/submit_benchmarks.py), eager elementwise ops, and "
                "flash-attn's fused cross-entropy (ComposerMPTCausalLM's loss_fn default, fused_crossentropy)"),
        Kernels("torchtitan", attention="flash2",
                description="torchtitan: torch's SDPA (flash backend), eager unless compiled"),
        Kernels("nanogpt", attention="flash2",
                description="nanoGPT: torch's SDPA (flash backend), eager unless compiled"),
        Kernels("llm.c", attention="cudnn", fuse_elementwise=True, loss="fused", host_forward_s=_C_LAUNCH_S,
                host_backward_s=_C_LAUNCH_S, host_free_s=0.0,
                description="llm.c: C/CUDA, cuDNN attention, hand-fused kernels, no Python"),
    )
}  # fmt: skip


def kernels_for(framework: str, compiled: bool = False) -> Kernels:
    """The Kernels of a framework name (FRAMEWORKS), under torch.compile when `compiled`; UserError when unknown."""
    found = FRAMEWORKS.get(framework.strip().lower())
    if found is None:
        raise UserError(f"unknown framework {framework!r}: choose one of {', '.join(FRAMEWORKS)}")
    return found.compiled() if compiled else found


def lightning_kernels(precision: str | None, compiled: bool = False, fp8: bool = False) -> Kernels:
    """The kernels a Lightning run's step launches: eager PyTorch, or torch.compile's; its linears in fp8 under
    Transformer Engine's precisions (every nn.Linear a te.Linear, the tied head's too: delayed scaling) or with
    torchao's float8 (`fp8`: dynamic scaling, the head kept 16-bit)."""
    from lmledger.ledger.precision_table import transformer_engine

    kernels = kernels_for("pytorch", compiled=compiled)
    if transformer_engine(precision):
        return dataclasses.replace(kernels, fp8_matmuls=True, fp8_casts="te", fp8_head=True)
    return dataclasses.replace(kernels, fp8_matmuls=True) if fp8 else kernels
