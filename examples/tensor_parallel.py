"""Tensor parallelism beside FSDP2 in a LightningModule's configure_model, in Lightning's TP-tutorial form.

Run under Lightning's ModelParallelStrategy (or lmledger's FSDP2Strategy with tensor_parallel_size), the
module tensor-parallelises itself over `self.device_mesh["tensor_parallel"]`, then fully_shards over
`self.device_mesh["data_parallel"]`. The Ledger() replays this same configure_model on a fake mesh of the
strategy's shape and predicts each rank's step (ledger.sharding.tp, callbacks/fsdp2.py); nothing here is lmledger's.

    LlamaTP      Hugging Face LlamaForCausalLM with the usual Llama plan: colwise q/k/v and the MLP's gate
                 and up projections, rowwise o_proj and down_proj (transformers' own base_model_tp_plan);
                 the embedding split by vocabulary rows, the LM head by vocabulary columns.
                 Grouped-query attention needs the KV heads to divide by the TP size.
    FeedForwardTP  Lightning's TP tutorial's module: a SwiGLU feed-forward (w1, w2, w3), colwise w1 and w3,
                 rowwise w2, trained on random regression data.

    lmledger fit --config configs/examples/hf-llama-tp.yaml
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from examples.hf_lm import LlamaLM
from lmledger.errors import ConfigError

LLAMA_LAYER_PLAN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
LLAMA_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def llama_plan() -> dict:
    """Each decoder layer's plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        **{name: ColwiseParallel() for name in LLAMA_LAYER_PLAN},
        **{name: RowwiseParallel() for name in LLAMA_ROWWISE},
    }


def llama_outer_plan() -> dict:
    """The embedding split by vocabulary rows and the LM head by vocabulary columns, both gathered after
    (torchtitan's, without sequence parallel or loss_parallel)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def parallelize_llama(model: nn.Module, tp_mesh: object) -> None:
    """The plan on a LlamaForCausalLM: every decoder layer, then the embedding and the LM head."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lmledger.ledger.sharding.tp import check_plan

    for wrapped in model.model.layers:
        layer = getattr(wrapped, "_checkpoint_wrapped_module", wrapped)  # torch's checkpoint_wrapper, if any
        check_plan(layer, llama_plan())
        parallelize_module(layer, tp_mesh, llama_plan())
    outer = llama_outer_plan()
    check_plan(model, outer)
    parallelize_module(model, tp_mesh, outer)


class LlamaTP(LlamaLM):
    """LlamaLM with a tensor-parallel plan and FSDP2, in configure_model."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from lmledger.ledger.sharding.tp import check_tensor_parallel

        if isinstance(self.model, FSDPModule):
            return  # sharded already
        mesh = self.device_mesh
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        layers = self.model.model.layers
        if tp_mesh.size() > 1:
            config = self.hf_config
            check_tensor_parallel(config.num_attention_heads, config.intermediate_size, tp_mesh.size())
            if config.num_key_value_heads % tp_mesh.size():
                raise ConfigError(
                    f"num_kv_heads {config.num_key_value_heads} does not divide by tensor_parallel_size "
                    f"{tp_mesh.size()}: choose a tensor_parallel_size that divides the KV heads"
                )
            parallelize_llama(self.model, tp_mesh)
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Under TP the grads live on two meshes (dp x tp, and dp alone for the norms and embeddings): torch's
        # clip_grad_norm_ stacks their norms, which DTensor refuses across meshes.
        if gradient_clip_val and gradient_clip_algorithm != "value" and self.device_mesh["tensor_parallel"].size() > 1:
            from lmledger.ledger.sharding.tp import clip_grad_norm_

            clip_grad_norm_(list(self.parameters()), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class FeedForward(nn.Module):
    """Lightning's TP tutorial's model: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FeedForwardTP(pl.LightningModule):
    """The tutorial's LightningModule: configure_model parallelises the feed-forward over the TP mesh."""

    def __init__(self, dim: int = 32, hidden_dim: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = FeedForward(dim, hidden_dim)
        self.lr = lr

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        parallelize_module(self.model, tp_mesh, plan)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)
