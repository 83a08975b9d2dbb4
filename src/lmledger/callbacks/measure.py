"""The fit's step measurement: ledger.dryrun.watch.StepWatch, the dry run's own reader, on the Lightning steps.

The Ledger's hooks feed it the events the dry run feeds it (batch start, zero_grad, backward, optimizer
step, batch end), so the fit's measured column and the dry run's prediction are read by the same code.
Here: which reading a module needs (whole tensors, or an FSDP2/TP rank's local shards), the CUDA
allocator's peak on a GPU, and torch.compile'd code found and left to compile.
"""

from __future__ import annotations

import types

import torch

from lmledger.ledger.dryrun.watch import Reading, StepWatch
from lmledger.ledger.report import Figures

__all__ = ["compiled_parts", "fit_watch", "measured_figures"]


def fit_watch(
    module: torch.nn.Module, *, accumulate: int, count_flops: bool, activations: bool, compiled: bool
) -> StepWatch:
    """The StepWatch for `module`'s fit (its arguments are StepWatch's), reading DTensor parameters by shard."""
    reading = Reading()
    if _is_sharded(module):  # FSDP2 or tensor parallel: this rank's shards (ledger.sharding's reading)
        from lmledger.ledger.sharding.rankstate import LOCAL_SHARDS

        reading = LOCAL_SHARDS
    return StepWatch(
        module.device, accumulate=accumulate, manual=not module.automatic_optimization, count_flops=count_flops,
        activations=activations, compiled=compiled, allocator_peak=True, reading=reading,
    )  # fmt: skip


def measured_figures(watch: StepWatch) -> Figures:
    """What the watch has read so far, as the report's measured column."""
    v = watch.values
    return Figures(
        params=v.get("params"), grads=v.get("grads"), optimizer=v.get("optimizer"),
        activations=v.get("activations"), autocast_weight_copies=v.get("autocast_weight_copies"),
        peak=v.get("peak"), peak_phase=watch.peak_phase, flops_hardware=v.get("flops_hardware"),
        why_missing=dict(watch.why_missing),
    )  # fmt: skip


def compiled_parts(module: torch.nn.Module) -> list[str]:
    """Where `module` runs torch.compile'd code: submodules compiled in place (`module.compile()`) or
    wrapped (`torch.compile(submodule)`), compiled callables kept as attributes (LitLM's `_forward`), and
    the module's own `forward` or `training_step` defined under `@torch.compile`.

    A compiled function reached some other way (a closure, a global) is not found."""
    found = [name for name in ("forward", "training_step") if _is_compiled(getattr(type(module), name, None))]
    for name, sub in module.named_modules():
        where = name or type(module).__name__
        if getattr(sub, "_compiled_call_impl", None) is not None or _is_compiled(sub):
            found.append(where)
            continue
        found += [f"{where}.{key}" for key, value in vars(sub).items() if key != "_modules" and _is_compiled(value)]
    return found


def _is_compiled(obj: object) -> bool:
    """A torch.compile result: an OptimizedModule, or a function dynamo wraps (a plain function, so that
    an object answering every attribute, a Mock say, is not taken for one)."""
    from torch._dynamo.eval_frame import OptimizedModule  # canary test_compiled_objects_are_recognisable

    if isinstance(obj, OptimizedModule):
        return True
    function = getattr(obj, "__func__", obj) if isinstance(obj, types.MethodType) else obj
    return isinstance(function, types.FunctionType) and callable(vars(function).get("_torchdynamo_orig_callable"))


def _is_sharded(module: torch.nn.Module) -> bool:
    """Whether `module` holds DTensor parameters (FSDP2), whose untyped_storage() is the global size."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
