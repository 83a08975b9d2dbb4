"""All of vTrain's measured runs as rows of shared/published/README.md's format, for published_runs.py.

    python benchmarks/vtrain_rows.py --vtrain PATH > vtrain.csv
    python benchmarks/published_runs.py --rows vtrain.csv

PATH is a clone of VIA-Research/vTrain (its data/ground_truth_single.csv and ground_truth_multi.csv: 1,440 runs on one
node of 8 A100s and 109 on up to 512, Megatron-DeepSpeed). runs-dev.csv holds about half of them; the rest are the
same kind of row the held-back set has, so this is how to see whether a change to the model generalises before it is
scored (docs/time.md). Each row is written as runs-dev.csv writes vTrain's: GPT-2's vocabulary, a 4h MLP, fp16 and
80 GB presumed, full recompute, 1F1B, 8 GPUs a node on NVLink 3, 100 Gb/s a GPU between nodes (vTrain's configs:
800 Gb/s a node).
"""

from __future__ import annotations

import argparse
import csv
import sys
from decimal import Decimal
from pathlib import Path

FIELDS = ("id,source,gpu,gpus,gpus_per_node,intra_link,inter_link,framework,arch,layers,hidden,heads,kv_heads,"
          "ffn_hidden,vocab,seq_len,tp,pp,vpp,cp,dp,sharding,micro_batch,global_batch,recompute,seq_parallel,"
          "precision,compile,metric,value,confirmed,notes").split(",")  # fmt: skip
NOTES = ("A100 memory size not printed (80GB assumed); fp16 presumed (Megatron-DeepSpeed usual); vTrain validation "
         "config: full activation checkpointing; 1F1B; no gradient bucketing; intra-node 150 GB/s and inter-node "
         "800 Gb/s per node")  # fmt: skip
# vTrain's two files: their columns, in order (the multi-node file leads with the parameter count)
COLUMNS = {
    "single": ("gpus", "global_batch", "micro_batch", "hidden", "heads", "layers", "seq_len", "tp", "dp", "pp", "ms"),
    "multi": ("params", "gpus", "global_batch", "micro_batch", "hidden", "heads", "layers", "seq_len", "tp", "dp", "pp",
              "ms"),
}  # fmt: skip


def rows(vtrain: Path) -> list[dict]:
    """Every run in vTrain's two ground-truth files, as README.md rows (ids vtrain-all-single-N, vtrain-all-multi-N)."""
    out = []
    for kind, columns in COLUMNS.items():
        with open(vtrain / "data" / f"ground_truth_{kind}.csv", newline="", encoding="utf-8-sig") as f:
            runs = list(csv.reader(f))[1:]
        for i, values in enumerate(runs):
            run = dict(zip(columns, (v.strip() for v in values), strict=True))
            multi, h = kind == "multi", int(run["hidden"])
            params = f"params {run['params']}B as printed; " if multi else ""
            out.append({
                "id": f"vtrain-all-{kind}-{i:04d}", "source": f"vTrain data/ground_truth_{kind}.csv",
                "gpu": "a100-80gb", "gpus": run["gpus"], "gpus_per_node": 8, "intra_link": "nvlink3",
                "inter_link": "100Gb/s" if multi else "", "framework": "megatron-deepspeed", "arch": "gpt",
                "layers": run["layers"], "hidden": h, "heads": run["heads"], "kv_heads": run["heads"],
                "ffn_hidden": 4 * h, "vocab": 50257, "seq_len": run["seq_len"], "tp": run["tp"], "pp": run["pp"],
                "vpp": 1, "cp": 1, "dp": run["dp"], "sharding": "ddp" if int(run["dp"]) > 1 else "none",
                "micro_batch": run["micro_batch"], "global_batch": run["global_batch"], "recompute": "full",
                "seq_parallel": "unknown", "precision": "fp16", "compile": "unknown", "metric": "iter_s",
                "value": format(Decimal(run["ms"]).scaleb(-3), "f"), "confirmed": 0,
                "notes": f"unconfirmed=gpu_memory+precision; {params}{NOTES}",
            })  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vtrain", required=True, help="a clone of VIA-Research/vTrain")
    args = parser.parse_args()
    try:
        found = rows(Path(args.vtrain))
    except (OSError, ValueError, ArithmeticError) as err:  # no such clone, or a file not in vTrain's columns
        print(f"vtrain_rows: {args.vtrain} holds no vTrain ground truth ({err})", file=sys.stderr)
        return 2
    writer = csv.DictWriter(sys.stdout, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
