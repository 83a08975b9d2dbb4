"""Issue 49 §1: the environment a fit meets on a cluster.

A launcher's variables outlive it (a shell inside a torchrun job, an `salloc` step, a notebook kernel), and
`WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 lmledger fit` trained on one device as rank 0 under a logger that took it for
rank 1: exit 0 and no curves. Strategy x environment, by construction: each variable Lightning reads, alone and in
every combination, with a value that disagrees with the trainer's devices and nodes, is refused by the one check
(fitting.clusterenv); the launches that agree (torchrun's, srun's, Lightning's own children's, a plain sbatch
step's) pass it. fit, validate and account --measure refuse in one line, exit 2, nothing written: in-process, and
the issue's own case through the real CLI (test_bad_values' subprocess batch), where Lightning's rank-zero switch
reads the variables at import.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from conftest import MICRO_OVERRIDES
from lmledger.cli import main as lmledger
from lmledger.fitting.clusterenv import LAUNCH_VARIABLES, launch_disagreements

pytestmark = pytest.mark.usefixtures("one_thread")

# Trainer shapes: (devices, nodes, the fit arguments that ask for them).
SHAPES = {
    "one device": (1, 1, []),
    "ddp 2 devices": (2, 1, ["--trainer.devices", "2", "--trainer.strategy", "ddp"]),
    "ddp 2 nodes": (1, 2, ["--trainer.num_nodes", "2", "--trainer.strategy", "ddp"]),
    "fsdp2 2 devices": (2, 1, ["--trainer.devices", "2", "--trainer.strategy", "fsdp2"]),
}
# The names: each, with a value that disagrees with a trainer of `devices` x `nodes`.
NAMED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def disagreeing(name: str, devices: int, nodes: int) -> str:
    world = devices * nodes
    beyond = {"RANK": world, "SLURM_PROCID": world, "LOCAL_RANK": devices, "NODE_RANK": nodes, "GROUP_RANK": nodes}
    return str(beyond[name] if name in beyond else {"LOCAL_WORLD_SIZE": devices}.get(name, world) + 1)


def agreeing_launches(devices: int, nodes: int) -> list[dict[str, str]]:
    """Every process of each launcher's start of this shape, as its environment reads."""
    world, out = devices * nodes, []
    for rank in range(world):
        node, local = divmod(rank, devices)
        out.append({"TORCHELASTIC_RUN_ID": "j", "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
                    "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(devices)})  # torchrun  # fmt: skip
        out.append({"SLURM_NTASKS": str(world), "SLURM_PROCID": str(rank), "SLURM_JOB_NAME": "job"})  # srun
        # Lightning's own launcher: its children (rank 0 has none of these), under a plain sbatch step or not
        children = {"LOCAL_RANK": str(local), "NODE_RANK": str(node), "WORLD_SIZE": str(world)} if local else {}
        out += [children, {**children, "SLURM_PROCID": "0"}] if node == 0 else [{"NODE_RANK": str(node), **children}]
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_combination_that_disagrees_is_named_and_every_launch_that_agrees_passes(shape):
    devices, nodes, _ = SHAPES[shape]
    for size in range(1, len(NAMED) + 1):
        for names in itertools.combinations(NAMED, size):
            env = {name: disagreeing(name, devices, nodes) for name in names}
            said = " ".join(launch_disagreements(devices, nodes, env))
            assert all(f"{name}={env[name]}" in said for name in names), (env, said)
    for name in LAUNCH_VARIABLES:  # the rest torchrun sets, and a value no launcher gives
        assert launch_disagreements(devices, nodes, {name: disagreeing(name, devices, nodes)}), name
        assert launch_disagreements(devices, nodes, {name: "abc"}) == [f"{name}='abc' is not a whole number"]
    for env in agreeing_launches(devices, nodes):
        assert launch_disagreements(devices, nodes, env) == [], env
    # In range, yet not the rank the trainer gives: under Lightning's own environment the ranks come from
    # NODE_RANK and LOCAL_RANK, and a RANK beside them is what its logger believes.
    if devices * nodes > 1:
        (said,) = launch_disagreements(devices, nodes, {"RANK": "1"})
        assert said == "RANK=1 makes Lightning log as rank 1 a process the trainer runs as rank 0, so nothing would " \
            "be logged"  # fmt: skip
    assert launch_disagreements(devices, nodes, {"SLURM_NTASKS": "99", "SLURM_JOB_NAME": "interactive"}) == []


def test_devices_auto_on_a_gpu_counts_this_machines_gpus(monkeypatch):
    """`--trainer.devices auto` on a GPU is every GPU here to Lightning (planning reads it as 1): torchrun's
    8 workers on an 8-GPU node agree with it, and a stray RANK still does not."""
    from types import SimpleNamespace

    import torch

    from lmledger.fitting.trainerscale import resolve_strategy

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    scale = resolve_strategy(SimpleNamespace(accelerator="gpu", devices="auto", num_nodes=1, strategy="ddp"))
    assert (scale.devices, scale.devices_here()) == (1, 8)
    torchrun = {"TORCHELASTIC_RUN_ID": "j", "RANK": "5", "LOCAL_RANK": "5", "GROUP_RANK": "0", "WORLD_SIZE": "8",
                "LOCAL_WORLD_SIZE": "8"}  # fmt: skip
    assert launch_disagreements(scale.devices_here(), 1, torchrun) == []
    assert launch_disagreements(scale.devices_here(), 1, {**torchrun, "WORLD_SIZE": "16"})
    cpu = resolve_strategy(SimpleNamespace(accelerator="cpu", devices="auto", num_nodes=1, strategy="ddp"))
    assert cpu.devices_here() == 1  # Lightning's auto on a CPU: one process


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stdlib_data):
    """A working directory with one short run's checkpoint, for validate."""
    root = tmp_path_factory.mktemp("cluster-env")
    (root / "data").mkdir()
    (root / "data" / "stdlib").symlink_to(stdlib_data)
    (root / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert lmledger(["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", "1"]) == 0
        yield root


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_symlink())


SEED_LINE = re.compile(r"^(\[rank: \d+\] )?Seed set to \d+$")
COMMANDS = {
    "fit": ["fit", "--trainer.max_steps", "1"],
    "validate": ["validate", "--ckpt_path", "runs/tiny/version_0/checkpoints/last.ckpt"],
    "account --measure": ["account", "--measure"],
}
LEFTOVERS = [{name: disagreeing(name, 1, 1)} for name in LAUNCH_VARIABLES] + [
    {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"},  # the issue's
]
TORCHRUN_2X2 = {"TORCHELASTIC_RUN_ID": "j", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
# Every command with every leftover on one device; fit with a 2 x 2 torchrun's leftovers under each other shape.
CASES = [(env, "one device", command) for env in LEFTOVERS for command in COMMANDS]
CASES += [(TORCHRUN_2X2, shape, "fit") for shape in SHAPES if shape != "one device"]


@pytest.mark.parametrize(("env", "shape", "command"), CASES, ids=[f"{c} {' '.join(e)} {s}" for e, s, c in CASES])
def test_fit_validate_and_account_measure_refuse_a_stray_launcher_in_one_line(
    trained, capsys, monkeypatch, restored_environ, env, shape, command
):
    for name in (*LAUNCH_VARIABLES, "TORCHELASTIC_RUN_ID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    words = COMMANDS[command]
    before = _files(trained)
    capsys.readouterr()
    assert lmledger([*words[:1], "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *SHAPES[shape][2], *words[1:]]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not SEED_LINE.match(line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"lmledger {words[0]}: error: this process's launcher variables disagree with "), lines
    named = [name for name in LAUNCH_VARIABLES if name in env]
    assert all(f"{name}={env[name]}" in lines[0] for name in named if launch_disagreements(
        *SHAPES[shape][:2], {name: env[name]})), lines  # fmt: skip
    assert f"`unset {' '.join(named)}`" in lines[0]
    assert _files(trained) == before
