"""What this CPU's kernels can run, found by running them: a tiny op once per process, cached.

CPUs differ from one machine to the next, and torch's CPU kernels with them. oneDNN (torch's mkldnn) has
no LSTM under bf16 or fp16 autocast on a CPU without AVX-512: `aten.mkldnn_rnn_layer` raises "could not
create a primitive descriptor for the LSTM forward propagation primitive" (seen 2026-12-01 on an AVX2
machine; reproduced here with ONEDNN_MAX_CPU_ISA=AVX2). Flags in /proc/cpuinfo do not say which kernels
a given torch build has, so `cannot_run` runs the op itself.

    cannot_run("lstm", "bf16-mixed")        # None where it runs, else the reason (tests skip with it)
    missing_kernel_line(error, precision)   # one line for a fit that hit such a limit, or None
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["PROBES", "cannot_run", "missing_kernel_line"]

# oneDNN's words for the primitive it could not build, and the aten op that asked for it.
_NO_PRIMITIVE = re.compile(r"could not create a primitive descriptor for (?:the |an? )?(?P<what>[\w ]+?) primitive")
_ATEN_OPS = {"lstm": "aten.mkldnn_rnn_layer", "gru": "aten.mkldnn_rnn_layer", "rnn": "aten.mkldnn_rnn_layer",
             "convolution": "aten.mkldnn_convolution", "matmul": "aten.mkldnn_matmul",
             "inner product": "aten.mkldnn_linear"}  # fmt: skip


def _autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def _weights_dtype(precision: str) -> torch.dtype:
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


def _run(module: nn.Module, x: torch.Tensor, precision: str) -> None:
    """One forward and backward of `module` on `x` in `precision`, as Lightning runs it on a CPU."""
    dtype = _weights_dtype(precision)
    module = module.to(dtype)
    x = x.to(dtype).requires_grad_()
    autocast = _autocast_dtype(precision)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()


PROBES: dict[str, Callable[[str], None]] = {
    "lstm": lambda p: _run(nn.LSTM(4, 8, batch_first=True), torch.randn(2, 3, 4), p),
    "gru": lambda p: _run(nn.GRU(4, 8, batch_first=True), torch.randn(2, 3, 4), p),
    "conv2d": lambda p: _run(nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8), p),
    "matmul": lambda p: _run(nn.Linear(16, 16), torch.randn(4, 16), p),
}


@functools.cache
def cannot_run(op: str, precision: str) -> str | None:
    """Why this CPU cannot run `op` (a PROBES name) in `precision` (a Lightning precision), or None.

    The tiny op runs once per process (cached). Its RNG draws happen under a forked generator."""
    if op not in PROBES:
        raise ValueError(f"no CPU probe named {op!r}; known: {', '.join(PROBES)}")
    try:
        with torch.random.fork_rng(devices=[]):
            PROBES[op](precision)
    except RuntimeError as err:
        return f"this CPU ({torch.backends.cpu.get_cpu_capability()}) cannot run {op} in {precision}: {_first(err)}"
    return None


def missing_kernel_line(error: BaseException, precision: str) -> str | None:
    """One line for a fit stopped because this CPU's oneDNN has no kernel for an op in its precision.

    It names the op, the precision and the CPU, and the fix. None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    found = _NO_PRIMITIVE.search(str(error))
    if found is None:
        return None
    what = found["what"].strip()
    kind = next((k for k in _ATEN_OPS if what.lower().startswith(k)), None)
    op = f"{_ATEN_OPS[kind]} ({what})" if kind else what
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"this CPU ({capability}) lacks the kernel for {op} in {precision}: torch's oneDNN has none for it here "
        "(its bf16 and fp16 RNNs need AVX-512); train in 32-true on this machine, or in "
        f"{precision} on a GPU or a CPU with AVX-512"
    )


def _first(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line.split(". Run workload with")[0]  # oneDNN's hint about ONEDNN_VERBOSE
