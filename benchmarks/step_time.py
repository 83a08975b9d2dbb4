"""The predicted step time beside the measured one, per case (issue 29): `lmledger fit` of each case for
enough steps to be steady, reading the line the Ledger prints at fit end:

    step 85.2 ms predicted, 83.1 ms measured (measured/predicted 0.975; over 40 batches)

Predicted: before step 1, from the dry run's ops replayed here (ledger/timing/steptime). Measured: the mean
per optimizer step of the fit's throughput windows (warm-up, profiled steps and validation left out).
It prints predicted, measured and error per case, then the median and worst |error|. The step-time cache
is a fresh one per run of this script (shared by its cases), so the figures are this machine's now.

Identical fits on this 2-core VM differ by up to +-9% a step, and the VM's speed drifts over minutes
(docs/time.md), so each case is fitted `--repeats` times, and each fit predicts afresh: the cache's op times
are dropped before it (its calibrations kept: Lightning's loop, the per-op overhead, the optimizer, gloo), so
its ops are replayed just before its own steps run. A case's error is the median of its fits' errors; the
table shows the medians of predicted and measured, the measured spread, and the load over the case.

    .venv/bin/python benchmarks/step_time.py                    # every case, 3 fits each (~28 min, idle 2-core CPU)
    .venv/bin/python benchmarks/step_time.py --cases tiny,tiny-ac --steps 40
    .venv/bin/python benchmarks/step_time.py --write            # also atop benchmarks/results/step-time-DATE.md

Timing needs an idle machine: the table shows the load average over each case, and "others busy", the most
any of its fits saw other processes take of the CPUs during its measured steps (the Ledger's own line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY = "configs/tiny.yaml"
CASES: dict[str, list[str]] = {
    "tiny": ["--config", TOY],
    "tiny-ac": ["--config", TOY, "--model.config.activation_checkpointing", "1"],
    "tiny-bf16": ["--config", TOY, "--trainer.precision", "bf16-mixed"],
    "tiny-accum4": ["--config", TOY, "--trainer.accumulate_grad_batches", "4"],
    "wide-lm": ["--config", TOY, "--model.config.d_model", "512", "--model.config.n_heads", "8",
                "--model.config.d_ff", "1536", "--model.config.context_length", "256", "--data.batch_size", "8"],
    "hf-llama": ["--config", "configs/examples/hf-llama.yaml"],
    "hf-gpt2": ["--config", "configs/examples/hf-gpt2.yaml"],
    "hf-bert": ["--config", "configs/examples/hf-bert.yaml"],
    "hf-t5": ["--config", "configs/examples/hf-t5.yaml"],
    "convnet": ["--config", "configs/examples/byte-convnet.yaml"],
    "tiny-ddp2": ["--config", TOY, "--trainer.devices", "2", "--trainer.strategy", "ddp"],
    # Issue 50's cases, none tuned on: sharded steps, a longer context, a module that shards itself.
    "tiny-ctx512": ["--config", TOY, "--model.config.d_model", "192", "--model.config.n_heads", "6",
                    "--model.config.d_ff", "512", "--model.config.context_length", "512", "--data.batch_size", "4"],
    "tiny-fsdp2": ["--config", TOY, "--trainer.devices", "2", "--trainer.strategy", "fsdp2"],
    "tiny-tp2": ["--config", TOY, "--trainer.devices", "2", "--trainer.strategy", "lmledger.strategies.FSDP2Strategy",
                 "--trainer.strategy.tensor_parallel_size", "2"],
    "tiny-ddp2-accum2": ["--config", TOY, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                         "--trainer.accumulate_grad_batches", "2"],
    "tiny-fsdp2-accum2": ["--config", TOY, "--trainer.devices", "2", "--trainer.strategy", "fsdp2",
                          "--trainer.accumulate_grad_batches", "2"],
    "hf-llama-tp": ["--config", "configs/examples/hf-llama-tp.yaml", "--trainer.devices", "2"],
}  # fmt: skip
_LINE = re.compile(r"step ([0-9.e+]+) ms predicted, ([0-9.e+]+) ms measured")
_PREDICTED = re.compile(r"step time predicted .*")
_OTHERS = re.compile(r"other processes busy (\d+)% of the CPUs")


def _data(work: Path) -> Path:
    """The prepared stdlib corpus: the repository's if there, else prepared once into `work`."""
    if (REPO / "data/stdlib/train.bin").exists():
        return REPO / "data/stdlib"
    out = work / "data/stdlib"
    lmledger = [sys.executable, "-m", "lmledger.cli"]
    subprocess.run([*lmledger, "prepare", "--out", str(out)], check=True, capture_output=True, cwd=REPO)
    return out


