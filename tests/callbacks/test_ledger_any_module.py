"""Trainer(callbacks=[Ledger()]) on modules that are not lmledger's: the dry run's prediction beside the measurement."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import read_scalars
from lmledger.callbacks import Ledger
from lmledger.errors import UserError
from lmledger.ledger.units import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `examples` lives at the repository root

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

BATCH, SEQ = 4, 32


def token_loader(n_batches: int = 6) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, 256, (n_batches * BATCH, SEQ), generator=g) for _ in range(2))
    return DataLoader(TensorDataset(inputs, targets), batch_size=BATCH)


def fit(
    module: pl.LightningModule, loader, callbacks, tmp_path: Path | None = None, steps: int = 3, precision="32-true"
) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        precision=precision,
        logger=TensorBoardLogger(tmp_path, name="run") if tmp_path else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(module, loader)
    return trainer


def tiny_llama(checkpointing: int = 0):
    pytest.importorskip("transformers")
    from examples.hf_lm import LlamaLM

    torch.manual_seed(0)
    return LlamaLM(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, context_length=SEQ,
                   activation_checkpointing=checkpointing)  # fmt: skip


# bf16-mixed with checkpointing: Lightning's autocast keeps no cast cache, so a checkpointed layer's
# weight casts die with it; under torch's default (cache on) every cast lives to the end of forward.
@pytest.mark.parametrize("precision, checkpointing", [("32-true", 0), ("bf16-mixed", 1)])
def test_hf_llama_ledger_predicts_what_the_fit_measures(precision, checkpointing, tmp_path, capsys):
    ledger = Ledger(warmup_steps=1)
    trainer = fit(tiny_llama(checkpointing), token_loader(), [ledger], tmp_path, precision=precision)
    child = ledger
    predicted, measured = child.predicted, child.measured
    assert predicted is not None, child.why_not_predicted
    for name in ("params", "grads", "optimizer"):
        assert predicted.get(name) == measured.get(name), name
    assert predicted.activations == pytest.approx(measured.activations, rel=0.01)
    assert predicted.autocast_weight_copies == pytest.approx(measured.autocast_weight_copies, rel=0.01)
    assert predicted.peak == pytest.approx(measured.peak, rel=0.03)
    assert predicted.flops_hardware == measured.flops_hardware
    assert child.tokens == BATCH * SEQ  # the first integer rank-2 tensor: the input ids

    # The table: every ratio shown is 1 within the tolerances, and the fit's tokens/s is there.
    rows = {name: (pred, meas, ratio) for name, pred, meas, ratio in child.report.rows()}
    for name in ("params", "grads", "optimizer", "FLOPs/step (hardware)"):
        assert rows[name][2] == "1.000", name
    assert 0.99 <= float(rows["activations"][2]) <= 1.01 and 0.97 <= float(rows["peak"][2]) <= 1.03
    assert float(rows["tokens/s"][1]) > 0
    out = capsys.readouterr().out
    assert "ledger (predicted)" in out and "ledger (predicted beside measured)" in out and "ledger (summary)" in out

    scalars = read_scalars(trainer.logger.log_dir)
    assert scalars["memory/predicted/peak"][0][1] == predicted.peak
    assert scalars["memory/measured/peak"][0][1] == measured.peak
    assert scalars["flops/hardware_per_step"][0][1] == pytest.approx(predicted.flops_hardware)
    assert scalars["flops/measured_per_step"][0][1] == pytest.approx(measured.flops_hardware)
    assert "perf/tokens_per_sec" in scalars and "perf/samples_per_sec" not in scalars


def test_the_ledger_does_not_change_what_is_trained():
    """GPT-2 with dropout: the dry run and the measurement draw nothing from the RNG and move no weight."""
    pytest.importorskip("transformers")
    from examples.hf_lm import GPT2LM

    def train(callbacks) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = GPT2LM(hidden_size=32, num_layers=1, num_heads=2, context_length=SEQ, dropout=0.1)
        fit(module, token_loader(), callbacks)
        return {k: v.clone() for k, v in module.state_dict().items()}

    with_ledger, without = train([Ledger(warmup_steps=1)]), train([])
    for name, value in without.items():
        assert torch.equal(with_ledger[name], value), name


class Regressor(pl.LightningModule):
    """No tokens: float features in, a float target out, mse loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def test_a_model_without_tokens_reports_samples_per_second(tmp_path):
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)), batch_size=16)
    ledger = Ledger(warmup_steps=1)
    trainer = fit(Regressor(), loader, [ledger], tmp_path)
    child = ledger
    assert child.tokens is None and child.samples == 16
    assert child.predicted.optimizer == child.measured.optimizer == child.predicted.params  # momentum
    assert child.predicted.peak == pytest.approx(child.measured.peak, rel=0.03)
    scalars = read_scalars(trainer.logger.log_dir)
    assert "perf/samples_per_sec" in scalars and "perf/tokens_per_sec" not in scalars


