"""Command flags built from the command functions' signatures (commands/argparser.py) keep the names,
placeholders and errors the hand-written argparse parsers had."""

from __future__ import annotations

import argparse
import re
from typing import Annotated, Literal

import pytest

from lmledger.cli import main as lmledger
from lmledger.commands.argparser import ArgumentParser, add_function_arguments, canonical_flags, run_command
from lmledger.corpus import DEFAULT_BPE_VOCAB_SIZE, DEFAULT_OUT, DEFAULT_VAL_FRACTION, STDLIB
from lmledger.errors import UserError

SLURM_FLAGS = ("--partition", "--time", "--cpus-per-task", "--mem", "--gres")  # sweep --launcher slurm's (issue 20)
# The flags each command had before its parser came from a signature (typed here, not read from the code).
FLAGS = {
    ("gpus",): {"--help", "--resolve", "--json"},
    ("dtypes",): {"--help", "--json"},
    ("bench", "matmul"): {"--help", "--dtypes", "--sizes", "--repeats", "--device", "--plot", "--json"},
    ("prepare",): {"--help", "--source", "--tokenizer", "--vocab-size", "--out", "--overwrite", "--val-fraction"},
    ("sweep",): {"--help", "--dry-run", "--plan", "--jobs", "--out", "--launcher", *SLURM_FLAGS},
    # account and plan max-batch also name the fit arguments they pass through (--config, --a.b overrides)
    ("account",): {"--help", "--config", "--model", "--data", "--a", "--measure", "--gpu", "--json"},
    ("plan", "train-time"): {
        "--help",
        "--params",
        "--config",
        "--tokens",
        "--gpu",
        "--num-gpus",
        "--mfu",
        "--dtype",
        "--json",
        "--a",
    },
    ("plan", "max-params"): {"--help", "--gpu", "--num-gpus", "--precision", "--optimizer", "--json"},
    # --ledger.device_memory_gb (read as "--ledger"), the fit's spelling, and its alias --device-memory-gb
    ("plan", "max-batch"): {"--help", "--gpu", "--ledger", "--device-memory-gb", "--json", "--config", "--a"},
}


def help_text(capsys, *words: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        lmledger([*words, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("words", list(FLAGS), ids=" ".join)
def test_each_command_keeps_its_flags(capsys, words):
    text = help_text(capsys, *words)
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text)) == FLAGS[words]


def test_placeholders_and_quoted_constants_reach_the_help(capsys):
    text = " ".join(help_text(capsys, "prepare").split())
    for usage in ("--source stdlib|PATH [stdlib|PATH ...]", "--tokenizer {bytes,bpe}", "--vocab-size N", "--out DIR"):
        assert usage in text
    assert f"bpe vocabulary size (default {DEFAULT_BPE_VOCAB_SIZE})" in text
    assert f"(default {DEFAULT_OUT})" in text and f"(default {DEFAULT_VAL_FRACTION};" in text
    assert "Tokenize a corpus into DIR/train.bin" in text  # the docstring's summary is the description
    assert "--resolve NAME" in help_text(capsys, "gpus") and "--plot PNG" in help_text(capsys, "bench", "matmul")
    sweep = help_text(capsys, "sweep")
    sweep = " ".join(sweep.split())
    usage = (r"usage: lmledger sweep \[-h\] \[--dry-run\] \[--plan\] \[--jobs JOBS\] \[--out OUT\] "
             r"\[--launcher {local,slurm}\] \[--partition P\] \[--time T\] \[--cpus-per-task C\] \[--mem M\] "
             r"\[--gres G\] experiment")  # fmt: skip
    assert re.search(usage, sweep)


def test_the_real_prepare_signature_parses_as_the_old_parser_did():
    from lmledger.commands.prepare import prepare_corpus

    parser = ArgumentParser(prog="lmledger prepare")
    add_function_arguments(parser, prepare_corpus)
    assert vars(parser.parse_args([])) == {
        "source": (STDLIB,),
        "tokenizer": "bytes",
        "vocab_size": None,
        "out": DEFAULT_OUT,
        "overwrite": False,
        "val_fraction": DEFAULT_VAL_FRACTION,
    }
    args = parser.parse_args(["--source", "a", "b", "--tokenizer", "bpe", "--vocab-size", "300", "--overwrite"])
    assert (args.source, args.tokenizer, args.vocab_size, args.overwrite) == (["a", "b"], "bpe", 300, True)
    assert parser.parse_args(["--val-fraction", "0.25"]).val_fraction == 0.25


def example(
    path: str, mode: Literal["a", "b"] = "a", sizes: list[int] | None = None, dry_run: bool = False, n: int = 1
) -> int:
    """A command.

    Args:
        path: where
        mode: which
        sizes (S): how big, in a help line
            that continues
        dry_run: do nothing
        n (N): how many
    """
    return 0


def test_signature_rules_and_one_line_errors():
    parser = ArgumentParser(prog="lmledger example")
    add_function_arguments(parser, example)
    args = parser.parse_args(["p", "--mode", "b", "--sizes", "1", "2", "--dry-run", "--n", "3"])
    assert vars(args) == {"path": "p", "mode": "b", "sizes": [1, 2], "dry_run": True, "n": 3}
    assert "how big, in a help line that continues" in parser.format_help().replace("\n", " ").replace("  ", "")
    for argv, message in (
        (["p", "--mode", "c"], "argument --mode: invalid choice: 'c'"),
        (["p", "--n", "x"], "argument --n: invalid int value: 'x'"),
        (["p", "--dry_run"], "unrecognized arguments: --dry_run"),  # dashes only, as argparse users expect
        ([], "the following arguments are required: path"),
    ):
        with pytest.raises(UserError) as err:
            parser.parse_args(argv)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
        assert str(err.value).endswith("(see `lmledger example --help`)")


def _even(text: str) -> int:
    value = int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"{text!r} is odd")
    return value


