"""Shared fixtures and helpers: one prepared stdlib corpus per test session, a scratch working directory,
CLI override lists for small fits, one intra-op thread, and readers for JSON output and TensorBoard scalars."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmledger.cli import main as lmledger

# The test folders mirror src/ (tests/ledger/, tests/callbacks/, ...) and name each other's modules: `from
# test_resume import fit_args`, `test_preemption.SelfTerm` as a --trainer.callbacks class path in a fit the
# test starts. Every test folder is importable here and in every process a test starts (PYTHONPATH).
TEST_DIRS = sorted({str(p.parent) for p in Path(__file__).resolve().parent.rglob("test_*.py")})
sys.path[:0] = [d for d in TEST_DIRS if d not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join([*TEST_DIRS, *filter(None, [os.environ.get("PYTHONPATH")])])

# A model small enough that a CLI fit takes a few seconds on 2 cores.
TINY_OVERRIDES = [
    "--model.config.d_model", "64",
    "--model.config.n_layers", "2",
    "--model.config.n_heads", "2",
    "--model.config.d_ff", "128",
    "--model.config.context_length", "64",
    "--data.batch_size", "8",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip
# Smaller still, with no validation and a log line every step: for tests that fit many times.
MICRO_OVERRIDES = [
    "--model.config.d_model", "32",
    "--model.config.n_layers", "1",
    "--model.config.n_heads", "2",
    "--model.config.d_ff", "64",
    "--model.config.context_length", "32",
    "--data.batch_size", "4",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.limit_val_batches", "0",
    "--trainer.log_every_n_steps", "1",
]  # fmt: skip


# `make test` runs the suite on two pytest-xdist workers, then the tests marked `alone` by themselves. A worker takes
# whole groups: a file, or the files named here together, which share a session fixture that must be set up once
# (one local SLURM; one launch of the plain FSDP2 ranks). A group's file must be listed (held at collection).
XDIST_GROUPS = {
    "slurm_cluster": ("tests/test_slurm.py", "tests/sweep/test_sweep_slurm_input.py",
                      "tests/sweep/test_sweep_multinode.py"),
    "plain_fsdp2_ranks": ("tests/callbacks/test_ledger_fsdp2.py", "tests/ledger/test_fsdp2_accumulate.py"),
}  # fmt: skip
# The longest groups (1-2 minutes each, all processes and waits), handed out first so no worker ends on one alone.
XDIST_FIRST = ("slurm_cluster", "tests/fitting/test_resume_matrix.py", "tests/fitting/test_multinode.py")
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    # execnet starts a worker with SIGINT ignored, which every process it starts would inherit: Python's own
    # handler back, so a Ctrl-C test sees what a shell gives. One intra-op thread each: two workers, two cores.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a plain `pytest` without the plugin runs serially
def pytest_xdist_make_scheduler(config, log):
    """Whole files to a worker, the files of one XDIST_GROUPS entry together (see above)."""
    from xdist.scheduler import LoadScopeScheduling

    group_of = {path: fixture for fixture, paths in XDIST_GROUPS.items() for path in paths}

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(path, path)

        def _assign_work_unit(self, node) -> None:
            for scope in reversed([s for s in XDIST_FIRST if s in self.workqueue]):
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    """A test using a grouped fixture sits in a file of its group; tests marked `cuda` skip without a CUDA GPU."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for fixture, paths in XDIST_GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()) and path not in paths:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add {path} to conftest.XDIST_GROUPS")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one intra-op thread is several times faster, and steadier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """one_intra_op_thread() for a whole module: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    with one_intra_op_thread():
        yield


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """os.environ back as it was after the test: a DDP fit in this process leaves Lightning's MASTER_PORT,
    MASTER_ADDR, WORLD_SIZE and ranks there, and every later test's subprocess ranks would inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    assert lmledger(["prepare", "--source", "stdlib", "--out", str(out)]) == 0
    return out


