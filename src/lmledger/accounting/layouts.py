"""`plan layout --config FILE --gpu KEY --num-gpus N [--tokens D] [--top K]`: the layouts of a config over N GPUs
that fit, ranked by predicted tokens/s, as one JSON shape the command prints. A ToyLM config: every TP x CP x PP x DP
layout (ledger/timing/gpu/search.py). A config naming another LightningModule: data parallel, replicated or sharded,
x the micro-batch, each layout one rank's dry-run step as `account` prices it (plan_module_layouts)."""

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

__all__ = ["plan_layouts", "plan_module_layouts"]

# Lightning's strategies that wrap any module as it is: DDP (replicated) and FSDP (FULL_SHARD). FSDP2 needs the
# module's own configure_model, and TP its own plan: neither is searched for a module the kit did not write.
MODULE_SHARDINGS = ("ddp", "fsdp")
NOT_SEARCHED_FOR_MODULES = ("tensor, context and pipeline parallelism and activation checkpointing (the module's own "
                            "plan and setting)")  # fmt: skip


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


def _dropped_and_links(dropped: list[dict], capacity_bytes: int, links) -> dict:
    """The JSON both searches end with: every dropped layout, grouped by reason, the one nearest to fitting, links."""
    return {
        "dropped": dropped, "dropped_reasons": _dropped_reasons(dropped, capacity_bytes),
        "lowest_peak": min((r for r in dropped if "peak_bytes" in r), key=lambda r: r["peak_bytes"], default=None),
        "links": {"intra_node": links.intra.name, "inter_node": links.inter.name, "gpus_per_node": links.gpus_per_node},
    }  # fmt: skip


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
        return plan_module_layouts(argv, gpu, num_gpus, tokens, top)
    spec = load_run(argv)
    unswapped = toy_unswapped_matmuls(spec)
    if unswapped:
        raise UserError(unswapped)
    target, _ = target_gpu(spec.accelerator, gpu, spec.precision, spec.fp8)
    target = target or require_gpu("h100-sxm")
    _refuse_unpriced(target, gpu_dtype(spec.precision), transformer_engine(spec.precision) or bool(spec.fp8))
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

    return {
        "gpu": target.key, "num_gpus": num_gpus, "memory_bytes": target.memory_bytes, "global_batch": global_batch,
        "seq_len": spec.seq_len, "tokens_per_step": found.tokens_per_step, "tokens": tokens,
        "searched": len(found.ranked) + len(found.dropped), "fits": len(found.ranked),
        "ranked": [row(c) for c in found.ranked[:top]],
        **_dropped_and_links([row(c) for c in found.dropped], target.memory_bytes, links),
        "not_searched": "interleaving beyond 4 chunks a rank; context parallel below a 16K-token context",
        "notes": [stand_in_note(spec.precision, spec.weights_dtype)] if transformer_engine(spec.precision) else [],
    }  # fmt: skip


def _refuse_unpriced(target, dtype: str, fp8: bool) -> None:
    """plan layout ranks by the GPU op model's time: a GPU it cannot price (no SM count or architecture in the table,
    no peak in the step's dtype, or in fp8 for fp8 linears) is refused before the search, whose every layout it would
    drop."""
    from lmledger.errors import UserError
    from lmledger.ledger.timing.gpu.kernels import chip_of

    try:
        chip = chip_of(target)
        for needed in (dtype, "fp8") if fp8 else (dtype,):
            chip.peak(needed)
    except ValueError as err:
        raise UserError(f"plan layout ranks layouts by their predicted time, and {err}: choose another --gpu "
                        "(`lmledger gpus` lists them)") from None  # fmt: skip


def _gpus_in_nodes(num_gpus: int) -> tuple[int, int]:
    """(devices a node, nodes) for `num_gpus`: one node of up to 8, else whole nodes of 8."""
    from lmledger.errors import UserError

    if num_gpus <= 8:
        return num_gpus, 1
    if num_gpus % 8:
        raise UserError(f"--num-gpus {num_gpus} does not fill nodes of 8 GPUs: give 1 to 8, or a multiple of 8")
    return 8, num_gpus // 8


def _module_micro_batches(share: int) -> list[int]:
    """The micro-batches a replica's `share` of the batch is searched at: the powers of 2 that divide it, and itself."""
    return sorted({b for b in (2**i for i in range(share.bit_length())) if share % b == 0} | {share})


