"""The GPU check (run through benchmarks/gpu_check.sh): matmul MFU per dtype; short training runs of cs336-medium
and cs336-small at ctx 1024 in each precision, eager and compiled, with tokens/s, MFU, HFU, the fit's predicted step
and predicted vs measured peak memory read back from the runs' TensorBoard events; what the GPU does with each class
of op and with the cs336 steps' own ops (gpu_ops.py); the step-time table; then the test suite's CUDA-only tests.

Each stage runs in its own process (a crash or OOM is recorded, the rest goes on) under one overall deadline, the
most important first. Full results go to OUT/gpu_check.json, OUT/gpu_ops.json and OUT/gpu_check.md; the short
table is printed last. `--dry-run` (or no CUDA device) runs every stage at toy size on the CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("cs336-medium", "cs336-small")  # the MFU goal is set for cs336-medium
# The training rows, (model, label, trainer precision, extra overrides), in the order they run, so a tight budget
# drops the least important: the MFU goal's row, then the eager row the GPU op model and the replay predict, then
# fp8, then the smaller model and the other variants. Per-block compile: one block graph, compiled once for all 24
# blocks, so compile time stays seconds rather than minutes whatever the depth. fp8 rows need torchao or
# transformer_engine and sm_89+.
ROWS = (
    ("cs336-medium", "bf16-mixed+compile", "bf16-mixed", ["--model.compile", "blocks"]),
    ("cs336-medium", "bf16-mixed", "bf16-mixed", []),
    ("cs336-medium", "fp8-torchao+compile", "bf16-true", ["--model.compile", "blocks", "--model.fp8", "torchao"]),
    ("cs336-medium", "fp8-te", "transformer-engine", []),
    ("cs336-small", "bf16-mixed", "bf16-mixed", []),
    ("cs336-small", "bf16-mixed+compile", "bf16-mixed", ["--model.compile", "blocks"]),
    ("cs336-medium", "bf16-true+compile", "bf16-true", ["--model.compile", "blocks"]),
    ("cs336-medium", "bf16-mixed+compile-whole-model", "bf16-mixed", ["--model.compile", "true"]),
)
FIRST_ROWS = 2  # run before the op measurements (gpu_ops.py) and the step-time table; the rest after them
TOY = [  # dry run: the same stages at a size a CPU runs in seconds
    "--model.config.d_model", "64", "--model.config.n_layers", "2", "--model.config.n_heads", "2",
    "--model.config.d_ff", "128", "--model.config.context_length", "64", "--data.batch_size", "4",
    "--trainer.accelerator", "cpu", "--model.compile", "false",
]  # fmt: skip


def run(cmd: list[str], timeout: float, log) -> tuple[int, str, str]:
    """(exit code, stdout + stderr, stdout) of `cmd`, killed after `timeout` seconds (exit 124)."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), cwd=os.getcwd())
        code, stdout, output = proc.returncode, proc.stdout, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        code, stdout, output = 124, partial, f"{partial}\ntimed out after {timeout:.0f} s"
    log.write(f"$ {' '.join(cmd)}\n# exit {code} after {time.perf_counter() - started:.1f} s\n{output}\n")
    log.flush()
    return code, output, stdout


def without_compile(extra: list[str]) -> list[str]:
    """`extra` less its `--model.compile VALUE` pair (TOY turns compile off in a dry run)."""
    out, skip = [], False
    for arg in extra:
        if not skip and arg != "--model.compile":
            out.append(arg)
        skip = arg == "--model.compile"
    return out


def json_in(stdout: str) -> dict | None:
    """The JSON object a `--json` command printed, whatever else came before or after it."""
    decoder, start = json.JSONDecoder(), stdout.find("{")
    while start >= 0:
        try:
            found = decoder.raw_decode(stdout, start)[0]
            if isinstance(found, dict):
                return found
        except ValueError:
            pass
        start = stdout.find("{", start + 1)
    return None


def last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def fp8_unavailable(precision: str, extra: list[str], dry: bool) -> str | None:
    if dry:
        return "fp8 needs a CUDA GPU (dry run)"
    import importlib.util

    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        return "fp8 needs sm_89+"
    if "torchao" in extra and importlib.util.find_spec("torchao") is None:
        return "torchao not installed"
    if precision == "transformer-engine" and importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine not installed"
    return None


