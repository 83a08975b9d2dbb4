"""Memory free on a device now: what a new allocation can get. One reader for the kit (the preflight's RAM, the
replay's working set, the layout search's workers, the matmul benchmark's operands)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MEMINFO", "free_memory", "ram_available"]

MEMINFO = "/proc/meminfo"


def ram_available() -> int | None:
    """Bytes of RAM a new allocation can get without swapping: MemAvailable in /proc/meminfo (proc(5): the kernel's
    estimate, page cache included; kB = 1024 B); None where there is no /proc."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):  # "MemAvailable:   22874512 kB"
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: CUDA's free memory, or the RAM the OS reports available."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    found = ram_available()
    return found if found is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
