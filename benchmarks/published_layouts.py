"""Does `plan layout` put the published layouts near the top? `python benchmarks/published_layouts.py --rows
shared/published/runs-dev.csv [--only ID,...] [--sources PREFIX,...]`.

For each row whose layout and global batch are printed (Megatron-LM SC'21 Table 1, Korthikanti et al.; TP and PP known,
no context parallel), the layout search (ledger/timing/gpu/search.py) runs for that model, GPU count and global batch,
with the row's framework's kernels, its sharding, recompute, schedule and sequence parallelism (TP layouts run it where
the row did), the micro-batch searched (1, 2, 4, 8), each
rank's bytes as mixed precision keeps them (fp32 weights, gradients and moments: Megatron-LM's master weights). The
ranked layouts are grouped by their (TP, PP), each at its best micro-batch: a row's rank is its published (TP, PP)'s
place among them (1 is the fastest). One JSON line a row:

    {"id": ..., "published": [tp, pp], "rank": ..., "of": ..., "first": {...}, "published_step_s": ..., ...}

then how many rows rank their layout in the top 3. Reuses published_runs.py's reading of a row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as runs  # noqa: E402 - beside this script

SOURCES = ("Narayanan et al. SC21 Table 1", "Korthikanti")


def _summary(c, tokens: int) -> dict:
    return {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp, "micro_batch": c.layout.micro_batch,
            "step_s": c.step.total_s, "tokens_per_s": tokens / c.step.total_s,
            "peak_gb": c.memory.peak / 1e9}  # fmt: skip


def rank_row(row: dict) -> dict:
    from lmledger.ledger.hardware.gpus import require_gpu
    from lmledger.ledger.timing.gpu.search import search_layouts

    out = {"id": row["id"], "source": row["source"], "published": [row["tp"], row["pp"]]}
    # the micro-batch is searched; a precision or chunk count not printed takes the framework's usual (fp16, 1 chunk)
    row = {**row, "micro_batch": row["micro_batch"] or 1, "precision": row["precision"].replace("unknown", "fp16"),
           "vpp": row["vpp"].replace("unknown", "1")}  # fmt: skip
    reason = runs.why_not(row)
    if reason:
        return {**out, "rank": None, "reason": reason}
    precision, dtype = runs.precision_of(row)
    layout = runs.layout_of(row)
    sharding = "fsdp" if layout.sharding == "fsdp" else "ddp"
    gpu = require_gpu(row["gpu"])
    found = search_layouts(runs.model_config(row, row["layers"]), row["seq_len"], num_gpus=row["gpus"],
                           global_batch=row["global_batch"], capacity_bytes=gpu.memory_bytes, precision=precision,
                           gpu=gpu, compute_dtype=dtype, kernels=runs.kernels_of(row), links=runs.links_of(row),
                           memory_precision=precision.replace("-true", "-mixed"), shardings=(sharding,),
                           recomputes=(layout.recompute,), sequence_parallel=layout.sequence_parallel,
                           schedules=((layout.schedule, layout.virtual),))  # fmt: skip
    best: dict[tuple[int, int], object] = {}
    for c in found.ranked:  # fastest first: the first of each (TP, PP) is its best micro-batch
        best.setdefault((c.layout.tp, c.layout.pp), c)
    order = list(best)
    key = (row["tp"], row["pp"])
    tokens = found.tokens_per_step
    out.update(rank=order.index(key) + 1 if key in best else None, of=len(order),
               first=_summary(best[order[0]], tokens) if order else None,
               published_layout=_summary(best[key], tokens) if key in best else None)  # fmt: skip
    if key not in best:
        why = [c.dropped for c in found.dropped if (c.layout.tp, c.layout.pp) == key]
        out["reason"] = why[0] if why else "not among the searched layouts"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help="a CSV in shared/published/README.md's format")
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--sources", default=",".join(SOURCES), help="comma-separated prefixes of the source column")
    args = parser.parse_args()
    rows = runs.chosen_rows(args, "published_layouts")
    if rows is None:
        return 2
    rows = [r for r in rows if r["source"].startswith(tuple(args.sources.split(",")))]
    warnings.simplefilter("ignore")
    started, ranked = time.monotonic(), []
    for row in rows:
        result = rank_row(row)
        print(json.dumps(result), flush=True)
        if result["rank"] is not None or "reason" not in result:
            ranked.append(result)
    top = sum(1 for r in ranked if r["rank"] is not None and r["rank"] <= 3)
    print(f"published layout in the top 3: {top} of {len(ranked)} rows ranked ({len(rows)} read) "
          f"in {time.monotonic() - started:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
