"""Context parallelism per rank: each of c ranks holds seq / c tokens of every sequence, attention runs as torch's
ring attention, and one rank's step is predicted in one process and held to real gloo ranks.

What torch 2.13 does (torch/distributed/tensor/experimental/_context_parallel/_attention.py, canaries in
tests/test_canaries.py):

    context_parallel(mesh, buffers=..., buffer_seq_dims=...)   shards the buffers along the sequence, head-tail
                        (_HeadTailLoadBalancer: rank r keeps the r-th and the (2c - 1 - r)-th of 2c chunks, so every
                        rank does the same causal work; only when seq divides by 2c, else silently none), patches
                        F.scaled_dot_product_attention to wrap q, k, v as DTensors sharded on dim 2, and sends the
                        SDPA kernels to the ring (_templated_ring_attention and its backward) through DTensor's
                        custom op handlers: the CUDA ones only (flash, efficient, cuDNN). On a CPU tensor SDPA
                        picks aten._scaled_dot_product_flash_attention_for_cpu, which has no handler and no sharding
                        rule: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
                        sharding strategy registered", on real gloo ranks and on fakes over the fake process group
                        alike. So torch's context_parallel runs on neither here.
    the ring            forward: c local attention calls, each merged into the running output by its logsumexp
                        (fp32), K and V concatenated into one buffer and passed on: under "allgather" (the default,
                        set_rotate_method) one all-gather of every rank's K|V at the first step, under "alltoall" c - 1
                        permutes (an all_to_all_single sending the whole buffer to the next rank). backward: K|V
                        again the same way, and dK|dV accumulated in fp32 and passed on c times (always permutes).

What this module runs: torch's own ring (_templated_ring_attention, _templated_ring_attention_backward, its
rotaters and merger, and its head-tail load balancer's indices) with the CPU flash kernel as the block op, under
an autograd Function in place of DTensor's dispatch (`ring_attention`). The Function saves what the SDPA kernel's
autograd node saves, q, k, v, the output and its logsumexp, at the local shards' sizes; the ring's K|V buffers,
gathered blocks and merges live inside the op. Runs on real ranks and on fakes alike, so the prediction is the dry
run of that step itself (exact for it), and its twin runs it on gloo. A GPU run takes the same ring through
torch's own dispatch with the CUDA flash kernel, which saves the same five tensors (and two scalars' worth of RNG
state).

One rank's step (`predict_context`, twin `measure_context`): the rank's tokens of the batch (and of RoPE's
tables, as torchtitan shards freqs_cis); the parameters whole on every rank of the context-parallel group, as
torchtitan composes it: FSDP2 over the dp x cp ranks (fsdp=True: state 1 / (dp c) a rank, the blocks gathered
whole to compute), or replicated (fsdp=False: every rank holds all, its gradient all-reduce over dp x cp is the
caller's to add, as a DDP layout's is). `context_rank` gives a ToyLM config's step at a layout as the GPU op model
(ledger/timing/gpu/layout.py) takes a dry run: ops (the ring's collectives in group "context_parallel" of size
cp), each gradient's bytes, forward FLOPs and (state, activations, peak). Pure torch: no Lightning import.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from lmledger.errors import ConfigError, UserError
from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun import fakecopy
from lmledger.ledger.dryrun.engine import NotTraced, StepFn
from lmledger.ledger.sharding.fsdp2 import DEFAULT_FSDP, _rank_chunks_only, fake_process_group, fsdp_units, shard_blocks
from lmledger.ledger.sharding.rankstate import (
    FakeCopy,
    ShardedLedger,
    local_state_bytes,
    made_optimizers,
    priced_rank,
    sharded_ledger,
    sharded_tracking,
)
from lmledger.ledger.sharding.tp import meshes_outside_fake_mode

__all__ = [
    "CP_GROUP",
    "ROTATE",
    "check_context",
    "context_rank",
    "cp_batch",
    "cp_module",
    "cp_positions",
    "measure_context",
    "merge_copy_bytes",
    "predict_context",
    "ring_attention",
    "ring_traffic",
]

ROTATE = ("allgather", "alltoall")  # torch's set_rotate_method
CP_GROUP = "context_parallel"  # the ring's collectives' group name in the ops (ops.OpRecord.group)


# --------------------------------------------------------------------------------------------
# The sequence split
# --------------------------------------------------------------------------------------------


def check_context(seq: int, cp: int) -> None:
    """One line for what the ring cannot take: the head-tail split needs seq divisible by 2 cp (torch would
    silently drop the load balancing). The heads do not matter: context parallelism splits the sequence alone."""
    if not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"context parallel size must be a positive whole number of ranks, got {cp!r}")
    if seq % (2 * cp):
        raise ConfigError(
            f"sequence length {seq} does not split head-tail over {cp} context-parallel ranks: "
            f"use a length divisible by {2 * cp} (2 x cp)"
        )


def cp_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` holds, in its local order: torch's head-tail load balancer's indices
    (_HeadTailLoadBalancer), the rank's c-th of them: chunks rank and 2 cp - 1 - rank of 2 cp."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    check_context(seq, cp)
    if not 0 <= rank < cp:
        raise ConfigError(f"context-parallel rank {rank} of {cp}: use 0 to {cp - 1}")
    order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0]
    per = seq // cp
    return order[rank * per : (rank + 1) * per].clone()


def cp_batch(batch: object, cp: int, rank: int, seq_dim: int = 1) -> object:
    """Every tensor of `batch` cut to the rank's tokens along `seq_dim` (cp_positions); meta tensors by shape."""

    def local(t: torch.Tensor) -> torch.Tensor:
        positions = cp_positions(t.shape[seq_dim], cp, rank)
        if t.device.type == "meta":
            shape = list(t.shape)
            shape[seq_dim] = len(positions)
            return torch.empty(shape, dtype=t.dtype, device="meta")
        return t.index_select(seq_dim, positions.to(t.device)).contiguous()

    return fakecopy.map_tensors(local, batch)