def test_required_flags_parsed_values_and_passed_through_arguments():
    calls = []

    def passes(*rest: str, size: Annotated[int, _even], name: str = "x") -> int:
        """passes the rest on

        Args:
            size: an even number
        """
        calls.append((rest, size, name))
        return 3

    def refuses(*, size: Annotated[int, _even]) -> None:
        """refuses the rest"""
        calls.append(((), size, None))

    verbs = {"passes": passes, "refuses": refuses}
    assert run_command("lmledger ex", verbs, ["passes", "--config", "c.yaml", "--size", "4", "--a.b=-1"]) == 3
    assert run_command("lmledger ex", verbs, ["refuses", "--size", "2"]) == 0
    assert calls == [(("--config", "c.yaml", "--a.b=-1"), 4, "x"), ((), 2, None)]
    for argv, message in (
        (["passes", "--config", "c.yaml"], "the following arguments are required: --size"),
        (["refuses", "--size", "3"], "argument --size: '3' is odd"),
        (["refuses", "--size", "2", "--config", "c"], "unrecognized arguments: --config c (see `lmledger ex --help`)"),
        (["other"], "argument kind: invalid choice: 'other'"),
    ):
        with pytest.raises(UserError) as err:
            run_command("lmledger ex", verbs, argv)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert len(calls) == 2


def test_an_alias_of_a_fit_flag_is_rewritten_to_the_fit_spelling():
    assert canonical_flags(["--config", "c.yaml", "--device-memory-gb", "2", "--device-memory-gb=0.5", "x"]) == [
        "--config", "c.yaml", "--ledger.device_memory_gb", "2", "--ledger.device_memory_gb=0.5", "x",
    ]  # fmt: skip
    assert canonical_flags(["--device-memory-gbx", "--ledger.device_memory_gb=1"]) == [
        "--device-memory-gbx", "--ledger.device_memory_gb=1",
    ]  # fmt: skip


@pytest.mark.parametrize("command", [["fit"], ["validate"], ["account"], ["plan", "max-batch"]], ids=" ".join)
def test_every_command_with_the_memory_cap_gets_the_fit_spelling(monkeypatch, command):
    """fit and validate hand their arguments to LightningCLI, which knows only --ledger.device_memory_gb."""
    import importlib

    from lmledger import cli

    seen = []
    module = importlib.import_module(f"lmledger.commands.{cli.COMMANDS[command[0]][0]}")
    monkeypatch.setattr(module, "main", lambda argv: seen.append(argv) or 0)
    assert lmledger([*command, "--config", "c.yaml", "--device-memory-gb", "3"]) == 0
    expected = [*command[1:], "--config", "c.yaml", "--ledger.device_memory_gb", "3"]
    assert seen == [[command[0], *expected] if command[0] in cli.VERB_COMMANDS else expected]


