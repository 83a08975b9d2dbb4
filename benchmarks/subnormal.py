"""What subnormal floats cost a CPU step, which a step-time replay cannot see: measured in one run.

A replay (ledger/timing/steptime) runs each op on made-up values: weights at about 1/sqrt(fan_in), inputs in
range. A model in training holds its own values, and a softmax that sharpens puts probabilities below
float32's smallest normal number (1.18e-38): exp(-88) is already there. On x86 a kernel that meets such a
subnormal operand takes a microcode assist unless the thread flushes them (FTZ/DAZ, torch.set_flush_denormal).

Two parts:
1. Ops on a (64, 64, 64) softmax output with 0%, 0.3%, 3% and 30% of its entries subnormal, 2 threads: the
   bmm of attention's backward, softmax's backward, an elementwise product; then the same with
   torch.set_flush_denormal(True), set after OpenMP's threads exist, as a user's code would set it.
2. examples/hf_encoders.T5Seq2Seq (configs/examples/hf-t5.yaml's model; T5 does not scale its attention
   logits by 1/sqrt(d), so its softmax sharpens fast) trained with AdamW on the stdlib corpus: the median
   backward of its first steps and of its last, and the share of subnormal floats among the tensors its
   forward saves for backward. Each arm in a process of its own: flushing off; on, set once OpenMP's threads
   exist (the flag is per thread: its workers keep theirs); on, set before they exist (they inherit it).

    python benchmarks/subnormal.py [--steps 80] [--data data/stdlib]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository's examples package
FLUSH = {"off": "off", "after": "on, set after OpenMP starts", "before": "on, set before OpenMP starts"}
TINY = torch.finfo(torch.float32).tiny


def _median_us(fn, repeats: int = 200) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def ops_table() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 64, 64, generator=generator), -1)
    grad, grad_out = (torch.randn(*s, generator=generator) for s in ((64, 64, 32), (64, 64, 64)))
    rows = []
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        for share in (0.0, 0.003, 0.03, 0.3):
            mask = torch.rand(probs.shape, generator=generator) < share
            p = torch.where(mask, torch.full_like(probs, 1e-40), probs)
            times = (
                _median_us(lambda p=p: torch.bmm(p.transpose(1, 2), grad)),
                _median_us(lambda p=p: torch._softmax_backward_data(grad_out, p, -1, torch.float32)),
                _median_us(lambda p=p: p * grad_out),
            )
            rows.append((flush, share, times))
    torch.set_flush_denormal(False)
    base = {flush: times for flush, share, times in rows if share == 0.0}
    print("| flush | subnormal | bmm (attention's backward) | softmax backward | elementwise product |")
    print("|---|---|---|---|---|")
    for flush, share, times in rows:
        cells = " | ".join(f"{t:.0f} us ({t / b:.2f}x)" for t, b in zip(times, base[flush], strict=True))
        print(f"| {'on' if flush else 'off'} | {share:.1%} | {cells} |")


def _subnormal_share(model, batch) -> float:
    """The share of subnormal floats among the tensors one forward saves for backward."""
    counts = [0, 0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            a = t.detach().abs()
            counts[0] += int(((a < TINY) & (a > 0)).sum())
            counts[1] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return counts[0] / max(1, counts[1])


def t5_run(data: str, steps: int, flush: str) -> tuple[float, float, float, float]:
    """In a fresh process: `flush` "off", "after" (set once OpenMP's threads exist) or "before" (set first)."""
    from examples.hf_encoders import T5Seq2Seq
    from lmledger.data import TokenDataModule

    torch.set_flush_denormal(flush == "before")
    torch.set_num_threads(2)
    torch.bmm(torch.randn(8, 64, 64), torch.randn(8, 64, 64))  # OpenMP's threads start here
    torch.set_flush_denormal(flush != "off")
    torch.manual_seed(1234)
    module = T5Seq2Seq()
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
    loader = TokenDataModule(path=data, batch_size=16, context_length=128)
    loader.setup("fit")
    batches = iter(loader.train_dataloader())
    first_share = _subnormal_share(module, next(batches))
    backward = []
    for _ in range(steps):
        loss = module.loss(next(batches))
        start = time.perf_counter()
        loss.backward()
        backward.append(time.perf_counter() - start)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    last_share = _subnormal_share(module, next(batches))
    early, late = statistics.median(backward[3:13]), statistics.median(backward[-10:])
    return early * 1e3, late * 1e3, first_share, last_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--data", default="data/stdlib")
    args = parser.parse_args()
    if args.steps < 23:
        parser.error("--steps must be at least 23 (steps 4-13 and the last 10 are compared)")
    torch.set_num_threads(2)
    torch.bmm(torch.randn(8, 64, 64), torch.randn(8, 64, 64))  # OpenMP's threads exist before any flag is set
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    ops_table()
    from _common import prepared_corpus

    with tempfile.TemporaryDirectory() as scratch:
        data = str(Path(prepared_corpus(args.data, Path(scratch))).resolve())
        print(f"\nT5Seq2Seq (hf-t5.yaml's model), AdamW lr 3e-3, {args.steps} steps on {data}:\n")
        print("| flush | backward, steps 4-13 | last 10 | last / first | saved floats subnormal: step 0 | end |")
        print("|---|---|---|---|---|---|")
        for flush in ("off", "after", "before"):
            code = f"import json, subnormal; print(json.dumps(subnormal.t5_run({data!r}, {args.steps}, {flush!r})))"
            done = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, check=True)
            early, late, first, last = json.loads(done.stdout.splitlines()[-1])
            print(f"| {FLUSH[flush]} | {early:.1f} ms | {late:.1f} ms | {late / early:.2f} | "
                  f"{first:.3%} | {last:.3%} |")  # fmt: skip


if __name__ == "__main__":
    main()