def cp_module(model: nn.Module, seq: int, cp: int, rank: int) -> nn.Module:
    """A copy of the toy LM whose RoPE tables hold the rank's positions' rows (as torchtitan shards freqs_cis
    with the batch): its blocks then rotate each local token by its global position. Parameters are shared, not
    copied. Learned positions are refused: the toy LM adds arange(local length)'s rows."""
    from lmledger.model import RotaryEmbedding

    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.positions == "learned":
        raise ConfigError("context parallel needs rotary positions: learned ones index arange(local length); use rope")
    if cfg is not None and seq > cfg.context_length:
        raise ConfigError(f"sequence length {seq} > context_length {cfg.context_length}")
    positions = cp_positions(seq, cp, rank)
    memo = {id(t): t for t in model.parameters()}
    copied = copy.deepcopy(model, memo)
    for sub in copied.modules():
        if isinstance(sub, RotaryEmbedding):
            for name in ("cos", "sin"):
                table = getattr(sub, name)
                rows = (
                    torch.empty((len(positions), *table.shape[1:]), dtype=table.dtype, device="meta")
                    if table.device.type == "meta"
                    else table.index_select(0, positions.to(table.device))
                )
                sub.register_buffer(name, rows, persistent=False)
    return copied


# --------------------------------------------------------------------------------------------
# The ring: torch's, with the CPU flash kernel, under an autograd Function
# --------------------------------------------------------------------------------------------


def _torch_ring():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


class _RingAttention(torch.autograd.Function):
    """Causal SDPA over the context-parallel group as torch's ring computes it (module doc)."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale):
        ring, aten = _torch_ring(), torch.ops.aten
        out, lse = ring._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, query, key, value,
            is_causal=True, scale=scale,
        )  # fmt: skip
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ring, aten = _torch_ring(), torch.ops.aten
        query, key, value, out, lse = ctx.saved_tensors
        grads = ring._templated_ring_attention_backward(
            ctx.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out, "grad_out",
            query, key, value, out, lse, is_causal=True, dropout_p=0.0, scale=ctx.scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2], None, None


@contextlib.contextmanager
def ring_attention(group: object, rotate: str = "allgather") -> Iterator[None]:
    """While open, F.scaled_dot_product_attention is causal attention over `group` (a ProcessGroup of the cp ranks)
    as torch's ring runs it (module doc), its K|V passed by `rotate`, load-balanced (head-tail: the batch and the
    positions cut by cp_batch and cp_module). Under autocast q, k and v are cast first, as autocast casts SDPA's."""
    if rotate not in ROTATE:
        raise ConfigError(f"rotate method {rotate!r}: choose one of {', '.join(ROTATE)} (torch's set_rotate_method)")
    ring = _torch_ring()
    method = ring._RotateMethod.ALL_GATHER if rotate == "allgather" else ring._RotateMethod.ALL_TO_ALL

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or not is_causal or enable_gqa:
            raise UserError(
                "ring attention here takes causal SDPA without a mask, dropout or enable_gqa (the toy LM's)"
            )
        if query.device.type != "cpu":
            raise UserError(
                f"ring_attention runs the CPU flash kernel; on {query.device.type} use torch's context_parallel"
            )
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        with torch.autocast(device, enabled=False):
            return _RingAttention.apply(query, key, value, group, scale)

    options = ring._cp_options
    with (
        mock.patch.object(F, "scaled_dot_product_attention", sdpa),
        mock.patch.object(options, "rotate_method", method),
        mock.patch.object(options, "enable_load_balance", True),
        mock.patch.object(options, "convert_to_f32", True),
    ):
        yield


