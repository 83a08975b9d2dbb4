"""`lmledger fit|validate`: LightningCLI over LitLM and TokenDataModule, or over any LightningModule.

`--model CLASS_PATH` / `--data CLASS_PATH` switch LightningCLI to subclass mode. So does a --config
whose `model:` / `data:` has a `class_path`. Then any LightningModule and LightningDataModule run
(data defaults to TokenDataModule). They get lmledger.callbacks.Ledger and the same run directories,
checkpoints and resume. Class paths import from the working directory too, as under `python -m`.

Runs live under `runs/<name>/version_<n>/`: TensorBoard events, the resolved config.yaml, checkpoints/.
Each new run takes the next version, so no earlier run is overwritten.
`--ckpt_path last` resumes the newest run of that name that has a last.ckpt.
It logs into the same version.

`validate` needs --ckpt_path (a file or `last`) and writes nothing. It makes no config.
It makes no run directory unless the command line names one to log in.
`lmledger sweep` does (`--trainer.logger.init_args.save_dir DIR`).

Every run also gets these, unconfigured. Checkpoints are written atomically (AtomicCheckpointIO).
A NaN/Inf guard runs (`--nonfinite.max_skips K`; default 0 stops at the first non-finite step).
Each batch is reseeded for exact resume (StepSeeder). SIGTERM saves and stops (PreemptionCheckpoint,
exit 143). A --ckpt_path is checked before Lightning touches it. Is it readable? Does it fit the model?
Was it trained with the same settings and data? Has it steps left to train?
docs/reliability.md lists every case.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lmledger.atomic import write_error
from lmledger.errors import UserError
from lmledger.fitting.checks import SUBCOMMANDS
from lmledger.fitting.cli import run_claimed, slurm_tasks_per_node
from lmledger.fitting.peers import PeerFailure
from lmledger.fitting.resume import NothingToResume
from lmledger.fitting.steps import disk_error
from lmledger.preemption import elastic_line, slurm_line

__all__ = ["main"]


_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _quiet_event_writer(excepthook):
    """threading.excepthook, minus the traceback of TensorBoard's writer thread on a full disk.

    The training loop re-raises that OSError at its next write. Then main reports it in one line.
    Canary: test_tensorboard_writer_thread_reraises_its_error."""

    def hook(args) -> None:
        if issubclass(args.exc_type, OSError) and "tensorboard" in type(args.thread).__module__.lower():
            return
        excepthook(args)

    return hook


def main(argv: list[str]) -> int:
    subcommand = argv[0] if argv else None
    if subcommand not in SUBCOMMANDS:
        raise UserError(f"unknown subcommand {subcommand!r}; choose from {', '.join(SUBCOMMANDS)}")
    if subcommand == "fit" and rank_zero_only.rank == 0:
        if not sys.stdout.isatty():  # a batch job's --output file gets each line as it is printed
            sys.stdout.reconfigure(line_buffering=True)
        if slurm_line() is not None:
            print(f"lmledger fit: {slurm_line()}", flush=True)
        elif elastic_line() is not None:  # a torchrun worker: its run id keys --ckpt_path auto
            print(f"lmledger fit: {elastic_line()}", flush=True)
    excepthook, threading.excepthook = threading.excepthook, _quiet_event_writer(threading.excepthook)
    # A run that fails where Lightning skips its teardown (a full disk under the logger's finalize) leaves its
    # signal handlers installed; the command puts back the ones it found, for whoever calls it next.
    handlers = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    try:
        slurm_tasks_per_node()
        run_claimed(argv)
    except NothingToResume as done:
        print(f"lmledger {subcommand}: {done}")
        return 0
    except PeerFailure as failure:  # a rank never came, stopped answering or died (fitting.peers)
        print(f"lmledger {subcommand}: {failure.line}", file=sys.stderr, flush=True)
        return 1
    except SIGTERMException as stop:  # PreemptionCheckpoint's Preempted, or Lightning's own (DDP, set-up)
        saved = getattr(stop, "checkpoint", None)
        if saved and rank_zero_only.rank != 0:
            pass  # every rank stopped at the same step (PreemptionCheckpoint); rank 0 says so
        elif saved:
            requeued = f"; {stop.requeued}" if getattr(stop, "requeued", None) else ""
            print(f"lmledger {subcommand}: preempted at step {stop.step}: saved {saved}; resume with --ckpt_path last"
                  f"{requeued}", file=sys.stderr)  # fmt: skip
        elif subcommand == "fit":
            print(f"lmledger {subcommand}: preempted (SIGTERM) before a step could be saved; --ckpt_path last "
                  "resumes from the run's newest checkpoint, if it has one", file=sys.stderr)  # fmt: skip
        else:
            print(f"lmledger {subcommand}: stopped by SIGTERM", file=sys.stderr)
        return 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
    except torch.cuda.OutOfMemoryError as oom:  # the Ledger explains it in one line
        if not hasattr(oom, "ledger_line"):
            raise
        raise UserError(oom.ledger_line) from oom
    except SystemExit as exit_:
        # Lightning turns Ctrl-C into sys.exit(1) after its graceful shutdown; cli.py reports it as 130.
        if isinstance(exit_.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
    except UserError:
        raise
    except Exception as err:  # a disk that refused a run's file (NameTheEventFile names an event file)
        if isinstance(err, RuntimeError) and getattr(err, "ledger_line", None):  # a CPU kernel (callbacks.cpukernels)
            raise UserError(err.ledger_line) from err
        refused = disk_error(err)
        if refused is None or not refused.filename:
            raise
        kept = "the checkpoints saved before it are intact"
        raise write_error(refused, Path(refused.filename), after=kept) from None
    finally:
        threading.excepthook = excepthook
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return 0
