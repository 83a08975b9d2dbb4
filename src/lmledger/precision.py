"""Precision names -> what the Trainer gets, the checks that run before it is built, and fp8.

Precisions (Lightning's names; what each keeps and runs in is in lmledger.ledger.precision_table):

    32-true              fp32 weights, grads, AdamW state and matmuls
    bf16-mixed           fp32 weights and state, matmuls in bf16 under torch.autocast
    16-mixed             the same with fp16, plus dynamic loss scaling (GradScaler)
    bf16-true, 16-true   the whole model (and so AdamW's state) converted to bf16 / fp16
    transformer-engine   fp8 matmuls in NVIDIA Transformer Engine's te.Linear, weights bf16
                         (-float16: fp16); TiedTransformerEnginePrecision(weights_dtype="float32")
                         keeps fp32 master weights instead

fp8 comes two ways. One is the Transformer Engine precision plugin above. The other is torchao's
float8 training (`model.fp8: torchao`, see _convert_linears_to_float8), inside bf16-mixed or bf16-true.
Both need their library (the fp8-te / fp8-ao extras). Both need a GPU with fp8 tensor cores.
When either is missing, check_precision says so in one line. Nothing falls back to bf16 behind the
user's back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import lightning.fabric.plugins.precision.transformer_engine as lightning_te
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, TransformerEnginePrecision
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lmledger.errors import UserError
from lmledger.ledger.precision_table import ROWS, normalize_precision

__all__ = [
    "TiedTransformerEnginePrecision",
    "apply_fp8",
    "check_precision",
    "check_trainer_config",
    "local_device",
    "predicted_device",
    "requested_precision",
    "resolve_accelerator",
    "trainer_precision_kwargs",
]


_FP8_PATHS = ("torchao",)  # values of LitLM's `fp8` switch; Transformer Engine is a trainer precision
_TE_PRECISIONS = tuple(row.name for row in ROWS.values() if row.transformer_engine)
_BF16_PRECISIONS = tuple(row.name for row in ROWS.values() if row.compute_dtype == "bf16")

# fp8 tensor cores (and torch._scaled_mm on CUDA) start at sm_89, Ada; bf16 ones at sm_80, Ampere.
_FP8_MIN_CAPABILITY = (8, 9)
_BF16_MIN_CAPABILITY = (8, 0)

_TORCHAO_AVAILABLE = RequirementCache("torchao>=0.8")
_WEIGHTS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ----------------------------------------------------------------------------------------------
# Checks, run before anything is built
# ----------------------------------------------------------------------------------------------


def resolve_accelerator(accelerator: object = "auto") -> str:
    """The device type a Trainer `accelerator` flag lands on: "cpu", "cuda", "mps" or other."""
    name = "auto" if accelerator is None else str(accelerator).lower()
    if name in ("auto", "gpu"):
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cuda" if name == "gpu" else "cpu"  # "gpu" without one: Lightning reports that itself
    return name


def predicted_device(accelerator: object) -> torch.device:
    """The device a machine-independent prediction is for: CUDA if the config names a GPU, else CPU."""
    return torch.device("cuda" if str(accelerator).lower() in ("gpu", "cuda") else "cpu")


def local_device(accelerator: object = "auto") -> torch.device:
    """Where the config's step runs on this machine, to measure it: CUDA if asked for and here, else CPU."""
    here = resolve_accelerator(accelerator) == "cuda" and torch.cuda.is_available()
    return torch.device("cuda" if here else "cpu")


