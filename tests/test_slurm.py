"""Under a real SLURM (scripts/slurm-local.sh, one node on localhost; the tests skip in one line without it):
a batch job stopped twice (SLURM's warning signal, `scontrol requeue`) requeues and continues its own run bit
for bit; `srun --ntasks 2` trains DDP over gloo with the ledger per rank, and a SIGTERM to one rank stops both
at the same step; a sweep as a job array, one of its tasks preempted and requeued, gives the local launcher's
table; a point that cannot fit --mem or the GPU of --gres is refused before sbatch."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml
from test_preemption import curves
from test_resume import TAGS

from conftest import MICRO_OVERRIDES, read_scalars
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger
from lmledger.rundir import SLURM_JOB_FILE

pytestmark = pytest.mark.usefixtures("one_thread")

TESTS = Path(__file__).resolve().parent
STEPS = 12


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def fit_args(name: str, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", str(STEPS),
            "--trainer.callbacks.init_args.every_n_train_steps", "2", "--trainer.logger.init_args.name", name,
            *extra]  # fmt: skip


def squeue_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    return out.splitlines()[0] if out else ""


def wait_for(condition, what: str, timeout: float = 120.0, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"; log:\n{log.read_text()[-3000:]}" if log else ""))


def release(job: str) -> None:
    """A requeued job waits ~2 minutes (its BeginTime); let it start now."""
    wait_for(lambda: squeue_state(job) == "PENDING", f"job {job} pending again")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, capture_output=True)


def checkpoint_step(path: Path) -> int:
    try:
        return int(open_checkpoint(path)["global_step"])
    except Exception:
        return -1


def slurm_texts(run: Path) -> dict[int, str]:
    """The `slurm` TensorBoard text entries of every event file in a run directory: {step: text}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = {}
    for path in run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for event in acc.Tensors("slurm/text_summary") if "slurm/text_summary" in acc.Tags()["tensors"] else []:
            texts[event.step] = event.tensor_proto.string_val[0].decode()
    return texts


def test_a_batch_job_requeued_twice_continues_its_run_bit_for_bit(workdir, slurm_cluster):
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 0, "seconds": 0.25}}'
    # Progress lines on (the log is not a terminal: one plain line per step), later on the line than MICRO's off.
    args = fit_args("cut", "--trainer.enable_progress_bar", "true", "--trainer.callbacks+=" + throttle,
                    "--ckpt_path", "auto")  # fmt: skip
    log = workdir / "job.log"
    script = workdir / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={log}\n#SBATCH --open-mode=append\n#SBATCH --cpus-per-task=1\n#SBATCH --chdir={workdir}\n"
        f"exec {shlex.quote(sys.executable)} -m lmledger.cli {shlex.join(args)}\n"
    )
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=job_env(),
                         check=True).stdout.strip()  # fmt: skip
    try:
        assert lmledger(fit_args("whole")) == 0  # the uninterrupted reference, in this process meanwhile
        run = workdir / "runs" / "cut" / "version_0"
        ckpt = run / "checkpoints" / "last.ckpt"
        # The log is read while the job runs: progress lines arrive as they are printed, not at exit.
        wait_for(lambda: re.search(r"^step \d+", log.read_text(), re.M) if log.exists() else None, "a progress line",
                 log=log)  # fmt: skip
        assert squeue_state(job) == "RUNNING"
        # 1: SLURM's warning signal, as --signal=B:USR1@N sends it before a time limit.
        wait_for(lambda: checkpoint_step(ckpt) >= 2, "the first checkpoint", log=log)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        release(job)
        wait_for(lambda: "restart 1" in log.read_text(), "the requeued job's first line", log=log)
        # 2: the scheduler requeues it (SIGTERM, then SIGKILL after KillWait), once the resumed run has trained.
        first = checkpoint_step(ckpt)
        wait_for(lambda: checkpoint_step(ckpt) > first, "a checkpoint of the resumed run", log=log)
        subprocess.run(["scontrol", "requeue", job], check=True)
        release(job)
        wait_for(lambda: squeue_state(job) == "", "the job to finish", timeout=180, log=log)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    starts = re.findall(rf"^lmledger fit: SLURM job {job}, restart (\d)$", text, re.M)
    assert starts == ["0", "1", "2"], text[-3000:]
    saved = re.findall(r"^lmledger fit: preempted at step (\d+): saved \S+; resume with --ckpt_path last; (.*)$",
                       text, re.M)  # fmt: skip
    assert len(saved) == 2 and f"job {job} requeued" in saved[0][1], text[-3000:]
    assert text.count("--ckpt_path auto: resuming runs/cut/version_0 at step") == 2, text[-3000:]
    assert (run / SLURM_JOB_FILE).read_text().strip() == job
    assert slurm_texts(run) == {r: f"SLURM job {job}, restart {r}" for r in (0, 1, 2)}  # one per (re)start
    assert sorted(p.name for p in (workdir / "runs" / "cut").iterdir()) == ["version_0"]
    pieces, whole = curves(run), {t: dict(v) for t, v in read_scalars(workdir / "runs/whole/version_0").items()}
    assert len(pieces) == 3
    for tag in TAGS:
        steps = sorted(s for piece in pieces for s in piece[tag])
        assert steps == list(range(STEPS)), (tag, steps)  # every step logged once: none lost, none twice
        for piece in pieces:
            assert piece[tag] == {s: whole[tag][s] for s in piece[tag]}, tag  # exact float equality


