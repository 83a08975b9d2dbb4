"""Why LitLM's AdamW is fused on CPU too: seconds per optimizer step, fused kernel over foreach (torch's
default), on the parameters of a config's model with random gradients, measured in one run.

Arms alternate (ABBA) so a drift in machine load falls on both alike; the ratio printed is the median
foreach step over the median fused step (> 1: fused is faster).

    python benchmarks/optimizer_step.py [--config configs/tiny.yaml] [--steps 50] [--pairs 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import yaml

from lmledger.model import ModelConfig, ToyLM


def step_seconds(model: ToyLM, fused: bool, steps: int, device: torch.device) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    optimizer.step()  # allocates the moments
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    fields = yaml.safe_load(open(args.config))["model"]["config"]
    device = torch.device(args.device)
    with device:
        model = ToyLM(ModelConfig(**fields))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    timings: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for fused in (*order, *reversed(order)):
            timings[fused].append(step_seconds(model, fused, args.steps, device))
    fused, foreach = statistics.median(timings[True]), statistics.median(timings[False])
    print(
        f"AdamW step on {model.num_parameters():,} params ({args.config}, {device}, "
        f"{torch.get_num_threads()} threads): fused {fused * 1e3:.3f} ms, foreach {foreach * 1e3:.3f} ms, "
        f"foreach/fused = {foreach / fused:.2f}"
    )


if __name__ == "__main__":
    main()
