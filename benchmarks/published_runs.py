"""Published training runs predicted by the GPU op-time model, without a GPU: `python benchmarks/published_runs.py
--rows shared/published/runs-dev.csv [--only ID,...] [--sources PREFIX,...] [--limit N]`.

Each row (the format of shared/published/README.md) is built as a ToyLM configuration at its real shape (gpt: LayerNorm,
GeLU MLP, learned positions, biases; mpt: the same without biases; llama: RMSNorm, SwiGLU, RoPE, grouped-query
attention), dry-run at its layout per rank and priced on its GPU as its framework's kernels run
(ledger/timing/gpu/layout.step_at_layout). One JSON line a row:

    {"id": ..., "source": ..., "metric": ..., "published": ..., "predicted": ..., "error": ..., "step_s": ...}

`predicted` is in the row's own metric; `error` is (predicted - published) / published. A row it cannot predict
gets `"predicted": null` and the reason. The last lines give the median and worst |error| per source and overall.
Dry runs are cached per distinct shape and layout (a row's depth and batch only scale the priced step).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
import warnings
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# The fields a step-time prediction needs (README.md's `confirmed` list); a row with one unknown is not predicted.
NEEDED = ("gpu", "gpus", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tp", "pp", "cp",
          "dp", "micro_batch", "global_batch", "precision", "recompute")  # fmt: skip
INT_FIELDS = ("gpus", "gpus_per_node", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tp",
              "pp", "cp", "dp", "micro_batch", "global_batch")  # fmt: skip
# Megatron-LM pads its vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by 128), as GPT-NeoX does
# (neox_args.make_vocab_size_divisible_by = 128: 20B's 50257 runs as 50432); llm.c to 50304.
_PAD_TO = {"megatron": 128, "megatron-deepspeed": 128, "megatron-core": 128, "nemo": 128, "llm.c": 128, "gpt-neox": 128}
# The precision each framework trains in, as a Lightning precision the dry run takes: Megatron-LM, llm.c and
# torchtitan keep 16-bit weights and activations (fp32 master weights only in the optimizer); llm-foundry's
# benchmarks too (FSDP's PURE mixed precision gathers bf16 weights, and its low_precision_layernorm runs in bf16:
# scripts/train/benchmarking/submit_benchmarks.py, yamls/pretrain/mpt-*.yaml); nanoGPT and the rest run autocast
# over fp32 weights.
_TRUE_16 = ("megatron", "megatron-deepspeed", "megatron-core", "nemo", "llm.c", "torchtitan", "llm-foundry")


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in INT_FIELDS:  # an integer; None where empty or unknown; any other text kept for why_not to name
            value = (row.get(key) or "").strip()
            row[key] = int(value) if value.lstrip("-").isdigit() else None if value in ("", "unknown") else value
        row["value"] = float(row["value"])
    return rows


# README.md's values for the fields a prediction reads as words ("unknown" aside)
_WORDS = {"precision": ("fp16", "bf16", "fp8"), "recompute": ("none", "selective", "full"),
          "sharding": ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "distopt"),
          "seq_parallel": ("0", "1"), "compile": ("0", "1"),
          "metric": ("iter_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")}  # fmt: skip


def why_not(row: dict) -> str | None:
    """Why the row is not predicted, or None: a field unknown, or a value README.md does not allow."""
    missing = [f for f in NEEDED if row.get(f) in (None, "", "unknown")]
    if missing:
        return f"{', '.join(missing)} unknown"
    bad = [
        f"{f} {row[f]!r}" for f in INT_FIELDS if row.get(f) is not None and not (isinstance(row[f], int) and row[f] > 0)
    ]
    bad += [f"{f} {row[f]!r}" for f, allowed in _WORDS.items() if row.get(f, "unknown") not in (*allowed, "unknown")]
    vpp = (row.get("vpp") or "unknown").strip()
    if vpp != "unknown" and not (vpp.isdigit() and int(vpp) > 0):
        bad.append(f"vpp {vpp!r}")
    if row["value"] <= 0:
        bad.append(f"value {row['value']!r}")
    if bad:
        return f"{', '.join(bad)}: not a value README.md allows"
    if row["pp"] > 1 and row.get("vpp") in (None, "", "unknown"):
        return f"PP {row['pp']} with an unknown number of chunks a rank (vpp)"
    if row["arch"] not in ("gpt", "mpt", "llama"):
        return f"arch {row['arch']}: only gpt, mpt and llama rows are built"
    if row["tp"] * row["cp"] * row["pp"] * row["dp"] != row["gpus"]:
        return f"TP {row['tp']} x CP {row['cp']} x PP {row['pp']} x DP {row['dp']} is not the {row['gpus']} GPUs"
    if row["global_batch"] % (row["micro_batch"] * row["dp"]):
        return f"global batch {row['global_batch']} is not a multiple of micro-batch x DP"
    return None


def padded_vocab(row: dict) -> int:
    framework = framework_of(row)
    pad = _PAD_TO.get(framework, 1) * (row["tp"] if framework != "llm.c" else 1)
    return -(-row["vocab"] // pad) * pad


def model_config(row: dict, layers: int):
    from lmledger.model import ModelConfig

    vocab = padded_vocab(row)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    arch = {}
    if row["arch"] in ("gpt", "mpt") and "mlp" in fields:
        # Learned positions, as GPT-2's; rotary under context parallel, whose dry run shards rotary positions only
        # (README.md's gpt rows may have either, and a position table's lookup and add is noise in a step's time)
        positions = "rope" if row["cp"] > 1 else "learned"
        arch = dict(mlp="gelu", norm="layer", positions=positions, bias=row["arch"] == "gpt")
    if row["kv_heads"] != row["heads"] and "n_kv_heads" in fields:
        arch["n_kv_heads"] = row["kv_heads"]
    return ModelConfig(vocab_size=vocab, context_length=row["seq_len"], d_model=row["hidden"], n_layers=layers,
                       n_heads=row["heads"], d_ff=row["ffn_hidden"], **arch)  # fmt: skip


def precision_of(row: dict) -> tuple[str, str]:
    """(Lightning precision, the dtype of its matmuls): fp8 rows run bf16 around fp8 linears (kernels_of)."""
    half = "16" if row["precision"] == "fp16" else "bf16"
    kind = "true" if row["framework"] in _TRUE_16 else "mixed"
    return f"{half}-{kind}", "fp16" if row["precision"] == "fp16" else "bf16"


def gpu_of(row: dict) -> str:
    """The GPU the row ran on: an `h100-sxm` row whose notes say HBM2e ran on Meta's Grand Teton H100, 96 GB of HBM2e
    at a 500 W limit (shared/published/README.md; torchtitan's docs/performance.md), the table's `h100-sxm-500w`."""
    if row["gpu"] == "h100-sxm" and "hbm2e" in row.get("notes", "").lower():
        return "h100-sxm-500w"
    return row["gpu"]


def framework_of(row: dict) -> str:
    """The row's framework; an `other` row's is the one its notes start with where it is one of ours
    (shared/published/README.md), else eager PyTorch."""
    from lmledger.ledger.timing.gpu.frameworks import FRAMEWORKS

    if row["framework"] != "other":
        return row["framework"]
    named = [name for name in FRAMEWORKS if row.get("notes", "").lower().startswith(name)]
    return max(named, key=len, default="pytorch")  # "megatron-core ..." is not Megatron-LM's


def kernels_of(row: dict):
    """The row's framework's kernels (frameworks.py), compiled where the row says, with fp8 linears for fp8 rows and
    async TP where its notes say it ran."""
    import dataclasses as dc

    from lmledger.ledger.timing.gpu import kernels_for

    kernels = kernels_for(framework_of(row), compiled=row.get("compile") == "1")
    if "async tp" in row.get("notes", "").lower():  # opt-in, so printed where a run used it (torchtitan's tables)
        kernels = dc.replace(kernels, async_tp=True)
    return dc.replace(kernels, fp8_matmuls=True) if row["precision"] == "fp8" else kernels


def recompute_of(row: dict) -> str:
    """ledger/timing/gpu/layout's recompute for the row's: "selective" is the attention core in Megatron-LM
    (Korthikanti et al.), and in torchtitan its selective AC, per block ("layer": every second one, its default
    frequency) or per op ("op", its default), as the row's notes say."""
    if row["recompute"] != "selective":
        return row["recompute"]
    if row["framework"].startswith(("megatron", "nemo")):
        return "attention"
    return "layer" if "selective layer" in row.get("notes", "") else "op"


def layout_of(row: dict):
    """The row's layout; an uninterleaved pipeline runs its framework's schedule (Megatron-DeepSpeed: DeepSpeed's)."""
    from lmledger.ledger.timing.gpu.layout import Layout

    sharding = "fsdp" if row["sharding"] in ("fsdp", "zero3", "hsdp") else "ddp"
    accumulate = row["global_batch"] // (row["micro_batch"] * row["dp"])
    virtual = int(row.get("vpp") or 1) if row["pp"] > 1 else 1
    return Layout(tp=row["tp"], dp=row["dp"], sharding=sharding, micro_batch=row["micro_batch"], accumulate=accumulate,
                  recompute=recompute_of(row), pp=row["pp"], virtual=virtual, cp=row["cp"],
                  schedule="interleaved" if virtual > 1 else kernels_of(row).pipeline_schedule,
                  sequence_parallel=sequence_parallel_of(row) and row["tp"] > 1)  # fmt: skip


def sequence_parallel_of(row: dict) -> bool:
    """The row's sequence parallel; where it is `unknown`, its framework's: torchtitan's TP plan always shards the
    norms' sequence over the TP ranks (SequenceParallel on every norm in its apply_tp), others' is off."""
    if row.get("seq_parallel") in (None, "", "unknown"):
        return row["framework"] == "torchtitan"
    return row["seq_parallel"] == "1"


def links_of(row: dict):
    from lmledger.ledger.hardware.interconnect import links_for

    per_node = row["gpus_per_node"] or 8
    nodes = -(-row["gpus"] // per_node)
    inter = row["inter_link"] if row["inter_link"] not in ("", "unknown") else None
    return links_for(row["gpu"], row["intra_link"] or None, inter, min(per_node, row["gpus"]), nodes)


@cache
def _step(config, seq: int, layout, precision: str, gpu: str, dtype: str, kernels, links):
    from lmledger.ledger.timing.gpu.layout import step_at_layout

    return step_at_layout(config, seq, layout, precision, gpu, compute_dtype=dtype, kernels=kernels, links=links)


def predict(row: dict) -> dict:
    out = {"id": row["id"], "source": row["source"], "metric": row["metric"], "published": row["value"]}
    reason = why_not(row)
    if reason is None:
        try:
            precision, dtype = precision_of(row)
            step = _step(model_config(row, row["layers"]), row["seq_len"], layout_of(row), precision, gpu_of(row),
                         dtype, kernels_of(row), links_of(row))  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a row the kit cannot build or trace: recorded, the rest go on
            step, reason = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        if step is not None and not hasattr(step, "total_s"):
            reason = step.reason
    if reason is not None:
        return {**out, "predicted": None, "error": None, "reason": reason}
    seconds = step.total_s
    tokens = row["global_batch"] * row["seq_len"]
    metric = {"iter_s": lambda: seconds, "tokens_per_s_per_gpu": lambda: tokens / seconds / row["gpus"],
              "tflops_per_gpu": lambda: logged_flops(row) / seconds / row["gpus"] / 1e12,
              "mfu": lambda: mfu_of(row, seconds)}.get(row["metric"])  # fmt: skip
    value = metric() if metric else None
    if value is None:
        reason = f"metric mfu: no {row['precision']} peak on {row['gpu']}"  # the only metric left without a value
        return {**out, "predicted": None, "error": None, "reason": reason, "step_s": seconds}
    out = {**out, "predicted": value, "error": value / row["value"] - 1, "step_s": seconds,
           "breakdown_ms": {k: round(v * 1e3, 2) for k, v in step.seconds.items() if round(v * 1e3, 2)}}  # fmt: skip
    implied = published_mfu(row)
    if implied is not None and implied > 1:  # a typo or a misread batch in the source: no model of the chip meets it
        out["above_peak"] = (f"the published value is {implied:.0%} of the {row['gpu']}'s {row['precision']} peak in "
                             f"model FLOPs alone: no step is that short")  # fmt: skip
    return out


# The MFU numerator each framework prints (ledger/closedform/flops.MFU_CONVENTIONS), checked against rows that print
# both an MFU and a throughput (tests/test_published_runs.py; runs-dev.csv's 124 such rows). PaLM's 6 N + 12 L H Q T
# is Megatron-LM's (Korthikanti et al.: its 4 rows within 0.4%) and llm-foundry's (0.3% in the median of 109, 3.6% at
# worst); torchtitan's logger of 2024 counted 6 x every parameter, the token embedding too, + 12 L H Q T (its 11 rows
# within 0.6%): nanoGPT's count, for a model without a learned position table.
_MFU_CONVENTION = {"torchtitan": "nanogpt", "nanogpt": "nanogpt"}


def model_flops(row: dict) -> float:
    """A step's model FLOPs as the row's framework counts them for its MFU (_MFU_CONVENTION, else PaLM's)."""
    from lmledger.ledger.closedform.flops import flops_per_token_by_convention

    convention = _MFU_CONVENTION.get(framework_of(row), "palm")
    per_token = flops_per_token_by_convention(model_config(row, row["layers"]), row["seq_len"])[convention]
    return per_token * row["global_batch"] * row["seq_len"]


def mfu_of(row: dict, seconds: float) -> float | None:
    """The row's MFU at a step of `seconds`: its model FLOPs over the dense peak of the row's `gpu` and precision, the
    datasheet figure sources divide by (torchtitan's 500 W H100 rows print MFU at the SXM part's peak; an fp8 row's
    is the fp8 peak); None where the datasheet has no such peak."""
    from lmledger.ledger.hardware.gpus import require_gpu

    peak = require_gpu(row["gpu"]).peak_flops[row["precision"]]
    if not peak:
        return None  # the chip has no such tensor-core rate (bf16 on a V100, fp8 on an A100)
    return model_flops(row) / seconds / row["gpus"] / peak


def published_mfu(row: dict) -> float | None:
    """The MFU the row's published value comes to (its metric read back into a step's seconds, mfu_of); None where
    the chip has no peak at the row's precision."""
    if row["metric"] == "mfu":
        return row["value"]
    per_gpu = row["value"] * row["gpus"]
    seconds = {"iter_s": lambda: row["value"],
               "tokens_per_s_per_gpu": lambda: row["global_batch"] * row["seq_len"] / per_gpu,
               "tflops_per_gpu": lambda: logged_flops(row) / (per_gpu * 1e12)}[row["metric"]]()  # fmt: skip
    return mfu_of(row, seconds)


def logged_flops(row: dict) -> float:
    """A step's FLOPs as the row's framework logs them, the convention of its TFLOP/s per GPU: GPT-NeoX's own (below);
    Megatron-LM's and Megatron-DeepSpeed's eq. 3 (Narayanan et al. 2021: the recomputed forward counted, factor 4
    with full recompute, else 3; SC'21's rows say so, and BLOOM's logged hardware FLOPs are it); the others print
    model FLOPs (shared/published/README.md: MosaicML, NeMo), their MFU's numerator."""
    framework = framework_of(row)
    if framework == "gpt-neox":
        return neox_flops(row)
    if framework not in ("megatron", "megatron-deepspeed"):
        return model_flops(row)
    b, s, layers, h, vocab = row["global_batch"], row["seq_len"], row["layers"], row["hidden"], row["vocab"]
    factor = 4 if row["recompute"] == "full" else 3
    return 24 * factor * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def neox_flops(row: dict) -> float:
    """GPT-NeoX's logged FLOPs from its 20B release (c560814b, Feb 2022) until September 2023 (5f364017 moved it to
    eq. 3): tokens x (6 P + 60 s h l), recompute not counted (megatron/logging.py, get_flops). P is its
    get_total_params: the parameters of every model-parallel rank summed, so a TP-replicated norm or bias counts TP
    times, and a pipeline's embedding twice (on its first and last stage; 20B unties it, the default ties it)."""
    tp, h, f, layers, vocab = row["tp"], row["hidden"], row["ffn_hidden"], row["layers"], padded_vocab(row)
    matrices = layers * (4 * h * h + 2 * h * f + 3 * h + f)  # QKV, out and MLP weights; their column-parallel biases
    replicated = layers * 6 * h + 2 * h  # two LayerNorms, the out and MLP-out biases a layer; the final LayerNorm
    params = matrices + tp * replicated + (2 if row["pp"] > 1 else 1) * vocab * h
    s = row["seq_len"]
    return row["global_batch"] * s * (6 * params + 60 * s * h * layers)


def summary(results: list[dict]) -> list[str]:
    by_source: dict[str, list[float]] = {}
    for r in results:
        if r["error"] is not None:
            by_source.setdefault(r["source"].split(" ")[0], []).append(abs(r["error"]))
    lines = []
    everything = [e for errors in by_source.values() for e in errors]
    for name, errors in sorted(by_source.items()) + [("overall", everything)]:
        if errors:
            lines.append(f"{name}: {len(errors)} rows, median |error| {statistics.median(errors):.1%}, "
                         f"worst {max(errors):.1%}")  # fmt: skip
    possible = [abs(r["error"]) for r in results if r["error"] is not None and "above_peak" not in r]
    if len(possible) < len(everything):
        rest = "no other row"
        if possible:
            median, worst = statistics.median(possible), max(possible)
            rest = f"the other {len(possible)}: median |error| {median:.1%}, worst {worst:.1%}"
        lines.append(f"above their chip's peak as published: {len(everything) - len(possible)} (their lines say so); "
                     f"{rest}")  # fmt: skip
    skipped = sum(1 for r in results if r["predicted"] is None)
    lines.append(f"not predicted: {skipped} of {len(results)} rows (their lines say why)")
    return lines


def chosen_rows(args, prog: str) -> list[dict] | None:
    """The rows of `args.rows` (those named by `args.only`), or None after one line on stderr: no such file, or not
    shared/published/README.md's format."""
    path = Path(args.rows)
    if not path.is_file():
        print(f"{prog}: no such file {path}", file=sys.stderr)
        return None
    try:
        rows = read_rows(path)
    except (KeyError, ValueError) as err:
        print(f"{prog}: {path} is not in shared/published/README.md's format ({err})", file=sys.stderr)
        return None
    return [r for r in rows if r["id"] in set(args.only.split(","))] if args.only else rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help="a CSV in shared/published/README.md's format")
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--sources", help="comma-separated prefixes of the source column")
    parser.add_argument("--limit", type=int, help="the first N rows (after --only/--sources)")
    args = parser.parse_args()
    rows = chosen_rows(args, "published_runs")
    if rows is None:
        return 2
    if args.sources:
        rows = [r for r in rows if r["source"].startswith(tuple(args.sources.split(",")))]
    rows = rows[: args.limit] if args.limit else rows
    warnings.simplefilter("ignore")
    started, results = time.monotonic(), []
    for row in rows:
        result = predict(row)
        results.append(result)
        print(json.dumps(result), flush=True)
    for line in summary(results):
        print(line)
    print(f"{len(rows)} rows in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
