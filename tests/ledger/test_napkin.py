import json
import math
import random
import subprocess
import sys

import pytest

from conftest import run_json
from lmledger import cli
from lmledger.errors import UserError
from lmledger.ledger.closedform.napkin import (
    bytes_per_param,
    largest_within,
    max_batch,
    max_params,
    train_time,
    training_flops,
)


def test_lecture_train_time_on_h100():
    # CS336 lecture 2: 70e9 params, 15e12 tokens, 1024 H100 at MFU 0.5 -> 143.9 days. The lecture divides
    # 1979e12 / 2 = 989.5e12 where our table has the datasheet's 989.4e12: 143.92 vs 143.94 days, both
    # 143.9 to the lecture's precision, so that is the tolerance.
    plan = train_time(70e9, 15e12, "h100-sxm", num_gpus=1024, mfu=0.5)
    assert plan.total_flops == pytest.approx(6.3e24)
    assert round(plan.days, 1) == 143.9
    assert plan.hours == pytest.approx(plan.days * 24)


def test_lecture_train_time_on_a100_is_not_143_days():
    # docs/reference.md, "Napkin math": "1024 A100" for 143.9 days is wrong; A100s (312e12) take ~456 days.
    plan = train_time(70e9, 15e12, "NVIDIA A100-SXM4-80GB", num_gpus=1024, mfu=0.5)
    assert plan.days == pytest.approx(456, abs=1)


def test_lecture_max_params():
    # 8 H100 x 80e9 bytes / 16 bytes per param (AdamW, fp32) = 40e9; one GPU 5e9.
    eight = max_params("h100-sxm", num_gpus=8, precision="32-true", optimizer="adamw")
    assert eight.bytes_per_param == 16
    assert eight.max_params == 40_000_000_000
    assert max_params("h100-sxm").max_params == 5_000_000_000


@pytest.mark.parametrize(
    "precision,optimizer,expected",
    [
        ("32-true", "adamw", 16),  # 4 param + 4 grad + 4 m + 4 v
        ("bf16-mixed", "adamw", 16),  # autocast: fp32 params, grads, m, v
        ("16-mixed", "adamw", 16),
        ("bf16-true", "adamw", 8),  # 2 + 2 + 2 + 2
        ("16-true", "adamw", 8),
        ("transformer-engine", "adamw", 8),  # bf16 weights
        ("transformer-engine-float16", "adamw", 8),
        ("64-true", "adamw", 32),
        ("32-true", "sgd", 12),  # momentum: one fp32 state
        ("bf16-mixed", "sgd", 12),
        ("bf16-true", "sgd", 6),
        ("32-true", "none", 8),
        ("bf16-true", "none", 4),
    ],
)
def test_bytes_per_param(precision, optimizer, expected):
    assert bytes_per_param(precision, optimizer) == expected


def test_precision_changes_max_params_by_bytes_per_param():
    assert max_params("h200", 1, "bf16-true").max_params == 141e9 // 8
    assert max_params("h200", 1, "32-true", "none").max_params == 141e9 // 8


def test_train_time_scales_inversely_with_gpus_mfu_and_peak():
    base = train_time(1e9, 20e9, "h100-sxm", num_gpus=8, mfu=0.4)
    assert train_time(1e9, 20e9, "h100-sxm", num_gpus=16, mfu=0.4).days == pytest.approx(base.days / 2)
    assert train_time(1e9, 20e9, "h100-sxm", num_gpus=8, mfu=0.2).days == pytest.approx(base.days * 2)
    # Dense fp8 is twice dense bf16 on Hopper (1978.9 vs 989.4 TFLOP/s: the datasheet rounds each).
    fp8 = train_time(1e9, 20e9, "h100-sxm", num_gpus=8, mfu=0.4, dtype="fp8")
    assert fp8.days == pytest.approx(base.days / 2, rel=1e-3)
    # Doubling tokens doubles the FLOPs: 6 N D.
    assert training_flops(1e9, 40e9) == 2 * base.total_flops


