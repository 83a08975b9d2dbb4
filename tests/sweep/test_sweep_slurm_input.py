"""Issue 28 §2 and §6 for `lmledger sweep --launcher slurm`: what reaches the batch script, and what is left.

Every flag and path that reaches the batch script is quoted as its reader reads it back (bash for the shell
lines, sbatch's own parser for the #SBATCH lines), and a value no #SBATCH line can carry (a newline) is
refused in one line before anything is written. An sbatch refusal leaves nothing behind. The tasks run the
experiment as it was submitted, and a task that dies is failed with the cause its log names.

Most tests need no SLURM: a stand-in `sbatch` on PATH keeps the script it is given and refuses it, or runs its
task 0 with bash as slurmd would; a stand-in `squeue` lists nothing. Two tests submit to the real one-node
cluster (tests/conftest.py `slurm_cluster`) and skip in one line without it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from lmledger.cli import main as lmledger
from lmledger.sweep import load_experiment
from lmledger.sweep.slurm import ended_result

PLAN = {"command": "plan max-params", "gpu": "h100-sxm"}  # a point that runs in a second, without Lightning
JOB = "4242"  # the stand-in sbatch's job id

FAKE_SBATCH = f"""#!/bin/bash
# Test stand-in for sbatch: keeps its arguments and the script, then refuses (FAKE_SBATCH_REFUSE) or queues it,
# running task 0 with bash as slurmd would when FAKE_SBATCH_RUN is set.
script="${{@: -1}}"
printf '%s\\n' "$@" > "$FAKE_SLURM/argv"
cp -- "$script" "$FAKE_SLURM/submitted.sh"
if [ -n "$FAKE_SBATCH_REFUSE" ]; then echo "sbatch: error: $FAKE_SBATCH_REFUSE" >&2; exit 1; fi
if [ -n "$FAKE_SBATCH_RUN" ]; then
  SLURM_ARRAY_JOB_ID={JOB} SLURM_ARRAY_TASK_ID=0 bash "$script" > "$FAKE_SLURM/task0.out" 2>&1
