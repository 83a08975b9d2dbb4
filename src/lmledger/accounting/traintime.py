"""`plan train-time --config FILE --tokens D [--gpu KEY]`: the days to train on D tokens at a config's step time."""

from __future__ import annotations

from lmledger.accounting.step import account_any_model
from lmledger.accounting.steptime import toy_predicted_time, trainer_time_settings

__all__ = ["train_time_from_config"]


def train_time_from_config(config: str, tokens: float, gpu: str | None = None) -> dict:
    """`plan train-time --config FILE --tokens D [--gpu KEY]`: the time to train on D tokens.

    Without a GPU: at the step time predicted on this machine (ledger.timing.steptime). With one: at that GPU's
    roofline bound of the same step (its datasheet peaks and bandwidth), the fastest it could run there,
    so an upper bound on speed, until a GPU results file gives per-category efficiencies for it."""
    from lmledger.errors import UserError
    from lmledger.fitting.checks import named_classes
    from lmledger.run_config import load_run

    argv = ["--config", config]
    if named_classes(argv):
        if gpu is not None:
            raise UserError("plan train-time --config --gpu prices lmledger's ToyLM configs; drop --gpu for this one")
        result = account_any_model(argv, False, step_time=True)
        predicted, per_step = result["time"]["predicted"], result["run"]["tokens_per_step"]
        spec = None
    else:
        spec = load_run(argv)
        if spec.world_size > 1:
            raise UserError(
                f"{config} runs on {spec.world_size} devices: plan train-time --config predicts one device's step; "
                "fit it with the Ledger to see its step time"
            )
        predicted = toy_predicted_time(spec, argv) if gpu is None else {}
        per_step = spec.tokens_per_batch * trainer_time_settings(argv)["accumulate"]
    if "none" in predicted:
        raise UserError(f"{config}: {predicted['line']}")
    if not per_step:
        raise UserError(f"{config}: its batches hold no token ids, so there is no tokens/s to plan with")
    out = {"config": config, "tokens": tokens, "tokens_per_step": per_step, "gpu": gpu}
    if gpu is None:
        step_s, source = predicted["total_s"], f"predicted on this machine: {predicted['line']}"
    else:
        from lmledger.ledger.hardware.peak_flops import compute_dtype_for_precision
        from lmledger.ledger.timing.roofline import gpu_roofline, toy_step_ops

        ops = toy_step_ops(spec.config, spec.batch_size, spec.seq_len, spec.precision)
        bound = gpu_roofline(ops, compute_dtype_for_precision(spec.precision), gpu)
        step_s = bound.seconds * trainer_time_settings(argv)["accumulate"]
        source = (
            f"roofline bound on {bound.device} (datasheet peaks and bandwidth): an upper bound on speed, so the days "
            "are a floor; no GPU results file gives this GPU's per-category efficiencies yet"
        )
    seconds = tokens / per_step * step_s
    out.update(step_s=step_s, tokens_per_s=per_step / step_s, seconds=seconds, days=seconds / 86400, source=source)
    return out