@pytest.fixture
def workdir(tmp_path, stdlib_data, monkeypatch) -> Path:
    """cwd = a fresh directory with configs/ and data/stdlib as a fresh checkout would see them."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stdlib").symlink_to(stdlib_data)
    (tmp_path / "configs").symlink_to(repo / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def plain_fsdp2_ranks(tmp_path_factory) -> dict[str, list[dict] | str]:
    """The 2-rank FSDP2 fits of a plain module (test_ledger_fsdp2's cases, test_fsdp2_accumulate's manual step),
    all in one launch: {case: each rank's Ledger figures, or why not (test_ledger_fsdp2.case_ranks)}. Imported
    here, when first asked for, so neither test module makes the other (nor the ranks they spawn) import
    Lightning."""
    from test_ledger_fsdp2 import launch_plain_fits

    return launch_plain_fits(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="session")
def gloo_ranks() -> Iterator[Callable[..., list]]:
    """spawn_gloo_ranks(target, world_size, *args) on gloo ranks started once per pytest process and world size
    (rank_pool.RankPool): the real-rank tests' launches without a process start each (3-5 CPU-s a launch)."""
    from rank_pool import RankPool

    pools: dict[int, RankPool] = {}

    def launch(target: Callable, world_size: int, *args: object) -> list:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:  # first asked for, or ended by a rank that raised
            pool = pools[world_size] = RankPool(world_size)
        return pool.launch(target, args)

    yield launch
    for pool in pools.values():
        pool.close()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """RLIMIT_FSIZE for this process: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored)."""
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def figures_of(doc: dict, source: str) -> dict:
    """One source's byte lines of the one JSON shape ({line: {source: bytes}}): {line: bytes}."""
    return {line: (by_source or {}).get(source) for line, by_source in doc["memory"].items()}


def one_error_line(capsys) -> str:
    """The one `lmledger ...: error:` line a refused in-process command wrote to stderr."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lmledger")]  # Lightning logs INFO lines too
    assert len(lines) == 1, err
    return lines[0]


def run_json(capsys, *argv: str) -> dict:
    """`lmledger ARGV` in-process, which must exit 0; its stdout parsed as one JSON object."""
    capsys.readouterr()
    assert lmledger(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def read_scalars(run_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in a TensorBoard run directory as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(run_dir: Path | str) -> list[Path]:
    """A run directory's TensorBoard event files, oldest first, by the wall time of each one's first event. The
    name's timestamp is whole seconds: two writers opened in one second tie there, and then come in directory order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    def opened(path: Path) -> float:
        return next(iter(EventFileLoader(str(path)).Load())).wall_time  # the file_version event, written at open

    return sorted(Path(run_dir).glob("events.out.tfevents.*"), key=opened)


# Subprocesses (the CLI as users run it) show every warning but these two, which Lightning prints on the tests'
# tiny runs. PYTHONWARNINGS matches a message's start, literally; UserWarning covers PossibleUserWarning.
SUBPROCESS_WARNINGS_HIDDEN = (
    "ignore:The number of training batches:UserWarning",  # fit_loop.py: fewer batches than log_every_n_steps
    "ignore:Be aware that when using `ckpt_path`:UserWarning",  # trainer/call.py: resuming or validating a checkpoint
)
os.environ.setdefault("PYTHONWARNINGS", ",".join(SUBPROCESS_WARNINGS_HIDDEN))
# The Ledger's step-time prediction (ledger/timing/steptime) replays each new model's ops several times before
# step 1: over the suite's hundreds of small fits that is minutes. tests/ledger/test_step_time.py turns it on
# where it is the subject; `lmledger account`, `plan` and `sweep --plan` predict regardless.
os.environ.setdefault("LMLEDGER_NO_STEP_TIME", "1")


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")


SLURM_NODES = 2  # the session's cluster: two slurmd on this host (n1, n2); the one-node tests run on it too


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[int]:
    """A SLURM on localhost (scripts/slurm-local.sh --nodes 2: nodes n1 and n2, each with this machine's CPUs), up
    once per session and down at its end unless it was already up; yields its node count. A cluster of ours
    already up with jobs queued is used as it is (a one-node one then skips the two-node tests). Skips in one
    line where the packages or root are missing; CI has both (.ci/run)."""
    import shutil
    import subprocess

    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM (scripts/slurm-local.sh) runs its daemons as root; this is not root")
    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm-local.sh"
    was_up = subprocess.run([script, "status"], capture_output=True).returncode == 0
    started = subprocess.run([script, "up", "--nodes", str(SLURM_NODES)], capture_output=True, text=True, timeout=180)
    if started.returncode != 0 and was_up:  # ours, busy with another session's jobs: take it as it is
        started = subprocess.run([script, "up"], capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr
    status = subprocess.run([script, "status"], capture_output=True, text=True, timeout=60)
    yield len(status.stdout.splitlines())
    if not was_up:
        subprocess.run([script, "down"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_cluster: int) -> int:
    """slurm_cluster with at least two nodes, else a one-line skip."""
    if slurm_cluster < 2:
        pytest.skip(f"the local SLURM runs {slurm_cluster} node (busy with jobs, so not restarted as two)")
    return slurm_cluster


def seeded_step_time_cache(cache_dir: Path, ranks: int = 2) -> Path:
    """A step-time cache for a multi-rank fit of 1-thread ranks, holding what other tests probe already: Lightning's
    loop (test_step_time.py, a minute of fits) and gloo's all-reduce at its seven sizes (test_sharded_step_time.py),
    so the fit's local rank 0 measures only the rest (the ranks' wait, its per-op costs) before they replay."""
    from lmledger.callbacks.steptime import loop_calibration_name
    from lmledger.ledger.timing.steptime.cache import STEP_TIMES_FILE, StepTimeCache
    from lmledger.ledger.timing.steptime.calibrate import gloo_calibration

    with one_intra_op_thread():
        one = StepTimeCache(torch.device("cpu"), cache_dir / STEP_TIMES_FILE)
        layout = StepTimeCache(torch.device("cpu"), cache_dir / STEP_TIMES_FILE, ranks=ranks)
    one.set_calibration(loop_calibration_name(False, True), {"base_s": 1e-3, "per_log_s": 1e-3}, "seeded")
    one.save()
    times = {str(4**k): 5e-4 * 2 ** (k - 6) for k in range(6, 13)}  # 4 KiB .. 16 MiB, as the probe takes them
    layout.set_calibration(gloo_calibration(ranks), {"alpha_s": 5e-4, "bytes_per_s": 1e9, "times": times}, "seeded")
    layout.save()
    return layout.path
