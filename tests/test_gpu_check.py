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
    variants = ("bf16-mixed+compile", "bf16-true+compile", "fp8-torchao+compile", "fp8-te")
    expected = [(variant, model) for variant in variants for model in ("cs336-medium", "cs336-small")]
    expected.append(("bf16-mixed+compile-whole-model", "cs336-medium"))
    # Most important first: cs336-medium (the MFU goal's config) before small, whole-model compile last.
    assert [(s["variant"], s["model"]) for s in stages] == expected
    # At toy size, with compile off, the bf16 rows are two distinct fits (bf16-mixed, bf16-true): each runs once
    # (in well under the time budget), and a stage that would repeat one names the stage that ran it.
    repeats = {
        ("bf16-mixed+compile", "cs336-small"): "cs336-medium bf16-mixed+compile",
        ("bf16-true+compile", "cs336-small"): "cs336-medium bf16-true+compile",
        ("bf16-mixed+compile-whole-model", "cs336-medium"): "cs336-medium bf16-mixed+compile",
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

    # The CUDA-only tests ran and, on the CPU, all skipped.
    tests = results["cuda_tests"]
    assert tests["exit"] == 0 and "skipped" in tests["summary"] and "passed" not in tests["summary"], tests

    table = (out / "gpu_check.md").read_text().strip()
    stage_rows = [line for line in table.splitlines() if line.startswith("| cs336-")]
    assert len(stage_rows) == len(stages)
    assert proc.stdout.rstrip().endswith(table)
