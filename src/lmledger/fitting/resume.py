"""--ckpt_path: which checkpoint it means, and whether that checkpoint may resume this run.

    ckpt_path_form              values refused before anything is built (URLs, `best`, a directory, ...)
    checked_hyperparameters,    a checkpoint's hyperparameters hold no bad value and name no code
    refuse_checkpoint_code      the command line does not (LightningCLI merges them into the config)
    resume_run                  `auto` and `last` resolved to a checkpoint of this run (a file, or a sharded
                                directory an fsdp2 run saved)
    merge_sharded_hyperparameters   a sharded checkpoint's hyperparameters build the model, as a file's do

A resume is refused when its settings or data differ. A run that trained every step asked for
raises `NothingToResume`.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import Namespace

from lmledger.checkpointing import is_sharded_checkpoint, newest_checkpoint, open_checkpoint
from lmledger.data import TokenDataModule, load_meta
from lmledger.errors import ConfigError, UserError
from lmledger.lightning_private import is_local_path
from lmledger.lit import LitLM, check_hyperparameters
from lmledger.preemption import run_key
from lmledger.rundir import slurm_job_version, versions

__all__ = [
    "SPECIAL_CKPT_PATHS",
    "NothingToResume",
    "Resume",
    "checked_hyperparameters",
    "ckpt_path_form",
    "free_name",
    "merge_sharded_hyperparameters",
    "name_the_default_logger",
    "refuse_a_bare_run_over",
    "refuse_a_run_pinned_over",
    "refuse_checkpoint_code",
    "resolve_last",
    "resume_run",
]

# --ckpt_path values Lightning resolves itself rather than reading as a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry", "auto")  # auto: ours (fit resumes if it can)


class NothingToResume(Exception):
    """--ckpt_path names a run that trained every step asked for. Say so, exit 0, write nothing."""


# Model settings that may differ on resume. They change how the same function is computed, not which.
# (Top-level `activation_checkpointing` is the examples' and other modules' name for the same switch.)
_RESUME_MAY_CHANGE = ("compile", "config.activation_checkpointing", "config.vocab_size", "activation_checkpointing")


def ckpt_path_form(ckpt: str, subcommand: str, default_root_dir) -> None:
    """Refuse, before anything is built, --ckpt_path values this process cannot honour.

    Those are remote URLs, and Lightning's names for state this process does not have:

        best        a fit earlier in the same process
        registry    a model registry
        hpc         Lightning's SLURM requeue checkpoint, hpc_ckpt_N.ckpt, when there is none
    """
    if not is_local_path(ckpt):
        raise UserError(
            f"--ckpt_path {ckpt}: remote checkpoints are not supported here; copy it to a local file and pass that"
        )
    if ckpt == "hpc" and any(Path(default_root_dir or ".").glob("hpc_ckpt_*.ckpt")):
        return
    if ckpt == "auto" and subcommand != "fit":
        raise UserError(f"--ckpt_path auto is for `lmledger fit` (resume if there is a checkpoint, else start); "
                        f"`lmledger {subcommand}` needs `last` or a checkpoint file")  # fmt: skip
    if ckpt in ("best", "hpc", "registry"):
        raise UserError(
            f"--ckpt_path {ckpt}: there is no {ckpt!r} checkpoint to resolve in a fresh `lmledger {subcommand}`; "
            "pass `last` or a checkpoint file (runs/NAME/version_N/checkpoints/*.ckpt)"
        )
    if ckpt not in SPECIAL_CKPT_PATHS + ("auto",) and Path(ckpt).is_dir():
        open_checkpoint(ckpt, mmap=True)  # a sharded checkpoint (fsdp2) is a directory; any other: one line why not


def merge_sharded_hyperparameters(cli) -> None:
    """Build the model from a sharded --ckpt_path's hyperparameters, as LightningCLI does for a file.

    (LightningCLI._parse_ckpt_path reads only a file: `Path(ckpt_path).is_file()`, Lightning 2.6.6.)
    """
    subcommand = cli.config.get("subcommand")
    ckpt = cli.config[subcommand].get("ckpt_path") if subcommand else None
    if not ckpt or ckpt in SPECIAL_CKPT_PATHS or not is_sharded_checkpoint(ckpt):
        return
    hparams = dict(open_checkpoint(ckpt, mmap=True).get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    if not hparams:
        return
    if "_class_path" in hparams:
        hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    cli.config = cli.parser.parse_object({subcommand: {"model": hparams}}, cli.config)


def _find_last_checkpoint(save_dir: str, name: str, ckpt: str) -> tuple[Path, int] | None:
    """(newest_checkpoint, N) of the newest `save_dir/name/version_N` that has a checkpoint (--ckpt_path `ckpt`)."""
    root = Path(save_dir, name)
    for version in sorted(versions(root), reverse=True):
        found = _newest_of_run(root / f"version_{version}" / "checkpoints", ckpt)
        if found is not None:
            return found, version
    return None


def _newest_of_run(checkpoints: Path, ckpt: str) -> Path | None:
    """newest_checkpoint of a run's checkpoints directory, refusing one whose checkpoint is a dangling link.

    A `last.ckpt` symlink whose target a clean-up or a move took is no checkpoint to newest_checkpoint: `auto` would
    start the run over from step 0 in its own directory, `last` resume an older version. One line, nothing changed."""
    for path in sorted(checkpoints.glob("*.ckpt")):
        if path.is_symlink() and not path.exists():
            raise UserError(
                f"--ckpt_path {ckpt}: {path} is a symbolic link to {os.readlink(path)}, which does not exist (moved or "
                "deleted); nothing was changed: restore its target, or remove the link to resume from the run's "
                "other checkpoints (with none, the run starts over)"
            )
    return newest_checkpoint(checkpoints)


def name_the_default_logger(config) -> None:
    """No logger given (--trainer.logger null, or true) is Lightning's default one: a TensorBoardLogger writing
    default_root_dir/lightning_logs/version_N. Named as such, it is claimed, resumed and checked as a configured one is:
    left to Lightning, `--ckpt_path last` looked in the new version, found nothing and started over (with a warning,
    exit 0), and `auto` refused it as another logger's layout. (Lightning names a SLURM job's version by the job's id;
    here the claim's slurm_job file finds it, as for every configured logger.)"""
    if config.trainer.get("barebones"):  # null is no logger there (Lightning's Trainer); true was refused
        return
    if config.trainer.get("logger") in (None, True):  # True: Lightning's default logger, asked for by name
        config.trainer.logger = _default_logger(config)