@contextlib.contextmanager
def _as_rank(group: object, rank: int) -> Iterator[None]:
    """torch.distributed.get_rank(group) answers `rank` for the ring's group: the fake process group makes this
    process rank 0 of every group, and the ring's blocks (which half of q or of K|V each step takes) follow the rank."""
    import torch.distributed as dist

    original = dist.get_rank

    def get_rank(group_: object = None) -> int:
        return rank if group_ is group else original(group_)

    with mock.patch.object(dist, "get_rank", get_rank):
        yield


def predict_context(
    module: nn.Module,
    batch: object,
    *,
    cp: int,
    rank: int = 0,
    rotate: str = "allgather",
    step: StepFn | None = None,
    optimizer: object = None,
    precision: str | int = "32-true",
    fsdp: bool = True,
    dp: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    split_logits: bool = False,
    activation_checkpointing: bool = False,
) -> ShardedLedger | NotTraced:
    """One context-parallel rank's steady-state step of the toy LM `module` on the whole-sequence `batch` ((inputs,
    targets), (batch, seq)): the rank's tokens and positions (cp_batch, cp_module), ring attention over a fake group
    of cp ranks, FSDP2 over all dp x cp ranks (fsdp=True) or the state replicated; the blocks checkpointed with
    activation_checkpointing. With tp > 1, each rank also holds 1 / tp of every block by the toy LM's TP plan
    (ledger.sharding.tp.toy_tp_plan, with `sequence_parallel` and `split_logits`), on torchtitan's mesh (dp, cp, tp):
    the ring then passes the rank's own heads. A ShardedLedger with strategy "context_parallel", world dp x cp x tp."""
    seq = fakecopy.batch_tensors(batch)[0].shape[1]
    check_context(seq, cp)
    for name, size in (("data-parallel", dp), ("tensor-parallel", tp)):
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"{name} size must be a positive whole number of ranks, got {size!r}")
    local = cp_module(module, seq, cp, rank)
    if activation_checkpointing:
        local = _checkpointed(local)
    world = dp * cp * tp
    with fake_process_group(world), _rank_chunks_only(), meshes_outside_fake_mode():
        mesh = _cp_mesh(dp, cp, tp)
        group = mesh[CP_GROUP].get_group()
        wrap = _sharding(mesh, tp, fsdp, sequence_parallel, split_logits)
        fake = FakeCopy(local, cp_batch(batch, cp, rank), step, optimizer, precision, None, wrap=wrap)
        if isinstance(fake.error, NotTraced):
            return fake.error
        with sharded_tracking(), ring_attention(group, rotate), _as_rank(group, rank):
            result = fake.ledger()
        if isinstance(result, NotTraced):
            return result
        tp_group = mesh["tensor_parallel"].get_group().group_name if tp > 1 else None
        result = _name_groups(result, group.group_name, cp, tp_group, tp)
        units = fsdp_units(fake.model) if fsdp else []
    return sharded_ledger(result, "context_parallel", world, comm_buffers=max(units, default=0) * 2,
                          tensor_parallel=tp)  # fmt: skip


