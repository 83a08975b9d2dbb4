"""lmledger: train a toy LM and keep a ledger of every byte and FLOP it spends."""

__version__ = "0.1.0"
