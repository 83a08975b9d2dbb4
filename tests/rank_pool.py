"""gloo ranks kept for a test session: conftest's `gloo_ranks` fixture, spawn_gloo_ranks (ledger.sharding.realranks)
without a process start per launch.

A launch of spawn_gloo_ranks on 2 cores spends most of its time starting its ranks: each imports torch, lmledger and
the test module before its first collective (4 launches of 2 ranks: 37 CPU-s in fresh ranks, 15 in these, 2026-12-05).
Here the ranks of a world size are started once per pytest process, and each launch runs spawn_gloo_ranks' own rank
body (realranks._rank_main: a gloo process group of its own over a fresh store, the target, the result saved, a
barrier, the group destroyed) on them. A rank that raises, or dies, ends its pool (its peers may wait in a collective);
the next launch starts a new one. Module-level functions, so the spawned ranks can import this module by name."""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable

import torch


def _serve(rank: int, world_size: int, tasks, results) -> None:
    """One rank: each task is one launch, run as spawn_gloo_ranks' rank runs it, until a None."""
    from lmledger.ledger.sharding.realranks import _rank_main

    while (task := tasks.get()) is not None:
        tmp, target, args = task
        try:
            _rank_main(rank, world_size, tmp, target, args)
        except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
            results.put((rank, traceback.format_exc()))
            return
        results.put((rank, None))


class RankPool:
    """`world_size` gloo ranks, each a spawned process waiting for launches."""

    def __init__(self, world_size: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._ranks = [
            ctx.Process(target=_serve, args=(rank, world_size, self._tasks[rank], self._results), daemon=True)
            for rank in range(world_size)
        ]
        for process in self._ranks:
            process.start()

    @property
    def alive(self) -> bool:
        return all(process.is_alive() for process in self._ranks)

    def launch(self, target: Callable, args: tuple) -> list:
        """spawn_gloo_ranks(target, world_size, *args) on these ranks: their return values, by rank."""
        with tempfile.TemporaryDirectory() as tmp:
            for tasks in self._tasks:
                tasks.put((tmp, target, args))
            waiting, errors = set(range(self.world_size)), {}
            while waiting:
                try:
                    rank, error = self._results.get(timeout=1 if not errors else 2)
                except queue.Empty:
                    if errors or not self.alive:  # a peer of a rank that raised may wait in a collective
                        break
                    continue
                waiting.discard(rank)
                if error is not None:
                    errors[rank] = error
            if waiting or errors:
                self.close()
                said = "".join(f"\n--- rank {rank}:\n{error}" for rank, error in sorted(errors.items()))
                raise RuntimeError(
                    f"{target.__name__} on {self.world_size} gloo ranks: ranks {sorted(errors)} raised, "
                    f"{sorted(waiting)} did not finish{said}"
                )
            return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(self.world_size)]

    def close(self) -> None:
        for tasks, process in zip(self._tasks, self._ranks, strict=True):
            if process.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + 10
        for process in self._ranks:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # waiting in a collective for a peer that raised
                process.kill()
                process.join()
