"""Every command, every flag it takes, every kind of bad value: exit 2, one line, no traceback, nothing written.

Issue 28 §4: `account` and `plan max-batch` answered inputs `fit` refuses, for another setup, without a
word. Enumerated rather than patched:

- the flags of the argparse commands come from their own signatures (commands/argparser.py builds the
  parsers from them), read here through each command's run_command call; a new flag gets its bad values
  by construction, from its type;
- the fit arguments that shape what planning answers (the ToyLM's ModelConfig fields, the batch, the
  optimizer, the trainer's accelerator, precision, devices, nodes and strategy) are refused by `fit`,
  `account` and `plan max-batch` alike, in the same words. Every other fit flag is parsed by the one
  LightningCLI parser all three use, and planning does not read it.

In-process (lmledger.cli.main with argv), with a handful of subprocesses proving the real CLI the same.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from lmledger import cli
from lmledger.commands.argparser import ArgumentParser, add_function_arguments
from lmledger.model import ARCHITECTURE_CHOICES, ModelConfig

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny.yaml"]
# A fit that took a bad value would train one step, not 600 (a failing case ends fast).
ONE_STEP = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]

# A bad value of each kind, per type of value (issue 28: zero, negative, huge, NaN, a string, an empty string,
# an enum's typo). A string flag gets the empty string; a choice gets a typo of its first choice as well.
HUGE_INT = "1" + "0" * 30
BAD_NUMBERS = {
    int: {"zero": "0", "negative": "-1", "huge": HUGE_INT, "nan": "nan", "string": "abc", "empty": ""},
    float: {"zero": "0", "negative": "-1", "huge": "1e400", "nan": "nan", "string": "abc", "empty": ""},
}

# A value of the kind is meaningful for the flag: not a bad value there (each says why).
MEANINGFUL = {
    ("model.config.activation_checkpointing", "zero"),  # 0 = no block recomputed (ModelConfig)
}


def _bad_values(kind: object, choices=None) -> dict[str, str]:
    if choices:
        first = str(next(iter(choices)))
        return {"typo": first + "x", "empty": ""}
    if kind in BAD_NUMBERS:
        return dict(BAD_NUMBERS[kind])
    return {"empty": ""}


# ---------------------------------------------------------------------------------------------------------
# The argparse commands: flags from their signatures
# ---------------------------------------------------------------------------------------------------------

# A valid command line of each command (words, then flags); a bad value replaces one flag's value in it.
BASES = {
    ("gpus",): [],
    ("dtypes",): [],
    ("bench", "matmul"): ["--sizes", "16", "--repeats", "1", "--dtypes", "fp32", "--device", "cpu"],
    ("prepare",): ["--source", "src.txt", "--out", "prepared"],
    ("sweep",): ["experiments/batch_memory.yaml", "--dry-run"],
    ("plan", "train-time"): ["--params", "1e9", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "0.5"],
    ("plan", "max-params"): ["--gpu", "h100-sxm"],
    ("plan", "max-batch"): [*TINY, "--gpu", "h100-sxm"],
    ("plan", "layout"): [*TINY, "--gpu", "h100-sxm", "--num-gpus", "2"],
    ("account",): [*TINY],
}
# Flags that mean something only beside another: the bad value is given with it.
SLURM_FLAGS = ("--partition", "--time", "--cpus-per-task", "--mem", "--gres")
COMPANIONS = {
    ("prepare", "--vocab-size"): ["--tokenizer", "bpe"],
    **{("sweep", flag): ["--launcher", "slurm"] for flag in SLURM_FLAGS},
}


def _command_functions() -> dict[tuple[str, ...], typing.Callable]:
    """{command words: function} for every argparse command, as each command's main hands it to run_command."""
    found: dict[tuple[str, ...], typing.Callable] = {}
    for name, (module_name, _) in cli.COMMANDS.items():
        if name in cli.VERB_COMMANDS:
            continue  # fit and validate: LightningCLI's parser (below)
        module = importlib.import_module(f"lmledger.commands.{module_name}")
        seen = []
        original = module.run_command
        module.run_command = lambda prog, command, argv, *a, **k: seen.append(command) or 0  # noqa: B023
        try:
            module.main([])
        finally:
            module.run_command = original
        (command,) = seen
        verbs = command.items() if isinstance(command, dict) else [((), command)]
        for verb, function in verbs:
            found[(name, *((verb,) if verb else ()))] = function
    return found


