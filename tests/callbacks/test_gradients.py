"""The gradient norm (measured once a step, sharded or not), clipping by it, and the NaN guard's two ways of
dropping a bad update: on the device through the fused optimizer's `found_inf`, or by hand."""

from __future__ import annotations

import json
import math
import types
import warnings
from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import MICRO_OVERRIDES, read_scalars
from lmledger.callbacks.nonfinite import NonFiniteGuard, NonFiniteLossError, _Verdict
from lmledger.checkpointing import open_checkpoint
from lmledger.cli import main as lmledger
from lmledger.data import TokenDataModule
from lmledger.lit import LitLM, total_norm
from lmledger.model import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

TINY = ModelConfig(vocab_size=256, context_length=32, d_model=32, n_layers=1, n_heads=2, d_ff=64)


def test_one_gradient_norm_per_step_for_log_guard_and_clipping(workdir, monkeypatch):
    calls = []
    get_total_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: calls.append(1) or get_total_norm(*a, **k))
    steps = 5
    # tiny.yaml clips at 1.0, and the NaN guard is on in every fit.
    assert lmledger(["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_steps", str(steps)]) == 0
    assert len(calls) == steps
    norms = [v for _, v in read_scalars("runs/tiny/version_0")["train/grad_norm"]]
    assert len(norms) == steps and all(math.isfinite(v) and v > 0 for v in norms)


class LightningClipping(LitLM):
    """LitLM with Lightning's stock clipping (which measures the norm itself), for comparison."""

    configure_gradient_clipping = L.LightningModule.configure_gradient_clipping


