"""`--trainer.strategy fsdp2`: FSDP2 over every rank, by name.

Lightning's ModelParallelStrategy defaults to data parallel = nodes, tensor parallel = devices per
node. So on one node its "auto" is all tensor parallel. FSDP2Strategy fixes tensor parallel at 1.
Every rank shards the model, as `lmledger account --trainer.strategy fsdp2` predicts.

Importing this module registers "fsdp2" in Lightning's StrategyRegistry, as Lightning's own strategies
register on import. So `Trainer(strategy="fsdp2")` works in Python too: `import lmledger` arranges this
import for whenever Lightning's strategies load (lmledger/__init__.py), and lmledger.callbacks imports it.
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

__all__ = ["FSDP2", "FSDP2Strategy", "register"]

FSDP2 = "fsdp2"


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy with tensor parallel 1 and every rank data-parallel."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == 1:
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def register() -> None:
    """Add "fsdp2" to Lightning's strategy registry, once."""
    if FSDP2 not in StrategyRegistry:
        StrategyRegistry.register(FSDP2, FSDP2Strategy, description="FSDP2 (fully_shard) over every rank")


register()
