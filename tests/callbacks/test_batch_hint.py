"""The Ledger's batch hint is the same dry run as its prediction (callbacks.dryrun.largest_training_batch,
issue 33 §2): under manual optimization too, where it used to say only "lower the batch size"."""

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lmledger.callbacks import Ledger
from lmledger.errors import UserError


class SteppedByHand(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt = self.optimizers()
        loss = F.mse_loss(self.net(x), x)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(batch_size: int, device_memory_gb: float) -> pl.Trainer:
    data = TensorDataset(torch.randn(64, 256, 16, generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Ledger(device_memory_gb=device_memory_gb, warmup_steps=0)])  # fmt: skip
    trainer.fit(SteppedByHand(), DataLoader(data, batch_size=batch_size))
    return trainer


def test_a_manual_step_that_does_not_fit_is_told_the_largest_batch_that_does():
    budget = 0.001  # 1 MB: a few samples' activations (~0.2 MB each) beside the state (~30 kB)
    with pytest.raises(UserError) as refused:
        _fit(32, budget)
    fits = int(re.search(r"a batch of (\d+) fits \(now 32\)", str(refused.value)).group(1))
    assert 1 <= fits < 32
    assert _fit(fits, budget).global_step == 1  # it fits, and is the largest that does
    with pytest.raises(UserError, match="exceeds"):
        _fit(fits + 1, budget)