def _default_logger(config) -> Namespace:
    root = config.trainer.get("default_root_dir") or os.getcwd()
    return Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                     init_args=Namespace(save_dir=str(root), name="lightning_logs"))  # fmt: skip


def _run_dir_of(config) -> tuple[Path, object] | None:
    """(save_dir/name, the logger's init_args) in our TensorBoard/CSV layout (Lightning's default logger's too, before
    name_the_default_logger names it); None for another logger, or none."""
    if config.trainer.get("barebones"):  # no logger (_bare_root)
        return None
    logger = config.trainer.get("logger")
    logger = _default_logger(config) if logger is None or logger is True else logger
    init = logger.init_args if logger is not None and hasattr(logger, "init_args") else None
    if init is None or "save_dir" not in init:
        return None
    return Path(init.save_dir, init.get("name") or "lightning_logs"), init


def resolve_last(config, subcommand: str) -> tuple[Path, int | None] | None:
    """--ckpt_path last: the newest checkpoint of this run's newest version, or with no logger of its root's
    checkpoints/ (_bare_root), where Lightning's own `last` looks in no directory validate keeps (None: another
    logger's layout)."""
    found, bare = _run_dir_of(config), _bare_root(config)
    if found is None and bare is None:
        return None
    if found is None:
        where, path = bare / "checkpoints", _newest_of_run(bare / "checkpoints", "last")
        last = (path, None) if path is not None else None
    else:
        root, init = found
        where = f"{root}/version_*/checkpoints/last.ckpt"
        last = _find_last_checkpoint(init.save_dir, init.get("name") or "lightning_logs", "last")
    if last is None:
        raise UserError(
            f"--ckpt_path last: no {'checkpoint in ' if found is None else ''}{where} to resume; "
            + ("start a fresh run without --ckpt_path" if subcommand == "fit" else "train one with `lmledger fit`")
        )
    return last


