"""A fit config's step priced on a GPU by the GPU op-time model (ledger/timing/gpu): what `account`, `plan
train-time`, `plan max-batch` and `sweep --plan` print where a config runs on a GPU (this machine's or one it lacks),
or `--gpu NAME` names one.

`target_gpu(accelerator, gpu)`: which GPU a prediction is for. `toy_gpu_step(spec, argv, gpu)`: lmledger's ToyLM at
its config's layout (ledger/timing/gpu/layout: per-rank dry runs of one and two layers, extrapolated). `ops_gpu_step`:
any other module's dry-run ops, one rank's. Each returns StepTime.to_json() with its one line and the GPU's key, or
{"none": why, "line": ...}, as accounting.steptime's predictions do.
"""

from __future__ import annotations

import torch

from lmledger.accounting.steptime import no_step_time
from lmledger.ledger.hardware.gpus import GpuSpec, find_gpu, require_gpu
from lmledger.ledger.precision_table import traced_precision, transformer_engine
from lmledger.ledger.run import Run
from lmledger.ledger.timing.gpu.frameworks import lightning_kernels

__all__ = [
    "DEFAULT_GPU", "gpu_dtype", "module_precision", "ops_gpu_step", "stand_in_note", "target_gpu", "toy_gpu_step",
    "toy_unswapped_matmuls", "unswapped_matmuls",
]  # fmt: skip

# The GPU a GPU config is priced on where this machine has none and no --gpu names one: the lecture's (CS336's)
DEFAULT_GPU = "h100-sxm"


def target_gpu(
    accelerator: object, gpu: str | None, precision: str | None = None, fp8: str | None = None
) -> tuple[GpuSpec | None, str]:
    """(the GPU a step prediction is for, why that one): --gpu's; for a GPU config, or one whose fp8 runs only on a
    CUDA GPU (Transformer Engine's `precision`, LitLM's `fp8`: fit refuses either on a CPU), this machine's GPU where
    it has one in the table, else DEFAULT_GPU; None for a CPU config without --gpu (its step is timed here)."""
    if gpu is not None:
        return require_gpu(gpu), "--gpu"
    if str(accelerator).lower() in ("gpu", "cuda"):
        runs_on = "the config runs on a GPU"
    elif transformer_engine(precision):
        runs_on = f"{precision} runs on a CUDA GPU only"
    elif fp8:
        runs_on = f"fp8 ({fp8}) runs on a CUDA GPU only"
    else:
        return None, ""
    if torch.cuda.is_available():
        found = find_gpu(torch.cuda.get_device_name())
        if found is not None:
            return found, "this machine's GPU"
    return require_gpu(DEFAULT_GPU), f"{runs_on} and this machine has none: {DEFAULT_GPU} assumed"


def gpu_dtype(precision: str) -> str:
    """The dtype a Lightning precision's step runs in on a GPU, whose dense peak its MFU divides by: 16-bit, fp32 or
    tf32 as the precision says; an fp8 run's against bf16's, which its step outside the linears runs in."""
    from lmledger.ledger.hardware.peak_flops import compute_dtype_for_precision

    dtype = compute_dtype_for_precision(traced_precision(precision) if transformer_engine(precision) else precision)
    return dtype if dtype in ("bf16", "fp16", "fp32", "tf32") else "bf16"


