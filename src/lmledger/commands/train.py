"""`lmledger fit|validate`: LightningCLI over LitLM and TokenDataModule.

Runs live under `runs/<name>/version_<n>/` (TensorBoard events, the resolved config.yaml, checkpoints/);
each new run takes the next version, so nothing from an earlier run is overwritten.
`--ckpt_path last` resumes the newest run of that name that has a last.ckpt, logging into the same version.

Every run also gets, without configuring anything: checkpoints written atomically (AtomicCheckpointIO),
a NaN/Inf guard (`--nonfinite.max_skips K`, default 0 = stop at the first non-finite step), per-batch
reseeding for exact resume (StepSeeder), and a check that a --ckpt_path is readable and fits the model
before Lightning touches it.
"""

from __future__ import annotations

import logging
import re
import secrets
import warnings
from pathlib import Path

import torch
from jsonargparse import ArgumentError
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lmledger.callbacks import LedgerSettings, ledger_callbacks
from lmledger.callbacks.nonfinite import NonFiniteGuard
from lmledger.callbacks.progress import plain_progress_if_not_a_terminal
from lmledger.checkpointing import (
    AtomicCheckpointIO,
    StepSeeder,
    check_checkpoint_fits,
    make_last_checkpoint_atomic,
    open_checkpoint,
)
from lmledger.data import TokenDataModule
from lmledger.errors import ConfigError, UserError
from lmledger.lit import LitLM
from lmledger.precision import check_trainer_config, trainer_precision_kwargs

SUBCOMMANDS = ("fit", "validate")
# --ckpt_path values Lightning resolves itself rather than reading as a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


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


def _check_accelerator(accelerator) -> None:
    """Lightning says "No supported gpu backend found!" (with a traceback) when asked for a missing GPU."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if accelerator == "gpu" and MPSAccelerator.is_available():
        return
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    raise UserError(
        f"--trainer.accelerator {accelerator}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
        f"{build}); use --trainer.accelerator cpu"
    )


class LedgerCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The vocabulary comes from the data's meta.json; the window length from the model config.
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.config.context_length", "data.context_length")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        parser.add_class_arguments(LedgerSettings, "ledger")

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads a --ckpt_path file's hyperparameters right after parsing; a missing or damaged
        # file would fail there with a traceback, so check it first.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        ckpt = config.get("ckpt_path")
        if ckpt and not str(ckpt).startswith(SPECIAL_CKPT_PATHS) and _is_local_file_protocol(ckpt):
            open_checkpoint(ckpt, mmap=True)
        # `--seed_everything true` promises a random seed, but Lightning 2.6.6's seed_everything(None) takes
        # PL_GLOBAL_SEED from the environment or else 0. Draw one here; it is saved in config.yaml like any seed.
        if config.get("seed_everything") is True:
            config.seed_everything = secrets.randbelow(2**32)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        _check_accelerator(config.trainer.get("accelerator"))
        check_trainer_config(config.trainer, fp8=config.model.get("fp8"))  # fp8/bf16 need library + hardware
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

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # Our plugins for transformer-engine (tied weights) and 16-mixed on CPU (lmledger.precision).
        config = self._get(self.config_init, "trainer", default={})
        precision = trainer_precision_kwargs(config.get("precision"), config.get("accelerator"), config.get("plugins"))
        # The ledger callbacks ride along with whatever callbacks the config lists (--ledger.enabled false: none).
        callbacks = config.get("callbacks") or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks])]
        callbacks += ledger_callbacks(self._get(self.config_init, "ledger"))
        # Last, so the line it prints carries the values the ledger callbacks logged for this step.
        callbacks += plain_progress_if_not_a_terminal(config.get("enable_progress_bar"))
        try:
            trainer = super().instantiate_trainer(**{**precision, "callbacks": callbacks, **kwargs})
        except ValueError as err:  # Lightning's checks of accelerator, strategy and devices, e.g. FSDP on CPU
            raise ConfigError(" ".join(str(err).split())) from None
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a chosen plugin stays
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        make_last_checkpoint_atomic(trainer.callbacks)
        return trainer

    def _check_checkpoint(self) -> None:
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS and _is_local_file_protocol(ckpt):
            check_checkpoint_fits(ckpt, self.model)

    def before_fit(self) -> None:
        self._check_checkpoint()

    def before_validate(self) -> None:
        self._check_checkpoint()


def _run_cli(cli_class: type[LedgerCLI], argv: list[str], run: bool) -> LedgerCLI:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropAdverts())
    # LightningCLI warns when it gets `args` while sys.argv also holds arguments, as it does when we run
    # as the console script. sys.argv must stay as it is: DDP's launcher re-runs it for ranks 1..N-1.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # Lightning 2.6.6 calls a torch.utils._pytree API that torch 2.13 deprecates; nothing for users to act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Lightning warns on every mid-epoch resume that a loader without state_dict() "can cause unreliable
    # results". TokenDataModule's resumes exactly (its sampler starts at the restored batch count; tested).
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
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
                "callbacks": [StepSeeder()],
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                },
            },
        )
    except (ArgumentError, MisconfigurationException) as err:
        # MisconfigurationException is Lightning's "bad settings" error, e.g. `--trainer.accelerator gpu`
        # on a machine without one.
        raise UserError(" ".join(line.strip() for line in str(err).strip().splitlines())) from None


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
