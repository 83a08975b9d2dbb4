"""What every example shares: training on lmledger's (inputs, targets) token windows with AdamW.

A subclass sets `lr` and `weight_decay`, defines `loss(batch)`, and may narrow `decays(p)` (which
parameters take weight decay; matrices by default, so norms' gains and biases do not).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on every position, in fp32; targets are already shifted by one (lmledger's windows)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TokenWindowModule(pl.LightningModule):
    """A LightningModule trained on (inputs, targets) token windows: logs train/loss and val/loss."""

    lr: float
    weight_decay: float

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def decays(self, param: nn.Parameter) -> bool:
        return param.ndim >= 2

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if self.decays(p)], "weight_decay": self.weight_decay},
            {"params": [p for p in params if not self.decays(p)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.lr)
