"""No rank left waiting (issue 31 §3): a node that never arrives, and a peer that dies or stops answering
mid-run, each end the run within the strategy's timeout with one line naming what was waited for, which rank,
and for how long; the newest checkpoint stays intact and `--ckpt_path auto` resumes it exactly. Real gloo
ranks on CPU (2 at most), the smallest model, 12 steps."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
from test_preemption import curves

from conftest import MICRO_OVERRIDES
from lmledger.checkpointing import open_checkpoint

TESTS = Path(__file__).resolve().parents[1]
STEPS = 12
# Seconds: the tests' --trainer.strategy.timeout, which bounds the rendezvous as well as each collective, so with
# two ranks it must hold rank 1's start-up (its imports: 15 s did not, on 2 cores at load 6, 2026-12-02).
BOUND = 30
LONELY_BOUND = 5  # a node whose peer never starts waits out the whole bound: a short one, as nothing is to come


def env(**more: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "NODE_"))}
    out["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    out["OMP_NUM_THREADS"] = "1"
    return {**out, **more}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(name: str, *extra: str, bound: int = BOUND) -> list[str]:
    return [sys.executable, "-m", "lmledger.cli", "fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES,
            "--trainer.max_steps", str(STEPS), "--trainer.callbacks.init_args.every_n_train_steps", "2",
            "--trainer.logger.init_args.name", name, "--ledger.enabled", "false",
            "--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy",
            "--trainer.strategy.timeout", f"0:00:{bound:02d}", *extra]  # fmt: skip


def said(done: subprocess.CompletedProcess) -> str:
    """The one `lmledger fit:` line on stderr."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("lmledger fit:")]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


class Stop(pl.Callback):
    """Test-only: signal `signum` to global rank `rank` as step `at_step` starts."""

    def __init__(self, rank: int, at_step: int, signum: int) -> None:
        self.rank, self.at_step, self.signum = rank, at_step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def test_a_node_that_never_comes_ends_the_rendezvous_in_one_line(workdir):
    """Two simulated nodes, only node 0 started: it waits its bound, says for what, leaves no run directory."""
    port = free_port()
    command = fit("lonely", "--trainer.num_nodes", "2", "--trainer.devices", "1", bound=LONELY_BOUND)
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300,
                          env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0"))  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    line = said(done)
    found = re.fullmatch(rf"lmledger fit: rendezvous: rank 0 waited (\d+) s at 127\.0\.0\.1:{port} for 1 of 2 ranks "
                         r"\(this is node 0 of 2\), and they never joined: start every node with the same MASTER_ADDR "
                         rf"and MASTER_PORT, or wait longer with --trainer\.strategy\.timeout "
                         rf"\(now {LONELY_BOUND:.1f} s\)", line)  # fmt: skip
    assert found, line  # (a bound under 10 s is said to a tenth)
    assert LONELY_BOUND <= int(found.group(1)) <= LONELY_BOUND + 2  # torch's own count of the wait: the bound held
    assert "Traceback" not in done.stderr
    assert not (workdir / "runs" / "lonely").exists()  # a run that never trained leaves nothing


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_peer_lost_mid_run_ends_the_run_in_one_line_and_auto_resumes_exactly(workdir, signum):
    """Rank 1 SIGKILLed (its sockets close: rank 0's next collective fails at once) or SIGSTOPped (it stops
    answering: rank 0's collective waits BOUND s) as step 5 starts. Rank 0 says which rank, at which step, and
    that last.ckpt (step 4) is intact; after the kill, `--ckpt_path auto` resumes version_0 from it, and the step
    it redoes logs the very loss the lost run logged."""
    stop = f'{{"class_path": "test_multinode.Stop", "init_args": {{"rank": 1, "at_step": 5, "signum": {int(signum)}}}}}'
    ddp = ["--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    done = subprocess.run(fit("lost", *ddp, "--trainer.callbacks+=" + stop), cwd=workdir, capture_output=True,
                          text=True, timeout=300, env=env())  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    line = said(done)
    kept = re.escape("the newest checkpoint runs/lost/version_0/checkpoints/last.ckpt (step 4) is intact: "
                     "resume with --ckpt_path auto")  # fmt: skip
    if signum == signal.SIGKILL:
        assert re.fullmatch(rf"lmledger fit: rank 1 \(pid \d+\) was killed by SIGKILL at step 5; rank 0 stopped; "
                            rf"{kept}", line), line  # fmt: skip
    else:
        found = re.fullmatch(rf"lmledger fit: rank 0 waited (\d+) s in a collective \(\w+\) at step 5 for rank 1, "
                             rf"which stopped answering; {kept}; a step that legitimately takes longer needs a larger "
                             rf"--trainer\.strategy\.timeout \(now {BOUND} s\)", line)  # fmt: skip
        assert found and int(found.group(1)) == BOUND, line
    assert "Traceback" not in done.stderr
    run = workdir / "runs" / "lost" / "version_0"
    assert open_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    if signum == signal.SIGSTOP:
        return  # the resume is the killed case's: the checkpoint left is the same
    resumed = subprocess.run(fit("lost", *ddp, "--ckpt_path", "auto"), cwd=workdir, capture_output=True, text=True,
                             timeout=300, env=env())  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "lmledger fit: --ckpt_path auto: resuming runs/lost/version_0 at step 4 from last.ckpt" in resumed.stdout
    assert sorted(p.name for p in (workdir / "runs" / "lost").iterdir()) == ["version_0"]
    lost, again = curves(run)
    assert sorted(lost["train/loss"]) == [0, 1, 2, 3, 4]  # step 5 never finished
    assert sorted(again["train/loss"]) == list(range(4, STEPS))  # nothing lost beyond the checkpoint
    assert again["train/loss"][4] == lost["train/loss"][4]  # the redone step: the same loss, bit for bit
    assert open_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == STEPS


