"""What one device can hold, for the ledger's check before step 1 (callbacks.ledger.Ledger).

The predicted peak of a training step is compared with a capacity:

    CUDA        bytes free on the device + those this process's caching allocator holds
    CPU         available RAM (MemAvailable in /proc/meminfo; psutil where /proc is absent),
                shared between this machine's processes, + the model's parameters and buffers
    anywhere    `device_memory_gb` when set (1 GB = 1e9 bytes)

On CUDA the model's parameters live in the allocator's bytes. On CPU they are already allocated. In
both, they are part of the prediction. On CUDA the smaller of the device and the setting wins. On
CPU the setting replaces the RAM figure. The user may know of swap, or of other jobs to come.

If the peak does not fit, the run stops with `does_not_fit`'s line. It gives predicted vs available,
the largest component and the largest batch that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from lmledger.ledger.hardware.memory import ram_available
from lmledger.ledger.report import Figures
from lmledger.ledger.units import format_bytes

__all__ = [
    "Capacity",
    "available_memory",
    "available_ram",
    "does_not_fit",
    "processes_on_this_machine",
]


@dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # where the figure came from, as the user would name it


def available_ram() -> Capacity | None:
    """RAM a new allocation can get without swapping; None where neither /proc nor psutil says."""
    found = ram_available()
    if found is not None:
        return Capacity(found, "MemAvailable in /proc/meminfo")
    try:
        import psutil  # not a dependency: macOS and Windows have no /proc
    except ImportError:
        return None
    return Capacity(int(psutil.virtual_memory().available), "available RAM (psutil)")


def _held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's CPU parameters and buffers. Already allocated, they are in the prediction."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def available_memory(
    device: torch.device,
    device_memory_gb: float | None,
    module: torch.nn.Module | None = None,
    processes_here: int = 1,
) -> Capacity | None:
    """What one device can hold for this run; None where nothing says.

    On CPU, the machine's available RAM is split between its `processes_here` training processes.
    Each already holds its module's tensors.
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


def does_not_fit(predicted: Figures, capacity: Capacity, hint: str) -> str:
    """The one line a run gets whose predicted peak exceeds what the device holds."""
    name, nbytes = predicted.largest_component()
    return (
        f"predicted peak memory {format_bytes(predicted.peak)} per device exceeds the "
        f"{format_bytes(capacity.bytes)} available ({capacity.source}); largest part: {name} "
        f"{format_bytes(nbytes)}; {hint}"
    )


def processes_on_this_machine(trainer: pl.Trainer) -> int:
    """Training processes sharing this machine's RAM. A CPU DDP run starts one per device."""
    return max(1, trainer.world_size // max(1, trainer.num_nodes))
