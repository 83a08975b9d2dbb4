"""The fit's measuring pipeline: gradient accumulation predicted and measured per optimizer step, one Ledger
per Trainer, training untouched by the ledger, and model FLOPs (3 x forward) for any module."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lmledger.callbacks import Ledger
from lmledger.errors import UserError
from lmledger.ledger.closedform.flops import analytic_flops
from lmledger.ledger.dryrun.engine import dry_run
from lmledger.model import ModelConfig, ToyLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` lives at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_moe's module

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster on one thread

BATCH, SEQ = 4, 32


def token_loader(n_batches: int = 10) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, 256, (n_batches * BATCH, SEQ), generator=g) for _ in range(2))
    return DataLoader(TensorDataset(inputs, targets), batch_size=BATCH)


def fit(module, loader, callbacks, *, steps=3, accumulate=1, precision="32-true") -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, callbacks=callbacks)  # fmt: skip
    trainer.fit(module, loader)
    return trainer


def tiny_llama():
    pytest.importorskip("transformers")
    from examples.hf_lm import LlamaLM

    torch.manual_seed(0)
    return LlamaLM(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, context_length=SEQ)


# --- gradient accumulation ----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_accumulation_is_predicted_per_optimizer_step(accumulate, precision):
    ledger = Ledger(warmup_steps=0)
    fit(tiny_llama(), token_loader(), [ledger], steps=2, accumulate=accumulate, precision=precision)
    predicted, measured = ledger.predicted, ledger.measured
    assert predicted is not None, ledger.why_not_predicted
    for name in ("params", "grads", "optimizer"):  # read after the optimizer step, never 0
        assert measured.get(name) == predicted.get(name) > 0, name
    assert measured.activations == pytest.approx(predicted.activations, rel=0.01)  # one micro-batch's
    assert measured.flops_hardware == predicted.flops_hardware  # every micro-batch of the step
    assert measured.peak == pytest.approx(predicted.peak, rel=0.03)
    assert measured.peak_phase == predicted.peak_phase


def test_accumulation_multiplies_flops_and_keeps_grads_through_later_micro_batches():
    one, four = Ledger(warmup_steps=0), Ledger(warmup_steps=0)
    fit(tiny_llama(), token_loader(), [one], steps=2)
    fit(tiny_llama(), token_loader(), [four], steps=2, accumulate=4)
    assert four.predicted.flops_hardware == 4 * one.predicted.flops_hardware
    assert four.predicted.activations == one.predicted.activations
    # The later micro-batches run with the step's grads alive: their peak is at least the first one's.
    assert four.measured.peak >= one.measured.peak


def test_the_toy_ledger_accumulates_too(workdir):
    from lmledger.data import TokenDataModule
    from lmledger.lit import LitLM

    data = TokenDataModule(path="data/stdlib", batch_size=2, context_length=16)
    cfg = ModelConfig(vocab_size=data.vocab_size, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    ledger = Ledger(warmup_steps=0)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0, accumulate_grad_batches=3,
                         callbacks=[ledger])  # fmt: skip
    trainer.fit(LitLM(config=cfg), datamodule=data)
    dry, closed = ledger.report.predicted["dry run"], ledger.report.predicted["closed form"]
    assert dry.flops_hardware == closed.flops_hardware == 3 * analytic_flops(cfg, 2, 16).hardware
    assert closed.peak is None and "one micro-batch" in closed.why_missing["peak"]
    assert ledger.measured.optimizer == dry.optimizer > 0
    assert ledger.measured.peak == pytest.approx(dry.peak, rel=0.02)


# --- one Ledger, training untouched ---------------------------------------------------------------------


def test_two_ledgers_in_one_trainer_are_refused():
    with pytest.raises(UserError, match="2 Ledger callbacks"):
        fit(tiny_llama(), token_loader(), [Ledger(), Ledger()])


class DrawsFromEveryGenerator(pl.LightningModule):
    """A step that draws from Python's random and numpy's global generator as well as torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = random.random() + float(np.random.rand()) + float(torch.rand(()))
        return F.mse_loss(self.net(x) * (1 + 0.01 * noise), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_ledger_leaves_every_generator_a_step_draws_from_as_it_was():
    def train(callbacks) -> float:
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        module = DrawsFromEveryGenerator()
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
        fit(module, DataLoader(data, batch_size=16), callbacks, steps=4)
        return sum(p.sum() for p in module.parameters()).item()

    assert train([Ledger(warmup_steps=1)]) == train([])


def test_lightnings_boring_model_is_predicted_within_its_loss_copies():
    """Lightning keeps a divided loss and a detached copy of it per step (ClosureResult), which the dry run
    models; BoringModel's peak is 688 B, so a few bytes are the whole tolerance."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    ledger = Ledger(warmup_steps=1)
    fit(BoringModel(), None, [ledger])
    assert ledger.measured.peak - ledger.predicted.peak <= 4  # was 8 before the copies were modelled


# --- model FLOPs for any module ---------------------------------------------------------------------------


def test_three_forwards_are_6n_plus_attention_for_the_toy_lm():
    cfg = ModelConfig(vocab_size=256, context_length=SEQ, d_model=64, n_layers=2, n_heads=2, d_ff=128)
    batch = tuple(torch.empty(BATCH, SEQ, dtype=torch.long, device="meta") for _ in range(2))
    step = dry_run(ToyLM(cfg), batch, step=lambda model, b: model(*b))
    assert 3 * step.flops_forward == analytic_flops(cfg, BATCH, SEQ).model


def test_three_forwards_are_6n_plus_attention_for_hf_llama():
    module = tiny_llama()
    cfg = module.model.config
    batch = tuple(torch.empty(BATCH, SEQ, dtype=torch.long, device="meta") for _ in range(2))
    step = dry_run(module, batch, step=lambda m, b: m.training_step(b, 0))
    d, layers, ff, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    kv = d * cfg.num_key_value_heads // cfg.num_attention_heads
    n_matmul = layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * vocab  # q, o, k, v, MLP; the LM head
    tokens = BATCH * SEQ
    model_flops = 6 * n_matmul * tokens + 12 * layers * d * SEQ * tokens  # PaLM appendix B: 6N + 12·L·H·Q·T
    assert 3 * step.flops_forward == model_flops


def test_any_module_gets_mfu_beside_hfu(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from conftest import read_scalars

    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="run"),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[Ledger(warmup_steps=1)])  # fmt: skip
    trainer.fit(tiny_llama(), token_loader())
    scalars = read_scalars(trainer.logger.log_dir)
    for (_, mfu), (_, hfu) in zip(scalars["perf/mfu"], scalars["perf/hfu"], strict=True):
        assert 0 < mfu <= hfu <= 1  # model FLOPs leave out the recompute hardware FLOPs count
    assert scalars["flops/model_per_step"][0][1] < scalars["flops/hardware_per_step"][0][1]


# --- several optimizers and manual optimization ------------------------------------------------------------


class GAN(pl.LightningModule):
    """Two networks, two optimizers, stepped by hand (Lightning's GAN pattern: toggle, manual_backward, step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        noise = torch.zeros(real.shape[0], 8, device=real.device) + 0.5
        with self.toggled_optimizer(g_opt):
            fake = self.generator(noise)
            g_loss = F.softplus(-self.discriminator(fake)).mean()
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
        with self.toggled_optimizer(d_opt):
            d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            d_opt.step()

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.SGD(self.discriminator.parameters(), lr=1e-2, momentum=0.9),
        )


class ClipsItself(pl.LightningModule):
    """Manual optimization with Lightning's clipping and a scheduler the step advances."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = F.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _regression_loader(*shapes: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(*(torch.randn(96, n, generator=g) for n in shapes)), batch_size=16)


@pytest.mark.parametrize("module, shapes", [(GAN, (16,)), (ClipsItself, (16, 8))])
def test_manual_optimization_is_predicted(module, shapes):
    ledger = Ledger(warmup_steps=1)
    torch.manual_seed(0)
    trained = module()
    fit(trained, _regression_loader(*shapes), [ledger], steps=6)
    predicted, measured = ledger.predicted, ledger.measured
    assert predicted is not None, ledger.why_not_predicted
    for name in ("params", "grads", "optimizer"):
        assert measured.get(name) == predicted.get(name) > 0, name
    assert measured.activations == predicted.activations
    assert measured.flops_hardware == predicted.flops_hardware
    assert measured.peak == pytest.approx(predicted.peak, rel=0.03)


def test_a_manual_steps_ops_are_recorded_in_their_phases_for_the_time_ledger():
    """Each manual_backward's ops are backward, each optimizer's step's are the optimizer step (both optimizers),
    the rest forward; their FLOPs are the step's, and the module's Python is timed. Before, the manual dry run kept
    no op records, and a fit said "no step-time prediction"."""
    torch.manual_seed(0)
    gan = GAN()
    optimizers = gan.configure_optimizers()
    (real,) = next(iter(_regression_loader(16)))
    ledger = dry_run(gan, real, step=lambda m, b: m.training_step((b,), 0), optimizer=optimizers, manual=True)
    ops = ledger.ops
    assert ops is not None and ops.outside is not None and ops.outside.dispatches > 0
    flops = {phase: sum(op.flops for op in ops.ops if op.phase == phase) for phase in ("forward", "backward")}
    assert (flops["forward"], flops["backward"]) == (ledger.flops_forward, ledger.flops_backward)
    assert flops["forward"] > 0 and flops["backward"] > 0
    stepped = [op for op in ops.ops if op.phase == "optimizer step"]
    # both optimizers step each of their networks' 4 tensors: Adam's first moment, SGD's new momentum buffer
    assert sum(op.name == "aten.lerp_.Scalar" for op in stepped) == len(list(gan.generator.parameters())) == 4
    assert sum(op.name == "aten.clone.default" for op in stepped) == len(list(gan.discriminator.parameters())) == 4
    order = [op.phase for op in ops.ops]  # the generator's step, then the discriminator's forward, as the step runs
    first_step = order.index("optimizer step")
    assert "forward" in order[first_step:] and "backward" in order[first_step:]


def test_a_span_left_out_of_the_dispatch_clock_counts_only_while_the_clock_runs():
    """The manual step's first run (ops recorded, clock not entered) steps its optimizers inside left_out too: that
    must not take their time off the second run's (the clock's) wall time."""
    import time

    from lmledger.ledger.count.ops import DispatchClock

    clock = DispatchClock()
    with clock.left_out():
        time.sleep(0.02)  # not entered: nothing counted, nothing taken off
    assert clock.wall_s == 0.0
    with clock:
        torch.ones(4).add_(1)
        with clock.left_out():
            torch.ones(4).mul_(2)
            time.sleep(0.02)
    assert 0 <= clock.wall_s < 0.02 and clock.dispatches == 2  # ones and add_; the left-out span's ops not counted


def test_the_dry_run_of_a_manual_step_leaves_the_real_module_alone():
    """toggle_optimizer, the schedulers and requires_grad of the real module are untouched by the fake step."""
    torch.manual_seed(0)
    module = ClipsItself()
    ledger = Ledger(warmup_steps=1, measure=False)
    trainer = fit(module, _regression_loader(16, 8), [ledger], steps=2)
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [1e-2 * 0.5**2]  # two real steps only
    assert all(p.requires_grad for p in module.parameters())


# --- mixture of experts ------------------------------------------------------------------------------------


class MoELM(pl.LightningModule):
    """tests/ledger/test_moe.py's plain top-k MoE layer as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        from test_moe import TopKMoE

        self.net = TopKMoE()

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def moe_loader() -> DataLoader:
    from test_moe import VOCAB

    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, VOCAB, (16, 128), generator=g) for _ in range(2))
    return DataLoader(TensorDataset(inputs, targets), batch_size=4)


