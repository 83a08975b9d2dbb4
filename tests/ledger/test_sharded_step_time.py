"""What a sharded CPU step spends beside its replayed ops (issue 50): gloo's collectives along their measured
points, FSDP2's cost per collective, each probed on real gloo ranks in processes of their own."""

from __future__ import annotations

import pytest
import torch

from lmledger.ledger.count.ops import COMMUNICATION, OpRecord
from lmledger.ledger.timing.steptime import fsdp2, rankwait
from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.calibrate import gloo_calibration, gloo_seconds
from lmledger.ledger.timing.steptime.fsdp2 import fsdp2_collective_s

MB = 1 << 20
TIMES = {"4096": 0.5e-3, "65536": 0.6e-3, str(MB): 3e-3, str(16 * MB): 12e-3}  # an all-reduce's seconds by its bytes


def _collective(name: str, nbytes: int, group_size: int = 2) -> OpRecord:
    return OpRecord(name, "backward", COMMUNICATION, 0, nbytes, nbytes, "float32", group="world", group_size=group_size)


@pytest.fixture
def seeded(tmp_path) -> StepTimeCache:
    cache = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2)
    cache.set_calibration(gloo_calibration(2), {"alpha_s": 1e-3, "bytes_per_s": 1e9, "times": TIMES}, "seeded")
    return cache


def test_gloo_collectives_are_priced_along_the_all_reduces_measured_points(seeded):
    """gloo's all-reduce here jumps fivefold between 64 KiB and 1 MiB: no latency-and-bandwidth line fits it, so a
    collective is priced between the two measured sizes around it, as the all-reduce sending its bytes."""
    price = lambda name, n: gloo_seconds(_collective(name, n), 2, seeded)  # noqa: E731
    assert price("c10d.allreduce_", MB) == pytest.approx(3e-3)
    assert price("c10d.allreduce_", 2 * MB) == pytest.approx(3e-3 + 9e-3 * MB / (15 * MB))
    # an all-gather of 2 MiB (its gathered side) sends what an all-reduce of 1 MiB sends on 2 ranks
    assert price("c10d._allgather_base_", 2 * MB) == pytest.approx(3e-3)
    assert price("c10d._reduce_scatter_base_", 2 * MB) == pytest.approx(3e-3)
    assert price("c10d.allreduce_", 32 * MB) == pytest.approx(12e-3 + 9e-3 * 16 / 15)  # past the last, along it
    assert price("c10d.allreduce_", 100) == pytest.approx(0.5e-3)  # below the first: never cheaper than it
    assert price("_c10d_functional.wait_tensor", MB) == 0.0  # a wait moves nothing
    assert gloo_seconds(_collective("c10d.allreduce_", MB), 4, seeded) is None  # nothing measured at 4 ranks


def test_fsdp2_collectives_pay_fsdp2s_measured_cost_beyond_a_bare_all_reduce(seeded):
    seeded.set_calibration("fsdp2_per_collective_w2", 1.5e-3, "seeded")
    ops = [_collective("c10d._allgather_base_", MB), _collective("c10d._reduce_scatter_base_", MB),
           _collective("c10d.allreduce_", MB)]  # fmt: skip
    extra, how = fsdp2.price(ops, 2, seeded, measure=False)
    assert extra == pytest.approx(2 * (1.5e-3 - 0.5e-3))  # two of FSDP2's, over the smallest all-reduce's time
    assert "2 of them FSDP2's, each +1 ms for FSDP2's hooks" in how
    assert fsdp2.price(ops[2:], 2, seeded, measure=False) == (0.0, "")  # DDP's all-reduce pays nothing more
    # Cheaper inside FSDP2's stream of collectives than a lone all-reduce after compute: less, never below FSDP2's own
    seeded.set_calibration("fsdp2_per_collective_w2", 0.3e-3, "seeded")
    extra, how = fsdp2.price(ops, 2, seeded, measure=False)
    assert extra == pytest.approx(2 * (0.3e-3 - 0.5e-3)) and "each -0.2 ms" in how
    assert gloo_seconds(ops[0], 2, seeded) + extra / 2 >= 0.3e-3  # the bare all-reduce never below the smallest


