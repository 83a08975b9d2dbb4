"""Pipeline schedules (ledger/sharding/schedule.py): each order against the closed forms of its paper."""

import pytest

from lmledger.errors import ConfigError
from lmledger.ledger.sharding.schedule import BACKWARD, FORWARD, Pipeline, in_flight, orders, timeline


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_equal_stages_take_the_papers_bubble(schedule, virtual):
    # pp 4, m 8, a stage's forward 1 s and backward 2 s (split over its v chunks): the step is m (F + B) plus the
    # bubble (pp - 1)(F + B) / v (GPipe and 1F1B: Narayanan et al. 2021 eq. 1; interleaved: SC'21 section 2.2.2)
    pipe = Pipeline(4, 8, schedule, virtual)
    t = timeline(pipe, [1.0 / virtual] * pipe.chunks, [2.0 / virtual] * pipe.chunks)
    assert t.seconds == pytest.approx(8 * 3 + 3 * 3 / virtual)
    assert t.bubble == pytest.approx(3 * 3 / virtual)
    assert t.busy == pytest.approx((24.0,) * 4)


def test_each_order_runs_every_forward_and_backward_once():
    for pipe in (Pipeline(3, 5, "gpipe"), Pipeline(3, 5, "1f1b"), Pipeline(3, 6, "interleaved", 3),
                 Pipeline(3, 5, "deepspeed")):  # fmt: skip
        for r, actions in enumerate(orders(pipe)):
            want = {(k, i, c * pipe.stages + r) for k in (FORWARD, BACKWARD) for i in range(pipe.micro_batches)
                    for c in range(pipe.virtual)}  # fmt: skip
            assert sorted(actions) == sorted(want)
            for kind, i, j in actions:  # a backward never runs before its own forward on the rank
                if kind == BACKWARD:
                    assert actions.index((FORWARD, i, j)) < actions.index((BACKWARD, i, j))


def test_activations_in_flight():
    assert [in_flight(Pipeline(4, 8, "gpipe"), r) for r in range(4)] == [8] * 4
    assert [in_flight(Pipeline(4, 8, "1f1b"), r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(Pipeline(4, 2, "1f1b"), r) for r in range(4)] == [2, 2, 2, 1]  # fewer micro-batches than stages
    for m in (2, 8):  # DeepSpeed's TrainSchedule holds what 1F1B holds
        assert [in_flight(Pipeline(4, m, "deepspeed"), r) for r in range(4)] == [
            in_flight(Pipeline(4, m, "1f1b"), r) for r in range(4)
        ]
    # interleaved, v chunks of 1/v the layers: the first rank holds pp (1 + (pp - 1) / (pp v)) stages' worth
    # (Korthikanti et al. 2022, section 4.2.3): 5.5 at pp 4, v 2
    for v in (2, 4):
        assert in_flight(Pipeline(4, 8, "interleaved", v), 0) / v == pytest.approx(4 * (1 + 3 / (4 * v)))


def test_the_last_stage_slower_sets_the_pace_and_sends_add_on_the_critical_path():
    pipe = Pipeline(4, 8, "1f1b")
    slow_last = timeline(pipe, [1, 1, 1, 1.5], [2, 2, 2, 3])
    # (m - 1) micro-batches at the slowest stage's pace, plus one micro-batch through every stage
    assert slow_last.seconds == pytest.approx(7 * 4.5 + (3 * 3 + 4.5))
    with_sends = timeline(pipe, [1] * 4, [2] * 4, send_s=0.1)
    assert 33 + 2 * 3 * 0.1 - 1e-9 <= with_sends.seconds <= 33 + 2 * 8 * 3 * 0.1


@pytest.mark.parametrize("args", [(4, 8, "zigzag", 1), (4, 8, "1f1b", 2), (4, 6, "interleaved", 2), (0, 8, "1f1b", 1)])
def test_bad_pipelines_are_one_line(args):
    with pytest.raises(ConfigError):
        Pipeline(*args)


def test_deepspeeds_lockstep_is_1f1bs_work_and_its_blocking_sends_hold_both_ranks():
    # DeepSpeed's TrainSchedule: with free hand-overs it takes what 1F1B takes, stages equal or not, since each rank
    # runs the same forwards and backwards in an order its neighbours keep pace with
    for forward, backward in (([1] * 4, [2] * 4), ([1, 3, 1, 1], [2, 6, 2, 2]), ([1, 1, 1, 1.5], [2, 2, 2, 3])):
        for m in (2, 8):
            lockstep = timeline(Pipeline(4, m, "deepspeed"), forward, backward)
            assert lockstep.seconds == pytest.approx(timeline(Pipeline(4, m, "1f1b"), forward, backward).seconds)
    # each send blocks its rank and the receiving one (NCCL point-to-point, paired): on 2 stages every forward's
    # output and every backward's gradient crosses, so both ranks carry all 2m hand-overs on top of 1F1B's step
    for m in (2, 8):
        lockstep = timeline(Pipeline(2, m, "deepspeed"), [1, 1], [2, 2], send_s=0.1)
        assert lockstep.seconds == pytest.approx((m + 1) * 3 + 2 * m * 0.1)
        assert lockstep.seconds > timeline(Pipeline(2, m, "1f1b"), [1, 1], [2, 2], send_s=0.1).seconds
