"""lmledger: train language models with PyTorch Lightning, and keep a ledger of their cost.

Every byte, FLOP and second is predicted, then measured beside it.

    import lmledger
    trainer = lightning.Trainer(callbacks=[lmledger.Ledger()])

`Ledger` and `callbacks` are imported on first use. `import lmledger` alone loads neither torch nor
Lightning. So the commands that need neither (`lmledger plan`, `lmledger gpus`) start fast.

After `import lmledger`, `Trainer(strategy="fsdp2")` names lmledger.strategies.FSDP2Strategy: it is
registered with Lightning's StrategyRegistry now if Lightning's strategies are loaded, else the moment
they load (a one-shot import hook; Lightning reads no entry points for strategies).
"""

import sys
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmledger")  # pyproject.toml holds the one version
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Ledger", "__version__", "callbacks"]

_STRATEGIES = "lightning.pytorch.strategies"


class _RegisterFSDP2AfterLightning:
    """A meta path finder that, once Lightning's strategies module has run, imports lmledger.strategies
    (which registers "fsdp2"), then leaves sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name != _STRATEGIES:
            return None
        sys.meta_path.remove(self)  # one shot; and the lookup below must not find this finder again
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister:
    """The loader of Lightning's strategies module, followed by lmledger.strategies' registration."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import_module("lmledger.strategies")

    def __getattr__(self, name: str):  # get_resource_reader, get_filename, ...: the real loader's
        return getattr(self.loader, name)


if _STRATEGIES in sys.modules:
    import_module("lmledger.strategies")
elif not any(isinstance(f, _RegisterFSDP2AfterLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterFSDP2AfterLightning())


def __getattr__(name: str):
    if name == "Ledger":
        return import_module("lmledger.callbacks").Ledger
    if name in ("callbacks", "ledger", "commands", "sweep"):
        return import_module(f"lmledger.{name}")
    raise AttributeError(f"module 'lmledger' has no attribute {name!r}")