def _sharding(mesh: object, tp: int, fsdp: bool, sequence_parallel: bool, split_logits: bool):
    """The wrap of a CP rank's model: the TP plan on the mesh's tensor_parallel dimension (tp > 1), then FSDP2 over
    its data-parallel ranks, dp x cp (fsdp); None where neither applies. Call it outside FakeTensorMode: flattening
    dp x cp reads the rank table with nonzero (tp.meshes_outside_fake_mode's reason)."""
    data_parallel = _fsdp_mesh(mesh) if fsdp else None  # here, outside the fake copy's FakeTensorMode
    if tp == 1:
        return (lambda model: shard_blocks(model, data_parallel, DEFAULT_FSDP)) if fsdp else None

    def wrap(model: nn.Module) -> None:
        from lmledger.ledger.sharding import tp as tensor_parallel

        tensor_parallel.toy_tp_plan(model, mesh["tensor_parallel"], sequence_parallel, split_logits=split_logits,
                                    regather=sequence_parallel)  # fmt: skip
        if data_parallel is not None:
            shard_blocks(model, data_parallel, DEFAULT_FSDP)

    return wrap


def _cp_mesh(dp: int, cp: int, tp: int) -> object:
    """torchtitan's mesh of a CP layout over the world: (data_parallel, context_parallel, tensor_parallel), TP
    innermost (its ranks adjacent, in a node), CP next; a dimension of size 1 where the layout has none."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("data_parallel", CP_GROUP, "tensor_parallel"))


def _fsdp_mesh(mesh: object) -> object:
    """FSDP2's mesh of a _cp_mesh: its dp x cp ranks flattened (torchtitan's dp_shard_cp), or the cp ranks alone."""
    if mesh["data_parallel"].size() == 1:
        return mesh[CP_GROUP]
    return mesh["data_parallel", CP_GROUP]._flatten("data_parallel_context_parallel")


def _checkpointed(module: nn.Module) -> nn.Module:
    """A copy of `module` with every block under torch's non-reentrant checkpoint_wrapper (predict_sharded's)."""
    from lmledger.ledger.sharding.sharded import _with_checkpointed_blocks

    found = _with_checkpointed_blocks(lambda copied, _batch: copied, module, None)
    if isinstance(found, NotTraced):
        raise UserError(found.reason)
    return found


def _name_groups(result, ring_group: str, cp: int, tp_group: str | None = None, tp: int = 1):
    """`result` with the ring's collectives (functional ones on its group) in group CP_GROUP of size cp, TP's (on
    `tp_group`) in "tensor_parallel" of size tp, and FSDP2's (c10d's, over the dp x cp ranks) in "data_parallel", the
    name fsdp2's own prediction gives them."""
    from lmledger.ledger.count.ops import OpSummary

    if result.ops is None:
        return result
    ops = []
    for op in result.ops.ops:
        if op.group == ring_group and op.name.startswith("_c10d_functional."):
            op = dataclasses.replace(op, group=CP_GROUP, group_size=cp)
        elif op.group and op.group == tp_group:
            op = dataclasses.replace(op, group="tensor_parallel", group_size=tp)
        elif op.group:
            op = dataclasses.replace(op, group="data_parallel")
        ops.append(op)
    return dataclasses.replace(result, ops=OpSummary.of(ops, result.ops.outside))


