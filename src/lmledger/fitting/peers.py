"""No rank left waiting: how long a rank waits for the others, and one line when one never comes or dies.

    set_peer_timeout    the strategy's process-group timeout: the kit's PEER_TIMEOUT where Lightning's 30 min is left
    close_process_group the end of a run that made a process group: destroyed, not left to interpreter exit
    PeerWatch           a callback: the step reached, the run's checkpoints, the launcher's child ranks
    peer_failure_line   an error from torch.distributed as one line: what was waited for, which rank, how long

The process-group timeout bounds both waits on gloo: the rendezvous (init_process_group's TCPStore waits that
long for every rank) and every collective (gloo's recv waits that long for a peer that stops answering). On
NCCL it is the watchdog's timeout. Lightning 2.6.6 passes torch's default_pg_timeout (30 min) to every backend,
NCCL included, whose own default is 10 min (torch 2.13 init_process_group's docstring; canary
test_process_group_timeouts). A peer that dies (SIGKILL) closes its sockets: the survivors' next collective
fails at once ("Connection reset by peer").
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl

from lmledger.lightning_private import observe_child_ranks

__all__ = [
    "LIGHTNING_TIMEOUT",
    "PEER_TIMEOUT",
    "PeerFailure",
    "PeerWatch",
    "close_process_group",
    "end_child_ranks",
    "peer_failure_line",
    "set_peer_timeout",
]

# A toy run's ranks arrive within seconds of each other and a collective takes milliseconds; the longest wait
# between two collectives is rank 0 saving a checkpoint or the ledger's dry run (seconds). 120 s covers that on
# a loaded 2-core CPU; a large run sets its own (docs/cluster.md).
PEER_TIMEOUT = timedelta(seconds=120)
LIGHTNING_TIMEOUT = timedelta(minutes=30)  # DDPStrategy's and ModelParallelStrategy's default timeout
# After a child rank dies, the launcher (rank 0) gets this long to fail in its own collective and say so,
# before Lightning's observer ends it with SIGKILL (the line is then printed first, from here).
DEATH_GRACE_S = 10.0


class PeerFailure(Exception):
    """Another rank never came, stopped answering or died: `line` says which, how long, and what was kept.

    `lmledger fit` prints it and exits 1 (not bad input, so not a UserError's 2).
    """

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def set_peer_timeout(strategy) -> timedelta | None:
    """Give a distributed strategy the kit's PEER_TIMEOUT where its timeout is Lightning's default.

    A timeout the user set (`--trainer.strategy.timeout 0:10:00` with the class form) stays. Returns the
    timeout in force (None: not a strategy with a process group).
    """
    timeout = getattr(strategy, "_timeout", None)
    if not isinstance(timeout, timedelta):
        return None
    if timeout == LIGHTNING_TIMEOUT:
        strategy._timeout = timeout = PEER_TIMEOUT
    return timeout


def close_process_group() -> None:
    """Destroy the default process group, if this run made one, once every rank's collectives are done.

    Lightning 2.6.6 leaves it after fit (canary test_lightning_leaves_the_process_group_after_fit). Left to
    interpreter exit, gloo's worker threads can end the process in std::terminate, "terminate called without an
    active exception" (SIGABRT) after a run that succeeded: pytorch/pytorch#190489.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _seconds(value: timedelta | float | None) -> str:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    return "?" if seconds is None else f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


class _State:
    """What the failure line needs, kept where the observer thread can read it too."""

    def __init__(self) -> None:
        self.rank, self.world, self.node, self.nodes = 0, 1, 0, 1
        self.step: int | None = None  # the optimizer steps done, once training has started
        self.joined = False  # the rendezvous completed (Lightning calls setup after init_process_group)
        self.checkpoints: Path | None = None
        self.timeout: timedelta | None = None
        self.children: list = []  # the launcher's Popen of local ranks 1.. (rank 0 only)
        self.dead: list[str] = []  # "rank 1 (pid 7) was killed by SIGKILL", noted before Lightning kills the rest
        self.reported = False
        self.lock = threading.Lock()
        self.started = time.monotonic()


STATE = _State()


def _dead_children(wait_s: float = 0.0) -> list[str]:
    """The launcher's child ranks that have ended, in words. A peer's socket closes as it dies, a moment before
    its exit can be reaped: with `wait_s`, wait that long for one to end."""
    deadline = time.monotonic() + wait_s
    while wait_s and time.monotonic() < deadline and all(proc.poll() is None for proc in STATE.children):
        time.sleep(0.05)
    dead = []
    per_node = len(STATE.children) + 1
    for i, proc in enumerate(STATE.children):
        code = proc.poll()
        if code is None or code == 0:
            continue
        rank = STATE.node * per_node + i + 1
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        dead.append(f"rank {rank} (pid {proc.pid}) {how}")
    return dead


def _newest_checkpoint_words() -> str:
    """The words for the newest checkpoint: "PATH (step N) is intact: resume with --ckpt_path auto", or why not."""
    from lmledger.checkpointing import newest_checkpoint, open_checkpoint

    directory = STATE.checkpoints
    found = newest_checkpoint(directory) if directory is not None and directory.is_dir() else None
    if found is None:
        return "no checkpoint was saved yet: rerun to start over"
    try:
        step = int(open_checkpoint(found, mmap=True).get("global_step", 0))
    except Exception as err:  # a damaged file: say so, never claim it
        return f"the newest checkpoint {_shown(found)} does not load ({type(err).__name__}): see docs/reliability.md"
    return f"the newest checkpoint {_shown(found)} (step {step}) is intact: resume with --ckpt_path auto"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class PeerWatch(pl.Callback):
    """Keeps what peer_failure_line says: this rank, the step reached, the checkpoint directory, the child ranks."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        STATE.joined = True
        self._note(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(trainer)
        STATE.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        STATE.step = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Before Lightning's own on_exception kills the launcher's children: which of them had died.
        self._note(trainer)
        STATE.dead = STATE.dead or _dead_children()

    @staticmethod
    def _note(trainer: pl.Trainer) -> None:
        STATE.rank, STATE.world = trainer.global_rank, trainer.world_size
        STATE.node, STATE.nodes = trainer.node_rank, trainer.num_nodes
        if STATE.step is not None:
            STATE.step = max(STATE.step, trainer.global_step)
        STATE.timeout = getattr(trainer.strategy, "_timeout", None)
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "dirpath", None):
            STATE.checkpoints = Path(callback.dirpath)
        elif trainer.log_dir is not None:
            STATE.checkpoints = Path(trainer.log_dir) / "checkpoints"


def end_child_ranks() -> None:
    """SIGKILL the launcher's child ranks still alive (one frozen, or waiting on the lost one): Lightning kills
    them on Ctrl-C only, and a stopped one would hold the job's output open with no rank left to end it."""
    for proc in STATE.children:
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=10)
            except Exception:  # a process that does not die of SIGKILL (uninterruptible I/O): nothing more to do
                pass


