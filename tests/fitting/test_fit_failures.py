"""Crash-safe checkpoints, the NaN guard, per-batch seeding, and every bad input the kit knows about.

Bad inputs go through `lmledger.cli.main` in-process; each must give one line on stderr, exit 2, no
traceback, and leave every file already on disk as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import MICRO_OVERRIDES, file_size_limit, read_scalars
from lmledger.callbacks.nonfinite import NonFiniteGuard
from lmledger.checkpointing import (
    AtomicCheckpointIO,
    atomic_write,
    make_last_checkpoint_atomic,
    open_checkpoint,
)
from lmledger.cli import main as lmledger
from lmledger.errors import UserError
from lmledger.seeding import StepSeeder

# Lightning's seed_everything logs this info line before any class is built; it is not part of an error.
SEED_LINE = re.compile(r"^Seed set to \d+$")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread


def fit(*extra: str) -> int:
    return lmledger(["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *extra])


def one_error_line(capsys, command: str = "fit", after_training: bool = False) -> str:
    """The single error line on stderr; a run that trained first may have logged warnings before it."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and not SEED_LINE.match(line)]
    if after_training:
        assert sum(line.startswith("lmledger ") for line in lines) == 1, err
        lines = lines[-1:]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lmledger {command}: error: "), lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every regular file under root (symlinked dirs followed), keyed by relative path."""
    hashes = {}
    for dirpath, _, files in os.walk(root, followlinks=True):
        for name in files:
            path = Path(dirpath, name)
            hashes[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def assert_nothing_overwritten(before: dict[str, str], root: Path) -> None:
    after = snapshot(root)
    changed = [k for k, digest in before.items() if after.get(k) != digest]
    assert not changed, f"changed or removed: {changed}"


# ------------------------------------------------------------------------------- atomic saves


def _save_forever(path: Path, payloads: list[torch.Tensor]) -> None:
    """Child process: overwrite `path` with checkpoint i (payload i % 2, filled with 1 or 2) until killed."""
    io = AtomicCheckpointIO()
    i = 0
    while True:
        io.save_checkpoint({"i": i, "state_dict": {"w": payloads[i % 2]}}, path)
        i += 1


def test_killed_saves_never_leave_a_torn_checkpoint(tmp_path):
    # 16 MiB per save: long enough that most kills land mid-write. The payloads are built here, before
    # fork, so the child only serializes (no intra-op thread pool after fork).
    payloads = [torch.full((4 * 2**20,), float(v)) for v in (1, 2)]
    path = tmp_path / "last.ckpt"
    rng = random.Random(0)
    survived, torn_writes_left = 0, 0
    deadline = time.monotonic() + 25
    trials = 0
    while trials < 20 and time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:  # child
            try:
                _save_forever(path, payloads)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        trials += 1
        torn_writes_left += any(tmp_path.glob(".last.ckpt.*.tmp"))
        # Once a checkpoint exists, no kill may take it away; whatever is there loads whole.
        assert path.exists() or survived == 0
        if path.exists():
            checkpoint = open_checkpoint(path)  # raises UserError if damaged
            assert torch.equal(checkpoint["state_dict"]["w"], payloads[checkpoint["i"] % 2]), checkpoint["i"]
            survived += 1
    assert trials >= 20 and survived >= 1, (trials, survived)
    # The kills did interrupt writes in progress (their temp files are the evidence)...
    assert torn_writes_left >= 1, (torn_writes_left, trials)
    # ...and the next save clears what a killed writer left.
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_link_mode_last_checkpoint_becomes_a_full_save():
    link = ModelCheckpoint(save_last="link", save_top_k=1, monitor="x")
    already_full = ModelCheckpoint(save_last="link", save_top_k=0)  # Lightning links only with top-k files
    make_last_checkpoint_atomic([link, already_full])
    assert link.save_last is True
    assert already_full.save_last == "link"


def test_checkpoint_loading_runs_no_pickled_code(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, evil)
    with pytest.raises(UserError, match="refused for safety"):
        open_checkpoint(evil)
    with pytest.raises(UserError, match="refused for safety"):
        AtomicCheckpointIO().load_checkpoint(evil)
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the control: an unrestricted load does run it
    assert marker.exists()


# ---------------------------------------------------------------------------- per-batch seeds


class _DrawsModule(pl.LightningModule):
    """Records one torch, numpy and python random draw per training step, as dropout would consume them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.draws: dict[int, tuple[float, float, float]] = {}

    def training_step(self, batch, batch_idx):
        self.draws[self.global_step] = (torch.rand(()).item(), np.random.rand(), random.random())
        return (self.w * batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        torch.rand(3)  # validation consumes random numbers between steps too

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _draws(ckpt_dir: Path, seeder: bool, max_steps: int, resume: Path | None = None) -> dict:
    pl.seed_everything(7, verbose=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(64, 4)), batch_size=1)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, filename="{step}")]
    if seeder:
        callbacks.append(StepSeeder())
    trainer = pl.Trainer(
        max_steps=max_steps, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    module = _DrawsModule()
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data, ckpt_path=resume)
    return module.draws


@pytest.mark.parametrize("seeder", [True, False])
def test_resumed_run_draws_the_same_random_numbers(tmp_path, monkeypatch, seeder):
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after seed_everything overwrites it
    whole = _draws(tmp_path / "a", seeder, max_steps=8)
    resumed = _draws(tmp_path / "b", seeder, max_steps=8, resume=tmp_path / "a" / "step=3.ckpt")
    assert sorted(resumed) == list(range(3, 8))
    same = all(resumed[s] == whole[s] for s in resumed)
    # Without the seeder the generators carry on from wherever the new process left them: the control.
    assert same is seeder


# ----------------------------------------------------------------------------- non-finite loss


class InjectNaN(pl.Callback):
    """Test-only fault: the model's loss is multiplied by NaN at the given steps."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps
        self._hook = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self._hook = pl_module.model.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _inject_nan(steps: list[int]) -> list[str]:
    spec = {"class_path": f"{__name__}.InjectNaN", "init_args": {"steps": steps}}
    return ["--trainer.callbacks+=" + json.dumps(spec)]


def _every(n: int) -> list[str]:
    return ["--trainer.callbacks.init_args.every_n_train_steps", str(n)]


def test_nan_loss_stops_with_one_line_naming_step_and_checkpoint(workdir, capsys):
    assert fit("--trainer.max_steps", "10", *_every(5), *_inject_nan([6])) == 2
    line = one_error_line(capsys, after_training=True)
    ckpt = Path("runs/tiny/version_0/checkpoints/last.ckpt")
    assert "step 6: loss is nan" in line and f"{ckpt} (step 5)" in line, line
    checkpoint = open_checkpoint(ckpt)
    assert checkpoint["global_step"] == 5
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values())
    losses = dict(read_scalars("runs/tiny/version_0")["train/loss"])
    assert sorted(losses) == list(range(6)) and all(math.isfinite(v) for v in losses.values())