fi
echo {JOB}
"""


@pytest.fixture
def fake_slurm(tmp_path_factory, monkeypatch) -> Path:
    """sbatch and squeue stand-ins first on PATH; returns the folder where sbatch leaves what it was given
    (outside the working directory, which the tests compare before and after)."""
    kept = tmp_path_factory.mktemp("fake-slurm")
    (kept / "bin").mkdir(parents=True)
    (kept / "bin" / "sbatch").write_text(FAKE_SBATCH)
    (kept / "bin" / "squeue").write_text("#!/bin/sh\nexit 0\n")  # nothing pending or running
    # two nodes of 2 CPUs in the default partition "debug", one of 8 in "big"
    (kept / "bin" / "sinfo").write_text('#!/bin/sh\nprintf "2 debug*\\n2 debug*\\n8 big\\n"\n')
    for tool in ("sbatch", "squeue", "sinfo"):
        (kept / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{kept / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(kept))
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "")  # set here so that the tests' own settings are undone after them
    monkeypatch.setenv("FAKE_SBATCH_RUN", "")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    return kept


def write_experiment(path: Path, **spec) -> Path:
    path.write_text(yaml.safe_dump({"name": "q", **spec}, sort_keys=False))
    return path


def sweep(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = lmledger(["sweep", *argv, "--launcher", "slurm"])
    return code, capsys.readouterr().err.strip()


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root: a file's bytes, None for a folder."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def sbatch_directives(script: str) -> list[str]:
    """The arguments sbatch reads from a script's #SBATCH lines, as src/sbatch/opt.c (`_opt_batch_script`,
    `_get_argument`) reads them: the lines up to the first command; in each, arguments end at unquoted
    whitespace, `"` or `'` group, a backslash takes the next character as it is, an unquoted `#` ends the line."""
    args = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.strip().startswith("#"):
                break  # the first command: sbatch reads no further
            continue
        rest, i = line[len("#SBATCH") :], 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            arg, quote, escaped = None, "", False
            while i < len(rest) and (quote or not rest[i].isspace()):
                ch = rest[i]
                i += 1
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                    continue
                elif quote:
                    if ch == quote:
                        quote = ""
                        continue
                elif ch in "\"'":
                    quote = ch
                    continue
                elif ch == "#":
                    i = len(rest)  # a comment: the rest of the line is not read
                    break
                arg = (arg or "") + ch
            assert not quote, f"sbatch: Unmatched `{quote}` in [{line}]"
            if arg is None:
                break
            args.append(arg)
    return args


# ------------------------------------------------------------------------ what reaches the batch script

HOSTILE = ["a b", "x;touch semi", "$(touch dollar)", "`touch tick`", "q\"uo'te", "hash#tail", "back\\slash"]


@pytest.mark.parametrize("flag", ["--partition", "--gres"])
def test_each_flag_reaches_sbatch_as_given_and_nothing_else_runs(workdir, capsys, fake_slurm, flag):
    """Spaces, `;`, `$(...)`, backticks, quotes, `#` and backslashes in each flag that goes into an #SBATCH line:
    sbatch reads back exactly the value given (the stand-in sbatch refuses the array, so each case is cheap;
    test_a_path_with_spaces_and_shell_characters_runs runs a script's shell lines)."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    os.environ["FAKE_SBATCH_REFUSE"] = "refused by the test"
    for value in HOSTILE:
        code, err = sweep(capsys, str(path), "--out", "o", flag, value)
        script = (fake_slurm / "submitted.sh").read_text()
        assert f"{flag}={value}" in sbatch_directives(script), (value, script)
        assert code == 2 and err.endswith("refused by the test; nothing was queued, and nothing was left behind"), err
        assert not (workdir / "o").exists()


def test_a_time_sbatch_cannot_read_is_refused_before_anything_is_written(workdir, capsys, fake_slurm):
    """--time takes sbatch's forms only (minutes, [hours:]minutes:seconds, days-hours[:minutes[:seconds]],
    UNLIMITED): anything else, shell characters included, is refused in one line before sbatch; --dry-run too."""
    from lmledger.sweep.slurmscript import SlurmRequest

    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    for value in (*HOSTILE, "1h", "soon", "1:2:3:4"):
        code, err = sweep(capsys, str(path), "--out", "o", "--time", value)
        assert code == 2 and "give a limit as sbatch takes it" in err and "\n" not in err, (value, err)
        assert not (workdir / "o").exists() and not (fake_slurm / "submitted.sh").exists()
    assert sweep(capsys, str(path), "--dry-run", "--time", "1h")[0] == 2
    for value in ("30", "30:00", "1:00:00", "2-0", "2-12:30", "2-12:30:00", "UNLIMITED", "infinite"):
        assert SlurmRequest(time=value).time == value


@pytest.mark.parametrize("flag", ["--partition", "--time", "--gres", "--out"])
def test_a_newline_in_any_flag_is_refused_before_anything_is_written(workdir, capsys, fake_slurm, flag):
    """`$'debug\\ntouch x'` would end its #SBATCH line and put `touch x` on a line of its own, which bash runs:
    refused in one line, before sbatch, and nothing is written. A carriage return and a tab likewise. (--mem
    reaches the script only as a number of MiB, and --cpus-per-task as an int.)"""
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    before = tree(workdir)
    os.environ["FAKE_SBATCH_RUN"] = "1"  # were it submitted, its task would run the script
    for value in ("debug\ntouch x", "debug\rtouch x", "debug\ttouch x"):
        argv = ["--out", value] if flag == "--out" else ["--out", "o", flag, value]
        code, err = sweep(capsys, str(path), *argv)
        assert not (fake_slurm / "argv").exists() and tree(workdir) == before  # sbatch never ran, nothing written
        assert code == 2 and "\n" not in err and "Traceback" not in err, err
        assert f"{flag} " in err and "control character" in err and "#SBATCH" in err, err
    code, err = sweep(capsys, str(path), "--out", "o", "--partition", "")
    # the command line refuses an empty value of any flag (commands/argparser.py) before the batch script's check
    assert code == 2 and "--partition: an empty value" in err and "\n" not in err and tree(workdir) == before
    # sbatch takes the word "hetjob" out of an #SBATCH line, and starts a heterogeneous job's next part there
    argv = ["--out", "runs/HetJob"] if flag == "--out" else ["--out", "o", flag, "gpu-hetjob"]
    code, err = sweep(capsys, str(path), *argv)
    assert code == 2 and "job" in err and "heterogeneous" in err and tree(workdir) == before, err


def test_a_results_path_with_a_backslash_is_refused(workdir, capsys, fake_slurm):
    """A backslash in --output turns off SLURM's %A_%a (sbatch(1), filename pattern): every task would write
    one file named `%A_%a.out`. Refused, and a `%` of the path is doubled instead (it stands for itself)."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    code, err = sweep(capsys, str(path), "--out", "a\\b")
    assert code == 2 and "holds a backslash" in err and not (workdir / "a\\b").exists(), err
    os.environ["FAKE_SBATCH_REFUSE"] = "refused by the test"
    sweep(capsys, str(path), "--out", "100%x")
    (output,) = [a for a in sbatch_directives((fake_slurm / "submitted.sh").read_text()) if a.startswith("--output=")]
    assert output == f"--output={workdir}/100%%x/slurm/logs/%A_%a.out"


def test_a_path_with_spaces_and_shell_characters_runs(workdir, capsys, fake_slurm, monkeypatch):
    """The working directory and --out hold a space, `;`, `$(...)` and backticks: the task runs (bash, as slurmd
    would run it), its point is done, and none of the names' commands ran."""
    odd = workdir / "my runs;$(touch dollar)`touch tick`"
    odd.mkdir()
    monkeypatch.chdir(odd)
    path = write_experiment(odd / "e.yaml", points=[PLAN])
    os.environ["FAKE_SBATCH_RUN"] = "1"
    code, err = sweep(capsys, str(path), "--out", "out dir; $(touch x)")
    task_log = (fake_slurm / "task0.out").read_text()
    assert code == 0, (err, task_log)
    out = odd / "out dir; $(touch x)"
    (status,) = [json.loads(p.read_text()) for p in (out / "points").glob("*/status.json")]
    assert status["status"] == "done" and status["slurm_task"] == f"{JOB}_0", status
    assert "max_params" in (out / "results.csv").read_text()
    script = (fake_slurm / "submitted.sh").read_text()
    assert f"--output={out}/slurm/logs/%A_%a.out" in sbatch_directives(script)
    assert not [p for p in workdir.rglob("*") if p.name in ("x", "dollar", "tick", "touch")]


# ------------------------------------------------------------------------------ a refusal leaves nothing


@pytest.mark.parametrize(("more", "said"), [
    ([], "a node would need 64 CPUs, but the largest node of the default partition has 2 (sinfo)"),
    (["--partition", "debug"], "a node would need 64 CPUs, but the largest node of partition debug has 2 (sinfo)"),
    (["--partition", "big"], "a node would need 64 CPUs, but the largest node of partition big has 8 (sinfo)"),
])  # fmt: skip
def test_more_cpus_per_task_than_any_node_has_is_refused_before_anything_is_queued(workdir, capsys, fake_slurm,
                                                                                      more, said):  # fmt: skip
    """Issue 49 §3: `--cpus-per-task 64` on 2-CPU nodes was queued and pended forever. The partition's node sizes
    (sinfo) are asked first; what no node can hold is one line, sbatch never runs, nothing is written. A request
    that fits a node of the partition named goes on."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    before = tree(workdir)
    code, err = sweep(capsys, str(path), "--cpus-per-task", "64", *more)
    assert code == 2 and err.startswith(f"lmledger sweep: error: --cpus-per-task 64: {said}, so the array would pend "
                                        "forever; ask for at most"), err  # fmt: skip
    assert err.endswith("or a partition with larger nodes; nothing was queued"), err
    assert not (fake_slurm / "argv").exists() and tree(workdir) == before
    assert sweep(capsys, str(path), "--cpus-per-task", "8", "--partition", "big")[0] == 1  # queued: its task never ran
    assert "--cpus-per-task=8" in sbatch_directives((fake_slurm / "submitted.sh").read_text())


def test_an_sbatch_refusal_leaves_nothing(workdir, capsys, fake_slurm):
    """sbatch refusing the array (a bad partition, time or memory) leaves no array-N.sh, tasks-N.json,
    experiment-N.yaml or sweep.json, and no folder the sweep made; in a results directory of an earlier
    submission, everything stays as it was."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN, {**PLAN, "num-gpus": 8}])
    os.environ["FAKE_SBATCH_REFUSE"] = "invalid partition specified: nope"
    code, err = sweep(capsys, str(path), "--out", "a/b/o", "--partition", "nope")
    assert not (workdir / "a").exists()
    assert code == 2 and err == ("lmledger sweep: error: sbatch refused the array: sbatch: error: invalid partition "
                                 "specified: nope; nothing was queued, and nothing was left behind"), err  # fmt: skip
    # An earlier submission (queued; its tasks left the queue without a result) ...
    os.environ["FAKE_SBATCH_REFUSE"] = ""
    (workdir / "o").mkdir()
    (workdir / "o" / "notes.txt").write_text("mine\n")
    code, _ = sweep(capsys, str(path), "--out", "o")
    assert code == 1 and (workdir / "o" / "slurm" / "array-1.sh").is_file()
    before = tree(workdir / "o")
    # ... then a refused one: the directory is as it was.
    os.environ["FAKE_SBATCH_REFUSE"] = "Requested time limit is invalid (missing or exceeds some limit)"
    code, err = sweep(capsys, str(path), "--out", "o", "--time", "99999")
    assert tree(workdir / "o") == before
    assert code == 2 and "Requested time limit is invalid" in err


# ------------------------------------------------------------- the experiment as submitted, and the real cause


def run_task(out: Path, index: int = 0) -> subprocess.CompletedProcess:
    """Task `index` of the newest array, as slurmd runs it: bash on the batch script, output to its SLURM log."""
    (script,) = sorted((out / "slurm").glob("array-*.sh"))[-1:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"SLURM_ARRAY_JOB_ID": JOB, "SLURM_ARRAY_TASK_ID": str(index)}
    log = out / "slurm" / "logs" / f"{JOB}_{index}.out"
    with open(log, "a") as f:
        return subprocess.run(["bash", str(script)], env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300)


def test_a_pending_task_runs_the_experiment_as_submitted(workdir, capsys, fake_slurm):
    """The experiment YAML edited while the tasks wait in the queue: they run the points they were queued for
    (a frozen copy, slurm/experiment-N.yaml), not the edited ones; before, they died of StopIteration."""
    path = write_experiment(workdir / "e.yaml", points=[{**PLAN, "num-gpus": 8}])
    code, _ = sweep(capsys, str(path), "--out", "o")  # queued; the stand-in squeue lists nothing, so it returns
    assert code == 1
    out = workdir / "o"
    (point,) = load_experiment(path).points
    submitted = path.read_bytes()
    write_experiment(path, points=[{**PLAN, "num-gpus": 16}])  # edited while the task is pending
    assert run_task(out).returncode == 0, (out / "slurm" / "logs" / f"{JOB}_0.out").read_text()
    status = json.loads((out / "points" / point.id / "status.json").read_text())
    assert status["status"] == "done" and status["output"]["num_gpus"] == 8, status
    assert (out / "slurm" / "experiment-1.yaml").read_bytes() == submitted


def test_a_task_that_dies_is_failed_with_the_cause_its_log_names(workdir, capsys, fake_slurm):
    """A task that leaves the queue without a result is failed with the last error line of its SLURM log (the
    task's own traceback, or SLURM's `slurmstepd: error:` line), not a guess at time limit or memory; one that
    cannot load its experiment says so in its status."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN, {**PLAN, "num-gpus": 8}])
    assert sweep(capsys, str(path), "--out", "o")[0] == 1
    out = workdir / "o"
    first, second = load_experiment(path).points
    # 1: the task dies before it can record anything (its record is gone): Python's last line, from the log.
    record = out / "slurm" / "tasks-1.json"
    kept = record.read_bytes()
    record.unlink()
    assert run_task(out, 0).returncode == 1
    result = ended_result(out, first)
    assert result.status == "failed" and f"SLURM task {JOB}_0 ended without a result: FileNotFoundError:" in (
        result.error
    ), result.error
    assert "tasks-1.json" in result.error and "time limit" not in result.error
    # 2: SLURM ended it (its line in the task's log).
    record.write_bytes(kept)
    log = out / "slurm" / "logs" / f"{JOB}_1.out"
    log.write_text(f"lmledger sweep: point {second.id} in SLURM task {JOB}_1 (restart 0)\nslurmstepd: error: *** JOB "
                   f"{JOB} ON n1 CANCELLED AT 2026-12-01T22:00:00 DUE TO PREEMPTION ***\n"
                   f"lmledger sweep: point {second.id} in SLURM task {JOB}_1 (restart 1)\nslurmstepd: error: *** JOB "
                   f"{JOB} ON n1 CANCELLED AT 2026-12-01T23:00:00 DUE TO TIME LIMIT ***\n")  # fmt: skip
    assert "DUE TO TIME LIMIT ***" in ended_result(out, second).error
    # a requeued task's log holds every start: the cause is the last start's, not an earlier one's
    with open(log, "a") as f:
        f.write(f"lmledger sweep: point {second.id} in SLURM task {JOB}_1 (restart 2)\n")
    assert "its log names no error" in ended_result(out, second).error
    # 3: the frozen experiment cannot be read: the task fails its point in one line, and the status says why.
    (out / "slurm" / "experiment-1.yaml").write_text("points: [")
    assert run_task(out, 1).returncode == 2
    result = ended_result(out, second)
    assert result.status == "failed" and result.error.startswith("the task could not start its point: "), result.error
    assert "experiment-1.yaml: not valid YAML" in result.error and "\n" not in result.error


# -------------------------------------------------------------------------------------- the real SLURM


def squeue_gone(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    return out.returncode != 0 or not out.stdout.strip()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--partition", "nope", "invalid partition"),
        ("--mem", "100T", "memory"),
        # sbatch read the quoted #SBATCH line back whole: its message quotes the value as given
        ("--partition", 'de bug;$(touch x) "#1', 'invalid partition specified: de bug;$(touch x) "#1'),
    ],
)
def test_real_sbatch_refusals_leave_nothing(workdir, capsys, slurm_cluster, flag, value, said):
    """sbatch refusing a bad partition or memory leaves no array-N.sh, tasks-N.json, experiment-N.yaml,
    sweep.json or folder behind."""
    path = write_experiment(workdir / "e.yaml", points=[PLAN])
    code, err = sweep(capsys, str(path), "--out", "a/o", flag, value)
    assert not (workdir / "a").exists()  # before: a/o/sweep.json, a/o/slurm/array-1.sh, tasks-1.json, logs/
    assert code == 2 and "\n" not in err and "sbatch refused the array" in err and said.lower() in err.lower(), err
    assert not (workdir / "x").exists()


def test_a_path_with_a_space_runs_under_real_slurm(workdir, capsys, slurm_cluster, monkeypatch):
    """A working directory and --out with a space, `;` and `$(...)`, and a --partition value sbatch must read back
    from a quoted #SBATCH line: the array runs and the point is done (before, `sbatch: error: Invalid
    directive`)."""
    odd = workdir / "my dir;$(touch x)"
    odd.mkdir()
    monkeypatch.chdir(odd)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    path = write_experiment(odd / "e.yaml", points=[PLAN])
    code, err = sweep(capsys, str(path), "--out", "out dir", "--partition", "debug", "--cpus-per-task", "1")
    out = odd / "out dir"
    assert code == 0, err
    (status,) = [json.loads(p.read_text()) for p in (out / "points").glob("*/status.json")]
    logs = list((out / "slurm" / "logs").glob("*.out"))
    assert code == 0 and status["status"] == "done", (err, status, [p.read_text() for p in logs])
    assert [p.name for p in logs] == [status["slurm_task"] + ".out"]
    assert not [p for p in workdir.rglob("x")]
