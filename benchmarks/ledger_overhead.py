"""What keeping the ledger costs: median training-step time with the ledger callbacks over without.

Runs the same short fit of a config (default configs/tiny.yaml, on this machine's default device)
again and again in one process, alternating with and without `ledger_callbacks(LedgerSettings())`
(for a config whose model is a class_path, e.g. configs/examples/hf-llama.yaml: with and without
`lmledger.callbacks.Ledger()`, its dry run and measured steps) in ABBA order, so a drift in
machine load falls on both arms alike. A step is the time from one training batch's end to the next
one's (everything the loop does per batch, the ledger's hooks included); each fit's first `--skip`
steps are left out: they hold the ledger's memory measurement and its throughput warm-up, one-off
costs the ratio is not about. Goal: ratio <= 1.01.

Step times on a shared machine jitter by more than the ledger costs, so the script also clocks
the ledger's hooks themselves in the "with" fits: their median time per step over the median step
without the ledger is the direct cost, which noise cannot hide or inflate.

    python benchmarks/ledger_overhead.py [--pairs 4] [--steps 30] [--threads 1] [--config configs/tiny.yaml]
    python benchmarks/ledger_overhead.py --config configs/examples/hf-llama.yaml   # a Hugging Face Llama
    python benchmarks/ledger_overhead.py --quick [--config ...]                    # checks the script runs

On 2 CPU cores the default takes about 1-2 minutes. Validation and checkpointing are off in both
arms; the logger (TensorBoard, every trainer.log_every_n_steps) is on in both. One intra-op thread
by default: with two on two busy cores, a step can stall for a whole scheduler slice.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from _common import prepared_corpus
from lightning.pytorch.loggers import TensorBoardLogger

from lmledger.callbacks import Ledger, LedgerSettings, ledger_callbacks
from lmledger.data import TokenDataModule
from lmledger.lit import LitLM
from lmledger.model import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` lives at the repository root


class StepTimes(L.Callback):
    """perf_counter at each training batch's end; placed last, so every other hook is inside a step.
    Also the running total of `hook_seconds` there, so each step's time inside the ledger's hooks."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.hook_totals: list[float] = []
        self.hook_seconds = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())
        self.hook_totals.append(self.hook_seconds)

    def steps(self, skip: int) -> list[float]:
        return _diffs(self.ends[skip:])

    def cpu_steps(self, skip: int) -> list[float]:
        return _diffs(self.cpu_ends[skip:])

    def hook_steps(self, skip: int) -> list[float]:
        return _diffs(self.hook_totals[skip:])


def _diffs(values: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(values)]


def clock_hooks(callbacks: list[L.Callback], timer: StepTimes) -> None:
    """Wrap every hook the callbacks override so its time adds to timer.hook_seconds."""
    for callback in callbacks:
        for name in dir(L.Callback):
            if name.startswith("on_") and getattr(type(callback), name) is not getattr(L.Callback, name):
                setattr(callback, name, _clocked(getattr(callback, name), timer))


def _clocked(hook, timer: StepTimes):
    def clocked(*args, **kwargs):
        start = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            timer.hook_seconds += time.perf_counter() - start

    return clocked


def _any_model(model_cfg: dict, data_cfg: dict, data: str) -> tuple[L.LightningModule, TokenDataModule]:
    """A config whose model is a class_path (configs/examples/): that class with its init_args, on token data."""
    module_name, _, name = model_cfg["class_path"].rpartition(".")
    model = getattr(importlib.import_module(module_name), name)(**model_cfg.get("init_args", {}))
    init = data_cfg.get("init_args", {})
    datamodule = TokenDataModule(
        path=data, batch_size=init.get("batch_size", 16), context_length=init.get("context_length", 128)
    )
    return model, datamodule