def plan_module_layouts(argv: list[str], gpu: str | None, num_gpus: int, tokens: float | None, top: int) -> dict:
    """plan_layouts for a config naming any LightningModule: data parallel over `num_gpus`, replicated (DDP) or fully
    sharded (Lightning's FSDP), x the micro-batch, at the config's global batch (its data's batch_size x accumulation x
    data-parallel ranks). Each layout is one rank's dry-run step at that world size, priced on the GPU as `account
    --gpu` prices it (accounting.step.account_module); the module's own precision and checkpointing stay."""
    from lmledger.accounting.scale import trainer_scale
    from lmledger.accounting.step import account_module
    from lmledger.errors import UserError
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.ledger.hardware.gpus import require_gpu

    config = parse_fit_config(list(argv))
    scale = trainer_scale(argv)  # fit's own checks of the trainer's values
    if scale.tensor_parallel > 1:
        raise UserError(f"plan layout searches data-parallel layouts of a module; this one is split over "
                        f"tensor_parallel_size {scale.tensor_parallel} by its own configure_model: plan that layout "
                        "with `lmledger account --config FILE --gpu KEY`")  # fmt: skip
    batch = config.get("data.init_args.batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool):
        raise UserError("plan layout varies the micro-batch through the data module's batch_size argument, which "
                        "this config's data has not: plan its one layout with `lmledger account --config FILE --gpu "
                        "KEY`")  # fmt: skip
    accumulate = trainer_time_settings(argv)["accumulate"]
    global_batch = batch * accumulate * scale.world_size
    share, rest = divmod(global_batch, num_gpus)
    if rest or not share:
        replicas = f"{scale.world_size} replica" + ("s" if scale.world_size > 1 else "")
        raise UserError(
            f"the global batch {global_batch} (batch_size {batch} x accumulation {accumulate} x "
            f"{replicas}) does not split over {num_gpus} GPUs: choose a --num-gpus that divides it"
        )
    precision = str(config.get("trainer.precision") or "32-true")
    target, _ = target_gpu(config.get("trainer.accelerator"), gpu, precision)
    target = target or require_gpu("h100-sxm")
    _refuse_unpriced(target, gpu_dtype(precision), transformer_engine(precision))
    devices, nodes = _gpus_in_nodes(num_gpus)
    at = ["--trainer.accelerator", "gpu", "--trainer.devices", str(devices), "--trainer.num_nodes", str(nodes)]
    rows, seq = [], None
    for sharding in MODULE_SHARDINGS if num_gpus > 1 else ("ddp",):
        for micro in _module_micro_batches(share):
            args = [*argv, *at, "--trainer.strategy", sharding, "--trainer.accumulate_grad_batches",
                    str(share // micro), "--data.init_args.batch_size", str(micro)]  # fmt: skip
            out = account_module(args, target.key)
            seq = seq or out["run"]["tokens_per_step"] // max(1, out["run"]["batch_size"])
            figures, step = out["predictors"]["dry run"], out["time"]["predicted"]
            peak = figures.peak
            row = {"tensor_parallel": 1, "sequence_parallel": False, "context_parallel": 1, "pipeline_parallel": 1,
                   "data_parallel": num_gpus, "sharding": sharding if num_gpus > 1 else "none", "micro_batch": micro,
                   "micro_batches": share // micro, "recompute": "the module's", "schedule": None,
                   "chunks_per_rank": 1}  # fmt: skip
            if peak is not None:
                row["peak_bytes"] = peak
            if peak is not None and peak > target.memory_bytes:
                row["dropped"] = f"its peak {peak / 1e9:.1f} GB is over the GPU's {target.memory_bytes / 1e9:.0f} GB"
            elif peak is None:  # whether it fits is not known: not ranked beside layouts that do
                row["dropped"] = f"its peak is not predicted: {figures.why_missing.get('peak') or 'no dry run'}"
            elif "total_s" not in step:
                row["dropped"] = step.get("none") or "no step time"
            else:
                row["step"] = step
            rows.append(row)
    tokens_per_step = global_batch * seq if seq else global_batch
    ranked = sorted((r for r in rows if "step" in r), key=lambda r: r["step"]["total_s"])
    for r in ranked:
        step = r.pop("step")
        s = step["seconds"]
        rate = tokens_per_step / step["total_s"]
        r.update(step_s=step["total_s"], tokens_per_s=rate, mfu=step.get("mfu"), days=tokens / rate / 86400 if tokens
                 else None, mfu_explained=step.get("mfu_explained"),
                 breakdown_s={"compute": sum(s.get(c, 0.0) for c in ("matmul", "attention", "other", "optimizer")),
                              "communication": s.get("communication", 0.0), "bubble": 0.0,
                              "host": s.get("host", 0.0)})  # fmt: skip
    return {
        "gpu": target.key, "num_gpus": num_gpus, "memory_bytes": target.memory_bytes, "global_batch": global_batch,
        "seq_len": seq, "tokens_per_step": tokens_per_step, "tokens": tokens, "searched": len(rows),
        "fits": len(ranked), "ranked": ranked[:top],
        **_dropped_and_links([r for r in rows if "dropped" in r], target.memory_bytes,
                             _links(target, [*argv, *at], num_gpus)),
        "not_searched": NOT_SEARCHED_FOR_MODULES, "notes": [],
    }  # fmt: skip