def read_run(run_dir: Path, warmup_logs: int = 1) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def steady(tag: str) -> float | None:  # median of the logged values after the first
        if tag not in tags:
            return None
        values = [e.value for e in acc.Scalars(tag)]
        return statistics.median(values[warmup_logs:] or values)

    def last(tag: str) -> float | None:
        return acc.Scalars(tag)[-1].value if tag in tags else None

    return {
        "tokens_per_sec": steady("perf/tokens_per_sec"),
        "tflops": steady("perf/tflops"),
        "mfu": steady("perf/mfu"),
        "hfu": steady("perf/hfu"),
        "data_wait_frac": steady("perf/data_wait_frac"),
        "compile_speedup": last("perf/compile_speedup"),
        "train_loss": last("train/loss"),
        "peak_predicted": last("memory/predicted/peak"),
        "peak_measured": last("memory/measured/peak"),
        "activations_predicted": last("memory/predicted/activations"),
        "activations_measured": last("memory/measured/activations"),
        "reserved_measured": last("memory/measured/reserved"),
        "step_predicted_s": last("time/predicted/total"),
        "scalars": {tag: last(tag) for tag in sorted(tags) if tag.startswith(("memory/", "time/", "ledger/"))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage at toy size on the CPU")
    parser.add_argument("--out", help="results directory (default $OUT, else benchmarks/results/DATE-GPU)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all stages together")
    parser.add_argument("--stage-timeout", type=float, default=180.0, help="seconds at most for one training row")
    parser.add_argument(
        "--reserve-tests", type=float, default=90.0, help="seconds of the budget kept for the CUDA-only tests"
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ops-budget", type=float, default=120.0, help="seconds for gpu_ops.py")
    args = parser.parse_args()

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    slug = "cpu-dry" if dry else device.lower().replace("nvidia", "").strip().replace(" ", "-")
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results" / f"{dt.date.today()}-{slug}")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    cli = [sys.executable, "-m", "lmledger.cli"]
    results: dict = {"date": dt.date.today().isoformat(), "device": device, "dry_run": dry, "stages": []}
    log = open(out / "gpu_check.log", "w")

    # (a) matmul MFU per dtype
    dtypes, sizes = ("fp32,bf16", "128,256") if dry else ("fp32,tf32,bf16,fp8", "4096,8192")
    code, output, stdout = run([*cli, "bench", "matmul", "--dtypes", dtypes, "--sizes", sizes, "--json"], 120, log)
    bench = json_in(stdout) if code == 0 else None
    results["matmul"] = bench if bench is not None else {"error": last_error_line(output) or f"exit {code}"}

    # data: the cs336 configs read BPE 10k tokens; the dry run makes do with bytes. Configs and data are
    # found from the checkout (REPO), not the working directory, so the script runs from anywhere.
    data = REPO / "data" / "stdlib-bpe10k" if not dry else out / "data-bytes"
    if not (data / "meta.json").is_file():
        prepare = ["--tokenizer", "bpe", "--vocab-size", "10000"] if not dry else []
        code, output, _ = run([*cli, "prepare", *prepare, "--out", str(data)], 240, log)
        if code != 0:
            results["error"] = f"prepare failed: {last_error_line(output)}"

    # (b) short training runs, (c) the op measurements and (d) the step-time table between the first rows and the rest
    models = args.models.split(",")
    rows = [row for row in ROWS if row[0] in models]
    toy_fits: dict[tuple, str] = {}  # dry run: each distinct toy fit (TOY sets every model's size) -> its stage
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "lmledger-gpu-check-runs"  # event files: read, not returned

    def fit_row(model: str, label: str, precision: str, extra: list[str]) -> None:
        compiled = "--model.compile" in extra and not dry
        stage = {"model": model, "variant": label, "precision": precision, "compiled": compiled}
        results["stages"].append(stage)
        reason = fp8_unavailable(precision, extra, dry) if ("fp8" in label) else None
        if dry and not reason:  # the same toy fit again would test nothing new: run each once
            first = toy_fits.setdefault((precision, *without_compile(extra)), f"{model} {label}")
            reason = None if first == f"{model} {label}" else f"dry run: the same toy fit as {first}"
        left = deadline - args.reserve_tests - time.monotonic()
        if reason or left < 30 or "error" in results:
            stage["skipped"] = reason or results.get("error") or "out of time"
            return
        name = f"{model}-{label}"
        cmd = [
            *cli, "fit", "--config", str(REPO / "configs" / f"{model}.yaml"),
            "--trainer.precision", precision, *extra,
            "--data.path", str(data), "--data.num_workers", "2",
            "--trainer.max_steps", str(args.steps if not dry else 6),
            "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "5" if not dry else "2",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_progress_bar", "false",  # the log stays readable
            "--trainer.logger.init_args.save_dir", str(scratch),
            "--trainer.logger.init_args.name", name,
            *(TOY if dry else []),
        ]  # fmt: skip
        started = time.monotonic()
        code, output, _ = run(cmd, min(left, args.stage_timeout), log)
        stage["seconds"] = round(time.monotonic() - started, 1)
        stage["lines"] = [line for line in output.splitlines() if line.startswith(("ledger:", "step "))][-12:]
        if code != 0:
            stage["error"] = last_error_line(output)
            return
        versions = sorted((scratch / name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
        stage.update(read_run(versions[-1]))

    for row in rows[:FIRST_ROWS]:
        fit_row(*row)

    # (c) what the GPU does with each class of op, and the dry run's ops of the cs336 steps replayed on it
    left = deadline - args.reserve_tests - time.monotonic()
    if left < 60:
        results["ops"] = {"skipped": "out of time"}
    else:
        budget = min(args.ops_budget, left - 30)
        ops_json = out / "gpu_ops.json"
        cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_ops.py"), "--out", str(ops_json),
               "--budget", str(budget), *(["--dry-run"] if dry else [])]  # fmt: skip
        code, output, _ = run(cmd, budget + 60, log)
        results["ops"] = {"exit": code, "file": ops_json.name, "summary": last_error_line(output)}

    # (d) the step-time table (docs/time.md): the roofline bound of the first model's step beside three profiled
    # steps, kernel time per category, and the step predicted by the replay on this GPU, from `lmledger account
    # --measure` (bf16-mixed, eager).
    left = deadline - args.reserve_tests - time.monotonic()
    if left < 30:
        results["time"] = {"skipped": "out of time"}
    else:
        config = str(REPO / "configs" / f"{models[0]}.yaml")
        cmd = [*cli, "account", "--config", config, "--data.path", str(data), "--measure", "--json"]
        cmd += TOY if dry else []
        code, output, stdout = run(cmd, min(left, 150), log)
        found = json_in(stdout) if code == 0 else None
        time_table = (found or {}).get("time")
        results["time"] = (
            {"model": models[0], **time_table} if time_table else {"error": last_error_line(output) or f"exit {code}"}
        )
        if found:
            results["account"] = {k: found.get(k) for k in ("memory", "flops", "mfu_conventions", "run")}

    for row in rows[FIRST_ROWS:]:
        fit_row(*row)

    # (e) the tests that need CUDA: allocator peaks and saved activations against the ledger, the matmul
    # benchmark in every dtype, and no host sync in a steady-state training step. Last, in the time kept for them.
    left = deadline - time.monotonic()
    if left < 30:
        results["cuda_tests"] = {"skipped": "out of time"}
    else:
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", str(REPO / "tests")]
        code, output, _ = run(pytest, left, log)
        results["cuda_tests"] = {"exit": code, "summary": last_error_line(output),
                                 "lines": [ln for ln in output.splitlines() if "PASS" in ln or "FAIL" in ln
                                           or "SKIP" in ln or "ERROR" in ln][-30:]}  # fmt: skip

    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    table = summary_table(results)
    (out / "gpu_check.md").write_text(table + "\n")
    log.close()
    print(f"full results: {out}/gpu_check.json, log: {out}/gpu_check.log\n")
    print(table)
    return 0


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def summary_table(results: dict) -> str:
    lines = [f"GPU check {results['date']} on {results['device']}", ""]
    lines += ["| matmul | size | TFLOP/s | MFU | note |", "|---|---|---|---|---|"]
    for row in results.get("matmul", {}).get("results", []):
        lines.append(
            f"| {row['dtype']} | {row['size']} | {_fmt(row.get('flops_per_s') and row['flops_per_s'] / 1e12, '.1f')} "
            f"| {_fmt(row.get('mfu'), '.3f')} | {row.get('note') or ''}"
        )
    if "error" in results.get("matmul", {}):
        lines.append(f"| matmul failed: {results['matmul']['error']} | | | | |")
    columns = ["model", "variant", "tokens/s", "MFU", "HFU", "compile speedup", "peak predicted GB", "peak measured GB"]
    lines += ["", "| " + " | ".join([*columns, "note"]) + " |", "|" + "---|" * (len(columns) + 1)]
    for s in results["stages"]:
        gb = lambda b: None if b is None else b / 1e9  # noqa: E731
        note = s.get("skipped") or s.get("error") or f"{s.get('seconds')} s"
        if s.get("compiled") and s.get("peak_predicted") is not None:
            note += "; predicted peak is the eager model's"
        lines.append(
            f"| {s['model']} | {s['variant']} | {_fmt(s.get('tokens_per_sec'), ',.0f')} | {_fmt(s.get('mfu'), '.3f')} "
            f"| {_fmt(s.get('hfu'), '.3f')} | {_fmt(s.get('compile_speedup'), '.2f')} "
            f"| {_fmt(gb(s.get('peak_predicted')), '.2f')} "
            f"| {_fmt(gb(s.get('peak_measured')), '.2f')} | {note} |"
        )
    timing = results.get("time", {})
    if "table" in timing:
        lines += ["", f"Step-time table ({timing['model']}, bf16-mixed eager, `lmledger account --measure`):", "",
                  "```", timing["table"], "```"]  # fmt: skip
    elif timing:
        lines += ["", f"Step-time table: {timing.get('skipped') or timing.get('error')}"]
    tests = results.get("cuda_tests", {})
    lines += ["", f"CUDA-only tests (pytest -m cuda): {tests.get('skipped') or tests.get('summary')}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