def _value_kind(action) -> object:
    """int, float or str: what an argparse action's type makes of a good value (an Annotated parser's result)."""
    if action.type in (int, float) or action.type is None:
        return action.type or str
    for text in ("1", "0.5", "h100-sxm"):
        try:
            return type(action.type(text))
        except Exception:  # noqa: BLE001 (a parser refusing this sample)
            continue
    return str


def _argparse_cases() -> list:
    cases = []
    for words, function in _command_functions().items():
        parser = ArgumentParser(prog="lmledger " + " ".join(words))
        add_function_arguments(parser, function)
        for action in parser._actions:
            if action.nargs == 0 or action.dest == "help":
                continue  # a bare flag (--json) takes no value
            flag = action.option_strings[-1] if action.option_strings else None
            values = {**_bad_values(_value_kind(action), action.choices), **EXTRA_BAD.get((words, flag), {})}
            for label, value in values.items():
                cases.append(pytest.param(words, flag, value, id=f"{' '.join(words)} {flag or action.dest} {label}"))
    return cases


# Bad values of a flag beyond its type's kinds (issue 49 §3): a memory under one byte; more CPUs than any node has
# (the stand-in sinfo's nodes: here()), which only a sweep launched (not --dry-run) asks SLURM about.
EXTRA_BAD = {
    (("plan", "max-batch"), "--device-memory-gb"): {"tiny": "1e-12"},
    (("sweep",), "--cpus-per-task"): {"beyond every node": "64"},
    # a GPU of the table the op model cannot price (no SM count): plan layout dropped every layout and blamed memory
    (("plan", "layout"), "--gpu"): {"not priced": "gb200"},
    # not sbatch's forms: refused before a --dry-run lists anything, not by sbatch at submission
    (("sweep",), "--time"): {"not sbatch's form": "1h"},
    (("sweep",), "--mem"): {"no unit sbatch knows": "8X"},
}
LAUNCHED = {("sweep", "--cpus-per-task", "64")}


def _with_value(words: tuple[str, ...], flag: str | None, value: str) -> list[str]:
    base = [a for a in BASES[words] if a != "--dry-run" or (*words, flag, value) not in LAUNCHED]
    if flag is None:  # a positional: the first base word that is not a flag
        return [*words, value, *base[1:]]
    aliases = {flag, *(["--ledger.device_memory_gb"] if flag == "--device-memory-gb" else [])}
    for i, arg in enumerate(base):
        if arg in aliases:
            del base[i : i + 2]
            break
    return [*words, *base, *COMPANIONS.get((words[0], flag), []), flag, value]


# ---------------------------------------------------------------------------------------------------------
# The fit arguments planning reads: refused by fit, account and plan max-batch alike
# ---------------------------------------------------------------------------------------------------------


