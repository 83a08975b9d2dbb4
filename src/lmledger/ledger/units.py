"""How lmledger writes bytes and counts for people.

Bytes are decimal everywhere: 1 MB = 1e6 bytes, 1 GB = 1e9 bytes.
The lecture, GPU datasheets and `--ledger.device_memory_gb` count so.
PyTorch's memory summaries are binary (1 GiB = 2**30 bytes, 7% more than a GB).
A figure copied from them reads 7% lower here.
"""

from __future__ import annotations

__all__ = [
    "GB",
    "MB",
    "MEMORY_COMPONENTS",
    "MEMORY_ROWS",
    "ROWS",
    "ROW_LABELS",
    "STATE_COMPONENTS",
    "TERA",
    "format_bytes",
    "format_count",
    "format_mb",
    "tera",
]

MB, GB = 1e6, 1e9
TERA = 1e12  # TFLOP/s, TB/s
_BYTE_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_COUNT_UNITS = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))

# The memory ledger's parts, in the order every table, JSON and plot lists them.
STATE_COMPONENTS = ("params", "grads", "optimizer")  # held between steps
MEMORY_COMPONENTS = (*STATE_COMPONENTS, "activations")
MEMORY_ROWS = (*MEMORY_COMPONENTS, "peak")

# Every ledger row, in the order every table lists them, with its label: the one list (ledger.report renders it,
# its JSON names it). Bytes per device (autocast's weight casts sit in the peak, beside activations), then FLOPs
# per optimizer step: hardware (what the kernels do, recompute included) and model (6N + attention, MFU's).
ROW_LABELS = {
    **{row: row for row in MEMORY_COMPONENTS}, "autocast_weight_copies": "autocast_weight_copies", "peak": "peak",
    "flops_hardware": "FLOPs/step (hardware)", "flops_model": "FLOPs/step (model)",
}  # fmt: skip
ROWS = tuple(ROW_LABELS)


def format_bytes(nbytes: float | None) -> str:
    """12_653_000 -> '12.65 MB'; None (not known) -> 'n/a'."""
    if nbytes is None:
        return "n/a"
    for unit, scale in _BYTE_UNITS:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_count(n: float) -> str:
    """1234567 -> '1.23M' (FLOPs, parameters, tokens)."""
    for unit, scale in _COUNT_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_mb(nbytes: float | None, spec: str = ".1f", unit: str = " MB") -> str:
    """12_345_678 -> '12.3 MB'; None -> '—'. `spec` and `unit` suit a column (',.2f', '')."""
    return "—" if nbytes is None else f"{nbytes / MB:{spec}}{unit}"


def tera(value: float) -> float:
    """A rate in units of 1e12: FLOP/s -> TFLOP/s, bytes/s -> TB/s."""
    return value / TERA