def test_max_params_round_trips_into_train_time_through_the_cli(capsys):
    fit = run_json(capsys, "plan", "max-params", "--gpu", "h100-sxm", "--num-gpus", "8", "--json")
    assert set(fit) >= {"max_params", "bytes_per_param"}
    params = fit["max_params"]
    tokens = 20 * params  # Chinchilla's 20 tokens per parameter
    argv = ["plan", "train-time", "--params", str(params), "--tokens", str(tokens), "--gpu", "h100-sxm"]
    plan = run_json(capsys, *argv, "--num-gpus", "8", "--mfu", "0.5", "--json")
    assert set(plan) >= {"days", "total_flops"}
    # 6 * 40e9 * 800e9 FLOPs on 8 x 989.4e12 FLOP/s at MFU 0.5.
    assert plan["total_flops"] == pytest.approx(1.92e23)
    assert plan["days"] == pytest.approx(1.92e23 / (8 * 989.4e12 * 0.5) / 86400, rel=1e-12)  # ~561.5


def test_plan_prints_readable_tables(capsys):
    argv = ["plan", "train-time", "--params", "70B", "--tokens", "15T", "--gpu", "h100-sxm", "--num-gpus", "1024"]
    assert cli.main([*argv, "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "143.9" in out and "989.4" in out
    assert cli.main(["plan", "max-params", "--gpu", "NVIDIA H100 80GB HBM3", "--num-gpus", "8"]) == 0
    assert "40,000,000,000" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"params": -1}, "--params must be positive"),
        ({"tokens": 0}, "--tokens must be positive"),
        ({"mfu": 0}, r"--mfu must be in \(0, 1\]"),
        ({"mfu": 1.5}, r"--mfu must be in \(0, 1\]"),
        ({"num_gpus": 0}, "--num-gpus"),
        ({"num_gpus": 10**9}, "--num-gpus 1000000000 is beyond any cluster"),
        ({"params": math.inf}, "--params must be a finite number"),
        ({"tokens": math.nan}, "--tokens must be a finite number"),
        ({"params": 1e300}, "--params 1e[+]300 is absurdly large"),
        ({"mfu": math.nan}, r"--mfu must be in \(0, 1\]"),
        ({"mfu": 1e-300}, r"--mfu must be in \(0, 1\]"),
        ({"gpu": "h900"}, "unknown GPU 'h900'"),
        ({"gpu": "a100-80gb", "dtype": "fp8"}, "a100-80gb has no fp8 peak"),
        ({"dtype": "fp9"}, "unknown dtype"),
    ],
)
def test_train_time_rejects_bad_input(kwargs, match):
    args = {"params": 1e9, "tokens": 1e10, "gpu": "h100-sxm", "num_gpus": 1, "mfu": 0.5, **kwargs}
    with pytest.raises(UserError, match=match):
        train_time(**args)


def test_max_params_rejects_bad_input():
    with pytest.raises(UserError, match="unknown precision '8-true'"):
        max_params("h100-sxm", 1, "8-true")
    with pytest.raises(UserError, match="unknown optimizer 'lion'"):
        max_params("h100-sxm", 1, "32-true", "lion")
    with pytest.raises(UserError, match="ambiguous: matches h100-sxm, h100-pcie, h100-nvl"):
        max_params("NVIDIA H100", 1)  # the form factor decides the peak
    with pytest.raises(UserError, match="--num-gpus"):
        max_params("h100-sxm", 2.5)