def test_max_batch_takes_either_spelling_and_shows_the_fit_spelling(capsys):
    import json

    answers = []
    for flag in (["--ledger.device_memory_gb", "0.05"], ["--device-memory-gb", "0.05"], ["--device-memory-gb=0.05"]):
        capsys.readouterr()
        assert lmledger(["plan", "max-batch", "--config", "configs/tiny.yaml", *flag, "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0]["capacity_bytes"] == 50_000_000 and answers[0]["max_batch"] > 0
    text = " ".join(help_text(capsys, "plan", "max-batch").split())
    assert "--ledger.device_memory_gb GB, --device-memory-gb GB" in text
    assert lmledger(["plan", "max-batch", "--config", "configs/tiny.yaml", "--gpu", "h100-sxm",
                     "--ledger.device_memory_gb", "80"]) == 2  # fmt: skip
    assert "--ledger.device_memory_gb GB (alias --device-memory-gb), one of them" in capsys.readouterr().err


def test_fit_reads_the_alias_as_its_own_flag(capsys):
    """The alias reaches LightningCLI in its spelling: a bad value is reported under the fit's flag name."""
    assert lmledger(["fit", "--config", "configs/tiny.yaml", "--device-memory-gb", "abc"]) == 2
    err = capsys.readouterr().err
    assert "--ledger.device_memory_gb abc: expected a float or null" in err and "device-memory-gb" not in err


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        # A Union of Literals: each value once (64 and '64'), none cut at the first Literal's bracket.
        (["--trainer.precision", "7"], "--trainer.precision 7: expected 64, 32, 16, 'transformer-engine', "),
        (["--trainer.max_steps", "abc"], "--trainer.max_steps abc: expected an int"),  # a value of one type
        # a class's argument with no class named: the flag's own base type was tried
        (["--optimizer.lr", "0.1"], "--optimizer.lr 0.1: --optimizer names no class to take lr: name one first"),
    ],
)
def test_a_value_the_parser_refuses_is_named_with_what_it_takes(capsys, flag, said):
    assert lmledger(["account", "--config", "configs/tiny.yaml", *flag]) == 2
    err = capsys.readouterr().err
    assert said in err and "typing." not in err and "Parser key" not in err and "<class" not in err, err
    assert "'bf16' or null" in err if flag[0] == "--trainer.precision" else True


def test_every_flag_refuses_an_empty_value_an_int_is_a_count_and_a_float_finite():
    """Issue 28 §4: the rules every signature-built flag gets (tests/commands/test_bad_values.py runs them on each
    command)."""

    def command(path: str, n: int = 1, x: float = 0.5, mode: Literal["a", "b"] = "a") -> int:
        """A command."""
        return 0

    parser = ArgumentParser(prog="lmledger example")
    add_function_arguments(parser, command)
    assert vars(parser.parse_args(["p", "--n", "2147483647", "--x", "-0.25"])) == {
        "path": "p", "n": 2**31 - 1, "x": -0.25, "mode": "a",
    }  # fmt: skip
    for argv, message in (
        ([""], "argument path: an empty value: give one"),
        (["p", "--mode", ""], "argument --mode: an empty value"),
        (["p", "--n", " "], "argument --n: an empty value"),
        (["p", "--n", "0"], "argument --n: '0' is not a count between 1 and 2,147,483,647"),
        (["p", "--n", "2147483648"], "argument --n: '2147483648' is not a count between 1"),
        (["p", "--n", "1.5"], "argument --n: invalid int value: '1.5'"),
        (["p", "--x", "nan"], "argument --x: not a finite number: 'nan'"),
        (["p", "--x", "1e400"], "argument --x: not a finite number: '1e400'"),
        (["p", "--x", "abc"], "argument --x: invalid float value: 'abc'"),
    ):
        with pytest.raises(UserError) as err:
            parser.parse_args(argv)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
