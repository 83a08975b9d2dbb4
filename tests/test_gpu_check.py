"""benchmarks/gpu_check.sh --dry-run: every stage of the GPU check at toy size on the CPU, end to end.

The script cd's to the checkout and reads the cs336 configs from there; the dry run prepares its own byte-level
corpus under OUT. So it is run here from an empty directory: a pass shows it needs nothing from the working
directory (no configs/, no data/), and the directory must still be empty afterwards.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Alone: its stages run against time budgets. Inside a pytest-xdist worker its first fit stalled on 2026-12-03
# (11:17 in the full suite, 15:03 with `-n 1`): py-spy showed the DataLoader's main loop waiting on its data
# queue and both workers on their index queues, every queue feeder idle. From 16:15 it passed seven runs in seven
# with `-n 1` (with CI's PATH shims too, and beside two busy loops) and one with `-n 2`; the cause is not found.
pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[1]


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dry_run_measures_every_stage_or_says_why_not(tmp_path):
    cwd, out, tmp = tmp_path / "elsewhere", tmp_path / "out", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    # TMPDIR: where the script installs wheels from .whl/, kept inside this test's directory.
    # PYTHON: the interpreter running the tests, never whatever `python3` is first on PATH.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert list(cwd.iterdir()) == []
    assert (out / "data-bytes" / "meta.json").is_file()

    results = json.loads((out / "gpu_check.json").read_text())
    assert results["dry_run"] is True

    matmul = {row["dtype"]: row for row in results["matmul"]["results"]}
    assert {"fp32", "bf16"} <= set(matmul)
    for dtype in ("fp32", "bf16"):
        assert _finite_positive(matmul[dtype]["flops_per_s"]), matmul[dtype]

    stages = results["stages"]
    # Most important first: the MFU goal's row (cs336-medium, compiled), the eager row the GPU models predict, fp8,
    # then the small model and the other variants, whole-model compile last.
    expected = [("bf16-mixed+compile", "cs336-medium"), ("bf16-mixed", "cs336-medium"),
                ("fp8-torchao+compile", "cs336-medium"), ("fp8-te", "cs336-medium"), ("bf16-mixed", "cs336-small"),
                ("bf16-mixed+compile", "cs336-small"), ("bf16-true+compile", "cs336-medium"),
                ("bf16-mixed+compile-whole-model", "cs336-medium")]  # fmt: skip
    assert [(s["variant"], s["model"]) for s in stages] == expected
    # At toy size, with compile off, the bf16 rows are two distinct fits (bf16-mixed, bf16-true): each runs once
    # (in well under the time budget), and a stage that would repeat one names the stage that ran it.
    first = "cs336-medium bf16-mixed+compile"
    repeats = {
        ("bf16-mixed", "cs336-medium"): first,
        ("bf16-mixed", "cs336-small"): first,
        ("bf16-mixed+compile", "cs336-small"): first,
        ("bf16-mixed+compile-whole-model", "cs336-medium"): first,
    }
    ran = 0
    for stage in stages:
        assert "error" not in stage, stage
        if stage["variant"].startswith("fp8"):
            assert "GPU" in stage["skipped"], stage
            continue
        first = repeats.get((stage["variant"], stage["model"]))
        if first is not None:
            assert stage["skipped"] == f"dry run: the same toy fit as {first}", stage
            continue
        assert "skipped" not in stage, stage
        ran += 1
        for key in ("tokens_per_sec", "mfu", "hfu", "peak_predicted"):
            assert _finite_positive(stage.get(key)), (key, stage)
    assert ran == 2

    # The op measurements (gpu_ops.py): every part ran and timed something, and the toy step's ops were replayed
    # in sequence, nearly all of them, summing to a positive time in each compute category.
    assert results["ops"]["exit"] == 0, results["ops"]
    ops = json.loads((out / results["ops"]["file"]).read_text())
    for part in ("gemm", "sdpa", "memory", "optimizer"):
        timed = [row for row in ops[part] if "seconds" in row or "forward_s" in row]
        assert timed and all(_finite_positive(r.get("seconds", r.get("forward_s"))) for r in timed), (part, ops[part])
    assert _finite_positive(ops["launch"]["host_enqueue_s_per_op"]) and _finite_positive(ops["launch"]["tiny_kernel_s"])
    step = ops["step cs336-medium"]
    assert "step cs336-small" not in ops  # the toy twin of the first: not run again
    seconds = step["replay"]["seconds"]
    replayed = [t for t in seconds if t is not None]
    assert len(step["ops"]) == len(seconds) and len(replayed) >= 0.9 * len(seconds), step["replay"]
    for category in ("matmul", "attention", "other"):
        times = [t for op, t in zip(step["ops"], seconds, strict=True) if op["category"] == category and t]
        assert times and sum(times) > 0, category
    assert _finite_positive(step["measured"]["step_s"]) and step["profile"], step["measured"]
    # The GPU op model's step of the same dry run (an H200's on the CPU), its categories summing to it
    for framework in ("pytorch", "compile"):
        priced = step["gpu_model"][framework]
        assert _finite_positive(priced["total_s"]) and sum(priced["seconds"].values()) == pytest.approx(
            priced["total_s"]
        )
    # torch's estimator needs CUDA: on the CPU it aborts, in a process of its own, and each mode says so.
    assert set(step["runtime_estimator"]) == {"operator-level-cost-model", "operator-level-benchmark"}

    # The CUDA-only tests ran and, on the CPU, all skipped.
    tests = results["cuda_tests"]
    assert tests["exit"] == 0 and "skipped" in tests["summary"] and "passed" not in tests["summary"], tests

    table = (out / "gpu_check.md").read_text().strip()
    stage_rows = [line for line in table.splitlines() if line.startswith("| cs336-")]
    assert len(stage_rows) == len(stages)
    assert proc.stdout.rstrip().endswith(table)