# A multi-rank fit takes its collectives' and Lightning loop's calibrations from the cache only (one
# rank's minutes in a calibration would time out the others' first collective), so they are made here
# first, at the thread count its ranks run with (Lightning gives each of W ranks cores / W threads).
_PREWARM = """
import os, torch
torch.set_num_threads(max(1, os.cpu_count() // {world}))
from lmledger.callbacks.steptime import lightning_loop_seconds
from lmledger.ledger.timing.steptime.cache import StepTimeCache
from lmledger.ledger.timing.steptime.calibrate import collective_model
from lmledger.ledger.timing.steptime.fsdp2 import fsdp2_collective_s
from lmledger.ledger.timing.steptime.rankwait import rank_wait
cache = StepTimeCache(torch.device("cpu"), ranks={world})
collective_model({world}, cache)
fsdp2_collective_s({world}, cache)
rank_wait({world}, cache)
cache.save()
lightning_loop_seconds(progress_bar=False, logger=True, log_every_n_steps=10)
"""


def prewarm(world: int, env: dict) -> None:
    code = _PREWARM.format(world=world)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, capture_output=True, timeout=600)


def run_case(
    name: str, steps: int, data: Path, work: Path, env: dict, logs: Path | None = None, repeats: int = 1
) -> dict:
    """The case fitted `repeats` times: the first fit's prediction, the median of the fits' measured steps."""
    fits = []
    for i in range(repeats):
        _drop_op_times(Path(env["LMLEDGER_CACHE_DIR"]))
        fits.append(_fit(name, steps, data, work, env, logs, i))
    row = dict(fits[0])
    row["wall_s"] = sum(f["wall_s"] for f in fits)
    row["load"] = (fits[0]["load"][0], fits[-1]["load"][1])
    measured = [f["measured_ms"] for f in fits if "measured_ms" in f]
    if "predicted_ms" not in row or len(measured) < repeats:
        row.pop("predicted_ms", None)
        row["error"] = next((f["error"] for f in fits if "error" in f), "a fit printed no measured step")
        return row
    row["predicted_ms"] = statistics.median(f["predicted_ms"] for f in fits)
    row["measured_ms"], row["spread"] = statistics.median(measured), (min(measured), max(measured))
    shares = [f["others_pct"] for f in fits if f.get("others_pct") is not None]
    row["others_pct"] = max(shares) if shares else None
    row["error_pct"] = statistics.median(100 * (f["predicted_ms"] - f["measured_ms"]) / f["measured_ms"] for f in fits)
    return row


def _drop_op_times(cache: Path) -> None:
    """The step-time cache less its op times (and the busy-machine mark they carry); calibrations stay."""
    from lmledger.ledger.timing.steptime.cache import STEP_TIMES_FILE
    from lmledger.ledger.timing.steptime.predict import BUSY_CALIBRATION

    path = cache / STEP_TIMES_FILE
    if not path.exists():
        return
    entries = json.loads(path.read_text())
    for entry in entries.values():
        entry["ops"] = {}
        entry.get("calibrations", {}).pop(BUSY_CALIBRATION, None)
    path.write_text(json.dumps(entries))


