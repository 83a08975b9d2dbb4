"""Every strategy x every way a run is stopped and resumed, through the real CLI, bit for bit.

Strategies: one device, DDP over 2 gloo ranks, FSDP2 over 2 gloo ranks (a sharded checkpoint: a directory).
Stops: SIGTERM (the run saves the step it is in and exits 143) and SIGKILL of every rank in the middle of a
checkpoint save (the previous checkpoint must stay whole). Resumes: `--ckpt_path last`, an explicit path (for
fsdp2 the directory), `--ckpt_path auto`. Each resumed piece logs the uninterrupted run's train/loss and
train/lr exactly, with no step lost or repeated. The uninterrupted and the interrupted runs are made once per
strategy (module-scoped) and copied into each case's own directory.

Across layouts: a sharded checkpoint resumes on one device, and a single-file one under fsdp2, each loading
exactly the weights and optimizer moments that were saved (torch's own converter is the reference).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from conftest import MICRO_OVERRIDES, event_files, one_intra_op_thread, read_scalars
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger

TESTS = Path(__file__).resolve().parents[1]
MAX_STEPS = 6
EVERY = 2  # ModelCheckpoint saves last.ckpt after steps 2, 4 and 6
TERM_AT = 2  # SIGTERM as step 3 starts (global_step 2): the run finishes that step and saves step 3
KILL_AT = 4  # SIGKILL inside the save of step 4: step 2's checkpoint is the newest whole one
TAGS = ("train/loss", "train/lr")
STRATEGIES = {
    "single": [],
    "ddp": ["--trainer.strategy", "ddp", "--trainer.devices", "2"],
    "fsdp2": ["--trainer.strategy", "fsdp2", "--trainer.devices", "2"],
}
ELSEWHERE = {"fsdp2 on 1 rank": ["--trainer.strategy", "fsdp2", "--trainer.devices", "1"]}  # resumes only
NAME = "cut"
RUN = Path("runs", NAME, "version_0")
LAST = RUN / "checkpoints" / "last.ckpt"


def fit_args(strategy: str, *extra: str, command: str = "fit") -> list[str]:
    return [
        command, "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *{**STRATEGIES, **ELSEWHERE}[strategy],
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.callbacks.init_args.every_n_train_steps", str(EVERY),
        "--trainer.logger.init_args.name", NAME,
        "--ledger.enabled", "false",  # the ledger never changes the run (test_resume.py resumes with it); ~15% of a fit
        *extra,
    ]  # fmt: skip


def sharded_layout(path: Path) -> bool:
    """Whether `path` is a directory as ModelParallelStrategy saves one (the test's own reading, not the kit's)."""
    return path.is_dir() and {".metadata", "meta.pt"} <= {p.name for p in path.iterdir()}


def step_of(path: Path) -> int:
    """The global_step a checkpoint (a file, or a sharded directory's meta.pt) records."""
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True)["global_step"]


def callback(name: str, module: str = "test_resume_matrix", **init_args) -> str:
    args = ", ".join(f'"{k}": {v}' for k, v in init_args.items())
    return f'--trainer.callbacks+={{"class_path": "{module}.{name}", "init_args": {{{args}}}}}'


class KillInSave(pl.Callback):
    """Test-only: SIGKILLs every rank of the fit (its process group) halfway through the save after step
    `at_step`: rank 0 has written a checkpoint file (its shard, or the single file) and asks to fsync it."""

    def __init__(self, at_step: int) -> None:
        self.at_step, self.armed = at_step, False

    def setup(self, trainer, pl_module, stage) -> None:
        real = os.fsync

        def fsync(fd):
            if self.armed:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return real(fd)

        os.fsync = fsync  # this is a test-only subprocess, started in a session of its own

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.armed = trainer.global_step == self.at_step and trainer.global_rank == 0