class TermRank1(pl.Callback):
    """Test-only: SIGTERM to global rank 1 alone as step `at_step` starts; rank 0 hears of it only through the
    ranks' agreement at the step boundary."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.at_step:
            os.kill(os.getpid(), 15)


def test_srun_two_ranks_train_ddp_and_stop_together(workdir, slurm_cluster):
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.max_steps", "6", "--ledger.warmup_steps", "1"]  # fmt: skip
    # One node: the session's cluster has two, and two tasks spread over them would be two nodes of one rank each.
    srun = ["srun", "--nodes", "1", "--ntasks", "2", "--cpus-per-task", "1", "--chdir", str(workdir), sys.executable,
            "-m", "lmledger.cli"]  # fmt: skip
    term = '{"class_path": "test_slurm.TermRank1", "init_args": {"at_step": 2}}'
    stopped = subprocess.run([*srun, *fit_args("ddp", *ddp, "--trainer.callbacks+=" + term)], capture_output=True,
                             text=True, env=job_env(), timeout=300)  # fmt: skip
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143, said[-3000:]
    lines = re.findall(r"^lmledger fit: preempted at step (\d+)", said, re.M)
    assert lines == ["3"], said[-3000:]  # rank 0 alone prints it; both stopped after step 3, the one saved
    run = workdir / "runs" / "ddp" / "version_0"
    assert open_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert not list(workdir.rglob("hpc_ckpt_*.ckpt"))  # Lightning's own SLURM requeue stayed off
    assert "MEMBER: 2/2" in said  # Lightning's SLURMEnvironment made the group of two from srun's variables
    scalars = read_scalars(run)
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]
    for part in ("params", "grads", "optimizer"):  # DDP replicates the state: per rank, measured = predicted
        assert scalars[f"memory/measured/{part}"][-1][1] == scalars[f"memory/predicted/{part}"][-1][1]
    per_device, total = scalars["perf/tokens_per_sec"][-1][1], scalars["perf/tokens_per_sec_total"][-1][1]
    assert abs(total - 2 * per_device) <= 1e-6 * total


class WritePid(pl.Callback):
    """Test-only: each rank of a SLURM job writes its pid to rank<N>.pid in the working directory as training
    starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        if os.environ.get("SLURM_JOB_ID"):
            Path(f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))