def _cuda_capability() -> tuple[int, int] | None:
    """The lowest compute capability among the visible CUDA devices (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))


def _fp8_hardware_problem(device: str, capability: tuple[int, int] | None) -> str | None:
    need = "fp8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper or later)"
    if device != "cuda":
        return f"this run is on {device}, not on a GPU with {need}"
    if capability is None:
        return f"no CUDA GPU is visible (fp8 needs one with {need})"
    if capability < _FP8_MIN_CAPABILITY:
        return f"this GPU is sm_{capability[0]}{capability[1]}, without {need}"
    return None


def _require_fp8(what: str, library: str, installed: bool, extra: str, device: str, capability, instead: str) -> None:
    missing = [] if installed else [f"{library} is not installed (pip install 'lmledger[{extra}]')"]
    hardware = _fp8_hardware_problem(device, capability)
    if hardware:
        missing.append(hardware)
    if missing:
        raise UserError(f"{what} cannot run: {' and '.join(missing)}. Fix this, or {instead}")


def check_precision(
    precision: str | int | None,
    accelerator: object = "auto",
    fp8: str | None = None,
    *,
    capability: tuple[int, int] | None = None,
) -> None:
    """Raise UserError (one line) if `precision` (with LitLM's `fp8` switch) cannot run on
    `accelerator`. `capability` stands in for the CUDA device's (default: asked of torch)."""
    name = "32-true" if precision is None else normalize_precision(precision)
    device = resolve_accelerator(accelerator)
    if device == "cuda" and capability is None:
        capability = _cuda_capability()

    if fp8 is not None:
        if fp8 not in _FP8_PATHS:
            raise UserError(
                f"unknown model.fp8 {fp8!r}: use torchao, or null (Transformer Engine is "
                "--trainer.precision transformer-engine)"
            )
        _require_fp8(
            "fp8 through torchao (model.fp8=torchao)", "torchao", bool(_TORCHAO_AVAILABLE), "fp8-ao",
            device, capability, instead="drop --model.fp8",
        )  # fmt: skip
        if name in _TE_PRECISIONS:
            raise UserError(f"model.fp8=torchao and trainer.precision={name} are two fp8 paths: choose one")
        if name not in _BF16_PRECISIONS:
            raise UserError(
                f"model.fp8=torchao runs inside bf16 training: set --trainer.precision bf16-mixed or bf16-true "
                f"(got {name})"
            )

    if name in _TE_PRECISIONS:
        _require_fp8(
            f"fp8 through Transformer Engine (trainer.precision={name})", "transformer_engine",
            bool(lightning_te._TRANSFORMER_ENGINE_AVAILABLE), "fp8-te", device, capability,
            instead="choose a precision without fp8, e.g. --trainer.precision bf16-mixed",
        )  # fmt: skip

    if name in _BF16_PRECISIONS and device == "cuda" and capability is not None and capability < _BF16_MIN_CAPABILITY:
        raise UserError(
            f"precision {name} needs bfloat16 tensor cores (compute capability >= 8.0, Ampere or later); "
            f"this GPU is sm_{capability[0]}{capability[1]}: use --trainer.precision 16-mixed"
        )


def _as_list(plugins: object) -> list:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _names_te_plugin(spec: object) -> bool:
    """Whether a parsed --trainer.plugins entry (class_path spec, or instance) is a TE precision."""
    if isinstance(spec, TransformerEnginePrecision):
        return True
    class_path = spec.get("class_path") if isinstance(spec, Mapping) else getattr(spec, "class_path", None)
    return isinstance(class_path, str) and class_path.endswith("TransformerEnginePrecision")


def _te_weights_dtype(spec: object) -> torch.dtype:
    if isinstance(spec, TransformerEnginePrecision):
        return spec.weights_dtype
    init_args = spec.get("init_args") if isinstance(spec, Mapping) else getattr(spec, "init_args", None)
    name = (init_args or {}).get("weights_dtype") or "bfloat16"
    return _dtype(str(name).removeprefix("torch."))


def requested_precision(trainer: Any) -> tuple[str, torch.dtype | None]:
    """(precision, weights dtype) that a parsed `trainer` config section asks for.

    The section is mapping-like: precision, plugins. The weights dtype is that of a Transformer
    Engine plugin in `plugins`, else None. These are the two arguments that
    lmledger.ledger.closedform.memory.state_bytes takes."""
    precision = trainer.get("precision")
    te_plugins = [spec for spec in _as_list(trainer.get("plugins")) if _names_te_plugin(spec)]
    if not te_plugins:
        return ("32-true" if precision is None else normalize_precision(precision)), None
    if precision is not None:
        raise UserError(
            f"trainer.precision={precision} and a Transformer Engine precision plugin were both given: "
            "set --trainer.precision null when passing the plugin"
        )
    weights = _te_weights_dtype(te_plugins[0])
    return ("transformer-engine-float16" if weights == torch.float16 else "transformer-engine"), weights


def check_trainer_config(trainer: Any, fp8: str | None = None) -> None:
    """check_precision for a parsed, not yet instantiated, `trainer` config section.

    The section is mapping-like: precision, accelerator, plugins. A Transformer Engine plugin in
    `plugins` counts as fp8."""
    precision, _ = requested_precision(trainer)
    check_precision(precision, trainer.get("accelerator"), fp8)


# ----------------------------------------------------------------------------------------------
# What the Trainer gets
# ----------------------------------------------------------------------------------------------


def trainer_precision_kwargs(precision: str | int | None, accelerator: object = "auto", plugins: object = None) -> dict:
    """Trainer keyword arguments for `precision`.

    Usually `precision=NAME`. Where Lightning's own choice is not what we want, it is `precision=None`
    and `plugins=[*plugins, OUR_PLUGIN]`. Two cases:

    transformer-engine(-float16) gets TiedTransformerEnginePrecision, which keeps tied weights tied.

    16-mixed on CPU gets Lightning's fp16 MixedPrecision plugin, explicitly. Lightning would swap it
    for bf16-mixed (canary test_16_mixed_on_cpu_becomes_bf16). But torch runs fp16 autocast and
    GradScaler on CPU. So the run is what was asked for.
    """
    plugins = _as_list(plugins)
    if precision is None:
        return {}
    name = normalize_precision(precision)
    if name in _TE_PRECISIONS:
        weights = ROWS[name].convert_to
        return {"precision": None, "plugins": [*plugins, TiedTransformerEnginePrecision(weights_dtype=weights)]}
    if name == "16-mixed" and resolve_accelerator(accelerator) == "cpu":
        return {"precision": None, "plugins": [*plugins, MixedPrecision("16-mixed", device="cpu")]}
    return {"precision": name}


# ----------------------------------------------------------------------------------------------
# fp8 through Transformer Engine
# ----------------------------------------------------------------------------------------------


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _WEIGHTS_DTYPES:
        raise UserError(f"unknown dtype {name!r}: use one of {', '.join(_WEIGHTS_DTYPES)}")
    return _WEIGHTS_DTYPES[name]


class TiedTransformerEnginePrecision(TransformerEnginePrecision):
    """Lightning's Transformer Engine (fp8) precision, with tied weights kept tied.

    Lightning swaps each nn.Linear for a te.Linear holding a clone of its weight
    (canary test_transformer_engine_unties_tied_weights). So a tied LM head silently unties.
    It then trains one more V x d matrix. convert_module records which parameters were shared.
    It shares them again after.

    Args:
        weights_dtype: "bfloat16" (Lightning's `transformer-engine`), "float16", or "float32" for
            fp32 master weights (16 bytes per parameter with AdamW instead of 8).
        recipe: Transformer Engine's DelayedScaling arguments (None = its defaults).
        replace_layers: swap nn.Linear for te.Linear (None = yes, unless TE layers are present).
        fallback_compute_dtype: autocast dtype for the ops that do not run in fp8 (attention,
            norms, the loss); None = the weights' dtype, but bf16 for fp32 weights.
    """

    def __init__(
        self,
        *,
        weights_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        recipe: dict | None = None,
        replace_layers: bool | None = None,
        fallback_compute_dtype: Literal["bfloat16", "float16"] | None = None,
    ) -> None:
        weights = _dtype(weights_dtype)
        if fallback_compute_dtype is not None:
            fallback = _dtype(fallback_compute_dtype)
        else:
            fallback = torch.bfloat16 if weights == torch.float32 else weights
        super().__init__(
            weights_dtype=weights, recipe=recipe, replace_layers=replace_layers, fallback_compute_dtype=fallback
        )
        if weights == torch.float16:
            self.precision = "transformer-engine-float16"

    def convert_module(self, module: nn.Module) -> nn.Module:
        ties = _shared_parameters(module)
        module = super().convert_module(module)
        _retie(module, ties)
        return module


_SharedParameter = list[tuple[str, str, nn.Module]]  # (owner module path, attribute, owner) per reference


def _shared_parameters(root: nn.Module) -> list[_SharedParameter]:
    """Every Parameter held by more than one (module, attribute), as the references to it."""
    refs: dict[int, dict[tuple[int, str], tuple[str, str, nn.Module]]] = {}
    for path, owner in root.named_modules(remove_duplicate=False):
        for attr, param in owner._parameters.items():
            if param is not None:
                refs.setdefault(id(param), {}).setdefault((id(owner), attr), (path, attr, owner))
    return [list(by_owner.values()) for by_owner in refs.values() if len(by_owner) > 1]


def _retie(root: nn.Module, shared: Iterable[_SharedParameter]) -> None:
    """Make each group of references from _shared_parameters() point at one Parameter again.

    The one kept is held by an owner that was not swapped out, else the first reference's."""
    for group in shared:
        current = [(root.get_submodule(path), attr, original) for path, attr, original in group]
        kept = [getattr(owner, attr) for owner, attr, original in current if owner is original]
        param = kept[0] if kept else getattr(current[0][0], current[0][1])
        for owner, attr, _ in current:
            if getattr(owner, attr) is not param:
                setattr(owner, attr, param)


# ----------------------------------------------------------------------------------------------
# fp8 through torchao
# ----------------------------------------------------------------------------------------------


def _float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Which linears torchao converts: both dims divisible by 16, and not the LM head.

    16 is torch._scaled_mm's rule. The head's output is the logits. There fp8's 3-bit mantissa would
    perturb the loss directly. A tied head's weight is also the embedding table. The price: the head's
    matmul stays in bf16. That is V x d per token, a large share of a small model's FLOPs."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _convert_linears_to_float8(model: nn.Module) -> nn.Module:
    """Swap `model`'s eligible nn.Linear layers for torchao Float8Linear, in place.

    Scaling is dynamic, per tensor. Weights stay in their dtype: fp8 copies are made per matmul."""
    if not _TORCHAO_AVAILABLE:
        raise UserError(
            "fp8 through torchao (model.fp8=torchao) cannot run: torchao is not installed "
            "(pip install 'lmledger[fp8-ao]'). Fix this, or drop --model.fp8"
        )
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=_float8_eligible)


def apply_fp8(model: nn.Module, fp8: str | None) -> nn.Module:
    """LitLM's `fp8` switch: None leaves `model` as it is; "torchao" converts it in place."""
    if fp8 is None:
        return model
    if fp8 not in _FP8_PATHS:
        raise UserError(f"unknown fp8 {fp8!r}: use torchao, or null")
    return _convert_linears_to_float8(model)
