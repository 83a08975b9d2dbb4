"""What several benchmarks share: the process's peak resident memory, and a prepared corpus to train on.

Imported as `_common` by scripts run as `python benchmarks/NAME.py` (their folder is then on sys.path).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def resident_bytes() -> int:
    """The process's peak resident set so far (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def prepared_corpus(path: str, scratch: Path) -> str:
    """`path` if it holds a prepared corpus, else the stdlib corpus prepared into `scratch` (lmledger prepare)."""
    from lmledger.cli import main as lmledger

    if (Path(path) / "meta.json").is_file():
        return path
    out = scratch / "stdlib"
    if lmledger(["prepare", "--out", str(out)]) != 0:
        raise SystemExit(f"could not prepare a corpus in {out}")
    return str(out)