def _resolve_auto(config) -> tuple[Path | None, int | None, str]:
    """--ckpt_path auto: (checkpoint, version, what happens in words).

    Under SLURM, "this run" is the version directory this job or array task trains in. Its slurm_job
    file says so. A requeued job resumes it; another job never does. Under torchrun, the same for its run
    id (preemption.run_key): a restart of its workers resumes it. Elsewhere, it is the newest
    version with a checkpoint: a pod restarted, a script run again. With no checkpoint: (None, the job's version or
    None for a new one, the reason).
    """
    found = _run_dir_of(config)
    bare = _bare_root(config) if found is None else None
    if bare is not None:  # no logger: the one run its root keeps (refuse_a_bare_run_over), whoever restarts it
        ckpt = _newest_of_run(bare / "checkpoints", "auto")
        return ckpt, None, "" if ckpt else f"no checkpoint in {bare / 'checkpoints'} yet: starting fresh"
    if found is None:
        raise UserError(
            "--ckpt_path auto finds checkpoints in the TensorBoardLogger/CSVLogger layout (save_dir/name/version_N); "
            "with another logger pass --ckpt_path FILE"
        )
    root, init = found
    keyed = run_key()
    if keyed is None:
        last = _find_last_checkpoint(init.save_dir, init.get("name") or "lightning_logs", "auto")
        if last is None:
            return None, None, f"no checkpoint under {root} yet: starting fresh"
        return last[0], last[1], ""
    job, who = keyed
    version = slurm_job_version(root, job)
    if version is None:
        return None, None, f"{who} has no run under {root} yet: starting fresh"
    ckpt = _newest_of_run(root / f"version_{version}" / "checkpoints", "auto")
    if ckpt is None:
        why = f"{who} stopped in {root}/version_{version} before its first checkpoint: starting over"
        return None, version, why
    return ckpt, version, ""


def free_name(directory: Path, stem: str) -> str:
    """The first of stem.yaml, stem-2.yaml, stem-3.yaml, ... that `directory` lacks."""
    n = 1
    while (directory / (name := f"{stem}.yaml" if n == 1 else f"{stem}-{n}.yaml")).exists():
        n += 1
    return name


@dataclass(frozen=True)
class Resume:
    """What a fit's --ckpt_path resolved to, for the run's first line and its config file."""

    line: str  # "resuming RUN at step N from FILE", or why nothing is resumed
    fresh: bool = False  # --ckpt_path auto found nothing: the line gets the version directory claimed
    config_filename: str | None = None  # the resumed run's config, saved beside its first


def refuse_a_run_pinned_over(config) -> None:
    """Refuse a fit without --ckpt_path whose logger is pinned (`--trainer.logger.init_args.version 0`) to a version
    directory that already holds something: Lightning would log, save its config and checkpoints into another run
    (a second curve in its event files, its last.ckpt replaced). A fresh fit takes a version of its own."""
    found = _run_dir_of(config)
    version = found[1].get("version") if found is not None else None
    if version is None:
        return
    run = found[0] / (version if isinstance(version, str) else f"version_{version}")
    held = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UserError(
            f"--trainer.logger.init_args.version {version}: {run} already holds a run ({shown}), and a fit without "
            "--ckpt_path never writes into one; drop the version to start the next free one (--ckpt_path last "
            "resumes the newest run of this name in place)"
        )


def _bare_root(config) -> Path | None:
    """Where a fit with no logger (--trainer.logger false) keeps its run: Lightning writes its config and checkpoints,
    and the Ledger its per-rank records, straight into --trainer.default_root_dir (the working directory by
    default), with no version directory to keep one run's files from the next. None with a logger. Under
    barebones there is none, whatever --trainer.logger says (null; any other was refused)."""
    logger = config.trainer.get("logger")
    if logger is not False and logger != [] and not config.trainer.get("barebones"):
        return None
    return Path(config.trainer.get("default_root_dir") or os.getcwd())


def _kept_in(root: Path, checkpoint: Path) -> bool:
    """Whether `checkpoint` is one of the run a bare root keeps (its checkpoints/, a file or a sharded directory)."""
    return (root / "checkpoints").resolve() in checkpoint.resolve().parents