def _links(gpu: GpuSpec, argv: list[str], world: int):
    """The run's links (--ledger.intra_node/inter_node, else the GPU's usual node), split at the config's devices a
    node; at another GPU count (plan train-time --num-gpus), in nodes of up to 8."""
    from lmledger.fitting.checks import check_fit_values
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.ledger.hardware.interconnect import links_for

    intra = inter = None
    devices, nodes = world, 1
    if argv:
        config = parse_fit_config(list(argv))
        intra, inter = config.get("ledger.intra_node"), config.get("ledger.inter_node")
        scale = check_fit_values(config)  # as accounting.scale.trainer_scale, which imports this module
        devices, nodes = scale.devices, scale.num_nodes
    if devices * nodes != world:
        devices, nodes = min(world, 8), -(-world // 8)
    return links_for(gpu.key, intra, inter, devices, nodes)


def _recompute(spec: Run) -> str:
    every = spec.config.activation_checkpointing
    return "none" if every == 0 else "full" if every == 1 else "layer" if every == 2 else "full"


def toy_gpu_step(spec: Run, argv: list[str], gpu: GpuSpec, accumulate: int = 1, num_gpus: int | None = None) -> dict:
    """The ToyLM config's step on `gpu` at its layout: TP from its strategy, data parallel the rest of its devices (or
    of `num_gpus`), fully sharded under FSDP/FSDP2/ZeRO-3, else replicated."""
    from lmledger.ledger.closedform.flops import flops_per_token_by_convention
    from lmledger.ledger.timing.gpu.explain import explain_mfu
    from lmledger.ledger.timing.gpu.layout import Layout, step_at_layout
    from lmledger.ledger.timing.steptime import StepTime

    world = num_gpus or spec.world_size
    tp = spec.tensor_parallel
    unswapped = toy_unswapped_matmuls(spec)
    if unswapped:
        return no_step_time(unswapped)
    if world % tp:
        return no_step_time(f"{world} GPUs do not divide into tensor-parallel groups of {tp}")
    sharded = spec.strategy in ("fsdp", "fsdp2") or spec.strategy.startswith("deepspeed_stage_3")
    layout = Layout(tp=tp, dp=world // tp, sharding="fsdp" if sharded else "ddp", micro_batch=spec.batch_size,
                    accumulate=accumulate, recompute=_recompute(spec),
                    sequence_parallel=spec.sequence_parallel and tp > 1)  # fmt: skip
    dtype = gpu_dtype(spec.precision)
    step = step_at_layout(spec.config, spec.seq_len, layout, traced_precision(spec.precision, spec.weights_dtype), gpu,
                          compute_dtype=dtype, kernels=lightning_kernels(spec.precision, spec.compiled, bool(spec.fp8)),
                          links=_links(gpu, argv, world))  # fmt: skip
    if not isinstance(step, StepTime):
        return no_step_time(step.reason)
    tokens = spec.batch_size * spec.seq_len * accumulate  # a rank's; TP's ranks share theirs
    per_token = flops_per_token_by_convention(spec.config, spec.seq_len)
    model_flops = per_token["palm"] * tokens / tp
    mfu = model_flops / step.total_s / gpu.peak_flops[dtype] if step.total_s > 0 else None
    from dataclasses import replace

    step = replace(step, mfu=mfu, tokens=tokens)
    out = {**step.to_json(), "line": step.line(), "gpu": gpu.key, "layout": _layout_json(layout, world),
           "mfu_explained": explain_mfu(step.seconds, model_flops, per_token["hfu"] * tokens / tp,
                                        gpu.peak_flops[dtype])}  # fmt: skip
    if world > 1:  # the line is one rank's: its tokens, which a TP group shares
        rate = tokens * layout.dp / step.total_s if step.total_s > 0 else 0.0
        # ZeRO-1/2 move the bytes DDP's all-reduce does (a reduce-scatter, then the updated shards gathered); each
        # rank's optimizer steps its shard, which the layout's replicated step does not split
        kind = f"{spec.strategy} priced as ddp" if spec.strategy.startswith("deepspeed") and not sharded else None
        out["notes"] = [*out["notes"], f"per GPU; {world} GPUs ({tp} TP x {layout.dp} DP, {kind or layout.sharding}): "
                        f"{rate:,.0f} tokens/s in all"]  # fmt: skip
    return out


def ops_gpu_step(
    ops, gpu: GpuSpec, precision: str, tokens: int | None, samples: int, accumulate: int = 1, *,
    buckets: tuple[tuple[int, str], ...] = (), world_size: int = 1, argv: list[str] = (),
) -> dict:  # fmt: skip
    """Any module's step on `gpu`, from its dry run's ops (one rank's, on this machine's fake tensors), with DDP's
    `buckets` (bytes, dtype) all-reduced over `world_size` ranks as backward fills them."""
    from lmledger.ledger.timing.gpu import predict_gpu_step
    from lmledger.ledger.timing.gpu.explain import explain_mfu
    from lmledger.ledger.timing.steptime import StepTime

    dtype, kernels = gpu_dtype(precision), lightning_kernels(precision)
    model_flops = 3 * ops.flops_in("forward")
    step = predict_gpu_step(ops, gpu, compute_dtype=dtype, kernels=kernels, tokens=tokens,
                            samples=samples, accumulate=accumulate, model_flops=model_flops, buckets=list(buckets),
                            world_size=world_size, links=_links(gpu, list(argv), world_size))  # fmt: skip
    if not isinstance(step, StepTime):
        return no_step_time(step.reason)
    if accumulate > 1:  # the micro-batches before the last: forward and backward, their own collectives, no step
        from dataclasses import replace

        from lmledger.ledger.count.ops import OPTIMIZER, OpSummary

        micro = predict_gpu_step(OpSummary.of([op for op in ops.ops if op.category != OPTIMIZER]), gpu,
                                 compute_dtype=dtype, kernels=kernels, links=_links(gpu, list(argv),
                                 world_size), world_size=world_size)  # fmt: skip
        seconds = {c: v + (accumulate - 1) * micro.seconds.get(c, 0.0) for c, v in step.seconds.items()}
        total = sum(seconds.values())
        step = replace(step, seconds=seconds, mfu=model_flops * accumulate / total / gpu.peak_flops[dtype])
    run_flops = ops.flops_in("forward", "backward")  # recompute included: it is dispatched in backward
    why = explain_mfu(step.seconds, model_flops * accumulate, run_flops * accumulate, gpu.peak_flops[dtype])
    return {**step.to_json(), "line": step.line(), "gpu": gpu.key, "mfu_explained": why}


def module_precision(trainer: object, module: torch.nn.Module) -> tuple[str, str, object]:
    """(the precision a parsed trainer section asks for, the precision `module`'s dry run traces, a Transformer Engine
    plugin's weights dtype or None), as traced_precision says. A module whose matmul layers Transformer Engine would
    not all swap is refused (unswapped_matmuls)."""
    from lmledger.errors import UserError
    from lmledger.precision import requested_precision

    precision, weights = requested_precision(trainer)
    unswapped = unswapped_matmuls(module, precision)
    if unswapped:
        raise UserError(unswapped)
    return precision, traced_precision(precision, weights), weights  # requested_precision's are the table's


def unswapped_matmuls(module: torch.nn.Module, precision: str) -> str | None:
    """Why a module's Transformer Engine step is not planned, or None: Lightning's plugin swaps an nn.Linear whose in
    and out features divide by 8 and 16 for te.Linear, and nothing else (a Conv1D, a bare 2-D weight), which stays
    16-bit where the plan prices every linear matmul in fp8 (lightning_kernels)."""
    if not transformer_engine(precision):
        return None
    kept = []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear):
            if child.in_features % 8 or child.out_features % 16:
                kept.append(f"{name} ({child.in_features} -> {child.out_features})")
        elif not isinstance(child, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and any(
            p.dim() == 2 for p in child.parameters(recurse=False)
        ):
            kept.append(f"{name} ({type(child).__name__})")
    if not kept:
        return None
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return (f"{precision} swaps only the nn.Linear layers whose features divide by 8 and 16 for te.Linear, and leaves "
            f"{type(module).__name__}'s {shown} 16-bit: this plan cannot tell those matmuls from the swapped ones "
            "(plan it at bf16-true)")  # fmt: skip


def toy_unswapped_matmuls(spec: Run) -> str | None:
    """unswapped_matmuls of a ToyLM config's model (built on the meta device: no memory)."""
    if not transformer_engine(spec.precision):
        return None
    from lmledger.model import ToyLM

    with torch.device("meta"):
        return unswapped_matmuls(ToyLM(spec.config), spec.precision)


def stand_in_note(precision: str, weights_dtype: object = None) -> str:
    """What a Transformer Engine step's plan stands on: a trace at traced_precision, its linears priced in fp8."""
    return (f"{precision}: planned as {traced_precision(precision, weights_dtype)} with its linears' matmuls priced in "
            "fp8 (te.Linear runs on a CUDA GPU only); its memory is that step's, without Transformer Engine's own "
            "saved tensors and fp8 weight copies")  # fmt: skip


def _layout_json(layout, world: int) -> dict:
    return {"gpus": world, "tensor_parallel": layout.tp, "sequence_parallel": layout.sequence_parallel,
            "data_parallel": layout.dp, "sharding": layout.sharding,
            "micro_batch": layout.micro_batch, "accumulate": layout.accumulate,
            "recompute": layout.recompute}  # fmt: skip