def timed_fit(config: dict, data: str, steps: int, ledger: bool, log_dir: Path) -> StepTimes:
    trainer_cfg = config.get("trainer", {})
    model_cfg = config.get("model", {})
    L.seed_everything(config.get("seed_everything", 1234), verbose=False)
    any_model = "class_path" in model_cfg
    if any_model:
        model, datamodule = _any_model(model_cfg, config.get("data", {}), data)
    else:
        datamodule = TokenDataModule(
            path=data,
            batch_size=config.get("data", {}).get("batch_size", 16),
            context_length=model_cfg["config"]["context_length"],
        )
        model = LitLM(
            ModelConfig(**{**model_cfg["config"], "vocab_size": datamodule.vocab_size}),
            optimizer=model_cfg.get("optimizer", "adamw"),
            lr=model_cfg.get("lr", 3e-3),
        )
    timer = StepTimes()
    if not ledger:
        ledger_cbs = []
    else:
        ledger_cbs = [Ledger()] if any_model else ledger_callbacks(LedgerSettings())
    clock_hooks(ledger_cbs, timer)
    trainer = L.Trainer(
        accelerator=trainer_cfg.get("accelerator", "auto"),
        devices=1,
        precision=trainer_cfg.get("precision", "32-true"),
        max_steps=steps,
        gradient_clip_val=trainer_cfg.get("gradient_clip_val"),
        log_every_n_steps=trainer_cfg.get("log_every_n_steps", 10),
        logger=TensorBoardLogger(str(log_dir), name="with" if ledger else "without"),
        callbacks=[*ledger_cbs, timer],
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule)
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--data", default=None, help="prepared data dir (default: the config's data.path)")
    parser.add_argument("--pairs", type=int, default=4, help="fits per arm")
    parser.add_argument("--steps", type=int, default=30, help="training steps per fit")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--skip", type=int, default=5, help="first steps of each fit left out")
    parser.add_argument("--quick", action="store_true", help="1 pair of 8-step fits: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps = 1, args.skip + 3
    if args.steps < args.skip + 2:
        parser.error("--steps must exceed --skip by at least 2")
    config = yaml.safe_load(Path(args.config).read_text())
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        data_cfg = config.get("data", {})
        data_path = data_cfg.get("init_args", data_cfg).get("path", "data/stdlib")
        data = prepared_corpus(args.data or data_path, Path(scratch))
        times: dict[bool, list[float]] = {False: [], True: []}
        hook_times: list[float] = []
        cpu_times: dict[bool, list[float]] = {False: [], True: []}
        per_pair = []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)  # ABBA
            medians = {}
            for ledger in order:
                timer = timed_fit(config, data, args.steps, ledger, Path(scratch) / "runs")
                steps = timer.steps(args.skip)
                times[ledger] += steps
                medians[ledger] = statistics.median(steps)
                cpu_times[ledger] += timer.cpu_steps(args.skip)
                if ledger:
                    hook_times += timer.hook_steps(args.skip)
            per_pair.append(medians[True] / medians[False])
            print(f"pair {pair + 1}/{args.pairs}: without {medians[False] * 1e3:.1f} ms, "
                  f"with {medians[True] * 1e3:.1f} ms, ratio {per_pair[-1]:.3f}", flush=True)  # fmt: skip

    without, with_ledger = statistics.median(times[False]), statistics.median(times[True])
    ratio = with_ledger / without
    print(
        f"\n{args.config}: median step {without * 1e3:.2f} ms without the ledger, {with_ledger * 1e3:.2f} ms "
        f"with it, over {len(times[False])} and {len(times[True])} steps after the first {args.skip} of each fit"
    )
    print(f"median step-time ratio (with / without): {ratio:.4f}  (goal <= 1.01; "
          f"per-pair ratios {min(per_pair):.3f}..{max(per_pair):.3f})")  # fmt: skip
    cpu_ratio = statistics.median(cpu_times[True]) / statistics.median(cpu_times[False])
    print(f"median step CPU-time ratio (main thread): {cpu_ratio:.4f}")
    hooks, worst = statistics.median(hook_times), max(hook_times)
    print(f"time inside the ledger's hooks: median {hooks * 1e6:.0f} us per step (worst {worst * 1e3:.2f} ms, "
          f"a logging step), i.e. a direct cost ratio of {1 + hooks / without:.4f} "
          f"(mean over steps {1 + statistics.fmean(hook_times) / without:.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