def test_diverging_lr_stops_the_run(workdir, capsys):
    # The real-world cause: a learning rate so large the first update blows the weights up.
    assert fit("--trainer.max_steps", "10", "--model.lr", "1e30", "--model.warmup_steps", "1") == 2
    line = one_error_line(capsys, after_training=True)
    assert re.search(r"step [1-9]: (loss is (nan|inf)|gradient norm is (nan|inf))", line), line
    assert "No checkpoint was saved before it" in line


def test_skips_up_to_max_skips_then_stops(workdir, capsys):
    assert fit("--trainer.max_steps", "10", *_every(5), *_inject_nan([3, 5, 7]), "--nonfinite.max_skips", "2") == 2
    line = one_error_line(capsys, after_training=True)
    assert "step 7: loss is nan" in line and "2 earlier non-finite steps skipped" in line, line
    scalars = read_scalars("runs/tiny/version_0")
    losses = dict(scalars["train/loss"])
    # Steps 4 and 6 are finite again: a skipped step left the weights clean.
    assert [s for s, v in sorted(losses.items()) if not math.isfinite(v)] == [3, 5]
    # A dropped update has no gradient norm (not the previous step's, which Lightning would repeat).
    assert [s for s, v in scalars["train/grad_norm"] if not math.isfinite(v)] == [3, 5]
    checkpoint = open_checkpoint("runs/tiny/version_0/checkpoints/last.ckpt")
    assert checkpoint["global_step"] == 5
    # AdamW stepped for steps 0-4 except the skipped step 3: the update was really dropped.
    adam_steps = {float(s["step"]) for s in checkpoint["optimizer_states"][0]["state"].values()}
    assert adam_steps == {4.0}
    guard_state = [v for k, v in checkpoint["callbacks"].items() if k.startswith("NonFiniteGuard")]
    assert guard_state == [{"skipped": 1}]


def test_max_skips_must_not_be_negative():
    with pytest.raises(UserError, match="max_skips"):
        NonFiniteGuard(max_skips=-1)