class DictBatchLM(pl.LightningModule):
    """Batches are mappings (a Hugging Face BatchEncoding here); the module states its own tokens per batch."""

    def __init__(self, tokens: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.head = nn.Linear(32, 256)
        if tokens is not None:
            self.tokens_per_batch = tokens

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("stated", [None, 100])
def test_batch_encoding_batches_and_stated_tokens(stated):
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    encodings = [
        transformers.BatchEncoding(
            {"attention_mask": torch.ones(BATCH, SEQ), "input_ids": torch.randint(0, 256, (BATCH, SEQ), generator=g)}
        )
        for _ in range(3)
    ]
    for encoding in encodings:
        encoding["labels"] = encoding["input_ids"].roll(-1, dims=1)
    ledger = Ledger(warmup_steps=1)
    fit(DictBatchLM(stated), DataLoader(encodings, batch_size=None), [ledger])
    child = ledger
    # The float attention mask is skipped: tokens are the input ids' B x T unless the module says otherwise.
    assert child.tokens == (stated if stated is not None else BATCH * SEQ)
    assert child.predicted is not None, child.why_not_predicted
    assert child.predicted.activations == child.measured.activations


class UsesItsTrainer(Regressor):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"] * (1 + 0 * self.trainer.global_step)}


def test_a_training_step_that_reads_its_trainer_is_predicted():
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 8, generator=g)), batch_size=16)
    ledger = Ledger(warmup_steps=1)
    fit(UsesItsTrainer(), loader, [ledger])
    child = ledger
    assert child.predicted is not None, child.why_not_predicted
    assert child.predicted.peak == pytest.approx(child.measured.peak, rel=0.03)


def test_anomaly_detection_is_dry_run_and_its_time_not_predicted(monkeypatch):
    """Trainer(detect_anomaly=True): autograd reads each backward output for a NaN, which a fake tensor cannot
    answer. The dry run leaves that check out (its memory and FLOPs are the step's), and the step time, which the
    check and anomaly mode's stack per op slow by half or more (tiny.yaml: 226 ms against 134 predicted), is not
    predicted, with the reason."""
    monkeypatch.delenv("LMLEDGER_NO_STEP_TIME", raising=False)  # the reason is given before anything is replayed
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 8, generator=g)), batch_size=16)
    ledger = Ledger(warmup_steps=1)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, detect_anomaly=True,
                         callbacks=[ledger])  # fmt: skip
    trainer.fit(Regressor(), loader)
    assert ledger.predicted is not None, ledger.why_not_predicted
    assert ledger.predicted.peak == pytest.approx(ledger.measured.peak, rel=0.03)
    assert ledger.predicted.flops_hardware == ledger.measured.flops_hardware > 0
    assert "detect_anomaly=True" in ledger.step_time.reason
    assert not torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()  # as the fit found them


class ReadsALoss(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)["loss"]
        if loss.item() > 1e9:  # data-dependent: fake tensors hold no values
            raise RuntimeError("diverged")
        return loss


def test_an_untraceable_module_is_measured_with_a_reason(capsys):
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 8, generator=g)), batch_size=16)
    ledger = Ledger(warmup_steps=1)
    fit(ReadsALoss(), loader, [ledger])
    child = ledger
    assert child.predicted is None and ".item()" in child.why_not_predicted
    assert child.measured.peak > child.measured.params > 0
    assert "not predicted" in capsys.readouterr().out


