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
    regather        (optional, with sequence_parallel) Megatron-LM's sequence-parallel column linears: the
                    all-gather of the sequence shard feeding attn.qkv, and the one feeding mlp.w1 (and w3),
                    fused with those linears (_GatheredLinears), which save the rank's shard and gather it
                    again in backward, where torch's styles save the gathered, whole sequence
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

from lmledger.errors import ConfigError, UserError

__all__ = [
    "apply_plan",
    "by_mesh",
    "clip_grad_norm_",
    "norm_collectives",
    "norm_over_meshes",
    "check_plan",
    "check_tensor_parallel",
    "check_toy_plan",
    "meshes_outside_fake_mode",
    "replay_configure_model",
    "RegatheredColwise",
    "SplitAdamW",
    "toy_tp_plan",
]


class SplitAdamW(torch.optim.Optimizer):
    """AdamW over a TP rank's DTensor parameters and its plain ones (norms) apart: torch's fused and foreach kernels
    take one kind a call, and Megatron's fused Adam steps both."""

    def __init__(self, params, **hyper) -> None:
        from torch.distributed.tensor import DTensor

        params = list(params)
        super().__init__(params, dict(hyper))
        kinds = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
        self.inner = [torch.optim.AdamW(group, **hyper) for group in kinds if group]
        for optimizer in self.inner:  # one state, keyed by parameter: what the dry run counts as this optimizer's
            optimizer.state = self.state

    def step(self, closure=None) -> None:
        for optimizer in self.inner:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.inner:
            optimizer.zero_grad(set_to_none)


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


def norm_collectives(params: list) -> int:
    """The all-reduces a gradient norm over these parameters' DTensor grads runs (norm_over_meshes, or one DTensor
    norm's full_tensor): per mesh (by_mesh), one for each dimension of more than one rank on which some of them are
    sharded (their partial norm reduced over it; the grads take the parameters' placements); 0 for plain ones."""
    count = 0
    for group in by_mesh(params).values():
        mesh = getattr(group[0], "device_mesh", None)
        if mesh is None:
            continue
        count += sum(1 for dim, ranks in enumerate(mesh.shape)
                     if ranks > 1 and any(not t.placements[dim].is_replicate() for t in group))  # fmt: skip
    return count


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
    if sequence_parallel and cfg.context_length % tensor_parallel:
        raise ConfigError(
            f"sequence parallel splits each sequence over the TP ranks: context_length {cfg.context_length} does not "
            f"divide by tensor_parallel_size {tensor_parallel}"
        )


def toy_plan(
    sequence_parallel: bool = False,
    gated: bool = True,
    learned: bool = False,
    split_logits: bool = False,
    regather: bool = False,
) -> tuple[dict, dict]:
    """(per-block plan, top-level plan) of lmledger's ToyLM, as parallelize_module takes them.

    `gated`: a SwiGLU MLP (w1, w3, w2); False for a GeLU one (w1, w2). `learned`: a learned position table.
    `split_logits`: Megatron-LM's ends, with or without sequence parallel: the embedding split by vocabulary rows and
    the LM head by vocabulary columns, each rank's logits left as its vocabulary shard (the GPU model's dry runs: the
    cross-entropy reads its shard; a trained module's loss would need torch's loss_parallel). `regather` (with
    `sequence_parallel` only): attn's and mlp's gathers fused with their column linears, as Megatron-LM's
    (RegatheredColwise)."""
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

        block.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        if regather:  # the gathers fused with qkv and w1 (w3): these are no longer ColwiseParallel
            from torch.distributed.tensor.parallel import ParallelStyle

            ParallelStyle.register(RegatheredColwise)  # parallelize_module takes a ParallelStyle
            for name in ("attn.qkv", "mlp.w1", "mlp.w3"):
                block.pop(name, None)
            block.update(
                {"attn": RegatheredColwise(("qkv",)), "mlp": RegatheredColwise(("w1", "w3") if gated else ("w1",))}
            )
        else:
            block.update({"attn": gather(), "mlp": gather()})
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


