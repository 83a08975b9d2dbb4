"""Canaries: facts about the installed Lightning and torch that a workaround in lmledger relies on.

Each test asserts the fact still holds. When an upgrade makes one fail, the workaround named in its
docstring can probably go (or lmledger.lightning_private must follow the moved attribute). No fits:
each calls the library directly.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import signal
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lmledger import lightning_private


def _trainer(**kwargs) -> Trainer:
    options = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return Trainer(**{**options, **kwargs})


def _as_fitting(trainer: Trainer) -> Trainer:
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    return trainer


# ------------------------------------------------------------------ lmledger.lightning_private


def test_local_file_protocol():
    assert lightning_private.is_local_path("runs/x/last.ckpt")
    assert not lightning_private.is_local_path("s3://bucket/last.ckpt")


def test_should_update_logs_follows_log_every_n_steps():
    trainer = _as_fitting(_trainer(log_every_n_steps=3))
    loop = trainer.fit_loop.epoch_loop
    logged = []
    for stepped in range(6):
        loop._batches_that_stepped = stepped
        logged.append(lightning_private.should_update_logs(trainer))
    # Checked after the batch that takes step `stepped + 1`: steps 3 and 6 are logged.
    assert logged == [False, False, True, False, False, True]
    assert lightning_private.batches_that_stepped(trainer) == 5


def test_epoch_loop_counts_batches_that_stepped():
    trainer = _as_fitting(_trainer(accumulate_grad_batches=2, max_steps=10))
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.total.ready = progress.current.ready = 1
    assert lightning_private.batches_fetched(trainer) == 1
    assert lightning_private.accumulating(trainer)  # batch 1 of 2: gradients only
    progress.total.ready = progress.current.ready = 2
    assert not lightning_private.accumulating(trainer)  # batch 2 of 2: the optimizer steps


def test_signal_connector_keeps_a_sigterm_flag():
    """Lightning's SIGTERM handler only sets a flag; the loops stop on it (PreemptionCheckpoint takes it)."""
    trainer = _trainer()
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert trainer.received_sigterm
    assert lightning_private.take_received_sigterm(trainer)
    assert not trainer.received_sigterm
    assert not lightning_private.take_received_sigterm(trainer)


def test_model_checkpoint_saves_last_through_private_methods():
    callback = ModelCheckpoint(dirpath="unused", save_last=True)
    assert callback._last_global_step_saved == 0
    assert list(inspect.signature(callback._save_last_checkpoint).parameters) == ["trainer", "monitor_candidates"]
    assert list(inspect.signature(callback._monitor_candidates).parameters) == ["trainer"]
    # Nothing to do when the callback has already saved this step.
    callback._last_global_step_saved, callback.last_model_path = 7, "unused/last.ckpt"
    callback._save_last_checkpoint = None  # would fail if called
    assert lightning_private.save_last_checkpoint(callback, SimpleNamespace(global_step=7)) == "unused/last.ckpt"


def test_model_checkpoint_saves_last_under_fast_dev_run(tmp_path):
    """Lightning 2.6: fast_dev_run "suppresses checkpointing", yet ModelCheckpoint.on_train_end saves last.ckpt
    (lmledger fit drops its ModelCheckpoints under fast_dev_run)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(fast_dev_run=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(BoringModel())
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_cli_get_reads_under_the_subcommand():
    from jsonargparse import Namespace

    cli = SimpleNamespace(subcommand="fit")
    cli._get = types.MethodType(LightningCLI._get, cli)
    config = Namespace(fit=Namespace(trainer={"max_steps": 5}))
    assert lightning_private.cli_value(cli, config, "trainer") == {"max_steps": 5}
    assert lightning_private.cli_value(cli, config, "ledger", default={}) == {}


@pytest.mark.parametrize("logger_class", ["TensorBoardLogger", "CSVLogger"])
def test_logger_picks_its_version_lazily(tmp_path, logger_class):
    from lightning.pytorch import loggers

    logger = getattr(loggers, logger_class)(save_dir=tmp_path, name="run")
    assert logger._version is None  # nothing chosen until first asked
    lightning_private.pin_logger_version(logger, lambda root: 7)
    assert logger.version == 7 and logger.log_dir.endswith("version_7")
    lightning_private.pin_logger_version(logger, lambda root: 8)  # chosen once
    assert logger.version == 7


def test_cli_parses_ckpt_path_in_a_private_hook():
    """FitCLI._parse_ckpt_path turns a checkpoint's unparseable hyperparameters into one line."""
    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI.__init__)


# ------------------------------------------------------------------ behaviour lmledger works around


