"""The dry run's measured twin inside a fit: the same figures, read off the real steps.

One step here is one optimizer step. Under automatic optimization it is `accumulate` micro-batches
(Lightning's accumulate_grad_batches). Under manual optimization it is one batch: the module steps its
optimizers itself. Everything opens at a batch's start (`batch_start`). It closes at a batch's end or
on an exception:

    step 1   FLOPs (flopcounter.StepFlopCounter, over every micro-batch). The saved activations of the
             first micro-batch's forward: saved-tensor hooks, closed at backward so nothing is held
             longer than the step holds it. Then params, grads and optimizer state, once the
             optimizer stepped.
    step 2   the peak, in the steady state (optimizer state exists). CUDA: max_memory_allocated,
             stats reset at its start, read after its optimizer step. Elsewhere: the live tensor
             bytes ledger.count.memtrack counts, with the phase it fell in. Python's cycle collector is off
             for the step, as in the dry run. So what a step leaves in reference cycles is freed at
             the same point.

The phases are the dry run's (dryrun.phases): forward, backward, optimizer step. Backward includes
zero_grad: it only frees. Under accumulation: first micro-batch, later micro-batches, optimizer step.
"""

from __future__ import annotations

import contextlib
import gc
import types

import torch

from lmledger.ledger.closedform.activations import measure_saved_activations
from lmledger.ledger.closedform.memory import measure_state_bytes
from lmledger.ledger.count.flopcounter import StepFlopCounter
from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.dryrun.engine import phases
from lmledger.ledger.dryrun.fakecopy import batch_tensors
from lmledger.ledger.report import Figures
from lmledger.ledger.sharding.sharded import local_state_bytes

__all__ = ["StepMeasurement", "compiled_parts"]


