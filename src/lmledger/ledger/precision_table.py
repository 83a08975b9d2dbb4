"""One row per Lightning precision: storage widths, matmul dtype, and how the plugin runs the model.

Every other module reads these facts here.

    param/grad/state_bytes  bytes per element of a parameter, its gradient and one optimizer state tensor
                            (torch creates AdamW's m, v and SGD's momentum like the parameter)
    compute_dtype           the ledger.hardware.gpus dtype whose dense peak MFU is measured against
    autocast                torch.autocast's dtype (MixedPrecision), None when autocast does not run
    convert_to              the dtype the plugin converts the module to (DoublePrecision, HalfPrecision,
                            TransformerEnginePrecision's weights), None when the module stays fp32
    transformer_engine      nn.Linear layers are swapped for Transformer Engine's fp8 te.Linear
    grad_scaler             the plugin scales the loss with a GradScaler (fp16 autocast's dynamic scaling)
    activation_bytes        (compute, residual) widths the activation and peak model uses: matmul operands
                            and intermediates, and the residual stream; None where it is not modelled
    deepspeed_model_bytes   the width DeepSpeed runs the model in; None where Lightning's
                            DeepSpeedPrecision refuses the precision

Dtypes are torch attribute names ("bfloat16"). So importing this module imports neither torch nor
Lightning: `lmledger plan` answers without them. `Row.autocast_dtype` and `Row.convert_dtype` give
torch dtypes. tests/ledger/test_precision_table.py holds each row against Lightning's plugins and torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmledger.errors import ConfigError

__all__ = [
    "ALIASES", "PRECISIONS", "ROWS", "Row", "normalize_precision", "precision", "traced_precision",
    "transformer_engine",
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    name: str
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    compute_dtype: str
    autocast: str | None = None
    convert_to: str | None = None
    transformer_engine: bool = False
    grad_scaler: bool = False
    activation_bytes: tuple[int, int] | None = None
    deepspeed_model_bytes: int | None = None

    @property
    def fused_optimizer(self) -> bool:
        """LitLM's rule: torch's fused AdamW/SGD, except under a GradScaler.

        Its unscale would leave the gradients scaled for logging and clipping.
        """
        return not self.grad_scaler

    @property
    def autocast_dtype(self):  # -> torch.dtype | None
        return _torch_dtype(self.autocast)

    @property
    def convert_dtype(self):  # -> torch.dtype | None
        return _torch_dtype(self.convert_to)


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch

    return getattr(torch, name)


_ROWS = (
    Row("64-true", 8, 8, 8, "fp64", convert_to="float64"),
    Row("32-true", 4, 4, 4, "fp32", activation_bytes=(4, 4), deepspeed_model_bytes=4),
    Row("16-mixed", 4, 4, 4, "fp16", autocast="float16", grad_scaler=True, activation_bytes=(2, 4),
        deepspeed_model_bytes=2),
    Row("bf16-mixed", 4, 4, 4, "bf16", autocast="bfloat16", activation_bytes=(2, 4), deepspeed_model_bytes=2),
    Row("16-true", 2, 2, 2, "fp16", convert_to="float16", activation_bytes=(2, 2), deepspeed_model_bytes=2),
    Row("bf16-true", 2, 2, 2, "bf16", convert_to="bfloat16", activation_bytes=(2, 2), deepspeed_model_bytes=2),
    # te.Linear runs its matmuls in fp8. The weights stay in the plugin's weights dtype.
    Row("transformer-engine", 2, 2, 2, "fp8", convert_to="bfloat16", transformer_engine=True),
    Row("transformer-engine-float16", 2, 2, 2, "fp8", convert_to="float16", transformer_engine=True),
)  # fmt: skip

ROWS: dict[str, Row] = {row.name: row for row in _ROWS}
PRECISIONS = tuple(ROWS)
# Lightning's short names (lightning.fabric.connector's _PRECISION_INPUT), as it maps them.
ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision(name: str | int) -> Row:
    """The row of a Lightning precision name or alias ("bf16" and 32 included)."""
    key = ALIASES.get(str(name), str(name))
    if key not in ROWS:
        raise ConfigError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)} (or {', '.join(ALIASES)})")
    return ROWS[key]


def normalize_precision(name: str | int) -> str:
    """The canonical name ("bf16" -> "bf16-mixed", 32 -> "32-true")."""
    return precision(name).name


def transformer_engine(name: str | int | None) -> bool:
    """Whether a precision is Transformer Engine's (its te.Linear runs on a CUDA GPU only); False for None, or a
    plugin the table lacks."""
    row = _row_or_none(name)
    return row is not None and row.transformer_engine


def traced_precision(name: str | int, weights_dtype: object = None) -> str:
    """The precision a dry run traces for a run at `name`. Transformer Engine's is traced as its weights'
    (`weights_dtype`, else its row's): Lightning's plugin converts the module to them and runs what te.Linear does not
    under autocast to a 16-bit dtype: bf16-true or 16-true, and for fp32 master weights bf16-mixed
    (TiedTransformerEnginePrecision's bf16 fallback); its linears are priced in fp8 (timing/gpu/frameworks.
    lightning_kernels). A plugin the table lacks is traced as bf16-mixed; any other as itself."""
    row = _row_or_none(name)
    if row is None:
        return "bf16-mixed"
    if not row.transformer_engine:
        return row.name
    weights = str(weights_dtype).removeprefix("torch.") if weights_dtype is not None else row.convert_to
    if weights == "float32":
        return "bf16-mixed"
    return next(r.name for r in ROWS.values() if r.convert_to == weights and r.autocast is None
                and not r.transformer_engine)  # fmt: skip


def _row_or_none(name: str | int | None) -> Row | None:
    if name is None:
        return None
    try:
        return precision(name)
    except ConfigError:  # a plugin the table lacks
        return None
