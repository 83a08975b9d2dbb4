"""Planning Llama-3-70B on 64 x H100-80GB at 8,192 tokens: FSDP2 alone and FSDP2 x TP 8, per rank, in one process.

The model is transformers' LlamaForCausalLM of Llama-3-70B's shape (Meta's config.json: vocab 128,256, hidden
8,192, 80 layers, 64 heads / 8 KV heads, MLP 28,672) on the meta device. ledger.sharding.sharded.predict_sharded
dry-runs one rank's step (bf16-mixed, AdamW) over torch's fake process group: FSDP2 alone over 64 ranks, and
FSDP2 over 8 data-parallel ranks x tensor parallel 8 (examples/tensor_parallel.py's Llama plan: colwise q/k/v,
gate, up; rowwise o_proj, down_proj), each with and without every layer checkpointed. For each it prints the
state per rank, activations, FSDP buffers, the peak at micro-batch 1 and 2, and the largest micro-batch per
rank that fits 80 GB on the line through those two (the peak grows linearly with the batch). Then the same
TP case at W = 512, for the cost's flatness in W. Goals: each dry run under 60 s and the process under 2 GB
resident on a 2-core CPU.

    python benchmarks/dryrun_70b.py            # the 70B shape (minutes: 10 dry runs of 80 layers)
    python benchmarks/dryrun_70b.py --quick    # a 2-layer, 1/16-width cut: checks the script runs

Run it on an otherwise idle machine: on a shared one the seconds measure the neighbours too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ (the Llama TP plan)

from _common import resident_bytes  # noqa: E402

from benchmarks.dryrun_8b import H100_BYTES, adamw, llama, step  # noqa: E402
from lmledger.ledger.hardware.interconnect import communication, default_links  # noqa: E402
from lmledger.ledger.sharding.sharded import FSDPSettings, predict_sharded  # noqa: E402

LLAMA3_70B = dict(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
)  # fmt: skip


def llama_tp_plan(model, tp_mesh) -> None:
    """examples/tensor_parallel.py's plan on a LlamaForCausalLM."""
    from examples.tensor_parallel import parallelize_llama

    parallelize_llama(model, tp_mesh)


def one(shape: dict, seq: int, batch: int, world: int, tensor_parallel: int, checkpointing: bool) -> dict:
    model = llama(shape, checkpointing)
    ids = torch.empty((batch, seq), dtype=torch.long, device="meta")
    settings = FSDPSettings(tensor_parallel=tensor_parallel, tp_plan=llama_tp_plan if tensor_parallel > 1 else None)
    start = time.perf_counter()
    ledger = predict_sharded(
        model, (ids, ids), step=step, optimizer=adamw, precision="bf16-mixed", strategy="fsdp2", world_size=world,
        fsdp=settings,
    )  # fmt: skip
    took = time.perf_counter() - start
    if not hasattr(ledger, "peak"):
        return {"not_traced": ledger.reason, "seconds": took}
    # 8 ranks a node on NVLink 4, NDR between nodes (an H100 cluster's links, ledger.hardware.interconnect)
    comm = communication(ledger.ops, default_links("h100-sxm", 8, world // 8), world)
    return {
        "params": ledger.params, "grads": ledger.grads, "optimizer": ledger.optimizer,
        "activations": ledger.activations, "comm_buffers": ledger.comm_buffers, "peak": ledger.peak,
        "peak_phase": ledger.peak_phase, "flops": ledger.flops_forward + ledger.flops_backward,
        "seconds": took, "resident": resident_bytes(), "communication": comm,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small cut of the shape: checks the script runs")
    parser.add_argument("--json", type=Path, help="write every figure here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    shape, seq, capacity = dict(LLAMA3_70B), 8192, H100_BYTES
    if args.quick:
        shape.update(hidden_size=512, intermediate_size=1792, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=8, vocab_size=8016)  # fmt: skip
        seq, capacity = 512, 2e9
    results = {}
    order = [("FSDP2 x TP 8", 8, True), ("FSDP2 alone", 1, True), ("FSDP2 x TP 8", 8, False), ("FSDP2 alone", 1, False)]
    for name, tp, checkpointing in order:  # the likeliest plans first
        at = [one(shape, seq, b, 64, tp, checkpointing) for b in (1, 2)]
        case = {"b1": at[0], "b2": at[1]}
        if "peak" in at[0] and "peak" in at[1]:
            slope = at[1]["peak"] - at[0]["peak"]
            fits = 0 if at[0]["peak"] > capacity else 1 + int((capacity - at[0]["peak"]) // max(slope, 1))
            case["max_batch"] = fits
        key = f"{name}, checkpointing {'on' if checkpointing else 'off'}"
        results[key] = case
        b1, b2 = at[0], at[1]
        if "not_traced" in b1:
            print(f"{key}: not traced: {b1['not_traced']}", flush=True)
            continue
        gb = {k: v / 1e9 for k, v in b1.items() if isinstance(v, int)}
        print(
            f"{key}: params {gb['params']:.3f} GB, grads {gb['grads']:.3f} GB, AdamW {gb['optimizer']:.3f} GB, "
            f"activations {gb['activations']:.2f} GB, FSDP buffers {gb['comm_buffers']:.2f} GB, "
            f"peak {gb['peak']:.2f} GB (b=1), {b2.get('peak', 0) / 1e9:.2f} GB (b=2), largest micro-batch "
            f"{case.get('max_batch')}; {b1['seconds']:.1f} s, {b1['resident'] / 1e9:.2f} GB resident",
            flush=True,
        )
        links = b1["communication"]["by_link"]
        print("  collectives per step (b=1): " + ", ".join(
            f"{row['seconds'] * 1e3:.1f} ms on {name} ({row['collectives']} ops, {row['bytes_sent'] / 1e9:.2f} GB sent)"
            for name, row in links.items()) + "; at line rate, none overlapped", flush=True)  # fmt: skip
    wide = one(shape, seq, 1, 512, 8, True)
    results["FSDP2 x TP 8, checkpointing on, W=512"] = {"b1": wide}
    print(f"W=512, TP 8, checkpointing on: peak {wide.get('peak', 0) / 1e9:.2f} GB; {wide['seconds']:.1f} s, "
          f"{resident_bytes() / 1e9:.2f} GB resident")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
