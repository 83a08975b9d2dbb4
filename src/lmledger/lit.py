"""The LightningModule around the toy LM.

It holds the optimizer groups and LR schedule. It takes the step's one gradient norm, and clips by
it. It logs loss and perplexity.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torchmetrics.aggregation import MeanMetric

from lmledger.errors import ConfigError
from lmledger.ledger.sharding.tp import by_mesh, norm_collectives, norm_over_meshes
from lmledger.lightning_private import should_update_logs
from lmledger.model import ModelConfig, ToyLM
from lmledger.precision import apply_fp8

__all__ = ["LitLM", "check_hyperparameters", "total_norm", "warmup_cosine"]


def total_norm(grads: list[torch.Tensor], device: torch.device, shard_group=None) -> torch.Tensor:
    """The 2-norm of `grads` taken together.

    `shard_group` is a process group whose ranks each hold a shard of the gradients. With it, this is
    the norm of all the shards together. That is a collective. Every rank of the group must call it,
    even one that holds no gradients.
    """
    if shard_group is None:
        return torch.nn.utils.get_total_norm(grads)
    local = torch.nn.utils.get_total_norm(grads).to(device) if grads else torch.zeros((), device=device)
    squared = local.float().square()
    torch.distributed.all_reduce(squared, group=shard_group)
    return squared.sqrt()


def _set_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Switch a torch AdamW/SGD between its fused and foreach kernels, state included.

    Fused kernels keep Adam's step counts on the parameter's device. The others keep them on the CPU,
    as load_state_dict places them.
    """
    for group in optimizer.param_groups:
        group["fused"] = fused
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(p.device if fused else "cpu", torch.float32)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up from ~0 to 1, then cosine decay to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_hyperparameters(lr: float, min_lr_ratio: float, warmup_steps: int, weight_decay: float, betas, **_) -> None:
    """ConfigError naming the first LitLM setting that would train wrongly.

    A negative or NaN lr steps uphill or poisons every weight. A min_lr_ratio > 1 makes the "decay"
    climb. Betas outside [0, 1) diverge. It has no defaults of its own: it checks the values LitLM was
    given. LitLM.__init__ holds the defaults.
    """
    if not (_real(lr) and lr > 0):
        raise ConfigError(f"model.lr must be a finite number > 0, got {lr}")
    if not (_real(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise ConfigError(f"model.min_lr_ratio must be between 0 and 1 (the final LR over lr), got {min_lr_ratio}")
    if not (isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0):
        raise ConfigError(f"model.warmup_steps must be an integer >= 0, got {warmup_steps}")
    if not (_real(weight_decay) and weight_decay >= 0):
        raise ConfigError(f"model.weight_decay must be a finite number >= 0, got {weight_decay}")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"model.betas must be two numbers in [0, 1), got {betas}")


# A named instance rather than a call in the signature (ruff B008). It must stay a ModelConfig:
# LightningCLI turns its fields into --model.config.*. (An Optional ... = None default leaves no such
# keys to link.)
_DEFAULT_MODEL_CONFIG = ModelConfig()


class LitLM(L.LightningModule):
    """Trains `ToyLM` on (x, y) batches of token ids.

    Args:
        config: the model's architecture. The CLI links vocab_size from the data's meta.json.
        optimizer: "adamw" (decoupled weight decay on matmul weights only) or "sgd" (momentum 0.9).
        lr: peak learning rate, reached after warmup_steps, then cosine to lr * min_lr_ratio.
        compile: run the training/validation steps through torch.compile. True compiles the whole
            model: fastest steps, longest compile (the graph unrolls every block). "blocks" compiles
            each transformer block in place. That is one graph, compiled once and reused by every
            block, so compile time does not grow with depth. The embedding, head and loss stay eager.
            Either way the FLOP counter measures an eager copy. Checkpoints keep the eager module's keys.
        fp8: "torchao" swaps the eligible linears for torchao Float8Linear (lmledger.precision), before
            compile. Use it with trainer precision bf16-mixed or bf16-true. None = no fp8 here.
            (Transformer Engine fp8 is the trainer precision "transformer-engine".)
        sequence_parallel: under tensor parallelism (ModelParallelStrategy's tensor_parallel_size > 1),
            also split the norms and the residual stream along the sequence (ledger.sharding.tp.toy_tp_plan).
    """

    def __init__(
        self,
        config: ModelConfig = _DEFAULT_MODEL_CONFIG,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 50,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        compile: bool | Literal["blocks"] = False,
        fp8: Literal["torchao"] | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        check_hyperparameters(lr, min_lr_ratio, warmup_steps, weight_decay, betas)
        self.save_hyperparameters()
        self.config = config
        self.model = apply_fp8(ToyLM(config), fp8)
        # Token-weighted mean over validation batches. A NaN batch makes it NaN. "warn" would drop it;
        # "disable" drops the weights (canary test_mean_metric_without_nan_check_drops_the_weights).
        self.val_loss = MeanMetric(nan_strategy=float("nan"))
        # In __dict__, not a submodule: state_dict keys are `self.model`'s with or without compile.
        self.__dict__["_forward"] = torch.compile(self.model) if compile is True else self.model
        if compile == "blocks":
            for block in self.model.blocks:
                block.compile()  # in place: the block's __call__ runs the compiled graph; its keys stay
        self._grad_norm: torch.Tensor | None = None
        self._lr = torch.zeros((), dtype=torch.float32)
        self._last_loss = torch.full((), math.nan)  # the latest micro-batch's loss, for the progress bar

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward(idx, targets)

    def configure_model(self) -> None:
        """FSDP2 (and TP) under Lightning's ModelParallelStrategy; nothing under any other strategy.

        With the mesh's tensor_parallel size > 1 it first applies the toy LM's TP plan over that
        dimension (ledger.sharding.tp.toy_tp_plan: colwise q/k/v and SwiGLU's w1/w3, rowwise out and w2). Then it
        fully_shards each transformer block, then the toy LM (ledger.sharding.sharded.shard_blocks), over the
        mesh's data-parallel ranks.
        """
        from torch.distributed.fsdp import FSDPModule

        strategy = self._trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, L.pytorch.strategies.ModelParallelStrategy) or isinstance(self.model, FSDPModule):
            return  # not FSDP2, or sharded already (a second fit on the same module)
        from lmledger.ledger.sharding.sharded import FSDPSettings, shard_blocks

        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            if self.hparams.fp8 or self.hparams.compile:
                what = "fp8" if self.hparams.fp8 else "compile"
                raise ConfigError(f"LitLM's tensor-parallel plan is not run with model.{what}: set it off")
            from lmledger.ledger.sharding.tp import toy_tp_plan

            toy_tp_plan(self.model, mesh["tensor_parallel"], self.hparams.sequence_parallel)
        shard_blocks(self, mesh["data_parallel"], FSDPSettings())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self(x, y)
        self._last_loss = loss.detach()
        # Only where Lightning writes train metrics (every log_every_n_steps). Each self.log costs ~0.5 ms
        # in Lightning's result collection. The values of the other steps are never written.
        if self._writes_train_metrics():
            self.log("train/loss", loss)
            # A device tensor filled in place: a Python float would cost a blocking host-to-device copy.
            if self._lr.device != loss.device:
                self._lr = torch.zeros((), dtype=torch.float32, device=loss.device)
            self.log("train/lr", self._lr.fill_(self.lr_schedulers().get_last_lr()[0]))
        return loss

    def _writes_train_metrics(self) -> bool:
        """Whether Lightning writes this step's train metrics. A module without a trainer logs nothing anyway."""
        return self._trainer is None or should_update_logs(self._trainer)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._grad_norm = None  # a new step: gradient_norm() measures afresh, even after a step without backward

    def on_after_backward(self) -> None:
        self._grad_norm = None  # the gradients changed: gradient_norm() measures them afresh

    def gradient_norm(self) -> torch.Tensor | None:
        """The 2-norm of all gradients; None when there are none.

        It is measured once per step, shared by the train/grad_norm log, NonFiniteGuard and clipping.
        Under FSDP each rank holds a shard of the gradients. So the squared shard norms are summed over
        the shard group. Under FSDP2 that is the DTensor grads' mesh.
        """
        if self._grad_norm is None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            shard_group = self._gradient_shard_group()
            if not grads and shard_group is None:
                return None
            meshes = {id(g.device_mesh): g.device_mesh for g in grads if hasattr(g, "device_mesh")}
            if shard_group is None and len(meshes) > 1:  # TP: 2-D (dp x tp) grads beside dp-only ones
                self._grad_norm = norm_over_meshes(grads)
                return self._grad_norm
            norm = total_norm(grads, self.device, shard_group)
            # FSDP2's DTensor grads give a DTensor of partial norms. full_tensor() reduces it over the mesh.
            self._grad_norm = norm.full_tensor() if callable(getattr(norm, "full_tensor", None)) else norm
        return self._grad_norm

    def collectives_per_step(self, trainer) -> int:
        """The all-reduces gradient_norm runs each optimizer step (on_before_optimizer_step asks for it every step):
        one over the shard group under FSDP; under FSDP2 and TP, one per mesh dimension of more than one rank that its
        DTensor gradients are sharded over (full_tensor of a partial norm: tp.norm_collectives); none where every rank
        holds all the gradients. The step-time prediction prices them (callbacks.steptime.fit_ops)."""
        if trainer.world_size <= 1:
            return 0
        return 1 if self._gradient_shard_group() is not None else norm_collectives(list(self.parameters()))

    def _gradient_shard_group(self):
        """The process group whose ranks each hold a shard of the gradients; None if every rank holds all."""
        strategy = self.trainer.strategy
        if not isinstance(strategy, FSDPStrategy) or getattr(strategy.sharding_strategy, "name", "") == "NO_SHARD":
            return None
        # The root FSDP module's group: the ranks the shards span. Under hybrid sharding that is one
        # node's, as the shards repeat on every node. Summing over the world would count each shard once
        # per node.
        return self.trainer.model.process_group

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Grads are unscaled here (16-mixed) and not yet clipped. This is the norm clipping acts on.
        norm = self.gradient_norm()
        if self._writes_train_metrics():
            self.log("train/grad_norm", float("nan") if norm is None else norm)
        # The bar's loss, copied to the host only at logging steps. Lightning reads every prog_bar value
        # back after every batch. A device tensor there would cost a host sync per step.
        trainer = self.trainer
        if trainer.progress_bar_callback is not None and should_update_logs(trainer):
            self.log("loss", self._last_loss.float().cpu(), prog_bar=True, logger=False, batch_size=1)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        if not gradient_clip_val or gradient_clip_algorithm == "value":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # Clip by the norm measured this step. Lightning's clipping measures again, and refuses FSDP
        # (canary test_lightning_fsdp_refuses_clipping_by_norm).
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = self.gradient_norm()
        if params and norm is not None:
            # torch's foreach multiply takes DTensors of one mesh: under TP, clip each mesh's grads apart.
            for group in by_mesh(params).values():
                torch.nn.utils.clip_grads_with_norm_(group, gradient_clip_val, norm)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(self(x, y), weight=y.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # Already reduced over ranks. sync_dist only silences Lightning's DDP warning.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def _fused_optimizer(self) -> bool:
        # The live plugin decides: a DeepSpeed or custom plugin may differ from its name. For Lightning's
        # own plugins this is ledger.precision_table' Row.fused_optimizer (tests/ledger/test_precision_table.py).
        return getattr(self.trainer.precision_plugin, "scaler", None) is None

    def on_train_start(self) -> None:
        # A restored optimizer takes `fused` from the checkpoint (saved under fp16, say). Set this run's
        # choice once every strategy has restored its state. (FSDP restores after the module's hooks.)
        fused = self._fused_optimizer()
        for optimizer in self.trainer.optimizers:
            if isinstance(optimizer, (torch.optim.AdamW, torch.optim.SGD)):
                _set_fused(optimizer, fused)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Decay only matmul weights: 2-D and not an embedding table (tokens, learned positions). Norms' gains,
        # biases and embeddings don't.
        tables = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
        decay = [p for p in params if p.ndim >= 2 and id(p) not in tables]
        no_decay = [p for p in params if not (p.ndim >= 2 and id(p) not in tables)]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # Fused kernels: one launch for all parameters. AdamW is 3-9x faster than foreach on 2 CPU cores
        # (benchmarks/optimizer_step.py). NonFiniteGuard's `found_inf` skips the step on the device. Not
        # under fp16's GradScaler, which would leave the gradients scaled for logging and clipping.
        fused = self._fused_optimizer()
        if self.hparams.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas, fused=fused)
        else:
            optimizer = torch.optim.SGD(groups, lr=self.hparams.lr, momentum=0.9, fused=fused)
        # The run's length is asked for only past warm-up, after a resume's restore. Asked here,
        # estimated_stepping_batches would build the train iterator early. A resumed run would restart
        # its data.
        trainer, warmup, min_ratio = self.trainer, self.hparams.warmup_steps, self.hparams.min_lr_ratio

        @functools.cache
        def total_steps() -> int:
            return trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches

        def multiplier(step: int) -> float:
            return warmup_cosine(step, warmup, total_steps() if step > warmup else warmup + 1, min_ratio)

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