class DumpState(pl.Callback):
    """Test-only: at the start of training (after the restore), rank 0 saves the whole model and optimizer
    state, keyed by parameter name (torch.distributed.checkpoint.state_dict, which gathers FSDP2 shards)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optimizer = get_state_dict(pl_module, trainer.optimizers, options=options)
        if trainer.is_global_zero:
            torch.save({"state_dict": model, "optimizer": optimizer}, self.out)


def fit(cwd: Path, strategy: str, *extra: str, command: str = "fit") -> tuple[int, str]:
    """`lmledger fit` in `cwd`: (exit code, stdout + stderr). One device runs in this process; two ranks (and any
    kill) in a subprocess of its own session, as Lightning's launcher re-runs the command line for rank 1."""
    argv = fit_args(strategy, *extra, command=command)
    if strategy == "single" and not any("KillInSave" in a for a in argv):
        raw = io.BytesIO()
        out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)  # `fit` reconfigures stdout: a real stream
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            with one_intra_op_thread():
                code = lmledger(argv)
        out.flush()
        return code, raw.getvalue().decode("utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "lmledger.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600, start_new_session=True,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def new_dir(root: Path, stdlib_data: Path) -> Path:
    root.mkdir(parents=True)
    (root / "data").mkdir()
    (root / "data" / "stdlib").symlink_to(stdlib_data)
    (root / "configs").symlink_to(TESTS.parent / "configs")
    return root


class Runs:
    """The uninterrupted, SIGTERMed and SIGKILLed runs of each strategy, each made once, in its own directory."""

    def __init__(self, root: Path, stdlib_data: Path) -> None:
        self.root, self.data, self.made = root, stdlib_data, {}

    def get(self, strategy: str, kind: str) -> Path:
        key = (strategy, kind)
        if key not in self.made:
            cwd = new_dir(self.root / f"{strategy}-{kind}", self.data)
            extra, expected = {
                "whole": ([], 0),
                "term": ([callback("SelfTerm", "test_preemption", at_step=TERM_AT)], 143),
                "kill": ([callback("KillInSave", at_step=KILL_AT)], -signal.SIGKILL),
            }[kind]
            code, out = fit(cwd, strategy, *extra)
            assert code == expected, out[-3000:]
            self.made[key] = (cwd, out)
        return self.made[key][0]

    def output(self, strategy: str, kind: str) -> str:
        self.get(strategy, kind)
        return self.made[(strategy, kind)][1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_data) -> Runs:
    return Runs(tmp_path_factory.mktemp("matrix"), stdlib_data)


def copy_of(runs: Runs, strategy: str, kind: str, workdir: Path) -> Path:
    shutil.copytree(runs.get(strategy, kind) / "runs", workdir / "runs", symlinks=True)
    return workdir


def curves(run_dir: Path) -> list[dict[str, dict[int, float]]]:
    """{tag: {step: value}} per event file of a run directory, oldest first."""
    files = event_files(run_dir)
    return [{tag: dict(points) for tag, points in read_scalars(f).items() if tag in TAGS} for f in files]


def assert_continues(reference: Path, pieces: list[dict], resumed_from: int, whole_run: bool) -> None:
    """Each piece equals the uninterrupted run exactly; the last covers resumed_from..MAX_STEPS-1; with
    whole_run, the pieces together hold every step once."""
    whole = curves(reference / RUN)[0]
    for piece in pieces:
        for tag in TAGS:
            assert piece[tag] == {s: whole[tag][s] for s in piece[tag]}, (tag, piece[tag], whole[tag])
    for tag in TAGS:
        assert sorted(pieces[-1][tag]) == list(range(resumed_from, MAX_STEPS)), tag
        if whole_run:
            assert sorted(s for piece in pieces for s in piece[tag]) == list(range(MAX_STEPS)), tag


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


CASES = ["sigterm-last", "sigterm-path", "sigkill-auto"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_stopped_run_resumes_bit_for_bit(runs, workdir, strategy, case):
    stop, mode = case.split("-")
    sharded = strategy == "fsdp2"
    reference = runs.get(strategy, "whole")
    assert sharded_layout(reference / LAST) == sharded and (reference / LAST).is_file() != sharded
    copy_of(runs, strategy, "term" if stop == "sigterm" else "kill", workdir)
    checkpoints = workdir / RUN / "checkpoints"
    if stop == "sigterm":
        said = [line for line in runs.output(strategy, "term").splitlines() if line.startswith("lmledger fit:")]
        assert said == [f"lmledger fit: preempted at step {TERM_AT + 1}: saved {LAST}; resume with --ckpt_path last"]
        resumed_from = TERM_AT + 1
    else:  # killed halfway through the save of step KILL_AT: its staged copy is torn, step KILL_AT - EVERY whole
        (staged,) = leftovers(checkpoints)
        assert staged.startswith(".last.ckpt.") and staged.endswith(".tmp"), staged
        resumed_from = KILL_AT - EVERY
    assert step_of(workdir / LAST) == resumed_from
    assert sharded_layout(workdir / LAST) == sharded

    ckpt = {"last": "last", "auto": "auto", "path": str(LAST)}[mode]
    code, out = fit(workdir, strategy, "--ckpt_path", ckpt)
    assert code == 0, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("lmledger fit:")]
    if mode == "path":  # an explicit checkpoint starts a new run directory, and leaves the old one as it was
        assert said == [f"lmledger fit: resuming from {LAST} at step {resumed_from}, in a new run directory"], out
        (piece,) = curves(workdir / "runs" / NAME / "version_1")
        assert_continues(reference, [piece], resumed_from, whole_run=False)
        final = workdir / "runs" / NAME / "version_1" / "checkpoints" / "last.ckpt"
    else:
        prefix = "--ckpt_path auto: " if mode == "auto" else ""
        assert said == [f"lmledger fit: {prefix}resuming {RUN} at step {resumed_from} from last.ckpt"], out
        pieces = curves(workdir / RUN)
        assert len(pieces) == 2
        assert_continues(reference, pieces, resumed_from, whole_run=stop == "sigterm")  # a kill may lose unflushed logs
        final = workdir / LAST
    assert step_of(final) == MAX_STEPS and sharded_layout(final) == sharded
    assert leftovers(checkpoints) == []  # the torn staging of the killed save is gone, nothing else staged
    assert "overwriting" not in out  # torch's warning when shards are written over a checkpoint in place


def test_validate_reads_a_sharded_checkpoint_builds_its_model_and_writes_nothing(runs, workdir):
    from test_fit_failures import snapshot

    copy_of(runs, "fsdp2", "term", workdir)
    before = snapshot(workdir / "runs")
    # The command line names another width: the checkpoint's hyperparameters build the model, as a file's do.
    other = ["--trainer.limit_val_batches", "2", "--model.config.d_model", "64"]
    for ckpt in ("last", str(LAST)):
        code, out = fit(workdir, "single", *other, "--ckpt_path", ckpt, command="validate")
        assert code == 0, out[-3000:]
        assert "val/loss" in out, out[-2000:]
    assert snapshot(workdir / "runs") == before


def _saved_by_torch(sharded: Path, out: Path) -> dict:
    """A sharded checkpoint read back by torch's own converter (torch.distributed.checkpoint.format_utils)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(sharded, out)
    return torch.load(out, weights_only=False)


def assert_same_state(loaded: dict, model: dict, optimizer: dict) -> None:
    assert sorted(loaded["state_dict"]) == sorted(model)
    for name, tensor in model.items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    assert sorted(loaded["optimizer"]["state"]) == sorted(optimizer["state"])
    for name, moments in optimizer["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded["optimizer"]["state"][name][key]), torch.as_tensor(value))
    steps = [float(m["step"]) for m in loaded["optimizer"]["state"].values()]
    assert steps and all(s > 0 for s in steps)  # the moments are a trained optimizer's, not a fresh one's


@pytest.mark.parametrize("target", ["single", "fsdp2 on 1 rank"])
def test_a_sharded_checkpoint_resumes_elsewhere_with_exactly_its_state(runs, workdir, target):
    """Saved by 2 FSDP2 ranks; resumed on one device (no sharding), or resharded onto 1 FSDP2 rank."""
    copy_of(runs, "fsdp2", "term", workdir)
    saved = _saved_by_torch(workdir / LAST, workdir / "reference.pt")
    code, out = fit(workdir, target, "--ckpt_path", "last", callback("DumpState", out='"loaded.pt"'))
    assert code == 0, out[-3000:]
    assert_same_state(torch.load(workdir / "loaded.pt"), saved["state_dict"], saved["optimizer_0"])
    # The resumed run's own save took the old directory's place whole: a single file on one device.
    assert sharded_layout(workdir / LAST) == (target != "single")
    assert step_of(workdir / LAST) == MAX_STEPS
    assert leftovers(workdir / RUN / "checkpoints") == []


def test_a_single_file_checkpoint_resumes_under_fsdp2_with_exactly_its_state(runs, workdir):
    copy_of(runs, "single", "term", workdir)
    # The reference: the same file restored on one device by Lightning and torch's optimizer.load_state_dict.
    code, out = fit(workdir, "single", "--ckpt_path", str(LAST), callback("DumpState", out='"one.pt"'))
    assert code == 0, out[-3000:]
    one = torch.load(workdir / "one.pt")
    code, out = fit(workdir, "fsdp2", "--ckpt_path", str(LAST), callback("DumpState", out='"fsdp2.pt"'))
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    assert_same_state(torch.load(workdir / "fsdp2.pt"), one["state_dict"], one["optimizer"])
    # The two resumes trained in version_1 and version_2; the fsdp2 one saved a sharded checkpoint.
    last = workdir / "runs" / NAME / "version_2" / "checkpoints" / "last.ckpt"
    assert sharded_layout(last) and step_of(last) == MAX_STEPS


def test_a_damaged_shard_is_refused_in_one_line_and_the_run_is_left_as_it_was(runs, workdir):
    from test_fit_failures import snapshot

    copy_of(runs, "fsdp2", "term", workdir)
    shard = workdir / LAST / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # rank 1's shard cut short
    before = snapshot(workdir / "runs")
    code, out = fit(workdir, "fsdp2", "--ckpt_path", "last")
    assert code == 2, out[-3000:]
    errors = {line for line in out.splitlines() if line.startswith("lmledger fit: error:")}
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    (line,) = errors
    assert line.startswith(f"lmledger fit: error: checkpoint {LAST} cannot be loaded into this run ("), line
    # No config-resumed.yaml, no event file, the checkpoint as it was. (The lock file names its last holder.)
    after = snapshot(workdir / "runs")
    assert {k: v for k, v in after.items() if not k.endswith("lmledger.lock")} == {
        k: v for k, v in before.items() if not k.endswith("lmledger.lock")
    }


def test_a_run_directorys_pieces_are_read_in_the_order_they_were_written(tmp_path):
    """One device's stop and resume run in this process: their event files can share the name's whole-second
    timestamp (single-sigterm-last read the resumed piece first in some runs). Order is the first event's time,
    whatever the names say: here the older file's name is given the later second."""
    from torch.utils.tensorboard import SummaryWriter

    for step, second in ((0, 1796176218), (3, 1796176217)):
        writer = SummaryWriter(tmp_path / "w")
        writer.add_scalar("train/loss", float(step), step)
        writer.close()
        (written,) = (tmp_path / "w").iterdir()
        written.rename(tmp_path / f"events.out.tfevents.{second}.vm.1.{step}")
    assert [next(iter(curve["train/loss"])) for curve in curves(tmp_path)] == [0, 3]


def test_torch_loads_distributed_checkpoints_through_private_names():
    """Canary: lmledger.checkpointing reads a sharded checkpoint in one process through torch's private
    _EmptyStateDictLoadPlanner and _load_state_dict (as format_utils.dcp_to_torch_save does), and torch's
    DefaultLoadPlanner.load_bytes unpickles with weights_only=False (so lmledger checks the values first)."""
    import inspect

    from torch.distributed.checkpoint._nested_dict import set_element  # noqa: F401
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    assert "no_dist" in inspect.signature(_load_state_dict).parameters
    assert "keys" in inspect.signature(_EmptyStateDictLoadPlanner).parameters
    assert "weights_only=False" in inspect.getsource(DefaultLoadPlanner.load_bytes)


# ------------------------------------------------------------------ the swap itself, cut at every point (no fit)


def fake_sharded(path: Path, step: int) -> Path:
    """A sharded checkpoint as ModelParallelStrategy lays it out: DCP shards and index, then Lightning's meta.pt."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"w": torch.full((4,), float(step))}, "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": step, "hyper_parameters": {}}, path / "meta.pt")
    return path


# Where a kill can land. With renameat2's swap there is no point between the renames: it is one.
CUTS = [
    (True, "while staged"),
    (True, "before the old one is deleted"),
    (False, "while staged"),
    (False, "after the first rename"),
    (False, "before the old one is deleted"),
]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant here
@pytest.mark.parametrize(("can_swap", "cut"), CUTS, ids=[f"{'swap' if a else 'no swap'}, {b}" for a, b in CUTS])
def test_a_sharded_save_cut_anywhere_leaves_a_whole_checkpoint_for_auto(tmp_path, monkeypatch, can_swap, cut):
    from lmledger import atomic
    from lmledger.checkpointing import newest_checkpoint

    last = fake_sharded(tmp_path / "last.ckpt", 2)
    staged = atomic.temp_path(last)
    if not can_swap:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    if cut == "while staged":  # the shards written, meta.pt not yet: the index alone does not make it whole
        import torch.distributed.checkpoint as dcp

        dcp.save({"state_dict": {"w": torch.zeros(4)}}, checkpoint_id=staged, no_dist=True)
    else:
        fake_sharded(staged, 4)

        class Killed(BaseException):
            pass

        real_rename, real_remove, renames = os.rename, atomic.remove_path, []

        def rename(a, b):
            renames.append((a, b))
            if cut == "after the first rename" and len(renames) == 2:
                raise Killed
            real_rename(a, b)

        def remove(path):
            if cut == "before the old one is deleted":
                raise Killed
            real_remove(path)

        monkeypatch.setattr(atomic.os, "rename", rename)
        monkeypatch.setattr(atomic, "remove_path", remove)
        with pytest.raises(Killed):
            atomic.publish(staged, last)
        monkeypatch.undo()
    found = newest_checkpoint(tmp_path)
    assert found is not None and step_of(found) in (2, 4)
    if cut == "while staged":
        assert step_of(found) == 2 and found == last  # the swap never happened
    if cut == "after the first rename":  # last.ckpt is gone for now; its copy moved aside is whole
        assert not last.exists() and found.name.endswith(".old") and step_of(found) == 2
        # A later save's clean-up keeps that copy while it is the only one (even once its writer is dead).
        dead = found.with_name(f".last.ckpt.{2**22 + 12345}.{'a' * 12}.old")
        os.rename(found, dead)
        assert atomic.remove_stale_temps(tmp_path, ["last.ckpt"]) == [] or dead.exists()
        assert dead.exists() and newest_checkpoint(tmp_path) == dead
    if cut == "before the old one is deleted":
        assert found == last and step_of(found) == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_that_pickles_code_is_refused_before_anything_runs(tmp_path):
    import pickle

    from lmledger.errors import UserError

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    ckpt = fake_sharded(tmp_path / "last.ckpt", 2)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UserError, match="refused for safety") as err:
        open_checkpoint(ckpt)
    assert "\n" not in str(err.value) and not ran.exists()


def test_a_directory_that_is_no_whole_checkpoint_is_one_line(tmp_path):
    from lmledger.errors import UserError

    torn = tmp_path / "last.ckpt"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"shard")
    with pytest.raises(UserError, match=r"is a directory without \.metadata and meta\.pt: not a whole sharded"):
        open_checkpoint(torn)
