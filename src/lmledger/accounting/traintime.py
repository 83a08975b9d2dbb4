"""`plan train-time --config FILE --tokens D [--gpu KEY] [--num-gpus N]`: the days to train on D tokens at a config's
step time: predicted on this machine for a CPU config, on a GPU by the GPU op-time model (accounting.gpustep) for a GPU
config or with --gpu."""

from __future__ import annotations

from lmledger.accounting.gpustep import target_gpu, toy_gpu_step
from lmledger.accounting.scale import trainer_scale
from lmledger.accounting.step import account_module
from lmledger.accounting.steptime import toy_predicted_time, trainer_time_settings

__all__ = ["train_time_from_config"]


def train_time_from_config(
    argv: list[str], tokens: float, gpu: str | None = None, num_gpus: int | None = None
) -> dict:  # fmt: skip
    """`plan train-time --config FILE [--config FILE2] [--a.b VALUE] --tokens D [--gpu KEY] [--num-gpus N]`: the
    time to train on D tokens. `argv` is the fit's arguments, read as `lmledger fit` reads them.

    A GPU config, or any config with `gpu`: its step on that GPU at its layout (TP from its strategy, data parallel
    over the rest of `num_gpus`, else of its own devices), tokens per step over every data-parallel rank. A CPU
    config without `gpu`: its one-device step predicted on this machine."""
    from lmledger.errors import UserError
    from lmledger.fitting.checks import named_classes
    from lmledger.run_config import load_run

    config = _config_files(argv)
    accumulate = trainer_time_settings(argv)["accumulate"]
    on_cpus = (f"{config} runs on CPUs: plan train-time --config predicts one CPU's step; name a GPU with --gpu to "
               "plan it on several")  # fmt: skip
    if named_classes(argv):
        if num_gpus not in (None, 1):
            raise UserError(
                "plan train-time --config --num-gpus scales lmledger's ToyLM configs; give this module's ranks as its "
                "fit takes them: --trainer.devices N (and --trainer.num_nodes M)"
            )
        result = account_module(argv, gpu=gpu)  # one rank's step at its world size, as account plans it
        if result["time"] is None:
            raise UserError(on_cpus)
        world = result["run"].get("world_size", 1)  # one device's result names none
        tensor_parallel = getattr(trainer_scale(argv), "tensor_parallel", 1) if world > 1 else 1
        replicas = world // tensor_parallel  # a TP group's ranks share their batch
        predicted = result["time"]["predicted"]
        per_step = (result["run"]["tokens_per_step"] or 0) * accumulate * replicas
    else:
        spec = load_run(argv)
        target, why = target_gpu(spec.accelerator, gpu, spec.precision, spec.fp8)
        world = num_gpus or spec.world_size
        if target is not None:
            predicted = toy_gpu_step(spec, argv, target, accumulate, world)
            if why != "--gpu":
                predicted["notes"] = [*predicted.get("notes", ()), why]
        elif world > 1 or num_gpus:
            raise UserError(on_cpus)
        else:
            predicted = toy_predicted_time(spec, argv)
        per_step = spec.batch_size * spec.seq_len * accumulate * (world // spec.tensor_parallel)
    if "none" in predicted:
        raise UserError(f"{config}: {predicted['line']}")
    if not per_step:
        raise UserError(f"{config}: its batches hold no token ids, so there is no tokens/s to plan with")
    step_s = predicted["total_s"]
    seconds = tokens / per_step * step_s
    where = f"on {predicted['priced_on']} (GPU op model)" if predicted.get("priced_on") else "on this machine"
    return {
        "config": config, "tokens": tokens, "tokens_per_step": per_step, "gpu": predicted.get("priced_on"),
        "num_gpus": world, "step_s": step_s, "tokens_per_s": per_step / step_s, "mfu": predicted.get("mfu"),
        "seconds": seconds, "days": seconds / 86400, "source": f"predicted {where}: {predicted['line']}",
        "predicted": predicted,
    }  # fmt: skip


def _config_files(argv: list[str]) -> str:
    """The fit arguments' --config files (or the class they name), as the plan names them; refused without either,
    so that a stray override is not planned on the default model."""
    from lmledger.errors import UserError
    from lmledger.fitting.checks import config_files, named_classes

    files = config_files(argv)
    if not files and not named_classes(argv):
        raise UserError(f"unrecognized arguments: {' '.join(argv)} (a fit config's overrides come with --config "
                        "FILE)")  # fmt: skip
    return ", ".join(files) or named_classes(argv)[0][1]
