"""The step time predicted before anything runs (ledger.timing.steptime), for account, sweep --plan and plan train-time.

`predicted_step_time(ops, ...)`: a dry run's ops priced on this machine, with the trainer's loop, clipping
and data wait. `toy_predicted_time(spec, argv)`: the toy LM's, from its dry run. Each is StepTime.to_json()
with its one line, or {"none": why, "line": ...}.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lmledger.ledger.hardware.peak_flops import compute_dtype_for_precision
from lmledger.ledger.run import Run
from lmledger.ledger.units import format_bytes
from lmledger.model import count_parameters

__all__ = ["no_step_time", "predicted_step_time", "ranks_on_cpus", "toy_predicted_time", "trainer_time_settings"]


def trainer_time_settings(argv: list[str]) -> dict:
    """What of a fit config's trainer the step-time prediction reads: accumulation, clipping, the loop's
    progress bar, logger and logging cadence."""
    from lmledger.fitting.cli import parse_fit_config

    trainer = parse_fit_config(list(argv)).trainer
    get = trainer.get if hasattr(trainer, "get") else lambda k, d=None: getattr(trainer, k, d)
    clip = get("gradient_clip_val")
    algorithm = str(get("gradient_clip_algorithm") or "norm").lower()
    return {
        "accumulate": int(get("accumulate_grad_batches") or 1),
        "clip": ("value" if "value" in algorithm else "norm", float(clip)) if clip else None,
        "progress_bar": get("enable_progress_bar") is not False,
        "logger": get("logger") not in (False, None) or get("logger") is None,
        "log_every_n_steps": int(get("log_every_n_steps") or 50),
    }


def predicted_step_time(
    ops, optimizer, argv: list[str], precision: str, device: torch.device, tokens: int | None, samples: int,
    loader: object = None,
) -> dict:  # fmt: skip
    """StepTime.to_json() of a config's step on this machine (or {"none": why}), with its one line."""
    import os

    from lmledger.callbacks.steptime import NO_STEP_TIME, lightning_loop_seconds

    if os.environ.get(NO_STEP_TIME):
        return no_step_time(f"off ({NO_STEP_TIME} is set)")
    from lmledger.ledger.timing.steptime import StepTime, data_wait, predict_step_time

    settings = trainer_time_settings(argv)
    loop = lightning_loop_seconds(
        progress_bar=settings["progress_bar"], logger=settings["logger"],
        log_every_n_steps=settings["log_every_n_steps"],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = predict_step_time(
            ops, device, compute_dtype=compute_dtype_for_precision(precision), optimizer=optimizer,
            clip=settings["clip"], loop_s=loop[0] if loop else None, loop_how=loop[1] if loop else "",
            data=data_wait(loader) if loader is not None else None, tokens=tokens, samples=samples,
            accumulate=settings["accumulate"],
        )  # fmt: skip
    if not isinstance(result, StepTime):
        return no_step_time(result.reason)
    return {**result.to_json(), "line": result.line()}


def no_step_time(why: str) -> dict:
    """The step-time prediction's JSON shape where there is none: why, and the line printed in its place."""
    return {"none": why, "line": f"no step-time prediction: {why}"}


def ranks_on_cpus(world_size: int) -> dict:
    """no_step_time for a CPU run of several ranks: its step is predicted in the fit, whose ranks replay their ops
    at once, as their steps run (callbacks/steptime.py), not by a planner in one process."""
    return no_step_time(f"{world_size} ranks on CPUs are predicted in their fit, where they replay the step's ops "
                        "together; --gpu NAME plans them on a GPU")  # fmt: skip


def toy_predicted_time(spec: Run, argv: list[str], dry: object = None) -> dict:
    """The ToyLM config's step time predicted here: its dry run on meta weights, its optimizer.

    `dry`: that dry run on this CPU if the caller has it (account's main column), else it is run here."""
    import os

    from lmledger.callbacks.steptime import NO_STEP_TIME
    from lmledger.ledger.dryrun.engine import NotTraced

    if os.environ.get(NO_STEP_TIME):
        return no_step_time(f"off ({NO_STEP_TIME} is set)")
    from lmledger.ledger.hardware.memory import free_memory
    from lmledger.ledger.predict import toy_dry_run, toy_optimizer
    from lmledger.model import ToyLM

    needs = 16 * count_parameters(spec.config)  # params, grads and AdamW's two moments in fp32, before activations
    if needs > free_memory(torch.device("cpu")):
        why = (f"its training state alone ({format_bytes(needs)}) exceeds this machine's free memory, so its ops "
               "cannot run here; `plan train-time --config FILE --gpu NAME` prices it on a GPU")  # fmt: skip
        return no_step_time(why)
    if dry is None:
        accumulate = trainer_time_settings(argv)["accumulate"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dry = toy_dry_run(dataclasses.replace(spec, device=torch.device("cpu")), accumulate)
    if isinstance(dry, NotTraced):
        return no_step_time(dry.reason)
    with torch.device("meta"):  # the optimizer the ops were priced with, over meta weights
        model = ToyLM(spec.config)
    optimizer = toy_optimizer(spec)(list(model.parameters()))
    return predicted_step_time(
        dry.ops, optimizer, argv, spec.precision, torch.device("cpu"),
        spec.tokens_per_batch, spec.batch_size,
    )  # fmt: skip
