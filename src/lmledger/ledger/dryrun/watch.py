"""The one reader of a training step: counts steps 1 and 2 from the events of whatever loop runs them.

Three loops feed it the same events: the dry run on fake tensors and its measured twin on real ones
(engine.ledger_of_step, manualopt.ledger_of_manual_step), and a Lightning fit (the Ledger's hooks).
So a figure predicted and the same figure measured are read by the same code. One step is one
optimizer step: `accumulate` micro-batches, or one batch under manual optimization, whose training_step
steps its optimizers itself. Everything opens at a batch's start and closes at a batch's end, or in
`close()` after an exception:

    step 1   FLOPs (flopcounter.StepFlopCounter, over every micro-batch; split into forward and
             backward at the backward events). The saved activations of the first micro-batch's forward:
             saved-tensor hooks, closed at backward so nothing is held longer than the step holds it.
             Then params, grads and optimizer state, once the optimizer stepped.
    step 2   the peak, in the steady state (optimizer state exists): the live tensor bytes
             ledger.count.memtrack counts, with the phase it fell in; on CUDA in a fit, the allocator's
             max_memory_allocated. Python's cycle collector is off for the step, so what a step leaves
             in reference cycles is freed at the same point every time.

The phases are dryrun.phases: forward, backward, optimizer step. Backward includes zero_grad: it only
frees. Under accumulation: first micro-batch, later micro-batches, optimizer step. How a rank reads its
tensors (whole, or by their local shards) is a `Reading`; ledger.sharding supplies the local one.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmledger.ledger.closedform.activations import measure_saved_activations
from lmledger.ledger.closedform.memory import measure_state_bytes, unique_storage_bytes
from lmledger.ledger.count.flopcounter import StepFlopCounter
from lmledger.ledger.count.memtrack import MemoryTracker
from lmledger.ledger.dryrun.fakecopy import batch_tensors
from lmledger.ledger.dryrun.steptypes import StepLedger, phases

__all__ = ["Reading", "StepWatch"]


@dataclass(frozen=True)
class Reading:
    """How one rank reads its tensors: whole (the default), or by local shards (ledger.sharding.LOCAL_SHARDS).

    tracker         makes step 2's memory tracker
    state           params, grads and optimizer bytes after step 1: `state(model, optimizers)`
    while_tracking  a context open while the tracker runs (FSDP2 resizes storages outside any operator)
    while_counting  a context open while FLOPs are counted (a DTensor op priced at its local shapes)
    """

    tracker: Callable[[], MemoryTracker] = MemoryTracker
    state: Callable[[nn.Module, list], dict[str, int]] = measure_state_bytes
    while_tracking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    while_counting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class StepWatch:
    """Counts steps 1 and 2 from their events (module docstring); `values` is what it has read so far.

    Arguments:

        accumulate      micro-batches per optimizer step (1 under manual optimization)
        manual          the module steps its optimizers in training_step (each batch is one step)
        count_flops     count FLOPs. False for a compiled toy LM, whose FLOPs are the closed forms'.
        activations     measure saved activations. False under torch.compile: the compiled graph saves
                        a fused set the eager prediction does not describe.
        compiled        the module runs torch.compile'd code. Step 1 is then left alone: dynamo compiles
                        on it, as it would unwatched. FLOPs are counted on step 2, on the compiled code,
                        beside the peak. Both counters are dispatch modes that let compiled code run
                        compiled (ignore_compile_internals): by default dynamo runs a frame met under a
                        mode eager for good (canary test_dynamo_runs_a_frame_eager_for_good_under_a_dispatch_mode).
        allocator_peak  read step 2's peak off the CUDA allocator instead of counting live tensors
        reading         whole tensors or local shards (Reading)
    """

    def __init__(
        self, device: torch.device, *, accumulate: int = 1, manual: bool = False, count_flops: bool = True,
        activations: bool = True, compiled: bool = False, allocator_peak: bool = False,
        reading: Reading = Reading(),
    ) -> None:  # fmt: skip
        self.device = device
        self.compiled = compiled
        self.accumulate = 1 if manual else accumulate
        self.manual = manual
        self.count_flops = count_flops
        self.measure_activations = activations
        self.allocator_peak = allocator_peak and device.type == "cuda"
        self.reading = reading
        self.values: dict[str, int] = {}
        self.why_missing: dict[str, str] = {} if activations else {"activations": "n/a (compiled)"}
        self.peak_phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self.flops_by_op: dict[str, int] = {}
        self.steps_done = 0
        self._micro = 0  # micro-batches run of the current step
        self._stepped_at: int | None = None  # global_step when the current step began
        self._counter: StepFlopCounter | None = None
        self._counting: contextlib.ExitStack | None = None
        self._flops_mark, self._flops_to = 0, "flops_forward"
        self._hooks: contextlib.ExitStack | None = None
        self._saved = None
        self._tracker: MemoryTracker | None = None
        self._tracking: contextlib.ExitStack | None = None
        self._gc_was_enabled = False
        self._phases = phases(self.accumulate)

    @property
    def done(self) -> bool:
        return self.steps_done >= 2

    @property
    def flop_registry(self) -> dict:
        """The FLOP formulas the counter prices ops with (ledger.count.ops.OpRecorder prices by them too)."""
        return StepFlopCounter().flop_registry

    # -- the events -----------------------------------------------------------------------------

    def batch_start(self, module: nn.Module, optimizers: list, batch: object, global_step: int) -> None:
        if self.done:
            return
        self._settle_flops("flops_forward")
        if self._micro == 0:
            self._stepped_at = global_step
            if self.steps_done == 0:
                self._open_step_one(module)
            else:
                self._open_step_two(module, optimizers, batch)
        self._phase(self._phases[0] if self.accumulate == 1 or self._micro == 0 else self._phases[1])

    def before_zero_grad(self) -> None:
        self._settle_flops("flops_forward")
        if self.accumulate == 1:
            self._phase(self._phases[1])  # zero_grad only frees; it is charged to backward

    def before_backward(self) -> None:
        self._close_hooks()  # forward is over: what backward needs is saved
        self._settle_flops("flops_backward")
        if self.accumulate == 1:
            self._phase(self._phases[1])

    def after_backward(self) -> None:
        self._settle_flops("flops_forward")

    def before_optimizer_step(self) -> None:
        # An optimizer's own matmuls (Muon's, say) count with the forward: a manual step may run a forward
        # after an optimizer step, and no event marks the end of one.
        self._settle_flops("flops_forward")
        self._phase(self._phases[2])

    def batch_end(self, module: nn.Module, optimizers: list, global_step: int) -> bool:
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
        """Unwind whatever is open (an exception, or a loop that ended inside a watched step)."""
        self._close_hooks()
        self._stop_counter()
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        self._close_tracking()
        self._restore_gc()

    def step_ledger(self, model: nn.Module, batch: object, **extra: object) -> StepLedger:
        """The two steps read as one StepLedger (both must be done); `extra` sets its other fields (ops)."""
        v = self.values
        return StepLedger(
            params=v["params"], grads=v["grads"], optimizer=v["optimizer"],
            buffers=unique_storage_bytes(model.buffers()), batch=unique_storage_bytes(batch_tensors(batch)),
            activations=v.get("activations", 0), autocast_weight_copies=v.get("autocast_weight_copies", 0),
            peak=v["peak"], peak_phase=self.peak_phase, phase_peaks=dict(self.phase_peaks),
            flops_forward=v.get("flops_forward", 0), flops_backward=v.get("flops_backward", 0),
            flops_by_op=dict(self.flops_by_op), **extra,
        )  # fmt: skip

    # -- step 1 ---------------------------------------------------------------------------------

    def _open_step_one(self, module: nn.Module) -> None:
        if self.compiled:  # dynamo compiles this step: nothing may watch it (class docstring)
            return
        if self.count_flops:
            self._start_counter()
        if self.measure_activations:
            self._hooks = contextlib.ExitStack()
            self._saved = self._hooks.enter_context(measure_saved_activations(module))

    def _close_step_one(self, module: nn.Module, optimizers: list) -> None:
        self._stop_counter()
        if self._saved is not None:
            self.values["activations"] = self._saved.activations
            self.values["autocast_weight_copies"] = self._saved.autocast_weight_copies
            self._saved = None
        self.values.update(self.reading.state(module, list(optimizers)))

    # -- step 2 ---------------------------------------------------------------------------------

    def _open_step_two(self, module: nn.Module, optimizers: list, batch: object) -> None:
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        if self.compiled and self.count_flops:  # compiled on step 1: count the compiled code's FLOPs now
            self._start_counter()
        if self.allocator_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._tracking = contextlib.ExitStack()
        self._tracking.enter_context(self.reading.while_tracking())
        # Each optimizer on its own: a sharded tracker reads an optimizer's DTensor state by its local shards.
        self._tracker = self.reading.tracker().track(module, *optimizers, batch_tensors(batch))
        self._tracker.phase(self._phases[0])
        self._tracker.start()

    def _close_step_two(self) -> None:
        if self._tracker is not None:
            self._tracker.stop()
            self.values["peak"] = self._tracker.peak_bytes
            self.phase_peaks = {name: self._tracker.phase_peaks.get(name, 0) for name in self._phases}
            self.peak_phase = max(self.phase_peaks, key=self.phase_peaks.__getitem__)
            self._tracker = None
            self._close_tracking()
        elif self.allocator_peak:
            torch.cuda.synchronize(self.device)
            self.values["peak"] = torch.cuda.max_memory_allocated(self.device)
        self._stop_counter()  # compiled: opened at step 2, inside the tracker's mode (closed first, above)
        self._restore_gc()

    # -- helpers --------------------------------------------------------------------------------

    def _start_counter(self) -> None:
        self._counting = contextlib.ExitStack()
        self._counting.enter_context(self.reading.while_counting())
        self._counter = self._counting.enter_context(StepFlopCounter())
        self._flops_mark, self._flops_to = 0, "flops_forward"

    def _settle_flops(self, then: str) -> None:
        """Charge the FLOPs counted since the last event to where they fell; count the next ones to `then`."""
        if self._counter is not None:
            total = self._counter.get_total_flops()
            self.values[self._flops_to] = self.values.get(self._flops_to, 0) + total - self._flops_mark
            self._flops_mark = total
        self._flops_to = then

    def _stop_counter(self) -> None:
        if self._counter is None:
            return
        self._settle_flops("flops_forward")
        counter, counting = self._counter, self._counting
        self._counter = self._counting = None
        counting.close()
        self.values["flops_hardware"] = counter.get_total_flops()
        self.flops_by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}

    def _phase(self, name: str) -> None:
        if self._tracker is not None and self._tracker.running:
            self._tracker.phase(name)

    def _close_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    def _close_tracking(self) -> None:
        if self._tracking is not None:
            self._tracking.close()
            self._tracking = None

    def _restore_gc(self) -> None:
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = False