def test_a_predicted_peak_over_the_limit_stops_before_step_one():
    module = Regressor()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Ledger(device_memory_gb=1e-6)])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)), batch_size=16)
    with pytest.raises(UserError, match="exceeds the 1 kB available"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0


def test_a_cpu_run_is_held_to_the_machines_ram(monkeypatch):
    from lmledger.callbacks import preflight

    # This machine's share of RAM, as PreflightGuard sees it for LitLM, less than the predicted peak.
    monkeypatch.setattr(preflight, "available_ram", lambda: preflight.Capacity(1000, "MemAvailable in /proc/meminfo"))
    module = Regressor()
    held = sum(t.numel() * t.element_size() for t in module.parameters())
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Ledger()])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)), batch_size=16)
    with pytest.raises(UserError, match=rf"exceeds the {format_bytes(1000 + held)} available \(MemAvailable"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0


def test_litlm_gets_the_toy_ledger(workdir):
    from lmledger.data import TokenDataModule
    from lmledger.lit import LitLM
    from lmledger.model import ModelConfig

    data = TokenDataModule(path="data/stdlib", batch_size=2, context_length=16)
    module = LitLM(config=ModelConfig(vocab_size=data.vocab_size, context_length=16, d_model=32, n_layers=1,
                                      n_heads=2, d_ff=64))  # fmt: skip
    ledger = Ledger()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0, callbacks=[ledger])  # fmt: skip
    trainer.fit(module, datamodule=data)
    # Two predictors, the dry run of LitLM's own training step (fused AdamW) and the closed forms.
    dry, closed = ledger.report.predicted["dry run"], ledger.report.predicted["closed form"]
    assert ledger.measured.params == dry.params == closed.params
    for name in ("params", "grads", "optimizer", "activations", "flops_hardware", "flops_model"):
        assert dry.get(name) == closed.get(name), name
    assert dry.peak == pytest.approx(closed.peak, rel=0.02)
    assert ledger.measured.peak == pytest.approx(dry.peak, rel=0.02)


@pytest.mark.parametrize("steps", [1, 2])
def test_short_fits_leave_nothing_attached(steps):
    """The peak is measured on step 2, with the cycle collector paused for that step only."""
    import gc

    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 8, generator=g)), batch_size=16)
    ledger = Ledger()
    fit(Regressor(), loader, [ledger], steps=steps)
    child = ledger
    assert gc.isenabled() and child.measurement._tracker is None and child.measurement._counter is None
    assert child.measured.params == child.predicted.params
    assert (child.measured.peak is not None) == (steps == 2)


def test_fast_dev_run_writes_no_rank_record(tmp_path):
    """Lightning suppresses logging and checkpoints under fast_dev_run; the Ledger wrote its ranks/rank0.json beside
    the default checkpoint directory all the same."""
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 8, generator=g)), batch_size=16)
    ledger = Ledger()
    trainer = pl.Trainer(fast_dev_run=2, accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ledger])  # fmt: skip
    trainer.fit(Regressor(), loader)
    assert ledger.measured.params == ledger.predicted.params > 0
    assert list(tmp_path.iterdir()) == []


def lightning_demo_transformer() -> pl.LightningModule:
    """Lightning's own demo LM (lightning.pytorch.demos), tiny. Its forward reads a mask's value
    (`if self.src_mask is None or ...` then masked_fill on `mask == 1`), so the dry run cannot trace it."""
    from lightning.pytorch.demos import LightningTransformer, Transformer

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2 here; these tests bring their batches
            pass

    torch.manual_seed(0)
    module = Demo(vocab_size=64)
    module.model = Transformer(vocab_size=64, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.0)
    return module


@pytest.mark.parametrize("logger, steps", [("tensorboard", 3), ("tensorboard", 1), ("csv", 3), ("none", 3)])
def test_measured_only_never_crashes_under_any_logger(logger, steps, tmp_path):
    """Issue 28 §5: a module the dry run cannot trace, under Lightning's default TensorBoardLogger, crashed in
    the predicted-vs-measured chart (no prediction to draw). Measured only runs under every logger."""
    from lightning.pytorch.loggers import CSVLogger

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4 * BATCH, 8), generator=g)
    loader = DataLoader(TensorDataset(ids, ids.roll(-1, dims=1)), batch_size=BATCH)
    made = {"tensorboard": lambda: TensorBoardLogger(tmp_path, name="run"), "csv": lambda: CSVLogger(tmp_path),
            "none": lambda: False}[logger]()  # fmt: skip
    ledger = Ledger(warmup_steps=1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=made, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[ledger])  # fmt: skip
    trainer.fit(lightning_demo_transformer(), loader)
    assert ledger.predicted is None and "fake tensors hold no values" in ledger.why_not_predicted
    assert ledger.measured.params > 0 and trainer.global_step == steps
    if logger == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
        events.Reload()
        assert "memory/predicted_vs_measured" in events.Tags()["images"]  # the chart, measured bars only
        scalars = read_scalars(trainer.logger.log_dir)
        assert scalars["memory/measured/params"][0][1] == ledger.measured.params
        assert "ledger/check/misses" not in scalars and ledger.check == []  # nothing to check it against
        assert "ledger/check/text_summary" in events.Tags()["tensors"]  # "nothing to check: not predicted (...)"
    elif logger == "csv":
        assert "memory/measured/params" in (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0]


