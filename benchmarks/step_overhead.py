"""Our own overhead: `lmledger fit` against a nanoGPT-style bare PyTorch loop, same step.

Both arms train the same ToyLM of a config (default configs/tiny.yaml: model, batch, data, fused
AdamW with LitLM's two weight-decay groups, warm-up + cosine LR, gradient clipping at the config's
value) for `--steps` steps, alternating in ABBA order in one process so a drift in machine load falls
on both alike. tokens/s is counted from each arm's own step-end clock, after `--skip` steps (the fit's
dry run, preflight and first-step allocations are one-off costs, not per-step overhead); validation
inside the fit is paused out of its clock. The fit runs through `lmledger.cli.main(["fit", ...])`
with the ledger on, as a user runs it (checkpoints as configured, the time ledger's sampled profiled
steps included; --time-ledger adds an arm without them).

With --explain, one more step of each arm is profiled (ledger/timing/profile.py) and their breakdowns are
printed side by side: the ops take the same time in both, so the difference lands in "host overhead /
idle" (Lightning's loop, logging, the LR schedule, the per-step checks), which is where the gap is.

    python benchmarks/step_overhead.py [--rounds 4] [--steps 300] [--threads 2] [--config configs/tiny.yaml]
    python benchmarks/step_overhead.py --time-ledger --steps 600   # and TimeLedger's share of a 600-step fit
    python benchmarks/step_overhead.py --quick        # checks the script runs (1 round of 20 steps)

Goal: ratio (fit / bare tokens/s) >= 0.98. Timings are meaningless on a busy machine: run
it when nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import yaml
from _common import prepared_corpus

REPO = Path(__file__).resolve().parents[1]


class ValidationPaused(L.Callback):
    """A fit callback whose clock stops over validation: `self._paused` is the seconds spent there."""

    def __init__(self) -> None:
        self._paused_at: float | None = None
        self._paused = 0.0

    def on_validation_start(self, trainer, pl_module) -> None:
        self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None


class StepClock(ValidationPaused):
    """perf_counter at each training batch's end, with validation paused out."""

    ends: list[float] = []  # class-level: the CLI builds its own instance, the script reads it here

    def __init__(self) -> None:
        super().__init__()
        StepClock.ends = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        StepClock.ends.append(time.perf_counter() - self._paused)


def tokens_per_sec(ends: list[float], tokens_per_step: int, skip: int) -> float:
    steps = ends[skip:]
    return tokens_per_step * (len(steps) - 1) / (steps[-1] - steps[0])


def bare_loop(config: dict, data: str, steps: int, explain: bool = False) -> tuple[list[float], object]:
    """nanoGPT's train.py loop on the config's ToyLM: forward, backward, clip, step, zero_grad, LR by hand."""
    step, ends = bare_stepper(config, data, steps)
    for _ in range(steps):
        step()
        ends.append(time.perf_counter())
    breakdown = None
    if explain:
        from lmledger.ledger.timing.profile import profile_step

        breakdown = profile_step(step, torch.device("cpu"))
    return ends, breakdown


