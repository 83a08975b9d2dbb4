"""`lmledger fit|validate`: LightningCLI over LitLM and TokenDataModule.

Runs live under `runs/<name>/version_<n>/` (TensorBoard events, the resolved config.yaml, checkpoints/);
each new run takes the next version, so nothing from an earlier run is overwritten.
`--ckpt_path last` resumes the newest run of that name that has a last.ckpt, logging into the same version.

`validate` needs --ckpt_path (a file or `last`) and writes nothing: no config, and no run directory unless the
command line names one to log in (`--trainer.logger.init_args.save_dir DIR`, as `lmledger sweep` does).

Every run also gets, without configuring anything: checkpoints written atomically (AtomicCheckpointIO),
a NaN/Inf guard (`--nonfinite.max_skips K`, default 0 = stop at the first non-finite step), per-batch
reseeding for exact resume (StepSeeder), a save-and-stop on SIGTERM (PreemptionCheckpoint, exit 143),
and checks that a --ckpt_path is readable, fits the model, was trained with the same settings and data,
and has steps left to train, before Lightning touches it. docs/reliability.md lists every case.
"""

from __future__ import annotations

import logging
import math
import secrets
import sys
import warnings
from pathlib import Path

import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lmledger.callbacks import LedgerSettings, ledger_callbacks
from lmledger.callbacks.nonfinite import NonFiniteGuard
from lmledger.callbacks.progress import plain_progress_if_not_a_terminal
from lmledger.checkpointing import (
    AtomicCheckpointIO,
    PreemptionCheckpoint,
    StepSeeder,
    check_checkpoint_fits,
    claim_version_dir,
    make_last_checkpoint_atomic,
    newest_checkpoint,
    open_checkpoint,
    versions,
)
from lmledger.data import TokenDataModule, load_meta
from lmledger.errors import ConfigError, UserError
from lmledger.lit import LitLM, check_hyperparameters
from lmledger.precision import check_trainer_config, trainer_precision_kwargs

SUBCOMMANDS = ("fit", "validate")
# --ckpt_path values Lightning resolves itself rather than reading as a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


