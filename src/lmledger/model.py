"""The toy decoder-only language model: plain PyTorch + einops, no Lightning.

Pre-norm transformer:
    token embedding
    -> n_layers x [RMSNorm -> causal self-attention (RoPE, SDPA) -> residual,
                   RMSNorm -> SwiGLU MLP -> residual]
    -> RMSNorm -> LM head
No biases, no dropout. Positions are rotary (RoPE), which adds no parameters.
So N counts only the weights that do matmuls, the embedding table and the norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmledger.errors import ConfigError

__all__ = ["Block", "CausalSelfAttention", "ModelConfig", "RotaryEmbedding", "SwiGLU", "ToyLM", "count_parameters"]


# The largest size of a model dimension, layer count or context: 2**24. Beyond any trained LM (Llama 3 405B:
# d_model 16,384, d_ff 53,248, 126 layers, vocabulary 128,256; Llama 4 Scout's context: 10M tokens).
MAX_SIZE = 1 << 24


@dataclass(frozen=True)  # frozen: LitLM's default instance is shared
class ModelConfig:
    vocab_size: int = 256
    context_length: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Recompute every n-th block in backward (torch.utils.checkpoint): 0 = off, 1 = every block.
    activation_checkpointing: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}")
            if getattr(self, name) > MAX_SIZE:
                raise ConfigError(f"model {name} {getattr(self, name)} is beyond any model: at most {MAX_SIZE:,}")
        for name in ("rope_theta", "norm_eps"):
            if not 0 < getattr(self, name) < math.inf:  # nan fails both comparisons
                raise ConfigError(f"model {name} must be a finite number > 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head dim d_model/n_heads = {self.head_dim} must be even for RoPE")
        if not 0 <= self.activation_checkpointing <= MAX_SIZE:
            raise ConfigError("activation_checkpointing must be >= 0 (0 = off, n = every n-th block)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_checkpointed(self, layer: int) -> bool:
        n = self.activation_checkpointing
        return n > 0 and layer % n == 0


def count_parameters(cfg: ModelConfig) -> int:
    """Closed-form parameter count; `ToyLM.num_parameters()` must equal it."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # qkv + out, SwiGLU w1 w2 w3, two RMSNorm gains
    embeddings = v * d if cfg.tie_embeddings else 2 * v * d
    return cfg.n_layers * per_layer + embeddings + d  # + final norm


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Su et al. 2021) with cos/sin tables cached as non-persistent buffers."""

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_len, head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim)."""
        seq = x.shape[-2]
        # Match x's dtype so bf16 activations stay bf16 (an fp32 table would promote them).
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Grouped per head, (q|k|v) within each: a column split of qkv (tensor parallel, ledger.sharding.tp) gives each
        # rank whole heads, and a checkpoint the same layout at any TP size.
        q, k, v = rearrange(self.qkv(x), "b t (h three d) -> three b h t d", three=3, h=self.n_heads)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ToyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Truncated normal (at 3 sigma) with std 1/sqrt(fan_in) for every matmul weight.

        An untied embedding is a lookup table: fan_in 1, std 1. A tied one is also the LM head,
        whose fan_in is d_model. So it takes std 1/sqrt(d_model), and logits start at unit scale.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed.weight:
                std = 1.0 / math.sqrt(module.in_features)
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        std = 1.0 / math.sqrt(self.cfg.d_model) if self.cfg.tie_embeddings else 1.0
        nn.init.trunc_normal_(self.embed.weight, std=std, a=-3 * std, b=3 * std)

    def num_parameters(self) -> int:
        """Unique parameters (a tied embedding/LM-head weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (batch, seq) token ids. Returns logits (batch, seq, vocab).

        Given targets (batch, seq), returns the mean next-token cross-entropy instead."""
        if idx.shape[1] > self.cfg.context_length:
            raise ConfigError(f"sequence length {idx.shape[1]} > context_length {self.cfg.context_length}")
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if self.training and self.cfg.is_checkpointed(i) and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v").float(), rearrange(targets, "b t -> (b t)"))
