"""Tensor parallelism (TP) beside FSDP2: lmledger's toy-LM plan, its checks, and the fake-mesh workaround.

A TP plan is torch's `parallelize_module` over the mesh's tensor-parallel dimension, run before
`fully_shard` over its data-parallel one (Lightning's TP tutorial, torchtitan's llama). For lmledger's
ToyLM (`toy_tp_plan`), per block:

    attn.qkv        colwise: its output columns are grouped per KV head (model.py), so each rank keeps
                    whole groups, their query heads, k and v. (A (q|k|v) layout would need torch's
                    _StridedShard, which DTensor's matmul does not keep and distributed checkpointing
                    cannot save.) So n_kv_heads, as n_heads, must divide by the TP size.
    attn.out        rowwise
    mlp.w1, w3      colwise (SwiGLU's gate and up; a GeLU MLP has w1 alone)
    mlp.w2          rowwise (down)
    sequence_parallel (optional) the norms and the residual stream split along the sequence, the
                    embedding split by vocabulary rows and the LM head by vocabulary columns
A Linear's bias splits with its columns (colwise) or stays whole (rowwise), as torch's styles do. A
learned position table stays whole on every rank; under sequence parallel each rank adds the rows of its
own sequence shard (the table's output taken as replicated and sliced along the sequence: no
communication forward, an all-gather of its gradient backward), as Megatron-LM adds positions before
scattering the sequence.

Under FakeTensorMode, `fully_shard` over a TP-sharded module fails building its 2-D mesh
(DeviceMesh._concatenate reads the rank table with nonzero: DynamicOutputShapeException).
`meshes_outside_fake_mode` builds those meshes with fake mode suspended (held by
test_canary_fsdp2_over_tp_needs_real_meshes_under_fake_mode). Pure torch: no Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn

from lmledger.errors import ConfigError

__all__ = [
    "apply_plan",
    "by_mesh",
    "clip_grad_norm_",
    "norm_over_meshes",
    "check_plan",
    "check_tensor_parallel",
    "check_toy_plan",
    "meshes_outside_fake_mode",
    "replay_configure_model",
    "toy_tp_plan",
]


def by_mesh(tensors: list) -> dict[int, list]:
    """Tensors grouped by their DTensor mesh (plain tensors and a param's grad by the same key)."""
    groups: dict[int, list] = {}
    for t in tensors:
        mesh = getattr(t.grad if isinstance(t, torch.nn.Parameter) and t.grad is not None else t, "device_mesh", None)
        groups.setdefault(id(mesh), []).append(t)
    return groups


def norm_over_meshes(grads: list) -> torch.Tensor:
    """The 2-norm of DTensor grads that live on different meshes (FSDP2 x TP and FSDP2 alone).

    Each mesh's norm is reduced over its own ranks (full_tensor), then they are combined.
    """
    groups = by_mesh(grads).values()
    norms = [torch.nn.utils.get_total_norm(group) for group in groups]
    squares = [(n.full_tensor() if hasattr(n, "full_tensor") else n).float().square() for n in norms]
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(parameters: list, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for parameters on several meshes (FSDP2 x TP); returns the norm.

    torch's own stacks the per-tensor norms, and DTensor refuses a stack across meshes.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = norm_over_meshes([p.grad for p in params])
    for group in by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def check_tensor_parallel(
    n_heads: int, hidden: int, tensor_parallel: int, d_model: int | None = None, n_kv_heads: int | None = None
) -> None:
    """ConfigError, one line, when heads, KV heads or the MLP's hidden size do not divide by the TP size."""
    if n_heads % tensor_parallel:
        raise ConfigError(
            f"n_heads {n_heads} does not divide by tensor_parallel_size {tensor_parallel}: each TP rank keeps "
            "whole heads; choose a tensor_parallel_size that divides the heads"
        )
    if n_kv_heads is not None and n_kv_heads % tensor_parallel:
        raise ConfigError(
            f"n_kv_heads {n_kv_heads} does not divide by tensor_parallel_size {tensor_parallel}: each TP rank keeps "
            "whole KV groups; choose a tensor_parallel_size that divides the KV heads"
        )
    if hidden % tensor_parallel:
        raise ConfigError(
            f"the MLP's hidden size {hidden} does not divide by tensor_parallel_size {tensor_parallel}: "
            "choose a tensor_parallel_size that divides it"
        )


def check_toy_plan(cfg, tensor_parallel: int, sequence_parallel: bool = False) -> None:
    """ConfigError, one line, for a ToyLM config (a ModelConfig, or a parsed config's section of its fields) that
    toy_tp_plan cannot split over `tensor_parallel` ranks: what fit's configure_model and planning both refuse."""
    check_tensor_parallel(cfg.n_heads, cfg.d_ff, tensor_parallel, n_kv_heads=getattr(cfg, "n_kv_heads", None))
    if sequence_parallel and cfg.tie_embeddings:
        raise ConfigError("sequence parallel splits the embedding and the LM head apart: set tie_embeddings false")


def toy_plan(
    sequence_parallel: bool = False, gated: bool = True, learned: bool = False, split_logits: bool = False
) -> tuple[dict, dict]:
    """(per-block plan, top-level plan) of lmledger's ToyLM, as parallelize_module takes them.

    `gated`: a SwiGLU MLP (w1, w3, w2); False for a GeLU one (w1, w2). `learned`: a learned position table.
    `split_logits`: Megatron-LM's ends, with or without sequence parallel: the embedding split by vocabulary rows and
    the LM head by vocabulary columns, each rank's logits left as its vocabulary shard (the GPU model's dry runs: the
    cross-entropy reads its shard; a trained module's loss would need torch's loss_parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    block = {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
        "mlp.w1": ColwiseParallel(),
        **({"mlp.w3": ColwiseParallel()} if gated else {}),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
    }
    top: dict = {}
    if sequence_parallel:

        def gather():  # the norms' sequence shards gathered for attention and the MLP
            return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

        block.update(
            {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather(), "mlp": gather()}
        )
        top = {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        if learned:  # the whole table's rows for the whole sequence, each rank keeping its shard's (module doc)
            top["pos_embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    if split_logits:
        stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout entering the head
        top["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        top["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=True)
    return block, top


def toy_tp_plan(model: nn.Module, tp_mesh: object, sequence_parallel: bool = False, split_logits: bool = False) -> None:
    """Tensor-parallelise lmledger's ToyLM in place over `tp_mesh` (module docstring; `split_logits`: toy_plan's)."""
    from torch.distributed.tensor.parallel import parallelize_module

    size = tp_mesh.size()
    check_toy_plan(model.cfg, size, sequence_parallel)
    learned = getattr(model, "pos_embed", None) is not None
    block_plan, top_plan = toy_plan(sequence_parallel, model.cfg.mlp == "swiglu", learned, split_logits)
    for wrapped in model.blocks:
        block = getattr(wrapped, "_checkpoint_wrapped_module", wrapped)  # torch's checkpoint_wrapper
        check_plan(block, block_plan)
        parallelize_module(block, tp_mesh, block_plan)
        block.attn.n_heads //= size  # each rank's heads and KV groups, as torchtitan's plan sets them
        block.attn.n_kv_heads //= size
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)


def check_plan(module: nn.Module, plan: dict) -> None:
    """ConfigError, one line, for a plan naming a module `module` does not have.

    parallelize_module itself only warns for a name that matches nothing.
    """
    import fnmatch

    names = [n for n, _ in module.named_modules() if n]
    for key in plan:
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            near = ", ".join(names[:6])
            raise ConfigError(
                f"the tensor-parallel plan names {key!r}, which {type(module).__name__} has no module of: "
                f"use one of its module names ({near}, ...)"
            )


def apply_plan(module: nn.Module, tp_mesh: object, plan: dict) -> None:
    """parallelize_module(module, tp_mesh, plan), after check_plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_plan(module, plan)
    parallelize_module(module, tp_mesh, plan)


def replay_configure_model(module: nn.Module, mesh: object) -> None:
    """FSDPSettings.shard for a LightningModule: its own configure_model, with `mesh` as its device_mesh.

    Lightning's ModelParallelStrategy sets `_device_mesh` before calling configure_model, and
    LightningModule.device_mesh reads it (canary in tests/callbacks/test_ledger_fsdp2.py). This sets it the same way.
    """
    module._device_mesh = mesh
    module.configure_model()


@contextmanager
def meshes_outside_fake_mode() -> Iterator[None]:
    """DeviceMesh._concatenate (FSDP2's mesh of dp x tp) runs with FakeTensorMode suspended.

    Under fake mode it reads the rank table with nonzero, a data-dependent shape, and raises. The rank
    table is small and real: building it outside fake mode costs nothing and changes nothing else.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return original(device_mesh_list)

    with mock.patch.object(DeviceMesh, "_concatenate", staticmethod(concatenate)):
        yield


# --------------------------------------------------------------------------------------------
# Megatron-LM's closed forms, beside the dry run (docs/scale.md)
# --------------------------------------------------------------------------------------------


def megatron_memory(
    *, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int, micro_batch: int, tp: int,
    sequence_parallel: bool, selective_recompute: bool = True, query_groups: int | None = None,
    untied: bool = True, distributed_optimizer: bool = False, data_parallel: int = 1,
) -> dict[str, float]:  # fmt: skip
    """One rank's weights + optimizer and activation bytes by Megatron-LM's closed forms, for its GPT.

    Our own code of the formulas Megatron-LM's theoretical_memory_usage.py evaluates (read 2026-12-01):
      weights and optimizer  18 bytes a parameter (fp16 weight, fp32 main grad, fp32 master weight and two Adam
                             moments), or 6 + 12 / dp with the distributed optimizer, on the most loaded TP shard
                             (the layers and both embeddings over tp)
      activations per layer  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
                             Models"), Table 2, 16-bit: s b h (10 + 24 / t + 5 a s / (h t)) with TP alone,
                             s b h (34 / t + 5 a s / (h t)) with sequence parallel; selective recompute drops the
                             5 a s / (h t) attention-score term. Megatron writes 34 as 18 + 4 ffn / h (its 4h MLP: 34)
      the rest               8 s b (the input ids), s b h (the embedding's dropout mask), 4 s b h (1 + v / h) (the
                             LM head's input and the fp32 logits of the loss), all over t
    Megatron itself reports these only with sequence parallel and selective recompute; the other rows of
    Table 2 are given here for the side by side. Its GPT is not lmledger's toy LM (a GeLU MLP with biases,
    LayerNorm and dropout), so where the two differ the shapes differ too.
    """
    h, s, b, a, t = hidden, seq, micro_batch, heads, tp
    groups = query_groups or heads
    # Megatron's own count: attention 2h^2 (1 + groups / heads), MLP 2 h ffn, 4h of norms and biases a layer,
    # the final norm's 2h once
    layer_params = layers * (2 * h * h * (1 + groups / heads) + 2 * h * ffn + 4 * h) + 2 * h
    embedding = h * vocab
    shard = (layer_params + embedding * (2 if untied else 1)) / t
    per_param = 6 + 12 / data_parallel if distributed_optimizer else 18
    mlp = 4 * ffn / h - 16  # 0 for Megatron's 4h MLP: its 34 is 18 + 4 ffn / h
    if sequence_parallel:
        per_layer = s * b * h * ((34 + mlp) / t)
    else:
        per_layer = s * b * h * (10 + (24 + mlp) / t)
    if not selective_recompute:
        per_layer += 5 * a * s * s * b / t
    rest = (8 * s * b + s * b * h + 4 * s * b * h * (1 + vocab / h)) / t
    return {"weights_and_optimizer": shard * per_param, "activations": layers * per_layer + rest}