class KillOnFirstAttempt(pl.Callback):
    """Test-only: SIGKILL to global rank `rank` as step `at_step` starts, in torchrun's first attempt only."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank, self.at_step = rank, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first and trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGKILL)


def test_torchrun_restarts_a_killed_worker_and_it_resumes_its_run_bit_for_bit(workdir):
    """Two torchrun agents on localhost with torchrun's defaults (c10d rendezvous, its shared store;
    --max-restarts 1), one worker each; rank 1 SIGKILLed at step 5. torchrun restarts both workers; each process
    group gets a store of its attempt's own (fitting.clusterenv: before it, 2 restarts in 3 dialed the dead
    attempt's addresses and both agents exited 1 at step 5); `--ckpt_path auto`, keyed to the run id, resumes
    version_0 at step 4, and every step's loss equals an uninterrupted 2-rank run's, bit for bit (that one from
    Lightning's launcher: the same two global ranks)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    kill = '{"class_path": "test_multinode.KillOnFirstAttempt", "init_args": {"rank": 1, "at_step": 5}}'
    worker = fit("elastic", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--ckpt_path", "auto",
                 "--trainer.callbacks+=" + kill)[1:]  # fmt: skip
    agents = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t31", "--max-restarts", "1",
                                *worker], cwd=workdir, env=env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]  # fmt: skip
    try:
        whole = subprocess.run(fit("whole", "--trainer.devices", "2", "--trainer.accelerator", "cpu"), cwd=workdir,
                               capture_output=True, text=True, timeout=300, env=env())  # fmt: skip
        assert whole.returncode == 0, whole.stderr[-3000:]
        outs = [agent.communicate(timeout=400)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(out[-2000:] for out in outs)
    text = "\n".join(outs)
    first_line = r"^lmledger fit: torchrun run t31 \(TORCHELASTIC_RUN_ID\), this node's restart (\d) of at most 1$"
    firsts = re.findall(first_line, text, re.M)
    # Rank 0 alone says it, once per start; the count is its node's agent's (counted only where a worker failed).
    assert len(firsts) == 2 and firsts[0] == "0", text[-3000:]
    assert "--ckpt_path auto: torchrun run t31 has no run under runs/elastic yet: starting fresh in " \
        "runs/elastic/version_0" in text  # fmt: skip
    assert "--ckpt_path auto: resuming runs/elastic/version_0 at step 4 from last.ckpt" in text
    run = workdir / "runs" / "elastic" / "version_0"
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert (run / "slurm_job").read_text().strip() == "torchrun:t31"
    first, again = curves(run)
    reference = curves(workdir / "runs" / "whole" / "version_0")[0]
    assert sorted(first["train/loss"]) == [0, 1, 2, 3, 4] and sorted(again["train/loss"]) == list(range(4, STEPS))
    for piece in (first, again):
        for tag, values in piece.items():
            assert values == {s: reference[tag][s] for s in values}, tag  # exact float equality


def test_a_torchrun_workers_run_key_and_first_line():
    from lmledger.preemption import elastic_line, run_key

    env = {"TORCHELASTIC_RUN_ID": "j7", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2"}  # fmt: skip
    assert run_key(env) == ("torchrun:j7", "torchrun run j7")
    assert run_key({**env, "SLURM_JOB_ID": "812"}) == ("812", "SLURM job 812")  # srun inside an allocation: the job
    assert elastic_line(env) == "torchrun run j7 (TORCHELASTIC_RUN_ID), this node's restart 1 of at most 2"
    assert run_key({}) is None and elastic_line({}) is None


def test_a_dead_attempts_store_keys_are_never_read(monkeypatch):
    """store_of_this_attempt against a real TCPStore standing in for torchrun's agent store, holding what a dead
    attempt left (its leader token, its port): rank 1 starts before rank 0 and reads the dead token first; both
    still agree on the port this attempt's rank 0 chose, and point MASTER_PORT at it with the agent store off."""
    import threading

    import torch.distributed as dist

    from lmledger.fitting.clusterenv import store_of_this_attempt

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    agent.set("lmledger/t/leader", "dead")
    agent.set("lmledger/t/dead/port", "1")  # the dead attempt's: nobody listens there
    base = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    envs = [{**base, "RANK": "0"}, {**base, "RANK": "1"}]
    ports: dict[int, int] = {}
    one = threading.Thread(target=lambda: ports.setdefault(1, store_of_this_attempt(timedelta(seconds=30), envs[1])))
    one.start()
    time.sleep(0.5)  # rank 1 has read the dead token by now
    ports[0] = store_of_this_attempt(timedelta(seconds=30), envs[0])
    one.join(timeout=30)
    assert ports[0] == ports[1] != 1 and ports[0] != port
    assert [(e["MASTER_PORT"], e["TORCHELASTIC_USE_AGENT_STORE"]) for e in envs] == [(str(ports[0]), "False")] * 2
    assert store_of_this_attempt(timedelta(seconds=1), envs[0]) is None  # done once: the agent store is off now


def test_real_rendezvous_errors_read_as_one_line(monkeypatch):
    """The lines for torch's own errors, raised here by real TCPStores (1 s): a master nobody joins, a client
    whose master never comes."""
    import torch.distributed as dist

    from lmledger.fitting import peers

    monkeypatch.setattr(peers, "STATE", peers._State())
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(dist.DistError) as alone:
        dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(seconds=1))
    line = peers.peer_failure_line(alone.value)
    # torch counts whole seconds from before it starts waiting: 1 s reads as 1 or 2.
    assert line is not None
    assert re.match(rf"rendezvous: rank 0 waited [12] s at 127\.0\.0\.1:{port} for 1 of 2 ranks", line), line
    peers.STATE.rank, peers.STATE.node, peers.STATE.nodes, peers.STATE.reported = 1, 1, 2, False
    with pytest.raises(dist.DistError) as nobody:
        dist.TCPStore("127.0.0.1", free_port(), world_size=2, is_master=False, timeout=timedelta(seconds=1))
    line = peers.peer_failure_line(nobody.value)
    assert line is not None and line.startswith(
        f"rendezvous: rank 1 (node 1 of 2) could not reach rank 0 at 127.0.0.1:{port} within 1.0 s"
    ), line
    assert peers.peer_failure_line(ValueError("bad value")) is None  # not a peer's failure: left alone


def test_the_kits_timeout_replaces_lightnings_default_only(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    from lmledger.fitting.peers import PEER_TIMEOUT, set_peer_timeout

    assert set_peer_timeout(DDPStrategy()) == PEER_TIMEOUT
    assert set_peer_timeout(DDPStrategy(timeout=timedelta(minutes=45))) == timedelta(minutes=45)
    assert set_peer_timeout(object()) is None


# Canaries: what torch 2.13 and Lightning 2.6.6 do that fitting.peers relies on.


def test_process_group_timeouts():
    """Lightning passes torch's 30-minute default_pg_timeout to every backend, NCCL included, although NCCL's own
    default is 10 minutes (init_process_group's docstring; ProcessGroupNCCL.hpp kProcessGroupNCCLDefaultTimeout):
    without the kit's timeout, a rank waits 30 minutes for a lost peer on GPUs too."""
    import inspect

    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.constants import default_pg_timeout

    assert "Default value is 10 minutes for NCCL and 30 minutes for other backends" in dist.init_process_group.__doc__
    assert default_pg_timeout == timedelta(minutes=30)
    for strategy in (DDPStrategy, ModelParallelStrategy):
        assert inspect.signature(strategy.__init__).parameters["timeout"].default == default_pg_timeout


def test_lightning_leaves_the_process_group_after_fit(tmp_path, restored_environ):
    """Lightning 2.6.6's DDPStrategy.teardown does not destroy the process group it made: what
    fitting.peers.close_process_group does at the end of `lmledger fit` (pytorch/pytorch#190489)."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    try:
        trainer.fit(BoringModel())
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert torch.distributed.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_lightning_observer_kills_the_launcher_when_a_child_dies():
    """Lightning's _ChildProcessObserver SIGKILLs the launcher (its main_pid) once a child rank has failed: what
    lightning_private.observe_child_ranks hooks, so that a line is said first. Here main_pid is a stand-in."""
    from lightning.fabric.strategies.launchers import subprocess_script

    import lmledger.fitting.peers  # noqa: F401 (installs the hook)

    hooked = subprocess_script._ChildProcessObserver
    assert hooked.lmledger_hooked
    base = hooked.__mro__[1]
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait()
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert base(main_pid=stand_in.pid, child_processes=[child])._run() is True
        assert stand_in.wait(timeout=30) == -signal.SIGKILL
    finally:
        stand_in.kill()


def test_the_interconnect_table_and_the_users_own_rate():
    from lmledger.errors import UserError
    from lmledger.ledger.hardware.interconnect import INTERCONNECTS, resolve_interconnect

    # One direction per GPU: a datasheet's both-directions NVLink figure halved; a port's Gb/s over 8.
    assert resolve_interconnect("nvlink4").bytes_per_s == 900e9 / 2
    assert resolve_interconnect("IB-NDR").bytes_per_s == 400e9 / 8 == resolve_interconnect("400Gb/s").bytes_per_s
    assert resolve_interconnect("1.8TB/s").bytes_per_s == 1.8e12
    assert all(link.source and link.scope in ("intra-node", "inter-node") for link in INTERCONNECTS.values())
    for bad in ("nvlink9", "50 MB/s", "", "0GB/s", "-5GB/s"):
        with pytest.raises(UserError) as refused:
            resolve_interconnect(bad)
        assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="is intra-node, not inter-node"):
        resolve_interconnect("nvlink4", scope="inter-node")
