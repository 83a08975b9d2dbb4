"""What one GPU does with each class of op, measured for the GPU op-time model (docs/time.md): run by gpu_check.py.

Every time here is kernel time on the GPU (replay.kernel_seconds: CUDA events behind a spin kernel, so the
host's launch is left out), except where a row says host or wall. It writes one JSON file:

    gemm        matmuls over a grid and a random sample of (m, n, k), per dtype and operand layout, inputs hot
                (the same tensors each call) and, below 2x L2, cold (rotated copies that outgrow L2)
    sdpa        scaled_dot_product_attention forward and forward+backward per backend, head dim, sequence and
                causality, at a fixed 16k tokens a batch as FlashAttention's papers benchmark
    memory      memory-bound kernels (copy, add, scale, GeLU, SiLU, casts, softmax, norms, cross-entropy,
                embedding) from 16 KiB to 1 GiB, hot and cold
    launch      the host's eager dispatch per op (forward, and with autograd), a tiny kernel's GPU time, and
                the same kernels back to back in a CUDA graph
    optimizer   fused and foreach AdamW steps over parameter sets of 1M to 400M elements
    steps       per ToyLM config: its dry run's ops on this GPU, each op's kernel time replayed in the step's order
                (replay.sequence_seconds), the real step (events over steps, and host time alone), a profiled
                real step's kernel time per aten op, and torch's RuntimeEstimator in both its modes

`--dry-run` (or no CUDA) runs every part at toy size on the CPU, to check the script, not the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lmledger.ledger.timing.steptime import replay

REPO = Path(__file__).resolve().parents[1]


def kernel_s(call: Callable[[], object], device: torch.device, budget_s: float = 0.02, spin: int = 0) -> float:
    """Median kernel seconds of `call` (replay.kernel_seconds); `spin`: cycles, for calls whose dispatch is long."""
    if spin and device.type == "cuda":
        saved, replay._SPIN_CYCLES = replay._SPIN_CYCLES, spin
        try:
            return replay.kernel_seconds(call, device, budget_s=budget_s)[0]
        finally:
            replay._SPIN_CYCLES = saved
    return replay.kernel_seconds(call, device, budget_s=budget_s)[0]


def l2_bytes(device: torch.device) -> int:
    return replay.cache_bytes(device)


def same(made: tuple) -> Callable[[], tuple]:
    """The same inputs every call: hot, in L2 where they fit."""
    return lambda: made


def on(func: Callable, pick: Callable[[], tuple]) -> object:
    return func(*pick())


def rotating(make: Callable[[], tuple], device: torch.device, limit: int = 64) -> Callable[[], tuple]:
    """A call-to-call rotation through enough copies of `make()`'s tensors to outgrow twice the L2: cold inputs."""
    sets = [make()]
    each = sum(t.nbytes for t in sets[0] if isinstance(t, torch.Tensor))
    copies = max(1, min(limit, -(-2 * l2_bytes(device) // max(1, each))))
    sets += [make() for _ in range(copies - 1)]
    turn = iter(range(1 << 62))
    return lambda: sets[next(turn) % copies]


# ---------------------------------------------------------------------------------------------------------------
# matmuls

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, layout: str, device: torch.device):
    """(a, b) of a [m, k] @ [k, n] product; layout NN, NT (b stored transposed: a Linear's forward, x @ W.T) or
    TN (a stored transposed: the weight gradient, grad.T @ x)."""
    a = (
        torch.randn(k, m, device=device, dtype=dtype).t()
        if layout == "TN"
        else torch.randn(m, k, device=device, dtype=dtype)
    )
    b = (
        torch.randn(n, k, device=device, dtype=dtype).t()
        if layout == "NT"
        else torch.randn(k, n, device=device, dtype=dtype)
    )
    return a, b


def _fp8_operands(m: int, n: int, k: int, device: torch.device):
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm requires
    one = torch.ones((), device=device)
    return a, b, one


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def gemm_row(m: int, n: int, k: int, dtype: str, layout: str, device: torch.device, cold: bool) -> dict:
    row = {"m": m, "n": n, "k": k, "dtype": dtype, "layout": layout, "cold": cold}
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        if dtype == "fp8":
            make, func = functools.partial(_fp8_operands, m, n, k, device), _scaled_mm
        else:
            make, func = functools.partial(_operands, m, n, k, _DTYPES[dtype], layout, device), torch.mm
        pick = rotating(make, device) if cold else same(make())
        row["seconds"] = kernel_s(functools.partial(on, func, pick), device)
    except Exception as err:  # noqa: BLE001 - a shape or dtype this build refuses: recorded, the sweep goes on
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return row


def gemm_sweep(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    grid = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384] if not dry else [16, 64]
    cap = 4e12 if not dry else 1e7  # FLOPs: 16384^2 x 8192 and smaller (about 5 ms at peak)
    shapes = [(m, n, k) for m in grid for n in grid for k in grid if 2 * m * n * k <= cap]
    rng = random.Random(0)
    sample = []  # log-uniform, half at multiples of 64 (as layer widths are), half anywhere: the grid's held-out check
    while len(sample) < (160 if not dry else 4):
        dims = [int(math.exp(rng.uniform(math.log(64), math.log(32768 if not dry else 128)))) for _ in range(3)]
        if len(sample) % 2 == 0:
            dims = [max(64, d // 64 * 64) for d in dims]
        if 2 * math.prod(dims) <= cap:
            sample.append(tuple(dims))
    # the published runs' layer shapes: tokens x (hidden / tp) and (ffn / tp), e.g. GPT-3 2.7B-175B and Llama 8B-70B
    model = (
        [(8192, h, h) for h in (2560, 3072, 5120, 6144, 12288 // 8 * 3)]
        + [
            (8192, 3 * 4096 // 2, 4096),
            (8192, 14336 // 4, 4096),
            (8192, 4096, 14336 // 4),
            (8192, 50304, 2048),
            (4096, 10000, 1024),
            (16384, 10000, 1024),
            (16384, 128256 // 8, 8192),
            (4095, 4095, 4095),
            (4097, 4097, 4097),
        ]
        if not dry
        else []
    )
    rows = []
    for m, n, k in shapes + sample + model:
        if time.monotonic() > deadline:
            rows.append({"skipped": "out of time"})
            break
        rows.append(gemm_row(m, n, k, "bf16", "NN", device, cold=False))
        if (m * k + k * n) * 2 < 2 * l2_bytes(device) and (m, n, k) in shapes:
            rows.append(gemm_row(m, n, k, "bf16", "NN", device, cold=True))
    probe = [(4096, 4096, 4096), (16384, 4096, 1024), (16384, 1024, 4096), (1024, 4096, 16384), (8192, 10000, 1024),
             (2048, 2048, 2048), (512, 512, 512)] if not dry else [(64, 64, 64)]  # fmt: skip
    for m, n, k in probe:
        for layout in ("NT", "TN"):
            rows.append(gemm_row(m, n, k, "bf16", layout, device, cold=False))
        for dtype in ("fp16", "fp32", "tf32") + (("fp8",) if device.type == "cuda" else ()):
            if time.monotonic() < deadline:
                rows.append(gemm_row(m, n, k, dtype, "NN", device, cold=False))
    rows += bmm_rows(device, dry, deadline)
    return rows


def bmm_rows(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    """Unfused attention, as Megatron-era trainers ran it: scores = bmm(q, k^T) and out = bmm(probs, v) per
    (batch x heads), and the softmax over the scores between them, in fp16 and bf16."""
    rows = []
    for dtype in ("fp16", "bf16"):
        for seq in (1024, 2048) if not dry else (32,):
            for head_dim in (64, 128) if not dry else (16,):
                for bh in (16, 64, 256) if not dry else (2,):
                    if time.monotonic() > deadline:
                        return rows
                    t = _DTYPES[dtype]
                    q = torch.randn(bh, seq, head_dim, device=device, dtype=t)
                    k = torch.randn(bh, head_dim, seq, device=device, dtype=t)
                    p = torch.randn(bh, seq, seq, device=device, dtype=t)
                    base = {"op": "bmm", "batch": bh, "seq": seq, "head_dim": head_dim, "dtype": dtype}
                    scores, out = functools.partial(torch.bmm, q, k), functools.partial(torch.bmm, p, q)
                    rows.append({**base, "m": seq, "n": seq, "k": head_dim, "seconds": kernel_s(scores, device)})
                    rows.append({**base, "m": seq, "n": head_dim, "k": seq, "seconds": kernel_s(out, device)})
                    softmax = functools.partial(torch.softmax, p, -1)
                    rows.append({**base, "op": "softmax", "numel": p.numel(), "seconds": kernel_s(softmax, device)})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# attention


def sdpa_sweep(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    from torch.nn.attention import SDPBackend

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    tokens, hidden = (16384, 2048) if not dry else (256, 64)
    rows = []
    for head_dim in (64, 128, 256) if not dry else (32,):
        for seq in (512, 1024, 2048, 4096, 8192, 16384) if not dry else (64, 128):
            for causal in (True, False):
                for name, backend in backends.items():
                    if time.monotonic() > deadline:
                        return rows + [{"skipped": "out of time"}]
                    if name == "math" and seq > 2048:
                        continue  # materializes b x h x s x s scores: slow and large, and no trainer runs it there
                    heads, batch = hidden // head_dim, max(1, tokens // seq)
                    row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
                           "backend": name, "dtype": "bf16"}  # fmt: skip
                    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                                           requires_grad=True) for _ in range(3))  # fmt: skip
                    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
                    forward = functools.partial(_attention, backend, causal, q, k, v)
                    try:
                        with torch.no_grad():
                            row["forward_s"] = kernel_s(forward, device)
                        both = functools.partial(_attention_both, forward, grad, (q, k, v))
                        row["forward_backward_s"] = kernel_s(both, device, spin=2_000_000)
                    except Exception as err:  # noqa: BLE001 - a backend that does not take this shape
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                    rows.append(row)
    return rows


def _attention(backend, causal: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    if backend is None:  # the backend torch picks
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _attention_both(forward: Callable, grad: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    forward().backward(grad)
    for t in inputs:
        t.grad = None


# ---------------------------------------------------------------------------------------------------------------
# memory-bound kernels


def _memory_ops(n: int, dtype: torch.dtype, device: torch.device) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (make inputs, call on them, bytes read + written per call)."""
    e = torch.empty((), dtype=dtype).element_size()
    rows, width = max(1, n // 1024), min(n, 1024)
    vocab = 10000
    ce_rows = max(1, n // vocab)
    x = lambda: (torch.randn(n, device=device, dtype=dtype),)  # noqa: E731
    xy = lambda: (torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype))  # noqa: E731
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    eo = torch.empty((), dtype=other).element_size()
    return {
        "copy": (xy, lambda a, b: b.copy_(a), 2 * n * e),
        "add": (xy, lambda a, b: torch.add(a, b), 3 * n * e),
        "mul_scalar": (x, lambda a: a * 1.5, 2 * n * e),
        "gelu": (x, lambda a: F.gelu(a), 2 * n * e),
        "silu": (x, lambda a: F.silu(a), 2 * n * e),
        "cast": (x, lambda a: a.to(other), n * (e + eo)),
        "softmax": (x, lambda a: torch.softmax(a.view(rows, width), -1), 2 * n * e),
        "sum_lastdim": (x, lambda a: a.view(rows, width).sum(-1), n * e + rows * e),
        "layer_norm": (x, lambda a: F.layer_norm(a.view(rows, width), (width,)), 2 * n * e),
        "cross_entropy": (
            lambda: (
                torch.randn(ce_rows, vocab, device=device, dtype=dtype),
                torch.randint(0, vocab, (ce_rows,), device=device),
            ),
            lambda a, t: F.cross_entropy(a, t),
            ce_rows * vocab * e,
        ),  # fmt: skip
        "embedding": (
            lambda: (
                torch.randint(0, vocab, (rows,), device=device),
                torch.randn(vocab, width, device=device, dtype=dtype),
            ),
            lambda i, w: F.embedding(i, w),
            2 * n * e,
        ),  # fmt: skip
    }


def memory_sweep(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    rows = []
    exponents = range(12, 30, 2) if not dry else (10, 12)
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for exp in exponents:
            n = 1 << exp
            for name, (make, call, moved) in _memory_ops(n, dtype, device).items():
                if time.monotonic() > deadline:
                    return rows + [{"skipped": "out of time"}]
                for cold in (False, True) if moved < 2 * l2_bytes(device) else (False,):
                    row = {"op": name, "numel": n, "dtype": dtype_name, "bytes": moved, "cold": cold}
                    try:
                        pick = rotating(make, device, limit=256) if cold else same(make())
                        with torch.no_grad():
                            row["seconds"] = kernel_s(functools.partial(on, call, pick), device)
                    except Exception as err:  # noqa: BLE001
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# launch and dispatch


def launch_probe(device: torch.device) -> dict:
    from lmledger.ledger.timing.steptime.calibrate import _Chain

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    x = torch.zeros(1024, device=device)
    out: dict = {}
    n = 2000
    for _ in range(2):  # the second pass is the one kept: the first warms the caching allocator and dispatcher
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        out["host_enqueue_s_per_op"] = (time.perf_counter() - t0) / n
        sync()
        out["wall_s_per_op_queued"] = (time.perf_counter() - t0) / n
    with torch.no_grad():
        out["tiny_kernel_s"] = kernel_s(lambda: x.add_(1.0), device)
    model = _Chain().to(device)
    y = torch.randn(16, device=device, requires_grad=True)
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            model(y).backward()
        host = time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t0
    from lmledger.ledger.count.ops import OpRecorder

    recorder = OpRecorder({})
    with recorder:
        model(y).backward()
    ops = len(recorder.records)
    out["autograd_chain"] = {"ops": ops, "host_s_per_op": host / 20 / ops, "wall_s_per_op": wall / 20 / ops}
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1.0)
        graph.replay()
        out["graph_s_per_kernel"] = kernel_s(graph.replay, device) / n
    return out


# ---------------------------------------------------------------------------------------------------------------
# the optimizer


def optimizer_sweep(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    rows = []
    for total in (1 << 20, 10 << 20, 100 << 20, 400 << 20) if not dry else (1 << 12,):
        each = min(total, 4 << 20)
        for kind in ("fused", "foreach"):
            if time.monotonic() > deadline:
                return rows + [{"skipped": "out of time"}]
            params = [torch.randn(each, device=device, requires_grad=True) for _ in range(total // each)]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            opt = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
            opt.step()
            spin = 20_000_000 if kind == "foreach" else 2_000_000  # a foreach step dispatches for milliseconds
            seconds = kernel_s(opt.step, device, spin=spin)
            clip = kernel_s(functools.partial(torch.nn.utils.clip_grad_norm_, params, 1.0), device, spin=20_000_000)
            rows.append({"kind": kind, "params": total, "tensors": len(params), "dtype": "fp32", "seconds": seconds,
                         "clip_grad_norm_seconds": clip})  # fmt: skip
            del opt, params
    return rows


# ---------------------------------------------------------------------------------------------------------------
# a ToyLM step


def compact_ops(ops) -> list[dict]:
    """The dry run's ops, as the GPU model reads them: name, phase, category, FLOPs, bytes and tensor layouts."""
    from lmledger.ledger.count.ops import TensorSpec
    from lmledger.ledger.timing.steptime.tensors import leaves_of, thaw

    out = []
    for op in ops:
        specs = list(leaves_of(thaw(op.signature))) if op.signature is not None else []
        out.append({
            "name": op.name, "phase": op.phase, "category": op.category, "flops": op.flops,
            "bytes_read": op.bytes_read, "bytes_written": op.bytes_written, "dtype": op.dtype,
            "recompute": op.recompute,
            "tensors": [[list(s.shape), list(s.stride), s.dtype] for s in specs if isinstance(s, TensorSpec)],
        })  # fmt: skip
    return out


def profiled_ops(step: Callable, device: torch.device) -> list[dict]:
    """A real step under torch.profiler: each aten op that launched kernels, in order, with its input shapes and its
    kernels' GPU time (self: a nested op's kernels are its own)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = []
    for event in prof.events():
        own = getattr(event, "self_device_time_total", None)
        if own is None:
            own = getattr(event, "self_cuda_time_total", 0)
        if device.type == "cuda" and not own:
            continue
        if device.type != "cuda" and not event.name.startswith("aten::"):
            continue
        kernels = [k.name for k in getattr(event, "kernels", [])][:2]
        rows.append({"name": event.name, "shapes": event.input_shapes, "device_us": own,
                     "cpu_us": event.self_cpu_time_total, "start_us": event.time_range.start,
                     "kernels": [k[:120] for k in kernels]})  # fmt: skip
    rows.sort(key=lambda r: r["start_us"])
    return rows


ESTIMATOR_MODES = ("operator-level-cost-model", "operator-level-benchmark")


def runtime_estimator(config, batch: int, seq: int, device: torch.device, modes=ESTIMATOR_MODES) -> dict:
    """torch's RuntimeEstimator (torch.distributed._tools) over the same step, in each of `modes`, in ms."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    from lmledger.model import ToyLM

    out = {}
    for mode_name in modes:
        estimator = RuntimeEstimator()
        started = time.perf_counter()
        truncated = torch.nn.init.trunc_normal_  # reads a bound back (.item()), which a fake tensor cannot give
        torch.nn.init.trunc_normal_ = lambda t, *a, std=1.0, **k: torch.nn.init.normal_(t, std=std)
        try:
            with FakeTensorMode():
                with torch.device(device):
                    model = ToyLM(config)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                x = torch.randint(0, config.vocab_size, (batch, seq), device=device)
                with estimator(estimate_mode_type=mode_name):
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = model(x, x)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
            out[mode_name] = {"ms": estimator.total_runtime, "took_s": time.perf_counter() - started}
        except Exception as err:  # noqa: BLE001 - recorded beside the others
            out[mode_name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
        finally:
            torch.nn.init.trunc_normal_ = truncated
    return out


def gpu_model(dry, tokens: int, device: torch.device) -> dict:
    """The GPU op-time model's step (ledger/timing/gpu) of this dry run on this GPU (H200 on a CPU dry run), per
    framework setting: eager PyTorch as this step runs, and under torch.compile."""
    from lmledger.ledger.hardware.gpus import find_gpu
    from lmledger.ledger.timing.gpu import kernels_for, predict_gpu_step

    spec = find_gpu(torch.cuda.get_device_name()) if device.type == "cuda" else find_gpu("h200")
    if spec is None:
        return {"error": f"no GPU table entry for {torch.cuda.get_device_name()}"}
    out = {"gpu": spec.key}
    for framework in ("pytorch", "compile"):
        step = predict_gpu_step(dry.ops, spec, compute_dtype="bf16", kernels=kernels_for(framework), tokens=tokens,
                                model_flops=3 * dry.flops_forward)  # fmt: skip
        out[framework] = step.to_json() if hasattr(step, "to_json") else {"none": step.reason}
    return out


def step_check(name: str, config, batch: int, seq: int, device: torch.device, deadline: float) -> dict:
    from lmledger.ledger.dryrun.engine import NotTraced, training_step
    from lmledger.ledger.predict import toy_dry_run, toy_optimizer, toy_step
    from lmledger.ledger.run import Run
    from lmledger.model import ToyLM

    run = Run(config=config, batch_size=batch, seq_len=seq, precision="bf16-mixed", device=device)
    out: dict = {"config": name, "model": dataclasses.asdict(config), "batch": batch, "seq": seq,
                 "precision": run.precision, "fused_optimizer": run.fused_optimizer}  # fmt: skip
    started = time.perf_counter()
    dry = toy_dry_run(run)
    if isinstance(dry, NotTraced):
        return {**out, "error": f"dry run: {dry.reason}"}
    ops = list(dry.ops.ops)
    out["dry_run_s"] = time.perf_counter() - started
    out["gpu_model"] = gpu_model(dry, batch * seq, device)
    out["ops"] = compact_ops(ops)
    out["flops_hardware"] = dry.flops
    out["flops_forward"] = dry.flops_forward
    out["peak_predicted"] = dry.peak
    # the replay: each op's kernel time in the step's order, data flowing op to op
    started = time.perf_counter()
    medians, failed = replay.sequence_seconds(ops, device, rounds=5, budget_s=20.0)
    out["replay"] = {"seconds": medians, "failed": {str(k): v for k, v in failed.items()},
                     "took_s": time.perf_counter() - started}  # fmt: skip
    if time.monotonic() > deadline:
        return {**out, "skipped": "out of time after the replay"}
    # the real step (the dry run's: autocast forward, backward, fused AdamW; no clipping, no Lightning)
    torch.manual_seed(0)
    model = ToyLM(config).to(device)
    optimizer = toy_optimizer(run)(list(model.parameters()))
    data = tuple(torch.randint(0, config.vocab_size, (batch, seq), device=device) for _ in range(2))
    step = training_step(model, data, step=toy_step, optimizer=optimizer, precision=run.precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(3):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    n = 10 if device.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n
    sync()
    wall = (time.perf_counter() - t0) / n
    out["measured"] = {"step_s": wall, "host_s": host, "steps": n}
    if device.type == "cuda":
        out["measured"]["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        out["measured"]["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    out["profile"] = profiled_ops(step, device)
    del model, optimizer, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    left = deadline - time.monotonic()
    if left > 10:
        out["runtime_estimator"] = runtime_estimator_apart(config, batch, seq, device, left)
    return out


def runtime_estimator_apart(config, batch: int, seq: int, device: torch.device, timeout: float) -> dict:
    """runtime_estimator, each mode in a process of its own: torch's estimator can abort the process (seen on a CPU:
    `terminate called after throwing an instance of 'python_error'`), which must not take the other parts with it;
    the cost model (quick) first, then the benchmark (each op run on the GPU) in what time is left."""
    import subprocess

    out, end = {}, time.monotonic() + timeout
    for mode in ESTIMATOR_MODES:
        left = end - time.monotonic()
        what = json.dumps({"config": dataclasses.asdict(config), "batch": batch, "seq": seq, "device": device.type,
                           "mode": mode})  # fmt: skip
        try:
            proc = subprocess.run([sys.executable, __file__, "--runtime-estimator", what], capture_output=True,
                                  text=True, timeout=max(1.0, left))  # fmt: skip
        except subprocess.TimeoutExpired:
            out[mode] = {"error": f"timed out after {left:.0f} s"}
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            out[mode] = {"error": f"exit {proc.returncode}: {' | '.join(tail)[:300]}"}
        else:
            out.update(json.loads(lines[-1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for everything")
    parser.add_argument("--configs", default="cs336-medium,cs336-small")
    parser.add_argument("--runtime-estimator", help=argparse.SUPPRESS)  # runtime_estimator_apart's child
    args = parser.parse_args()
    if args.runtime_estimator:
        from lmledger.model import ModelConfig

        what = json.loads(args.runtime_estimator)
        config = ModelConfig(**what["config"])
        device = torch.device(what["device"])
        print(json.dumps(runtime_estimator(config, what["batch"], what["seq"], device, (what["mode"],))))
        return 0
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    started = time.monotonic()
    end = started + args.budget
    result: dict = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "dry_run": dry, "l2_bytes": l2_bytes(device)}  # fmt: skip
    if not dry:
        props = torch.cuda.get_device_properties(device)
        result["sms"] = props.multi_processor_count
        result["memory_bytes"] = props.total_memory

    def save() -> None:
        Path(args.out).write_text(json.dumps(result))

    def part(name: str, share: float, fn: Callable) -> None:
        """Run one part within `share` of what is left, recording its error rather than stopping."""
        t0 = time.monotonic()
        deadline = t0 + share * max(0.0, end - t0)
        try:
            result[name] = fn(deadline)
        except Exception as err:  # noqa: BLE001 - one part's failure must not lose the others
            result[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
        result.setdefault("took_s", {})[name] = round(time.monotonic() - t0, 1)
        print(f"gpu_ops: {name} took {result['took_s'][name]} s", flush=True)
        save()

    part("launch", 1.0, lambda d: launch_probe(device))
    from lmledger.model import ModelConfig

    sizes = {  # configs/cs336-*.yaml at the BPE corpus's 10k vocabulary; batch as the configs say
        "cs336-small": (ModelConfig(10000, 1024, 768, 12, 12, 3072), 16),
        "cs336-medium": (ModelConfig(10000, 1024, 1024, 24, 16, 4096), 16),
    }
    names = args.configs.split(",")
    for name in names[:1] if dry else names:  # a dry run shrinks every config to one toy: one is enough
        cfg, batch = sizes[name]
        seq = cfg.context_length
        if dry:
            cfg, batch, seq = ModelConfig(256, 64, 64, 2, 2, 128), 2, 64
        part(f"step {name}", 0.35, lambda d, c=cfg, b=batch, s=seq, n=name: step_check(n, c, b, s, device, d))
    part("gemm", 0.4, lambda d: gemm_sweep(device, dry, d))
    part("sdpa", 0.45, lambda d: sdpa_sweep(device, dry, d))
    part("memory", 0.6, lambda d: memory_sweep(device, dry, d))
    part("optimizer", 1.0, lambda d: optimizer_sweep(device, dry, d))
    result["total_s"] = round(time.monotonic() - started, 1)
    save()
    print(f"gpu_ops: wrote {args.out} in {result['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
