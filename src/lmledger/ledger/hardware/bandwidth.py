"""Memory bandwidth per device, for the roofline (ledger/timing/roofline.py): bytes per second an op can move.

A listed GPU has its datasheet figure in gpus.GPUS (HBM/GDDR bandwidth). A CPU's is measured once
per machine: no spec the OS reports gives it. It is cached on disk beside the CPU peak, with when and
how (cpu.cache_dir()/cpu-bandwidth.json). An unlisted GPU's is measured once per process.

The measurement is the best rate of `dst.copy_(src)`: each byte read once and written once. Buffers
run from 256 KiB to 64 MiB, over several rounds. It runs with torch's threads, and with one thread
times the threads (caches are per core). On a CPU the best rate comes from a buffer in cache, not
from DRAM. A small model's tensors are often cache-resident, and a bound must not be beaten. So the
roofline takes the best rate ("cache"). The large-buffer rate ("dram") is kept beside it, in the
detail line and the cache file.

How much of the last-level cache this process can keep its data in is measured too (`usable_cpu_cache`): a VM's
/sys reports the socket's L3, which its neighbours share. No Lightning import.
"""

from __future__ import annotations

import datetime
import functools
import time
from dataclasses import dataclass

import torch

from lmledger.ledger.hardware.cpu import cache_dir, cpu_info, load_cache, save_cache
from lmledger.ledger.hardware.gpus import find_gpu, resolve
from lmledger.ledger.hardware.memory import free_memory

__all__ = [
    "Bandwidth",
    "cpu_cache_levels",
    "measured_cpu_bandwidth",
    "memory_bandwidth",
    "usable_cache",
    "usable_cpu_cache",
]

_CPU_BANDWIDTH_FILE = "cpu-bandwidth.json"
_CPU_CACHE_FILE = "cpu-cache.json"
_SIZES = tuple(1 << p for p in range(18, 27))  # bytes per buffer: 256 KiB .. 64 MiB
_TARGET_S = 0.002  # each timing repeats the copy until it lasts this long
_CPU_TRIES = 3


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    source: str  # "datasheet:<key>" or "measured"
    detail: str = ""
    dram_bytes_per_s: float | None = None  # a measured device's large-buffer rate


def memory_bandwidth(device: str | torch.device | None = None) -> Bandwidth:
    """The bandwidth the roofline divides bytes by on `device`; default CUDA if present, else CPU."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        spec = find_gpu(torch.cuda.get_device_name(index))
        if spec is not None:
            return Bandwidth(spec.bandwidth_bytes_per_s, f"datasheet:{spec.key}", f"datasheet {spec.name}")
        return _measured_device_bandwidth(f"cuda:{index}")
    return measured_cpu_bandwidth()


def _gpu_bandwidth(key: str) -> Bandwidth:
    """The datasheet bandwidth of a GPU key or torch device name, for planning on paper."""
    spec = resolve(key)
    if spec is None:
        from lmledger.errors import UserError

        raise UserError(f"unknown GPU {key!r}: see `lmledger gpus` for the keys")
    return Bandwidth(spec.bandwidth_bytes_per_s, f"datasheet:{spec.key}", f"datasheet {spec.name}")


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _copy_rates(device: torch.device, rounds: int) -> dict[int, float]:
    """Best bytes/s (read + written) of a buffer copy on `device`, per buffer size, over `rounds`."""
    best: dict[int, float] = {}
    for _ in range(rounds):
        for size in _SIZES:
            src = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
            dst = torch.empty_like(src)
            dst.copy_(src)  # first touch: page faults are not bandwidth
            repeats, seconds = 1, 0.0
            while True:
                _sync(device)
                start = time.perf_counter()
                for _ in range(repeats):
                    dst.copy_(src)
                _sync(device)
                seconds = time.perf_counter() - start
                if seconds >= _TARGET_S or repeats >= 1 << 14:
                    break
                repeats *= 4
            best[size] = max(best.get(size, 0.0), 2 * size * repeats / seconds)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_key() -> str:
    info = cpu_info()
    return f"{info.model} | {info.logical_cpus} cpus | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measured_cpu_bandwidth(*, tries: int = _CPU_TRIES, refresh: bool = False) -> Bandwidth:
    """This CPU's best copy bandwidth.

    Measured once per machine (CPU model, CPU count, torch version, threads). Cached in
    cache_dir()/cpu-bandwidth.json with when and how. `refresh` measures again and keeps the faster.
    """
    path = cache_dir() / _CPU_BANDWIDTH_FILE
    entries = load_cache(path, "CPU bandwidth")
    key = _cache_key()
    entry = entries.get(key)
    valid = isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) and entry[k] > 0 for k in ("bytes_per_s", "dram_bytes_per_s")
    )
    if refresh or not valid:
        threads = torch.get_num_threads()
        rates = _copy_rates(torch.device("cpu"), tries)
        torch.set_num_threads(1)
        try:
            single = _copy_rates(torch.device("cpu"), tries)
        finally:
            torch.set_num_threads(threads)
        entry = {
            # Caches are private per core: one thread's cache-resident rate times the threads is what
            # they reach together. It also survives a busy machine, where a descheduled thread stalls a
            # multi-threaded copy and only ever makes it look slower.
            "bytes_per_s": max(max(rates.values()), max(single.values()) * threads),
            "dram_bytes_per_s": max(rates[_SIZES[-1]], single[_SIZES[-1]]),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tries": tries,
            "method": (
                f"best rate of float32 copy_ (bytes read + written) over buffers {_SIZES[0] >> 10} KiB to "
                f"{_SIZES[-1] >> 20} MiB, with all threads or one thread's times the threads; dram = the "
                "largest buffer's rate"
            ),
        }
        if valid and entries[key]["bytes_per_s"] > entry["bytes_per_s"]:
            entry = entries[key]  # a busy machine only makes copies slower: the faster one stands
        entries[key] = entry
        save_cache(path, entries, "CPU bandwidth")
    detail = (
        f"measured {str(entry.get('measured_at', '?'))[:10]}: best copy rate (cache-resident), "
        f"{entry['dram_bytes_per_s'] / 1e9:.3g} GB/s from DRAM (cache: {path})"
    )
    return Bandwidth(float(entry["bytes_per_s"]), "measured", detail, float(entry["dram_bytes_per_s"]))


@functools.cache
def _measured_device_bandwidth(device: str) -> Bandwidth:
    rates = _copy_rates(torch.device(device), 2)
    best = max(rates.values())
    return Bandwidth(best, "measured", f"best copy rate on {device}, this process", rates[_SIZES[-1]])


def cpu_cache_levels() -> list[int]:
    """This CPU's cache sizes in bytes, smallest first, as /sys reports them for cpu0 (empty where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in range(8):
        try:
            text = open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read().strip()
        except OSError:
            continue
        if text:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return sorted(sizes)