@pytest.mark.parametrize(
    "argv",
    [
        ["train-time", "--params=-70e9", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "0.5"],
        ["train-time", "--params", "1e9", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "2"],
        ["max-params", "--gpu", "not-a-gpu"],
        ["max-params", "--gpu", "h100-sxm", "--precision", "fp4"],
        # 1e400 parses as inf, which printed "inf" and emitted JSON's non-standard Infinity.
        ["train-time", "--params", "1e400", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "0.5", "--json"],
        ["train-time", "--params", "1e9", "--tokens", "inf", "--gpu", "h100-sxm", "--mfu", "0.5", "--json"],
        ["train-time", "--params", "1e300", "--tokens", "1e300", "--gpu", "h100-sxm", "--mfu", "0.5", "--json"],
        ["train-time", "--params", "1e9", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "nan", "--json"],
        [
            "train-time",
            "--params",
            "1e9",
            "--tokens",
            "1e12",
            "--gpu",
            "h100-sxm",
            "--mfu",
            "0.5",
            "--num-gpus",
            "1e400",
        ],
        ["max-params", "--gpu", "h100-sxm", "--num-gpus", "99999999999"],
        ["max-params", "--gpu", "h100-sxm", "--num-gpus", "-3"],
        ["max-batch", "--config", "configs/tiny.yaml"],  # no memory to fit in
        ["max-batch", "--gpu", "h100-sxm", "--device-memory-gb", "80", "--config", "configs/tiny.yaml"],
        ["max-batch", "--device-memory-gb", "0", "--config", "configs/tiny.yaml"],
    ],
)
def test_plan_cli_bad_input_is_one_line_exit_2(argv, capsys):
    assert cli.main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("lmledger plan: error: ")


def _linear_bytes(base: int, per_sample: int, calls: list[int]):
    def bytes_for_batch(b: int) -> int:
        calls.append(b)
        return base + per_sample * b

    return bytes_for_batch


def test_max_batch_matches_brute_force_on_a_linear_cost():
    base, per_sample = 1000, 37
    for capacity in range(0, base + per_sample * 300, 13):
        expected = max((b for b in range(1, 301) if base + per_sample * b <= capacity), default=0)
        assert max_batch(_linear_bytes(base, per_sample, []), capacity) == expected, capacity


def test_max_batch_edge_cases():
    base, per_sample = 1000, 37
    assert max_batch(_linear_bytes(base, per_sample, []), base + per_sample - 1) == 0  # b = 1 does not fit
    assert max_batch(_linear_bytes(base, per_sample, []), base + per_sample) == 1  # b = 1 fits exactly
    assert max_batch(_linear_bytes(base, per_sample, []), base + per_sample * 64) == 64  # a power of two exactly
    assert max_batch(_linear_bytes(base, per_sample, []), base + per_sample * 65 - 1) == 64
    # Memory that never runs out stops at the limit instead of looping.
    assert max_batch(lambda b: 0, 10, limit=1000) == 1000


def test_max_batch_is_logarithmic_in_calls():
    calls = []
    capacity = 80 * 10**9
    answer = max_batch(_linear_bytes(10**9, 3 * 10**6, calls), capacity)
    assert answer == (capacity - 10**9) // (3 * 10**6)
    assert len(calls) <= 2 * math.ceil(math.log2(answer)) + 2


def test_a_nearly_linear_peak_is_found_in_a_handful_of_calls():
    # tiny.yaml's dry-run peaks (2026-12-02): the slope from b = 1 to 2 is 2% under the slope at b = 3,600, so a
    # search that trusts only that line starts 68 sizes off; bracketing from there by doubling took 16 dry runs.
    base, first, per_sample = 14_830_000, 6_765_056, 6_895_152
    capacity = 24_568_967_680

    def peak(b: int) -> int:
        return base + first * b if b <= 2 else base + first * 2 + per_sample * (b - 2) - 1_000_000

    calls = []
    found = largest_within(_counted(peak, calls), capacity, 10**7)
    expected = max(b for b in range(1, 4000) if peak(b) <= capacity)
    assert found == (expected, expected + 1)
    assert len(calls) <= 5, calls