def regression_loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)), batch_size=16)


def test_a_profiler_that_cannot_start_leaves_the_fit_running(monkeypatch, recwarn):
    """Issue 28 §5: Kineto failing to start killed the fit, behind TimeLedger.on_exception's own AttributeError.
    The time ledger steps aside in one line; the rest of the ledger and the fit go on."""
    from lmledger.ledger.timing import profile

    def start(prof):
        raise RuntimeError("Kineto: profiler failed to start\n(a second line)")

    monkeypatch.setattr(profile, "start", start)
    ledger = Ledger(warmup_steps=1)
    trainer = fit(Regressor(), regression_loader(), [ledger], steps=5)
    assert trainer.global_step == 5 and ledger.measured.peak is not None
    assert ledger.timing.samples == [] and "RuntimeError: Kineto: profiler failed to start" in (
        ledger.timing.why_not_profiled
    )
    said = [str(w.message) for w in recwarn if "time ledger:" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "the fit goes on" in said[0]  # once, not per sampled step
    assert "no step profiled: the profiler did not start" in ledger.timing.report()


class RaisesInAProfiledStep(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:  # the first profiled batch (after the two measured steps)
            raise ValueError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_an_error_inside_a_profiled_step_is_the_one_raised(monkeypatch):
    """TimeLedger.on_exception closes what is open without raising, so the step's own error reaches the user
    even when closing the profiler fails too."""
    from lmledger.ledger.timing import profile

    real_stop = profile.stop

    def stop(prof):
        real_stop(prof)
        raise RuntimeError("stop failed")

    monkeypatch.setattr(profile, "stop", stop)
    ledger = Ledger(warmup_steps=1)
    with pytest.raises(ValueError, match="the user's own error"):
        fit(RaisesInAProfiledStep(), regression_loader(), [ledger], steps=5)
    assert ledger.timing._profiler is None and ledger.timing._record is None
    assert not torch._C._autograd._profiler_enabled()


GRAPH_RUNS: list[int] = []


def counting_backend(gm, inputs):
    """dynamo's graph run as it is (no inductor build in a test), counted each time it runs."""
    return lambda *args: GRAPH_RUNS.append(1) or gm.forward(*args)


class CompiledSubmodule(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend=counting_backend)


def test_the_ledger_leaves_torch_compile_on(tmp_path):
    """Issue 28 §5: the measurement's dispatch modes made dynamo run the compiled submodule eager for the whole
    fit (0 graphs; compiled first, it ran once, then eager from the measured step 2 on). Now the fit compiles and
    runs compiled as it does without the Ledger; FLOPs and the peak are read off the compiled step 2; the dry
    run's eager prediction says in one line what it does not cover."""
    from torch._dynamo.utils import counters

    trainers = []

    def graphs(callbacks, logger=None) -> tuple[int, int, int]:
        torch._dynamo.reset()
        counters.clear()
        GRAPH_RUNS.clear()
        torch.manual_seed(0)
        trainers.append(fit(CompiledSubmodule(), regression_loader(), callbacks, logger, steps=4))
        return counters["stats"]["unique_graphs"], counters["frames"]["ok"], len(GRAPH_RUNS)

    without = graphs([])
    ledger = Ledger(warmup_steps=1)
    # The same graphs, and the compiled graph runs on every step (4), the measured steps 1 and 2 included.
    assert graphs([ledger], tmp_path) == without and without[0] >= 1 and without[2] == 4
    assert ledger.compiled == ["net"]
    assert any(n.startswith("torch.compile (net): the dry run predicts the eager step") for n in ledger.report.notes)
    predicted, measured = ledger.predicted, ledger.measured
    assert measured.flops_hardware == predicted.flops_hardware  # counted on the compiled (dynamo, eager) step 2
    assert measured.peak == pytest.approx(predicted.peak, rel=0.03) and measured.params == predicted.params
    assert measured.activations is None and measured.why_missing["activations"] == "n/a (compiled)"
    scalars = read_scalars(trainers[-1].logger.log_dir)
    assert scalars["ledger/check/misses"][-1][1] == 0 and ledger.check == []  # the self-check ran and passed


class ReachesItsModelThroughAClosure(pl.LightningModule):
    """Issue 28 §5: the model lives outside the LightningModule's attributes; training_step reaches it by name."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.__dict__["net"] = net  # not a submodule: the module holds no parameters
        self.step = lambda x, y: F.mse_loss(net(x), y)  # the closure

    def training_step(self, batch, batch_idx):
        return self.step(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3)


def test_the_ledger_checks_itself_and_names_a_closure(tmp_path, caplog):
    """The dry run sees none of a closure's parameters: optimizer 0 and half the peak predicted (the issue's silent
    miss), params 0 on both sides. The self-check says so, one line per line beyond tolerance (and one for what
    the optimizer steps but the module does not hold), with the ratio and the cause, printed and logged."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    ledger = Ledger(warmup_steps=1)
    with caplog.at_level("INFO"):
        trainer = fit(ReachesItsModelThroughAClosure(net), regression_loader(), [ledger], tmp_path)
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    assert ledger.predicted.params == ledger.measured.params == 0 and ledger.predicted.optimizer == 0
    first, *others = ledger.check
    assert first.startswith(f"ledger check: params: the optimizer steps {format_bytes(held)} of parameters")
    assert f"optimizer measured {ledger.measured.optimizer:,} vs predicted 0 (ratio inf" in others[0]
    assert [line.split(" measured")[0] for line in others] == ["ledger check: optimizer", "ledger check: peak"]
    for line in ledger.check:
        assert "likely cause: training_step reaches its model through a closure" in line, line
        assert "(params, grads, optimizer 0)" in line and "\n" not in line
        assert [r.getMessage() for r in caplog.records].count(line) == 1  # printed once
    scalars = read_scalars(trainer.logger.log_dir)
    assert scalars["ledger/check/misses"][-1][1] == 3
    assert scalars["ledger/check/ratio/peak"][-1][1] == pytest.approx(ledger.measured.peak / ledger.predicted.peak)


def test_the_check_flags_each_line_beyond_its_tolerance():
    from lmledger.ledger.report import TOLERANCE, Figures, Report, misses

    predicted = Figures(params=100, grads=100, optimizer=0, activations=1000, peak=2000, flops_hardware=10)
    measured = Figures(params=100, grads=0, optimizer=0, activations=1099, peak=2201, flops_hardware=11)
    found = misses(Report({"dry run": predicted}, measured=measured))
    assert [(m.line, m.ratio) for m in found] == [("grads", 0.0), ("peak", 1.1005), ("flops_hardware", 1.1)]
    assert TOLERANCE["activations"] == 0.10  # 1099 / 1000 is within it
    assert misses(Report({}, measured=measured)) == [] and misses(Report({"dry run": predicted})) == []
    assert misses(Report({"dry run": Figures(grads=0)}, measured=Figures(grads=5)))[0].ratio == float("inf")


def test_compiled_parts_finds_where_a_module_runs_compiled_code():
    from unittest import mock

    from lmledger.callbacks.measure import compiled_parts
    from lmledger.lit import LitLM
    from lmledger.model import ModelConfig

    class DecoratedForward(nn.Module):
        @torch.compile
        def forward(self, x):
            return x

    config = ModelConfig(vocab_size=64, context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    assert compiled_parts(LitLM(config=config, compile=True)) == ["LitLM._forward"]  # kept in __dict__
    assert compiled_parts(LitLM(config=config, compile="blocks")) == ["model.blocks.0", "model.blocks.1"]
    assert compiled_parts(LitLM(config=config)) == [] and compiled_parts(CompiledSubmodule()) == ["net"]
    assert compiled_parts(DecoratedForward()) == ["forward"]
    holds_a_mock = nn.Linear(2, 2)
    holds_a_mock.helper = mock.MagicMock()  # answers every attribute, _torchdynamo_orig_callable too
    assert compiled_parts(holds_a_mock) == []
