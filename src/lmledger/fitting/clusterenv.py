"""The environment a fit meets on a cluster: a launcher's variables, and torchrun's store across restarts.

    refuse_stray_launcher   RANK, WORLD_SIZE, ... that disagree with the trainer's devices and nodes: one line
    store_of_this_attempt   under torchrun's defaults, a process-group store no earlier attempt wrote into

A launcher's variables outlive it (a shell in a torchrun job, an `salloc` step, a notebook kernel). Lightning
reads them twice: its rank-zero switch (who logs) takes the first of RANK, LOCAL_RANK, SLURM_PROCID at import,
while the trainer takes its ranks from the cluster environment it detects. Where the two disagree, a run trains
and logs nothing, so a disagreement is refused before anything is built (docs/reliability.md).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta

from lmledger.errors import ConfigError

__all__ = ["LAUNCH_VARIABLES", "launch_disagreements", "refuse_stray_launcher", "store_of_this_attempt"]

# What torchrun, srun and Lightning's own launcher set for the processes they start, that Lightning reads.
LAUNCH_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "SLURM_NTASKS", "SLURM_PROCID",
)  # fmt: skip
# lightning.fabric.utilities.rank_zero._get_rank: the rank-zero switch's reading, first found wins.
_RANK_ZERO_KEYS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


def launch_disagreements(devices: int, num_nodes: int, env=os.environ) -> list[str]:
    """Each launcher variable in `env` that disagrees with a trainer of `devices` x `num_nodes`, in words."""
    world = devices * num_nodes
    given = {name: env[name] for name in LAUNCH_VARIABLES if name in env}
    numbers = {name: int(value) for name, value in given.items() if value.strip().isdigit()}
    said = [f"{name}={value!r} is not a whole number" for name, value in given.items() if name not in numbers]
    # Lightning's SLURMEnvironment is detected by SLURM_NTASKS, unless the job is named as interactive.
    slurm = "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    limits = {
        "WORLD_SIZE": (world, f"a world of {world}"), "LOCAL_WORLD_SIZE": (devices, f"{devices} device(s) a node"),
        **({"SLURM_NTASKS": (world, f"a world of {world}")} if slurm else {}),
    }  # fmt: skip
    for name, (wanted, words) in limits.items():
        if numbers.get(name, wanted) != wanted:
            said.append(f"{name}={numbers[name]} where the trainer runs {words}")
    ranks, nodes = (world, f"its world of {world}"), (num_nodes, f"its {num_nodes} node(s)")
    local = (devices, f"its {devices} device(s) a node")
    bounds = {"RANK": ranks, "SLURM_PROCID": ranks, "LOCAL_RANK": local, "NODE_RANK": nodes, "GROUP_RANK": nodes}
    for name, (bound, words) in bounds.items():
        if numbers.get(name, 0) >= bound:
            said.append(f"{name}={numbers[name]} is beyond {words}")
    claim = next((name for name in _RANK_ZERO_KEYS if name in given), None)
    flagged = {entry.split("=", 1)[0] for entry in said}  # a claim already out of range is said once
    rank = _trainer_rank(devices, world, numbers, slurm, env)
    if claim is not None and claim not in flagged and numbers[claim] != rank:
        said.append(
            f"{claim}={numbers[claim]} makes Lightning log as rank {numbers[claim]} a process the trainer runs as "
            f"rank {rank}, so nothing would be logged"
        )
    return said


def _trainer_rank(devices: int, world: int, numbers: dict[str, int], slurm: bool, env) -> int:
    """The global rank Lightning's trainer gives this process, from the cluster environment it would detect."""
    if world == 1:
        return 0  # a single-device strategy is rank 0, whatever the environment says
    if slurm:
        return numbers.get("SLURM_PROCID", 0)
    if "TORCHELASTIC_RUN_ID" in env:  # TorchElasticEnvironment: RANK itself
        return numbers.get("RANK", 0)
    node = numbers.get("NODE_RANK", numbers.get("GROUP_RANK", 0))  # LightningEnvironment
    return node * devices + numbers.get("LOCAL_RANK", 0)