def _shaped_cost(shape: str, base: int, k: int):
    """A nondecreasing cost of the batch size, as a peak might grow."""
    return {
        "linear": lambda b: base + k * b, "quadratic": lambda b: base + k * b * b,
        "square root": lambda b: base + int(1000 * k * math.sqrt(b)), "steps of 8": lambda b: base + k * -(-b // 8),
        "constant": lambda b: base, "wobbly": lambda b: base + k * b + int(0.4 * k * math.sin(b)),
    }[shape]  # fmt: skip


def _counted(cost, calls: list[int]):
    def counted(b: int) -> int:
        calls.append(b)
        return cost(b)

    return counted


@pytest.mark.parametrize("shape", ["linear", "quadratic", "square root", "steps of 8", "constant", "wobbly"])
def test_the_search_agrees_with_bisection_on_any_nondecreasing_cost(shape):
    rng = random.Random(shape)
    for _ in range(300):
        limit = rng.choice([1, 2, 9, 100, 4096, 10**7])
        cost = _shaped_cost(shape, rng.randint(0, 10**6), rng.randint(1, 10**4))
        capacity = rng.randint(0, int(cost(limit) * 1.2) + 1)
        low, high = 0, limit + 1  # bisection over the sizes: low fits (or is 0), high is over (or past limit)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if cost(middle) <= capacity else (low, middle)
        calls = []
        found = largest_within(_counted(cost, calls), capacity, limit)
        assert found == (low, high if high <= limit else None), (limit, capacity)
        assert len(calls) == len(set(calls))  # each size asked once
        assert len(calls) <= 4 * math.log2(limit + 1) + 4, (limit, capacity, calls)


def test_plan_json_is_standard_json_at_the_limits(capsys):
    # The largest counts accepted still give finite figures, so --json never emits Infinity or NaN.
    argv = ["plan", "train-time", "--params", "1e24", "--tokens", "1e24", "--gpu", "t4", "--dtype", "fp16"]
    result = run_json(capsys, *argv, "--mfu", "1e-6", "--json")
    assert math.isfinite(result["days"]) and result["total_flops"] == pytest.approx(6e48)


def test_reading_a_fit_config_prints_no_seed_line():
    # LightningCLI seeds while parsing and logs "Seed set to 1234"; nothing runs here. account reads its
    # config through the same run_config.load_run, so one subprocess covers both commands.
    argv = ["plan", "max-batch", "--gpu", "h100-sxm", "--config", "configs/tiny.yaml", "--json"]
    proc = subprocess.run([sys.executable, "-m", "lmledger.cli", *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Seed set" not in proc.stderr + proc.stdout
    assert json.loads(proc.stdout)["max_batch"] > 0


def test_the_three_largest_batch_callers_are_the_one_search():
    """Issue 33 §2: max_batch, dryrun.largest_batch and sharded.largest_batch_sharded all answer as
    largest_within does, and as a brute force over every size does, on a tiny model's dry-run peaks."""
    import torch
    from torch import nn

    from lmledger.ledger.dryrun.engine import dry_run, largest_batch
    from lmledger.ledger.sharding.sharded import largest_batch_sharded, predict_sharded

    class Mlp(nn.Linear):
        def forward(self, x):
            return super().forward(x).square().mean()

    model, limit = Mlp(32, 32), 9

    def batch_for(size: int) -> torch.Tensor:
        return torch.empty(size, 32, device="meta")

    single = {b: dry_run(model, batch_for(b), device="cpu").peak for b in range(1, limit + 1)}
    ddp = {b: predict_sharded(model, batch_for(b), strategy="ddp", world_size=2).peak for b in range(1, limit + 1)}
    assert all(single[b] < single[b + 1] for b in range(1, limit)) and ddp[1] > single[1]  # buckets
    for peaks, search in (
        (single, lambda cap: largest_batch(model, batch_for, cap, device="cpu", limit=limit)),
        (ddp, lambda cap: largest_batch_sharded(model, batch_for, cap, limit=limit, strategy="ddp", world_size=2)),
    ):
        for capacity in (peaks[1] - 1, peaks[1], (peaks[4] + peaks[5]) // 2, peaks[limit]):
            expected = max((b for b in peaks if peaks[b] <= capacity), default=0)
            found = search(capacity)
            assert found.size == expected == max_batch(peaks.__getitem__, capacity, limit=limit), capacity
            over = expected + 1 if expected < limit else None
            assert largest_within(peaks.__getitem__, capacity, limit) == (expected, over)
            assert (found.fits.peak if expected else 0) <= capacity
            assert found.over is None if expected == limit else found.over.peak > capacity