# --------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """A prepared corpus of a dozen small files, whose val split holds a few dozen tokens."""
    src = tmp_path_factory.mktemp("src")
    for i in range(12):
        (src / f"m{i:02d}.py").write_text(f"x = {i}\n" * (4 + i))
    out = tmp_path_factory.mktemp("prepared") / "small"
    assert lmledger(["prepare", "--source", str(src), "--out", str(out), "--val-fraction", "0.1"]) == 0
    return out


def _corrupt_meta(**changes):
    def corrupt(root: Path) -> None:
        meta = json.loads((root / "meta.json").read_text())
        meta.update(changes)
        (root / "meta.json").write_text(json.dumps(meta))

    return corrupt


def _truncate(root: Path) -> None:
    with open(root / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 7)


def _double_width(root: Path) -> None:
    # Same token count in meta.json, but the bytes were written as uint16.
    tokens = np.fromfile(root / "train.bin", dtype=np.uint8).astype(np.uint16)
    tokens.tofile(root / "train.bin")


DATA_FAULTS = {
    "missing dir": (lambda root: shutil.rmtree(root), "does not exist"),
    "missing meta.json": (lambda root: (root / "meta.json").unlink(), "has no meta.json"),
    "truncated bin": (_truncate, "truncated"),
    "wrong dtype": (_double_width, "written with another dtype"),
    "ids >= vocab": (_corrupt_meta(vocab_size=60), "holds token id"),
    "meta not json": (lambda root: (root / "meta.json").write_text("{oops"), "not valid JSON"),
}


@pytest.mark.parametrize("fault", DATA_FAULTS, ids=list(DATA_FAULTS))
def test_bad_data_is_one_line(workdir, small_data, capsys, fault):
    damage, expected = DATA_FAULTS[fault]
    data = workdir / "bad"
    shutil.copytree(small_data, data)
    damage(data)
    before = snapshot(workdir)
    assert fit("--data.path", str(data)) == 2
    assert expected in one_error_line(capsys)
    assert_nothing_overwritten(before, workdir)
    assert not (workdir / "runs").exists()


def test_data_too_short_for_the_context(workdir, small_data, capsys):
    before = snapshot(workdir)
    assert fit("--data.path", str(small_data), "--model.config.context_length", "512") == 2
    line = one_error_line(capsys)
    assert "context_length 512 needs 513 tokens but the val split" in line, line
    assert_nothing_overwritten(before, workdir)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.config.d_modell", "3"], "unrecognized arguments: --model.config.d_modell"),
        (["--model.lr", "fast"], "--model.lr fast: expected a float"),
        (["--trainer.max_steps", "1.5"], "--trainer.max_steps 1.5: expected an int"),
        (["--model.lr"], "expected one argument"),
        (["--config", "configs/nope.yaml"], "nope.yaml"),
        (["--model.config.d_model", "30", "--model.config.n_heads", "4"], "d_model (30) must be divisible by n_heads"),
        (["--trainer.accelerator", "gpu"], "--trainer.accelerator gpu: this machine has no usable CUDA GPU"),
        (["--trainer.accelerator", "cuda"], "--trainer.accelerator cuda: this machine has no usable CUDA GPU"),
        (["--nonfinite.max_skips", "-1"], "nonfinite.max_skips must be >= 0"),
        (["--trainer.accelerator", "cpu", "--trainer.strategy", "fsdp", "--trainer.devices", "2"],
         "The strategy `fsdp` requires a GPU accelerator"),
        (["--trainer.devices", "0"], "--trainer.devices must be a count >= 1"),
        (["--trainer.devices", "-3"], "--trainer.devices must be a count >= 1"),
        (["--trainer.gradient_clip_val", "-1"], "--trainer.gradient_clip_val must be >= 0"),
        (["--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches must be an integer >= 1"),
        (["--model.min_lr_ratio", "5"], "model.min_lr_ratio must be between 0 and 1"),
        (["--model.lr", "-1"], "model.lr must be a finite number > 0, got -1"),
        (["--model.lr", ".nan"], "model.lr must be a finite number > 0, got nan"),
        (["--ckpt_path", "best"], "--ckpt_path best: there is no 'best' checkpoint"),
        (["--ckpt_path", "hpc"], "--ckpt_path hpc: there is no 'hpc' checkpoint"),
        (["--ckpt_path", "https://example.com/x.ckpt"], "remote checkpoints are not supported here"),
        (["--ckpt_path", "s3://bucket/x.ckpt"], "remote checkpoints are not supported here"),
    ],
    ids=["unknown key", "wrong type", "int expected", "missing value", "missing config", "invalid shape", "gpu", "cuda",
         "negative skips", "fsdp on cpu", "zero devices", "negative devices", "negative clip", "zero accumulation",
         "min_lr_ratio 5", "negative lr", "nan lr", "best", "hpc", "https", "s3"],
)  # fmt: skip
def test_bad_config_is_one_line(workdir, capsys, args, expected):
    if args[:1] == ["--trainer.accelerator"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    before = snapshot(workdir)
    assert fit(*args) == 2
    assert expected in one_error_line(capsys)
    assert_nothing_overwritten(before, workdir)
    assert not (workdir / "runs").exists()


def test_unknown_key_in_a_config_file(workdir, capsys):
    Path("extra.yaml").write_text("model:\n  learning_rate: 0.1\n")
    assert fit("--config", "extra.yaml") == 2
    assert "learning_rate" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("fragment", "expected"),
    [
        ("data: [1, 2]\n", "config extra.yaml: `data` must be a mapping of settings"),
        ("model: {config: 5}\n", "config extra.yaml: `model.config` must be a mapping of settings"),
        ("trainer: 3\n", "config extra.yaml: `trainer` must be a mapping of settings"),
    ],
    ids=["data list", "model.config int", "trainer int"],
)
def test_a_config_section_that_is_not_a_mapping(workdir, capsys, fragment, expected):
    # jsonargparse reset `data: [1, 2]` to the class defaults and trained on them; `config: 5` blamed context_length.
    Path("extra.yaml").write_text(fragment)
    assert fit("--config", "extra.yaml", "--trainer.max_steps", "1") == 2
    assert expected in one_error_line(capsys)
    assert not (workdir / "runs").exists()


