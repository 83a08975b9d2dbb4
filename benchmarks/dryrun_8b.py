"""What sizing at scale costs: a Llama-3-8B-shaped model's per-rank dry run, FSDP2 and DDP, on this machine.

The model is transformers' LlamaForCausalLM built from a LlamaConfig of Llama-3-8B's shape (vocab 128,256,
hidden 4,096, 32 layers, 32 heads / 8 KV heads, MLP 14,336; Meta's published config.json) on the meta
device: no weights, no download. ledger.sharding.sharded.predict_sharded dry-runs one rank's training step (bf16-mixed,
AdamW) at world size W over torch's fake process group. Printed per run: wall seconds, the process's peak
resident memory (ru_maxrss: Python, torch, transformers and the dry run), the rank's peak against an H100's
80 GB, and for DDP by how much it does not fit. Goals: under 60 s and under 2 GB resident on a
2-core CPU; the cost flat in W (W = 8, 64, 512 within 1.5x of each other).

    python benchmarks/dryrun_8b.py                # 8B, seq 8192, micro-batch 1, W = 8, 64, 512
    python benchmarks/dryrun_8b.py --quick        # a 2-layer, 1/16-width cut of the same shape: checks it runs

Run it on an otherwise idle machine: on a shared one the seconds measure the neighbours too.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from _common import resident_bytes

from lmledger.hf import causal_lm_loss, checkpoint_layers
from lmledger.ledger.sharding.sharded import FSDPSettings, predict_sharded

H100_BYTES = 80e9  # H100 SXM, 80 GB (NVIDIA datasheet; ledger.hardware.gpus' h100-sxm)
SECONDS_GOAL, RESIDENT_GOAL, FLAT_GOAL = 60.0, 2e9, 1.5
LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
)  # fmt: skip


def llama(shape: dict, checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if checkpointing:
        checkpoint_layers(model)
    return model


step = causal_lm_loss  # the causal LM step on (inputs, targets) windows


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small cut of the shape: checks the script runs")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per rank")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    shape = dict(LLAMA3_8B)
    if args.quick:
        shape.update(hidden_size=256, intermediate_size=896, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=8016)  # fmt: skip
        args.seq = min(args.seq, 512)
    ids = torch.empty((args.batch, args.seq), dtype=torch.long, device="meta")
    n_params = sum(p.numel() for p in llama(shape, False).parameters())
    print(f"Llama-3-8B shape: {n_params:,} params; micro-batch {args.batch} x {args.seq} per rank, bf16-mixed AdamW")
    print(f"{'strategy':<8} {'W':>4} {'AC':>3} {'seconds':>8} {'resident':>9} {'rank peak':>10} {'vs 80 GB':>10}")
    seconds = {}
    for strategy, worlds in (("fsdp2", args.worlds), ("ddp", args.worlds[:1])):
        for checkpointing in (True, False):
            for world in worlds:
                model = llama(shape, checkpointing)
                start = time.perf_counter()
                result = predict_sharded(
                    model, (ids, ids), step=step, optimizer=adamw, precision="bf16-mixed", strategy=strategy,
                    world_size=world, fsdp=FSDPSettings(),
                )  # fmt: skip
                took = time.perf_counter() - start
                if not hasattr(result, "peak"):
                    print(f"{strategy:<8} {world:>4} {'on' if checkpointing else 'off':>3} not traced: {result.reason}")
                    continue
                seconds[(strategy, checkpointing, world)] = took
                fits = result.peak <= H100_BYTES
                verdict = "fits" if fits else f"over {(result.peak - H100_BYTES) / 1e9:.1f} GB"
                print(
                    f"{strategy:<8} {world:>4} {'on' if checkpointing else 'off':>3} {took:>8.1f} "
                    f"{resident_bytes() / 1e9:>7.2f}GB {result.peak / 1e9:>8.2f}GB {verdict:>10}"
                )
    fsdp_seconds = [seconds[k] for k in seconds if k[0] == "fsdp2" and k[1]]
    if len(fsdp_seconds) > 1:
        spread = max(fsdp_seconds) / min(fsdp_seconds)
        print(f"cost across W (FSDP2, AC on): max/min = {spread:.2f} (goal <= {FLAT_GOAL})")
    worst = max(seconds.values(), default=0.0)
    print(f"slowest dry run {worst:.1f} s (goal < {SECONDS_GOAL:.0f} s); "
          f"peak resident {resident_bytes() / 1e9:.2f} GB (goal < {RESIDENT_GOAL / 1e9:.0f} GB)")  # fmt: skip


if __name__ == "__main__":
    main()
