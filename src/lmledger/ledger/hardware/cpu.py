"""The CPU's peak FLOP/s: from its specifications, or its best measured matmul, cached per machine.

The peak is a property of the machine, not of the moment. The spec (`cpu_spec_peak`, labelled
"spec") is cores x clock x FLOP per cycle. That is per cycle of the widest FMA units its flags report.
Where the OS reports too little, or a matmul beats the spec, the peak is measured. That is
`measured_cpu_peak`, labelled "measured". It is the best rate of square matmuls over several tries
(ledger/hardware/matmul.py), cached on disk per machine. `cpu_peak` chooses between them. Importing this
module does not import torch.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from lmledger.atomic import DiskWriteError, atomic_write
from lmledger.ledger.hardware import matmul
from lmledger.ledger.hardware.gpus import PeakFlops, dtype_name

__all__ = [
    "CPU_MEASURE_TRIES",
    "CPU_PEAKS_FILE",
    "CpuInfo",
    "OthersBusy",
    "cache_dir",
    "cpu_info",
    "cpu_peak",
    "cpu_spec_peak",
    "load_cache",
    "measured_cpu_peak",
    "save_cache",
]


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo "model name" (or the platform's processor string)
    machine: str  # platform.machine(): x86_64, aarch64, ...
    cores: int  # physical cores this process may run on (affinity mask, capped by a cgroup CPU quota)
    logical_cpus: int  # CPUs in the affinity mask (hyperthreads count twice)
    ghz: float | None  # the highest clock the OS reports; None if it reports none
    clock_source: str  # "cpufreq max" or "cpuinfo MHz"
    flags: frozenset[str]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpuinfo_blocks(text: str) -> dict[int, dict[str, str]]:
    """/proc/cpuinfo as {processor number: {field: value}}."""
    blocks = {}
    for chunk in text.split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            name, sep, value = line.partition(":")
            if sep:
                fields[name.strip()] = value.strip()
        if fields.get("processor", "").isdigit():
            blocks[int(fields["processor"])] = fields
    return blocks


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs a cgroup CPU quota allows (container --cpus), None without a quota."""
    text = _read("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
    if text:
        quota, _, period = text.strip().partition(" ")
    else:  # cgroup v1
        quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        quota_us, period_us = int(str(quota).strip()), int(str(period).strip())
    except ValueError:
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None


@functools.cache
def cpu_info() -> CpuInfo:
    """What the OS reports of the CPUs this process may run on (Linux; elsewhere mostly unknown)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    blocks = _cpuinfo_blocks(_read("/proc/cpuinfo") or "")
    mine = [blocks[cpu] for cpu in allowed if cpu in blocks]
    first = mine[0] if mine else {}
    model = first.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())
    # Hyperthreads share their core's FMA units: count (package, core) pairs, not logical CPUs.
    pairs = set()
    for cpu in allowed:
        block = blocks.get(cpu, {})
        core = block.get("core id") or _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        package = block.get("physical id") or _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        pairs.add((str(package).strip(), str(core).strip()) if core is not None else ("cpu", str(cpu)))
    cores = len(pairs) or len(allowed)
    limit = _cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, limit)
    # The clock: cpufreq's maximum, turbo included (a peak is an upper bound). In VMs without cpufreq,
    # the "cpu MHz" the hypervisor reports: the nominal clock, constant there.
    max_khz = [_read(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq") for cpu in allowed]
    max_khz = [int(k) for k in max_khz if k and k.strip().isdigit()]
    mhz = [float(b["cpu MHz"]) for b in mine if re.fullmatch(r"[0-9.]+", b.get("cpu MHz", ""))]
    if max_khz:
        ghz, clock_source = max(max_khz) / 1e6, "cpufreq max"
    elif mhz:
        ghz, clock_source = max(mhz) / 1e3, "cpuinfo MHz"
    else:
        ghz, clock_source = None, ""
    return CpuInfo(model, platform.machine().lower(), cores, len(allowed), ghz, clock_source, flags)


# FP32 FLOP per cycle per core: (flags needed, FLOP/cycle, what).
# x86 cores issue two FMA per cycle on their widest vectors: Intel since Haswell (256-bit) and
# Skylake-SP Gold/Platinum (512-bit), AMD since Zen 2 (256-bit). Sources: Intel's optimization manual,
# AMD's software optimization guides. An FMA is 2 FLOP per lane: AVX-512 2 x 16 x 2 = 64, AVX2
# 2 x 8 x 2 = 32. AVX without FMA issues one 8-wide add and one 8-wide multiply (16); SSE2 4 + 4 (8).
# Parts with one 512-bit pipe (Xeon Bronze/Silver, Zen 4's 2 x 256) reach half. So the spec is an
# upper bound, as a peak should be.
_X86_FP32 = (
    ({"avx512f"}, 64, "AVX-512, 2 FMA pipes"),
    ({"avx2", "fma"}, 32, "AVX2, 2 FMA pipes"),
    ({"avx"}, 16, "AVX add + mul"),
    ({"sse2"}, 8, "SSE2 add + mul"),
)
# aarch64: 128-bit NEON FMA, 4 fp32 lanes x 2 FLOP x 4 pipes = 32 (Arm Neoverse V1/V2, e.g. Grace).
# An upper bound on 2-pipe cores (Neoverse N1, Cortex-A72).
_ARM_FP32 = 32
# Matrix units: Intel AMX's TMUL does 1024 BF16 (AMX-BF16, Sapphire Rapids on) or FP16 (AMX-FP16,
# Granite Rapids) ops per cycle per core (Intel, "Accelerate AI Workloads with Intel AMX").
# AVX512-BF16's VDPBF16PS and AVX512-FP16's VFMADDPH work on 32 16-bit lanes: 2 pipes x 32 x 2 = 128.
_AMX_FLOP_PER_CYCLE = 1024
_AVX512_16BIT_FLOP_PER_CYCLE = 128


def _flop_per_cycle(info: CpuInfo, dtype: str) -> tuple[int, str] | None:
    """Peak FLOP per cycle per core for `dtype` matmuls on this CPU, and what it rests on."""
    flags = info.flags
    if info.machine in ("x86_64", "amd64", "i386", "i686"):
        fp32 = next(((flop, what) for need, flop, what in _X86_FP32 if need <= flags), None)
    elif info.machine in ("aarch64", "arm64") and "asimd" in flags:
        fp32 = (_ARM_FP32, "NEON, 4 FMA pipes")
    else:
        fp32 = None
    if fp32 is None:
        return None
    if dtype == "fp32":
        return fp32
    if dtype == "fp64":
        return fp32[0] // 2, f"{fp32[1]}, half the fp32 lanes"
    if dtype in ("bf16", "fp16"):
        amx, avx512 = ("amx_bf16", "avx512_bf16") if dtype == "bf16" else ("amx_fp16", "avx512_fp16")
        if amx in flags:
            return _AMX_FLOP_PER_CYCLE, amx.upper().replace("_", "-")
        if avx512 in flags:
            return _AVX512_16BIT_FLOP_PER_CYCLE, f"{avx512.upper().replace('_', '-')}, 2 pipes"
        return fp32[0], f"{fp32[1]}; no native {dtype}, so converted and multiplied as fp32"
    return None  # tf32, fp8, int8: no CPU matmul peak


def cpu_spec_peak(dtype: str, info: CpuInfo | None = None) -> PeakFlops | None:
    """The CPU's peak from its specifications: cores x clock x FLOP/cycle for `dtype`.

    None where the OS reports no clock, or the CPU's vector units are not known here.
    """
    dtype = dtype_name(dtype)
    info = info or cpu_info()
    per_cycle = _flop_per_cycle(info, dtype)
    if info.ghz is None or per_cycle is None:
        return None
    flop, what = per_cycle
    detail = (
        f"spec: {info.cores} core{'s' if info.cores != 1 else ''} x {info.ghz:.3g} GHz ({info.clock_source}) "
        f"x {flop} FLOP/cycle ({what})"
    )
    return PeakFlops(info.cores * info.ghz * 1e9 * flop, "spec", dtype, detail)


CPU_MEASURE_TRIES = 5  # ramps of matmuls for a measured CPU peak, once per machine (cached on disk)


def cache_dir() -> Path:
    """Where per-machine measurements live.

    $LMLEDGER_CACHE_DIR, else $XDG_CACHE_HOME/lmledger, else ~/.cache/lmledger.
    """
    if os.environ.get("LMLEDGER_CACHE_DIR"):
        return Path(os.environ["LMLEDGER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmledger"


CPU_PEAKS_FILE = "cpu-peaks.json"


def _cpu_cache_key(dtype: str) -> str:
    import torch

    info = cpu_info()
    threads = torch.get_num_threads()
    return f"{info.model} | {info.logical_cpus} cpus | torch {torch.__version__} | {threads} threads | {dtype}"


def load_cache(path: Path, what: str) -> dict:
    """The JSON object a machine cache file holds; {} when there is none, or, warned, when it is unreadable.

    The warning (naming `what`, e.g. "CPU peak") points at the caller's caller: the code that asked.
    """
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"ignoring unreadable {what} cache {path} ({err}); measuring again", stacklevel=3)
        return {}
    return entries if isinstance(entries, dict) else {}


def save_cache(path: Path, entries: dict, what: str) -> None:
    """Write a machine cache file atomically; a disk that refuses it is a warning, not an error."""
    try:
        atomic_write(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
    except DiskWriteError as err:
        warnings.warn(f"could not cache the measured {what} ({err})", stacklevel=3)


def measured_cpu_peak(dtype: str, *, tries: int = CPU_MEASURE_TRIES, refresh: bool = False) -> PeakFlops:
    """The best rate of square `dtype` matmuls on this CPU over `tries` ramps.

    Measured once per machine (CPU model, CPU count, torch version, torch threads). Cached in
    cache_dir()/cpu-peaks.json with when and how. `refresh` measures again.
    """
    dtype = dtype_name(dtype)
    path = cache_dir() / CPU_PEAKS_FILE
    entries = load_cache(path, "CPU peak")
    key = _cpu_cache_key(dtype)
    entry = entries.get(key)
    valid = isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)) and entry["flops_per_s"] > 0
    if refresh or not valid:
        entry = {
            "flops_per_s": matmul.best_matmul_rate("cpu", dtype, tries),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tries": tries,
            "method": "best rate of square matmuls, sizes 64 to 2048 doubling, fastest of 5 repeats each",
        }
        entries[key] = entry
        save_cache(path, entries, "CPU peak")
    detail = f"measured {str(entry.get('measured_at', '?'))[:10]}, best of {entry.get('tries', '?')} (cache: {path})"
    return PeakFlops(float(entry["flops_per_s"]), "measured", dtype, detail)


def cpu_peak(dtype: str) -> PeakFlops:
    """The CPU's peak for `dtype`: its spec, or this machine's best matmul where that beats it.

    The measurement is made once and cached (`measured_cpu_peak`). A peak a matmul beats is no peak.
    A VM's /proc/cpuinfo gives the nominal clock, not the turbo the cores run at. On 2026-12-01, this
    2-core Xeon VM: spec 282 GFLOP/s at the reported 2.2 GHz. A square fp32 matmul reached 390.
    """
    spec = cpu_spec_peak(dtype)
    measured = measured_cpu_peak(dtype)
    if spec is not None and spec.flops_per_s >= measured.flops_per_s:
        return spec
    if spec is None:
        return measured
    detail = (
        f"{measured.detail}; above the {spec.flops_per_s / 1e9:.4g} GFLOP/s of the {spec.detail}, so the "
        "OS reports a clock below the one the cores run at"
    )
    return PeakFlops(measured.flops_per_s, "measured", dtype, detail)


class OthersBusy:
    """The share of this machine's CPU time that other processes (and the hypervisor's steal) took since
    `start()`: a timing made while it is large is of a busy machine (two intra-op threads on two cores slow
    down many-fold when another process takes one of them). "Ours" is this process's group: the ranks a
    launcher started beside it and the calibrations it started count as its own work. Linux's /proc;
    `share()` is None elsewhere, or before `start()`.
    """

    def __init__(self) -> None:
        self._start: tuple[int, int, dict[tuple[int, int], int]] | None = None

    def start(self) -> OthersBusy:
        self._start = _jiffies()
        return self

    def share(self) -> float | None:
        end = _jiffies() if self._start is not None else None
        if self._start is None or end is None:
            return None
        total, busy = end[0] - self._start[0], end[1] - self._start[1]
        return max(0.0, min(1.0, (busy - _ours(self._start, end)) / total)) if total > 0 else None


def _ours(start: tuple, end: tuple) -> int:
    """The jiffies this process group spent between two `_jiffies()` readings, process by process: one of the
    group that ended meanwhile, reaped outside it (an orphan), takes its jiffies with it; summed over the group,
    its whole life would count as the others' (a share of 1.0 after a multi-rank run). Its time in the window is
    lost instead; a child reaped inside the group comes back whole in its parent's cutime, so this may read a
    little high, never below zero."""
    return sum(jiffies - start[2].get(process, 0) for process, jiffies in end[2].items())


def _jiffies() -> tuple[int, int, dict[tuple[int, int], int]] | None:
    """(all CPUs' jiffies, their busy jiffies (steal included), {(pid, start time): jiffies} of this process
    group's processes), or None off Linux."""
    stat = _read("/proc/stat")
    if not stat:
        return None
    try:
        fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
    except (IndexError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
    total = sum(fields[:8])
    busy = total - fields[3] - fields[4]
    group, ours = os.getpgrp(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        text = _read(f"/proc/{entry.name}/stat")
        after_name = text.rsplit(")", 1)[1].split() if text else []  # the name in parentheses may hold spaces
        if len(after_name) > 14 and int(after_name[2]) == group:
            # utime, stime, and the waited-for children's cutime, cstime (fields 14-17 of proc(5)); start time: 22
            ours[int(entry.name), int(after_name[19])] = sum(int(x) for x in after_name[11:15])
    return total, busy, ours
