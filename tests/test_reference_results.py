"""Committed reference results stay what the code predicts: a prediction change must regenerate them.

experiments/results/batch_memory/ was once left behind by a change to the peak prediction; this recomputes
every predicted column of its results.csv with `account`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import run_json
from lmledger.sweep.collect import output_tags

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results" / "batch_memory" / "results.csv"
PREDICTED = ["run/tokens_per_step", "memory/predicted/activations", "memory/predicted/peak", "flops/hardware_per_step"]
GRID = ["data.batch_size", "model.config.context_length"]


def test_batch_memory_reference_matches_todays_predictions(workdir, capsys):
    rows = list(csv.DictReader(RESULTS.open()))
    assert len(rows) == 12 and all(row["status"] == "done" for row in rows)
    stale = []
    for row in rows:
        overrides = [arg for key in GRID for arg in (f"--{key}", row[key])]
        predicted = output_tags(run_json(capsys, "account", "--config", "configs/tiny.yaml", *overrides, "--json"))
        stale += [
            f"{row['point']} {col}: committed {row[col]}, predicted {predicted[col]}"
            for col in PREDICTED
            if int(row[col]) != predicted[col]
        ]
    assert not stale, "regenerate experiments/results/batch_memory (see docs/sweeps.md):\n" + "\n".join(stale)


def test_batch_memory_reference_measured_peak_is_within_2pct_of_the_prediction():
    rows = list(csv.DictReader(RESULTS.open()))
    ratios = [int(r["memory/measured/peak"]) / int(r["memory/predicted/peak"]) for r in rows]
    assert all(0.98 <= ratio <= 1.02 for ratio in ratios), ratios


@pytest.mark.parametrize("column", ["memory/measured/activations", "flops/measured_per_step"])
def test_batch_memory_reference_measured_equals_predicted(column):
    # The measured twins in the committed file are exact on the CPU (0.000%), as the README says.
    twin = column.replace("measured/", "predicted/").replace("measured_per_step", "hardware_per_step")
    rows = list(csv.DictReader(RESULTS.open()))
    assert [int(r[column]) for r in rows] == [int(r[twin]) for r in rows]