def test_a_data_path_that_is_not_utf8(workdir, small_data, capsys):
    name = os.fsdecode(b"data-\xff")  # a byte that is no UTF-8, as a Latin-1 file name arrives in sys.argv
    os.symlink(small_data, workdir / name)
    assert fit("--data.path", name, "--trainer.max_steps", "1") == 2
    assert "is not valid UTF-8" in one_error_line(capsys)
    assert not (workdir / "runs").exists()


def test_validate_needs_a_checkpoint(workdir, capsys):
    assert lmledger(["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES]) == 2
    assert "validate needs --ckpt_path" in one_error_line(capsys, "validate")
    assert not (workdir / "runs").exists()  # no empty training-run version either


@pytest.fixture
def trained(workdir) -> Path:
    """A short run's last.ckpt (d_model 32) in the working directory."""
    assert fit("--trainer.max_steps", "2") == 0
    return workdir / "runs/tiny/version_0/checkpoints/last.ckpt"


def _runs(root: Path) -> dict[str, str]:
    """Every path under root/runs: a link by its target (links not followed), a file by its sha256, a folder as one."""
    out = {}
    for path in sorted((root / "runs").rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def test_a_last_checkpoint_whose_link_dangles_is_refused_and_nothing_changes(trained, workdir, capsys):
    """Issue 49 §3: the run's checkpoints/last.ckpt a symbolic link whose target a clean-up removed. `auto` started
    the run over from step 0, exit 0, writing into its directory; `last` said there was nothing to resume."""
    trained.unlink()
    trained.symlink_to(workdir / "scratch" / "last.ckpt")  # gone
    before = _runs(workdir)
    for command, ckpt in (("fit", "auto"), ("fit", "last"), ("validate", "last")):
        assert lmledger([command, "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--ckpt_path", ckpt]) == 2
        line = one_error_line(capsys, command)
        assert line == (
            f"lmledger {command}: error: --ckpt_path {ckpt}: {trained.relative_to(workdir)} is a symbolic link to "
            f"{workdir / 'scratch' / 'last.ckpt'}, which does not exist (moved or deleted); nothing was changed: "
            "restore its target, or remove the link to resume from the run's other checkpoints (with none, the run "
            "starts over)"
        ), line
        assert _runs(workdir) == before


def test_a_fresh_fit_pinned_into_a_finished_run_is_refused(trained, workdir, capsys):
    """Issue 49 §3: `--trainer.logger.init_args.version 0` without --ckpt_path, where version_0 holds a finished
    run: the fit exited 0 after writing into it (a second curve in its event file, its last.ckpt replaced)."""
    before = _runs(workdir)
    for version in ("0", "version_0"):  # the version's number, or its directory's name
        assert fit("--trainer.max_steps", "2", "--trainer.logger.init_args.version", version) == 2
        line = one_error_line(capsys)
        assert line.startswith(
            f"lmledger fit: error: --trainer.logger.init_args.version {version}: runs/tiny/version_0 already holds a "
            "run (checkpoints, config.yaml, events.out.tfevents."
        ), line
        assert line.endswith("a fit without --ckpt_path never writes into one; drop the version to start the next "
                             "free one (--ckpt_path last resumes the newest run of this name in place)")  # fmt: skip
        assert _runs(workdir) == before
    # a version of its own is taken
    assert fit("--trainer.max_steps", "2", "--trainer.logger.init_args.version", "7") == 0
    assert (workdir / "runs/tiny/version_7/checkpoints/last.ckpt").is_file()


def test_a_fit_without_a_logger_keeps_to_its_own_root(workdir, capsys, caplog, monkeypatch):
    """`--trainer.logger false` writes config.yaml, checkpoints/ and ranks/ straight into --trainer.default_root_dir.
    A second fit there ended in Lightning's SaveConfigCallback traceback, and so did its resume; `--ckpt_path last`
    was left to Lightning, which restored step 2's finished epoch and trained nothing more, exit 0."""
    root = workdir / "bare"
    bare = ("--trainer.logger", "false", "--trainer.default_root_dir", str(root))
    assert fit(*bare, "--trainer.max_steps", "2") == 0
    first = {p.name for p in root.iterdir()}
    assert first == {"checkpoints", "config.yaml", "ranks"}
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    elsewhere = workdir / "elsewhere.ckpt"
    shutil.copy(root / "checkpoints/last.ckpt", elsewhere)
    for resumed in ((), ("--ckpt_path", str(elsewhere))):  # a fresh fit, and one resuming another run's checkpoint
        assert fit(*bare, "--trainer.max_steps", "3", *resumed) == 2
        line = one_error_line(capsys)
        assert line.startswith(f"lmledger fit: error: --trainer.logger false: this fit writes straight into {root} "
                               "(--trainer.default_root_dir, no version directory), which already holds a run "
                               "(checkpoints, config.yaml, ranks), and a fit "), line  # fmt: skip
        assert line.endswith("never writes into one; pass a new --trainer.default_root_dir, or keep a logger (each "
                             "run then gets a version directory of its own)"), line  # fmt: skip
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files
    # the run kept there resumes in place: its config beside the first, its checkpoint a step further
    assert fit(*bare, "--trainer.max_steps", "3", "--ckpt_path", "last") == 0
    assert f"lmledger fit: resuming {root} at step 2 from last.ckpt" in capsys.readouterr().out
    assert (root / "config.yaml").read_bytes() == files[root / "config.yaml"]
    assert (root / "config-resumed.yaml").is_file()
    assert torch.load(root / "checkpoints/last.ckpt", weights_only=False)["global_step"] == 3
    # so does `auto` (a requeued job's): it had refused any run without a logger's version directories
    assert fit(*bare, "--trainer.max_steps", "4", "--ckpt_path", "auto") == 0
    assert f"lmledger fit: --ckpt_path auto: resuming {root} at step 3 from last.ckpt" in capsys.readouterr().out
    assert (root / "config-resumed-2.yaml").is_file()
    # validate's `last` is this run's too: Lightning's looked in validate's no checkpoint directory and evaluated
    # untrained weights, exit 0
    validate = ["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *bare, "--ckpt_path", "last"]
    with caplog.at_level(logging.INFO):
        assert lmledger(validate) == 0
    assert f"Loaded model weights from the checkpoint at {root}/checkpoints/last.ckpt" in caplog.text
    # a root that cannot be a directory: FileExistsError and FileNotFoundError tracebacks from Lightning's makedirs
    (workdir / "afile").write_text("")
    for where, expected in (("afile", "--trainer.default_root_dir afile is a file, not a directory"),
                            ("afile/run", "not a directory while writing afile/run; nothing was written; pass a "
                                          "writable --trainer.default_root_dir")):  # fmt: skip
        assert fit("--trainer.logger", "false", "--trainer.default_root_dir", where, "--trainer.max_steps", "2") == 2
        assert expected in one_error_line(capsys)
    # barebones: what it turns off, named at once by flag (Lightning refused them one a try, the logger by its repr);
    # then it runs without a logger, its root held as one with none (no "keep a logger": barebones has none)
    assert fit("--trainer.barebones", "true") == 2
    assert one_error_line(capsys).endswith(
        "this config asks for some: a logger (--trainer.logger false); "
        "--trainer.log_every_n_steps 1 (set it to 0); a ModelCheckpoint in "
        "--trainer.callbacks (drop it: --trainer.callbacks '[]' drops them all)"
    )
    quick = ("--trainer.barebones", "true", "--trainer.logger", "null", "--trainer.log_every_n_steps", "0",
             "--trainer.callbacks", "[]", "--trainer.default_root_dir", "quick",
             "--trainer.max_steps", "2")  # fmt: skip
    calls: list[bool] = []  # torch.set_flush_denormal's, recorded, not made: this process runs on
    monkeypatch.setattr(torch, "set_flush_denormal", lambda mode: calls.append(mode) or True)
    assert fit(*quick) == 0
    assert [p.name for p in (workdir / "quick").iterdir()] == ["config.yaml"]
    assert calls == []  # flushing subnormals is opt-in
    assert fit(*quick) == 2
    assert one_error_line(capsys).endswith("never writes into one; pass a new --trainer.default_root_dir")
    # fast_dev_run writes no run files: Lightning's ModelCheckpoint saved last.ckpt at train end all the same (one
    # more last-vN.ckpt each try), and the Ledger its ranks/ record, into the working directory
    before = {p for p in workdir.rglob("*")}
    assert fit("--trainer.fast_dev_run", "true") == 0
    assert {p for p in workdir.rglob("*")} == before
    # --flush_denormal true: FTZ/DAZ set before the model is built, and kept in config.yaml for a resume
    assert fit(*quick, "--trainer.default_root_dir", "flushed", "--flush_denormal", "true") == 0
    assert calls == [True]
    assert "flush_denormal: true" in (workdir / "flushed" / "config.yaml").read_text()


def test_lightnings_default_logger_is_resumed_and_validated_as_a_configured_one(workdir, capsys, caplog):
    """`--trainer.logger null` is Lightning's default TensorBoardLogger in default_root_dir/lightning_logs. Left to
    Lightning, `--ckpt_path last` looked in the new version, found nothing and started over (fit) or evaluated
    untrained weights (validate), with a warning and exit 0; `auto` refused it as another logger's layout."""
    default = ("--trainer.logger", "null", "--trainer.default_root_dir", "bare")
    assert fit(*default, "--trainer.max_steps", "2") == 0
    run = Path("bare/lightning_logs/version_0")
    assert (run / "checkpoints/last.ckpt").is_file()
    capsys.readouterr()
    for ckpt, step in (("last", 3), ("auto", 4)):
        assert fit(*default, "--trainer.max_steps", str(step), "--ckpt_path", ckpt) == 0
        assert f"resuming {run} at step {step - 1} from last.ckpt" in capsys.readouterr().out
    assert not (workdir / "bare/lightning_logs/version_1").exists()
    validate = ["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *default, "--ckpt_path", "last"]
    with caplog.at_level(logging.INFO):
        assert lmledger(validate) == 0
    assert f"Loaded model weights from the checkpoint at {run}/checkpoints/last.ckpt" in caplog.text
    # `true` asks for the same logger by name
    named = ("--trainer.logger", "true", "--trainer.default_root_dir", "bare")
    assert fit(*named, "--trainer.max_steps", "5", "--ckpt_path", "last") == 0
    assert f"resuming {run} at step 4 from last.ckpt" in capsys.readouterr().out


def test_bad_checkpoints_are_one_line(trained, workdir, capsys):
    truncated = workdir / "truncated.ckpt"
    truncated.write_bytes(trained.read_bytes()[: trained.stat().st_size // 2])
    garbage = workdir / "garbage.ckpt"
    garbage.write_bytes(os.urandom(4096))
    not_lightning = workdir / "plain.ckpt"
    torch.save({"weights": torch.ones(2)}, not_lightning)
    before = snapshot(workdir)
    cases = [
        ("fit", "missing.ckpt", "checkpoint missing.ckpt does not exist"),
        ("fit", str(truncated), f"checkpoint {truncated} cannot be read"),
        ("validate", str(truncated), f"checkpoint {truncated} cannot be read"),
        ("fit", str(garbage), f"checkpoint {garbage} cannot be read"),
        ("validate", str(not_lightning), "has no state_dict"),
    ]
    for command, ckpt, expected in cases:
        assert lmledger([command, "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--ckpt_path", ckpt]) == 2
        assert expected in one_error_line(capsys, command), (command, ckpt)
    assert_nothing_overwritten(before, workdir)


def test_checkpoints_named_like_lightnings_keywords_are_checked_too(trained, workdir, capsys):
    # Names starting with last/best/hpc/registry skipped the pre-check (a `startswith` test) and gave tracebacks.
    truncated = workdir / "last.ckpt"
    truncated.write_bytes(trained.read_bytes()[:1000])
    pickled = workdir / "best_model.ckpt"
    torch.save({"state_dict": {}, "x": _Evil()}, pickled)
    before = snapshot(workdir)
    for ckpt, expected in ((truncated, "cannot be read"), (pickled, "refused for safety")):
        assert fit("--ckpt_path", ckpt.name) == 2
        line = one_error_line(capsys)
        assert f"checkpoint {ckpt.name}" in line and expected in line, line
    assert_nothing_overwritten(before, workdir)


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def _with_hparams(trained: Path, path: Path, hparams) -> Path:
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["hyper_parameters"] = hparams
    torch.save(checkpoint, path)
    return path


def test_a_checkpoints_bad_hyperparameters_are_blamed_on_the_checkpoint(trained, workdir, capsys):
    hparams = torch.load(trained, weights_only=True)["hyper_parameters"]
    cases = [
        (_with_hparams(trained, workdir / "list.ckpt", list(hparams.items())), "stores its hyperparameters as a list"),
        (_with_hparams(trained, workdir / "lr.ckpt", {**hparams, "lr": -1.0}), "model.lr must be a finite number"),
        (_with_hparams(trained, workdir / "type.ckpt", {**hparams, "lr": "fast"}), "finite number > 0, got fast"),
        (_with_hparams(trained, workdir / "config.ckpt", {**hparams, "config": 5}), "holds hyperparameters this model"),
    ]
    before = snapshot(workdir)
    for ckpt, expected in cases:
        for command in ("fit", "validate"):
            capsys.readouterr()
            assert lmledger([command, "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--ckpt_path", str(ckpt)]) == 2
            line = one_error_line(capsys, command)
            assert f"checkpoint {ckpt}" in line and expected in line, line
    assert_nothing_overwritten(before, workdir)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (["--model.config.n_heads", "1"], ["model.config.n_heads: 2 in the checkpoint, 1 now"]),  # same shapes
        (["--model.optimizer", "sgd", "--model.config.tie_embeddings", "true"],
         ["model.config.tie_embeddings: False in the checkpoint, True now",
          "model.optimizer: adamw in the checkpoint, sgd now"]),
        (["--model.lr", "0.01"], ["model.lr: 0.003 in the checkpoint, 0.01 now"]),
    ],
    ids=["heads", "optimizer and tied embeddings", "lr"],
)  # fmt: skip
def test_resume_refuses_a_changed_model_or_optimizer(trained, workdir, capsys, change, expected):
    before = snapshot(workdir)
    assert fit("--trainer.max_steps", "4", *change, "--ckpt_path", "last") == 2
    line = one_error_line(capsys)
    assert "was trained with other settings" in line and all(e in line for e in expected), line
    assert_nothing_overwritten(before, workdir)
    assert sorted(p.name for p in (workdir / "runs/tiny").iterdir()) == ["version_0"]
    # What may change on resume: the length, logging, compilation choice.
    ok = ["--trainer.max_steps", "3", "--trainer.log_every_n_steps", "2"]
    assert fit(*ok, "--model.config.activation_checkpointing", "1", "--ckpt_path", "last") == 0


def test_resume_onto_other_data_is_refused_unless_asked(workdir, small_data, capsys):
    data = workdir / "mine"
    shutil.copytree(small_data, data)
    assert fit("--data.path", str(data), "--model.config.context_length", "8", "--trainer.max_steps", "2") == 0
    # Re-prepared from other text: same vocabulary (bytes), other tokens.
    src = workdir / "other-src"
    src.mkdir()
    for i in range(12):
        (src / f"o{i:02d}.py").write_text(f"y = {i * 7}  # other\n" * (5 + i))
    assert lmledger(["prepare", "--source", str(src), "--out", str(data), "--val-fraction", "0.1", "--overwrite"]) == 0
    before = snapshot(workdir)
    args = ["--data.path", str(data), "--model.config.context_length", "8", "--trainer.max_steps", "4"]
    capsys.readouterr()
    assert fit(*args, "--ckpt_path", "last") == 2
    line = one_error_line(capsys)
    assert "was trained on other data" in line and "train.bin" in line and "--allow_other_data true" in line, line
    assert_nothing_overwritten(before, workdir)
    assert fit(*args, "--ckpt_path", "last", "--allow_other_data", "true") == 0


def test_data_edited_after_prepare_is_caught_by_its_hash(workdir, small_data, capsys):
    data = workdir / "edited"
    shutil.copytree(small_data, data)
    with open(data / "train.bin", "r+b") as f:  # same size, same meta.json: only the hash can tell
        first = f.read(1)
        f.seek(0)
        f.write(bytes([(first[0] + 1) % 60]))
    assert fit("--data.path", str(data)) == 2
    assert "train.bin has sha256" in one_error_line(capsys)
    assert not (workdir / "runs").exists()


def test_checkpoint_of_another_shape_is_one_line(trained, workdir, capsys):
    before = snapshot(workdir)
    assert fit("--model.config.d_model", "64", "--ckpt_path", "last") == 2
    line = one_error_line(capsys)
    assert f"checkpoint {Path('runs/tiny/version_0/checkpoints/last.ckpt')} was trained with other settings" in line
    assert "model.config.d_model: 32 in the checkpoint, 64 now" in line, line
    assert_nothing_overwritten(before, workdir)
    # Given a file (not "last"), LightningCLI takes the model config from the checkpoint's hyperparameters.
    assert lmledger(["validate", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--model.config.d_model", "64",
                     "--ckpt_path", str(trained)]) == 0  # fmt: skip


def test_prepare_refuses_to_overwrite(workdir, small_data, capsys):
    before = snapshot(small_data)
    assert lmledger(["prepare", "--source", "stdlib", "--out", str(small_data)]) == 2
    assert "already holds prepared data" in one_error_line(capsys, "prepare")
    assert snapshot(small_data) == before


# ------------------------------------------------------------------------------ interrupted runs


class SelfSignal(pl.Callback):
    """Test-only: sends this process `signum` as training batch `at_step` starts."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def test_ctrl_c_exits_130(workdir, capsys):
    spec = {"class_path": f"{__name__}.SelfSignal", "init_args": {"signum": int(signal.SIGINT), "at_step": 2}}
    # Lightning catches KeyboardInterrupt, shuts down and calls sys.exit(1); the shell convention is 128 + SIGINT.
    assert fit("--trainer.max_steps", "6", "--trainer.callbacks+=" + json.dumps(spec)) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == "lmledger fit: interrupted"


def test_a_disk_error_while_saving_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    before = path.read_bytes()

    def full_disk(f):
        f.write(b"x" * 10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError) as caught:
        atomic_write(path, full_disk)
    assert str(caught.value) == f"no space left on device while writing {path}; the previous last.ckpt is intact"
    # torch.save turns the OSError into "RuntimeError: [enforce fail at inline_container.cc:...]"; still one line.
    big = {"state_dict": {"w": torch.ones(1 << 16)}}
    with pytest.raises(UserError, match="^file too large while writing .*; the previous last.ckpt is intact$"):
        with file_size_limit(1 << 12):
            AtomicCheckpointIO().save_checkpoint(big, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left behind


def test_a_full_disk_during_a_fit_is_one_line(workdir, capsys):
    assert fit("--trainer.max_steps", "2") == 0
    ckpt = workdir / "runs/tiny/version_0/checkpoints/last.ckpt"
    before = ckpt.read_bytes()
    # The checkpoint (~330 kB) is the only file of the run past the limit; a real full disk fails the same write.
    spec = {"class_path": f"{__name__}.FileSizeLimit", "init_args": {"limit": 200_000}}
    assert fit("--trainer.max_steps", "4", "--ckpt_path", "last", "--trainer.callbacks+=" + json.dumps(spec)) == 2
    line = one_error_line(capsys, after_training=True)
    shown = ckpt.relative_to(workdir)
    assert line == f"lmledger fit: error: file too large while writing {shown}; the previous last.ckpt is intact"
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["last.ckpt"]


class FileSizeLimit(pl.Callback):
    """Test-only: a file size limit for the training steps of this fit (lifted when the fit ends)."""

    def __init__(self, limit: int) -> None:
        self.limit, self._context = limit, None

    def on_train_start(self, trainer, pl_module) -> None:
        self._context = file_size_limit(self.limit)
        self._context.__enter__()

    def teardown(self, trainer, pl_module, stage) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown hooks when a fit raises
