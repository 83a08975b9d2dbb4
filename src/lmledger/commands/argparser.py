"""Command-line arguments from a command function's signature and docstring, parsed by argparse whose
usage errors are UserErrors (one line on stderr, exit 2, like every other bad input).

jsonargparse (LightningCLI's parser) would read the same signatures, but 4.53 spells `vocab_size` as
`--vocab_size`, wants `--json true` and `--source [a,b]`; argparse keeps the flags as they are.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence

from lmledger.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _docstring(function: Callable) -> tuple[str, dict[str, tuple[str | None, str]]]:
    """The summary (text before `Args:`) and, per parameter, (metavar, help) from lines such as
    `vocab_size (N): bpe vocabulary size (default {DEFAULT_BPE_VOCAB_SIZE})`. A `{NAME}` naming an
    upper-case global of the function's module is replaced by its value, so help quotes the constant."""
    text = re.sub(
        r"\{([A-Z][A-Z0-9_]*)\}",
        lambda m: str(function.__globals__[m[1]]) if m[1] in function.__globals__ else m[0],
        inspect.getdoc(function) or "",
    )
    summary, _, args = text.partition("\nArgs:\n")
    params: dict[str, tuple[str | None, str]] = {}
    name = None
    for line in args.splitlines():
        entry = re.match(r"    (\w+)(?: \(([^)]*)\))?: (.*)", line)
        if entry:
            name = entry[1]
            params[name] = (entry[2], entry[3])
        elif name and line.startswith("        "):  # a continuation line
            metavar, help_ = params[name]
            params[name] = (metavar, f"{help_} {line.strip()}")
    return " ".join(summary.split()), params


def _value_type(hint) -> tuple[object, bool]:
    """(the type of one value, whether the flag takes several) for a parameter's annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _value_type(args[0])
    if typing.get_origin(hint) in (list, tuple, Sequence):
        return _value_type(args[0])[0], True
    return hint, False


def add_function_arguments(parser: argparse.ArgumentParser, function: Callable) -> None:
    """One argument per parameter: no default -> positional; `flag: bool = False` -> a bare `--flag`;
    `Literal[...]` -> choices; a list or sequence -> one or more values; `snake_case` -> `--snake-case`."""
    _, docs = _docstring(function)
    hints = typing.get_type_hints(function)
    for param in inspect.signature(function).parameters.values():
        metavar, help_ = docs.get(param.name, (None, None))
        kind, several = _value_type(hints.get(param.name, str))
        options: dict = {"help": help_, "metavar": metavar}
        if kind is bool:
            options = {"help": help_, "action": "store_true"}
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif kind is not str:
            options["type"] = kind
        if several:
            options["nargs"] = "+"
        if param.default is inspect.Parameter.empty:
            parser.add_argument(param.name, **options)
        else:
            flag = "--" + param.name.replace("_", "-")
            parser.add_argument(flag, dest=param.name, default=param.default, **options)


def run_command(prog: str, command: Callable | Mapping[str, Callable], argv: list[str], description: str = "") -> int:
    """Parse argv for `command` (or for one verb of a {verb: function} mapping, as `bench matmul`) and call
    it with what was parsed; its docstring's summary is the --help description."""
    if callable(command):
        parser = ArgumentParser(prog=prog, description=description or _docstring(command)[0])
        add_function_arguments(parser, command)
        return command(**vars(parser.parse_args(argv))) or 0
    parser = ArgumentParser(prog=prog, description=description)
    verbs = parser.add_subparsers(dest="kind", required=True)
    for verb, function in command.items():
        summary = _docstring(function)[0]
        add_function_arguments(verbs.add_parser(verb, help=summary), function)
    args = vars(parser.parse_args(argv))
    return command[args.pop("kind")](**args) or 0