def _fit(name: str, steps: int, data: Path, work: Path, env: dict, logs: Path | None, index: int) -> dict:
    args = CASES[name]
    toy = args[1] == TOY
    command = [
        sys.executable, "-m", "lmledger.cli", "fit", *args, "--trainer.max_steps", str(steps),
        "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
        "--trainer.logger.init_args.save_dir", str(work / "runs"), "--ledger.profile_every", "0",
        "--data.path" if toy else "--data.init_args.path", str(data),
    ]  # fmt: skip
    started, load = time.perf_counter(), os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    text = done.stdout + done.stderr
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name}{'' if index == 0 else f'-{index + 1}'}.log").write_text(text)
    found = _LINE.search(text)
    row = {"case": name, "wall_s": time.perf_counter() - started, "rc": done.returncode,
           "load": (load, os.getloadavg()[0])}  # fmt: skip
    predicted_line = _PREDICTED.search(text)
    row["line"] = predicted_line.group(0) if predicted_line else ""
    if found is None:
        row["error"] = (text.strip().splitlines() or ["no output"])[-1][:200]
        return row
    row["predicted_ms"], row["measured_ms"] = float(found.group(1)), float(found.group(2))
    others = _OTHERS.search(text)
    row["others_pct"] = int(others.group(1)) if others else None
    return row


def table(rows: list[dict]) -> str:
    head = ("| case | predicted ms | measured ms (median) | measured spread | error | load avg | others busy | "
            "fit wall s |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        load = f"{r['load'][0]:.2f}-{r['load'][1]:.2f}"
        others = f"{r['others_pct']}%" if r.get("others_pct") is not None else "—"
        if "error_pct" in r:
            spread = f"{r['spread'][0]:.1f}-{r['spread'][1]:.1f}"
            lines.append(f"| {r['case']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {spread} | "
                         f"{r['error_pct']:+.1f}% | {load} | {others} | {r['wall_s']:.0f} |")  # fmt: skip
        else:
            lines.append(f"| {r['case']} | — | — | — | failed: {r.get('error', '')} | {load} | {others} | "
                         f"{r['wall_s']:.0f} |")  # fmt: skip
    errors = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
    if errors:
        worst = max((r for r in rows if "error_pct" in r), key=lambda r: abs(r["error_pct"]))
        lines.append(f"\nmedian |error| {statistics.median(errors):.1f}%, worst {abs(worst['error_pct']):.1f}% "
                     f"({worst['case']}), over {len(errors)} cases")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per fit (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="fits per case; measured is their median (default 3)")
    parser.add_argument("--cache", help="a step-time cache directory to keep (default: a fresh one)")
    parser.add_argument("--write", action="store_true", help="add the table atop benchmarks/results/step-time-DATE.md")
    parser.add_argument("--logs", help="keep each case's fit output in this directory (its step-time table)")
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if args.repeats < 1 or args.steps < 10:
        parser.error("--repeats takes 1 or more and --steps 10 or more (the first steps are warm-up)")
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: pick from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "LMLEDGER_CACHE_DIR": args.cache or str(work / "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
        data = _data(work)
        load_before = os.getloadavg()
        rows = []
        for name in names:
            if "--trainer.devices" in CASES[name]:
                prewarm(int(CASES[name][CASES[name].index("--trainer.devices") + 1]), env)
            row = run_case(name, args.steps, data, work, env, Path(args.logs) if args.logs else None, args.repeats)
            rows.append(row)
            shown = f"{row['error_pct']:+.1f}%" if "error_pct" in row else f"failed: {row.get('error')}"
            print(f"{name}: {shown}  ({row['wall_s']:.0f} s)  {row['line']}", flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    header = (
        f"step time predicted beside measured, {when}, {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs); load average {load_before[0]:.2f} before, {load[0]:.2f} after; "
        f"{args.steps} steps per fit, {args.repeats} fits per case"
    )
    text = header + "\n\n" + table(rows)
    print("\n" + text)
    if args.write:
        out = REPO / "benchmarks/results" / f"step-time-{when[:10]}.md"
        write_result(text, out)
        print(f"written: {out}")
    return 0


def write_result(text: str, out: Path) -> None:
    """This run at the top of the day's results file, the runs already in it kept below, newest first (a second
    run of the day once replaced the first's tables); written whole or not at all."""
    from lmledger.atomic import atomic_write

    earlier = out.read_text() if out.exists() else ""
    atomic_write(out, text + "\n" + (f"\n{earlier}" if earlier else ""))


if __name__ == "__main__":
    sys.exit(main())
