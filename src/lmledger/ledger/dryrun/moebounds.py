"""The dry run under both mixture-of-experts routings: balanced and worst (ledger.dryrun.moe says what each assumes).

Above the engine: it calls dryrun.dry_run twice, while dryrun uses only moe's routing mode.

    dry_run_bounds(model, batch, ...)   any model: a StepLedger, MoEBounds where routing decides a
                                        shape, or NotTraced
    predict_moe                         both bounds
    routing_dependent(result)           whether a NotTraced is the routing line
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lmledger.ledger.dryrun import engine as dryrun
from lmledger.ledger.dryrun.moe import ROUTING_REASON, ROUTINGS, Assumption
from lmledger.ledger.dryrun.steptypes import NotTraced, StepLedger

__all__ = ["MoEBounds", "dry_run_bounds", "predict_moe", "routing_dependent"]


@dataclass(frozen=True)
class MoEBounds:
    """The dry run under both routing assumptions: two dryrun.StepLedger.

    `routing_matters` is False when they agree on every figure routing could change. Then either is
    the prediction. That happens on a grouped GEMM path, an MoE whose temporaries never set a peak,
    or no MoE at all.
    """

    balanced: StepLedger
    worst: StepLedger
    routing_matters: bool


# The StepLedger figures a routing can change. It cannot change params, grads or optimizer state.
_ROUTED_FIGURES = ("peak", "phase_peaks", "activations", "flops_forward", "flops_backward")


def routing_dependent(result: object) -> bool:
    """Whether a dry run's NotTraced says routing decided a shape; predict_moe then answers."""
    return ROUTING_REASON in str(getattr(result, "reason", ""))


def predict_moe(
    model: nn.Module, batch: object, *, capacity: int | None = None, **dry_run_kwargs: object
) -> MoEBounds | NotTraced:
    """The dry run of `model` under balanced and worst routing.

    MoEBounds, or the NotTraced of the first that does not trace. `capacity` is the tokens an expert
    keeps per call, for a layer that drops the rest. Without it the worst routing sends every token to
    the heavy experts. Such a layer drops them: less than balanced. Other keywords are dry_run's
    (step, optimizer, precision, ...).
    """
    results = {}
    for name in ROUTINGS:
        assumption = Assumption(name, capacity if name == "worst" else None)
        result = dryrun.dry_run(model, batch, routing=assumption, **dry_run_kwargs)
        if isinstance(result, dryrun.NotTraced):
            return result
        results[name] = result
    balanced, worst = results["balanced"], results["worst"]
    matters = any(getattr(balanced, name) != getattr(worst, name) for name in _ROUTED_FIGURES)
    return MoEBounds(balanced=balanced, worst=worst, routing_matters=matters)


def dry_run_bounds(
    model: nn.Module, batch: object, *, capacity: int | None = None, **dry_run_kwargs: object
) -> StepLedger | MoEBounds | NotTraced:
    """The dry run of any model, MoE or not: a StepLedger, MoEBounds or NotTraced.

    MoEBounds where top-k routing decides a shape. The dry run stops at the first such shape, then
    predict_moe runs both assumptions. Callers that do not know whether the model routes call this
    (Ledger(), account).
    """
    result = dryrun.dry_run(model, batch, **dry_run_kwargs)
    if routing_dependent(result):
        return predict_moe(model, batch, capacity=capacity, **dry_run_kwargs)
    return result
