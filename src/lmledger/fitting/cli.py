"""FitCLI: LightningCLI over LitLM and TokenDataModule, or any LightningModule, with the kit's defaults.

It is what `lmledger fit|validate` runs; commands/fit.py says what the user sees. It adds the Ledger
callback, atomic checkpoints, the NaN/Inf guard and per-batch reseeding. Also the save-and-stop on
SIGTERM/SIGUSR1 and the run lock. Every check of fitting.checks and fitting.resume runs before
anything is claimed.

`parse_fit_config`, `build_model_and_data` and `first_batch` read a fit config without training. They
serve account, plan, run_config and sweeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lmledger.atomic import write_error
from lmledger.callbacks import Ledger, LedgerSettings, ledger_callbacks
from lmledger.callbacks.nonfinite import NonFiniteGuard
from lmledger.callbacks.progress import plain_progress_if_not_a_terminal
from lmledger.checkpointing import (
    AtomicCheckpointIO,
    check_checkpoint_fits,
    make_last_checkpoint_atomic,
    open_checkpoint,
)
from lmledger.data import TokenDataModule
from lmledger.errors import ConfigError, UserError
from lmledger.fitting.checks import (
    SUBCOMMANDS,
    DropAdverts,
    build_failure,
    check_accelerator,
    check_class_paths,
    check_config_files,
    check_fit_values,
    check_trains_something,
    named_classes,
    parse_error_line,
    refuse_automatic_features_by_hand,
    refuse_empty_train_loader,
    refuse_several_optimizers,
)
from lmledger.fitting.clusterenv import refuse_stray_launcher, store_of_this_attempt
from lmledger.fitting.peers import (
    PEER_TIMEOUT,
    PeerFailure,
    PeerWatch,
    close_process_group,
    end_child_ranks,
    peer_failure_line,
    set_peer_timeout,
)
from lmledger.fitting.resume import (
    SPECIAL_CKPT_PATHS,
    checked_hyperparameters,
    ckpt_path_form,
    free_name,
    merge_sharded_hyperparameters,
    name_the_default_logger,
    refuse_a_bare_run_over,
    refuse_a_run_pinned_over,
    refuse_checkpoint_code,
    resolve_last,
    resume_run,
)
from lmledger.fitting.steps import NameTheEventFile, StepChecks
from lmledger.lightning_private import cli_value, is_local_path, pin_logger_version
from lmledger.lit import LitLM
from lmledger.modelparallel_checkpoints import make_sharded_checkpoints_safe
from lmledger.precision import check_trainer_config, trainer_precision_kwargs
from lmledger.preemption import PreemptionCheckpoint, noted_stop_signals, run_key, slurm_line
from lmledger.rundir import RunClaim, claim_version_dir, release_claims, undo_uncommitted_claims
from lmledger.seeding import StepSeeder
from lmledger.strategies import register as register_strategies

__all__ = [
    "FitCLI",
    "build_model_and_data",
    "first_batch",
    "parse_fit_config",
    "run_claimed",
    "slurm_tasks_per_node",
]

register_strategies()  # --trainer.strategy fsdp2 (lmledger.strategies)


class FitCLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        argv = kwargs.get("args")  # a command line (as _run_cli passes it) names its subcommand first
        self._named = argv[0] if isinstance(argv, (list, tuple)) and argv else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Only the subcommand named: LightningCLI's parser for each of 4 costs every process (benchmarks/cli_start)."""
        every = LightningCLI.subcommands()
        return {self._named: every[self._named]} if self._named in every else every

    @property
    def any_model(self) -> bool:
        """Subclass mode: the model is any LightningModule. LitLM-specific checks and links are skipped."""
        return bool(self.subclass_mode_model)

    def add_arguments_to_parser(self, parser) -> None:
        if self.any_model:
            # The data a module trains on, unless the command line names another: lmledger's token windows.
            parser.set_defaults({"data": {"class_path": "lmledger.data.TokenDataModule"}})
        else:
            # The vocabulary comes from the data's meta.json. The window length comes from the model config.
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
        parser.add_argument(
            "--flush_denormal",
            type=bool,
            default=False,
            help="Flush subnormal floats to zero on the CPU (FTZ/DAZ), set before the first parallel op so that "
            "every OpenMP thread holds it (docs/time.md, subnormal floats).",
        )

    def parse_arguments(self, parser, args) -> None:
        self._argv = [str(a) for a in args or []]
        check_config_files(args, self.any_model)
        super().parse_arguments(parser, args)
        # LightningCLI reads a --ckpt_path file's hyperparameters right after parsing. A missing or
        # damaged file would fail there with a traceback. So check it first.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        ckpt = config.get("ckpt_path")
        if subcommand == "validate" and not ckpt:
            raise UserError(
                "validate needs --ckpt_path (a checkpoint file, or `last` for the newest of this run's name); "
                "without one it would evaluate untrained weights"
            )
        if ckpt:
            ckpt_path_form(str(ckpt), subcommand, config.trainer.get("default_root_dir"))
        if ckpt == "last" and subcommand == "validate":
            # Resolved here so that LightningCLI builds the model from the checkpoint's hyperparameters.
            found = resolve_last(config, subcommand)
            if found is not None:
                config.ckpt_path = ckpt = str(found[0])
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS:
            hparams = checked_hyperparameters(open_checkpoint(ckpt, mmap=True), ckpt, litlm=not self.any_model)
            refuse_checkpoint_code(hparams, config.model, ckpt, self.any_model)
        # `--seed_everything true` promises a random seed. Lightning would use 0 (canary
        # test_seed_everything_none_without_environment_is_zero). Drawn here, it is saved in config.yaml.
        if config.get("seed_everything") is True:
            config.seed_everything = secrets.randbelow(2**32)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI merges a checkpoint file's hyperparameters into the config. A value that does not
        # parse would be reported as if the command line held it.
        try:
            super()._parse_ckpt_path()
            merge_sharded_hyperparameters(self)  # Lightning merges only a file's
        except ArgumentError as err:
            ckpt = self.config[self.config.subcommand].get("ckpt_path")
            reason = " ".join(line.strip() for line in str(err).strip().splitlines())
            raise UserError(
                f"checkpoint {ckpt} holds hyperparameters this model does not accept ({reason}); "
                "pass another checkpoint"
            ) from None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if config.get("flush_denormal"):
            # Before the model is built: its init's first parallel op starts OpenMP's threads, which take the
            # flag from this thread then, and never after (benchmarks/subnormal.py).
            torch.set_flush_denormal(True)
        check_accelerator(config.trainer.get("accelerator"))
        check_trainer_config(config.trainer, fp8=config.model.get("fp8"))  # fp8/bf16 need library + hardware
        scale = check_fit_values(config)
        refuse_stray_launcher(scale.devices_here(), scale.num_nodes)  # a leftover RANK: the logger would write nothing
        if self.subcommand == "fit":
            check_trains_something(config.trainer)
        self._resume, self._fresh = None, False
        name_the_default_logger(config)
        if self.subcommand == "validate":
            # Evaluating writes no config. It writes no run directory either, unless the command line
            # names one to log in (as `lmledger sweep` does for each point). The metrics are printed.
            # (A logger name alone only says which run `--ckpt_path last` means.)
            self.save_config_callback = None
            if not any(arg.startswith("--trainer.logger.init_args.save_dir") for arg in self._argv):
                config.trainer.logger = False
            return
        if not config.get("ckpt_path"):
            refuse_a_run_pinned_over(config)
        resume = resume_run(config, self.subcommand, self.any_model)
        if rank_zero_only.rank == 0:  # rank 0 writes the run's files; the others find them already there
            refuse_a_bare_run_over(config)
        if resume is not None:
            self._resume, self._fresh = resume.line, resume.fresh  # before_fit names a fresh version directory
            if resume.config_filename is not None:
                self.save_config_kwargs["config_filename"] = resume.config_filename

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except UserError:
            raise
        except Exception as err:
            failure = build_failure(err)
            if failure is None:
                raise
            raise failure from None

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # Our plugins for transformer-engine (tied weights) and 16-mixed on CPU (lmledger.precision).
        config = cli_value(self, self.config_init, "trainer", default={})
        precision = trainer_precision_kwargs(config.get("precision"), config.get("accelerator"), config.get("plugins"))
        # The ledger callbacks join whatever callbacks the config lists (--ledger.enabled false: none).
        callbacks = config.get("callbacks") or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks])]
        settings = cli_value(self, self.config_init, "ledger")
        if self.any_model:
            callbacks.append(StepChecks(read_batches=settings.enabled))
        # One Ledger, the same for LitLM and any module. A config that lists its own runs that one alone.
        if not any(isinstance(c, Ledger) for c in callbacks):
            callbacks += ledger_callbacks(settings)
        # Last, so the line it prints carries the values the ledger callbacks logged for this step.
        shown = False if config.get("barebones") else config.get("enable_progress_bar")  # barebones: no progress
        callbacks += plain_progress_if_not_a_terminal(shown)
        self._claim = RunClaim()  # the run directory's lock; undoes a refused run's files (before_fit)
        callbacks.append(self._claim)
        precision = _slurm_plugins(precision, config.get("plugins"))
        try:
            trainer = super().instantiate_trainer(**{**precision, "callbacks": callbacks, **kwargs})
        except ValueError as err:  # Lightning's checks of accelerator, strategy, devices (e.g. FSDP on CPU)
            raise ConfigError(" ".join(str(err).split())) from None
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a chosen plugin stays
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        make_sharded_checkpoints_safe(trainer.strategy)  # fsdp2's directories: atomic saves, weights-only loads
        make_last_checkpoint_atomic(trainer.callbacks)
        if self.subcommand == "fit" and not trainer.fast_dev_run:
            trainer.callbacks.append(PreemptionCheckpoint())
        else:  # validate saves nothing. A ModelCheckpoint there only warns that its directory differs. Nor does
            # fast_dev_run, whose last.ckpt Lightning's ModelCheckpoint saves at train end all the same (canary
            # test_model_checkpoint_saves_last_under_fast_dev_run): a last-vN.ckpt more a try, in the working dir.
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        set_peer_timeout(trainer.strategy)  # a rank that never comes or stops answering ends the run (fitting.peers)
        trainer.callbacks.append(PeerWatch())
        trainer.callbacks.append(NameTheEventFile())
        return trainer

    def _check_checkpoint(self) -> None:
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt and ckpt not in SPECIAL_CKPT_PATHS and is_local_path(ckpt):
            check_checkpoint_fits(ckpt, self.model)

    def _claim_run_dir(self) -> None:
        # The run directory is claimed now, after the checks made before training. It is locked: one
        # writer per run (RunClaim). What a run refused in its first step wrote there is undone (main).
        # Rank 0 only: DDP's launcher re-runs the CLI for the other ranks, which log nothing.
        if rank_zero_only.rank != 0:
            return
        if not self.trainer.loggers:  # --trainer.logger false: the run's files go straight into default_root_dir
            Path(self.trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
        for logger in self.trainer.loggers:
            if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                root = Path(logger.root_dir)
                parents = [p for p in (*reversed(root.parents[: len(root.parts) - 1]), root) if not p.exists()]
                claimed: list[int] = []

                def claim(run_root, claimed=claimed) -> int:
                    claimed.append(claim_version_dir(run_root))
                    return claimed[-1]

                pin_logger_version(logger, claim)
                if self._claim.version_dir is not None:
                    continue  # one lock per process: the first logger's directory is the run's
                self._claim.claim(Path(logger.log_dir), bool(claimed) or not Path(logger.log_dir).exists(), parents)
                if run_key() and self.subcommand == "fit":  # the SLURM job or torchrun run: auto finds it again
                    self._claim.mark_slurm_job(run_key()[0])
        run = self._claim.version_dir
        for callback in self.trainer.callbacks:
            # The config name was chosen before the lock was held. A run that ended meanwhile may have taken it.
            if isinstance(callback, SaveConfigCallback) and run and (run / callback.config_filename).exists():
                callback.config_filename = free_name(run, "config-resumed")

    def before_fit(self) -> None:
        store_of_this_attempt(getattr(self.trainer.strategy, "_timeout", None) or PEER_TIMEOUT)  # torchrun restarts
        self._check_checkpoint()
        if self.any_model:
            refuse_several_optimizers(self.model, self.trainer)
            refuse_automatic_features_by_hand(self.model, self.trainer)
        if self.datamodule is not None:
            refuse_empty_train_loader(self.datamodule)
        self._claim_run_dir_or_say_why()
        if rank_zero_only.rank == 0:
            if self._fresh and self._claim.version_dir is not None:
                self._resume += f" in {self._claim.version_dir}"
            if self._resume:
                print(f"lmledger fit: {self._resume}", flush=True)
            if slurm_line() is not None:  # the job in TensorBoard too, one text entry per (re)start
                for logger in self.trainer.loggers:
                    if isinstance(logger, TensorBoardLogger):
                        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
                        logger.experiment.add_text("slurm", slurm_line(), global_step=restart)

    def before_validate(self) -> None:
        store_of_this_attempt(getattr(self.trainer.strategy, "_timeout", None) or PEER_TIMEOUT)
        self._check_checkpoint()
        self._claim_run_dir_or_say_why()

    def _claim_run_dir_or_say_why(self) -> None:
        try:
            self._claim_run_dir()
        except OSError as err:  # a read-only or full runs directory: mkdir of the version fails
            where = Path(err.filename) if err.filename else Path(self.trainer.default_root_dir)
            # no logger, or Lightning's default one (--trainer.logger null): the run is under --trainer.default_root_dir
            named = self.trainer.loggers and self.config[self.subcommand].trainer.get("logger") is not None
            flag = "--trainer.logger.init_args.save_dir" if named else "--trainer.default_root_dir"
            raise write_error(err, where, after=f"nothing was written; pass a writable {flag}") from None


def _slurm_plugins(kwargs: dict, plugins) -> dict:
    """Trainer kwargs with SLURMEnvironment(auto_requeue=False) among the plugins, under SLURM.

    That is when Lightning detects SLURM (srun, or --ntasks). And when the config names no cluster
    environment. PreemptionCheckpoint saves, requeues and stops on SIGUSR1 for every rank count.
    Lightning's requeue would save a second, hpc_ckpt checkpoint.
    """
    if not SLURMEnvironment.detect():
        return kwargs
    plugins = kwargs.get("plugins", plugins)
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if any(isinstance(p, ClusterEnvironment) for p in plugins):
        return kwargs
    return {**kwargs, "plugins": [*plugins, SLURMEnvironment(auto_requeue=False)]}


def slurm_tasks_per_node(env=os.environ) -> None:
    """Let `srun --ntasks N` run on one node.

    Lightning's SLURMEnvironment refuses it with a traceback: "Use --ntasks-per-node" (canary
    test_slurm_environment_refuses_ntasks_without_per_node). On one node the two mean the same. There
    it is given SLURM_NTASKS_PER_NODE=N. Over several nodes, the count per node is the user's to say.
    One line asks for it.
    """
    ntasks = env.get("SLURM_NTASKS", "1")
    if not ntasks.isdigit() or int(ntasks) <= 1 or "SLURM_NTASKS_PER_NODE" in env:
        return
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if nodes == "1":
        env["SLURM_NTASKS_PER_NODE"] = ntasks
        return
    raise UserError(
        f"srun --ntasks {ntasks} over {nodes} nodes: add --ntasks-per-node (Lightning's SLURMEnvironment needs the "
        "same number of tasks on every node, one per device)"
    )


def run_claimed(argv: list[str]) -> None:
    """The fit or validate.

    A run can be refused (UserError) before its first step passed every check. It then leaves its run
    directory as it found it (RunClaim.undo). Every run directory lock is released at the end.
    """
    try:
        with noted_stop_signals():  # a SIGUSR1 while the run is built: save and stop at step 1, not fatal
            _run_cli(FitCLI, argv, run=True)
        close_process_group()  # every rank is past its last collective; a failed run's peers may not be
    except UserError as err:
        undo_uncommitted_claims()
        if getattr(err, "every_rank", False):  # every rank is past its last collective, as after a run that succeeded
            close_process_group()
        raise
    except torch.cuda.OutOfMemoryError as oom:
        if hasattr(oom, "ledger_line"):  # the preflight's refusal, reported as a UserError by main
            undo_uncommitted_claims()
        raise
    except Exception as err:  # another rank never came, stopped answering or died: one line (fitting.peers)
        if isinstance(err, RuntimeError) and getattr(err, "ledger_line", None):  # a kernel this CPU lacks, in step 1
            undo_uncommitted_claims()
            raise
        line = peer_failure_line(err)
        if line is None:
            raise
        end_child_ranks()
        undo_uncommitted_claims()  # a rendezvous that never completed trained nothing: it leaves nothing
        raise PeerFailure(line) from None
    finally:
        release_claims()


def _run_cli(cli_class: type[FitCLI], argv: list[str], run: bool) -> FitCLI:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(DropAdverts())
    # LightningCLI warns when it gets `args` while sys.argv also holds arguments. It does when we run
    # as the console script. sys.argv must stay as it is: DDP's launcher re-runs it for ranks 1..N-1.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # From Lightning's own code, nothing to act on (canary test_lightning_pytree_uses_the_deprecated_leafspec).
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Lightning warns on every mid-epoch resume that a loader without state_dict() "can cause unreliable
    # results". TokenDataModule's resumes exactly: its sampler starts at the restored batch count (tested).
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    # Lightning warns on every run outside SLURM where `srun` is installed (a login node, our CI). A job
    # not started by srun is still handled (PreemptionCheckpoint, --ckpt_path auto; docs/cluster.md).
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    if argv and argv[0] == "validate":  # it restores weights only: the fit's checkpoint callback has nothing to do
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
    named = named_classes(argv[1:] if argv and argv[0] in SUBCOMMANDS else argv)
    if named:
        # Class paths import from the working directory, as under `python -m`. (The console script's
        # sys.path lacks it.) DDP's launcher re-runs the same command there.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        check_class_paths(named)
    try:
        return cli_class(
            pl.LightningModule if named else LitLM,
            pl.LightningDataModule if named else TokenDataModule,
            args=argv,
            run=run,
            subclass_mode_model=bool(named),
            subclass_mode_data=bool(named),
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
        raise UserError(parse_error_line(err)) from None


class _ParseOnlyCLI(FitCLI):
    """Parses a fit config and stops: builds no model, data or trainer."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


class _BuildCLI(FitCLI):
    """Parses a fit config and builds its model and data module. No trainer; nothing run or written. A config that
    runs on a GPU builds on any machine: planning checks a run as its target would (account --measure checks the
    accelerator here itself)."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        # Nor the trainer's plugins: a Transformer Engine plugin needs the library, which planning does not (its step
        # is priced, not run). The config keeps them, which is what planning reads.
        plugins = self.config.get("trainer.plugins")
        self.config["trainer.plugins"] = None
        try:
            super().instantiate_classes()
        finally:
            self.config["trainer.plugins"] = plugins

    def instantiate_trainer(self, **kwargs) -> None:
        return None


def build_model_and_data(argv: list[str]):
    """(model, data module, parsed config) of `lmledger fit ARGV`, built as fit builds them.

    ARGV lacks the `fit`. For account and plan max-batch.
    """
    with _without_seed_line():
        cli = _run_cli(_BuildCLI, argv, run=False)
    refuse_automatic_features_by_hand(cli.model, cli.config.trainer)  # as fit refuses them
    return cli.model, cli.datamodule, cli.config


@contextlib.contextmanager
def _without_seed_line():
    """Hide LightningCLI's "Seed set to N" line where nothing is trained. It seeds while parsing (a model's initial
    weights follow the config's seed); for a parse, or a build for account or plan, the line means nothing."""

    def drop(record: logging.LogRecord) -> bool:
        return "Seed set to" not in record.getMessage()  # "[rank: 1] Seed set to" where RANK says so

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    seed_log.addFilter(drop)
    try:
        yield
    finally:
        seed_log.removeFilter(drop)


def first_batch(datamodule) -> object:
    """A data module's first training batch, read once (set up for fit, no trainer attached)."""
    try:
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        return next(iter(loader))
    except StopIteration:
        raise UserError(f"{type(datamodule).__name__}.train_dataloader() yields no batch") from None


def parse_fit_config(argv: list[str]):
    """The parsed (not instantiated) config of `lmledger fit ARGV`, as a jsonargparse Namespace."""
    with _without_seed_line():
        return _run_cli(_ParseOnlyCLI, argv, run=False).config
