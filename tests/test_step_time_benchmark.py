"""benchmarks/step_time.py --write: a day's second run goes atop the first, which stays as it was."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location("step_time_benchmark", REPO / "benchmarks" / "step_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_second_run_of_the_day_keeps_the_first_below_it(tmp_path):
    bench = _benchmark()
    rows = [{"case": "tiny", "predicted_ms": 96.0, "measured_ms": 98.8, "spread": (97.3, 100.5), "error_pct": -2.8,
             "load": (1.4, 1.8), "others_pct": 0, "wall_s": 58.0}]  # fmt: skip
    out = tmp_path / "results" / "step-time-2026-12-02.md"
    first = "run 1\n\n" + bench.table(rows)
    bench.write_result(first, out)
    assert out.read_text() == first + "\n"
    second = "run 2\n\n" + bench.table([{**rows[0], "predicted_ms": 111.5, "error_pct": 0.4}])
    bench.write_result(second, out)
    text = out.read_text()
    assert text.startswith(second + "\n\n") and text.endswith(first + "\n")  # newest first, the first untouched
    assert text.count("| tiny |") == 2 and "median |error| 2.8%, worst 2.8% (tiny)" in text
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp file left beside it
