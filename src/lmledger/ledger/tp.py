"""Tensor parallelism (TP) beside FSDP2: lmledger's toy-LM plan, its checks, and the fake-mesh workaround.

A TP plan is torch's `parallelize_module` over the mesh's tensor-parallel dimension, run before
`fully_shard` over its data-parallel one (Lightning's TP tutorial, torchtitan's llama). For lmledger's
ToyLM (`toy_tp_plan`), per block:

    attn.qkv        colwise: its output columns are grouped per head (model.py), so each rank keeps
                    whole heads, q, k and v. (A (q|k|v) layout would need torch's _StridedShard, which
                    DTensor's matmul does not keep and distributed checkpointing cannot save.)
    attn.out        rowwise
    mlp.w1, w3      colwise (SwiGLU's gate and up)
    mlp.w2          rowwise (down)
    sequence_parallel (optional) the norms and the residual stream split along the sequence, the
                    embedding split by vocabulary rows and the LM head by vocabulary columns

Under FakeTensorMode, `fully_shard` over a TP-sharded module fails building its 2-D mesh
(DeviceMesh._concatenate reads the rank table with nonzero: DynamicOutputShapeException).
`meshes_outside_fake_mode` builds those meshes with fake mode suspended (held by
test_canary_fsdp2_over_tp_needs_real_meshes_under_fake_mode). Pure torch: no Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

from torch import nn

from lmledger.errors import ConfigError

__all__ = [
    "apply_plan",
    "check_plan",
    "check_tensor_parallel",
    "meshes_outside_fake_mode",
    "toy_tp_plan",
]


def check_tensor_parallel(n_heads: int, hidden: int, tensor_parallel: int, d_model: int | None = None) -> None:
    """ConfigError, one line, when heads or the MLP's hidden size do not divide by the TP size."""
    if n_heads % tensor_parallel:
        raise ConfigError(
            f"n_heads {n_heads} does not divide by tensor_parallel_size {tensor_parallel}: each TP rank keeps "
            "whole heads; choose a tensor_parallel_size that divides the heads"
        )
    if hidden % tensor_parallel:
        raise ConfigError(
            f"the MLP's hidden size {hidden} does not divide by tensor_parallel_size {tensor_parallel}: "
            "choose a tensor_parallel_size that divides it"
        )


def toy_plan(sequence_parallel: bool = False) -> tuple[dict, dict]:
    """(per-block plan, top-level plan) of lmledger's ToyLM, as parallelize_module takes them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    block = {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
        "mlp.w1": ColwiseParallel(),
        "mlp.w3": ColwiseParallel(),
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
    return block, top


def toy_tp_plan(model: nn.Module, tp_mesh: object, sequence_parallel: bool = False) -> None:
    """Tensor-parallelise lmledger's ToyLM in place over `tp_mesh` (module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = model.cfg
    size = tp_mesh.size()
    check_tensor_parallel(cfg.n_heads, cfg.d_ff, size)
    if sequence_parallel and cfg.tie_embeddings:
        raise ConfigError("sequence parallel splits the embedding and the LM head apart: set tie_embeddings false")
    block_plan, top_plan = toy_plan(sequence_parallel)
    for wrapped in model.blocks:
        block = getattr(wrapped, "_checkpoint_wrapped_module", wrapped)  # torch's checkpoint_wrapper
        check_plan(block, block_plan)
        parallelize_module(block, tp_mesh, block_plan)
        block.attn.n_heads //= size  # each rank's heads, as torchtitan's plan sets them
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