def measure_context(
    module: nn.Module,
    batch: object,
    *,
    rotate: str = "allgather",
    step: StepFn | None = None,
    optimizer: object = None,
    precision: str | int = "32-true",
    fsdp: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
) -> tuple[ShardedLedger, list[float]]:
    """The twin of predict_context on this rank of the initialised (real) default process group, whose ranks are
    the context-parallel group (dp 1) or, with tp > 1, a (cp, tp) mesh: the same step on real tensors, two optimizer
    steps read by the dry run's reader (step 1's state, FLOPs and saved activations, step 2's peak), and the two
    steps' losses averaged over the ranks (the whole batch's mean: every rank holds as many tokens, and TP's ranks
    the same ones). Replicated (fsdp=False), each gradient is all-reduced over the cp ranks as it is made (the
    data-parallel reduction the prediction leaves to its caller)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if not isinstance(tp, int) or tp < 1 or world % tp:
        raise ConfigError(f"tensor-parallel size {tp!r} does not divide the {world} ranks")
    cp = world // tp
    mesh = _cp_mesh(1, cp, tp)
    group, rank = mesh[CP_GROUP].get_group(), mesh[CP_GROUP].get_local_rank()
    seq = fakecopy.batch_tensors(batch)[0].shape[1]
    check_context(seq, cp)
    dtype, autocast = fakecopy.precision_dtypes(precision)
    model = copy.deepcopy(module)
    if dtype is not None:
        model.to(dtype)
    model = cp_module(model, seq, cp, rank)
    if activation_checkpointing:
        model = _checkpointed(model)
    wrap = _sharding(mesh, tp, fsdp, sequence_parallel, False)
    if wrap is not None:
        wrap(model)
    if not fsdp:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: _all_reduce_grad(p, group, cp))
    opts = made_optimizers(optimizer, module, list(model.parameters()))
    device = fakecopy.target_device(model, None)
    losses: list[float] = []
    run = step or dryrun.default_step

    def recorded(m: nn.Module, b: object) -> torch.Tensor:
        loss = run(m, b)
        losses.append(float(loss.detach()))  # a Python number: a kept tensor would add to the peak
        return loss

    local = fakecopy.cast_batch(cp_batch(batch, cp, rank), dtype)
    with sharded_tracking(), ring_attention(group, rotate):
        result = dryrun.ledger_of_step(model, local, recorded, opts[0], autocast, device)
    state = local_state_bytes(model, opts)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    units = fsdp_units(model) if fsdp else []
    ledger = sharded_ledger(
        dataclasses.replace(result, **state), "context_parallel", world, comm_buffers=max(units, default=0) * 2,
        tensor_parallel=tp,
    )  # fmt: skip
    return ledger, (mean / world).tolist()


def _all_reduce_grad(p: torch.Tensor, group: object, cp: int) -> None:
    """A replicated gradient's mean over the cp ranks, in place (a TP shard's local tensor under TP)."""
    import torch.distributed as dist

    grad = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
    dist.all_reduce(grad.div_(cp), group=group)


# --------------------------------------------------------------------------------------------
# The ring's traffic and the saved activations on paper, beside the dry run
# --------------------------------------------------------------------------------------------


def _compute_bytes(precision: str | int) -> int:
    dtype, autocast = fakecopy.precision_dtypes(precision)
    return (autocast or dtype or torch.float32).itemsize


def ring_traffic(
    config,
    seq: int,
    cp: int,
    micro_batch: int,
    precision: str | int,
    rotate: str = "allgather",
    recompute: str = "none",
    tp: int = 1,
) -> dict[str, list[tuple[str, int]]]:
    """The ring's collectives of one rank's step on paper, per phase: (kind, bytes of the buffer each rank puts in)
    for every layer, in torch's order. K|V is 2 x micro_batch x n_heads / tp x seq / cp x head_dim elements in the
    compute dtype (the toy LM repeats grouped K and V per query head before SDPA; TP leaves each rank its heads);
    dK|dV the same count in fp32 (_cp_options.convert_to_f32).

        forward    "allgather": one all-gather (out: cp x K|V); "alltoall": cp - 1 permutes of K|V
        backward   K|V again as forward, then cp permutes of dK|dV (the last one brings each rank its own home);
                   with recompute "full" the forward's ring runs first again
    A permute is torch's all_to_all_single sending the whole buffer to the next rank."""
    check_context(seq, cp)
    kv = 2 * micro_batch * config.n_heads // tp * (seq // cp) * config.head_dim
    kv_bytes, dkv_bytes = kv * _compute_bytes(precision), kv * 4
    fwd = [("all_gather", kv_bytes)] if rotate == "allgather" else [("all_to_all", kv_bytes)] * (cp - 1)
    bwd = (fwd if recompute == "full" else []) + fwd + [("all_to_all", dkv_bytes)] * cp
    if rotate == "alltoall":  # interleaved as the loop runs them: K|V on to the next rank, then dK|dV
        kvs, dkvs = [("all_to_all", kv_bytes)] * (cp - 1), [("all_to_all", dkv_bytes)] * cp
        loop = [x for i in range(cp) for x in (kvs[i : i + 1] + dkvs[i : i + 1])]
        bwd = (fwd if recompute == "full" else []) + loop
    return {"forward": fwd * config.n_layers, "backward": bwd * config.n_layers}


