"""How the sharded step's probes run (dtensor.py, fsdp2.py, rankwait.py): each in a Python process of its own, never
the caller's, whose process group and threads are the run's; a multi-rank probe on real gloo ranks spawned from it.
No Lightning import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

__all__ = ["in_own_process", "on_gloo_ranks"]


def in_own_process(module: str, call: str, threads: int, timeout_s: float = 180) -> dict | None:
    """The JSON object `module`'s `call` (a function call's source, e.g. "_main(2, 1)") returns, run in a fresh Python
    process at `threads` intra-op threads; None where it fails, times out or prints none."""
    code = f"import json; from {module} import {call.split('(')[0]}; print(json.dumps({call}))"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        value = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return value if isinstance(value, dict) and value else None


def on_gloo_ranks(rank_fn: Callable, world_size: int, *args: object) -> object:
    """What rank 0 of `world_size` spawned processes puts on the queue: each runs rank_fn(rank, world_size,
    init_method, *args, queue), `init_method` a file store of their own for their gloo process group. A file, not a
    TCP port: a port found free here may be taken by another process before the ranks bind it."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lmledger-probe-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(rank_fn, args=(world_size, init_method, *args, queue), nprocs=world_size,
                           start_method="spawn")  # fmt: skip
        return queue.get()
