"""Stop a run that will not fit before it starts, with one line instead of an out-of-memory error mid-run.

At fit start (before the sanity check and step 1) the predicted peak of a training step
(lmledger.ledger.memory.peak_bytes) is compared with what the device can hold:
- on CUDA, the bytes free on the device plus those this process's caching allocator already holds
  (the model's parameters live there and are part of the prediction);
- on CPU, the RAM the kernel says is available (MemAvailable in /proc/meminfo, or psutil where
  /proc is absent), shared between the processes of this machine, plus the model's parameters and
  buffers, which are already allocated and part of the prediction;
- anywhere, `device_memory_gb` when set (1 GB = 1e9 bytes): on CUDA the smaller of the two wins; on
  CPU the setting replaces the RAM figure (the user may know of swap, or of other jobs to come).
If the peak does not fit, the run stops with a UserError naming predicted vs available, the largest
component and the largest per-device batch size that fits (ledger.planner.max_batch over
predict_memory). If CUDA runs out of memory anyway, the ledger is printed, and the OOM carries one line
(`ledger_line`) that `lmledger fit` prints in place of the traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lmledger.callbacks.memory import MemoryPrediction, memory_table, predict_memory, print_memory_table
from lmledger.callbacks.run import LedgerRun
from lmledger.errors import ConfigError, UserError
from lmledger.ledger.planner import max_batch
from lmledger.ledger.units import format_bytes


@dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # where the figure came from, as the user would name it


MEMINFO = "/proc/meminfo"


def available_ram() -> Capacity | None:
    """RAM a new allocation can get without swapping, or None where neither /proc nor psutil says."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                # "MemAvailable:   22874512 kB" (proc(5): the kernel's estimate, page cache included; kB = 1024 B)
                if line.startswith("MemAvailable:"):
                    return Capacity(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # not a dependency: macOS and Windows have no /proc
    except ImportError:
        return None
    return Capacity(int(psutil.virtual_memory().available), "available RAM (psutil)")


def _held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's CPU parameters and buffers: allocated already, yet counted in the prediction."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def available_memory(
    device: torch.device,
    device_memory_gb: float | None,
    module: torch.nn.Module | None = None,
    processes_here: int = 1,
) -> Capacity | None:
    """What one device can hold for this run, or None where nothing says.

    On CPU the machine's available RAM is split between the `processes_here` training processes
    on it, and each already holds its module's tensors.
    """
    setting = None
    if device_memory_gb is not None:
        setting = Capacity(int(device_memory_gb * 1e9), f"--ledger.device_memory_gb {device_memory_gb:g}")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cuda = Capacity(free + torch.cuda.memory_reserved(device), f"free on {device}")
        return cuda if setting is None else min(setting, cuda, key=lambda c: c.bytes)
    if setting is not None or device.type != "cpu":
        return setting
    ram = available_ram()
    if ram is None:
        return None
    held = _held_bytes(module) if module is not None else 0
    share = ram.bytes // max(1, processes_here)
    source = ram.source if processes_here <= 1 else f"{ram.source}, shared by {processes_here} processes"
    return Capacity(share + held, source)


def largest_batch_that_fits(run: LedgerRun, capacity: int) -> int:
    return max_batch(lambda batch: predict_memory(run, batch).peak, capacity)


def batch_size_hint(run: LedgerRun, capacity: int) -> str:
    fits = largest_batch_that_fits(run, capacity)
    if fits == 0:
        return (
            "not even --data.batch_size 1 fits: shorten model.config.context_length, enable "
            "model.config.activation_checkpointing, train in bf16-true, or shard (FSDP)"
        )
    return f"--data.batch_size {fits} fits (now {run.batch_size})"


def does_not_fit(run: LedgerRun, predicted: MemoryPrediction, capacity: Capacity) -> str:
    name, nbytes = predicted.largest_component()
    return (
        f"predicted peak memory {format_bytes(predicted.peak)} per device exceeds the "
        f"{format_bytes(capacity.bytes)} available ({capacity.source}); largest part: {name} "
        f"{format_bytes(nbytes)}; {batch_size_hint(run, capacity.bytes)}"
    )


def processes_on_this_machine(trainer: pl.Trainer) -> int:
    """Training processes sharing this machine's RAM (a CPU DDP run starts one per device)."""
    return max(1, trainer.world_size // max(1, trainer.num_nodes))


class PreflightGuard(pl.Callback):
    """Refuses to start a run whose predicted peak does not fit; turns a CUDA OOM into one line.

    Args:
        device_memory_gb: memory one device may use, in GB (1e9 bytes); None = what CUDA reports
            free, or on a CPU the RAM the kernel reports available.
    """

    def __init__(self, device_memory_gb: float | None = None) -> None:
        if device_memory_gb is not None and not device_memory_gb > 0:
            raise ConfigError(f"ledger.device_memory_gb must be positive, got {device_memory_gb}")
        self.device_memory_gb = device_memory_gb
        self.run: LedgerRun | None = None
        self.predicted: MemoryPrediction | None = None
        self.capacity: Capacity | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run = LedgerRun.from_trainer(trainer, pl_module)
        self.predicted = predict_memory(self.run)
        self.capacity = available_memory(
            self.run.device, self.device_memory_gb, pl_module, processes_on_this_machine(trainer)
        )
        if self.capacity is None:
            return
        if self.predicted.peak is None:
            if self.device_memory_gb is not None or self.run.device.type == "cuda":
                rank_zero_warn(f"no memory preflight check: {self.predicted.unmodelled}")
            return
        if self.predicted.peak > self.capacity.bytes:
            if trainer.is_global_zero:
                print_memory_table(
                    memory_table(self.run, self.predicted, None, "memory ledger (predicted)"), stderr=True
                )
            raise UserError(does_not_fit(self.run, self.predicted, self.capacity))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, torch.cuda.OutOfMemoryError) or self.predicted is None:
            return
        print_memory_table(memory_table(self.run, self.predicted, None, "memory ledger at the OOM"), stderr=True)
        line = f"CUDA out of memory at step {trainer.global_step + 1}"
        if self.capacity is not None and self.predicted.peak is not None:
            if self.predicted.peak > self.capacity.bytes:
                line += "; " + does_not_fit(self.run, self.predicted, self.capacity)
            else:
                line += (
                    f"; the ledger predicted a peak of {format_bytes(self.predicted.peak)} within the "
                    f"{format_bytes(self.capacity.bytes)} available ({self.capacity.source}), so the rest is "
                    "memory it does not model (other processes, allocator fragmentation, library "
                    f"workspaces): lower --data.batch_size below {self.run.batch_size}"
                )
        elif self.predicted.peak is not None:
            line += f"; predicted peak {format_bytes(self.predicted.peak)} per device"
        # Raising here would skip Lightning's teardown (signal handlers, strategy) and the other callbacks'
        # on_exception. Lightning re-raises the OOM itself; the CLI prints `ledger_line` instead of it.
        exception.ledger_line = line
        if hasattr(exception, "add_note"):  # Python >= 3.11: a traceback in library use shows the line too
            exception.add_note(line)
