"""`lmledger sweep`: experiment files checked up front, points run through the real CLI in their own
processes and run directories, results collected, finished points reused, failed ones redone."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from lmledger.cli import main as lmledger
from lmledger.errors import UserError
from lmledger.sweep import load_experiment, run_sweep

# One measured step of a ~30k-parameter model: the cheapest point the real CLI can run.
SMALL = {
    "model.config.d_model": 32,
    "model.config.n_layers": 1,
    "model.config.n_heads": 2,
    "model.config.d_ff": 64,
}


def write_experiment(path: Path, **spec) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sweep_error(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert lmledger(["sweep", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "spec, named",
    [
        ({"command": "fit", "configs": ["configs/tiny.yaml"], "grid": {"data.batch_size": [1]}, "grdi": {}}, "'grdi'"),
        ({"command": "fit", "configs": ["configs/tiny.yaml"], "grid": {}}, "grid is empty"),
        ({"command": "fit", "configs": ["configs/tiny.yaml"], "grid": [1, 2]}, "grid must be a mapping"),
        ({"command": "fit", "configs": ["configs/tiny.yaml"], "grid": {"data.batch_size": []}}, "'data.batch_size'"),
        (
            {"command": "train", "configs": ["configs/tiny.yaml"], "grid": {"data.batch_size": [1]}},
            "command: unknown command 'train'",
        ),
        ({"command": "fit", "configs": ["configs/nope.yaml"], "grid": {"data.batch_size": [1]}}, "configs/nope.yaml"),
        ({"command": "fit", "grid": {"data.batch_size": [1]}}, "configs is missing"),
        ({"command": "fit", "configs": ["configs/tiny.yaml"]}, "no points"),
        (
            {"command": "fit", "configs": ["configs/tiny.yaml"], "grid": {"--data.batch_size": [1]}},
            "without leading dashes",
        ),
        ({"command": "fit", "configs": ["configs/tiny.yaml"], "points": [{"a.b": 1}, {"a.b": 1}]}, "duplicate"),
    ],
)
def test_bad_experiment_files_are_one_line_errors(workdir, capsys, spec, named):
    path = write_experiment(workdir / "bad.yaml", **spec)
    assert named in sweep_error(capsys, str(path), "--dry-run")


def test_grid_points_ids_and_command_lines(workdir):
    (workdir / "fragment.yaml").write_text("trainer:\n  precision: bf16-true\n")
    path = write_experiment(
        workdir / "ids.yaml",
        command="account --measure",
        configs=["configs/tiny.yaml"],
        fixed={"data.batch_size": 2},
        grid={"trainer.precision": ["32-true", "bf16-true"], "model.config.context_length": [16, 32]},
        points=[
            {"config": "fragment.yaml", "model.config.n_layers": 1},
            {"command": "plan max-params", "gpu": "h100-sxm", "requires": "gpu"},
        ],
    )
    experiment = load_experiment(path)
    assert experiment.name == "ids"
    ids = [p.id for p in experiment.points]
    assert len(set(ids)) == 6
    assert ids[0].startswith("precision=32-true_context_length=16-")
    assert ids[4].startswith("config=fragment_n_layers=1-")
    assert [p.requires_gpu for p in experiment.points] == [False] * 5 + [True]
    from lmledger.sweep import cli_args

    args = cli_args(experiment.points[1], Path("out"))
    # configs first, then fixed, then the point's own overrides (later arguments win)
    assert args[:4] == ["account", "--measure", "--config", "configs/tiny.yaml"]
    assert args.index("--data.batch_size") < args.index("--model.config.context_length")
    assert args[-1] == "--json"
    # a `config` fragment is read after the base configs and before every override
    args = cli_args(experiment.points[4])
    assert args[2:6] == ["--config", "configs/tiny.yaml", "--config", "fragment.yaml"]
    assert args[6:8] == ["--data.batch_size", "2"]
    # a point with its own command takes neither the base configs nor the fixed overrides
    assert cli_args(experiment.points[5]) == ["plan", "max-params", "--gpu", "h100-sxm", "--json"]
    # editing `fixed` makes every point a new run (a resumed sweep never reuses a stale result)
    changed = write_experiment(
        workdir / "ids.yaml", **{**yaml.safe_load(path.read_text()), "fixed": {"data.batch_size": 3}}
    )
    new_ids = [p.id for p in load_experiment(changed).points]
    assert not set(ids[:5]) & set(new_ids) and new_ids[5] == ids[5]


def test_dry_run_predicts_and_runs_nothing(workdir, capsys):
    path = write_experiment(
        workdir / "dry.yaml",
        command="fit",
        configs=["configs/tiny.yaml"],
        fixed=SMALL,
        grid={"data.batch_size": [2, 8]},
        points=[{"model.config.no_such_field": 1}],
    )
    capsys.readouterr()
    assert lmledger(["sweep", str(path), "--dry-run", "--out", "sweeps/dry"]) == 2  # a point is bad
    captured = capsys.readouterr()
    out = captured.out
    assert captured.err.strip() == (
        "lmledger sweep: error: 1 of 3 points have bad arguments (marked fail above); fix them before running the sweep"
    )
    assert not (workdir / "sweeps").exists() and not (workdir / "runs").exists()
    from lmledger.accounting import account
    from lmledger.run_config import load_run

    for batch in (2, 8):
        args = ["--config", "configs/tiny.yaml", *[str(x) for kv in SMALL.items() for x in ("--" + kv[0], kv[1])]]
        expected = account(load_run([*args, "--data.batch_size", str(batch)]), False)
        assert f"{expected['flops']['model']:.4g}" in out
        assert f"{expected['memory']['peak']['predicted'] / 1e6:,.2f}" in out
    assert "fail:" in out and "no_such_field" in out  # the bad point is shown beside the good ones


def test_account_grid_results_and_resume(workdir):
    """A 2x2 grid of measured steps, two at a time; then a re-run reuses every point."""
    path = write_experiment(
        workdir / "acts.yaml",
        command="account --measure",
        configs=["configs/tiny.yaml"],
        fixed=SMALL,
        grid={"data.batch_size": [1, 3], "model.config.context_length": [16, 32]},
    )
    experiment = load_experiment(path)
    out = workdir / "sweeps" / "acts"
    results = run_sweep(experiment, out, jobs=2)
    assert [r.status for r in results] == ["done"] * 4, [r.error for r in results]

    rows = read_csv(out / "results.csv")
    assert [row["point"] for row in rows] == [p.id for p in experiment.points]
    for column in (
        "status",
        "data.batch_size",
        "model.config.context_length",
        "memory/predicted/activations",
        "memory/measured/activations",
        "memory/predicted/peak",
        "flops/measured_per_step",
        "seconds",
    ):
        assert column in rows[0], column
    acts = {
        (int(r["data.batch_size"]), int(r["model.config.context_length"])): float(r["memory/measured/activations"])
        for r in rows
    }
    for row in rows:  # the collected numbers are the account's, measured beside predicted
        assert abs(
            float(row["memory/predicted/activations"]) - float(row["memory/measured/activations"])
        ) <= 0.03 * float(row["memory/measured/activations"])
        peak = float(row["memory/measured/peak"])  # CPU: live tensor bytes (ledger.count.memtrack)
        assert abs(float(row["memory/predicted/peak"]) - peak) <= 0.02 * peak
    # activations grow with batch and with sequence length (3x the batch: about 3x the bytes)
    assert 2.5 < acts[(3, 16)] / acts[(1, 16)] < 3.1 and acts[(1, 32)] > 1.5 * acts[(1, 16)]
    table = (out / "results.md").read_text().splitlines()
    assert sum(line.startswith("| done |") for line in table) == 4
    for png in ("memory.png", "memory_vs_batch_size.png", "memory_vs_context_length.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    for point in experiment.points:
        status = json.loads((out / "points" / point.id / "status.json").read_text())
        assert status["status"] == "done" and status["argv"][:2] == ["account", "--measure"]

    logs = {p.id: (out / "points" / p.id / "stdout.log").stat().st_mtime_ns for p in experiment.points}
    again = run_sweep(load_experiment(path), out, jobs=2)
    assert all(r.reused for r in again)
    assert logs == {p.id: (out / "points" / p.id / "stdout.log").stat().st_mtime_ns for p in experiment.points}
    assert read_csv(out / "results.csv") == rows

    # the directory is this sweep's: another experiment may not write into it
    other = write_experiment(
        workdir / "other.yaml", command="account", configs=["configs/tiny.yaml"], grid={"data.batch_size": [1]}
    )
    with pytest.raises(UserError, match="holds the results of sweep 'acts'"):
        run_sweep(load_experiment(other), out)


def test_fit_sweep_collects_tensorboard_and_survives_a_bad_point(workdir, capsys):
    """Two fit points through the real CLI, one whose data directory does not exist (its arguments
    parse; the run fails): the good one's losses come from its own TensorBoard run; the bad one is
    failed with the CLI's error line; a re-run redoes only the failed point."""
    path = write_experiment(
        workdir / "train.yaml",
        command="fit",
        configs=["configs/tiny.yaml"],
        fixed={
            **SMALL,
            "model.config.context_length": 32,
            "data.batch_size": 4,
            "trainer.max_steps": 6,
            "trainer.val_check_interval": 6,
            "trainer.limit_val_batches": 2,
            "trainer.log_every_n_steps": 2,
        },
        grid={"data.path": ["data/stdlib", "data/nowhere"]},
    )
    capsys.readouterr()
    assert lmledger(["sweep", str(path), "--jobs", "2", "--out", "sweeps/train"]) == 1  # one point failed
    out = workdir / "sweeps" / "train"
    good, bad = load_experiment(path).points
    rows = {row["point"]: row for row in read_csv(out / "results.csv")}
    assert rows[good.id]["status"] == "done" and rows[bad.id]["status"] == "failed"
    assert "data/nowhere" in rows[bad.id]["error"] and rows[good.id]["error"] == ""
    # the losses are the last values this point's own run logged
    from conftest import read_scalars

    assert sorted(p.name for p in (out / "runs").iterdir()) == [good.id]
    scalars = read_scalars(out / "runs" / good.id / "version_0")
    assert float(rows[good.id]["train/loss"]) == pytest.approx(scalars["train/loss"][-1][1], rel=1e-6)
    assert float(rows[good.id]["val/loss"]) == pytest.approx(scalars["val/loss"][-1][1], rel=1e-6)
    assert 3.0 < float(rows[good.id]["val/loss"]) < 7.0
    # ledger tags: the median of perf/*, the last value of the rest; an empty cell when not logged
    import statistics

    assert "memory/measured/peak" in scalars  # measured on the CPU too
    tags = ("perf/tokens_per_sec", "perf/mfu", "memory/measured/activations", "memory/measured/peak")
    for tag in (*tags, "flops/hardware_per_step"):
        if tag not in scalars:
            assert rows[good.id][tag] == "", tag
            continue
        values = [v for _, v in scalars[tag]]
        expected = statistics.median(values) if tag.startswith("perf/") else values[-1]
        assert float(rows[good.id][tag]) == pytest.approx(expected, rel=1e-6), tag

    bad_log = out / "points" / bad.id / "stderr.log"
    bad_log.write_text("stale\n")
    assert lmledger(["sweep", str(path), "--out", "sweeps/train"]) == 1
    assert bad_log.read_text() != "stale\n"  # the failed point ran again ...
    assert [p.name for p in (out / "runs" / good.id).iterdir()] == ["version_0"]  # ... the finished one did not
