"""One rank of a fit config at its world size and strategy: per-rank dry runs (ledger.sharding.atscale,
ledger.sharding.sharded).

`per_rank(spec)`: the toy LM's checkpointing cases; `any_model_at_scale(argv)`: any LightningModule's.
`trainer_scale` and `scale_links` read the devices, nodes, strategy and links as `fit` reads them.
`print_per_rank` renders a per-rank table through ledger.report.render, each case's rows from its Figures.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lmledger.ledger.run import Run
from lmledger.ledger.sharding.atscale import AtScale
from lmledger.ledger.units import format_bytes

__all__ = [
    "AC_LABELS", "add_per_rank", "any_model_at_scale", "at_scale", "per_rank",
    "print_any_model_at_scale", "print_per_rank", "scale_links", "traced_at_scale", "trainer_scale",
]  # fmt: skip


AC_LABELS = ("checkpointing off", "checkpointing on")


def traced_at_scale(spec: Run) -> bool:
    """Whether a ToyLM run's per-rank dry run (ledger.sharding.sharded) says more than the closed forms.

    It does for DDP over several ranks (its buckets) and for FSDP2 (its gathered blocks).
    ZeRO, FSDP1 and DeepSpeed keep the closed forms. Their state bytes are what the dry run would give."""
    return (spec.strategy in ("ddp", "auto", "single_device") and spec.world_size > 1) or spec.strategy == "fsdp2"


def add_per_rank(result: dict, spec: Run, argv: list[str]) -> None:
    """Set result["per_rank"]: one rank's dry run (an atscale.AtScale) at the config's world size and strategy.

    Where it traces the strategy (DDP's buckets, FSDP2's gathered blocks are in it) its case for the config's
    checkpointing (every block, or none) becomes the main predictor, "dry run", bytes and FLOPs; the closed
    forms stay beside it. The predictor is recorded in result["predictors"], the main one first."""
    result["per_rank"] = per_rank(spec, argv=argv)
    if spec.config.activation_checkpointing in (0, 1):
        case = result["per_rank"].cases[AC_LABELS[spec.config.activation_checkpointing]]
        if case.not_predicted is None and case.peak_checked:
            result["predictors"] = {"dry run": case.figures, **result["predictors"]}


def per_rank(spec: Run, capacity_bytes: int | None = None, argv: list[str] = ()) -> AtScale:
    """ledger.sharding.atscale.toy_at_scale with account's case names: checkpointing off and on.

    The strategy's settings come from the fit arguments `argv` (_scale_settings); without them (a sweep's
    listing), from the Run, which holds the tensor-parallel size."""
    from lmledger.ledger.sharding.atscale import toy_at_scale

    scale = trainer_scale(argv) if argv else None
    settings = {**_scale_settings(scale), "links": scale_links(argv, scale)} if argv else _scale_settings(spec)
    return toy_at_scale(spec, capacity_bytes, labels=AC_LABELS, **settings)


def trainer_scale(argv: list[str]):
    """The devices, nodes and strategy (a run_config.TrainerScale) that a fit's arguments ask for.

    They are parsed as `lmledger fit` parses them and checked by fit's own check of a config's values
    (fitting.checks.check_fit_values), so a value fit refuses is refused here in the same words. Nothing is
    built: a model at scale is then built on the meta device."""
    from lmledger.fitting.checks import check_fit_values
    from lmledger.fitting.cli import parse_fit_config

    return check_fit_values(parse_fit_config(list(argv)))


def scale_links(argv: list[str], scale):
    """The links a run at scale's collectives cross (ledger.hardware.interconnect.Links): --ledger.intra_node and
    --ledger.inter_node where given, else an H100 node's (NVLink 4, NDR), split at the devices a node of
    `scale` (the arguments' trainer_scale, which the caller has). None for a CPU run on one machine (gloo's
    collectives there are memory copies)."""
    from lmledger.fitting.cli import parse_fit_config
    from lmledger.ledger.hardware.interconnect import links_for

    config = parse_fit_config(list(argv))
    intra, inter = config.get("ledger.intra_node"), config.get("ledger.inter_node")
    if str(config.get("trainer.accelerator") or "auto") == "cpu" and scale.num_nodes == 1 and not (intra or inter):
        return None
    return links_for(None, intra, inter, scale.devices, scale.num_nodes)


def _scale_settings(scale, module=None) -> dict:
    """The keyword arguments at_scale takes from the strategy's init_args (a run_config.TrainerScale's, or a Run's,
    which has none).

    DDP's bucket settings: DDPStrategy passes them through to torch's DDP.
    A ModelParallelStrategy with tensor_parallel_size > 1 is FSDP2 x TP on a (data_parallel x tensor_parallel)
    mesh (ledger.sharding.tp): the toy LM's own plan, or a module's configure_model replayed on the fake mesh."""
    from lmledger.ledger.sharding.ddp import DDPSettings

    tensor_parallel = getattr(scale, "tensor_parallel", 1)
    if tensor_parallel > 1:
        from lmledger.ledger.sharding.fsdp2 import FSDPSettings
        from lmledger.ledger.sharding.tp import replay_configure_model

        shard = replay_configure_model if module is not None and hasattr(module, "configure_model") else None
        return {"fsdp": FSDPSettings(tensor_parallel=tensor_parallel, shard=shard)}
    return {"ddp": DDPSettings.from_kwargs(getattr(scale, "init_args", {}))} if scale.strategy == "ddp" else {}


def at_scale(world_size: int, strategy: str) -> bool:
    return world_size > 1 or strategy not in ("ddp", "auto", "single_device")


def any_model_at_scale(argv: list[str], capacity_bytes: int | None = None, gpu: str | None = None) -> dict:
    """One rank's dry run of any LightningModule, at the arguments' world size and strategy.

    Cases: as configured, and every block checkpointed (ledger.sharding.sharded). The module is built on the
    meta device, so an 8B model costs no memory. The batch is shaped like its data's first batch."""
    from lmledger.accounting.gpustep import module_precision, stand_in_note, target_gpu
    from lmledger.accounting.steptime import ranks_on_cpus
    from lmledger.callbacks.dryrun import samples_per_batch, tokens_per_batch
    from lmledger.fitting.cli import build_model_and_data, first_batch
    from lmledger.ledger import predict as ledger_predict
    from lmledger.ledger.sharding import atscale

    scale = trainer_scale(argv)
    world_size, strategy, links = scale.world_size, scale.strategy, scale_links(argv, scale)
    with torch.device("meta"):
        module, data, config = build_model_and_data(argv)
    batch = first_batch(data)
    precision, traced, weights = module_precision(config.trainer, module)  # Transformer Engine's traced as its weights'
    samples = samples_per_batch(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale = atscale.at_scale(
            module, lambda size: ledger_predict.resized(batch, size), samples, strategy=strategy, world_size=world_size,
            capacity_bytes=capacity_bytes, step=ledger_predict.module_step, precision=traced, links=links,
            **ledger_predict.optimizer_arguments(module), **_scale_settings(scale, module),
        )  # fmt: skip
    tokens = tokens_per_batch(module, batch)
    timed = scale.configured
    if target_gpu(config.trainer.get("accelerator"), gpu, precision)[0] is not None:
        timed = _timing_case(module, batch, samples, strategy, world_size, traced, scale.configured)
    time = _rank_gpu_time(timed, config, gpu, precision, tokens, samples, argv)
    if time is None and world_size > 1:  # on CPUs: the fit predicts it
        time = {"predicted": ranks_on_cpus(world_size)}
    if time is not None and traced != precision and "none" not in time["predicted"]:
        time["predicted"]["notes"].append(stand_in_note(precision, weights))
    return {
        "time": time,
        "params": ledger_predict.parameter_count(module),
        "run": {
            "model": config.model.class_path,
            "batch_size": samples,
            "tokens_per_step": tokens,
            "precision": precision,
            "strategy": strategy,
            "world_size": world_size,
            "device": "cpu",
        },
        "per_rank": scale,
        # the main predictor: the case as the module is configured (its first), bytes and hardware FLOPs per rank;
        # no model FLOPs for a module that is not the toy LM, as on one device
        "predictors": {"dry run": dataclasses.replace(scale.configured.figures, flops_model=None)},
        "measured": None,
    }


def _timing_case(module, batch, samples: int, strategy: str, world_size: int, precision: str, case):
    """The rank's case whose ops carry its collectives: FSDP1 and ZeRO-3 are dry-run as FSDP2 (the same all-gathers
    and reduce-scatters per block), ZeRO-1/2 as DDP (the same bytes reduced); their own case is state-only, the
    single device's ops."""
    from lmledger.ledger import predict as ledger_predict
    from lmledger.ledger.sharding import atscale
    from lmledger.ledger.sharding.rankstate import STATE_ONLY

    if strategy not in STATE_ONLY:
        return case
    stand_in = "fsdp2" if strategy in ("fsdp", "zero3", "deepspeed_stage_3") else "ddp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = atscale.at_scale(module, lambda size: ledger_predict.resized(batch, size), samples, strategy=stand_in,
                                 world_size=world_size, step=ledger_predict.module_step, precision=precision,
                                 labels=("as configured", "every block checkpointed"),
                                 **ledger_predict.optimizer_arguments(module))  # fmt: skip
    return found.configured if found.configured.ops is not None else case


