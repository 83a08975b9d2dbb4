"""The ledger: a training step's memory, FLOPs and time, predicted and measured.

Its modules are imported by name (ledger.predict, ledger.gpus, ...); the package exports nothing.
"""

__all__: list[str] = []