def refuse_a_bare_run_over(config) -> None:
    """Refuse a fit with no logger that would write over another run's files in its root (_bare_root): a fresh one,
    or one resuming a checkpoint kept elsewhere. Lightning's own check stops at its config.yaml, with a traceback,
    and only after the model is built."""
    from lmledger.callbacks.ranks import RANKS_DIR

    root = _bare_root(config)
    if root is not None and root.exists() and not root.is_dir():
        raise UserError(f"--trainer.default_root_dir {root} is a file, not a directory: with no logger, the run's "
                        "config and checkpoints go straight into it; pass a directory")  # fmt: skip
    held = [name for name in ("checkpoints", "config.yaml", RANKS_DIR) if root and (root / name).exists()]
    ckpt = config.get("ckpt_path")
    if not held or (ckpt and _kept_in(root, Path(ckpt))):
        return
    barebones = bool(config.trainer.get("barebones"))
    logger = "false" if config.trainer.get("logger") is False else "[]"
    named = "--trainer.barebones true" if barebones else f"--trainer.logger {logger}"
    raise UserError(
        f"{named}: this fit writes straight into {root} (--trainer.default_root_dir, no version "
        f"directory), which already holds a run ({', '.join(held)}), and a fit "
        + (f"resuming {ckpt}, not a checkpoint of that run, " if ckpt else "without --ckpt_path ")
        + "never writes into one; pass a new --trainer.default_root_dir"
        + ("" if barebones else ", or keep a logger (each run then gets a version directory of its own)")
    )


def resume_run(config, subcommand: str, any_model: bool) -> Resume | None:
    """Resolve a fit's --ckpt_path (`auto`, `last` or a file). Check it may resume this run.

    Sets config.ckpt_path to the file (None: a fresh start). Points the logger at the run's own version
    directory. None when there is nothing to say: no --ckpt_path, or `last` outside our logger layout.
    """
    ckpt = config.get("ckpt_path")
    if not ckpt:
        return None
    run_dir, auto = None, ckpt == "auto"
    if auto:
        path, version, fresh = _resolve_auto(config)
        if path is None:  # nothing to resume: a fresh start, in the SLURM job's own version if it has one
            config.ckpt_path = None
            if version is not None:
                _run_dir_of(config)[1].version = version
            return Resume(f"--ckpt_path auto: {fresh}", fresh=True)  # the version directory is named once claimed
        ckpt = "last"  # checked as --ckpt_path last checks the checkpoint it finds
    if ckpt == "last":
        found = (path, version) if config.ckpt_path == "auto" else resolve_last(config, subcommand)
        if found is None:
            return None  # another logger's layout: let Lightning resolve "last" itself
        path, version = found
        run_dir = path.parent.parent
        checkpoint = open_checkpoint(path, mmap=True)
        hparams = checked_hyperparameters(checkpoint, path, litlm=not any_model)
        differences = _hyperparameter_differences(hparams, config.model)
        if differences:
            raise UserError(
                f"checkpoint {path} was trained with other settings ({'; '.join(differences)}); resume with "
                f"the run's own (its {run_dir / 'config.yaml'}), or start a fresh run without --ckpt_path"
            )
    else:
        path, version = Path(ckpt), None
        checkpoint = open_checkpoint(path, mmap=True)
    step = int(checkpoint.get("global_step", 0))
    _check_not_finished(config.trainer, checkpoint, run_dir or path, step)
    _check_same_data(config, checkpoint, path)
    config.ckpt_path = str(path)
    bare = _bare_root(config)
    if bare is not None and _kept_in(bare, path):
        # no logger, and the run kept in its root: its config is saved beside the first one, never over it
        return Resume(f"{'--ckpt_path auto: ' if auto else ''}resuming {bare} at step {step} from {path.name}",
                      config_filename=free_name(bare, "config-resumed"))  # fmt: skip
    if version is None:
        return Resume(f"resuming from {path} at step {step}, in a new run directory")
    # Log into the run's own version. Its config is saved beside the first one, never over it.
    _run_dir_of(config)[1].version = version
    return Resume(
        f"{'--ckpt_path auto: ' if auto else ''}resuming {run_dir} at step {step} from {path.name}",
        config_filename=free_name(run_dir, "config-resumed"),
    )


