"""The toy decoder-only language model: plain PyTorch + einops, no Lightning.

Pre-norm transformer, by default Llama-style:
    token embedding
    -> n_layers x [RMSNorm -> causal self-attention (RoPE, SDPA) -> residual,
                   RMSNorm -> SwiGLU MLP -> residual]
    -> RMSNorm -> LM head
No biases, no dropout. Positions are rotary (RoPE), which adds no parameters.
So N counts only the weights that do matmuls, the embedding table and the norms.

ModelConfig's architecture options give the published families' shapes (docs/any-model.md):
GPT-2 / Megatron GPT (norm "layer", mlp "gelu", positions "learned", bias), MPT (LayerNorm, GeLU,
no bias), Llama 2/3 (the default, with n_kv_heads < n_heads: grouped-query attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmledger.errors import ConfigError

__all__ = [
    "ARCHITECTURE_CHOICES",
    "Block",
    "CausalSelfAttention",
    "GeluMLP",
    "ModelConfig",
    "RotaryEmbedding",
    "SwiGLU",
    "ToyLM",
    "block_linears",
    "count_parameters",
]


# The largest size of a model dimension, layer count or context: 2**24. Beyond any trained LM (Llama 3 405B:
# d_model 16,384, d_ff 53,248, 126 layers, vocabulary 128,256; Llama 4 Scout's context: 10M tokens).
MAX_SIZE = 1 << 24

# The named architecture options and their choices, the default first.
ARCHITECTURE_CHOICES = {"mlp": ("swiglu", "gelu"), "norm": ("rms", "layer"), "positions": ("rope", "learned")}


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
    # Architecture options (defaults: Llama-style). mlp "gelu" is w2(gelu_tanh(w1 x)), d_ff wide (GPT-2, Megatron).
    mlp: str = "swiglu"
    norm: str = "rms"  # or "layer": nn.LayerNorm, with a bias when `bias` is set
    positions: str = "rope"  # or "learned": an (context_length, d_model) table added to the token embedding
    n_kv_heads: int | None = None  # None: one KV head per query head; fewer: grouped-query attention
    bias: bool = False  # biases on every block Linear and on LayerNorm (the LM head has none, as GPT-2's)

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
        if self.head_dim % 2 and self.positions == "rope":
            raise ConfigError(f"head dim d_model/n_heads = {self.head_dim} must be even for RoPE")
        if not 0 <= self.activation_checkpointing <= MAX_SIZE:
            raise ConfigError("activation_checkpointing must be >= 0 (0 = off, n = every n-th block)")
        self._check_architecture()

    def _check_architecture(self) -> None:
        for name, choices in ARCHITECTURE_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"model {name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"model bias must be true or false, got {self.bias!r}")
        kv = self.n_kv_heads
        if kv is None:
            return
        if isinstance(kv, bool) or not isinstance(kv, int) or not 0 < kv <= MAX_SIZE:
            raise ConfigError(f"model n_kv_heads must be a positive whole number or null (= n_heads), got {kv!r}")
        if self.n_heads % kv:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is None (MHA)."""
        return self.n_kv_heads or self.n_heads

    @property
    def non_default_architecture(self) -> list[str]:
        """The architecture options set away from the default toy LM, as `name=value` (empty for the default)."""
        changed = [
            f"{name}={getattr(self, name)}" for name, ch in ARCHITECTURE_CHOICES.items() if getattr(self, name) != ch[0]
        ]
        if self.kv_heads != self.n_heads:
            changed.append(f"n_kv_heads={self.n_kv_heads}")
        return changed + (["bias=true"] if self.bias else [])

    def is_checkpointed(self, layer: int) -> bool:
        n = self.activation_checkpointing
        return n > 0 and layer % n == 0


