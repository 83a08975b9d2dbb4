"""`lmledger fit|validate`: LightningCLI over LitLM and TokenDataModule.

Runs live under `runs/<name>/version_<n>/` (TensorBoard events, the resolved config.yaml, checkpoints/);
each new run takes the next version, so nothing from an earlier run is overwritten.
`--ckpt_path last` resumes the newest run of that name that has a last.ckpt, logging into the same version.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI

from lmledger.data import TokenDataModule
from lmledger.errors import UserError
from lmledger.lit import LitLM

SUBCOMMANDS = ("fit", "validate")


class _DropAdverts(logging.Filter):
    """Lightning 2.6 prints a "💡 Tip" advertising a cloud logger on every run; it is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def find_last_checkpoint(save_dir: str, name: str) -> tuple[Path, int] | None:
    """The newest `save_dir/name/version_N/checkpoints/last.ckpt` and its N, or None."""
    found = []
    for ckpt in Path(save_dir, name).glob("version_*/checkpoints/last.ckpt"):
        match = re.fullmatch(r"version_(\d+)", ckpt.parent.parent.name)
        if match:
            found.append((int(match.group(1)), ckpt))
    if not found:
        return None
    version, ckpt = max(found)
    return ckpt, version


class LedgerCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The vocabulary comes from the data's meta.json; the window length from the model config.
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.config.context_length", "data.context_length")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        logger = config.trainer.logger
        init = logger.init_args if logger is not None and hasattr(logger, "init_args") else None
        if init is None or "save_dir" not in init:
            return  # not our TensorBoard layout; let Lightning resolve "last" itself
        found = find_last_checkpoint(init.save_dir, init.name)
        if found is None:
            raise UserError(
                f"--ckpt_path last: no {init.save_dir}/{init.name}/version_*/checkpoints/last.ckpt to resume; "
                "start a fresh run without --ckpt_path"
            )
        ckpt, version = found
        config.ckpt_path = str(ckpt)
        init.version = version
        # The resumed run writes its config beside the first one rather than over it.
        self.save_config_kwargs.setdefault("config_filename", "config-resumed.yaml")
        self.save_config_kwargs.setdefault("overwrite", True)

    def before_validate(self) -> None:
        ckpt = self.config_init["validate"].get("ckpt_path")
        if ckpt and ckpt not in ("last", "best") and not Path(ckpt).is_file():
            raise UserError(f"checkpoint {ckpt} does not exist; pass a .ckpt file written by `lmledger fit`")


def _run_cli(cli_class: type[LedgerCLI], argv: list[str], run: bool) -> LedgerCLI:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropAdverts())
    # LightningCLI warns when it gets `args` while sys.argv also holds arguments (it does when we
    # run as the console script); argv is what we parse, so hide the duplicate from it.
    saved_argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return cli_class(
            LitLM,
            TokenDataModule,
            args=argv,
            run=run,
            subclass_mode_model=False,
            subclass_mode_data=False,
            save_config_kwargs={"overwrite": False},
            parser_kwargs={"exit_on_error": False},
            trainer_defaults={
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                }
            },
        )
    except ArgumentError as err:
        raise UserError(" ".join(line.strip() for line in str(err).strip().splitlines())) from None
    finally:
        sys.argv = saved_argv


class _ParseOnlyCLI(LedgerCLI):
    """Parses a fit config and stops: builds no model, data or trainer."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def parse_fit_config(argv: list[str]):
    """The parsed (not instantiated) config of `lmledger fit ARGV`, as a jsonargparse Namespace."""
    return _run_cli(_ParseOnlyCLI, argv, run=False).config


def main(argv: list[str]) -> int:
    subcommand = argv[0] if argv else None
    if subcommand not in SUBCOMMANDS:
        raise UserError(f"unknown subcommand {subcommand!r}; choose from {', '.join(SUBCOMMANDS)}")
    _run_cli(LedgerCLI, argv, run=True)
    return 0