def _weights_after(cls, data_dir, clip: float | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    data = TokenDataModule(path=str(data_dir), batch_size=4, context_length=TINY.context_length)
    lit = cls(replace(TINY, vocab_size=data.vocab_size), warmup_steps=1, lr=1e-2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False, gradient_clip_val=clip,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(lit, data)
    return {k: v.clone() for k, v in lit.model.state_dict().items()}


def test_clipping_by_the_shared_norm_equals_lightnings_own(stdlib_data):
    ours = _weights_after(LitLM, stdlib_data, clip=0.05)
    lightning = _weights_after(LightningClipping, stdlib_data, clip=0.05)
    unclipped = _weights_after(LitLM, stdlib_data, clip=None)
    for name, weight in ours.items():
        torch.testing.assert_close(weight, lightning[name], rtol=1e-5, atol=1e-7)
    # The clip bit: the run without it ends elsewhere.
    assert max((ours[k] - unclipped[k]).abs().max().item() for k in ours) > 1e-4


def _sharded_norm_worker(rank: int, store_file: str, cases: list, results) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        for case, shards in enumerate(cases):
            grads = [torch.tensor(shard) for shard in shards[rank] if shard]
            results[rank, case] = total_norm(grads, torch.device("cpu"), torch.distributed.group.WORLD).item()
    finally:
        torch.distributed.destroy_process_group()


def test_sharded_norm_sums_the_ranks_squares(tmp_path):
    cases = [
        [[[1.0, 2.0]], [[2.0], [4.0]]],  # sqrt(1 + 4 + 4 + 16) = 5
        # Rank 1 holds no gradients at all (FSDP can shard that unevenly) and must still join the reduction.
        [[[3.0, 0.0], [4.0]], [[]]],
        [[[math.nan]], [[1.0]]],  # one rank's NaN reaches every rank
    ]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_sharded_norm_worker, args=(str(tmp_path / "store"), cases, results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        assert results[rank, 0] == pytest.approx(5.0) and results[rank, 1] == pytest.approx(5.0)
        assert math.isnan(results[rank, 2])


# ------------------------------------------------------------------------------------------ the NaN guard


class _Steps:
    """Drives NonFiniteGuard's hooks by hand around a fused optimizer, as Lightning would, one step at a time."""

    def __init__(self, guard: NonFiniteGuard, optimizer: str = "adamw") -> None:
        self.guard = guard
        self.param = nn.Parameter(torch.ones(3))
        if optimizer == "adamw":
            self.optimizer = torch.optim.AdamW([self.param], lr=0.1, fused=True)
        else:
            self.optimizer = torch.optim.SGD([self.param], lr=0.1, momentum=0.9, fused=True)
        self.trainer = types.SimpleNamespace(
            precision_plugin=object(), global_step=0, ckpt_path=None, checkpoint_callbacks=[]
        )
        self.module = object()  # no gradient_norm(): the guard measures the optimizer's gradients itself

    def step(self, value: float) -> None:
        self.param.grad = torch.full((3,), value)
        self.guard.on_before_backward(self.trainer, self.module, torch.tensor(value))
        self.guard.on_before_optimizer_step(self.trainer, self.module, self.optimizer)
        self.optimizer.step()
        self.trainer.global_step += 1


class _FakeEvent:
    """A CUDA event stand-in: the verdict has not reached the host until `arrived` says so."""

    def __init__(self, arrived: list[bool]) -> None:
        self.arrived, self.waited_for = arrived, False

    def query(self) -> bool:
        return self.arrived[0] or self.waited_for

    def synchronize(self) -> None:
        self.waited_for = True


def _verdicts_in_flight(monkeypatch, arrived: list[bool]) -> None:
    """Every verdict behaves as one from a busy GPU: it arrives when `arrived[0]` is True (or is waited for)."""
    record = _Verdict.record.__func__

    def record_in_flight(cls, *args):
        verdict = record(cls, *args)
        verdict.done = _FakeEvent(arrived)
        return verdict

    monkeypatch.setattr(_Verdict, "record", classmethod(record_in_flight))


def test_guard_drops_the_update_on_the_device_and_judges_it_when_the_verdict_arrives(monkeypatch):
    arrived = [False]
    _verdicts_in_flight(monkeypatch, arrived)
    run = _Steps(NonFiniteGuard(max_skips=1))
    run.step(1.0)  # the first step is judged at once (the optimizer creates its state in it)
    before = run.param.detach().clone()
    moments = {k: v.clone() for k, v in run.optimizer.state[run.param].items()}

    run.step(math.nan)  # step 1: dropped by the fused kernel before the host knows
    assert torch.equal(run.param, before)
    for key, value in run.optimizer.state[run.param].items():
        assert torch.equal(value, moments[key]), key  # moments and step count untouched
    assert run.guard.skipped == 0  # verdict still in flight

    run.step(1.0)  # step 2 is fine and applied
    assert not torch.equal(run.param, before)
    arrived[0] = True
    after_step_2 = run.param.detach().clone()
    with pytest.warns(UserWarning, match=r"step 1: loss is nan; update skipped \(1 of max_skips 1\)"):
        with pytest.raises(NonFiniteLossError, match=r"step 3: loss is nan; stopped before applying it \(1 earlier"):
            run.step(math.nan)  # step 3: past max_skips
    assert torch.equal(run.param, after_step_2)


def test_under_torch_distributed_every_rank_judges_a_verdict_exactly_one_step_later(monkeypatch):
    # A rank that judged on arrival could stop a step before another and leave it waiting in a collective.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    arrived = [True]
    _verdicts_in_flight(monkeypatch, arrived)
    run = _Steps(NonFiniteGuard(max_skips=0))
    run.step(1.0)
    run.step(math.inf)  # step 1: already on the host, yet not judged in its own step
    run.guard.on_before_backward(run.trainer, run.module, torch.tensor(1.0))
    run.param.grad = torch.ones(3)
    with pytest.raises(NonFiniteLossError, match="step 1: loss is inf"):
        run.guard.on_before_optimizer_step(run.trainer, run.module, run.optimizer)  # step 2's hook
    arrived[0] = False
    run = _Steps(NonFiniteGuard(max_skips=0))
    run.step(1.0)
    run.step(math.nan)  # step 1, still on its way to the host when step 2 asks: waited for, not skipped over
    with pytest.raises(NonFiniteLossError, match="step 1: loss is nan"):
        run.step(1.0)


def test_a_checkpoint_counts_the_verdicts_still_in_flight(monkeypatch):
    _verdicts_in_flight(monkeypatch, [False])
    run = _Steps(NonFiniteGuard(max_skips=3))
    for value in (1.0, math.inf, 1.0, math.nan):
        run.step(value)
    assert run.guard.skipped == 0
    with pytest.warns(UserWarning, match="update skipped"):
        assert run.guard.state_dict() == {"skipped": 2}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_bad_first_step_is_dropped_by_hand_and_leaves_no_garbage_state(optimizer):
    # Fused SGD allocates its momentum uninitialised and fills it in the step: skipping that step on the
    # device would keep whatever the memory held.
    run = _Steps(NonFiniteGuard(max_skips=1), optimizer)
    with pytest.warns(UserWarning, match="step 0: loss is nan; update skipped"):
        run.step(math.nan)
    assert torch.equal(run.param, torch.ones(3))
    for _ in range(3):
        run.step(1.0)
    assert torch.isfinite(run.param).all() and (run.param < 1).all()
    assert all(torch.isfinite(t).all() for t in run.optimizer.state[run.param].values() if torch.is_tensor(t))


def test_an_optimizer_restored_unfused_is_judged_by_hand():
    # load_state_dict takes `fused` from the checkpoint's param groups; found_inf would break an unfused step.
    run = _Steps(NonFiniteGuard(max_skips=1))
    unfused = torch.optim.AdamW([nn.Parameter(torch.ones(3))], lr=0.1, fused=False)
    unfused.param_groups[0]["params"][0].grad = torch.ones(3)
    unfused.step()
    run.optimizer.load_state_dict(unfused.state_dict())
    assert run.optimizer.param_groups[0]["fused"] is False
    run.step(1.0)
    with pytest.warns(UserWarning, match="update skipped"):
        run.step(math.nan)
    run.step(1.0)
    assert torch.isfinite(run.param).all()


def test_resuming_an_unfused_checkpoint_trains_fused(workdir):
    args = ["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, "--trainer.max_epochs", "-1"]
    args += ["--trainer.max_steps", "2"]
    assert lmledger(args) == 0
    ckpt = "runs/tiny/version_0/checkpoints/last.ckpt"
    checkpoint = open_checkpoint(ckpt)
    for group in checkpoint["optimizer_states"][0]["param_groups"]:
        group["fused"] = False  # as saved before fused kernels were used on CPU
    torch.save(checkpoint, ckpt)
    assert lmledger([*args[:-1], "4", "--ckpt_path", ckpt]) == 0
    resumed = open_checkpoint("runs/tiny/version_1/checkpoints/last.ckpt")
    assert resumed["global_step"] == 4
    assert all(group["fused"] for group in resumed["optimizer_states"][0]["param_groups"])
    # Loading weights outside a Trainer still works (no hook there may reach for one).
    with torch.serialization.safe_globals([ModelConfig]):
        lit = LitLM.load_from_checkpoint(ckpt)
    assert lit.config.d_model == 32


def test_fp16_with_grad_scaler_clips_and_skips_by_hand(workdir):
    # Under GradScaler the optimizer is not fused (Lightning would leave the gradients scaled for the
    # fused kernel to unscale, and clipping would act on scaled values), so the guard drops grads itself.
    inject = {"class_path": "test_fit_failures.InjectNaN", "init_args": {"steps": [2]}}
    args = ["--trainer.precision", "16-mixed", "--trainer.max_steps", "4", "--nonfinite.max_skips", "1"]
    args += ["--trainer.callbacks+=" + json.dumps(inject)]
    with pytest.warns(UserWarning, match="step 2: loss is nan; update skipped"):
        assert lmledger(["fit", "--config", "configs/tiny.yaml", *MICRO_OVERRIDES, *args]) == 0
    checkpoint = open_checkpoint("runs/tiny/version_0/checkpoints/last.ckpt")
    assert checkpoint["global_step"] == 4
    assert all(not group.get("fused") for group in checkpoint["optimizer_states"][0]["param_groups"])
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values())
    losses = dict(read_scalars("runs/tiny/version_0")["train/loss"])
    assert [s for s, v in sorted(losses.items()) if not math.isfinite(v)] == [2]


# ------------------------------------------------------------------------------------------ the hot path


class SyncWatch(L.Callback):
    """Counts host syncs (torch's sync debug mode) over steps `start`..`stop`, between logging steps."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.syncs: list[str] = []
        self._catcher = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start:
            self._catcher = warnings.catch_warnings(record=True)
            self.syncs = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.stop and self._catcher is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)
            self._catcher = None


class ReadBackCount(L.Callback):
    """Counts values read back to the host (aten._local_scalar_dense: .item(), bool(), float() of a tensor)
    from each batch start to the next, i.e. including Lightning's own bookkeeping after the batch."""

    class _Mode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    def __init__(self, steps: range) -> None:
        self.steps, self.reads, self._mode = steps, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.reads.append(self._mode.reads)
            self._mode = None
        if trainer.global_step in self.steps:
            self._mode = self._Mode()
            self._mode.__enter__()


def test_no_value_is_read_back_between_logging_steps(stdlib_data):
    # On CUDA each read-back is a host sync. The device-only check is the test below; this one runs
    # anywhere: steady-state steps with the ledger, the NaN guard, grad-norm logging and clipping on.
    from lmledger.callbacks import LedgerSettings, ledger_callbacks

    data = TokenDataModule(path=str(stdlib_data), batch_size=4, context_length=TINY.context_length)
    count = ReadBackCount(steps=range(5, 9))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=12, limit_val_batches=0, logger=False, log_every_n_steps=100,
        gradient_clip_val=1.0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[NonFiniteGuard(), *ledger_callbacks(LedgerSettings()), count],
    )  # fmt: skip
    trainer.fit(LitLM(replace(TINY, vocab_size=data.vocab_size), warmup_steps=1), data)
    assert count.reads == [0, 0, 0, 0]


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_steady_state_steps_never_wait_for_the_gpu(stdlib_data, precision):
    # The ledger, the NaN guard, grad-norm logging and clipping on; no logging step, bar or checkpoint
    # inside the watched steps (those read values back on purpose).
    from lmledger.callbacks import LedgerSettings, ledger_callbacks

    data = TokenDataModule(path=str(stdlib_data), batch_size=4, context_length=TINY.context_length)
    watch = SyncWatch(start=5, stop=9)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision=precision, max_steps=12, limit_val_batches=0, logger=False,
        log_every_n_steps=100, gradient_clip_val=1.0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[NonFiniteGuard(), *ledger_callbacks(LedgerSettings()), watch],
    )  # fmt: skip
    trainer.fit(LitLM(replace(TINY, vocab_size=data.vocab_size), warmup_steps=1), data)
    messages = [str(w.message) for w in watch.syncs if "synchroniz" in str(w.message)]
    assert messages == [], messages[:3]


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_callback_declares_the_all_reduces_it_runs_a_step(monkeypatch, world_size):
    """The step-time prediction prices what `collectives_per_step` says (callbacks.steptime.fit_ops): it must be
    what the callback runs. NonFiniteGuard's verdict and PreemptionCheckpoint's stop decision, counted."""
    from lmledger.callbacks.steptime import fit_ops
    from lmledger.preemption import PreemptionCheckpoint

    reduced = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: world_size > 1)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: reduced.append("guard"))
    run = _Steps(NonFiniteGuard())
    run.trainer.world_size = world_size
    run.step(1.0)
    preemption = PreemptionCheckpoint()
    decide = lambda stop, all=True: reduced.append("preemption") or stop  # noqa: E731, A002
    strategy = types.SimpleNamespace(reduce_boolean_decision=decide)
    trainer = types.SimpleNamespace(world_size=world_size, strategy=strategy)
    monkeypatch.setattr("lmledger.preemption.accumulating", lambda trainer: False)
    preemption.on_train_batch_end(trainer, None, None, None, 0)
    assert reduced.count("guard") == run.guard.collectives_per_step(run.trainer) == (world_size > 1)
    assert reduced.count("preemption") == preemption.collectives_per_step(trainer) == (world_size > 1)

    # fit_ops adds them to the dry run's ops: one-value all-reduces over the world at the optimizer step.
    from lmledger.ledger.count.ops import COMMUNICATION, OpRecord, OpSummary

    step = OpSummary.of([OpRecord("aten.mm.default", "forward", "matmul", 8, 16, 16, "float32")], None)
    prediction = types.SimpleNamespace(ops=step, buckets=(), world_size=world_size)
    other = types.SimpleNamespace(collectives_per_step=3)  # a user's attribute of that name, not the method
    fit = types.SimpleNamespace(world_size=world_size, callbacks=[run.guard, preemption, other])
    ops = fit_ops(fit, nn.Linear(2, 2), prediction)
    added = [op for op in ops.ops if op.category == COMMUNICATION]
    assert len(added) == 2 * (world_size > 1)
    assert all(op.phase == "optimizer step" and op.bytes == 4 and op.group_size == world_size for op in added)