def block_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of one block, by module name."""
    d, f = cfg.d_model, cfg.d_ff
    linears = {"attn.qkv": (d, d + 2 * cfg.kv_heads * cfg.head_dim), "attn.out": (d, d), "mlp.w1": (d, f)}
    if cfg.mlp == "swiglu":
        linears["mlp.w3"] = (d, f)
    return {**linears, "mlp.w2": (f, d)}


def count_parameters(cfg: ModelConfig) -> int:
    """Closed-form parameter count; `ToyLM.num_parameters()` must equal it."""
    d, v = cfg.d_model, cfg.vocab_size
    linears = sum(i * o + (o if cfg.bias else 0) for i, o in block_linears(cfg).values())
    norm = 2 * d if cfg.norm == "layer" and cfg.bias else d  # gain, and LayerNorm's bias
    embeddings = v * d if cfg.tie_embeddings else 2 * v * d
    positions = cfg.context_length * d if cfg.positions == "learned" else 0
    return cfg.n_layers * (linears + 2 * norm) + embeddings + positions + norm  # + final norm


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
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        qkv_out = cfg.d_model + 2 * cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, qkv_out, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.rope = (
            RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta) if cfg.positions == "rope" else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Grouped per KV head: each group's query heads, then its k, then its v. A column split of qkv (tensor
        # parallel, ledger.sharding.tp) gives each rank whole groups, and a checkpoint the same layout at any TP
        # size. With one KV head per query head this is (h three d), per head (q|k|v).
        per_group = self.n_heads // self.n_kv_heads
        qkv = rearrange(self.qkv(x), "b t (g s d) -> b g s t d", g=self.n_kv_heads, s=per_group + 2)
        q = rearrange(qkv[:, :, :per_group], "b g s t d -> b (g s) t d")
        k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if per_group > 1:
            # k and v repeated per query head (as HF's repeat_kv): every SDPA kernel, torch 2.4's (no enable_gqa),
            # and FlopCounterMode's formulas take them. The copies are saved for backward, and the ledger counts them.
            k, v = (repeat(t, "b g t d -> b (g s) t d", s=per_group) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)), GeLU's tanh approximation (GPT-2, Megatron's GPT). w1 up, w2 down: the TP plan's names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The config's norm over d_model: RMSNorm (gain only), or LayerNorm (gain, and a bias with cfg.bias)."""
    if cfg.norm == "layer":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else GeluMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ToyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Learned absolute positions (GPT-2's wpe); registered only then, so a RoPE model's keys are unchanged.
        self.pos_embed = nn.Embedding(cfg.context_length, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        # The index of blocks[0] in the whole model: a pipeline stage (ledger.sharding.pipeline) keeps a slice of
        # the blocks, and checkpointing picks blocks by their index in the whole model. A plain int beside a
        # ModuleList rather than torchtitan's ModuleDict: FSDP, TP and the checkpoint wrappers find the blocks as a
        # ModuleList's children, and the state-dict keys of the whole model stay blocks.0, blocks.1, ...
        self.block_offset = 0
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Truncated normal (at 3 sigma) with std 1/sqrt(fan_in) for every matmul weight.

        An untied embedding is a lookup table: fan_in 1, std 1. A tied one is also the LM head,
        whose fan_in is d_model. So it takes std 1/sqrt(d_model), and logits start at unit scale.
        A learned position table takes the token table's std, so the two add at one scale. Biases
        start at zero, norms at gain 1 (and bias 0).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed.weight:
                std = 1.0 / math.sqrt(module.in_features)
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        std = 1.0 / math.sqrt(self.cfg.d_model) if self.cfg.tie_embeddings else 1.0
        nn.init.trunc_normal_(self.embed.weight, std=std, a=-3 * std, b=3 * std)
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed.weight, std=std, a=-3 * std, b=3 * std)

    def num_parameters(self) -> int:
        """Unique parameters (a tied embedding/LM-head weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (batch, seq) token ids. Returns logits (batch, seq, vocab).

        Given targets (batch, seq), returns the mean next-token cross-entropy instead. A pipeline stage
        (ledger.sharding.pipeline) without `embed` takes the previous stage's hidden states (batch, seq, d_model)
        as `idx`; one without `lm_head` returns its hidden states (after `norm`, where it has one)."""
        if idx.shape[1] > self.cfg.context_length:
            raise ConfigError(f"sequence length {idx.shape[1]} > context_length {self.cfg.context_length}")
        x = idx
        if self.embed is not None:
            x = self.embed(idx)
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks, start=self.block_offset):
            if self.training and self.cfg.is_checkpointed(i) and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is None:
            if targets is not None:
                raise ConfigError("a pipeline stage without the LM head returns hidden states: it takes no targets")
            return x
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v").float(), rearrange(targets, "b t -> (b t)"))