def _children_started(children: list) -> None:
    STATE.children = children


def _child_died(children: list) -> bool:
    """Lightning's observer found a dead child rank: let rank 0 fail in its own collective and say so; if it has
    not within DEATH_GRACE_S (busy outside a collective), say it here, and let the observer end every rank.
    False (the launcher is ending by itself, its line said): no SIGKILL, so it exits with its own code."""
    STATE.children = children
    STATE.dead = STATE.dead or _dead_children()
    deadline = time.monotonic() + DEATH_GRACE_S
    while time.monotonic() < deadline and not STATE.reported:
        time.sleep(0.1)
    if not _claim_report():
        return False
    print(f"lmledger fit: {_death_line(None)}", file=sys.stderr, flush=True)
    return True


observe_child_ranks(_children_started, _child_died)


def _claim_report() -> bool:
    with STATE.lock:
        if STATE.reported:
            return False
        STATE.reported = True
        return True


def _at_step() -> str:
    return f" at step {STATE.step}" if STATE.step is not None else ""


def _death_line(peer: str | None) -> str:
    who = "; ".join(STATE.dead) if STATE.dead else f"a peer rank{f' ({peer})' if peer else ''} closed its connection"
    return f"{who}{_at_step()}; rank {STATE.rank} stopped; {_newest_checkpoint_words()}"


_STORE_WAIT = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
_CONNECT = re.compile(r"(?:failed to connect|Connection refused|connect\(\)|timed out.*connect|Socket Timeout)", re.I)
_PEER_GONE = re.compile(r"(Connection reset by peer|Connection closed by peer|Broken pipe)")
_PEER_ADDR = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")
_COLLECTIVE_WAIT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def peer_failure_line(err: BaseException) -> str | None:
    """One line for an error that means another rank never came, stopped answering, or died; None otherwise.

    Marks the failure reported, so Lightning's observer thread says nothing more.
    """
    import torch.distributed as dist

    text = " ".join(" ".join(str(e) for e in _chain(err)).split())
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    if not (isinstance(err, kinds) or "gloo" in text or "c10d" in text or "NCCL" in text or _STORE_WAIT.search(text)):
        return None
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    bound = f"--trainer.strategy.timeout (now {_seconds(STATE.timeout)})"
    line = None
    if found := _STORE_WAIT.search(text):
        waited, joined, world = (int(g) for g in found.groups())
        nodes = f" (this is node {STATE.node} of {STATE.nodes})" if STATE.nodes > 1 else ""
        line = (
            f"rendezvous: rank {STATE.rank} waited {waited} s at {where} for {world - joined} of {world} ranks{nodes}, "
            f"and they never joined: start every node with the same MASTER_ADDR and MASTER_PORT, or wait longer "
            f"with {bound}"
        )
    elif not STATE.joined and _CONNECT.search(text) and not _PEER_GONE.search(text):
        ms = re.search(r"after (\d+) ?ms", text)
        waited = _seconds(int(ms.group(1)) / 1000 if ms else time.monotonic() - STATE.started)
        line = (
            f"rendezvous: rank {STATE.rank} (node {STATE.node} of {STATE.nodes}) could not reach rank 0 at {where} "
            f"within {waited}: start node 0 (NODE_RANK 0) with that address, or wait longer with {bound}"
        )
    elif _PEER_GONE.search(text):
        addr = _PEER_ADDR.search(text)
        STATE.dead = STATE.dead or _dead_children(wait_s=5.0)
        line = _death_line(f"{addr.group(1)}:{addr.group(2)}" if addr else None)
    elif found := _COLLECTIVE_WAIT.search(text):
        others = ", ".join(str(r) for r in range(STATE.world) if r != STATE.rank)
        ranks = f"rank{'s' if STATE.world > 2 else ''} {others}"
        waited = _seconds(int(found.group(1)) / 1000)
        line = (
            f"rank {STATE.rank} waited {waited} in a collective ({found.group(2)}){_at_step()} for {ranks}, which "
            f"stopped answering; {_newest_checkpoint_words()}; a step that legitimately takes longer needs a larger "
            f"{bound}"
        )
    if line is not None:
        _claim_report()
    return line
