"""Pipeline schedules: the order in which each pipeline rank runs its forwards and backwards, what that order holds
in memory, and how long it takes. One description serves the memory (`in_flight`) and the time (`timeline`).

    gpipe         every forward of the step, then every backward (Huang et al., GPipe, 2019): a rank holds all m
                  micro-batches' activations
    1f1b          rank r runs pp - r - 1 forwards, then one forward and one backward in turn, then the backwards
                  left (Narayanan et al., PipeDream-Flush, 2021): it holds at most pp - r micro-batches
    interleaved   each rank holds v model chunks (virtual stages r, r + pp, ...); forwards go through the chunks in
                  groups of pp micro-batches, and a rank starts with 2(pp - r - 1) + (v - 1) pp forwards
                  (Narayanan et al., SC'21, section 2.2.2; Megatron-LM's and torch's ScheduleInterleaved1F1B): the
                  bubble is (pp - 1) / v of a stage's time, and m must be a multiple of pp

    deepspeed     DeepSpeed's PipelineEngine (TrainSchedule, deepspeed/runtime/pipe/schedule.py), which
                  Megatron-DeepSpeed trains with: the step is 2(m + pp - 1) slots, and in each a rank runs one forward
                  or one backward (even ranks start on a forward, odd ranks on a backward slot) or idles. A rank sends
                  a result in its next slot, and each send is blocking, paired with its neighbour's receive: so the
                  ranks run in lockstep and every slot waits for its slowest neighbour, where 1F1B lets a fast stage
                  run ahead. Same work as 1F1B, same activations held

`timeline` runs the orders against each other: an action starts once its rank is free and what it needs is done
(a forward the previous virtual stage's forward of that micro-batch, a backward the next stage's backward), plus
the point-to-point send between the two ranks. The bubble is what that leaves idle. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmledger.errors import ConfigError

__all__ = ["SCHEDULES", "Pipeline", "Timeline", "in_flight", "orders", "timeline"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "deepspeed")
FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Pipeline:
    stages: int  # pipeline ranks (pp)
    micro_batches: int  # m: micro-batches per optimizer step on one data-parallel replica
    schedule: str = "1f1b"
    virtual: int = 1  # model chunks per rank (v): above 1 only for "interleaved"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.stages < 1 or self.micro_batches < 1 or self.virtual < 1:
            raise ConfigError(f"a pipeline needs at least one stage, micro-batch and chunk, got {self}")
        if self.schedule != "interleaved" and self.virtual != 1:
            raise ConfigError(f"{self.virtual} model chunks a rank need the interleaved schedule, not {self.schedule}")
        if self.schedule == "interleaved" and self.micro_batches % self.stages:
            raise ConfigError(f"the interleaved schedule runs micro-batches in groups of the {self.stages} stages: "
                              f"{self.micro_batches} micro-batches is not a multiple")  # fmt: skip

    @property
    def chunks(self) -> int:
        """Virtual stages in all: the model is cut into this many equal pieces."""
        return self.stages * self.virtual


Action = tuple[str, int, int]  # (FORWARD or BACKWARD, micro-batch, virtual stage)


def orders(pipe: Pipeline) -> list[list[Action]]:
    """Each pipeline rank's actions in the order it runs them (module doc). Virtual stage c * pp + r is rank r's
    chunk c."""
    pp, m, v = pipe.stages, pipe.micro_batches, pipe.virtual
    if pipe.schedule == "deepspeed":
        return [[a for a in cmds if a[0] in (FORWARD, BACKWARD)] for cmds in _lockstep(pipe)]
    out = []
    for r in range(pp):
        if pipe.schedule == "gpipe":
            out.append([(FORWARD, i, r) for i in range(m)] + [(BACKWARD, i, r) for i in range(m)])
            continue
        total = m * v
        if pipe.schedule == "1f1b":
            warmup = min(pp - r - 1, total)
        else:
            warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)

        def forward(k: int, r: int = r) -> Action:  # the k-th forward: groups of pp micro-batches per chunk
            chunk = (k // pp) % v
            return FORWARD, (k // (pp * v)) * pp + k % pp, chunk * pp + r

        def backward(k: int, r: int = r) -> Action:  # backwards go through the chunks the other way
            chunk = v - 1 - (k // pp) % v
            return BACKWARD, (k // (pp * v)) * pp + k % pp, chunk * pp + r

        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        out.append(actions)
    return out


SEND, RECEIVE = "send", "receive"  # a blocking hand-over's two ends, (SEND or RECEIVE, micro-batch, peer rank)


def _lockstep(pipe: Pipeline) -> list[list[tuple[str, int, int]]]:
    """Each rank's commands under DeepSpeed's TrainSchedule (module doc), its sends and receives among them: slot t
    of rank r holds a forward of micro-batch t//2 - r//2 where t and r have the same parity, else a backward of
    t//2 - pp + 1 + r//2 (DeepSpeed's four parity cases, folded); a receive comes before the slot's compute, and the
    previous slot's result is sent first (a forward slot sends the gradient back, then receives)."""
    pp, m = pipe.stages, pipe.micro_batches
    out = []
    for r in range(pp):
        cmds: list[tuple[str, int, int]] = []
        prev = None  # (kind, micro-batch) of the rank's previous slot
        for t in range(2 * (m + pp - 1)):
            forward = t % 2 == r % 2
            i = t // 2 - r // 2 if forward else t // 2 - pp + 1 + r // 2
            valid = 0 <= i < m
            if forward and r > 0:  # DeepSpeed's order: receive this slot's input, then send the last gradient
                cmds += [(RECEIVE, i, r - 1)] if valid else []
                cmds += [(SEND, prev[1], r - 1)] if prev and prev[0] == BACKWARD else []
            elif not forward and r < pp - 1:  # send the last activation, then receive this slot's gradient
                cmds += [(SEND, prev[1], r + 1)] if prev and prev[0] == FORWARD else []
                cmds += [(RECEIVE, i, r + 1)] if valid else []
            if valid:
                cmds.append((FORWARD if forward else BACKWARD, i, r))
            prev = (FORWARD if forward else BACKWARD, i) if valid else None
        out.append(cmds)
    return out


