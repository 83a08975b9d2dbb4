"""Train an example, or any LightningModule and LightningDataModule, from a config file.

    python -m examples.fit fit --config configs/examples/hf-llama.yaml [--trainer.max_steps 50 ...]

LightningCLI in subclass mode: the config names the classes (`model: {class_path: ..., init_args: ...}`),
so it trains whatever module it is given; run it from the repository root so `examples` imports.
lmledger.callbacks.Ledger is added to the trainer's callbacks unless --ledger false.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI


class ExampleCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--ledger", type=bool, default=True, help="keep the lmledger ledger during the run")

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("ledger", True):
            from lmledger.callbacks import Ledger

            kwargs["callbacks"] = [*kwargs.get("callbacks", []), Ledger()]
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None) -> None:
    ExampleCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": False},
    )


if __name__ == "__main__":
    main()