def _read_rates(sizes: list[int], tries: int) -> dict[int, float]:
    """One thread's best read rate (bytes/s of a float32 sum) per buffer size, each a prefix of one buffer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's view of the shared level: what one op's inputs meet
    try:
        buffer = torch.ones(max(sizes) // 4)
        best: dict[int, float] = {}
        for _ in range(tries):
            for size in sizes:
                view = buffer[: size // 4]
                view.sum()  # brought in as far as it fits
                repeats = max(1, (64 << 20) // size)
                start = time.perf_counter()
                for _ in range(repeats):
                    view.sum()
                best[size] = max(best.get(size, 0.0), size * repeats / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(threads)


def usable_cache(rates: dict[int, float]) -> int:
    """The largest buffer size of `rates` (size -> read rate, sizes from just past the private caches to well past the
    last level) that still reads at least half its bytes from cache: every size up to it at the harmonic mean of the
    smallest size's rate (cache) and the largest's (DRAM) or faster. The smallest size where none does."""
    sizes = sorted(rates)
    cached, dram = rates[sizes[0]], rates[sizes[-1]]
    half = 2 * cached * dram / (cached + dram)  # 1/rate = 0.5/cached + 0.5/dram: half the bytes from each
    usable = sizes[0]
    for size in sizes[1:]:
        if rates[size] < half:
            break
        usable = size
    return usable


def usable_cpu_cache(*, tries: int = _CPU_TRIES, refresh: bool = False) -> int:
    """Bytes of the last-level cache this process's data stays in, measured once per machine and cached in
    cache_dir()/cpu-cache.json with when and how (`refresh` measures again).

    /sys reports the whole level, which a VM shares with its neighbours: the 2-core Intel VM's says 480 MiB, yet one
    thread read 64 MiB at 20 GB/s, 90 MiB at 19, 127 MiB at 15 and 1 GiB at 14.5 from DRAM (2026-12-07; 29 GB/s at
    4 MiB, past its 2 MiB L2). So the read rate is swept from twice the private level to twice the last (at most
    1 GiB, and a quarter of the free memory), buffer sizes a factor sqrt(2) apart, and `usable_cache` reads the edge.
    The reported size where /sys gives a single level or none (then 32 MiB, a server L3's order)."""
    levels = cpu_cache_levels()
    if len(levels) < 2:
        return levels[-1] if levels else 32 << 20
    last, private = levels[-1], levels[-2]
    path = cache_dir() / _CPU_CACHE_FILE
    entries = load_cache(path, "CPU cache")
    info = cpu_info()
    key = f"{info.model} | {info.logical_cpus} cpus | last level {last >> 10} KiB"
    entry = entries.get(key)
    if not refresh and isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and entry["bytes"] > 0:
        return entry["bytes"]
    top = max(4 * private, min(2 * last, 1 << 30, free_memory(torch.device("cpu")) // 4))
    sizes, size = [], 2 * private
    while size < top:
        sizes.append(size)
        size = int(size * 2**0.5) // 4096 * 4096
    rates = _read_rates([*sizes, top], tries)
    usable = min(last, usable_cache(rates))
    entries[key] = {
        "bytes": usable,
        "read_bytes_per_s": {str(k): round(v) for k, v in sorted(rates.items())},
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": (
            f"one thread's best float32 sum rate over {tries} tries, buffers {sizes[0] >> 10} KiB to {top >> 20} MiB; "
            "the largest size with every size up to it reading half its bytes from cache or more (usable_cache)"
        ),
    }
    save_cache(path, entries, "CPU cache")
    return usable