def bare_stepper(config: dict, data: str, steps: int):
    """The bare loop's step function, and the list of step ends its LR schedule counts."""
    from lmledger.data import TokenDataModule
    from lmledger.lit import warmup_cosine
    from lmledger.model import ModelConfig, ToyLM

    model_cfg, data_cfg = config["model"], config.get("data", {})
    datamodule = TokenDataModule(
        path=data, batch_size=data_cfg.get("batch_size", 16), context_length=model_cfg["config"]["context_length"]
    )
    datamodule.setup("fit")
    L.seed_everything(config.get("seed_everything", 1234), verbose=False)
    model = ToyLM(ModelConfig(**{**model_cfg["config"], "vocab_size": datamodule.vocab_size}))
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2 and p is not model.embed.weight]
    no_decay = [p for p in params if not any(p is q for q in decay)]
    lr = model_cfg.get("lr", 3e-3)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": model_cfg.get("weight_decay", 0.1)},
         {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    clip = config.get("trainer", {}).get("gradient_clip_val")
    warmup, min_ratio = model_cfg.get("warmup_steps", 50), model_cfg.get("min_lr_ratio", 0.1)
    batches = iter(datamodule.train_dataloader())
    ends = []
    model.train()

    def step(phase=lambda name: None) -> None:
        x, y = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_cosine(len(ends), warmup, max(steps, warmup + 1), min_ratio)
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        phase("optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, ends


class Paired(ValidationPaused):
    """Blocks of `block` fit batches, each followed by `block` bare-loop steps in the same process.

    Each pair is timed a few seconds apart, so machine drift (±5% between 100-step stretches of one
    arm on this shared CPU) falls on both alike. A fit block's clock pauses over validation."""

    step = None  # the bare loop's step function (set by paired())
    block, skip = 20, 10
    ratios: list[float] = []  # per pair: bare seconds / fit seconds = fit tokens/s / bare tokens/s

    def __init__(self) -> None:
        super().__init__()
        Paired.ratios = []
        self._batches, self._start = 0, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batches += 1
        if self._batches < Paired.skip or (self._batches - Paired.skip) % Paired.block:
            return
        if self._start is not None:
            fit_s = time.perf_counter() - self._start - self._paused
            began = time.perf_counter()
            for _ in range(Paired.block):
                Paired.step()
            Paired.ratios.append((time.perf_counter() - began) / fit_s)
        self._start, self._paused = time.perf_counter(), 0.0


def paired(config: dict, config_path: str, data: str, steps: int, scratch: Path) -> list[float]:
    """One fit of `steps` batches with Paired: the fit / bare tokens/s ratio of each block pair."""
    Paired.step, _ = bare_stepper(config, data, steps)
    lmledger_fit(config_path, data, steps, scratch, extra=["--trainer.callbacks+=__main__.Paired"])
    return list(Paired.ratios)


@contextlib.contextmanager
def time_ledgers() -> Iterator[list]:
    """The TimeLedgers the fits inside build (the CLI makes its own)."""
    from lmledger.callbacks import timing

    captured: list[timing.TimeLedger] = []
    original = timing.TimeLedger.__init__

    def keep(self, *a, **kw) -> None:
        original(self, *a, **kw)
        captured.append(self)

    timing.TimeLedger.__init__ = keep
    try:
        yield captured
    finally:
        timing.TimeLedger.__init__ = original


def profiling_share(ends: list[float], ledger) -> float:
    """The profiled batches' time beyond the median batch's, as a share of the fit's batch time.

    The profiler stops after StepClock reads its clock, so a profiled batch's cost lands in the next."""
    durations = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]  # durations[i]: batch i + 1
    median = statistics.median(durations)
    charged = {n + j for n in range(len(ends)) if ledger.is_profiling_step(n) for j in (0, 1)}
    excess = sum(durations[i - 1] - median for i in charged if 1 <= i <= len(durations))
    return excess / (ends[-1] - ends[0])


def lmledger_fit(
    config_path: str, data: str, steps: int, scratch: Path, time_ledger: bool = True, extra: list[str] = ()
):
    """`lmledger fit --config CONFIG` for `steps` steps with StepClock; the ledger's time ledger (its
    profiled steps) on or off (`--ledger.time`)."""
    from lmledger.cli import main as lmledger

    argv = [
        "fit", "--config", config_path, "--data.path", data, "--trainer.max_steps", str(steps),
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(scratch / "runs"),
        "--trainer.default_root_dir", str(scratch), "--trainer.callbacks+=__main__.StepClock",
        "--ledger.time", "true" if time_ledger else "false", *extra,
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = lmledger(argv)
    if code != 0:
        raise SystemExit(f"lmledger fit exited {code}")
    return list(StepClock.ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument("--data", default=None, help="prepared data dir (default: the config's data.path)")
    parser.add_argument("--rounds", type=int, default=4, help="bare/fit pairs, in ABBA order")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=10, help="first steps of each arm left out")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    parser.add_argument("--explain", action="store_true", help="profile one step of each arm, print both")
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps, with --explain")
    parser.add_argument(
        "--time-ledger", action="store_true",
        help="a third arm: the fit without the time ledger (--ledger.time false), for the profiler's share of a fit",
    )  # fmt: skip
    parser.add_argument(
        "--paired", action="store_true",
        help="one fit with 20 bare-loop steps after every 20 fit batches, timed as pairs (drift-proof)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.skip, args.explain = 1, 20, 5, True
    if args.threads:
        torch.set_num_threads(args.threads)
    config = yaml.safe_load(Path(args.config).read_text())
    tokens = config.get("data", {}).get("batch_size", 16) * config["model"]["config"]["context_length"]

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data = prepared_corpus(args.data or config.get("data", {}).get("path", "data/stdlib"), scratch)
        if args.paired:
            ratios = paired(config, args.config, data, args.steps, scratch / "paired")
            if len(ratios) < 2:
                raise SystemExit(f"--paired needs at least 2 pairs of {Paired.block} steps: raise --steps")
            q = statistics.quantiles(ratios, n=4)
            print(
                f"lmledger fit / bare loop tokens/s, paired blocks of {Paired.block} steps in one {args.steps}-step "
                f"fit: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(ratios)} pairs; "
                f"goal >= 0.98); torch threads {torch.get_num_threads()}"
            )
            return
        arms = ("bare", "fit", "fit-no-time") if args.time_ledger else ("bare", "fit")
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        shares: list[float] = []  # the profiled steps' share of each fit arm's time (--time-ledger)
        for round_ in range(args.rounds):
            order = arms if round_ % 2 == 0 else tuple(reversed(arms))
            for arm in order:
                if arm == "bare":
                    ends, _ = bare_loop(config, data, args.steps)
                else:
                    # The time ledger reuses the ledger's dry run: what it adds is its profiled steps.
                    with time_ledgers() as built:
                        ends = lmledger_fit(args.config, data, args.steps, scratch / f"{arm}{round_}", arm == "fit")
                    if args.time_ledger and arm == "fit" and built:
                        shares.append(profiling_share(ends, built[-1]))
                rates[arm].append(tokens_per_sec(ends, tokens, args.skip))
            shown = ", ".join(f"{arm} {rates[arm][-1]:,.0f} tok/s" for arm in arms)
            print(f"round {round_ + 1}/{args.rounds}: {shown}, ratio {rates['fit'][-1] / rates['bare'][-1]:.3f}")
        ratios = [f / b for f, b in zip(rates["fit"], rates["bare"], strict=True)]
        print(
            f"\nlmledger fit / bare loop tokens/s: median ratio {statistics.median(ratios):.3f} over {args.rounds} "
            f"round(s) of {args.steps} steps (goal >= 0.98); torch threads {torch.get_num_threads()}"
        )
        if args.time_ledger:
            profiled = [f / n for f, n in zip(rates["fit"], rates["fit-no-time"], strict=True)]
            print(
                f"lmledger fit with / without TimeLedger tokens/s: median ratio {statistics.median(profiled):.4f} "
                "(machine drift between the arms shows here too)"
            )
            print(
                f"profiled steps: {100 * statistics.median(shares):.2f}% of the fit's batch time, their time beyond "
                "the median batch in the same fit (goal <= 1%)"
            )
        if args.explain:
            explain(config, data, args, scratch)


def explain(config: dict, data: str, args, scratch: Path) -> None:
    """One profiled step of each arm, side by side (ms per step)."""
    from lmledger.ledger.timing.profile import MEASURED
    from lmledger.ledger.timing.roofline import LABELS

    _, bare = bare_loop(config, data, max(args.skip, 5), explain=True)
    with time_ledgers() as captured:
        lmledger_fit(args.config, data, max(args.skip, 5), scratch / "explain")  # the ledger's TimeLedger
    fit = captured[-1].measured if captured else None
    print(f"\n{'ms per step (one profiled step)':<30} {'bare loop':>10} {'lmledger fit':>13}")
    for name in MEASURED:
        b = bare.seconds.get(name, 0.0) * 1e3
        f = fit.seconds.get(name, 0.0) * 1e3 if fit else math.nan
        print(f"{LABELS[name]:<30} {b:>10.3f} {f:>13.3f}")
    print(f"{'wall':<30} {bare.wall_s * 1e3:>10.3f} {(fit.wall_s * 1e3 if fit else math.nan):>13.3f}")


if __name__ == "__main__":
    main()