def test_link_last_removes_the_old_link_before_making_the_new_one(tmp_path, monkeypatch):
    """checkpointing.make_last_checkpoint_atomic: save_last="link" leaves no last.ckpt for a moment."""
    (tmp_path / "step=2.ckpt").write_bytes(b"new")
    link = tmp_path / "last.ckpt"
    link.write_bytes(b"old")
    seen = []
    real_symlink = os.symlink
    monkeypatch.setattr(os, "symlink", lambda src, dst: (seen.append(os.path.lexists(dst)), real_symlink(src, dst)))
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))
    ModelCheckpoint._link_checkpoint(trainer, str(tmp_path / "step=2.ckpt"), str(link))
    assert seen == [False] and link.read_bytes() == b"new"


def test_lightning_saves_through_the_system_temp_dir_without_fsync(tmp_path, monkeypatch):
    """checkpointing.AtomicCheckpointIO writes beside the checkpoint, fsyncs and renames instead."""
    import shutil
    import tempfile

    from lightning.fabric.utilities.cloud_io import _atomic_save

    fsynced, moved = [], []
    real_move = shutil.move
    monkeypatch.setattr(os, "fsync", lambda fd: fsynced.append(fd))
    monkeypatch.setattr(shutil, "move", lambda src, dst, *a, **k: moved.append(src) or real_move(src, dst, *a, **k))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "system-temp"))
    (tmp_path / "system-temp").mkdir()
    (tmp_path / "runs").mkdir()
    _atomic_save({"step": 1}, tmp_path / "runs" / "last.ckpt")
    assert not fsynced
    assert [Path(src).parent for src in moved] == [tmp_path / "system-temp"]
    assert (tmp_path / "runs" / "last.ckpt").is_file()


def test_lightning_stops_on_sigterm_without_saving():
    """preemption.PreemptionCheckpoint: the loop raises SIGTERMException (exit 0) and saves nothing."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    source = inspect.getsource(_TrainingEpochLoop.on_advance_end)
    assert "received_sigterm" in source and "raise SIGTERMException" in source
    assert "save_checkpoint" not in source
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    assert issubclass(SIGTERMException, SystemExit) and SIGTERMException().code is None  # exit status 0


def test_remote_checkpoints_load_unsafely_by_default(monkeypatch):
    """checkpointing.AtomicCheckpointIO.load_checkpoint passes weights_only=True for URLs."""
    from lightning.fabric.utilities import cloud_io

    seen = {}
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda url, **kwargs: seen.update(kwargs))
    cloud_io._load("https://example.invalid/last.ckpt")
    assert seen["weights_only"] is False


def test_lightning_copies_batches_to_cuda_without_blocking():
    """data.TokenDataModule pins its batches so that this copy overlaps compute."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    seen = {}

    class Recorded(torch.Tensor):
        def to(self, *args, **kwargs):
            seen.update(kwargs)
            return self

    move_data_to_device(torch.zeros(2).as_subclass(Recorded), torch.device("cuda"))
    assert seen == {"non_blocking": True}


def test_a_lightning_module_copies_without_its_trainer():
    """callbacks.ledger's dry run gives the module's fake copy the trainer back."""
    import copy

    from lightning.pytorch import LightningModule

    module = LightningModule()
    module.trainer = _trainer()
    assert copy.deepcopy(module)._trainer is None


def test_16_mixed_on_cpu_becomes_bf16():
    """precision.trainer_precision_kwargs passes Lightning's fp16 MixedPrecision plugin explicitly on CPU."""
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = _trainer(precision="16-mixed")
    assert trainer.precision == "bf16-mixed"


def test_transformer_engine_unties_tied_weights(monkeypatch):
    """precision.TiedTransformerEnginePrecision: Lightning's layer swap clones each weight."""
    from lightning.fabric.plugins.precision.transformer_engine import _convert_layers

    te = types.ModuleType("transformer_engine.pytorch")
    te.Linear, te.LayerNorm = torch.nn.Linear, torch.nn.LayerNorm
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
    model[1].weight = torch.nn.Parameter(torch.zeros(16, 32))
    model[0].weight = torch.nn.Parameter(model[1].weight.T)  # a view of the same storage
    tied = model[0].weight.untyped_storage().data_ptr() == model[1].weight.untyped_storage().data_ptr()
    _convert_layers(model)
    untied = model[0].weight.untyped_storage().data_ptr() != model[1].weight.untyped_storage().data_ptr()
    assert tied and untied


def test_throughput_monitor_syncs_every_batch(monkeypatch):
    """callbacks/peak_flops.py: why lmledger times its own windows instead of using ThroughputMonitor."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: 1)
    stage = RunningStage.TRAINING
    monitor._throughputs[stage], monitor._t0s[stage] = Throughput(window_size=100), 0.0
    monitor._samples[stage] = monitor._batches[stage] = 0
    monitor._module_has_flops = False
    trainer = SimpleNamespace(
        state=SimpleNamespace(stage=stage), strategy=SimpleNamespace(root_device=torch.device("cuda"))
    )
    for _ in range(3):
        monitor._update(trainer, None, None, 0)
    assert len(synced) == 3
    assert "batches_per_sec" not in monitor._throughputs[stage].compute()  # nothing until 100 batches


def test_lightning_resolves_no_peak_for_nvidia_h200(monkeypatch):
    """ledger/hardware/gpus.py keeps its own table: Lightning maps "NVIDIA H200" to no peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert get_available_flops(torch.device("cuda"), torch.bfloat16) is None