def toy_tp_plan(
    model: nn.Module,
    tp_mesh: object,
    sequence_parallel: bool = False,
    split_logits: bool = False,
    regather: bool = False,
) -> None:
    """Tensor-parallelise lmledger's ToyLM in place over `tp_mesh` (module docstring; `split_logits` and `regather`:
    toy_plan's; `regather` without sequence parallel is a UserError)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if regather and not sequence_parallel:
        raise UserError(
            "regather fuses sequence parallel's all-gathers with the column linears: it needs sequence_parallel"
        )
    size = tp_mesh.size()
    check_toy_plan(model.cfg, size, sequence_parallel)
    learned = getattr(model, "pos_embed", None) is not None
    block_plan, top_plan = toy_plan(sequence_parallel, model.cfg.mlp == "swiglu", learned, split_logits, regather)
    for wrapped in model.blocks:
        block = getattr(wrapped, "_checkpoint_wrapped_module", wrapped)  # torch's checkpoint_wrapper
        check_plan(block, block_plan)
        parallelize_module(block, tp_mesh, block_plan)
        block.attn.n_heads //= size  # each rank's heads and KV groups, as torchtitan's plan sets them
        block.attn.n_kv_heads //= size
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)


# --------------------------------------------------------------------------------------------
# Megatron-LM's sequence-parallel column linears: the gather fused with the matmuls
# --------------------------------------------------------------------------------------------


# The TP group as _c10d_functional's ops name it: (its registered name, its size). Those ops are what torch's
# functional collectives (and DTensor's redistribute) run; called as ops, each is waited on where the code says
# (funcol's wrappers wait at once under fake tensors, which would record Megatron's overlapped collectives as serial).


def _gather_start(shard: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:
    """The TP group's sequence shards (b, s / t, h) all-gathered, stacked as (t b, s / t, h): in flight until
    _gather_end waits for it."""
    name, size = group
    return torch.ops._c10d_functional.all_gather_into_tensor(shard.contiguous(), size, name)


def _gather_end(gathered: torch.Tensor, batch: int) -> torch.Tensor:
    """_gather_start's shards waited for, laid along the sequence: (b, s, h) (a view at b = 1, else a copy, as torch's
    functional all-gather along the sequence makes for DTensor)."""
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    t = gathered.shape[0] // batch
    return gathered.view(t, batch, *gathered.shape[1:]).transpose(0, 1).reshape(batch, -1, gathered.shape[-1])


def _scatter_start(full: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:
    """(b, s, h) summed over the TP group and split along the sequence, each rank's (b, s / t, h): in flight until
    waited for (torch.ops._c10d_functional.wait_tensor)."""
    name, size = group
    b, s, h = full.shape
    stacked = full.view(b, size, s // size, h).transpose(0, 1).reshape(size * b, s // size, h)
    return torch.ops._c10d_functional.reduce_scatter_tensor(stacked, "sum", size, name)


class _GatheredLinears(torch.autograd.Function):
    """Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel (Korthikanti et al.
    2022, section 4.2.2), for one or several column linears reading one input.

    apply(shard, group, weight, bias, weight, bias, ...) -> (each linear's output): `shard` the rank's sequence
    shard (b, s / t, h), a local tensor; the weights and biases the TP-sharded DTensors (or their casts; a bias may
    be None), whose local column shards it multiplies. Forward: the shard all-gathered over the TP group, then each
    matmul on the whole sequence. Saved: the SHARD and the weights (the DTensors, so that an autocast cast of a
    weight is still told apart from the activations, as it is under torch's styles). Backward: the shard gathered
    again, the weight and bias grads from it (DTensors, as the parameters'), the input grads summed over the
    linears and reduce-scattered back to the sequence shard. The collectives are the _c10d_functional ops that
    torch's functional collectives (and DTensor's redistribute) run: the dry run's fake process group records them,
    and the time model prices them."""

    @staticmethod
    def forward(ctx, shard, group, *params):
        local = [_local_of(p) for p in params]
        full = _gather_end(_gather_start(shard, group), shard.shape[0])
        ctx.group = group
        ctx.specs = [_spec_of(p) for p in params]
        ctx.save_for_backward(shard, *params[0::2])
        return tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(local[0::2], local[1::2], strict=True))

    @staticmethod
    def backward(ctx, *grads):
        # Megatron-LM's order: the shard's gather issued, the input grad's matmul while it runs, then the gather
        # read; the input grad's reduce-scatter issued, the weight grads' matmuls while it runs, then it is read.
        # The dry run records them in this order, and the GPU model's streams overlap them as NCCL's would.
        shard, *weights = ctx.saved_tensors
        gathered = _gather_start(shard, ctx.group)  # gathered again: the forward kept only the shard
        flats = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
        grad_full = None
        for flat, weight in zip(flats, weights, strict=True):
            part = torch.mm(flat, _local_of(weight))  # linear's backward, as mm's: FLOPs and records as torch's
            grad_full = part if grad_full is None else grad_full + part
        full = _gather_end(gathered, shard.shape[0])
        grad_full = grad_full.view(*full.shape[:-1], grad_full.shape[-1])
        scattered = _scatter_start(grad_full, ctx.group)
        rows = full.reshape(-1, full.shape[-1])
        grad_params = []
        for i, flat in enumerate(flats):
            weight_spec, bias_spec = ctx.specs[2 * i], ctx.specs[2 * i + 1]
            grad_params.append(_like(torch.mm(flat.t(), rows), weight_spec))
            grad_params.append(None if bias_spec is False else _like(flat.sum(0), bias_spec))
        return torch.ops._c10d_functional.wait_tensor(scattered), None, *grad_params


def _local_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard itself (inside _GatheredLinears, where autograd does not follow it): no view op is
    dispatched, so the dry run records none (the GPU op model would count a view of the weight in a fused elementwise
    kernel's bytes); else `t`."""
    return getattr(t, "_local_tensor", t)


def _spec_of(t: torch.Tensor | None) -> object:
    """What a grad of `t` is made as: False for no tensor, None for a plain one, else the DTensor's layout."""
    if t is None:
        return False
    return (t.device_mesh, t.placements, t.shape, t.stride()) if hasattr(t, "to_local") else None


def _like(grad: torch.Tensor, spec: object) -> torch.Tensor:
    """A local grad as the DTensor `spec` (_spec_of) says, or as it is."""
    if not spec:
        return grad
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


class RegatheredColwise:
    """A parallel style for a module whose column linears `names` (attn's qkv; the MLP's w1, and w3) read its input:
    Megatron-LM's sequence-parallel gather, fused with them (_GatheredLinears).

    Each linear's weight and bias split by output rows, as ColwiseParallel splits them, without its hooks. A forward
    pre-hook on the module takes its input, the norm's sequence shard (a DTensor Shard(1) or its local tensor), as
    the local shard, and runs the gather and every linear's matmul on it once (one gather for SwiGLU's w1 and w3,
    Megatron's fused fc1); each linear, called on that shard, returns its output: the rank's columns over the whole
    sequence, a local tensor, as ColwiseParallel's. The model's code is unchanged. State lives on the modules and
    the hooks are partials and bound methods, so a deep copy of the module is a working copy."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        import types
        from functools import partial

        from torch.distributed.tensor.parallel import ColwiseParallel

        colwise = ColwiseParallel()
        process_group = device_mesh.get_group()
        group = (process_group.group_name, process_group.size())
        for name in self.names:
            linear = getattr(module, name)
            colwise._partition_linear_fn("", linear, device_mesh)
            linear.forward = types.MethodType(_regathered_linear, linear)
            linear._regather_group = group
        module.register_forward_pre_hook(partial(_regather, self.names, group))
        module.register_forward_hook(partial(_forget_regathered, self.names))
        return module


def _gathered(linears: list, shard: torch.Tensor, group: tuple) -> tuple[torch.Tensor, ...]:
    """The column linears' outputs over the whole sequence from the rank's sequence shard (_GatheredLinears)."""
    params = []
    for linear in linears:
        params += [_cast(shard, linear.weight), None if linear.bias is None else _cast(shard, linear.bias)]
    return _GatheredLinears.apply(_cast(shard, shard), group, *params)


def _regather(names: tuple, group: tuple, module: nn.Module, args: tuple) -> tuple:
    """RegatheredColwise's pre-hook: the input as its local shard, each linear's output computed and left on it."""
    x, *rest = args
    shard = x.to_local() if hasattr(x, "to_local") else x
    linears = [getattr(module, name) for name in names]
    for linear, out in zip(linears, _gathered(linears, shard, group), strict=True):
        linear.__dict__["_regathered"] = (shard, out)
    return (shard, *rest)


def _regathered_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A RegatheredColwise linear's forward: the output its module's pre-hook left for this input, else its own."""
    shard, out = self.__dict__.pop("_regathered", (None, None))
    if shard is x:
        return out
    return _gathered([self], x.to_local() if hasattr(x, "to_local") else x, self._regather_group)[0]


def _forget_regathered(names: tuple, module: nn.Module, _args: tuple, _out: object) -> None:
    for name in names:
        getattr(module, name).__dict__.pop("_regathered", None)


def _cast(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` in autocast's dtype where x's device autocasts (what F.linear would cast it to), else as it is."""
    device = x.device.type
    if device in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device):
        return t.to(torch.get_autocast_dtype(device))
    return t


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