def test_a_two_node_job_stopped_on_one_node_and_requeued_continues_its_run_bit_for_bit(workdir, slurm_two_nodes):
    """`sbatch --nodes 2` of `srun lmledger fit --trainer.num_nodes 2` (DDP over gloo, one rank a node, the ledger
    on): SIGUSR1 to node n2's task alone (as `--signal` sends it; scancel cannot pick one task), then `scontrol
    requeue`. Both ranks save at one step each time, the job requeues and resumes version_0, each step is logged
    once, and the curve equals an uninterrupted 2-rank run's bit for bit. The ledger is per rank on rank 0."""
    throttle = '{"class_path": "test_resume.Throttle", "init_args": {"after_step": 0, "seconds": 0.5}}'
    two = ["--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "ddp",
           "--trainer.accelerator", "cpu", "--ledger.warmup_steps", "1"]  # fmt: skip
    pids = '{"class_path": "test_slurm.WritePid"}'
    args = fit_args("nodes", *two, "--trainer.callbacks+=" + throttle, "--trainer.callbacks+=" + pids,
                    "--ckpt_path", "auto")  # fmt: skip
    log = workdir / "job.log"
    script = workdir / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={log}\n#SBATCH --open-mode=append\n#SBATCH --chdir={workdir}\n"
        f"exec srun {shlex.quote(sys.executable)} -m lmledger.cli {shlex.join(args)}\n"
    )
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=job_env(),
                         check=True).stdout.strip()  # fmt: skip
    try:
        run = workdir / "runs" / "nodes" / "version_0"
        ckpt = run / "checkpoints" / "last.ckpt"
        wait_for(lambda: checkpoint_step(ckpt) >= 2, "the first checkpoint", log=log)
        os.kill(int((workdir / "rank1.pid").read_text()), signal.SIGUSR1)  # node n2's task alone
        release(job)
        wait_for(lambda: "restart 1" in log.read_text(), "the requeued job's first line", log=log)
        first = checkpoint_step(ckpt)
        wait_for(lambda: checkpoint_step(ckpt) > first, "a checkpoint of the resumed run", log=log)
        subprocess.run(["scontrol", "requeue", job], check=True)
        release(job)
        # The uninterrupted reference, as the last piece trains.
        whole = subprocess.run([sys.executable, "-m", "lmledger.cli", *fit_args("whole", "--trainer.devices", "2",
                                "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu")], cwd=workdir,
                               env=job_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert whole.returncode == 0, whole.stderr[-3000:]
        wait_for(lambda: squeue_state(job) == "", "the job to finish", timeout=240, log=log)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    starts = re.findall(rf"^lmledger fit: SLURM job {job}, restart (\d)$", text, re.M)
    assert starts == ["0", "1", "2"], text[-3000:]  # rank 0 alone says it
    saved = re.findall(r"^lmledger fit: preempted at step (\d+): saved \S+; resume with --ckpt_path last; (.*)$", text,
                       re.M)  # fmt: skip
    assert len(saved) == 2 and f"job {job} requeued" in saved[0][1], text[-3000:]  # one line per stop, from rank 0
    assert text.count("--ckpt_path auto: resuming runs/nodes/version_0 at step") == 2, text[-3000:]
    assert "MEMBER: 2/2" in text and sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    pieces, reference = curves(run), {t: dict(v) for t, v in read_scalars(workdir / "runs/whole/version_0").items()}
    assert len(pieces) == 3
    for tag in TAGS:
        steps = sorted(s for piece in pieces for s in piece[tag])
        assert steps == list(range(STEPS)), (tag, steps)  # every step logged once
        for piece in pieces:
            assert piece[tag] == {s: reference[tag][s] for s in piece[tag]}, tag  # exact float equality
    scalars = read_scalars(run)
    for part in ("params", "grads", "optimizer"):  # DDP replicates the state: per rank, measured = predicted
        assert scalars[f"memory/measured/{part}"][-1][1] == scalars[f"memory/predicted/{part}"][-1][1]
    assert len(list((run / "checkpoints").glob("*.ckpt"))) == 1  # written once, by rank 0
    # The per-rank record beside the checkpoints: every rank's lines; rank 0's are TensorBoard's.
    from lmledger.callbacks.ranks import read_rank_records, worst_rank

    records = read_rank_records(run)
    assert sorted(records) == [0, 1] and [records[r]["node"] for r in (0, 1)] == [0, 1]
    assert all(record["step"] == STEPS and record["num_nodes"] == 2 for record in records.values())
    for record in records.values():  # the one JSON shape (docs/commands.md): memory.<line>.<source>
        assert record["sources"]["predicted"] == "dry run"
        for part in ("params", "grads", "optimizer"):
            memory = record["memory"][part]
            assert memory["measured"] == memory["predicted"] > 0, (record["rank"], part, memory)
    for part in ("params", "grads", "optimizer", "peak"):
        assert records[0]["memory"][part]["measured"] == scalars[f"memory/measured/{part}"][-1][1], part
    assert worst_rank(records, "peak") in (0, 1)


def test_a_two_node_fsdp2_job_is_predicted_per_rank_and_saves_one_sharded_checkpoint(workdir, slurm_two_nodes):
    """`sbatch --nodes 2` of `srun lmledger fit --trainer.num_nodes 2 --trainer.strategy fsdp2`, the ledger on: each
    rank's record holds half the state, measured equal to predicted; rank 0's is TensorBoard's; one sharded
    checkpoint (a shard per rank), one run directory."""
    args = fit_args("shards", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "fsdp2",
                    "--trainer.accelerator", "cpu", "--trainer.max_steps", "6",
                    "--ledger.warmup_steps", "1")  # fmt: skip
    log = workdir / "job.log"
    script = workdir / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={log}\n#SBATCH --chdir={workdir}\n"
        f"exec srun {shlex.quote(sys.executable)} -m lmledger.cli {shlex.join(args)}\n"
    )
    done = subprocess.run(["sbatch", "--wait", str(script)], capture_output=True, text=True, env=job_env(),
                          timeout=400)  # fmt: skip
    assert done.returncode == 0, log.read_text()[-3000:] if log.exists() else done.stderr
    from lmledger.callbacks.ranks import read_rank_records

    run = workdir / "runs" / "shards" / "version_0"
    records, scalars = read_rank_records(run), read_scalars(run)
    assert sorted(records) == [0, 1] and sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    for record in records.values():  # the one JSON shape (docs/commands.md): memory.<line>.<source>
        assert record["sources"]["predicted"] == "dry run"
        for part in ("params", "grads", "optimizer"):
            memory = record["memory"][part]
            assert memory["measured"] == memory["predicted"] > 0, (record["rank"], part, memory)
    for part in ("params", "grads", "optimizer", "peak"):
        assert records[0]["memory"][part]["measured"] == scalars[f"memory/measured/{part}"][-1][1], part
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert sorted(p.name for p in (run / "checkpoints" / "last.ckpt").glob("*.distcp")) == ["__0_0.distcp",
                                                                                           "__1_0.distcp"]  # fmt: skip