def test_deepspeed_strategy_defaults_to_zero_stage_2():
    """ledger.run reads a config's plain "deepspeed" as ZeRO stage 2."""
    assert inspect.signature(DeepSpeedStrategy.__init__).parameters["stage"].default == 2


def test_loops_restore_their_progress_before_the_train_loader_is_iterated():
    """data.TokenDataModule.batches_consumed reads the restored progress when it builds the loader."""
    source = inspect.getsource(Trainer._run)
    assert source.index("restore_training_state()") < source.index("self._run_stage()")
    from lightning.pytorch.loops.fit_loop import _FitLoop

    assert "self.setup_data()" in inspect.getsource(_FitLoop.run)


def test_trainer_accepts_values_that_train_wrongly():
    """fitting.checks.check_trainer_values refuses them: a negative clip ascends, 0 accumulation trains nothing."""
    assert _trainer(gradient_clip_val=-1.0).gradient_clip_val == -1.0
    assert _trainer(accumulate_grad_batches=0).accumulate_grad_batches == 0


def test_seed_everything_none_without_environment_is_zero(monkeypatch):
    """fitting.cli: `--seed_everything true` draws its own seed, since Lightning would use 0."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with torch.random.fork_rng(devices=[]):
        state = np.random.get_state(), random.getstate()
        try:
            assert seed_everything(None, verbose=False) == 0
        finally:
            np.random.set_state(state[0])
            random.setstate(state[1])
            os.environ.pop("PL_GLOBAL_SEED", None)


def test_lightning_advertises_a_cloud_logger():
    """fitting.checks.DropAdverts filters this line out of every run's output."""
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector

    assert "💡 Tip" in inspect.getsource(logger_connector)


def test_lightning_pytree_uses_the_deprecated_leafspec():
    """fitting.cli filters torch's FutureWarning about LeafSpec, raised from Lightning's own code."""
    from lightning.pytorch.utilities import _pytree

    with pytest.warns(FutureWarning, match=r"isinstance\(treespec, LeafSpec\)` is deprecated"):
        _pytree._tree_flatten(torch.zeros(1))


# ------------------------------------------------------------------ torch


def test_cpu_flash_attention_has_no_flop_formula():
    """ledger/closedform/flops.py registers torch's SDPA formulas for the CPU flash-attention ops."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    mode = FlopCounterMode(display=False)
    assert aten.mm in mode.flop_registry and aten._scaled_dot_product_flash_attention in mode.flop_registry
    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    ):
        assert op not in mode.flop_registry


@pytest.mark.parametrize("make", [torch.optim.AdamW, lambda p, **kw: torch.optim.SGD(p, momentum=0.9, **kw)])
def test_fused_optimizers_skip_the_step_when_found_inf_is_set(make):
    """callbacks.nonfinite drops a bad update on the device through `optimizer.found_inf`."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = make([param], lr=0.1, fused=True)
    assert optimizer._step_supports_amp_scaling
    param.grad = torch.ones(4)
    optimizer.step()  # creates the state
    before = param.detach().clone()
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert torch.equal(param.detach(), before)
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert not torch.equal(param.detach(), before)


def test_foreach_supported_devices_helper_exists():
    """ledger/closedform/peak.py and ledger/dryrun/fakecopy.py ask torch which devices run foreach kernels (private
    helpers)."""
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices as from_optimizer
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices as from_utils

    assert "cuda" in from_utils() and from_optimizer() == from_utils()


def test_lightning_fsdp_refuses_clipping_by_norm():
    """LitLM.configure_gradient_clipping clips by its own norm, which also works under FSDP."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.plugins.precision import FSDPPrecision

    with pytest.raises(MisconfigurationException, match="not supported"):
        FSDPPrecision("32-true").clip_grad_by_norm(None, 1.0)


def test_lightning_zeroes_grads_after_the_forward():
    """ledger.closedform.peak.peak_bytes: the previous step's grads are still alive at the end of forward."""
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

    order = []

    def forward():
        order.append("forward")
        return ClosureResult(closure_loss=torch.tensor(1.0))

    Closure(forward, lambda loss: order.append("backward"), lambda: order.append("zero_grad")).closure()
    assert order == ["forward", "zero_grad", "backward"]


