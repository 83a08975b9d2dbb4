"""Sweeps across nodes and ranks (issue 31 §1, §4): `lmledger sweep --launcher slurm` queues a point that asks
for 2 nodes as its own array (`--nodes 2 --ntasks-per-node D`, srun a task a rank), after holding its per-rank
peak at that shape (world size nodes x devices, the per-rank dry run `account` gives) against the request; the
results table shows rank 0's ledger lines by default and the worst rank's with `ranks: worst`, naming the rank.

The batch scripts and the fit check need no SLURM: a stand-in `sbatch` keeps each script it is given. The rank
records come from a real 2-rank DDP point (gloo, on this CPU). One test runs a 2-point sweep on the 2-node test
cluster (tests/conftest.py `slurm_two_nodes`) and skips in one line without it."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmledger.cli import main as lmledger
from lmledger.ledger.units import format_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

TESTS = Path(__file__).resolve().parents[1]
# A model whose FSDP2 state (3.4M parameters, 54 MB with AdamW) moves one rank's peak by tens of MB when sharded 2
# ways: only predicted here, on fake tensors, never trained. Each per-rank prediction is two dry runs (account's
# checkpointing off and on) that cost about a layer's ops each, so one wide layer, and as few as the tests can.
SHARDED = {"model.config.d_model": 512, "model.config.n_layers": 1, "model.config.n_heads": 4,
           "model.config.d_ff": 2048, "data.batch_size": 2, "trainer.strategy": "fsdp2",
           "trainer.max_steps": 2}  # fmt: skip
MICRO = {"model.config.d_model": 32, "model.config.n_layers": 1, "model.config.n_heads": 2, "model.config.d_ff": 64,
         "model.config.context_length": 32, "data.batch_size": 4, "trainer.limit_val_batches": 0,
         "trainer.log_every_n_steps": 1, "trainer.enable_model_summary": False}  # fmt: skip
MIB = 1 << 20

FAKE_SBATCH = """#!/bin/bash
# Test stand-in for sbatch: keeps each script it is given as submitted-<job>.sh and prints a new job id.
n=$(ls "$FAKE_SLURM" | grep -c '^submitted-')
job=$((4242 + n))
cp -- "${@: -1}" "$FAKE_SLURM/submitted-$job.sh"
echo $job
"""


@pytest.fixture
def fake_slurm(tmp_path_factory, monkeypatch) -> Path:
    """sbatch and squeue stand-ins first on PATH (squeue lists nothing); returns where sbatch keeps the scripts."""
    kept = tmp_path_factory.mktemp("fake-slurm")
    (kept / "bin").mkdir()
    (kept / "bin" / "sbatch").write_text(FAKE_SBATCH)
    (kept / "bin" / "squeue").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("sbatch", "squeue"):
        (kept / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{kept / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(kept))
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    return kept


def write_experiment(path: Path, fixed: dict, points: list[dict], **more) -> Path:
    doc = {"name": path.stem, "command": "fit", "configs": ["configs/tiny.yaml"], "fixed": fixed, "points": points,
           **more}  # fmt: skip
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def shape(nodes: int, devices: int) -> dict:
    return {"trainer.num_nodes": nodes, "trainer.devices": devices}


@functools.cache
def per_rank_peak(nodes: int, devices: int) -> int:
    """What `lmledger account --json` predicts as one rank's peak of the SHARDED point at this shape."""
    from lmledger.sweep.spec import format_value

    args = ["account", "--config", "configs/tiny.yaml"]
    for key, value in {**SHARDED, **shape(nodes, devices)}.items():
        args += [f"--{key}", format_value(value)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert lmledger([*args, "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["run"]["world_size"] == nodes * devices
    return result["memory"]["peak"]["predicted"]


def need(peak: float) -> int:
    """A rank's --mem need for a predicted peak (sweep/slurmfit.py: +25% and 2 GiB for the process)."""
    return math.ceil(peak * 1.25) + (2 << 30)


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def sweep(capsys, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = lmledger(["sweep", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]


def test_a_two_node_point_is_its_own_array_sized_by_its_per_rank_peak(workdir, capsys, fake_slurm):
    """An FSDP2 point on 2 nodes x 1 rank and a one-rank point: two arrays. The one-node point runs one task, as
    before; the 2-node one asks --nodes 2 --ntasks-per-node 1 and sruns its task. Each --mem is the need at the
    per-rank peak `account` predicts at the point's world size: for the 2-node point the FSDP2 shard's."""
    single = {"trainer.strategy": "auto", **shape(1, 1)}
    spec = write_experiment(workdir / "shapes.yaml", SHARDED, [shape(2, 1), single])
    code, _ = sweep(capsys, str(spec), "--launcher", "slurm", "--out", "o")
    assert code == 1  # the stand-in runs nothing: each task "ended without a result"
    scripts = [p.read_text() for p in sorted(fake_slurm.glob("submitted-*.sh"))]
    assert len(scripts) == 2, scripts
    (two,) = [s for s in scripts if "#SBATCH --nodes=2" in s]
    (one,) = [s for s in scripts if s is not two]
    lines = directives(two)
    assert {"--array=0-0", "--nodes=2", "--ntasks-per-node=1"} <= set(lines), lines
    assert f"--mem={math.ceil(need(per_rank_peak(2, 1)) / MIB)}M" in lines, lines
    assert need(per_rank_peak(2, 1)) < need(per_rank_peak(1, 1))  # sharded 2 ways: less than the one-rank peak
    (run,) = [line for line in two.splitlines() if line.startswith("exec ")]
    assert run.startswith("exec srun --kill-on-bad-exit=1 ") and " slurm-task " in run, run
    lines = directives(one)
    assert "--array=0-0" in lines and not [d for d in lines if d.startswith(("--nodes", "--ntasks"))], lines
    (run,) = [line for line in one.splitlines() if line.startswith("exec ")]
    assert " srun " not in run and " slurm-task " in run, run


def test_a_point_is_held_to_mem_at_its_shape(workdir, capsys, fake_slurm):
    """--mem between one rank's need sharded 2 ways and unsharded: the FSDP2 point on 2 nodes passes (it is checked
    first); the same point with 2 ranks on one node is refused (--mem is per node: the ranks share it), in one line
    naming the point, its per-rank peak as `account` predicts it, the node's need and --mem; nothing is queued."""
    two, one = per_rank_peak(2, 1), per_rank_peak(1, 1)
    mem_mib = (need(two) + need(one)) // 2 // MIB
    assert need(two) < mem_mib * MIB < need(one) and 2 * need(two) > mem_mib * MIB
    refused = write_experiment(workdir / "refused.yaml", SHARDED, [shape(2, 1), shape(1, 2)])
    code, said = sweep(capsys, str(refused), "--launcher", "slurm", "--out", "r", "--mem", f"{mem_mib}M")
    assert code == 2 and len(said) == 1 and not list(fake_slurm.glob("submitted-*.sh")), said
    point = re.search(r"point (\S+):", said[0]).group(1)
    assert point.startswith("num_nodes=1_devices=2-"), said
    assert f"predicted peak {format_bytes(two)} per rank (1 node x 2 ranks)" in said[0], said
    assert f"x 2 ranks a node: {2 * need(two) / 1e9:,.2f} GB) does not fit --mem {mem_mib}M" in said[0], said
    assert "nothing was queued" in said[0]
    assert not (workdir / "r").exists()


def results(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {row["point"]: row for row in csv.DictReader(f)}


def test_the_table_shows_rank_0_by_default_and_the_worst_rank_on_request(workdir, capsys):
    """A local sweep of a 2-rank DDP point (gloo). By default its row is rank 0's, as TensorBoard has it, and says
    so (rank 0, 2 rank records read). With `ranks: worst` the
    same finished sweep (nothing runs again) shows the rank with the largest measured peak, its lines from its
    record; a record whose peak is larger moves the row to that rank."""
    from lmledger.callbacks.ranks import read_rank_records
    from lmledger.sweep.collect import rank_tags

    fixed = {**MICRO, "trainer.max_steps": 3, "trainer.accelerator": "cpu"}
    points = [{"trainer.devices": 2, "trainer.strategy": "ddp"}]
    spec = write_experiment(workdir / "ranks.yaml", fixed, points)
    assert lmledger(["sweep", str(spec), "--out", "o"]) == 0
    table = results(workdir / "o" / "results.csv")
    (ddp,) = table
    run = workdir / "o" / "runs" / ddp / "version_0"
    records = read_rank_records(run)
    assert sorted(records) == [0, 1]
    tags = {r: rank_tags(record)[0] for r, record in records.items()}
    row = table[ddp]
    assert (row["rank"], row["ranks"]) == ("0", "2")
    for kind in ("predicted", "measured"):
        assert float(row[f"memory/{kind}/peak"]) == pytest.approx(tags[0][f"memory/{kind}/peak"], rel=1e-6)

    def worst_row() -> dict[str, str]:
        write_experiment(spec, fixed, points, ranks="worst")
        assert lmledger(["sweep", str(spec), "--out", "o"]) == 0  # both done: the table is written again
        return results(workdir / "o" / "results.csv")[ddp]

    peaks = {r: t["memory/measured/peak"] for r, t in tags.items()}
    expected = max(peaks, key=lambda r: (peaks[r], -r))
    row = worst_row()
    assert (row["rank"], row["ranks"]) == (str(expected), "2"), (row, peaks)
    for kind in ("predicted", "measured"):
        assert float(row[f"memory/{kind}/peak"]) == pytest.approx(tags[expected][f"memory/{kind}/peak"], rel=1e-6)
    # Rank 1 peaked higher (its record says so): the row is rank 1's, and the markdown table names it.
    path = run / "ranks" / "rank1.json"
    record = json.loads(path.read_text())
    higher = 2 * max(peaks.values())
    record["memory"]["peak"]["measured"] = higher
    path.write_text(json.dumps(record))
    row = worst_row()
    assert row["rank"] == "1" and float(row["memory/measured/peak"]) == higher
    assert float(row["memory/predicted/peak"]) == pytest.approx(tags[1]["memory/predicted/peak"], rel=1e-6)
    markdown = (workdir / "o" / "results.md").read_text()
    header = [c.strip() for c in markdown.splitlines()[2].strip("|").split("|")]
    assert "rank" in header and "ranks" in header, markdown


def test_a_bad_ranks_value_is_one_line(workdir, capsys):
    spec = write_experiment(workdir / "bad.yaml", MICRO, [{"trainer.devices": 1}], ranks="max")
    code, said = sweep(capsys, str(spec), "--dry-run")
    assert code == 2 and said == [f"lmledger sweep: error: {spec}: ranks must be rank0 or worst (whose ledger lines "
                                  "the table shows), got 'max'"], said  # fmt: skip


def test_the_local_launcher_refuses_a_two_node_point_before_anything_runs(workdir, capsys):
    """Node 0 alone would wait at the rendezvous for a node never started: one line, nothing run or written."""
    spec = write_experiment(workdir / "local.yaml", MICRO, [{"trainer.devices": 1}, shape(2, 1)])
    code, said = sweep(capsys, str(spec), "--out", "o")
    assert code == 2 and len(said) == 1, said
    line = (r"lmledger sweep: error: point num_nodes=2_devices=1-\w+ asks for 2 nodes \(trainer\.num_nodes\), and the "
            r"local launcher runs each point on this machine alone: use --launcher slurm, which queues it on that many "
            r"nodes; nothing was run")  # fmt: skip
    assert re.fullmatch(line, said[0]), said
    assert not (workdir / "o").exists()


def test_a_sweep_with_a_two_node_point_runs_both_points_under_slurm(workdir, slurm_two_nodes):
    """On the 2-node test cluster: a 1-rank point and a 2-node DDP point (1 rank a node, gloo), 6 steps each.
    Both run and complete; the 2-node point ran as --nodes 2 with a rank on each node, its rank records exist
    for both ranks, rank 1's output has its own log, and the table names the worst rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    fixed = {**MICRO, "trainer.max_steps": 6, "trainer.accelerator": "cpu", "ledger.warmup_steps": 1}
    points = [{"trainer.num_nodes": 1, "trainer.devices": 1},
              {"trainer.num_nodes": 2, "trainer.devices": 1, "trainer.strategy": "ddp"}]  # fmt: skip
    spec = write_experiment(workdir / "nodes.yaml", fixed, points, ranks="worst")
    command = [sys.executable, "-m", "lmledger.cli", "sweep", str(spec), "--launcher", "slurm", "--out", "o",
               "--cpus-per-task", "1"]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=420)
    finally:
        subprocess.run(["scancel", "--name=lmledger-nodes"], capture_output=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"submitted 1 point\(s\) as SLURM job array \d+", done.stdout)) == 2, done.stdout
    table = results(workdir / "o" / "results.csv")
    assert all(row["status"] == "done" for row in table.values()), table
    two = next(pid for pid in table if pid.startswith("num_nodes=2"))
    from lmledger.callbacks.ranks import read_rank_records

    records = read_rank_records(workdir / "o" / "runs" / two / "version_0")
    assert sorted(records) == [0, 1] and sorted(r["node"] for r in records.values()) == [0, 1]
    assert all(r["step"] == 6 and r["num_nodes"] == 2 for r in records.values())
    assert table[two]["ranks"] == "2" and table[two]["rank"] in ("0", "1")
    one = next(pid for pid in table if pid != two)
    assert (table[one]["rank"], table[one]["ranks"]) == ("", "")  # a one-rank point has no rank to name
    assert (workdir / "o" / "points" / two / "rank1.stdout.log").is_file()
    status = json.loads((workdir / "o" / "points" / two / "status.json").read_text())
    assert status["status"] == "done" and status["restart"] == 0
    scripts = [p.read_text() for p in (workdir / "o" / "slurm").glob("array-*.sh")]
    assert sum("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in s for s in scripts) == 1, scripts
