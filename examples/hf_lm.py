"""Hugging Face causal LMs as LightningModules: LlamaForCausalLM and GPT2LMHeadModel, tiny, no download.

The model is built from a config object (random weights), so nothing is fetched from the Hub. Batches
are lmledger's (inputs, targets) token windows, targets already shifted by one, so the loss is taken
here on every position (Hugging Face's `labels=` would shift a second time). Weight decay applies to
matrices (embeddings included), not to norms' gains and biases.
"""

from __future__ import annotations

import torch
from torch import nn

from examples._common import TokenWindowModule
from lmledger.errors import ConfigError
from lmledger.hf import causal_lm_loss, checkpoint_layers


class HFCausalLM(TokenWindowModule):
    """A `transformers` causal LM trained on (inputs, targets) token windows; subclasses build the model."""

    def __init__(self, lr: float = 3e-3, weight_decay: float = 0.1, activation_checkpointing: int = 0) -> None:
        super().__init__()
        if activation_checkpointing < 0:
            raise ConfigError("activation_checkpointing must be >= 0 (0 = off, n = every n-th layer)")
        self.lr, self.weight_decay = lr, weight_decay
        self.model = self.build()
        if activation_checkpointing:  # recompute every n-th decoder layer in backward
            checkpoint_layers(self.model, activation_checkpointing)

    def build(self) -> nn.Module:
        raise NotImplementedError

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return causal_lm_loss(self.model, batch)


class LlamaLM(HFCausalLM):
    """LlamaForCausalLM: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied LM head."""

    def __init__(
        self, vocab_size: int = 256, context_length: int = 128, hidden_size: int = 128, num_layers: int = 4,
        num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384, lr: float = 3e-3,
        weight_decay: float = 0.1, activation_checkpointing: int = 0,
    ) -> None:  # fmt: skip
        self.hf_config = _llama_config(
            vocab_size, context_length, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size
        )
        super().__init__(lr, weight_decay, activation_checkpointing)
        self.save_hyperparameters()

    def build(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(self.hf_config)


class GPT2LM(HFCausalLM):
    """GPT2LMHeadModel: LayerNorm, learned positions, GELU MLP (4x), tied LM head, biases."""

    def __init__(
        self, vocab_size: int = 256, context_length: int = 128, hidden_size: int = 128, num_layers: int = 4,
        num_heads: int = 4, dropout: float = 0.0, lr: float = 3e-3, weight_decay: float = 0.1,
        activation_checkpointing: int = 0,
    ) -> None:  # fmt: skip
        from transformers import GPT2Config

        # bos/eos 0: GPT-2's own ids (50256) lie outside a byte vocabulary
        self.hf_config = GPT2Config(
            vocab_size=vocab_size, n_positions=context_length, n_embd=hidden_size, n_layer=num_layers,
            n_head=num_heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        super().__init__(lr, weight_decay, activation_checkpointing)
        self.save_hyperparameters()

    def build(self) -> nn.Module:
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(self.hf_config)


def _llama_config(vocab, context, hidden, layers, heads, kv_heads, intermediate):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, max_position_embeddings=context, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate, bos_token_id=0,
        eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
