"""The `lmledger` entry point: dispatch to a subcommand, turn user errors into one clear line.

Each subcommand lives in `lmledger.commands.<name>` and exposes `main(argv) -> int`.
They are imported lazily, so `lmledger plan` does not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
import os
import sys

from lmledger.commands.argparser import canonical_flags
from lmledger.errors import UserError

__all__ = ["COMMANDS", "VERB_COMMANDS", "main"]


# Each command: (module under lmledger.commands, help). Most modules' main takes the arguments after the
# command; VERB_COMMANDS' main serves several commands and takes the command itself first.
VERB_COMMANDS = ("fit", "validate")
# Commands that read a fit's arguments: an alias of a fit flag (`--device-memory-gb`) becomes the fit's
# spelling (`--ledger.device_memory_gb`) before LightningCLI or argparse reads it.
_FIT_ARGUMENT_COMMANDS = ("fit", "validate", "account", "plan")
COMMANDS = {
    "fit": ("fit", "train a model (LightningCLI)"),
    "validate": ("fit", "evaluate a model on the validation split (LightningCLI)"),
    "prepare": ("prepare", "tokenize a corpus into train.bin / val.bin / meta.json"),
    "account": ("account", "one training step of a config, on paper and measured"),
    "plan": ("plan", "napkin math: training time, largest model, largest batch"),
    "gpus": ("gpus", "the GPU spec table (dense peaks, memory, bandwidth)"),
    "dtypes": ("dtypes", "floating-point formats: bytes, bits, range, eps, and the lecture's casts"),
    "bench": ("bench", "matmul benchmark: achieved FLOP/s and MFU per dtype and size"),
    "sweep": ("sweep", "run an experiment grid from a YAML file"),
}


def _usage() -> str:
    lines = ["usage: lmledger COMMAND [ARGS] (lmledger COMMAND --help for each)", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _discard_stdout() -> None:
    """Point stdout at /dev/null. Then the final flush of a closed pipe raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by something without a descriptor
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lmledger: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"lmledger.commands.{COMMANDS[name][0]}")
    if name in _FIT_ARGUMENT_COMMANDS:
        rest = canonical_flags(rest)
    try:
        code = int(module.main([name, *rest] if name in VERB_COMMANDS else rest) or 0)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, inside this handler
        return code
    except BrokenPipeError:
        _discard_stdout()
        return 141  # 128 + SIGPIPE: what `yes | head` reports, quietly
    except UserError as err:
        print(f"lmledger {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmledger {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
