"""`--trainer.strategy fsdp2`: FSDP2 over every rank, by name.

Lightning's ModelParallelStrategy defaults to data parallel = nodes, tensor parallel = devices per
node. So on one node its "auto" is all tensor parallel. FSDP2Strategy sets tensor parallel to 1 unless
told otherwise (tensor_parallel_size), and the rest data-parallel. Every rank shards the model, as
`lmledger account --trainer.strategy fsdp2` predicts.

Importing this module registers "fsdp2" in Lightning's StrategyRegistry, as Lightning's own strategies
register on import. So `Trainer(strategy="fsdp2")` works in Python too: `import lmledger` arranges this
import for whenever Lightning's strategies load (lmledger/__init__.py), and lmledger.callbacks imports it.
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

__all__ = ["FSDP2", "FSDP2Strategy", "register"]

FSDP2 = "fsdp2"


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy with tensor parallel 1 (by default) and every other rank data-parallel.

    With tensor_parallel_size T > 1 (`--trainer.strategy lmledger.strategies.FSDP2Strategy
    --trainer.strategy.tensor_parallel_size T`), data parallel is auto: the world size over T. The module's
    configure_model applies its TP plan over the mesh's "tensor_parallel" dimension, then FSDP2 over
    "data_parallel" (LitLM has one: ledger.sharding.tp.toy_tp_plan).
    """

    def __init__(self, data_parallel_size="auto", tensor_parallel_size: int = 1, **kwargs) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        # Lazily: this module loads in an import hook.
        from lmledger.modelparallel_checkpoints import make_sharded_checkpoints_safe

        make_sharded_checkpoints_safe(self)  # atomic sharded saves, weights-only loads, in Python's Trainer too

    def setup_environment(self) -> None:
        tensor = self._tensor_parallel_size
        if self._data_parallel_size == "auto" and isinstance(tensor, int) and tensor >= 1:
            self._data_parallel_size = self.num_nodes * self.num_processes // tensor
        if self._launcher is None:
            # A rank Lightning's launcher started (or torchrun, SLURM) runs no launcher of its own, and Lightning 2.6's
            # ModelParallelStrategy then leaves it at every core's threads, where DDP gives each rank cores / ranks:
            # on 2 cores, rank 1's two threads took rank 0's core and a TP 2 step ran 1.5x slower (canary in
            # tests/test_canaries.py). Set them as Lightning's launcher does for rank 0 (not over OMP_NUM_THREADS).
            from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

            _set_num_threads_if_needed(num_processes=self.num_processes)
        super().setup_environment()


def register() -> None:
    """Add "fsdp2" to Lightning's strategy registry, once."""
    if FSDP2 not in StrategyRegistry:
        StrategyRegistry.register(FSDP2, FSDP2Strategy, description="FSDP2 (fully_shard) over every rank")


register()
