"""A causal 1-D convolutional net over bytes: a language model with no attention and no transformers.

Each layer is a depthwise causal convolution (left padding only, so position t sees bytes <= t) followed
by a pointwise MLP, both residual, with LayerNorm before each (a ConvNeXt-style block in one dimension).
The receptive field grows by kernel_size - 1 bytes per layer. Batches are lmledger's (inputs, targets)
token windows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples._common import TokenWindowModule, next_token_loss


class CausalConvBlock(nn.Module):
    def __init__(self, width: int, kernel_size: int, expansion: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv_norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, kernel_size, groups=width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, expansion * width), nn.GELU(), nn.Linear(expansion * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, width)."""
        h = self.conv_norm(x).transpose(1, 2)  # (batch, width, seq) for Conv1d
        h = self.conv(F.pad(h, (self.kernel_size - 1, 0)))  # causal: pad on the left only
        x = x + h.transpose(1, 2)
        return x + self.mlp(self.mlp_norm(x))


class ByteConvNet(TokenWindowModule):
    """Next-byte prediction with a stack of causal convolution blocks."""

    def __init__(
        self,
        vocab_size: int = 256,
        width: int = 128,
        num_layers: int = 4,
        kernel_size: int = 8,
        expansion: int = 2,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.Sequential(*(CausalConvBlock(width, kernel_size, expansion) for _ in range(num_layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(inputs))))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return next_token_loss(self(inputs), targets)

    def decays(self, param: nn.Parameter) -> bool:
        return param.ndim >= 2 and param is not self.embed.weight  # the embedding, like norms, is not decayed
