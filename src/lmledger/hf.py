"""Hugging Face transformers models on lmledger's (inputs, targets) token windows, plain PyTorch.

`causal_lm_loss` is the step a causal LM takes on a window whose targets are already shifted by one (so
no `labels=`, which would shift a second time); `checkpoint_layers` recomputes its decoder layers in
backward under either name transformers has given that switch. Nothing here imports transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmledger.errors import ConfigError

__all__ = ["causal_lm_loss", "checkpoint_layers"]


def causal_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy over every position, in fp32, of a transformers causal LM on (inputs, targets)."""
    inputs, targets = batch
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def checkpoint_layers(model: nn.Module, every_n_layers: int = 1) -> None:
    """Non-reentrant torch.utils.checkpoint of every n-th decoder layer of a transformers model.

    Newer transformers call it activation_checkpointing_enable (5.24 has it, with every_n_layers); older
    ones gradient_checkpointing_enable, every layer only.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(kwargs, every_n_layers=every_n_layers)
    elif every_n_layers == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ConfigError("checkpointing every n-th layer needs a newer transformers: use 0 or 1")
