"""`plan layout --config FILE --gpu KEY --num-gpus N [--tokens D] [--top K]`: the layouts of a ToyLM config over N
GPUs that fit, ranked by predicted tokens/s (ledger/timing/gpu/search.py), as one JSON shape the command prints."""

from __future__ import annotations

import dataclasses

from lmledger.accounting.gpustep import (
    _links,
    gpu_dtype,
    stand_in_note,
    target_gpu,
    toy_unswapped_matmuls,
)
from lmledger.accounting.steptime import trainer_time_settings
from lmledger.ledger.precision_table import traced_precision, transformer_engine
from lmledger.ledger.timing.gpu.frameworks import lightning_kernels

__all__ = ["plan_layouts"]


def _layout_json(c, num_gpus: int, tokens_per_step: int, tokens: float | None, peak_flops: float, per_token: dict):
    """A candidate as JSON; `per_token`: {recompute: (model FLOPs, FLOPs run) a token}, the MFU's and the kernels'
    (the closed forms' hardware count, which knows no recompute but every block's or none)."""
    from lmledger.ledger.timing.gpu.explain import explain_mfu

    layout, step = c.layout, c.step
    out = {"tensor_parallel": layout.tp, "sequence_parallel": layout.sequence_parallel,
           "context_parallel": layout.cp, "pipeline_parallel": layout.pp,
           "data_parallel": layout.dp,
           "sharding": layout.sharding, "micro_batch": layout.micro_batch, "micro_batches": layout.accumulate,
           "recompute": layout.recompute, "schedule": layout.schedule if layout.pp > 1 else None,
           "chunks_per_rank": layout.virtual}  # fmt: skip
    if c.memory is not None:
        out["peak_bytes"] = c.memory.peak
    if c.dropped:
        return {**out, "dropped": c.dropped}
    rate = c.tokens_per_s(tokens_per_step)
    share = tokens_per_step / num_gpus  # a GPU's share of the step's tokens
    model = per_token["none"][0] * share
    run = per_token[layout.recompute][1] * share if layout.recompute in per_token else None  # no closed form: none
    out.update(step_s=step.total_s, tokens_per_s=rate, mfu=model / (peak_flops * step.total_s),
               breakdown_s=c.breakdown(), days=tokens / rate / 86400 if tokens else None,
               mfu_explained=explain_mfu(step.seconds, model, run, peak_flops) if run else None)  # fmt: skip
    return out


def _dropped_reasons(dropped: list[dict], capacity_bytes: int) -> list[dict]:
    """The dropped layouts grouped by why, most first: those whose peak is over the GPU's memory as one group with the
    range of their peaks ("peak_bytes": [lowest, highest]), any other by its own words."""
    groups: dict[str, list[dict]] = {}
    for r in dropped:
        over = r.get("peak_bytes", 0) > capacity_bytes
        groups.setdefault("" if over else r["dropped"], []).append(r)
    reasons = []
    for reason, rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        if reason:
            reasons.append({"reason": reason, "count": len(rows)})
        else:
            peaks = [r["peak_bytes"] for r in rows]
            reasons.append({"reason": "its peak is over the GPU's memory", "count": len(rows),
                            "peak_bytes": [min(peaks), max(peaks)]})  # fmt: skip
    return reasons


def plan_layouts(argv: list[str], gpu: str | None, num_gpus: int, tokens: float | None, top: int) -> dict:
    """The search for the config `argv` (`--config FILE` and fit overrides) on `num_gpus` of `gpu` (default: the GPU
    the config would be priced on), at the config's global batch; `top` ranked layouts and every dropped one."""
    from lmledger.errors import UserError
    from lmledger.fitting.checks import named_classes
    from lmledger.ledger.closedform.flops import flops_per_token_by_convention
    from lmledger.ledger.hardware.gpus import require_gpu
    from lmledger.ledger.timing.gpu.search import search_layouts
    from lmledger.run_config import load_run

    if named_classes(argv):
        raise UserError("plan layout searches layouts of lmledger's ToyLM configs; for another module, plan one layout "
                        "with `lmledger account --config FILE --gpu KEY`")  # fmt: skip
    spec = load_run(argv)
    unswapped = toy_unswapped_matmuls(spec)
    if unswapped:
        raise UserError(unswapped)
    target, _ = target_gpu(spec.accelerator, gpu, spec.precision)
    target = target or require_gpu("h100-sxm")
    accumulate = trainer_time_settings(argv)["accumulate"]
    global_batch = spec.batch_size * accumulate * max(1, spec.world_size // spec.tensor_parallel)
    dtype = gpu_dtype(spec.precision)
    links = _links(target, argv, num_gpus)
    traced = traced_precision(spec.precision, spec.weights_dtype)
    found = search_layouts(spec.config, spec.seq_len, num_gpus=num_gpus, global_batch=global_batch,
                           capacity_bytes=target.memory_bytes, precision=traced, gpu=target,
                           compute_dtype=dtype, links=links,
                           kernels=lightning_kernels(spec.precision, spec.compiled, bool(spec.fp8)))  # fmt: skip
    per_token = {}  # PaLM's count for the MFU; the hardware count at the layout's recompute for what the kernels run
    for recompute, every in (("none", 0), ("full", 1)):
        counts = flops_per_token_by_convention(dataclasses.replace(spec.config, activation_checkpointing=every),
                                               spec.seq_len)  # fmt: skip
        per_token[recompute] = (counts["palm"], counts["hfu"])
    peak = target.peak_flops[dtype]

    def row(c):
        return _layout_json(c, num_gpus, found.tokens_per_step, tokens, peak, per_token)

    dropped = [row(c) for c in found.dropped]

    return {
        "gpu": target.key, "num_gpus": num_gpus, "memory_bytes": target.memory_bytes, "global_batch": global_batch,
        "seq_len": spec.seq_len, "tokens_per_step": found.tokens_per_step, "tokens": tokens,
        "searched": len(found.ranked) + len(found.dropped), "fits": len(found.ranked),
        "ranked": [row(c) for c in found.ranked[:top]], "dropped": dropped,
        "dropped_reasons": _dropped_reasons(dropped, target.memory_bytes),
        "lowest_peak": min((r for r in dropped if "peak_bytes" in r), key=lambda r: r["peak_bytes"], default=None),
        "links": {"intra_node": links.intra.name, "inter_node": links.inter.name, "gpus_per_node": links.gpus_per_node},
        "not_searched": "interleaving beyond 4 chunks a rank; context parallel below a 16K-token context",
        "notes": [stand_in_note(spec.precision, spec.weights_dtype)] if transformer_engine(spec.precision) else [],
    }  # fmt: skip