def _check_not_finished(trainer, checkpoint: dict, run: Path, step: int) -> None:
    """NothingToResume if the checkpoint trained every step (or epoch) the trainer asks for."""
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
            # The data module sizes one epoch to max_steps. A run extended past its old max_steps would
            # stop at once on its completed epoch. So the epoch count does not bound such a run.
            trainer.max_epochs = epochs_done + 1
    elif max_epochs is not None and 0 <= max_epochs <= epochs_done:
        raise NothingToResume(
            f"{run} finished at step {step} ({epochs_done} epochs); nothing to resume "
            "(a larger --trainer.max_epochs trains further)"
        )


def _check_same_data(config, checkpoint: dict, path: Path) -> None:
    """A TokenDataModule checkpoint resumes only onto data of the same sha256, or with --allow_other_data."""
    trained_on = (checkpoint.get(TokenDataModule.__qualname__) or {}).get("sha256")
    data_path = _setting(config.data, "path")
    if not trained_on or config.get("allow_other_data") or not isinstance(data_path, (str, os.PathLike)):
        return  # another data module: its state, if any, is Lightning's to restore
    try:
        now = load_meta(data_path).get("sha256")
    except UserError:
        return  # the data module reports a bad directory in its own words
    if now and now != trained_on:
        changed = ", ".join(sorted(k for k in set(now) | set(trained_on) if now.get(k) != trained_on.get(k)))
        raise UserError(
            f"checkpoint {path} was trained on other data than {data_path} holds now ({changed} differ "
            "by sha256); resume onto the same data, or pass --allow_other_data true to continue on this data"
        )


def _setting(section, name: str):
    """A class's argument from its config section: `section.name`; in subclass mode `section.init_args.name`."""
    if section is None:
        return None
    if "init_args" in section and isinstance(section.get("init_args"), Namespace):
        return section.init_args.get(name)
    return section.get(name)


# ------------------------------------------------------------------------------ a checkpoint's hyperparameters


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


def _hyperparameter_differences(saved: dict, current) -> list[str]:
    """'model.KEY: A in the checkpoint, B now' per differing model setting (_RESUME_MAY_CHANGE aside).

    Only settings both sides know are compared. A checkpoint from before a setting existed ran its
    default. In subclass mode `current` is {class_path, init_args}: the class and its arguments are
    compared. A module that saves no hyperparameters has none to compare.
    """
    differences = []
    if isinstance(current, Namespace):
        current = current.as_dict()
    if isinstance(current, dict) and "class_path" in current:
        then = saved.get("_class_path")
        if then is not None and then != current["class_path"]:
            differences.append(f"model.class_path: {then} in the checkpoint, {current['class_path']} now")
        current = {**(current.get("init_args") or {}), **(current.get("dict_kwargs") or {})}
    theirs, ours = _flatten({k: v for k, v in saved.items() if not k.startswith("_")}), _flatten(current)
    for key in sorted(set(theirs) & set(ours)):
        if key in _RESUME_MAY_CHANGE or key.startswith("_"):
            continue
        then, now = theirs[key], ours[key]
        if then != now:
            differences.append(f"model.{key}: {_show(then)} in the checkpoint, {_show(now)} now")
    return differences