def test_a_mixture_of_experts_gets_both_routings_and_is_checked_against_the_worst():
    torch.manual_seed(0)
    ledger = Ledger(warmup_steps=1)
    fit(MoELM(), moe_loader(), [ledger], steps=2)
    balanced, worst = ledger.report.predicted["dry run"], ledger.report.predicted["worst routing"]
    assert balanced.peak < worst.peak
    assert ledger.measured.peak <= worst.peak
    assert ledger.measured.params == balanced.params == worst.params
    with pytest.raises(UserError, match="exceeds"):  # the check holds the worst routing, not the balanced one
        fit(MoELM(), moe_loader(), [Ledger(device_memory_gb=(balanced.peak + worst.peak) / 2e9)], steps=1)


def test_the_report_renders_the_same_figures_as_json_and_scalars():
    import json

    ledger = Ledger(warmup_steps=1)
    fit(tiny_llama(), token_loader(), [ledger], steps=2)
    report = ledger.report
    data = json.loads(json.dumps(report.to_json()))
    scalars = report.scalars()
    for line in ("params", "grads", "optimizer", "activations", "peak"):  # a tag is its figure's JSON path
        assert data["memory"][line]["predicted"] == report.predicted["dry run"].get(line)
        assert data["memory"][line]["measured"] == ledger.measured.get(line) == scalars[f"memory/measured/{line}"]
        assert scalars[f"memory/predicted/{line}"] == data["memory"][line]["predicted"]
    assert data["flops"]["measured"] == scalars["flops/measured_per_step"]
    assert scalars["flops/model_per_step"] == data["flops"]["model"]
