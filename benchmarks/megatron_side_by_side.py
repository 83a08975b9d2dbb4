"""Megatron-LM's closed forms beside the dry run, per rank under tensor parallelism (issue 30).

(a) Megatron's own GPT shape (8 layers, hidden 4,096, 32 heads, MLP 16,384, vocab 51,200, 2,048 tokens, micro-batch
    1, TP 8 on 8 ranks), sequence parallel off and on: ledger.sharding.tp.megatron_memory (our code of Megatron's
    theoretical_memory_usage.py formulas, Korthikanti et al. 2022 Table 2) beside the dry run of lmledger's toy LM
    at that shape (a SwiGLU MLP of width 16,384, RMSNorm, no biases or dropout, flash SDPA), bf16-mixed AdamW.
(b) Which one a real run agrees with: the toy LM at TP 2 on 2 real gloo ranks of this CPU (bf16-mixed), its
    measured saved activations beside both.

    python benchmarks/megatron_side_by_side.py          # (a) and (b); (a)'s two dry runs take a minute or two
    python benchmarks/megatron_side_by_side.py --quick  # (b) only
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmledger.ledger.sharding.sharded import FSDPSettings, measure_sharded, predict_sharded, spawn_gloo_ranks  # noqa: E402
from lmledger.ledger.sharding.tp import megatron_memory  # noqa: E402
from lmledger.model import ModelConfig, ToyLM  # noqa: E402

GPT = ModelConfig(vocab_size=51200, context_length=2048, d_model=4096, n_layers=8, n_heads=32, d_ff=16384)
TOY = ModelConfig(vocab_size=256, context_length=128, d_model=64, n_layers=2, n_heads=4, d_ff=256)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def batch(cfg: ModelConfig, size: int = 1, device: str = "meta"):
    ids = torch.zeros((size, cfg.context_length), dtype=torch.long, device=device)
    return ids, ids.clone()


def ours(cfg: ModelConfig, world: int, tp: int, sp: bool, size: int = 1):
    with torch.device("meta"):
        model = ToyLM(cfg)
    return predict_sharded(
        model, batch(cfg, size), optimizer=adamw, precision="bf16-mixed", strategy="fsdp2", world_size=world,
        fsdp=FSDPSettings(tensor_parallel=tp, sequence_parallel=sp),
    )  # fmt: skip


def megatron(cfg: ModelConfig, tp: int, sp: bool, size: int = 1) -> dict:
    return megatron_memory(
        layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads, ffn=cfg.d_ff, vocab=cfg.vocab_size,
        seq=cfg.context_length, micro_batch=size, tp=tp, sequence_parallel=sp,
    )  # fmt: skip


def _measured(sp: bool) -> int:
    torch.manual_seed(0)
    ledger = measure_sharded(
        ToyLM(TOY), batch(TOY, 4, "cpu"), optimizer=adamw, precision="bf16-mixed", strategy="fsdp2",
        fsdp=FSDPSettings(tensor_parallel=2, sequence_parallel=sp),
    )  # fmt: skip
    return ledger.activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| case | Megatron: weights + optimizer | ours: params + grads + AdamW | Megatron: activations | ours |")
    print("|---|---|---|---|---|")
    if not args.quick:
        for sp in (False, True):
            m, o = megatron(GPT, 8, sp), ours(GPT, 8, 8, sp)
            state = o.params + o.grads + o.optimizer
            tag = "on" if sp else "off"
            print(f"| GPT 8 x 4096, TP 8, SP {tag} | {m['weights_and_optimizer'] / 1e9:.3f} GB | "
                  f"{state / 1e9:.3f} GB | {m['activations'] / 1e9:.3f} GB | "
                  f"{o.activations / 1e9:.3f} GB |")  # fmt: skip
    for sp in (False, True):
        measured = spawn_gloo_ranks(_measured, 2, sp)
        m, o = megatron(TOY, 2, sp, 4), ours(TOY, 2, 2, sp, 4)
        print(f"| toy 2 x 64, TP 2, SP {'on' if sp else 'off'}, batch 4 x 128 | | | {m['activations'] / 1e6:.3f} MB "
              f"| {o.activations / 1e6:.3f} MB; measured rank 0 / 1: "
              f"{measured[0] / 1e6:.3f} / {measured[1] / 1e6:.3f} MB |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