def _show(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def checked_hyperparameters(checkpoint: dict, path, litlm: bool = True) -> dict:
    """The checkpoint's model hyperparameters; one line naming the checkpoint refuses bad ones.

    Bad is not a mapping, or holding a value LitLM would refuse. LightningCLI merges them into the
    config, where the error would otherwise blame the command line.
    """
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(hparams, dict):
        raise UserError(
            f"checkpoint {path} stores its hyperparameters as a {type(hparams).__name__}, not a mapping of names "
            "to values: it was not written by `lmledger fit`; pass a checkpoint of this kit"
        )
    if litlm and "_class_path" not in hparams:  # our LitLM's; another class checks its own
        try:
            # A setting the checkpoint lacks (saved before it existed) was trained with LitLM's default.
            given = {k: v for k, v in hparams.items() if not k.startswith("_")}
            check_hyperparameters(**(_litlm_defaults() | given))
        except (ConfigError, TypeError) as err:
            raise UserError(
                f"checkpoint {path} holds a bad hyperparameter ({err}); it was edited or written by other code: "
                "pass another checkpoint"
            ) from None
    return hparams


def _litlm_defaults() -> dict:
    """LitLM.__init__'s defaults, by name: the one place they are written."""
    parameters = inspect.signature(LitLM.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _is_import_path(value) -> bool:
    return isinstance(value, str) and "." in value and all(part.isidentifier() for part in value.split("."))


def _import_paths(value, key: str = ""):
    """(key, path) per value in a checkpoint's hyperparameters that jsonargparse would import.

    It imports them when LightningCLI merges them into the config. Such values are of two kinds. A
    `_class_path`/`class_path` entry at any depth. And any string of the form package.module.name: a
    callable- or class-typed argument imports it.
    """
    if isinstance(value, dict):
        for name, item in value.items():
            if name in ("_class_path", "class_path"):
                if item is not None:
                    yield (f"{key}.{name}" if key else name), item
            elif name != "_instantiator":  # Lightning's own key, popped before the merge
                yield from _import_paths(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _import_paths(item, f"{key}.{i}")
    elif _is_import_path(value):
        yield key, value


def _already_names(path: str, obj) -> bool:
    """Whether `path` names `obj` in modules already imported. `obj` is a default: a function or class.

    Nothing new is imported to find out. So a path into a module not yet loaded names nothing.
    """
    module, _, attr = path.rpartition(".")
    while module:
        if module in sys.modules:
            target = sys.modules[module]
            for part in attr.split("."):
                target = getattr(target, part, None)
            return target is obj
        module, _, head = module.rpartition(".")
        attr = f"{head}.{attr}"
    return False


def _shown(value) -> str:
    """A config value for a message. A function or class by its import path; anything else by repr()."""
    name, module = getattr(value, "__name__", None), getattr(value, "__module__", None)
    return f"{module}.{name}" if callable(value) and name and module else repr(value)


def _lookup(namespace, key: str):
    """The value at dotted `key` in a (possibly nested) mapping, list or Namespace; None if absent."""
    value = namespace.as_dict() if isinstance(namespace, Namespace) else namespace
    for part in key.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def refuse_checkpoint_code(hparams: dict, model_config, path, any_model: bool) -> None:
    """Refuse a --ckpt_path file that names code the command line does not.

    LightningCLI builds the model from the checkpoint's `_class_path`. It merges the other
    hyperparameters into the config. Then jsonargparse imports every class path and dotted callable
    among them. So a checkpoint could pick the class (or function) that runs. Each such value must
    equal what the command line and config files name there. It is checked on the weights-only load,
    before anything is imported.
    """
    current = model_config.as_dict() if isinstance(model_config, Namespace) else dict(model_config or {})
    named = current.get("class_path") if any_model else f"{LitLM.__module__}.{LitLM.__qualname__}"
    saved_class = hparams.get("_class_path")
    if saved_class is not None and saved_class != named:
        flag = f"--model {saved_class}" if any_model else f"--model {saved_class} (a class-path run)"
        raise UserError(
            f"checkpoint {path} was saved from class {saved_class!r}, but this command builds {named}: refused "
            f"before importing it (a checkpoint does not choose the code that runs); pass {flag} if you trust "
            f"that class, or a checkpoint of {named}"
        )
    init = (current.get("init_args") or {}) | (current.get("dict_kwargs") or {}) if any_model else current
    prefix = "--model.init_args." if any_model else "--model."
    for key, value in _import_paths({k: v for k, v in hparams.items() if k != "_class_path"}):
        now = _lookup(init, key.removesuffix("._class_path"))
        if isinstance(now, dict):
            now = now.get("class_path")
        if value != now and not (now is not None and _already_names(value, now)):
            raise UserError(
                f"checkpoint {path} sets model {key} to {value!r}, an import path this command does not name "
                f"(it has {_shown(now)}): refused before importing it (a checkpoint does not choose the code that "
                f"runs); pass {prefix}{key.removesuffix('.class_path')} {value} if you trust it"
            )