def experiment(workdir: Path, name: str, more: dict | None = None) -> Path:
    path = workdir / f"{name}.yaml"
    fixed = {"trainer.max_steps": 2, "trainer.limit_val_batches": 0, "trainer.log_every_n_steps": 1,
             "model.config.d_model": 32, "model.config.n_layers": 1, "model.config.n_heads": 2,
             "model.config.d_ff": 64, "model.config.context_length": 32, **(more or {})}  # fmt: skip
    doc = {"name": name, "command": "fit", "configs": ["configs/tiny.yaml"], "fixed": fixed,
           "grid": {"data.batch_size": [2, 4]},
           "metrics": ["train/loss", "memory/predicted/peak", "flops/model_per_step"]}  # fmt: skip
    path.write_text(yaml.safe_dump(doc, sort_keys=False))  # the overrides' order is their flags' order
    return path


def table(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def test_a_sweep_through_slurm_gives_the_local_table_with_a_point_preempted(workdir, slurm_cluster, monkeypatch):
    """A 2-point sweep as a job array, one task stopped by SLURM's warning signal mid-run, requeued and resumed:
    the same results table as the local launcher's, digit for digit."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    env = job_env()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # the local points import test_resume.Throttle too
    throttle = {"class_path": "test_resume.Throttle", "init_args": {"after_step": 0, "seconds": 0.3}}
    spec = experiment(workdir, "pair", {"trainer.max_steps": 8, "trainer.callbacks.init_args.every_n_train_steps": 2,
                                        "trainer.callbacks+": throttle})  # fmt: skip
    assert lmledger(["sweep", str(spec), "--out", "local", "--jobs", "2"]) == 0
    command = [sys.executable, "-m", "lmledger.cli", "sweep", str(spec), "--out", "slurm", "--launcher", "slurm",
               "--cpus-per-task", "1"]  # fmt: skip
    sweep = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        points = sorted(p.name for p in (workdir / "local" / "runs").iterdir())
        ckpt = workdir / "slurm" / "runs" / points[0] / "version_0" / "checkpoints" / "last.ckpt"
        wait_for(lambda: checkpoint_step(ckpt) >= 2, "the point's first checkpoint")
        status = workdir / "slurm" / "points" / points[0] / "status.json"
        task = json.loads(status.read_text())["slurm_task"]
        subprocess.run(["scancel", "--batch", "--signal=USR1", task], check=True)
        release(task)
        assert sweep.wait(timeout=240) == 0, sweep.stdout.read()
    finally:
        if sweep.poll() is None:
            sweep.kill()
        subprocess.run(["scancel", "--name=lmledger-pair"], capture_output=True)
    assert json.loads(status.read_text())["restart"] == 1 and json.loads(status.read_text())["status"] == "done"
    assert sorted(p.name for p in ckpt.parents[2].iterdir()) == ["version_0"]  # resumed in its own run
    local, slurm = table(workdir / "local" / "results.csv"), table(workdir / "slurm" / "results.csv")
    assert len(local) == 2 and all(row["status"] == "done" for row in local)
    assert slurm == local  # the same numbers, to the last digit written
    logs = sorted((workdir / "slurm" / "points").glob("*/stdout.log"))
    firsts = sorted(log.read_text().splitlines()[0] for log in logs)  # the SLURM line comes first
    assert [re.sub(r"\d+", "N", line) for line in firsts] == [
        "lmledger fit: SLURM job N (array task N of job N), restart N"] * 2, firsts  # fmt: skip
    assert {line.split("array task ")[1][0] for line in firsts} == {"0", "1"}
    (script,) = (workdir / "slurm" / "slurm").glob("array-*.sh")
    assert "#SBATCH --array=0-1\n" in script.read_text() and re.search(r"#SBATCH --mem=\d+M", script.read_text())
    # A second run finds both done and queues nothing.
    assert lmledger(["sweep", str(spec), "--out", "slurm", "--launcher", "slurm"]) == 0
    assert len(list((workdir / "slurm" / "slurm").glob("array-*.sh"))) == 1


def test_a_point_over_mem_is_refused_before_sbatch(workdir, capsys, slurm_cluster):
    spec = experiment(workdir, "big")
    capsys.readouterr()
    assert lmledger(["sweep", str(spec), "--launcher", "slurm", "--mem", "100M", "--out", "o"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
    assert len(err) == 1 and "does not fit --mem 100M" in err[0] and "nothing was queued" in err[0], err
    assert not (workdir / "o" / "slurm").exists()


def test_a_point_over_the_gres_gpus_memory_is_refused_before_sbatch(workdir, capsys, slurm_cluster):
    spec = workdir / "wide.yaml"
    spec.write_text(yaml.safe_dump({"name": "wide", "command": "fit", "configs": ["configs/tiny.yaml"],
                                    "grid": {"data.batch_size": [8, 4096]}}))  # fmt: skip
    capsys.readouterr()
    assert lmledger(["sweep", str(spec), "--launcher", "slurm", "--gres", "gpu:t4:1", "--out", "o"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmledger")]
    assert len(err) == 1 and "batch_size=4096" in err[0] and "does not fit the 16.00 GB of a" in err[0], err
    assert not (workdir / "o" / "slurm").exists()


def test_without_slurm_the_launcher_names_what_is_missing(workdir, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(workdir))  # no sbatch, no squeue
    spec = experiment(workdir, "none")
    assert lmledger(["sweep", str(spec), "--launcher", "slurm"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--launcher slurm needs SLURM's sbatch and squeue on PATH" in line, line


def test_a_rerun_does_not_resubmit_a_queued_point_and_a_vanished_task_is_failed(workdir, slurm_cluster):
    """A point whose task is still in the queue is not submitted again; one whose task left the queue without
    writing a status (killed by SLURM) is reported failed, naming its log."""
    from lmledger.sweep import load_experiment
    from lmledger.sweep.launch import status_path
    from lmledger.sweep.slurm import ended_result, in_queue

    points = load_experiment(experiment(workdir, "held")).points
    held = subprocess.run(["sbatch", "--parsable", "--hold", "--array=0", "--wrap", "true"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    try:
        status = status_path(workdir / "out", points[0])
        status.parent.mkdir(parents=True)
        status.write_text(f'{{"point": "{points[0].id}", "status": "queued", "slurm_task": "{held}_0"}}')
        assert in_queue(workdir / "out", list(points)) == {points[0].id: f"{held}_0"}
    finally:
        subprocess.run(["scancel", held], check=True)
    wait_for(lambda: not in_queue(workdir / "out", list(points)), "the held task to leave the queue")
    result = ended_result(workdir / "out", points[0])
    assert result.status == "failed" and f"SLURM task {held}_0 ended without a result" in result.error


class Usr1InSetup(pl.Callback):
    """Test-only: SIGUSR1 to this process while the Trainer sets up, before any training batch."""

    def setup(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)


def test_slurms_warning_during_set_up_saves_after_the_first_step(workdir):
    """SIGUSR1's default action ends the process: from parsing on, lmledger fit notes it instead, and saves and
    stops at the first step boundary (a subprocess: a regression would kill pytest)."""
    usr1 = '{"class_path": "test_slurm.Usr1InSetup"}'
    command = [sys.executable, "-m", "lmledger.cli", *fit_args("early", "--trainer.callbacks+=" + usr1)]
    done = subprocess.run(command, cwd=workdir, env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, (done.stdout + done.stderr)[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("lmledger fit:")]
    assert line == "lmledger fit: preempted at step 1: saved runs/early/version_0/checkpoints/last.ckpt; resume with " \
        "--ckpt_path last", line  # fmt: skip
    assert open_checkpoint(workdir / "runs/early/version_0/checkpoints/last.ckpt")["global_step"] == 1


# Canaries: what Lightning 2.6.6 does that lmledger's SLURM handling relies on (tests/test_canaries.py's kind;
# kept here beside the SLURM tests, they need no cluster).


def test_slurm_environment_is_detected_only_with_ntasks(monkeypatch):
    """A plain `sbatch` job (no --ntasks, no srun) is not SLURM to Lightning, so its own SIGUSR1 requeue is never
    installed there: why PreemptionCheckpoint handles SIGUSR1 itself (docs/cluster.md)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NAME", "job.sh")
    assert not SLURMEnvironment.detect()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert SLURMEnvironment.detect()


def test_slurm_environment_refuses_ntasks_without_per_node(monkeypatch):
    """Lightning raises on `--ntasks N` without `--ntasks-per-node`; fitting.cli.slurm_tasks_per_node sets it on
    one node."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lmledger.fitting.cli import slurm_tasks_per_node

    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    with pytest.raises(RuntimeError, match="ntasks-per-node"):
        SLURMEnvironment(auto_requeue=False)
    env = {"SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1"}
    slurm_tasks_per_node(env)
    assert env["SLURM_NTASKS_PER_NODE"] == "2"
    from lmledger.errors import UserError

    with pytest.raises(UserError, match="add --ntasks-per-node"):
        slurm_tasks_per_node({"SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2"})


def test_lightning_installs_no_sigusr1_handler_without_auto_requeue(monkeypatch):
    """With SLURMEnvironment(auto_requeue=False) Lightning's signal connector leaves SIGUSR1 alone (so the kit's
    handler is the only one), and its teardown puts back the handlers it found (so a handler installed before
    it, as PreemptionCheckpoint's SIGUSR1 in setup, outlives the fit: the handler then defers to the original)."""
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    class FakeTrainer:
        class _accelerator_connector:  # noqa: N801 (Lightning's attribute name)
            cluster_environment = None

    monkeypatch.setenv("SLURM_NTASKS", "1")
    trainer = FakeTrainer()
    trainer._accelerator_connector.cluster_environment = SLURMEnvironment(auto_requeue=False)
    before_usr1, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    ours = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR1, ours)
    try:
        connector = _SignalConnector(trainer)
        connector.register_signal_handlers()
        assert signal.getsignal(signal.SIGUSR1) is ours  # not replaced, not wrapped
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # as PreemptionCheckpoint's restore does at the end
        connector.teardown()
        assert signal.getsignal(signal.SIGUSR1) is ours  # Lightning put back what it found
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)
        signal.signal(signal.SIGTERM, before_term)
