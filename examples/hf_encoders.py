"""Hugging Face encoder models as LightningModules: a BERT-style masked LM and a T5, tiny, no download.

Both are built from a config object (random weights). Batches are lmledger's (inputs, targets) token
windows. BertMLM masks 15% of positions by a fixed pattern (every 7th token, so the step's shapes and
work do not depend on the data) and predicts them; T5Seq2Seq encodes the window's first half and
decodes its second half (teacher-forced, Hugging Face's own shift of `labels`). benchmarks/step_time.py
predicts their step time beside the measured one.
"""

from __future__ import annotations

import torch
from torch import nn

from examples._common import TokenWindowModule


class _HFModule(TokenWindowModule):
    def __init__(self, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.lr, self.weight_decay = lr, weight_decay


class BertMLM(_HFModule):
    """BertForMaskedLM: bidirectional self-attention, LayerNorm, GELU MLP, learned positions."""

    def __init__(
        self, vocab_size: int = 256, context_length: int = 128, hidden_size: int = 128, num_layers: int = 4,
        num_heads: int = 4, intermediate_size: int = 512, lr: float = 3e-3, weight_decay: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__(lr, weight_decay)
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=vocab_size + 1, hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, intermediate_size=intermediate_size,
            max_position_embeddings=context_length, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )  # fmt: skip
        self.mask_id = vocab_size  # one id past the bytes
        self.model: nn.Module = BertForMaskedLM(config)
        self.save_hyperparameters()

    def loss(self, batch) -> torch.Tensor:
        inputs, _ = batch
        masked = torch.zeros_like(inputs, dtype=torch.bool)
        masked[:, ::7] = True
        labels = torch.where(masked, inputs, torch.full_like(inputs, -100))
        return self.model(input_ids=inputs.masked_fill(masked, self.mask_id), labels=labels).loss


class T5Seq2Seq(_HFModule):
    """T5ForConditionalGeneration: encoder-decoder, relative position buckets, RMS-style LayerNorm."""

    def __init__(
        self, vocab_size: int = 256, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
        d_ff: int = 384, lr: float = 3e-3, weight_decay: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__(lr, weight_decay)
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=vocab_size, d_model=hidden_size, d_kv=hidden_size // num_heads, d_ff=d_ff,
            num_layers=num_layers, num_heads=num_heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        self.model: nn.Module = T5ForConditionalGeneration(config)
        self.save_hyperparameters()

    def loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        half = inputs.shape[1] // 2
        return self.model(input_ids=inputs[:, :half].contiguous(), labels=targets[:, half:].contiguous()).loss
