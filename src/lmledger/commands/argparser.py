"""Command-line arguments from a command function's signature and docstring, parsed by argparse.

Usage errors are UserErrors: one line on stderr, exit 2, like every other bad input.

jsonargparse (LightningCLI's parser) would read the same signatures. But 4.53 spells `vocab_size` as
`--vocab_size`, and wants `--json true` and `--source [a,b]`. argparse keeps the flags as they are.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence

from lmledger.errors import UserError

__all__ = ["MAX_FLAG_COUNT", "ArgumentParser", "add_function_arguments", "canonical_flags", "run_command"]


# A flag `lmledger fit` also takes keeps LightningCLI's spelling everywhere (what --help shows); the argparse
# spelling (`--device-memory-gb`) stays an alias, rewritten by canonical_flags before any parser reads it.
_FIT_SPELLINGS = {"device_memory_gb": "--ledger.device_memory_gb"}
_ALIASES = {"--" + name.replace("_", "-"): flag for name, flag in _FIT_SPELLINGS.items()}


def canonical_flags(argv: Sequence[str]) -> list[str]:
    """argv with each alias (`--device-memory-gb X`, `--device-memory-gb=X`) in its canonical spelling."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        out.append(_ALIASES[flag] + eq + value if flag in _ALIASES else arg)
    return out


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _docstring(function: Callable) -> tuple[list[str], dict[str, tuple[str | None, str]]]:
    """The summary's paragraphs, and (metavar, help) per parameter.

    The summary is the text before `Args:`, each paragraph on one line. Parameters come from lines such
    as `vocab_size (N): bpe vocabulary size (default {DEFAULT_BPE_VOCAB_SIZE})`. A `{NAME}` naming an
    upper-case global of the function's module becomes its value. So help quotes the constant."""
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
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", summary)]
    return [p for p in paragraphs if p], params


# The largest value a count flag takes (--jobs, --repeats, --vocab-size, --cpus-per-task): 2**31 - 1. Beyond
# it no count of this kit means anything (token ids are stored in at most 32 bits, and 10**30 repeats never end).
MAX_FLAG_COUNT = 2**31 - 1


def _checked(kind: object, parse: Callable | None) -> Callable[[str], object]:
    """A flag's value from its text, the same rules for every command (issue 28: bad values by construction).

    An empty value is refused for every flag (`--out ""` would write into the working directory). An `int`
    flag is a count from 1 to MAX_FLAG_COUNT, a `float` flag a finite number; an `Annotated` parser says
    more, or otherwise, for its own flag."""

    def convert(text: str) -> object:
        if not text.strip():
            raise argparse.ArgumentTypeError("an empty value: give one")
        if parse is not None:
            return parse(text)
        if kind is int:
            value = int(text)  # a ValueError reads "invalid int value: 'x'", argparse's words
            if not 1 <= value <= MAX_FLAG_COUNT:
                raise argparse.ArgumentTypeError(f"{text!r} is not a count between 1 and {MAX_FLAG_COUNT:,}")
            return value
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
            return value
        return text if kind in (str, object) or typing.get_origin(kind) is typing.Literal else kind(text)

    convert.__name__ = getattr(parse, "__name__", getattr(kind, "__name__", "value"))  # argparse's "invalid X value"
    return convert


def _value_type(hint) -> tuple[object, bool]:
    """(the type of one value, whether the flag takes several) for a parameter's annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _value_type(args[0])
    if typing.get_origin(hint) in (list, tuple, Sequence):
        return _value_type(args[0])[0], True
    return hint, False


def _passes_rest(function: Callable) -> bool:
    """Whether the function takes `*args`: arguments its own flags do not name (a fit config)."""
    return any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(function).parameters.values())


def add_function_arguments(parser: argparse.ArgumentParser, function: Callable) -> None:
    """One argument per parameter: no default -> positional, or a required flag when keyword-only;
    `flag: bool = False` -> a bare `--flag`; `Literal[...]` -> choices; a list or sequence -> one or more
    values; `Annotated[T, parse]` -> `parse(text)` makes the value; `snake_case` -> `--snake-case` (a name
    in _FIT_SPELLINGS: the fit's spelling first, `--snake-case` its alias);
    `*args` -> no argument (run_command hands it the arguments left over)."""
    _, docs = _docstring(function)
    hints = typing.get_type_hints(function, include_extras=True)
    for param in inspect.signature(function).parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            continue
        metavar, help_ = docs.get(param.name, (None, None))
        hint, parse = hints.get(param.name, str), None
        if typing.get_origin(hint) is typing.Annotated:
            hint, parse = typing.get_args(hint)[:2]
        kind, several = _value_type(hint)
        options: dict = {"help": help_, "metavar": metavar}
        if kind is bool:
            options = {"help": help_, "action": "store_true"}
        else:
            options["type"] = _checked(kind, parse)
            if typing.get_origin(kind) is typing.Literal:
                options["choices"] = typing.get_args(kind)
        if several:
            options["nargs"] = "+"
        if param.default is inspect.Parameter.empty and param.kind is not param.KEYWORD_ONLY:
            parser.add_argument(param.name, **options)
            continue
        flag = "--" + param.name.replace("_", "-")
        if param.default is inspect.Parameter.empty:
            options["required"] = True
        else:
            options["default"] = param.default
        flags = [_FIT_SPELLINGS[param.name], flag] if param.name in _FIT_SPELLINGS else [flag]
        parser.add_argument(*flags, dest=param.name, **options)


def run_command(
    prog: str,
    command: Callable | Mapping[str, Callable],
    argv: list[str],
    description: str = "",
    verb_name: str = "kind",
    **parser_options,
) -> int:
    """Parse argv for `command` and call it with what was parsed.

    `command` is a function, or a {verb: function} mapping (as `bench matmul`).
    A command's docstring summary is its --help description. A verb's first paragraph is its line in the
    command's --help. The rest is the verb's own description.
    A function with `*args` receives the arguments its flags do not name. Any other refuses them.
    verb_name names the verb in errors ("required: kind").
    parser_options go to the command's ArgumentParser (usage, allow_abbrev)."""
    if callable(command):
        parser = ArgumentParser(
            prog=prog, description=description or " ".join(_docstring(command)[0]), **parser_options
        )
        add_function_arguments(parser, command)
        function, parsed = command, parser.parse_known_args(argv)
    else:
        parser = ArgumentParser(prog=prog, description=description, **parser_options)
        verbs = parser.add_subparsers(dest=verb_name, required=True)
        for verb, function in command.items():
            summary = _docstring(function)[0]
            verb_parser = verbs.add_parser(
                verb, help=summary[0] if summary else None, description=" ".join(summary[1:]) or None
            )
            add_function_arguments(verb_parser, function)
        parsed = parser.parse_known_args(argv)
        function = command[vars(parsed[0]).pop(verb_name)]
    args, rest = parsed
    if rest and not _passes_rest(function):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return function(*rest, **vars(args)) or 0