class StepMeasurement:
    """Measures steps 1 and 2 of a fit (module docstring). `figures()` is what it has read so far.

    Arguments:

        accumulate     micro-batches per optimizer step (1 under manual optimization)
        manual         the module steps its optimizers in training_step (each batch is one step)
        count_flops    count FLOPs on the real step. False under torch.compile: the caller counts a
                       meta copy.
        activations    measure saved activations. False under torch.compile: the compiled graph saves
                       a fused set the eager prediction does not describe.
        compiled       the module runs torch.compile'd code (`compiled_parts`). Step 1 is then left
                       alone: dynamo compiles on it, as it would without the Ledger. The FLOPs are
                       counted on step 2, on the compiled code, beside the peak. Both counters are
                       dispatch modes that let compiled code run compiled (ignore_compile_internals):
                       by default dynamo runs a frame met under a mode eager for good (canary
                       test_dynamo_runs_a_frame_eager_for_good_under_a_dispatch_mode).
    """

    def __init__(
        self, device: torch.device, *, accumulate: int = 1, manual: bool = False, count_flops: bool = True,
        activations: bool = True, compiled: bool = False,
    ) -> None:  # fmt: skip
        self.device = device
        self.compiled = compiled
        self.accumulate = 1 if manual else accumulate
        self.manual = manual
        self.count_flops = count_flops
        self.measure_activations = activations
        self.values: dict[str, int] = {}
        self.why_missing: dict[str, str] = {} if activations else {"activations": "n/a (compiled)"}
        self.peak_phase: str | None = None
        self.steps_done = 0
        self._micro = 0  # micro-batches run of the current step
        self._stepped_at: int | None = None  # global_step when the current step began
        self._counter = None
        self._hooks: contextlib.ExitStack | None = None
        self._saved = None
        self._tracker: MemoryTracker | None = None
        self._cuda_peak = False
        self._resizes: contextlib.ExitStack | None = None  # FSDP2: UntypedStorage.resize_ followed (step 2)
        self._gc_was_enabled = False
        self._phases = phases(self.accumulate)

    @property
    def done(self) -> bool:
        return self.steps_done >= 2

    def figures(self) -> Figures:
        v = self.values
        return Figures(
            params=v.get("params"), grads=v.get("grads"), optimizer=v.get("optimizer"),
            activations=v.get("activations"), autocast_weight_copies=v.get("autocast_weight_copies"),
            peak=v.get("peak"), peak_phase=self.peak_phase, flops_hardware=v.get("flops_hardware"),
            why_missing=dict(self.why_missing),
        )  # fmt: skip

    # -- the hooks ------------------------------------------------------------------------------

    def batch_start(self, module: torch.nn.Module, optimizers: list, batch: object, global_step: int) -> None:
        if self.done:
            return
        if self._micro == 0:
            self._stepped_at = global_step
            if self.steps_done == 0:
                self._open_step_one(module)
            else:
                self._open_step_two(module, optimizers, batch)
        self._phase(self._phases[0] if self.accumulate == 1 or self._micro == 0 else self._phases[1])

    def before_backward(self) -> None:
        self._close_hooks()  # forward is over: what backward needs is saved
        if self.accumulate == 1:
            self._phase(self._phases[1])

    def before_zero_grad(self) -> None:
        if self.accumulate == 1:
            self._phase(self._phases[1])  # zero_grad only frees; the dry run charges it to backward

    def before_optimizer_step(self) -> None:
        self._phase(self._phases[2])

    def batch_end(self, module: torch.nn.Module, optimizers: list, global_step: int) -> bool:
        """After a batch; True when this batch ended step 2 (every figure has been read)."""
        if self.done:
            return False
        self._close_hooks()  # a step that skipped backward
        self._micro += 1
        stepped = self.manual or global_step != self._stepped_at
        if not stepped:
            return False  # still accumulating
        self._micro = 0
        self.steps_done += 1
        if self.steps_done == 1:
            self._close_step_one(module, optimizers)
            return False
        self._close_step_two()
        return True

    def close(self) -> None:
        """Unwind whatever is open (an exception, or a fit that ended inside a measured step)."""
        self._close_hooks()
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if getattr(self, "_local_flops", None) is not None:
            self._local_flops.stop()
            self._local_flops = None
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        self._stop_following_resizes()
        self._restore_gc()

    # -- step 1 ---------------------------------------------------------------------------------

    def _open_step_one(self, module: torch.nn.Module) -> None:
        if self.compiled:  # dynamo compiles this step: nothing may watch it (class docstring)
            return
        if self.count_flops:
            if _is_sharded(module):  # tensor parallel: a DTensor matmul costs this rank its local shards'
                from lmledger.ledger.sharding.rankstate import local_flops

                self._local_flops = local_flops()
                self._local_flops.start()
            self._counter = StepFlopCounter()
            self._counter.__enter__()
        if self.measure_activations:
            self._hooks = contextlib.ExitStack()
            self._saved = self._hooks.enter_context(measure_saved_activations(module))

    def _stop_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.values["flops_hardware"] = self._counter.get_total_flops()
            self._counter = None
        if getattr(self, "_local_flops", None) is not None:
            self._local_flops.stop()
            self._local_flops = None

    def _close_step_one(self, module: torch.nn.Module, optimizers: list) -> None:
        self._stop_counter()
        if self._saved is not None:
            self.values["activations"] = self._saved.activations
            self.values["autocast_weight_copies"] = self._saved.autocast_weight_copies
            self._saved = None
        measure = local_state_bytes if _is_sharded(module) else measure_state_bytes  # FSDP2: this rank's shards
        state = measure(module, optimizers[0] if len(optimizers) == 1 else None)
        if len(optimizers) > 1:  # each optimizer's state, every storage once
            state["optimizer"] = sum(measure(module, o)["optimizer"] for o in optimizers)
        self.values.update(state)

    # -- step 2 ---------------------------------------------------------------------------------

    def _open_step_two(self, module: torch.nn.Module, optimizers: list, batch: object) -> None:
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        if self.compiled and self.count_flops:  # compiled on step 1: count the compiled code's FLOPs now
            self._counter = StepFlopCounter()
            self._counter.__enter__()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_peak = True
            return
        # Each optimizer on its own: the FSDP2 tracker reads an optimizer's DTensor state by its local shards.
        self._tracker = (self._local_shard_tracker() if _is_sharded(module) else MemoryTracker()).track(
            module, *optimizers, batch_tensors(batch)
        )
        self._tracker.phase(self._phases[0])
        self._tracker.start()

    def _close_step_two(self) -> None:
        if self._tracker is not None:
            self._tracker.stop()
            self.values["peak"] = self._tracker.peak_bytes
            self.peak_phase = self._tracker.peak_phase
            self._tracker = None
            self._stop_following_resizes()
        elif self._cuda_peak:
            torch.cuda.synchronize(self.device)
            self.values["peak"] = torch.cuda.max_memory_allocated(self.device)
        self._stop_counter()  # compiled: opened at step 2, inside the tracker's mode (closed first, above)
        self._restore_gc()

    # -- helpers --------------------------------------------------------------------------------

    def _local_shard_tracker(self) -> MemoryTracker:
        """ledger.sharding.sharded's tracker, the one its measured twin uses.

        DTensors count by their local shard. The storages FSDP2 resizes outside any operator (its
        unsharded parameters) are followed while it runs.
        """
        from lmledger.ledger.sharding.rankstate import ShardedTracker, following_resizes

        self._resizes = contextlib.ExitStack()
        self._resizes.enter_context(following_resizes())
        return ShardedTracker()

    def _stop_following_resizes(self) -> None:
        if self._resizes is not None:
            self._resizes.close()
            self._resizes = None

    def _phase(self, name: str) -> None:
        if self._tracker is not None and self._tracker.running:
            self._tracker.phase(name)

    def _close_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    def _restore_gc(self) -> None:
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = False


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