def merge_copy_bytes(config, seq: int, cp: int, micro_batch: int, precision: str | int, rank: int) -> int:
    """What a rank saves beyond 1 / cp of the unsharded step's activations: on every rank but the last the ring's
    final merge is a partial update (torch.cat of the two halves), whose output is (b, h, t, d)-contiguous where
    the CPU flash kernel's is (b, t, h, d), so the toy LM's head merge (rearrange to b t (h d)) copies it and the
    output projection saves the copy: micro_batch x seq / cp x d_model in the compute dtype a layer."""
    if rank >= cp - 1:
        return 0
    return config.n_layers * micro_batch * (seq // cp) * config.d_model * _compute_bytes(precision)


# --------------------------------------------------------------------------------------------
# For the GPU op model: a ToyLM config's CP rank, as ledger/timing/gpu/layout.py takes a dry run
# --------------------------------------------------------------------------------------------


def context_rank(
    config,
    seq: int,
    cp: int,
    micro_batch: int,
    precision: str,
    recompute: str = "none",
    *,
    dp: int = 1,
    sharding: str = "fsdp",
    rotate: str = "allgather",
    rank: int = 0,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> tuple:
    """(ops, grads, forward FLOPs, (state, activations, peak)) of one context-parallel rank's step of the ToyLM
    `config` (its whole depth) at micro-batch x seq tokens a sample, the shape `_rank_ops` in
    ledger/timing/gpu/layout.py returns, or NotTraced:

        ops        the rank's OpSummary (forward, backward, AdamW step): the ring's collectives in group
                   "context_parallel" of size cp, FSDP2's in "data_parallel" of size dp x cp
        grads      each gradient's bytes on this rank, in the order backward makes them
        forward    the forward's FLOPs on this rank
        memory     (params + grads + AdamW state, saved activations, peak) bytes on this rank

    recompute "none" or "full" (every block checkpointed; its ring runs again in backward, collectives included);
    the selective kinds are the caller's transformation of the "none" ops, as layout.rank_ops makes them. sharding
    "fsdp": FSDP2 over the dp x cp ranks (torchtitan's dp_shard_cp); "ddp": the state replicated, its gradient
    all-reduce over dp x cp ranks left to the caller (its buckets from `grads`). AdamW, fused unless 16-mixed (the
    caller's rule; with tp > 1, ledger.sharding.tp.SplitAdamW). tp > 1: the toy LM's TP plan beside the ring, with
    `sequence_parallel`, its head split by vocabulary (Megatron-LM's vocab-parallel loss, as layout._rank_ops has it);
    TP's collectives in group "tensor_parallel" of size tp. Cached: a search meets the same shapes again."""
    if recompute not in ("none", "full"):
        raise ConfigError(f"recompute {recompute!r}: context_rank traces none or full; apply a selective one to 'none'")
    if sharding not in ("fsdp", "ddp"):
        raise ConfigError(f"sharding {sharding!r}: choose fsdp (FSDP2 over dp x cp) or ddp (replicated)")
    if micro_batch < 1:
        raise ConfigError(f"micro_batch must be at least 1, got {micro_batch}")
    check_context(seq, cp)
    return _context_rank(config, seq, cp, micro_batch, precision, recompute, dp, sharding, rotate, rank, tp,
                         sequence_parallel and tp > 1)  # fmt: skip


@functools.lru_cache(maxsize=128)
def _context_rank(config, seq, cp, micro_batch, precision, recompute, dp, sharding, rotate, rank, tp, sp):
    from lmledger.ledger.sharding.tp import SplitAdamW
    from lmledger.model import ToyLM

    with torch.device("meta"):
        model = ToyLM(dataclasses.replace(config, activation_checkpointing=0))
    ids = torch.empty((micro_batch, seq), dtype=torch.long, device="meta")
    fused = not precision.startswith("16-mixed")
    adamw = SplitAdamW if tp > 1 else torch.optim.AdamW
    found = predict_context(
        model, (ids, ids.clone()), cp=cp, rank=rank, rotate=rotate, step=lambda m, b: m(*b),
        optimizer=lambda params: adamw(params, lr=1e-4, fused=fused), precision=precision,
        fsdp=sharding == "fsdp", dp=dp, tp=tp, sequence_parallel=sp, split_logits=tp > 1,
        activation_checkpointing=recompute == "full",
    )  # fmt: skip
    return found if isinstance(found, NotTraced) else priced_rank(found, model)