def _fit_cases() -> list[tuple[str, str, list[str]]]:
    """(flag, kind of bad value, extra arguments) for each fit argument that shapes a planning answer."""
    cases = []
    hints = typing.get_type_hints(ModelConfig)
    for f in dataclasses.fields(ModelConfig):  # every model size and architecture option, by construction
        kind = hints[f.name]
        if type(None) in typing.get_args(kind):  # n_kv_heads: null is meaningful (= n_heads), its int is not
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        choices = ARCHITECTURE_CHOICES.get(f.name)  # mlp, norm, positions: a typo of the default, and empty
        for label, value in _bad_values(kind if kind is not bool else str, choices).items():
            if (f"model.config.{f.name}", label) not in MEANINGFUL:
                cases.append((f"model.config.{f.name}", label, [f"--model.config.{f.name}", value]))
    for label, value in _bad_values(int).items():
        cases += [
            ("data.batch_size", label, ["--data.batch_size", value]),
            ("trainer.num_nodes", label, ["--trainer.num_nodes", value]),
            ("trainer.devices", label, ["--trainer.devices", value]),
        ]
    # trainer.devices: the forms issue 28 found answered as world size 1 (with accelerator cpu, as tiny.yaml has)
    for value in ("1e9", "2.5", "2,3", "-1", "1000000000"):
        cases.append(("trainer.devices", value, ["--trainer.devices", value]))
    cases.append(("trainer.devices", "huge fsdp2", ["--trainer.devices", "1000000000", "--trainer.strategy", "fsdp2"]))
    for value in ("fsdp3", "ddpp", "", "lightning.pytorch.strategies.NoSuchStrategy"):
        cases.append(("trainer.strategy", value or "empty", ["--trainer.strategy", value]))
    ddp = ["--trainer.strategy.class_path", "lightning.pytorch.strategies.DDPStrategy"]
    for label, value in _bad_values(float).items():
        cases.append(("trainer.strategy.bucket_cap_mb", label, [*ddp, "--trainer.strategy.bucket_cap_mb", value]))
    cases.append(("trainer.strategy", "bucket_cap_mb inline", [
        "--trainer.strategy", '{"class_path": "DDPStrategy", "init_args": {"bucket_cap_mb": -5}}']))  # fmt: skip
    for key, typo in (
        ("trainer.precision", "bf17-mixed"),
        ("trainer.accelerator", "cpux"),
        ("model.optimizer", "adamx"),
        ("trainer.gradient_clip_algorithm", "nrom"),
    ):
        cases += [(key, "typo", [f"--{key}", typo]), (key, "empty", [f"--{key}", ""])]
    # Issue 49 §2-3: what planning read without fit's checks (accumulation, clipping, the ledger's links and memory
    # cap), and tensor-parallel sizes fit cannot run (given to a strategy that takes none, or not a whole number).
    for label, value in _bad_values(int).items():
        if label != "huge":  # any number of micro-batches is one fit accumulates
            cases.append(("trainer.accumulate_grad_batches", label, ["--trainer.accumulate_grad_batches", value]))
    for label, value in _bad_values(float).items():
        if label != "zero":  # 0: no clipping
            cases.append(("trainer.gradient_clip_val", label, ["--trainer.gradient_clip_val", value]))
    tp = ["--trainer.strategy", "lmledger.strategies.FSDP2Strategy", "--trainer.strategy.tensor_parallel_size"]
    for label, value in {**_bad_values(int), "fraction": "1.5"}.items():
        cases.append(("trainer.strategy.tensor_parallel_size", label, ["--trainer.devices", "2", *tp, value]))
    cases.append(("trainer.strategy.tensor_parallel_size", "more than the heads", ["--trainer.devices", "8", *tp, "8"]))
    for name in ("ddp", "fsdp2", "auto"):  # a registered name (or the default) takes no arguments
        named = ["--trainer.devices", "2", "--trainer.strategy", name, "--trainer.strategy.tensor_parallel_size", "2"]
        cases.append(("trainer.strategy.tensor_parallel_size", f"under {name}", named))
    for key, other_scope in (("ledger.intra_node", "ib-ndr"), ("ledger.inter_node", "nvlink4")):
        for label, value in {"empty": "", "typo": "nvlink9", "other scope": other_scope, "zero": "0GB/s"}.items():
            cases.append((key, label, [f"--{key}", value]))
    for label, value in {**_bad_values(float), "tiny": "1e-12"}.items():
        cases.append(("ledger.device_memory_gb", label, ["--ledger.device_memory_gb", value]))
    # barebones beside what it turns off (tiny.yaml's logger, log_every_n_steps and ModelCheckpoint): Lightning
    # refused them one a try, the logger by its object's repr, the ModelCheckpoint as an enable_checkpointing=False
    cases.append(("trainer.barebones", "beside a logger", ["--trainer.barebones", "true"]))
    return cases


