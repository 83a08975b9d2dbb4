"""The tiny toy LM, batch and AdamW the real-rank tests (DDP buckets, DDP and FSDP2 accumulation) share.

Module-level functions, so spawned gloo ranks can import them by name."""

from __future__ import annotations

import torch

from lmledger.model import ModelConfig, ToyLM

CFG = ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=2, d_ff=128)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch 4 x 32 of token ids and targets, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def model() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM(CFG)
