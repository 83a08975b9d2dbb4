"""A child process that dies with its parent, however the parent dies (SIGKILL included): a sweep's points
(sweep/launch.py) and a layout search's workers (ledger/timing/gpu/search.py). No Lightning, no torch."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]


def die_with_parent(parent: int) -> None:
    """Make this process receive SIGTERM when `parent` dies, however it dies (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>. prctl(2): the signal comes when the parent *thread* exits.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the call: nobody will send the signal
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def watch() -> None:  # elsewhere: poll. An orphan is adopted by another process.
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="lmledger-parent-watch", daemon=True).start()