def refuse_stray_launcher(devices: int, num_nodes: int, env=os.environ) -> None:
    """One line, before anything is built, when a launcher's variables disagree with the trainer (module doc)."""
    said = launch_disagreements(devices, num_nodes, env)
    if not said:
        return
    present = " ".join(name for name in LAUNCH_VARIABLES if name in env)
    raise ConfigError(
        f"this process's launcher variables disagree with --trainer.devices {devices} x --trainer.num_nodes "
        f"{num_nodes}: {'; '.join(said)}. Left over from a launcher (a torchrun or srun shell, a notebook kernel)? "
        f"`unset {present}`; under a launcher, give the devices and nodes it starts"
    )


# ------------------------------------------------------------------------------------------- torchrun's store

# How long a rank waits for rank 0 of the attempt it read before reading again (a dead attempt's never answers).
_ANSWER_S = 2.0


def store_of_this_attempt(timeout: timedelta, env=os.environ) -> int | None:
    """Under torchrun's shared store, point torch's env:// rendezvous at a store of this attempt's own; its port.

    The agent's store (TORCHELASTIC_USE_AGENT_STORE=True) outlives a restart with the dead attempt's addresses in
    it (pytorch/pytorch#135712), and TORCHELASTIC_RESTART_COUNT differs from node to node, so it cannot name the
    attempt. Rank 0 names a free port under a random token; each other rank proves the token live by a handshake
    under a nonce of its own, then all set MASTER_PORT to it with the agent store off (torch's rank 0 hosts a new
    store, as under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). None, nothing changed, outside that case.
    """
    world = int(env.get("WORLD_SIZE") or 1)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world <= 1:
        return None
    from torch.distributed import TCPStore

    from lmledger.fitting.peers import PeerFailure

    rank, where = int(env["RANK"]), f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    agent = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    space = f"lmledger/{env.get('TORCHELASTIC_RUN_ID', 'none')}/"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token, port = secrets.token_hex(8), _free_port()
        agent.set(f"{space}{token}/port", str(port))
        agent.set(f"{space}leader", token)
        for peer in range(1, world):
            joined = f"{space}{token}/join/{peer}"
            if not _appears(agent, joined, deadline):
                raise PeerFailure(f"rendezvous: rank 0 waited {timeout.total_seconds():.0f} s in torchrun's store at "
                                  f"{where} for rank {peer} of this attempt, which never came: "
                                  "wait longer with --trainer.strategy.timeout")  # fmt: skip
            agent.set(f"{space}{token}/welcome/{peer}/{agent.get(joined).decode()}", "1")
    else:
        nonce = secrets.token_hex(8)
        while True:
            token = agent.get(f"{space}leader").decode()  # perhaps a dead attempt's: its rank 0 never answers
            agent.set(f"{space}{token}/join/{rank}", nonce)
            if _appears(agent, f"{space}{token}/welcome/{rank}/{nonce}", min(deadline, time.monotonic() + _ANSWER_S)):
                break
            if time.monotonic() >= deadline:
                raise PeerFailure(f"rendezvous: rank {rank} waited {timeout.total_seconds():.0f} s in torchrun's store "
                                  f"at {where} for rank 0 of this attempt, which never answered: wait longer with "
                                  "--trainer.strategy.timeout")  # fmt: skip
        port = int(agent.get(f"{space}{token}/port").decode())
    env["MASTER_PORT"], env["TORCHELASTIC_USE_AGENT_STORE"] = str(port), "False"
    return port


def _appears(store, key: str, deadline: float) -> bool:
    """Whether `key` is in `store` by `deadline` (polled: a timed-out wait prints torch's socket warnings)."""
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _free_port() -> int:
    """A port free on this host now, for torch's rank 0 to host the store on (torch's own get_free_port does so)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