def test_lightning_autocast_keeps_no_weight_cache():
    """ledger.closedform.peak.peak_bytes and the dry run: a weight copy lives only while backward needs it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    assert MixedPrecision("bf16-mixed", "cpu").autocast_context_manager()._cache_enabled is False
    assert torch.autocast("cpu")._cache_enabled  # torch's own default keeps every copy until exit


# ------------------------------------------------------------------ torchmetrics


def test_mean_metric_without_nan_check_drops_the_weights():
    """LitLM.val_loss keeps MeanMetric's NaN check: with nan_strategy="disable" the weights are ignored
    (torchmetrics issue #3434)."""
    from torchmetrics.aggregation import MeanMetric

    metric = MeanMetric(nan_strategy="disable")
    metric.update(torch.tensor([1.0, 3.0]), weight=torch.tensor([1.0, 0.0]))
    assert metric.compute().item() == 2.0  # the unweighted mean; weighted it is 1.0


def test_importing_lightning_imports_transformers_and_matplotlib_where_installed():
    """docs/development.md's account of an `lmledger` process's start: Lightning imports torchmetrics, which
    imports transformers (for BERTScore) and matplotlib (for its plots) whenever they are installed, as in the dev
    environment: about 1.2 s of every process's start, for what only the HF examples and the kit's plots use. A
    fresh process, since this one has both."""
    import subprocess

    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    probe = "import sys, lightning.pytorch; print(*sorted({'transformers', 'matplotlib'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["matplotlib", "transformers"]


def test_a_storage_keeps_one_python_object_that_dies_with_it():
    """ledger.count.memtrack sees a storage freed when its Python object is finalized."""
    import weakref

    tensor = torch.empty(10)
    assert tensor.untyped_storage() is tensor.untyped_storage()
    freed = []
    ref = weakref.ref(tensor.untyped_storage(), lambda _: freed.append(True))
    view = tensor[2:]
    del tensor
    assert not freed  # the view still holds the storage
    del view
    assert freed and ref() is None


# ------------------------------------------------------------------ grouped GEMM (transformers' MoE experts)


def test_grouped_mm_meta_kernel_refuses_what_the_cpu_kernel_runs():
    """ledger.dryrun.moe answers torch._grouped_mm on fake CPU tensors itself: transformers 5.x runs MoE
    experts through it by default ("grouped_mm", integrations/moe.py), the CPU kernel takes float32,
    but the meta kernel (torch/_meta_registrations.py, _meta_grouped_mm_common) checks the CUDA
    kernel's bf16-only rule, so a fake float32 CPU step stops there. moe._grouped_mm_shape gives the
    CPU kernel's shapes, which this holds for the forward and both gradients' layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmledger.ledger.dryrun.moe import _grouped_mm_shape

    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=16)  # fmt: skip
    assert transformers.MixtralForCausalLM(config).config._experts_implementation == "grouped_mm"
    rows, offs = torch.randn(8, 16), torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    layouts = [(rows, torch.randn(4, 16, 8)), (rows.t(), torch.randn(8, 8)), (torch.randn(8, 8), torch.randn(4, 8, 16))]
    for a, b in layouts:
        real = torch._grouped_mm(a, b, offs=offs)  # the CPU kernel runs float32
        assert real.dtype == torch.float32 and real.is_contiguous()
        assert list(real.shape) == _grouped_mm_shape(a, b, offs)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(mode.from_tensor(rows), mode.from_tensor(layouts[0][1]), offs=mode.from_tensor(offs))


def test_flop_counter_decomposes_what_it_cannot_count():
    """ledger.count.flopcounter.StepFlopCounter: FlopCounterMode runs an op without a FLOP formula through its
    decomposition (func.decompose()), so inside it a real step computes other bits than outside."""
    import torch.utils.flop_counter as flop_counter_module

    from lmledger.ledger.count.flopcounter import StepFlopCounter

    source = inspect.getsource(flop_counter_module._FlopCounterMode.__torch_dispatch__)
    assert "func.decompose(" in source
    # And a step it changes, bit for bit (the toy LM's gradients), next to ours, which leaves it alone.
    from lmledger.model import ModelConfig, ToyLM

    torch.manual_seed(0)
    model = ToyLM(ModelConfig(vocab_size=256, context_length=64, d_model=64, n_layers=2, n_heads=2, d_ff=128))
    x, y = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))

    def grads(context) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with context:
            model(x, y).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(contextlib.nullcontext())
    assert all(torch.equal(a, b) for a, b in zip(grads(StepFlopCounter()), plain, strict=True))
    counted = grads(torch.utils.flop_counter.FlopCounterMode(display=False))
    assert not all(torch.equal(a, b) for a, b in zip(counted, plain, strict=True))


# ------------------------------------------------------------------- issue 23 §4 (commands/fit.py, atomic.py)


class RefusesToBuild(torch.nn.Module):
    """For test_jsonargparse_chains_a_failed_build: a class whose __init__ raises."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        raise ArithmeticError(f"odd width {width}")


def test_jsonargparse_chains_a_failed_build():
    """fitting.checks.build_failure: jsonargparse reports a subclass whose __init__ raised as a ValueError
    listing every Union subtype it tried, raised `from` the class's own exception, and the traceback of that
    exception passes through an instantiator frame holding `class_type` (the class being built)."""
    import traceback

    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--module", type=torch.nn.Module | None)
    config = parser.parse_object({"module": {"class_path": f"{__name__}.RefusesToBuild"}})
    with pytest.raises(ValueError, match="Does not validate against any of the Union subtypes") as caught:
        parser.instantiate_classes(config)
    original = caught.value
    while original.__cause__ is not None:
        original = original.__cause__
    assert isinstance(original, ArithmeticError) and str(original) == "odd width 3"
    built = [frame.f_locals.get("class_type") for frame, _ in traceback.walk_tb(original.__traceback__)]
    assert RefusesToBuild in built


def test_torch_save_turns_a_ctrl_c_in_a_write_into_a_runtime_error():
    """atomic.stage: a KeyboardInterrupt raised inside the file's write (where SIGINT lands while torch.save
    runs) comes out of torch.save, from the second record on, as "[enforce fail at inline_container.cc]",
    with the KeyboardInterrupt only as its __context__."""
    import io

    class InterruptedFile(io.BytesIO):
        writes = 0

        def write(self, data) -> int:
            InterruptedFile.writes += 1
            if InterruptedFile.writes == 2:
                raise KeyboardInterrupt
            return super().write(data)

    with pytest.raises(RuntimeError, match=r"enforce fail at inline_container\.cc") as caught:
        torch.save({"w": torch.ones(100)}, InterruptedFile())
    assert isinstance(caught.value.__context__, KeyboardInterrupt)


def test_tensorboard_writer_thread_reraises_its_error(tmp_path):
    """commands.fit._quiet_event_writer: TensorBoard's event writer fails in a thread of its own (a class
    from the tensorboard package), which reaches threading.excepthook, and the same OSError is raised again
    in the writing thread at its next write, so hiding the thread's traceback hides no error."""
    import errno
    import threading

    from torch.utils.tensorboard import SummaryWriter

    from conftest import file_size_limit

    seen = []
    hook, threading.excepthook = threading.excepthook, seen.append
    writer = SummaryWriter(str(tmp_path))
    try:
        with file_size_limit(2_000), pytest.raises(OSError) as caught:
            for step in range(1_000):
                writer.add_scalar("x", 1.0, step)
                writer.flush()
    finally:
        threading.excepthook = hook
    assert caught.value.errno == errno.EFBIG
    assert len(seen) == 1 and seen[0].exc_value is caught.value
    assert "tensorboard" in type(seen[0].thread).__module__


def test_tensorboard_writes_its_event_file_by_path(tmp_path):
    """test_run_claim's moved run: TensorBoard's writer opens its event file by name at each record (tensorboard's
    gfile appends by path), so a run directory moved under a live logger gets the records logged after the move
    in a new file of the same name at the old path, and keeps only the earlier ones."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from conftest import read_scalars

    logger = TensorBoardLogger(str(tmp_path), name="t")
    logger.log_metrics({"x": 1.0}, step=1)
    logger.experiment.flush()
    old = Path(logger.log_dir)
    old.rename(tmp_path / "moved")
    old.mkdir()
    logger.log_metrics({"x": 2.0}, step=2)
    logger.finalize("failed")
    assert [p.name for p in old.iterdir()] == [p.name for p in (tmp_path / "moved").iterdir()]
    assert read_scalars(old) == {"x": [(2, 2.0)]} and read_scalars(tmp_path / "moved") == {"x": [(1, 1.0)]}


def test_optimizer_step_record_encloses_its_closure():
    """ledger/timing/profile.py: torch.optim wraps every step() in a record_function named
    "Optimizer.step#<class>.step", and a closure passed to step() runs inside it, so under Lightning (next canary)
    forward and backward
    are inside that record too; the time ledger's optimizer window starts at its own marker instead."""
    weight = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = torch.optim.AdamW([weight])

    def closure():
        loss = (weight @ weight).sum()
        loss.backward()
        return loss

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step(closure)
    records = [e for e in prof.events() if e.name == "Optimizer.step#AdamW.step"]
    assert len(records) == 1
    matmuls = [e for e in prof.events() if e.name == "aten::mm"]  # the closure's forward and backward
    assert len(matmuls) >= 2
    for mm in matmuls:
        assert records[0].time_range.start <= mm.time_range.start <= mm.time_range.end <= records[0].time_range.end


def test_lightning_runs_the_closure_inside_optimizer_step_then_its_hook():
    """callbacks/timing.py: Lightning's precision plugin hands optimizer.step a closure that runs the training
    step (forward, backward) and then on_before_optimizer_step (Precision._after_closure), all inside
    step(); so the hook marks where the optimizer's own work begins."""
    from unittest import mock

    from lightning.pytorch.plugins.precision import Precision

    order = []

    class Optimizer:
        def step(self, closure=None):
            order.append("step")
            closure()
            order.append("update")

    after = lambda self, model, optimizer: order.append("on_before_optimizer_step")  # noqa: E731
    with mock.patch.object(Precision, "_after_closure", after):
        Precision().optimizer_step(Optimizer(), model=None, closure=lambda: order.append("closure"))
    assert order == ["step", "closure", "on_before_optimizer_step", "update"]


def test_one_profiler_at_a_time_is_visible():
    """callbacks/timing.py: torch._C._autograd._profiler_enabled() is True while a torch.profiler.profile
    records and False otherwise, so TimeLedger can leave a sampled step to a profiler already running (a
    second one started inside it records nothing)."""
    assert not torch._C._autograd._profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert torch._C._autograd._profiler_enabled()
    assert not torch._C._autograd._profiler_enabled()


def test_strategy_registry_resolves_a_registered_name():
    """lmledger.strategies registers "fsdp2" so `Trainer(strategy="fsdp2")` works in Python: Lightning's
    StrategyRegistry is a dict-like registry its accelerator connector reads a strategy name from, and
    `register(name, class, description=...)` adds one (Lightning 2.6 reads no entry points for strategies)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

    class Canary(SingleDeviceStrategy):
        pass

    name = "lmledger-canary-strategy"
    StrategyRegistry.register(name, Canary, description="canary", device="cpu")
    try:
        assert name in StrategyRegistry and isinstance(StrategyRegistry.get(name), Canary)
        assert isinstance(_trainer(strategy=name, devices=1).strategy, Canary)
    finally:
        StrategyRegistry.pop(name)
    with pytest.raises(ValueError, match="invalid strategy name"):  # what `strategy="fsdp2"` raised unregistered
        _trainer(strategy=name, devices=1)


def test_dynamo_runs_a_frame_eager_for_good_under_a_dispatch_mode():
    """The FLOP counter and the memory tracker are TorchDispatchModes (ledger.closedform.flops, ledger.count.memtrack):
    a compiled function called under such a mode, before or after it compiled, is skipped by dynamo for good, so a whole
    fit
    with the Ledger ran eager. A mode whose ignore_compile_internals() is True leaves it compiled."""
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 4)
    torch._dynamo.reset()
    counters.clear()
    watched_first = torch.compile(lambda t: (t * 2).sin(), backend="eager")
    with Watch():
        watched_first(x)
    watched_first(x)
    assert counters["stats"]["unique_graphs"] == 0  # eager, also outside the mode
    calls = []

    def counting(gm, inputs):  # a backend that counts the compiled graph's runs
        return lambda *args: calls.append(1) or gm.forward(*args)

    compiled_first = torch.compile(lambda t: (t * 3).cos(), backend=counting)
    compiled_first(x)
    with Watch():
        compiled_first(x)  # skipped: eager again, and for good
    compiled_first(x)
    assert counters["stats"]["unique_graphs"] == 1 and len(calls) == 1

    class Ignores(Watch):  # what ledger.closedform.flops and ledger.count.memtrack's modes declare
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

    calls.clear()
    under_a_mode = torch.compile(lambda t: (t * 4).tan(), backend=counting)
    with Ignores():
        under_a_mode(x)  # compiled under the mode
        under_a_mode(x)
    under_a_mode(x)
    assert len(calls) == 3
    torch._dynamo.reset()


def test_compiled_objects_are_recognisable():
    """callbacks/measure.compiled_parts finds compiled code by what torch.compile returns: an OptimizedModule
    for a module, a function with `_torchdynamo_orig_callable` for a function, and `_compiled_call_impl` set on a
    module compiled in place (`module.compile()`). None of them compiles anything until called."""
    from torch import nn
    from torch._dynamo.eval_frame import OptimizedModule

    linear = nn.Linear(2, 2)
    assert type(torch.compile(linear)) is OptimizedModule and torch.compile(linear)._orig_mod is linear
    assert callable(torch.compile(lambda t: t)._torchdynamo_orig_callable)
    assert linear._compiled_call_impl is None
    linear.compile()
    assert linear._compiled_call_impl is not None


def test_canary_fsdp2_over_tp_needs_real_meshes_under_fake_mode():
    """Issue 30: fully_shard over a TP-sharded module builds a (dp x tp) DeviceMesh (DeviceMesh._concatenate),
    which under FakeTensorMode reads its rank table with nonzero and raises (torch 2.13). Building it with fake
    mode suspended (ledger.sharding.tp.meshes_outside_fake_mode) makes the step run, with local shards of the TP x FSDP
    size. When the first half stops failing, the workaround can go."""
    import torch.distributed as dist
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lmledger.ledger.sharding.fsdp2 import fake_process_group
    from lmledger.ledger.sharding.tp import meshes_outside_fake_mode

    def step(workaround: bool):
        with fake_process_group(16, tensor_parallel=4) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
            mlp = nn.Sequential(nn.Linear(64, 224), nn.ReLU(), nn.Linear(224, 64))
            parallelize_module(mlp, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            if workaround:
                with meshes_outside_fake_mode():
                    fully_shard(mlp, mesh=mesh["data_parallel"])
            else:
                fully_shard(mlp, mesh=mesh["data_parallel"])
            mlp(torch.randn(2, 64)).sum().backward()
            return tuple(mlp[0].weight._local_tensor.shape)

    with pytest.raises(Exception, match="nonzero"):
        step(workaround=False)
    assert not dist.is_initialized()
    assert step(workaround=True) == (224 // 4 // 4, 64)  # rows split by TP 4, then by FSDP's 4 ranks


def test_a_checkpoint_recompute_runs_in_a_graph_task_with_grad_on():
    """ledger/count/ops._recomputing: torch 2.13 runs a non-reentrant checkpoint's forward again inside the
    backward's graph task (torch._C._current_graph_task_id() is not -1 there) with grad mode on, and the
    backward's own ops with it off; outside a backward the id is -1."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((str(func), torch.is_grad_enabled(), torch._C._current_graph_task_id() != -1))
            return func(*args, **(kwargs or {}))

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    with Watch():
        checkpoint(lambda t: torch.tanh(layer(t)), x, use_reentrant=False).sum().backward()
    assert torch._C._current_graph_task_id() == -1
    forward = [name for name, grad, in_backward in seen if not in_backward]
    recomputed = [name for name, grad, in_backward in seen if in_backward and grad]
    assert "aten.addmm.default" in forward and "aten.tanh.default" in forward
    assert "aten.addmm.default" in recomputed and "aten.tanh.default" in recomputed
    assert ("aten.tanh_backward.default", False, True) in seen  # the backward's own op: grad off


def test_xdist_scope_scheduling_still_has_the_two_methods_conftest_overrides():
    """tests/conftest.py's scheduler subclasses pytest-xdist 3.8's LoadScopeScheduling and overrides two private
    methods: `_split_scope(nodeid)` (a work unit's name) and `_assign_work_unit(node)`, which pops the first of
    the ordered `workqueue`. If either moves, the groups or the longest-first order silently stop holding."""
    from xdist.scheduler import LoadScopeScheduling

    assert list(inspect.signature(LoadScopeScheduling._split_scope).parameters) == ["self", "nodeid"]
    assert list(inspect.signature(LoadScopeScheduling._assign_work_unit).parameters) == ["self", "node"]
    assert "self.workqueue.popitem(last=False)" in inspect.getsource(LoadScopeScheduling._assign_work_unit)


def test_xdist_loadgroup_renames_the_private_nodeid_that_pytest_no_longer_reads():
    """Why conftest groups files itself: xdist's loadgroup marks a group by renaming `item._nodeid`, while
    pytest 9's `Node.nodeid` reads `_id`. When this fails, `--dist loadgroup` with xdist_group marks may do."""
    from _pytest.nodes import Node
    from xdist import remote

    assert "item._nodeid = " in inspect.getsource(remote)
    assert "_nodeid" not in inspect.getsource(Node.nodeid.fget)


def test_model_parallel_strategy_leaves_a_launched_ranks_threads_alone(monkeypatch):
    """Lightning's ModelParallelStrategy makes a launcher only in the process that starts the others, and only its
    launcher sets each rank's threads to cores / ranks (DDP's makes one in every rank). So a rank it started keeps every
    core's threads: lmledger.strategies.FSDP2Strategy.setup_environment sets them as the launcher does."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import ModelParallelStrategy

    monkeypatch.setenv("LOCAL_RANK", "1")  # what the launcher gives the ranks it starts
    # No Trainer: one built here would set this process's rank-zero flag to rank 1 for every later test in it.
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    strategy.cluster_environment = LightningEnvironment()
    assert strategy.cluster_environment.creates_processes_externally
    strategy._configure_launcher()
    assert strategy.launcher is None
    monkeypatch.delenv("LOCAL_RANK")
    strategy._configure_launcher()  # the process that starts the others makes one
    assert strategy.launcher is not None


def test_a_gloo_work_holds_its_tensor_until_it_dies():
    """A gloo send's Work keeps the sent tensor alive until the Work object dies, waited or not. So what torch's
    pipeline schedules keep of their sends (the Works in fwd_sends_to_wait, send_ops, send_work) keeps the stage
    outputs and input gradients: ledger.sharding.pipeline._HOLDS counts them as long as each schedule keeps them."""
    import datetime
    import threading
    import weakref

    import torch.distributed as dist

    store, groups = dist.HashStore(), [None, None]

    def join(rank: int) -> None:  # two ranks of one gloo group in this process, each connecting from its thread
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("canary", store), rank, 2, datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sent, received = torch.ones(4), torch.empty(4)
    storage = weakref.ref(sent.untyped_storage())
    work = groups[0].send([sent], 1, 0)
    groups[1].recv([received], 0, 0).wait()
    work.wait()
    del sent
    assert storage() is not None and received.sum() == 4
    del work
    assert storage() is None


def test_torch_pipeline_schedules_run_lmledgers_orders():
    """torch's pipeline schedules order each rank's forwards and backwards as ledger.sharding.schedule.orders does
    (pipeline_order, the schedule's IR: ScheduleGPipe and ScheduleInterleaved1F1B run theirs). Schedule1F1B runs
    its own loop (warm-up min(m, pp - rank) forwards, then a backward and a forward in turn: the same order, held
    by the real-rank tests in tests/ledger/test_pipeline_stages.py); its IR numbers the last rank's forwards 1..m,
    where the loop runs 0..m-1."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _ComputationType
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lmledger.ledger.sharding.schedule import Pipeline, orders

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    classes = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for pipe in (Pipeline(4, 8, "gpipe"), Pipeline(4, 8, "1f1b"), Pipeline(4, 8, "interleaved", 2)):
            stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), c * 4, pipe.chunks, torch.device("cpu"))
                      for c in range(pipe.virtual)]  # fmt: skip
            loss = lambda out, target: out.sum()  # noqa: E731
            schedule = (
                classes[pipe.schedule](stages[0], pipe.micro_batches, loss_fn=loss) if pipe.virtual == 1
                else pipelining.ScheduleInterleaved1F1B(stages, pipe.micro_batches, loss_fn=loss)
            )  # fmt: skip
            for rank, ours in enumerate(orders(pipe)):
                actions = [a for a in schedule.pipeline_order[rank] if a is not None and a.computation_type in kinds]
                theirs = [(kinds[a.computation_type], a.microbatch_index, a.stage_index) for a in actions]
                if pipe.schedule == "1f1b" and rank == pipe.stages - 1:
                    theirs = [(k, i - 1 if k == "F" else i, j) for k, i, j in theirs]
                assert theirs == ours, (pipe, rank)
    finally:
        dist.destroy_process_group()