FIT_CASES = _fit_cases()
PLANNING = {"account": ["account"], "plan max-batch": ["plan", "max-batch", "--gpu", "h100-sxm"]}


# ---------------------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def here(tmp_path_factory, stdlib_data):
    """A working directory as a checkout has it (configs, experiments, prepared data), with a run already in runs/."""
    root = tmp_path_factory.mktemp("bad-values")
    (root / "data").mkdir()
    (root / "data" / "stdlib").symlink_to(stdlib_data)
    for name in ("configs", "experiments", "examples"):
        (root / name).symlink_to(REPO / name)
    (root / "src.txt").write_text("def f(x):\n    return x + 1\n" * 50, encoding="utf-8")
    run = root / "runs" / "tiny" / "version_0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("a run already here\n", encoding="utf-8")
    # SLURM's tools, standing in (outside the tree compared): 2-CPU nodes; an sbatch a refusal must never reach.
    tools = tmp_path_factory.mktemp("slurm-stand-ins")
    for name, script in (("sinfo", 'printf "2 debug*\\n2 debug*\\n"'), ("squeue", "exit 0"),
                         ("sbatch", "echo 'stand-in sbatch reached' >&2; exit 1")):  # fmt: skip
        (tools / name).write_text(f"#!/bin/sh\n{script}\n")
        (tools / name).chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
        yield root


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (links not followed), with its size and mtime: what a refusal must leave as it was."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = (0, 0)
            continue
        stat = path.stat()
        out[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return out


def _refused(capfd, root: Path, argv: list[str], printed: list[str] | None = None) -> str:
    """Run `lmledger ARGV` in-process; assert exit 2, one line on stderr, no traceback, nothing written. The line
    (and what it printed on stdout, appended to `printed`)."""
    before = _tree(root)
    capfd.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's --help, or anything that exits by itself
        code = stop.code
    out, err = capfd.readouterr()
    if printed is not None:
        printed.append(out)
    # LightningCLI logs the seed as it parses a fit's config, before any check: its line is not the refusal's.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set to ")]
    assert code == 2, f"{argv}: exit {code}, stdout {out[-300:]!r}, stderr {err[-600:]!r}"
    assert len(lines) == 1 and "Traceback" not in err, f"{argv}: {err[-1200:]}"
    assert _tree(root) == before, f"{argv} wrote or changed files"
    return lines[0]


@pytest.mark.parametrize(("words", "flag", "value"), _argparse_cases())
def test_every_flag_of_every_argparse_command_refuses_its_bad_values(here, capfd, words, flag, value):
    line = _refused(capfd, here, _with_value(words, flag, value))
    assert line.startswith(f"lmledger {words[0]}: error: ") and "stand-in sbatch reached" not in line, line


# A value the LightningCLI parser itself refuses (by the flag's type) is the one parser's refusal for every
# command: each such case runs one command, in turn. A value the kit's checks refuse runs `fit` and a planning
# command (account and plan max-batch in turn), whose lines must agree word for word. (Each in-process command
# costs about 0.33 s of CPU, its LightningCLI parser built and run: the whole cross product would take minutes.)
PARSER_LEVEL = ("nan", "string", "empty", "fraction")
COMMANDS = (["fit"], *PLANNING.values())
# Fit arguments whose strings the kit's checks read (a string is not refused by the parser there).
KIT_READ_STRINGS = ("trainer.devices", "trainer.num_nodes", "trainer.strategy", "trainer.strategy.bucket_cap_mb",
                    "trainer.precision", "trainer.accelerator", "trainer.gradient_clip_algorithm", "ledger.intra_node",
                    "ledger.inter_node")  # fmt: skip
# plan max-batch takes --ledger.device_memory_gb as its own flag, beside --gpu: account plans those.
ACCOUNT_ONLY = ("ledger.device_memory_gb",)


# Strings the parser takes whatever they say; ModelConfig's own check refuses a bad one (the choices listed).
KIT_CHECKED_STRINGS = {f"model.config.{name}" for name in ARCHITECTURE_CHOICES}


def _is_parser_level(flag: str, label: str) -> bool:
    return label in PARSER_LEVEL and flag not in KIT_READ_STRINGS and flag not in KIT_CHECKED_STRINGS


@pytest.mark.parametrize(
    ("index", "flag", "label", "extra"),
    [(i, *case) for i, case in enumerate(FIT_CASES)],
    ids=[f"{f} {label}" for f, label, _ in FIT_CASES],
)
def test_fit_account_and_plan_refuse_a_bad_fit_value_in_the_same_words(here, capfd, index, flag, label, extra):
    if _is_parser_level(flag, label):
        words = COMMANDS[index % 3] if flag not in ACCOUNT_ONLY else COMMANDS[index % 2]
        line = _refused(capfd, here, [*words, *TINY, *(ONE_STEP if words == ["fit"] else []), *extra])
        assert line.startswith(f"lmledger {words[0]}: error: ") and flag in line, line
        return
    said = _refused(capfd, here, ["fit", *TINY, *ONE_STEP, *extra]).removeprefix("lmledger fit: error: ")
    words = PLANNING["account"] if flag in ACCOUNT_ONLY else list(PLANNING.values())[index % 2]
    line = _refused(capfd, here, [*words, *TINY, *extra])
    assert line == f"lmledger {words[0]}: error: {said}", (line, said)


TP_LONG = ["--trainer.strategy", "ModelParallelStrategy", "--trainer.strategy.tensor_parallel_size", "2"]
TP_INLINE = ["--trainer.strategy", '{"class_path": "ModelParallelStrategy", "init_args": {"tensor_parallel_size": 2}}']


@pytest.mark.parametrize("extra", [TP_LONG, TP_INLINE], ids=["long form", "inline"])
def test_a_tensor_parallel_strategy_fit_refuses_is_refused_by_planning_in_its_words(here, capfd, extra):
    """Both forms of ModelParallelStrategy(tensor_parallel_size 2) on one device: fit refuses them; account predicted
    "fsdp2 over 2 ranks" for the long form and "not modelled" for the inline one."""
    said = _refused(capfd, here, ["fit", *TINY, *ONE_STEP, *extra]).removeprefix("lmledger fit: error: ")
    assert "tensor_parallel_size 2" in said
    for words in PLANNING.values():
        assert _refused(capfd, here, [*words, *TINY, *extra]) == f"lmledger {words[0]}: error: {said}"


def test_every_planner_refuses_a_tensor_parallel_size_the_heads_do_not_divide_in_fits_words(here, capfd):
    """Issue 49 §2: tiny.yaml's 4 heads over tensor_parallel_size 8. account exited 0 with a closed form of the whole
    model over 8 ranks beside a dry run that said "not predicted"; fit cannot run it. Every planner reads the config
    through fit's check: account and plan max-batch (the matrix above), plan train-time --config and sweep --plan,
    which read it from a file."""
    tp8 = {"devices": 8, "strategy": {"class_path": "lmledger.strategies.FSDP2Strategy",
                                       "init_args": {"tensor_parallel_size": 8}}}  # fmt: skip
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config["trainer"].update(tp8)
    (here / "tp8.yaml").write_text(yaml.safe_dump(config))
    experiment = {"name": "tp8", "command": "account", "configs": ["tp8.yaml"], "grid": {"data.batch_size": [16]}}
    (here / "tp8-sweep.yaml").write_text(yaml.safe_dump(experiment))
    said = _refused(capfd, here, ["fit", "--config", "tp8.yaml", *ONE_STEP]).removeprefix("lmledger fit: error: ")
    assert said.startswith("n_heads 4 does not divide by tensor_parallel_size 8"), said
    for words in (["account"], ["plan", "max-batch", "--gpu", "h100-sxm"], ["plan", "train-time", "--tokens", "1e9"]):
        assert _refused(capfd, here, [*words, "--config", "tp8.yaml"]) == f"lmledger {words[0]}: error: {said}"
    listing: list[str] = []
    line = _refused(capfd, here, ["sweep", "tp8-sweep.yaml", "--plan"], listing)
    assert line.startswith("lmledger sweep: error: 1 of 1 points have bad arguments"), line
    assert f"fail: {said}" in listing[0], listing  # the point's row: fit's words


def test_fsdp2_on_a_module_without_configure_model_is_refused_by_fit_and_planning(here, capfd):
    """Lightning's ModelParallelStrategy raised a TypeError at setup (a 73-line traceback); account predicted it."""
    args = ["--config", "configs/examples/byte-convnet.yaml", "--trainer.strategy", "fsdp2"]
    said = _refused(capfd, here, ["fit", *args, "--trainer.max_steps", "1"]).removeprefix("lmledger fit: error: ")
    assert "ByteConvNet has no configure_model()" in said
    for words in PLANNING.values():
        assert _refused(capfd, here, [*words, *args]) == f"lmledger {words[0]}: error: {said}"


def test_good_values_next_to_the_bad_ones_are_answered(here, capsys):
    """The refusals are not everything: the forms fit takes are planned as fit would run them."""
    from lmledger.accounting import trainer_scale
    from lmledger.run_config import MAX_WORLD_SIZE

    assert trainer_scale([*TINY, "--trainer.devices", "2", "--trainer.num_nodes", "3"]).world_size == 6
    assert trainer_scale([*TINY, "--trainer.devices", " 4 "]).world_size == 4
    assert trainer_scale([*TINY, "--trainer.devices", "auto"]).world_size == 1
    assert trainer_scale([*TINY, "--trainer.devices", str(MAX_WORLD_SIZE)]).world_size == MAX_WORLD_SIZE
    gpu = [*TINY, "--trainer.accelerator", "gpu"]
    assert trainer_scale([*gpu, "--trainer.devices", "2,3"]).world_size == 2  # Lightning's GPU indices
    assert trainer_scale([*gpu, "--trainer.devices", "[0, 1, 2]"]).world_size == 3
    assert trainer_scale([*TINY, "--trainer.strategy", "DDP"]).strategy == "ddp"  # Lightning lower-cases names
    ddp = ["--trainer.strategy.class_path", "lightning.pytorch.strategies.DDPStrategy"]
    scale = trainer_scale([*TINY, *ddp, "--trainer.strategy.bucket_cap_mb", "0.5", "--trainer.devices", "2"])
    assert (scale.strategy, scale.init_args["bucket_cap_mb"], scale.world_size) == ("ddp", 0.5, 2)


# The real CLI, as users run it: the OOM-killed case of issue 28 §2 among them, and issue 49's stray launcher
# variables, which Lightning's rank-zero switch reads as it is imported. Started together, waited on together.
SUBPROCESS_CASES = [
    (["account", *TINY, "--trainer.devices", "1000000000", "--trainer.strategy", "fsdp2"], {}),
    (["plan", "max-batch", *TINY, "--gpu", "h100-sxm", "--trainer.strategy", "fsdp3"], {}),
    (["fit", *TINY, *ONE_STEP, "--trainer.devices", "2.5"], {}),
    (["plan", "train-time", "--params", "nan", "--tokens", "1e12", "--gpu", "h100-sxm", "--mfu", "0.5"], {}),
    (["fit", *TINY, *ONE_STEP], {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}),  # exit 0, no event file
]
SEED_LINE = re.compile(r"^(\[rank: \d+\] )?Seed set to \d+$")  # Lightning's, with the rank RANK says


def test_the_real_cli_refuses_the_same_way(here):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    before = _tree(here)
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "lmledger.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, **extra},
        )
        for argv, extra in SUBPROCESS_CASES
    ]
    said = []
    for (argv, _), process in zip(SUBPROCESS_CASES, started, strict=True):
        _, err = process.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip() and not SEED_LINE.match(line)]
        assert process.returncode == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err[-800:])
        assert lines[0].startswith(f"lmledger {argv[0]}: error: "), lines
        said.append(lines[0])
    assert "world size of 1,000,000,000 ranks, beyond any cluster" in said[0]
    assert said[4].startswith("lmledger fit: error: this process's launcher variables disagree with --trainer.")
    assert _tree(here) == before
