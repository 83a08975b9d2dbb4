"""Each op of a dry run, priced on a GPU: its kernel's seconds (kernels.py), the host's seconds to launch it, and what
it waits for. A framework's fusion (frameworks.Kernels.fuse_elementwise) turns runs of elementwise ops into one
kernel first (`fused`).

    kernel      runs on the compute stream: a matmul, an attention kernel, a streaming kernel
    collective  runs on its group's communication stream (comm.py)
    wait        the compute stream waits for a collective (a functional collective's wait_tensor)
    free        no kernel: a view or a metadata query; the host still dispatches it
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lmledger.ledger.count.ops import ATTENTION, COMMUNICATION, MATMUL, OPTIMIZER, OTHER, OpRecord, TensorSpec
from lmledger.ledger.hardware.interconnect import collective_kind
from lmledger.ledger.timing.gpu import comm
from lmledger.ledger.timing.gpu.frameworks import Kernels
from lmledger.ledger.timing.gpu.kernels import (
    EAGER_SOFTMAX_LAUNCHES,
    Chip,
    attention_seconds,
    matmul_seconds,
    megatron_fused_softmax,
    stream_seconds,
    sustained_share,
    unfused_attention_seconds,
)
from lmledger.ledger.timing.roofline import peak_dtype

__all__ = ["KERNEL", "COLLECTIVE", "WAIT", "FREE", "Priced", "fused", "price_ops"]

KERNEL, COLLECTIVE, WAIT, FREE = "kernel", "collective", "wait", "free"
FSDP_COPY_IN = "fsdp.all_gather_copy_in"  # FSDP2's packing of a group's shards into its all-gather input
_ELEMENT = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# A multi-tensor (foreach, fused optimizer) kernel takes a bounded list of tensors per launch (torch's
# MultiTensorApply: depth-dependent lists of up to 110 tensors): one launch per this many.
_TENSORS_PER_LAUNCH = 64
# The optimizer's state made at its first step (torch's AdamW zeroes each moment lazily): step 1's, which the dry run
# records, not a steady step's: neither a kernel nor a dispatch on the host
_STATE_INIT = ("aten.zeros.", "aten.zeros_like.", "aten.empty.", "aten.empty_like.", "aten.full.", "aten.full_like.")
# Megatron-LM's 16-bit optimizer (Float16OptimizerWithFloat16Params) steps fp32 main weights: a parameter's 16-bit
# gradient copied to fp32 (2 bytes read, 4 written), unscaled and checked (4, 4), Adam over the fp32 weight,
# gradient and moments (16, 12), the weight copied back to 16 bits (4, 2): 48 bytes, where the dry run's fused AdamW
# over 16-bit weight, gradient and moments moves 14 (8 read, 6 written)
_MASTER_ADAM_BYTES, _SIXTEEN_BIT_ADAM_BYTES = 48, 14


@dataclass(frozen=True)
class Priced:
    """One op (or a fused run of them) as the simulation (simulate.py) replays it."""

    kind: str
    category: str
    phase: str
    gpu_s: float  # on its stream: the kernel, or the collective on its link
    host_s: float  # the host's time to issue it
    reads: tuple[int, ...] = ()  # storage ids it waits for
    writes: tuple[int, ...] = ()
    stream: str = ""  # a collective's: its process group
    ops: int = 1  # dry-run ops it stands for
    # a collective waits for the compute issued before it (NCCL issued from the current stream); False for FSDP's
    # all-gathers, which torch's FSDP2 copies in and gathers on streams of their own that wait only for their input
    # (get_all_gather_streams in forward and pre-backward): so the next block's gather overlaps this one's compute
    after_compute: bool = True
    sync: bool = False  # the host waits for the device (every stream) before issuing it
    # a collective pipelined with the matmul it feeds or drains, in this many chunks (async TP: simulate.py); 0: not
    chunks: int = 0


def _specs(op: OpRecord) -> list[TensorSpec]:
    if op.signature is None:
        return []
    from lmledger.ledger.timing.steptime.tensors import leaves_of, thaw

    return list(leaves_of(thaw(op.signature)))


def _positional(op: OpRecord) -> list:
    if op.signature is None:
        return []
    from lmledger.ledger.timing.steptime.tensors import thaw

    args = thaw(op.signature)[0]
    return list(args) if isinstance(args, (list, tuple)) else []


def _matmul_dims(op: OpRecord) -> tuple[int, int, int, int] | None:
    """(m, n, k, batch) of a recorded matmul, from its operand shapes; None for one it cannot read (convolutions)."""
    base = op.name.split(".")[1] if "." in op.name else op.name
    shapes = [s for s in op.shapes if len(s) >= 2] or [tuple(s.shape) for s in _specs(op) if len(s.shape) >= 2]
    if base in ("mm", "_scaled_mm", "addmm", "_int_mm") and len(shapes) >= 2:
        (m, k), (_, n) = shapes[-2][-2:], shapes[-1][-2:]
        return m, n, k, 1
    if base in ("bmm", "baddbmm") and len(shapes) >= 2 and len(shapes[-1]) == 3:
        (b, m, k), (_, _, n) = shapes[-2], shapes[-1]
        return m, n, k, b
    return None


def _price_matmul(op: OpRecord, chip: Chip, compute: str, kernels: Kernels) -> float:
    dtype = peak_dtype(op.dtype, compute)
    dims = _matmul_dims(op)
    if kernels.fp8_matmuls and dtype in ("bf16", "fp16") and dims is not None and dims[3] == 1:
        m, n, k, _ = dims
        if kernels.fp8_casts == "te":
            # Transformer Engine (frameworks.Kernels.fp8_casts): forward, the input and the weight each cast and
            # transposed in one kernel (read 2 bytes, write 1 twice); backward, the output's gradient likewise, once
            # for the two matmuls that read it (its first operand in both: 2 bytes each), the rest from forward's
            forward = op.phase == "forward" or op.recompute
            moved, casts = ((m * k + k * n) * 4, 2) if forward else (m * k * 2, 1)
            return matmul_seconds(m, n, k, 1, "fp8", chip, 1) + stream_seconds(moved, chip, casts)
        # torchao's dynamic scaling: each operand's amax read, then cast to e4m3 (read 2 bytes, write 1); fused into
        # one pass each under compile, two eager. Then the scaled fp8 matmul.
        operands = (m * k + k * n) * (3 if kernels.fuse_elementwise else 5)
        return matmul_seconds(m, n, k, 1, "fp8", chip, 1) + stream_seconds(operands, chip, 2)
    if dims is None:  # a convolution or other: its FLOPs at a large GEMM's efficiency
        eff = min(chip.arch.matmul.get(dtype, chip.arch.matmul["fp32"]), sustained_share(dtype, chip))
        return op.flops / (chip.peak(dtype) * eff) + stream_seconds(0, chip)
    m, n, k, batch = dims
    element = 1 if dtype == "fp8" else _ELEMENT.get(op.dtype, 2)
    return matmul_seconds(m, n, k, batch, dtype, chip, element)


def _attention_shape(op: OpRecord) -> tuple[int, int, int, int, int, bool] | None:
    """(batch, heads, seq_q, seq_k, head_dim, causal) of a fused attention op: q and k are the first two 4-D tensors
    after a backward's gradient; is_causal is the first bool after dropout_p (a float) in every SDPA kernel's
    signature (flash, memory-efficient, cuDNN, CPU flash; forward and backward)."""
    four = [s for s in _specs(op) if len(s.shape) == 4]
    if "backward" in op.name:
        four = four[1:]
    if len(four) < 2:
        return None
    (b, h, sq, d), (_, _, sk, _) = four[0].shape, four[1].shape
    causal, after_float = False, False
    for arg in _positional(op):
        if isinstance(arg, float) and not isinstance(arg, bool):
            after_float = True
        elif after_float and isinstance(arg, bool):
            causal = arg
            break
    return b, h, sq, sk, d, causal


def _price_attention(op: OpRecord, chip: Chip, kernels: Kernels, compute: str) -> tuple[float, int]:
    """(seconds, launches) of an attention op: one launch, or Megatron's eager softmax's more (kernels.py)."""
    dtype = peak_dtype(op.dtype, compute)
    shape = _attention_shape(op)
    backward = "backward" in op.name
    kernel = _kernel(kernels, chip, dtype)
    if shape is None:  # not readable: a long non-causal sequence at head dim 128
        return attention_seconds(op.flops, 1 << 14, 1 << 14, 128, False, backward, kernel, dtype, chip), 1
    b, h, sq, sk, d, causal = shape
    if kernels.attention == "unfused" and sq == sk:
        fused = megatron_fused_softmax(b * h, sq)
        seconds = unfused_attention_seconds(b * h, sq, d, backward, dtype, chip, _ELEMENT.get(op.dtype, 2),
                                            kernels.attention_dropout, fused)  # fmt: skip
        return seconds, 1 if fused else 1 + EAGER_SOFTMAX_LAUNCHES
    return attention_seconds(op.flops, sq, sk, d, causal, backward, kernel, dtype, chip), 1


def _kernel(kernels: Kernels, chip: Chip, dtype: str = "bf16") -> str:
    """The attention kernel: the framework's, or torch SDPA's pick ("auto"): its flash backend (FlashAttention-2) in
    half precision, its memory-efficient one in fp32 (flash takes no fp32)."""
    if dtype not in ("bf16", "fp16", "fp8"):
        return "efficient"
    return "flash2" if kernels.attention in ("auto", "unfused") else kernels.attention


def _indexed_bytes(op: OpRecord) -> int | None:
    """What an op that indexes into its first input moves, where the dry run counts that whole input as read: an
    embedding lookup reads a row a token (the table at most: repeated rows come from cache) and nll_loss a value a
    token; nll_loss's backward writes its whole gradient (zero-filled, then scattered into) and reads only the
    targets. None for any other op, or one recorded without its arguments."""
    gather = op.name.startswith(("aten.embedding.", "aten.nll_loss_forward."))
    if not (gather or op.name.startswith("aten.nll_loss_backward.")):
        return None
    specs = _specs(op)
    indices = next((s for s in specs if s.dtype == "int64"), None)
    if indices is None:
        return None
    count = math.prod(indices.shape)
    if not gather:
        return op.bytes_written + 8 * count
    source = specs[0]
    element = _ELEMENT.get(source.dtype, 4)
    row = math.prod(source.shape[1:]) if op.name.startswith("aten.embedding.") else 1  # a row, or one value
    return min(math.prod(source.shape), count * row) * element + 8 * count + op.bytes_written


def _launches(op: OpRecord) -> int:
    if op.name.split(".")[1].startswith(("_foreach_", "_fused_")):
        return max(1, math.ceil(len(_specs(op)) / _TENSORS_PER_LAUNCH))
    return 1


def _host(op: OpRecord, kind: str, kernels: Kernels, launches: int = 1) -> float:
    if kind == FREE:
        return kernels.host_free_s
    if op.phase == "backward" and not op.recompute:  # a recomputed forward runs Python again
        return kernels.host_backward_s * launches
    return kernels.host_forward_s * launches


def _fp8_gather(op: OpRecord, kernels: Kernels) -> OpRecord:
    """A tensor-parallel forward all-gather feeding fp8 linears moves fp8: under sequence parallel it gathers a
    column-parallel linear's input, which torchao's Float8ColwiseParallel (torchtitan) and Transformer Engine's
    sequence-parallel Linear cast to e4m3 before the gather: half the 16-bit bytes. The backward's gathers (of the
    row-parallel outputs' gradients) stay 16-bit."""
    fp8_input = kernels.fp8_matmuls and op.group == "tensor_parallel" and (op.phase == "forward" or op.recompute)
    if not fp8_input or collective_kind(op.name) != "all_gather" or op.dtype not in ("bfloat16", "float16"):
        return op
    return dataclasses.replace(op, bytes_read=op.bytes_read // 2, bytes_written=op.bytes_written // 2)


def price_op(op: OpRecord, chip: Chip, kernels: Kernels, compute: str, links: comm.Links, world: int) -> Priced:
    """One op (module doc). `compute`: the run's matmul dtype, for ops whose own dtype has no peak."""
    reads = tuple(key for key, _ in op.storages)
    writes = tuple(key for key, _ in op.output_storages)
    if op.name.startswith(FSDP_COPY_IN):  # the gather's input packed on FSDP's copy-in stream, off the compute stream
        return Priced(COLLECTIVE, COMMUNICATION, op.phase, stream_seconds(op.bytes, chip), _host(op, KERNEL, kernels),
                      reads, writes, "fsdp copy-in", after_compute=False)  # fmt: skip
    if op.category == COMMUNICATION:
        seconds, stream = comm.collective(_fp8_gather(op, kernels), links, world)
        kind = WAIT if stream is None else COLLECTIVE
        fsdp_gather = op.name.startswith("c10d.") and "allgather" in op.name  # c10d's own: FSDP's, not DTensor's
        return Priced(kind, COMMUNICATION, op.phase, seconds, kernels.host_free_s, reads, writes, stream or "",
                      after_compute=not fsdp_gather)  # fmt: skip
    if op.category == MATMUL:
        seconds, kind = _price_matmul(op, chip, compute, kernels), KERNEL
    elif op.category == ATTENTION:
        seconds, launches = _price_attention(op, chip, kernels, compute)
        return Priced(KERNEL, op.category, op.phase, seconds, _host(op, KERNEL, kernels, launches), reads, writes)
    elif op.bytes == 0 and op.flops == 0:
        seconds, kind = 0.0, FREE
    elif op.category == OPTIMIZER and op.name.startswith(_STATE_INIT):
        return Priced(FREE, op.category, op.phase, 0.0, 0.0, reads, writes)
    else:
        launches = _launches(op)
        category = OPTIMIZER if op.category == OPTIMIZER else OTHER
        nbytes = _indexed_bytes(op) or op.bytes
        if category == OPTIMIZER and kernels.master_weights and "_fused_adam" in op.name and op.dtype != "float32":
            nbytes = op.bytes * _MASTER_ADAM_BYTES // _SIXTEEN_BIT_ADAM_BYTES
        return Priced(KERNEL, category, op.phase, stream_seconds(nbytes, chip, launches),
                      _host(op, KERNEL, kernels, launches), reads, writes)  # fmt: skip
    return Priced(kind, op.category, op.phase, seconds, _host(op, kind, kernels), reads, writes)


def price_ops(ops: list[OpRecord], chip: Chip, kernels: Kernels, compute: str, links: comm.Links, world: int):
    """Every op priced, with the framework's fusion applied (`fused`)."""
    head = _lm_head(ops) if kernels.fp8_matmuls and not kernels.fp8_head else set()
    sixteen = dataclasses.replace(kernels, fp8_matmuls=False)
    priced = [price_op(op, chip, sixteen if i in head else kernels, compute, links, world) for i, op in enumerate(ops)]
    if kernels.loss == "megatron":
        priced = _megatron_loss(ops, priced, chip, kernels, links)
    if kernels.loss_sync:
        priced = _loss_read_back(ops, priced)
    if not kernels.dtensor_tp:
        priced = _own_tensor_parallel(ops, priced)
    if kernels.async_tp:
        priced = _async_tensor_parallel(ops, priced)
    if not (kernels.fuse_elementwise or kernels.loss == "fused"):
        return priced
    return fused(ops, priced, chip, inner=kernels.fuse_elementwise, loss=kernels.loss == "fused")


def _lm_head(ops: list[OpRecord]) -> set[int]:
    """The LM head's matmuls: the last forward matmul before the loss and the first two after its gradient. An fp8
    run keeps them 16-bit: torchtitan converts every nn.Linear but the output layer to float8 (its float8
    converter's filter), llm-foundry's fp8 runs swap its blocks' linears for Transformer Engine's and compute the
    logits with F.linear on the tied embedding. None in a pipeline stage without the loss."""
    loss = [i for i, op in enumerate(ops) if op.name.startswith(_LOSS_OPS)]
    if not loss:
        return set()
    before = [i for i in range(loss[0]) if ops[i].category == MATMUL and ops[i].phase == "forward"]
    after = [i for i in range(loss[-1] + 1, len(ops)) if ops[i].category == MATMUL and ops[i].phase == "backward"]
    return set(before[-1:] + after[:2])


# Megatron-LM's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py; Megatron-DeepSpeed's and
# GPT-NeoX's mpu run the same code) over the fp32 logits its caller casts (`output.float()`, which the dry run's
# autocast cast records too), in place of the dry run's F.cross_entropy ops: (bytes per logit, kernels) of each.
# Forward: five kernels stream the logits (max 4 bytes, subtract 8, exp in place 8, sum 4, divide in place 8), where
# log-softmax reads and writes once; eleven small ones on the targets (the vocabulary-range mask, the masked target,
# the gather of each target's logit and its masking) where nll_loss gathers once. Backward: the targets' gradients
# updated in place (six small kernels) and one multiply over the saved probabilities (8 bytes), where PyTorch
# zero-fills the gradient, scatters into it, then runs log-softmax's backward (12 bytes).
_MEGATRON_LOSS = {"aten._log_softmax.": (32, 5), "aten.nll_loss_forward.": (0, 11),
                  "aten.nll_loss_backward.": (0, 6), "aten._log_softmax_backward_data.": (8, 1)}  # fmt: skip
# and three all-reduces of one fp32 value a token over the tensor-parallel group (the max, the target logits, the sum
# of exponentials), each called whatever the group's size, in the forward between its kernels
_MEGATRON_LOSS_REDUCES = 3


def _megatron_loss(
    ops: list[OpRecord], priced: list[Priced], chip: Chip, kernels: Kernels, links: comm.Links
) -> list[Priced]:
    """The loss's ops priced as Megatron-LM's cross-entropy runs them (_MEGATRON_LOSS); their dataflow is the dry
    run's. The all-reduces are on the forward's chain (each kernel after them reads their result), so they are added
    to the targets' gather, at the tensor-parallel group's link."""
    tp = next((op.group_size for op in ops if op.group == "tensor_parallel" and op.group_size), 1)
    out = list(priced)
    for i, (op, p) in enumerate(zip(ops, priced, strict=True)):
        found = next((v for k, v in _MEGATRON_LOSS.items() if op.name.startswith(k)), None)
        if found is None or p.kind != KERNEL:
            continue
        per_logit, launches = found
        logits = op.bytes_written // _ELEMENT.get(op.dtype, 4) if per_logit else 0  # log-softmax's output, fp32
        seconds = stream_seconds(per_logit * logits, chip, launches)
        host = _host(op, KERNEL, kernels, launches)
        if op.name.startswith("aten.nll_loss_forward."):
            tokens = next((math.prod(s.shape) for s in _specs(op) if s.dtype == "int64"), 0)
            reduce = OpRecord("c10d.allreduce_ (Megatron's loss)", op.phase, COMMUNICATION, 0, 4 * tokens, 0,
                              "float32", group="tensor_parallel", group_size=tp)  # fmt: skip
            seconds += _MEGATRON_LOSS_REDUCES * comm.collective(reduce, links, tp)[0]
            host += _MEGATRON_LOSS_REDUCES * kernels.host_forward_s
        out[i] = dataclasses.replace(p, gpu_s=seconds, host_s=host)
    return out


def _loss_read_back(ops: list[OpRecord], priced: list[Priced]) -> list[Priced]:
    """The host reads the loss back between forward and backward (frameworks.Kernels.loss_sync): the backward's first
    op waits for the device, so the forward's last kernels (the LM head's, the loss's) do not hide under it."""
    first = next((i for i, op in enumerate(ops) if op.phase == "backward"), None)
    if not first:  # no backward, or no forward before it (a pipeline stage's backward priced alone)
        return priced
    return [dataclasses.replace(p, sync=True) if i == first else p for i, p in enumerate(priced)]


def _own_tensor_parallel(ops: list[OpRecord], priced: list[Priced]) -> list[Priced]:
    """The host as a framework with its own TP layers runs the dry run's DTensor step (frameworks.Kernels.dtensor_tp):
    Megatron-LM calls torch.distributed.all_reduce once, so the functional collective's wait_tensor and the views
    DTensor puts at a collective's two sides dispatch nothing on its host. Their GPU side is unchanged."""
    out = list(priced)
    for i, (op, p) in enumerate(zip(ops, priced, strict=True)):
        beside = (ops[k] for k in (i - 1, i + 1) if 0 <= k < len(ops))
        wrapping = p.kind == FREE and any(o.category == COMMUNICATION and o.phase == op.phase for o in beside)
        if p.kind == WAIT or wrapping:
            out[i] = dataclasses.replace(p, host_s=0.0)
    return out


# The copies DTensor's sequence-parallel redistribute puts between a collective on dim 0 and the sequence dimension
_REORDERING_COPIES = ("aten.clone.", "aten.cat.", "aten.copy_.")


def _async_tensor_parallel(ops: list[OpRecord], priced: list[Priced]) -> list[Priced]:
    """Async TP (frameworks.Kernels.async_tp): a tensor-parallel all-gather whose output a matmul reads, through the
    functional wait, views and the copy that moves the gathered sequence dimension into place, runs in as many chunks
    as the group has ranks, each chunk's matmul as it lands; a reduce-scatter of a matmul's output likewise, each chunk
    sent as it is computed (torch's fused_all_gather_matmul and fused_matmul_reduce_scatter). The copies between are
    folded into the fused op: no kernel."""
    out = list(priced)
    for i, (op, p) in enumerate(zip(ops, priced, strict=True)):
        if p.kind != COLLECTIVE or op.group != "tensor_parallel" or op.group_size < 2:
            continue
        kind = collective_kind(op.name)
        if kind not in ("all_gather", "reduce_scatter"):
            continue
        forward = kind == "all_gather"
        chain, copies = set(p.writes if forward else p.reads), []
        steps = range(i + 1, min(len(ops), i + 16)) if forward else range(i - 1, max(-1, i - 16), -1)
        for j in steps:
            near, linked = (priced[j].reads, priced[j].writes) if forward else (priced[j].writes, priced[j].reads)
            if not chain.intersection(near):
                continue
            if priced[j].category == MATMUL:
                for k in copies:
                    out[k] = dataclasses.replace(out[k], kind=FREE, gpu_s=0.0, host_s=0.0)
                out[i] = dataclasses.replace(p, chunks=op.group_size)
                break
            if priced[j].kind == KERNEL:
                if not ops[j].name.startswith(_REORDERING_COPIES):
                    break  # a norm, an activation...: the collective is not next to its matmul
                copies.append(j)
            chain.update(linked)
    return out


def _fusable(op: OpRecord, p: Priced) -> bool:
    return p.kind in (KERNEL, FREE) and p.category in (OTHER,) and op.category == OTHER


# The ops of a cross-entropy loss as the dry run records it (F.cross_entropy's decomposition, forward and backward)
_LOSS_OPS = ("aten._log_softmax.", "aten.nll_loss", "aten._log_softmax_backward_data.")


def fused(ops: list[OpRecord], priced: list[Priced], chip: Chip, inner: bool = True, loss: bool = True) -> list[Priced]:
    """Each maximal run of elementwise and reduction ops (category other, views among them) within one phase becomes
    one kernel moving only the storages that enter the run from before it and those it writes that are read after it
    (or never read again in the step: gradients, state). Matmuls, attention, collectives and optimizer ops end a run.
    Which runs fuse (frameworks.Kernels): a run holding the loss's ops (its forward, after the LM head, and its
    gradient) where `loss`; any other where `inner`, but one that opens or closes its phase (the embedding's) only
    where both: a framework that fuses inside its blocks alone (Megatron-LM) runs its embedding and loss op by op,
    one with a fused loss kernel alone (llm-foundry's) its embedding too."""
    last_read: dict[int, int] = {}
    for i, op in enumerate(ops):
        for key, _ in op.storages:
            last_read[key] = i
    out: list[Priced] = []
    i = 0
    while i < len(ops):
        if not _fusable(ops[i], priced[i]):
            out.append(priced[i])
            i += 1
            continue
        j = i
        while j < len(ops) and _fusable(ops[j], priced[j]) and ops[j].phase == ops[i].phase:
            j += 1
        if any(op.name.startswith(_LOSS_OPS) for op in ops[i:j]):
            fuse = loss
        elif i == 0 or ops[i - 1].phase != ops[i].phase or j == len(ops) or ops[j].phase != ops[i].phase:
            fuse = inner and loss
        else:
            fuse = inner
        if fuse:
            out.append(_one_kernel(ops[i:j], priced[i:j], last_read, j, chip))
        else:
            out.extend(priced[i:j])
        i = j
    return out


def _one_kernel(run: list[OpRecord], priced: list[Priced], last_read: dict[int, int], end: int, chip: Chip) -> Priced:
    written: dict[int, int] = {}
    entering: dict[int, int] = {}
    for op, p in zip(run, priced, strict=True):
        for key, nbytes in op.storages:
            if key not in written:
                entering[key] = max(entering.get(key, 0), nbytes)
        if p.kind != KERNEL:  # a view or an allocation (empty) writes no bytes: its storage is not the kernel's output
            continue
        for key, nbytes in op.output_storages:
            written[key] = max(written.get(key, 0), nbytes)
    leaving = {key: n for key, n in written.items() if last_read.get(key, end) >= end or key not in last_read}
    moved = sum(entering.values()) + sum(leaving.values())
    kernels = [p for p in priced if p.kind == KERNEL]
    sync = any(p.sync for p in priced)
    if not kernels:  # views only
        return Priced(FREE, OTHER, run[0].phase, 0.0, sum(p.host_s for p in priced), ops=len(run), sync=sync)
    reads = tuple(entering)
    # One launch; the run's views and metadata ops still cost the host what they cost it (nothing under compile)
    host = max(p.host_s for p in kernels) + sum(p.host_s for p in priced if p.kind == FREE)
    return Priced(KERNEL, OTHER, run[0].phase, stream_seconds(moved, chip), host, reads, tuple(written),
                  ops=len(run), sync=sync)  # fmt: skip