def test_torch_context_parallel_refuses_the_cpu_attention_kernels():
    """torch's context_parallel sends only the CUDA SDPA kernels (flash, efficient, cuDNN) to its ring attention. On
    CPU tensors SDPA picks _scaled_dot_product_flash_attention_for_cpu, which DTensor has no sharding rule for; the
    math backend's decomposition mixes DTensors and plain tensors. Refused so on the fake process group, real and
    fake tensors alike (and on real gloo ranks: tests/ledger/test_context_parallel.py records the same line). So
    ledger.sharding.context runs torch's ring itself (ring_attention) with the CPU flash kernel as its block op."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lmledger.ledger.sharding.fsdp2 import fake_process_group

    refused = "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy"

    def attend(backend=None) -> None:
        q, k, v = (torch.empty(1, 2, 16, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with fake_process_group(2) as mesh:
        with pytest.raises(NotImplementedError, match=refused):
            attend()
        with FakeTensorMode(), pytest.raises(NotImplementedError, match=refused):
            attend()
        with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
            attend(SDPBackend.MATH)


def test_torch_ring_attention_parts_lmledger_runs():
    """What ledger.sharding.context takes from torch's context parallelism as it is: the options its ring reads (K|V
    all-gathered by default, head-tail load balancing, merges and dK|dV in fp32); the head-tail order (rank r holds
    chunks r and 2c - 1 - r), which torch drops silently where seq does not divide by 2c (check_context refuses it);
    the ring's signatures; and the CPU flash kernel's (out, logsumexp), logsumexp fp32 (b, h, t) for bf16 inputs too,
    whose backward takes the keywords the ring's backward passes."""
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

    options = _attention._ContextParallelOptions()
    assert (options.rotate_method, options.enable_load_balance, options.convert_to_f32) == (
        _attention._RotateMethod.ALL_GATHER, True, True)  # fmt: skip
    assert _load_balancer._HeadTailLoadBalancer(8, 2, "cpu")._generate_indices().tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    assert _load_balancer._create_default_load_balancer(30, 2, "cpu") is None
    forward = list(inspect.signature(_attention._templated_ring_attention).parameters)
    assert forward[:7] == ["group", "seq_dim", "op", "query", "key", "value", "is_causal"]
    backward = list(inspect.signature(_attention._templated_ring_attention_backward).parameters)
    assert backward[:11] == ["group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out",
                             "logsumexp", "is_causal"]  # fmt: skip
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, is_causal=True)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (1, 2, 8), torch.float32)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        query=q, key=q, value=q, out=out, logsumexp=lse, is_causal=False, grad_out=out, dropout_p=0.0, scale=None
    )
    assert [g.shape for g in grads] == [q.shape] * 3
