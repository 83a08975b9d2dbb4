"""Whether the step-time prediction times the optimizer with its state cached or flushed, against the optimizer
step inside a real training loop, for a small model (its step touches less than the last-level cache) and
tiny.yaml's (more), measured in one run.

For each model: the step's touched bytes (predict.touched_between_steps of its dry run) beside the cache, the
optimizer step timed kept and flushed (calibrate's own timing), and the same optimizer's step in a loop of real
forward, backward and step (median of its steps). The prediction takes the arm its touched bytes choose.

    python benchmarks/optimizer_cache.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lmledger.ledger.dryrun.engine import dry_run
from lmledger.ledger.timing.steptime.calibrate import _time_optimizer
from lmledger.ledger.timing.steptime.predict import touched_between_steps
from lmledger.ledger.timing.steptime.replay import cache_bytes
from lmledger.model import ModelConfig, ToyLM

CPU = torch.device("cpu")


def _mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def _tiny():  # configs/tiny.yaml's model and batch
    cfg = ModelConfig(vocab_size=256, context_length=128, d_model=128, n_layers=4, n_heads=4, d_ff=384)
    batch = tuple(torch.randint(0, 256, (16, 128)) for _ in range(2))
    return ToyLM(cfg), batch, lambda m, b: m(*b)


def in_loop(model, batch, loss_fn, steps: int) -> float:
    """Median seconds of optimizer.step() between real forward and backward passes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 3):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        start = time.perf_counter()
        optimizer.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    llc = cache_bytes(CPU)
    print(f"last-level cache {llc / 2**20:.0f} MiB, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    print(f"{'model':6} {'touched MB':>10} {'chosen':>7} {'kept ms':>8} {'flushed ms':>10} {'in loop ms':>10} "
          f"{'chosen/loop':>11} {'other/loop':>10}")  # fmt: skip
    for name, make in (("mlp", _mlp), ("tiny", _tiny)):
        model, batch, loss_fn = make()
        ops = dry_run(model, batch, step=loss_fn, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4)).ops
        touched = touched_between_steps(ops)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        shapes = [(tuple(p.shape), p.dtype) for p in model.parameters()]
        kept, flushed = (_time_optimizer(optimizer, shapes, CPU, None, 2 << 30, arm)[0] for arm in (False, True))
        loop = in_loop(model, batch, loss_fn, args.steps)
        chosen, other = (flushed, kept) if touched > llc else (kept, flushed)
        print(f"{name:6} {touched / 1e6:10.3f} {'flushed' if touched > llc else 'kept':>7} {kept * 1e3:8.3f} "
              f"{flushed * 1e3:10.3f} {loop * 1e3:10.3f} {chosen / loop:11.2f} {other / loop:10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