class _DropAdverts(logging.Filter):
    """Lightning 2.6 prints a "💡 Tip" advertising a cloud logger on every run; it is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


class NothingToResume(Exception):
    """--ckpt_path names a run that already trained every step asked for: say so and exit 0, writing nothing."""


# Model settings that may differ on resume: they change how the same function is computed, not which.
RESUME_MAY_CHANGE = ("compile", "config.activation_checkpointing", "config.vocab_size")


def find_last_checkpoint(save_dir: str, name: str) -> tuple[Path, int] | None:
    """The newest checkpoint (newest_checkpoint) of the newest `save_dir/name/version_N` that has one, and N."""
    root = Path(save_dir, name)
    for version in sorted(versions(root), reverse=True):
        ckpt = newest_checkpoint(root / f"version_{version}" / "checkpoints")
        if ckpt is not None:
            return ckpt, version
    return None


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, (list, tuple)):
        value = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return {prefix[:-1]: value}


def hyperparameter_differences(saved: dict, current) -> list[str]:
    """'model.KEY: A in the checkpoint, B now' for each model setting that differs (RESUME_MAY_CHANGE aside).
    Only settings both sides know are compared: a checkpoint from before a setting existed ran its default."""
    theirs, ours = _flatten({k: v for k, v in saved.items() if not k.startswith("_")}), _flatten(current)
    differences = []
    for key in sorted(set(theirs) & set(ours)):
        if key in RESUME_MAY_CHANGE or key.startswith("_"):
            continue
        then, now = theirs[key], ours[key]
        if then != now:
            differences.append(f"model.{key}: {_show(then)} in the checkpoint, {_show(now)} now")
    return differences


def _show(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _checked_hyperparameters(checkpoint: dict, path) -> dict:
    """The checkpoint's model hyperparameters, refused in one line naming the checkpoint when they are not
    a mapping or hold a value LitLM would refuse (LightningCLI merges them into the config, where the
    error would otherwise blame the command line)."""
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(hparams, dict):
        raise UserError(
            f"checkpoint {path} stores its hyperparameters as a {type(hparams).__name__}, not a mapping of names "
            "to values: it was not written by `lmledger fit`; pass a checkpoint of this kit"
        )
    if "_class_path" not in hparams:  # our LitLM's; another class checks its own
        try:
            check_hyperparameters(**{k: v for k, v in hparams.items() if not k.startswith("_")})
        except (ConfigError, TypeError) as err:
            raise UserError(
                f"checkpoint {path} holds a bad hyperparameter ({err}); it was edited or written by other code: "
                "pass another checkpoint"
            ) from None
    return hparams


def _check_config_files(args) -> None:
    """Sections of a --config file that are not mappings: jsonargparse 4 resets `data: [1, 2]` to the class
    defaults without a word, and `model: {config: 5}` ends in a message about a missing context_length."""
    args = list(args or [])
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    files += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    for name in files:
        path = Path(name)
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # jsonargparse reports an unreadable config in its own words
        if not isinstance(doc, dict):
            continue
        sections = [(key, doc.get(key)) for key in ("model", "data", "trainer")]
        if isinstance(doc.get("model"), dict):
            sections.append(("model.config", doc["model"].get("config")))
        for key, value in sections:
            if value is not None and not isinstance(value, dict):
                raise UserError(
                    f"config {name}: `{key}` must be a mapping of settings (`{key.split('.')[-1]}:` followed by "
                    f"indented `name: value` lines), got {type(value).__name__} {value!r}"
                )


def _check_trainer_values(trainer) -> None:
    """Values Lightning 2.6.6 accepts and then misuses: negative clipping ascends the gradient, zero
    accumulation trains nothing and exits 0, negative devices end in a traceback."""
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise ConfigError(f"--trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ConfigError(f"--trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate}")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < -1:
        raise ConfigError(
            f"--trainer.devices must be a count >= 1, a list of device indices, -1 (all) or auto, got {devices}"
        )


def _ckpt_path_form(ckpt: str, subcommand: str, default_root_dir) -> None:
    """--ckpt_path values we refuse before anything is built: remote URLs, and Lightning's names that
    need state this process does not have ("best": a fit earlier in the same process; "registry": a
    model registry; "hpc": Lightning's SLURM requeue checkpoint, hpc_ckpt_N.ckpt, when there is none)."""
    if not _is_local_file_protocol(ckpt):
        raise UserError(
            f"--ckpt_path {ckpt}: remote checkpoints are not supported here; copy it to a local file and pass that"
        )
    if ckpt == "hpc" and any(Path(default_root_dir or ".").glob("hpc_ckpt_*.ckpt")):
        return
    if ckpt in ("best", "hpc", "registry"):
        raise UserError(
            f"--ckpt_path {ckpt}: there is no {ckpt!r} checkpoint to resolve in a fresh `lmledger {subcommand}`; "
            "pass `last` or a checkpoint file (runs/NAME/version_N/checkpoints/*.ckpt)"
        )


def _run_dir_of(config) -> tuple[Path, object] | None:
    """(save_dir/name, the logger's init_args) for our TensorBoard/CSV layout; None for another logger."""
    logger = config.trainer.get("logger")
    init = logger.init_args if logger is not None and hasattr(logger, "init_args") else None
    if init is None or "save_dir" not in init:
        return None
    return Path(init.save_dir, init.get("name") or "lightning_logs"), init


def _resolve_last(config, subcommand: str) -> tuple[Path, int] | None:
    """--ckpt_path last: the newest checkpoint of the newest version of this run (None: not our layout)."""
    found = _run_dir_of(config)
    if found is None:
        return None
    root, init = found
    last = find_last_checkpoint(init.save_dir, init.get("name") or "lightning_logs")
    if last is None:
        raise UserError(
            f"--ckpt_path last: no {root}/version_*/checkpoints/last.ckpt to resume; "
            + ("start a fresh run without --ckpt_path" if subcommand == "fit" else "train one with `lmledger fit`")
        )
    return last


def _free_name(directory: Path, stem: str) -> str:
    """stem.yaml, else stem-2.yaml, stem-3.yaml, ...: the first that does not exist in `directory`."""
    n = 1
    while (directory / (name := f"{stem}.yaml" if n == 1 else f"{stem}-{n}.yaml")).exists():
        n += 1
    return name


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

        parser.add_argument(
            "--allow_other_data",
            type=bool,
            default=False,
            help="Resume a checkpoint onto data whose sha256 differs from the data it was trained on.",
        )

    def parse_arguments(self, parser, args) -> None:
        self._argv = [str(a) for a in args or []]
        _check_config_files(args)
        super().parse_arguments(parser, args)
        # LightningCLI reads a --ckpt_path file's hyperparameters right after parsing; a missing or damaged
        # file would fail there with a traceback, so check it first.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        ckpt = config.get("ckpt_path")
        if subcommand == "validate" and not ckpt:
            raise UserError(
                "validate needs --ckpt_path (a checkpoint file, or `last` for the newest of this run's name); "
                "without one it would evaluate untrained weights"
            )
        if ckpt:
            _ckpt_path_form(str(ckpt), subcommand, config.trainer.get("default_root_dir"))
        if ckpt == "last" and subcommand == "validate":
            # Resolved here so that LightningCLI builds the model from the checkpoint's hyperparameters.
            found = _resolve_last(config, subcommand)
            if found is not None:
                config.ckpt_path = ckpt = str(found[0])
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS:
            _checked_hyperparameters(open_checkpoint(ckpt, mmap=True), ckpt)
        # `--seed_everything true` promises a random seed, but Lightning 2.6.6's seed_everything(None) takes
        # PL_GLOBAL_SEED from the environment or else 0. Draw one here; it is saved in config.yaml like any seed.
        if config.get("seed_everything") is True:
            config.seed_everything = secrets.randbelow(2**32)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI merges a checkpoint file's hyperparameters into the config; a value that does not
        # parse would be reported as if the command line held it.
        try:
            super()._parse_ckpt_path()
        except ArgumentError as err:
            ckpt = self.config[self.config.subcommand].get("ckpt_path")
            reason = " ".join(line.strip() for line in str(err).strip().splitlines())
            raise UserError(
                f"checkpoint {ckpt} holds hyperparameters this model does not accept ({reason}); "
                "pass another checkpoint"
            ) from None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        _check_accelerator(config.trainer.get("accelerator"))
        check_trainer_config(config.trainer, fp8=config.model.get("fp8"))  # fp8/bf16 need library + hardware
        _check_trainer_values(config.trainer)
        self._resume = None
        if self.subcommand == "validate":
            # Evaluating writes no config and, unless the command line names a directory to log in (as
            # `lmledger sweep` does for each point), no run directory: the metrics are printed. (A logger
            # name alone only says which run `--ckpt_path last` means.)
            self.save_config_callback = None
            if not any(arg.startswith("--trainer.logger.init_args.save_dir") for arg in self._argv):
                config.trainer.logger = False
            return
        ckpt = config.get("ckpt_path")
        if not ckpt:
            return
        run_dir = None
        if ckpt == "last":
            found = _resolve_last(config, self.subcommand)
            if found is None:
                return  # not our TensorBoard layout; let Lightning resolve "last" itself
            path, version = found
            run_dir = path.parent.parent
            checkpoint = open_checkpoint(path, mmap=True)
            hparams = _checked_hyperparameters(checkpoint, path)
            differences = hyperparameter_differences(hparams, config.model)
            if differences:
                raise UserError(
                    f"checkpoint {path} was trained with other settings ({'; '.join(differences)}); resume with "
                    f"the run's own (its {run_dir / 'config.yaml'}), or start a fresh run without --ckpt_path"
                )
        else:
            path, version = Path(ckpt), None
            checkpoint = open_checkpoint(path, mmap=True)
        step = int(checkpoint.get("global_step", 0))
        self._check_not_finished(config.trainer, checkpoint, run_dir or path, step)
        self._check_same_data(config, checkpoint, path)
        config.ckpt_path = str(path)
        if version is not None:
            # Log into the run's own version; its config is saved beside the first one, never over it.
            _run_dir_of(config)[1].version = version
            self.save_config_kwargs["config_filename"] = _free_name(run_dir, "config-resumed")
            self._resume = f"resuming {run_dir} at step {step} from {path.name}"
        else:
            self._resume = f"resuming from {path} at step {step}, in a new run directory"

    @staticmethod
    def _check_not_finished(trainer, checkpoint: dict, run: Path, step: int) -> None:
        max_steps = trainer.get("max_steps")
        max_epochs = trainer.get("max_epochs")
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        epochs_done = fit_loop.get("epoch_progress", {}).get("current", {}).get("completed", 0)
        if fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
            epochs_done += 1  # saved at the epoch's last batch: Lightning counts that epoch done on restore
        if max_steps is not None and max_steps > 0:
            if step >= max_steps:
                raise NothingToResume(
                    f"{run} finished at step {step}; nothing to resume (a larger --trainer.max_steps trains further)"
                )
            if max_epochs is not None and 0 <= max_epochs <= epochs_done:
                # The data module sizes one epoch to max_steps, so a run extended past its old max_steps would
                # stop at once on its completed epoch; the epoch count does not bound such a run.
                trainer.max_epochs = epochs_done + 1
        elif max_epochs is not None and 0 <= max_epochs <= epochs_done:
            raise NothingToResume(
                f"{run} finished at step {step} ({epochs_done} epochs); nothing to resume "
                "(a larger --trainer.max_epochs trains further)"
            )

    @staticmethod
    def _check_same_data(config, checkpoint: dict, path: Path) -> None:
        trained_on = (checkpoint.get(TokenDataModule.__qualname__) or {}).get("sha256")
        if not trained_on or config.get("allow_other_data"):
            return
        try:
            now = load_meta(config.data.path).get("sha256")
        except UserError:
            return  # the data module reports a bad directory in its own words
        if now and now != trained_on:
            changed = ", ".join(sorted(k for k in set(now) | set(trained_on) if now.get(k) != trained_on.get(k)))
            raise UserError(
                f"checkpoint {path} was trained on other data than {config.data.path} holds now ({changed} differ "
                "by sha256); resume onto the same data, or pass --allow_other_data true to continue on this data"
            )

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
        if self.subcommand == "fit":
            trainer.callbacks.append(PreemptionCheckpoint())
        else:  # validate saves nothing; a ModelCheckpoint there only warns that its directory differs
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        return trainer

    def _check_checkpoint(self) -> None:
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS and _is_local_file_protocol(ckpt):
            check_checkpoint_fits(ckpt, self.model)

    def _claim_run_dir(self) -> None:
        # The run directory is claimed now, after every check, so a refused run leaves none behind. Rank 0
        # only: DDP's launcher re-runs the CLI for the other ranks, which log nothing.
        if rank_zero_only.rank != 0:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, (TensorBoardLogger, CSVLogger)) and logger._version is None:
                logger._version = claim_version_dir(logger.root_dir)

    def before_fit(self) -> None:
        self._check_checkpoint()
        self._claim_run_dir()
        if self._resume and rank_zero_only.rank == 0:
            print(f"lmledger fit: {self._resume}", flush=True)

    def before_validate(self) -> None:
        self._check_checkpoint()
        self._claim_run_dir()


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
    try:
        _run_cli(LedgerCLI, argv, run=True)
    except NothingToResume as done:
        print(f"lmledger {subcommand}: {done}")
        return 0
    except SIGTERMException as stop:  # PreemptionCheckpoint's Preempted, or Lightning's own (DDP, set-up)
        saved = getattr(stop, "checkpoint", None)
        if saved:
            print(f"lmledger {subcommand}: preempted at step {stop.step}: saved {saved}; resume with --ckpt_path last",
                  file=sys.stderr)  # fmt: skip
        elif subcommand == "fit":
            print(f"lmledger {subcommand}: preempted (SIGTERM) before a step could be saved; --ckpt_path last "
                  "resumes from the run's newest checkpoint, if it has one", file=sys.stderr)  # fmt: skip
        else:
            print(f"lmledger {subcommand}: stopped by SIGTERM", file=sys.stderr)
        return 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
    except SystemExit as exit_:
        # Lightning turns Ctrl-C into sys.exit(1) after its graceful shutdown; cli.py reports it as 130.
        if isinstance(exit_.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
    return 0