def _rank_gpu_time(case, config, gpu: str | None, precision: str, tokens, samples: int, argv) -> dict | None:
    """One rank's step on its GPU (accounting.gpustep), where the config runs on one or `gpu` names one."""
    from lmledger.accounting.gpustep import ops_gpu_step, target_gpu
    from lmledger.accounting.steptime import trainer_time_settings

    target, why = target_gpu(config.trainer.get("accelerator"), gpu, precision)
    if target is None or case.ops is None:
        return None
    accumulate = trainer_time_settings(list(argv))["accumulate"]
    scale = trainer_scale(argv)
    # DDP's buckets, which its emulated Reducer leaves out of the ops, reduced in backward as their gradients fill
    step = ops_gpu_step(case.ops, target, precision, tokens, samples, accumulate, buckets=case.bucket_sizes,
                        world_size=scale.world_size, argv=argv)  # fmt: skip
    step["notes"] = [*step.get("notes", ()), *([why] if why != "--gpu" else [])]
    return {"predicted": step}


def print_per_rank(scale: AtScale) -> None:
    """The per-rank table of a run at scale: state, buffers and peak per checkpointing case."""
    from rich.console import Console

    from lmledger.ledger.report import render

    tp = scale.tensor_parallel
    shape = f" (data parallel {scale.world_size // tp} x tensor parallel {tp})" if tp > 1 else ""
    title = f"per rank: {scale.strategy} over {scale.world_size} ranks{shape}, batch {scale.batch_size}"
    cases, table = list(scale.cases.values()), []
    rows = [("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "activations"),
            ("comm buffers (DDP buckets, FSDP2 gathers)", "comm_buffers"), ("peak", "peak")]  # fmt: skip
    if scale.capacity_bytes:
        rows.append(("largest micro-batch per rank", "max_batch"))
    links = next((c.communication["links"] for c in cases if c.communication), None)
    if links:
        rows += [(f"collectives per step in a node ({links['intra_node']['name']})", "intra-node"),
                 (f"collectives per step between nodes ({links['inter_node']['name']})", "inter-node")]  # fmt: skip
    for label, key in rows:
        table.append((label, *(_per_rank_cell(case, key) for case in cases)))
    Console().print(render(["", *scale.cases], table, title=title))  # the one renderer, as the ledger's
    if links:
        intra, inter = links["intra_node"], links["inter_node"]
        print(f"collectives: {links['num_nodes']} node(s) of {links['gpus_per_node']} ranks; in a node {intra['name']} "
              f"at {intra['bytes_per_s'] / 1e9:.4g} GB/s, between nodes {inter['name']} at "
              f"{inter['bytes_per_s'] / 1e9:.4g} GB/s one way (--ledger.intra_node / --ledger.inter_node set them); "
              "a ring's bytes at line rate, none overlapped with compute")  # fmt: skip
        for note in dict.fromkeys(link["note"] for link in (intra, inter) if link.get("note")):
            print(f"note: {note}")
    for label, case in scale.cases.items():
        if case.not_predicted:
            print(f"{label}: not predicted: {case.not_predicted}")
        elif case.max_batch == 0:
            print(f"{label}: does not fit: one sample per rank is over by {format_bytes(case.over_by_at_batch_1)}")
        elif not case.peak_checked:
            print(f"{label}: the peak is the single-device step's with the sharded state swapped in, not yet held "
                  "to a measurement (checked on a GPU when one is lent)")  # fmt: skip


def _per_rank_cell(case, key: str) -> str:
    """One cell of print_per_rank's table: a row of the case's Figures, or what only a rank at scale has."""
    if case.not_predicted:
        return "—"
    if key in ("intra-node", "inter-node"):
        spent = [r for r in (case.communication or {}).get("by_link", {}).values() if r["scope"] == key]
        return f"{sum(r['seconds'] for r in spent) * 1e3:.4g} ms" if spent else "—"
    if key == "max_batch":
        return "—" if case.max_batch is None else f"{case.max_batch:,}"
    if key == "comm_buffers":
        return format_bytes(case.comm_buffers)
    return format_bytes(case.figures.get(key)) + (" (unchecked)" if key == "peak" and not case.peak_checked else "")


def print_any_model_at_scale(result: dict) -> None:
    run = result["run"]
    print(
        f"{run['model']}: {result['params']:,} params, {run['batch_size']} samples per rank, {run['precision']}; "
        "dry-run on the meta device with the CPU's kernels (a GPU's attention kernels may hold more or less)"
    )
    print_per_rank(result["per_rank"])