def _lockstep_timeline(pipe: Pipeline, forward_s: list[float], backward_s: list[float], send_s: float) -> Timeline:
    """DeepSpeed's lockstep run: a rank's commands one after another, each send and its receive starting together
    once both ranks reach them (blocking NCCL point-to-point) and taking `send_s`."""
    plan = _lockstep(pipe)
    free, busy = [0.0] * pipe.stages, [0.0] * pipe.stages

    def advance(r: int, at: list[int]) -> int:
        kind, i, peer = plan[r][at[r]]
        if kind in (FORWARD, BACKWARD):
            seconds = (forward_s if kind == FORWARD else backward_s)[r]
            free[r] += seconds
            busy[r] += seconds
            at[r] += 1
            return 1
        if at[peer] >= len(plan[peer]) or plan[peer][at[peer]] != (RECEIVE if kind == SEND else SEND, i, r):
            return 0  # the peer has not reached the other end yet
        free[r] = free[peer] = max(free[r], free[peer]) + send_s
        at[r] += 1
        at[peer] += 1
        return 2

    _drain(plan, advance, pipe)
    return Timeline(max(free), tuple(busy), tuple(free))


def _drain(plan: list[list], advance, pipe: Pipeline) -> None:
    """Run every rank's orders against each other: `advance(rank, at)` takes the rank's next command(s) where what
    they wait for is done (moving `at`, returning how many commands it took) or returns 0; a plan that stops with
    commands left waits on itself: a bug in the orders, never a user's input."""
    at = [0] * len(plan)
    left = sum(len(p) for p in plan)
    while left:
        moved = False
        for r in range(len(plan)):
            while at[r] < len(plan[r]) and (taken := advance(r, at)):
                left -= taken
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule {pipe} deadlocks")


def in_flight(pipe: Pipeline, rank: int) -> int:
    """The most forwards whose activations rank `rank` holds at once (each a chunk's: 1/v of the rank's layers): the
    micro-batches a stage's saved activations are counted for, at its peak."""
    held = most = 0
    for kind, _, _ in orders(pipe)[rank]:
        held += 1 if kind == FORWARD else -1
        most = max(most, held)
    return most


@dataclass(frozen=True)
class Timeline:
    seconds: float  # the last backward's end on any rank
    busy: tuple[float, ...]  # each rank's forward and backward seconds
    ends: tuple[float, ...]  # each rank's last backward's end

    @property
    def bubble(self) -> float:
        """The idle share of the busiest rank's step: what the schedule leaves on the table."""
        return self.seconds - max(self.busy)


def timeline(pipe: Pipeline, forward_s: list[float], backward_s: list[float], send_s: float = 0.0) -> Timeline:
    """The schedule run on times per virtual stage (`forward_s[j]`, `backward_s[j]`: one micro-batch's, chunk j of
    pipe.chunks), each hand-over between ranks taking `send_s` (activations forward, their gradients back)."""
    if len(forward_s) != pipe.chunks or len(backward_s) != pipe.chunks:
        raise ValueError(f"times for {pipe.chunks} virtual stages expected")
    if pipe.schedule == "deepspeed":
        return _lockstep_timeline(pipe, forward_s, backward_s, send_s)
    plan = orders(pipe)
    pp, last = pipe.stages, pipe.chunks - 1
    done: dict[Action, float] = {}
    free = [0.0] * pp
    busy = [0.0] * pp

    def advance(r: int, at: list[int]) -> int:
        kind, i, j = plan[r][at[r]]
        if kind == FORWARD:
            needs = [((FORWARD, i, j - 1), send_s)] if j > 0 else []
            seconds = forward_s[j]
        else:
            needs = [((FORWARD, i, j), 0.0)]
            needs += [((BACKWARD, i, j + 1), send_s)] if j < last else []
            seconds = backward_s[j]
        if any(need not in done for need, _ in needs):
            return 0
        start = max([free[r], *(done[need] + (s if pp > 1 else 0.0) for need, s in needs)])
        free[r] = done[(kind, i, j)] = start + seconds
        busy[r] += seconds
        at[r] += 1
        return 1

    _drain(plan, advance, pipe)
    return Timeline(max(free), tuple(busy), tuple(free))
