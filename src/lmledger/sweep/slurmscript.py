"""What a SLURM array's batch script asks for, written so sbatch reads back exactly what was given.

SlurmRequest is what each task asks SLURM for (--partition, --time, --cpus-per-task, --mem, --gres); its
#SBATCH lines quote every value for sbatch's own directive parser (directive()), and a value no #SBATCH line
can carry (a newline, sbatch's word "hetjob") is refused in one line before anything is written. The
submission (sweep.slurm) writes the rest of the script.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lmledger.errors import UserError

__all__ = ["MIB", "SlurmRequest", "check_directive_value", "directive", "mem_bytes", "output_pattern"]

MIB = 1 << 20  # SLURM's --mem "M" (its default unit) is 2^20 bytes, as slurm.conf's RealMemory
# sbatch's --time forms (sbatch(1)): minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds; and no limit, UNLIMITED or INFINITE
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|unlimited|infinite", re.IGNORECASE)

# Seconds before a --time limit that SLURM sends SIGUSR1 (the kit saves, requeues and stops on it).
_SIGNAL_BEFORE_END_S = 120

# sbatch reads the #SBATCH lines of a script itself (src/sbatch/opt.c, _get_argument): a value may be
# double-quoted, with `\\` and `\"` escaped, so spaces, `;`, `$(...)`, backticks and `#` pass as written.
# But a line ends at a newline: the rest of a value with one would be a line of its own, and bash runs it.
# No partition, time, gres or path needs a newline or another control character, so those are refused.
# So is "hetjob" (or the older "packjob"), in any case: sbatch blanks that word out of an #SBATCH line and
# starts a heterogeneous job's next component at it.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)
_BARE = re.compile(r"[A-Za-z0-9_.,:/=@+-]+")  # written unquoted: what the cluster's own names look like


def check_directive_value(flag: str, value: str) -> None:
    """One line for a value no #SBATCH line can carry: a control character (a newline), sbatch's word
    "hetjob", or nothing."""
    if _CONTROL.search(value):
        raise UserError(
            f"{flag} {value!r} holds a control character (a newline, a tab...), which no #SBATCH line of the batch "
            "script can carry (sbatch reads those lines itself, one directive a line); give it without one"
        )
    if not value.strip():
        raise UserError(f"{flag} {value!r} is empty: give a value, or leave {flag} out for the cluster's default")
    if word := _HETJOB.search(value):
        raise UserError(
            f"{flag} {value!r} holds {word.group(0)!r}, which sbatch takes out of an #SBATCH line as the start of a "
            "heterogeneous job's next part; give it without that word"
        )


def directive(flag: str, value: object) -> str:
    """`#SBATCH --flag=value`, the value quoted as sbatch's directive parser reads it back.

    The value has passed check_directive_value."""
    text = str(value)
    if not _BARE.fullmatch(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"#SBATCH --{flag}={text}"


@dataclass(frozen=True)
class SlurmRequest:
    """What each task of the array asks SLURM for (None: the cluster's default).

    A value no #SBATCH line can carry is refused when the request is made, before anything is written."""

    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    gres: str | None = None

    def __post_init__(self) -> None:
        for name in ("partition", "time", "mem", "gres"):
            value = getattr(self, name)
            if value is not None:
                check_directive_value(f"--{name}", str(value))
        if self.time is not None and not _TIME.fullmatch(str(self.time).strip()):
            raise UserError(f"--time {self.time!r}: give a limit as sbatch takes it, in minutes (30), hours:minutes:"
                            "seconds (1:00:00) or days-hours (2-0)")  # fmt: skip
        if self.mem is not None:
            mem_bytes(self.mem)

    def sbatch_lines(self, mem_mib: int | None) -> list[str]:
        lines = []
        for flag, value in (("partition", self.partition), ("time", self.time), ("cpus-per-task", self.cpus_per_task),
                            ("gres", self.gres)):  # fmt: skip
            if value is not None:
                lines.append(directive(flag, value))
        if mem_mib is not None:
            lines.append(f"#SBATCH --mem={int(mem_mib)}M")
        if self.time is not None:
            lines.append(f"#SBATCH --signal=B:USR1@{_SIGNAL_BEFORE_END_S}")
        return lines


def mem_bytes(text: str) -> int:
    """Bytes of a `--mem` value, as sbatch reads it. A number with K, M (default), G or T (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--mem {text!r}: give a size as sbatch takes it, e.g. 8G, 8000M or 8000 (megabytes)")
    scale = {"K": 1 << 10, "": MIB, "M": MIB, "G": 1 << 30, "T": 1 << 40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def output_pattern(logs: Path) -> str:
    """The --output pattern of the tasks' logs in `logs`: SLURM fills in %A_%a, so a '%' of the path is
    written '%%'. A backslash anywhere turns every pattern off (sbatch(1), filename pattern): refused."""
    text = str(logs)
    check_directive_value("--out", text)
    if "\\" in text:
        raise UserError(
            f"--out {text!r} holds a backslash, which turns off the %A_%a in SLURM's log names (sbatch's "
            "--output pattern); choose a results directory without one"
        )
    return text.replace("%", "%%") + "/%A_%a.out"
