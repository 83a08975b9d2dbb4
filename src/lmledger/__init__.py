"""lmledger: train language models with PyTorch Lightning, and keep a ledger of their cost.

Every byte, FLOP and second is predicted, then measured beside it.

    import lmledger
    trainer = lightning.Trainer(callbacks=[lmledger.Ledger()])

`Ledger` and `callbacks` are imported on first use. `import lmledger` alone loads neither torch nor
Lightning. So the commands that need neither (`lmledger plan`, `lmledger gpus`) start fast.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmledger")  # pyproject.toml holds the one version
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Ledger", "__version__", "callbacks"]


def __getattr__(name: str):
    if name == "Ledger":
        return import_module("lmledger.callbacks").Ledger
    if name in ("callbacks", "ledger", "commands", "sweep"):
        return import_module(f"lmledger.{name}")
    raise AttributeError(f"module 'lmledger' has no attribute {name!r}")
