"""A byte LM that steps two optimizers by hand (manual optimization), as Muon-with-AdamW training does under
Lightning: AdamW for the embedding and the head, SGD with momentum for the blocks. For the planners' tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class TwoOptimizerLM(pl.LightningModule):
    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                    nn.Linear(4 * width, width)) for _ in range(layers)))  # fmt: skip
        self.head = nn.Linear(width, 256)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        adamw, sgd = self.optimizers()
        loss = F.cross_entropy(self.head(self.blocks(self.embed(inputs))).flatten(0, 1), targets.flatten())
        adamw.zero_grad()
        sgd.zero_grad()
        self.manual_backward(loss)
        adamw.step()
        sgd.step()
        return loss

    def configure_optimizers(self):
        ends = [*self.embed.parameters(), *self.head.parameters()]
        return torch.optim.AdamW(ends, lr=1e-3), torch.optim.SGD(self.blocks.parameters(), lr=0.05, momentum=0.9)
