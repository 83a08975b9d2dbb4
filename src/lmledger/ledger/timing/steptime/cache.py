"""The step-time cache: replayed op times and calibrations, per machine, torch version and layout (threads, ranks).

One JSON file beside the CPU peak and bandwidth caches (ledger/hardware/cpu.py: cache_dir()/step-times.json),
one entry per machine key, each with when and how it was measured:

    {"<cpu model> | <n> cpus | torch <v> | <t> threads[ x <r> ranks at once] | <device>": {
        "measured_at": ..., "method": ..., "ops": {op_key: seconds},
        "calibrations": {name: {"value": ..., "measured_at": ..., "method": ...}}}}

A file that cannot be read, or an entry of the wrong shape, is measured again, and `note` says so in one
line. Another machine's or torch version's entry is simply not this key's. Writes merge with what another
process wrote meanwhile (two DDP ranks predicting at once) and are atomic (lmledger.atomic); a machine's times
found stale (`forget`) leave the file too.
No Lightning import.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch

from lmledger.atomic import DiskWriteError, atomic_write
from lmledger.ledger.hardware.cpu import cache_dir, cpu_info

__all__ = ["STEP_TIMES_FILE", "StepTimeCache", "age_s", "machine_key", "now"]

STEP_TIMES_FILE = "step-times.json"
METHOD = (
    "ops replayed on real tensors of their recorded layouts: in the step's order, data flowing op to op, the "
    "median of rounds after a warm-up (keys ending '(in sequence)'), or alone, the median of calls"
)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def age_s(stamp: str) -> float:
    """Seconds since a time `now()` wrote; one that cannot be read counts as infinitely old."""
    try:
        then = datetime.datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return float("inf")
    if then.tzinfo is None:
        then = then.replace(tzinfo=datetime.timezone.utc)
    return (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()


def machine_key(device: torch.device, ranks: int = 1) -> str:
    """What the times belong to: the CPU, the torch build, the layout they were taken under (threads, and the ranks
    of one fit replaying at once on this machine: two 1-thread ranks share the caches and memory one 1-thread
    process has alone), and the device they ran on."""
    info = cpu_info()
    where = device.type
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())
    layout = f"{torch.get_num_threads()} threads" + (f" x {ranks} ranks at once" if ranks > 1 else "")
    return f"{info.model} | {info.logical_cpus} cpus | torch {torch.__version__} | {layout} | {where}"


class StepTimeCache:
    """One machine key's entry of the cache file, loaded on creation; `save()` writes it back."""

    def __init__(self, device: torch.device, path: Path | None = None, ranks: int = 1) -> None:
        self.path = path or cache_dir() / STEP_TIMES_FILE
        self.key = machine_key(device, ranks)
        self.note: str | None = None  # one line when the file or this entry had to be measured again
        entries = self._read()
        entry = entries.get(self.key)
        if entry is None:
            self.entry = self._fresh()
        elif not _valid(entry):
            self.note = f"step-time cache entry for this machine in {self.path} is malformed: measuring again"
            self.entry = self._fresh()
        else:
            self.entry = entry
        self._dirty = False
        self._forgotten = False  # forget(): what the file holds for this key is dropped at the next save

    @staticmethod
    def _fresh() -> dict:
        return {"measured_at": now(), "method": METHOD, "ops": {}, "calibrations": {}}

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            self.note = f"step-time cache {self.path} is unreadable ({type(err).__name__}): measuring again"
            return {}
        if not isinstance(entries, dict):
            self.note = f"step-time cache {self.path} is not a JSON object: measuring again"
            return {}
        return entries

    @property
    def ops(self) -> dict[str, float]:
        return self.entry["ops"]

    def calibration(self, name: str) -> dict | None:
        found = self.entry["calibrations"].get(name)
        return found if isinstance(found, dict) and isinstance(found.get("value"), (int, float, dict)) else None

    def set_calibration(self, name: str, value: object, method: str, **extra: object) -> None:
        self.entry["calibrations"][name] = {"value": value, "measured_at": now(), "method": method, **extra}
        self._dirty = True

    def mark(self) -> None:
        self._dirty = True

    def forget(self) -> None:
        """Drop every op time and calibration, here and, at the next save, from the file: the machine no
        longer runs as it did when they were taken."""
        self.entry["ops"].clear()
        self.entry["calibrations"].clear()
        self._forgotten = True
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        quiet = StepTimeCache.__new__(StepTimeCache)
        quiet.path, quiet.note = self.path, None
        entries = quiet._read()  # another process's additions are kept
        theirs = entries.get(self.key) if isinstance(entries.get(self.key), dict) else None
        if theirs is not None and _valid(theirs):
            if self._forgotten:
                theirs["ops"].clear()
                theirs["calibrations"].clear()
            theirs["ops"].update(self.entry["ops"])
            theirs["calibrations"].update(self.entry["calibrations"])
            self.entry = theirs
        entries[self.key] = self.entry
        try:
            atomic_write(self.path, json.dumps(entries, indent=0, sort_keys=True) + "\n")
        except DiskWriteError as err:
            self.note = f"could not write the step-time cache ({err})"
        self._dirty = False
        self._forgotten = False


def _valid(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("ops"), dict)
        and isinstance(entry.get("calibrations"), dict)
        and all(isinstance(v, (int, float)) and v >= 0 for v in entry["ops"].values())
    )