def test_fsdp2s_cost_per_collective_is_probed_on_gloo_ranks_and_cached(tmp_path):
    """Two gloo ranks in processes of their own, a chain of 2 and of 10 fully_shard units beside it unsharded: about
    1.1-1.7 ms a collective on the 2-core VM (2026-12-04), a bare all-reduce of that size 0.4. Bounds wide: a busy
    machine slows both sides."""
    cache = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2)
    assert fsdp2_collective_s(2, cache, measure=False) is None  # inside a multi-rank fit: the cache or nothing
    value, how = fsdp2_collective_s(2, cache)
    assert how == "measured now" and 1e-5 < value < 0.05
    again = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2)
    assert fsdp2_collective_s(2, again, measure=False)[0] == value


def test_each_collective_waits_for_the_other_ranks_by_the_compute_before_it(seeded):
    """steptime/rankwait.py: a collective reached after compute pays the ranks' wait for each other: none under the
    probe's short segment (gloo still spins), its long segment's wait beyond, in between along the line."""
    from lmledger.ledger.count.ops import MATMUL, OpSummary
    from lmledger.ledger.timing.steptime.rankwait import wait_seconds

    value = {"points": [[1e-3, 0.2e-3], [10e-3, 2e-3]]}
    assert wait_seconds(0.5e-3, value) == 0.0 and wait_seconds(1e-3, value) == pytest.approx(0.2e-3)
    assert wait_seconds(5.5e-3, value) == pytest.approx(1.1e-3) and wait_seconds(50e-3, value) == pytest.approx(2e-3)

    seeded.set_calibration("rank_wait_w2", value, "seeded")
    mm = OpRecord("aten.mm.default", "forward", MATMUL, 0, 0, 0, "float32")
    wait = _collective("_c10d_functional.wait_tensor.default", MB)
    ops = [mm, _collective("c10d._allgather_base_", MB), mm, _collective("_c10d_functional.all_reduce.default", MB),
           wait, mm, _collective("c10d.allreduce_", MB)]  # fmt: skip
    times = {0: 3e-3, 2: 2.5e-3, 5: 0.4e-3}  # replayed seconds by position; 0.1 ms per op besides
    extra, how = rankwait.price(OpSummary.of(ops), times, 1e-4, 2, seeded, measure=False)
    # 3.1 ms before FSDP2's all-gather (its own probe ran no compute between collectives), 2.6 ms before the first
    # all-reduce, 0.5 ms before the second (a wait is no collective: it does not reset the compute)
    assert extra == pytest.approx(wait_seconds(3.1e-3, value) + wait_seconds(2.6e-3, value) + 0.0)
    assert "3 collectives' wait for the other ranks" in how


def test_gloos_all_reduce_and_the_ranks_wait_are_probed_on_gloo_ranks_and_cached(tmp_path, monkeypatch):
    """The two probes a multi-rank fit's rank 0 runs besides FSDP2's: all-reduce at seven sizes (each call after a
    little compute, the mean over the launches of the ranks: one here, for the suite's time, where a fit takes three),
    and the wait after a short and a long segment of compute. Bounds wide: a busy machine slows everything; the long
    segment's wait is not below the short one's by more than noise."""
    from lmledger.ledger.timing.steptime import calibrate
    from lmledger.ledger.timing.steptime.rankwait import rank_wait

    monkeypatch.setattr(calibrate, "_LAUNCHES", 1)
    cache = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2)
    calibrate.collective_model(2, cache)
    assert "in each of 1 launches" in cache.calibration(gloo_calibration(2))["method"]
    times = cache.calibration(gloo_calibration(2))["value"]["times"]
    assert [int(size) for size in times] == [4**k for k in range(6, 13)] and all(0 < t < 1 for t in times.values())
    assert times[str(16 * MB)] > times["4096"]  # 4,000 times the bytes
    assert rank_wait(2, cache, measure=False) is None
    value, how = rank_wait(2, cache)
    (short, long) = value["points"]  # [segment s, wait s] each
    assert how == "measured now" and 0 < short[0] < long[0] < 1 and 0 <= short[1] < 0.05 and 0 <= long[1] < 0.05
    assert rank_wait(2, StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2), False) is not None


def test_a_cache_holding_the_earlier_probes_points_measures_again(tmp_path):
    """The probe before 2026-12-05 took medians of back-to-back calls (one of gloo's two modes): its points, under
    their old name, are not read, so a fit with such a cache probes again rather than price along them."""
    cache = StepTimeCache(torch.device("cpu"), tmp_path / "step-times.json", ranks=2)
    cache.set_calibration("gloo_allreduce_w2", {"alpha_s": 1e-3, "bytes_per_s": 1e9, "times": TIMES}, "median of 9")
    assert gloo_seconds(_collective("c10d.allreduce_", MB), 2, cache) is None
    assert gloo_calibration(2) != "gloo_allreduce_w2"
