"""The dry run's fake copy: model, batch and optimizer on fake tensors, acting as the real ones do.

`fake_copy` deep-copies a model onto `FakeTensorMode` tensors. Tied weights stay tied, and the real
tensors are never copied. `fake_tensor` and `map_tensors` make the batch fake. `fake_optimizer` builds
the optimizer over the fake parameters. `precision_dtypes` and `target_device` read the precision and the
device the step runs on.

Where fakes would not act as the real tensors do, these follow the real code:

    RealOutputStorages        a reduced loss kept in an input-sized buffer; oneDNN's RNN workspace; a
                              collective's wait_tensor returns its input
    PlaceholderScalars        a scalar a fake optimizer step reads from a tensor reads as 1
    eager_library_decisions   libraries that ask "am I traced?" take their eager branch
    _pin_kernel_choice        a fake optimizer runs the kernel (foreach or not) the real one would

No Lightning import.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from unittest import mock

import numpy as np
import torch
import torch.utils.data
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.optim.optimizer import _get_foreach_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode

from lmledger.errors import UserError
from lmledger.ledger import precision_table
from lmledger.ledger.dryrun.steptypes import OptimizerSpec

__all__ = [
    "PlaceholderScalars",
    "RealOutputStorages",
    "batch_tensors",
    "cast_batch",
    "eager_library_decisions",
    "fake_copy",
    "fake_optimizer",
    "fake_tensor",
    "map_tensors",
    "no_nan_reads",
    "precision_dtypes",
    "target_device",
]


def precision_dtypes(precision: str | int) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype the module and its floating inputs are converted to, autocast dtype) of a precision.

    That is how Lightning's plugins run the precision (ledger.precision_table). The loss scaling 16-mixed adds on
    CUDA is a few scalars, not modelled. Transformer Engine's layer swap is not run.
    """
    row = precision_table.precision(precision)
    if row.transformer_engine:
        covered = [r.name for r in precision_table.ROWS.values() if not r.transformer_engine]
        raise UserError(f"the dry run covers {', '.join(covered)}, not {row.name}: Transformer Engine's te.Linear "
                        "runs on a CUDA GPU only (`lmledger account` plans its step, traced at its weights' precision "
                        "with its linears priced in fp8)")  # fmt: skip
    return row.convert_dtype, row.autocast_dtype


def target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device the step runs on: `device`, else the parameters' (CPU for a meta model)."""
    if device is None:
        found = [t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
        return found[0] if found else torch.device("cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise UserError(f"unknown device {device!r} ({err}): use cpu or cuda") from None
    backend = getattr(torch, device.type, None)
    if device.type not in ("cpu", "meta") and not (backend is not None and backend.is_available()):
        # Fake tensors still go through the device's guard: a torch build without that device aborts
        # the process, past any exception handler.
        raise UserError(f"device {device} is not available on this machine: dry-run on a machine that has it")
    return device


def batch_tensors(batch: object) -> list[torch.Tensor]:
    """The tensors of a batch, in order.

    A batch is a tensor, or mappings (dict, Hugging Face BatchEncoding), tuples and lists of them, nested.
    Anything else holds none.
    """
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in batch_tensors(item)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: object) -> object:
    """The batch with fn applied to every tensor.

    Containers are rebuilt as their own type: a BatchEncoding stays one, a namedtuple stays one.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        out = copy.copy(batch)
        for key, value in batch.items():
            out[key] = map_tensors(fn, value)
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, item) for item in batch)
    return batch


def cast_batch(batch: object, dtype: torch.dtype | None) -> object:
    """Floating tensors of the batch in `dtype`, as Lightning's *-true precision plugins convert inputs."""
    if dtype is None:
        return batch
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def fake_tensor(
    t: torch.Tensor, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A fake tensor like t on `device`, floating tensors in `dtype` if given.

    One made from a real tensor on that device keeps its storage sharing with the other fakes of the mode.
    """
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    same_device = t.device == device or (t.device.type == device.type and device.index is None)
    if same_device and t.device.type != "meta" and dtype == t.dtype:
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)


# Objects a module may keep that the step does not change and that can be large (a memory-mapped
# array would be read whole by deepcopy): the fake copy shares them with the original.
_SHARED_TYPES = (np.ndarray, torch.utils.data.Dataset, torch.utils.data.DataLoader)


def fake_copy(
    model: nn.Module,
    mode: FakeTensorMode,
    device: torch.device,
    dtype: torch.dtype | None,
    share: tuple[object, ...] = (),
) -> tuple[nn.Module, dict[int, object]]:
    """A deep copy of model whose parameters, buffers and tensor attributes are fake.

    Floating parameters and buffers are in `dtype` if given. Module.to(dtype) leaves other attributes
    alone, and so does this. The memo of copy.deepcopy is filled first. So each tensor object maps to one
    fake (tied weights stay tied), and the real ones are never copied.
    """
    memo: dict[int, object] = {id(obj): obj for obj in share}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, _SHARED_TYPES):  # data a module holds on to: never copied
                memo[id(value)] = value
        converted = [*module._parameters.values(), *module._buffers.values()]
        attributes = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t, cast in [*((t, dtype) for t in converted), *((t, None) for t in attributes)]:
            if t is None or id(t) in memo:
                continue
            fake = fake_tensor(t.detach(), mode, device, cast)
            if isinstance(t, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
    return copy.deepcopy(model, memo), memo


def fake_optimizer(
    optimizer: OptimizerSpec,
    fake_model: nn.Module,
    memo: dict[int, object],
    device: torch.device,
) -> torch.optim.Optimizer | None:
    """The optimizer over the fake parameters.

    A factory is called on them. An optimizer is deep-copied, its parameters mapped to the fakes. Its
    hyperparameters and groups are kept, and its state starts empty.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        unknown = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in memo]
        if unknown:
            raise UserError("the optimizer holds tensors that are not the model's parameters: pass a factory instead")
        # Fresh state: step 1 creates it as the real optimizer did (a fake copy of a real `step`
        # counter would hold no value for AdamW to read).
        memo[id(optimizer.state)] = defaultdict(dict)
        fake = copy.deepcopy(optimizer, memo)
    else:
        fake = optimizer(list(fake_model.parameters()))
        if not isinstance(fake, torch.optim.Optimizer):
            raise UserError(f"the optimizer factory returned {type(fake).__name__}, not a torch.optim.Optimizer")
    _pin_kernel_choice(fake, device)
    return fake


def _pin_kernel_choice(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make the fake optimizer run the kernel torch would pick for the real parameters.

    By default torch.optim picks foreach only for plain tensors on a foreach device (CUDA). The test is
    `type(p) in [Tensor, Parameter]`, in torch.optim.optimizer._default_to_fused_or_foreach. A FakeTensor
    fails it. Left alone, a fake CUDA step would take the per-tensor loop and miss foreach's temporaries.
    So an unset `foreach` is set to what the real step gets.
    """
    foreach_default = device.type in _get_foreach_kernels_supported_devices()
    for group in optimizer.param_groups:
        unset = "foreach" in group and group["foreach"] is None
        if unset and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = foreach_default


_WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT_TENSOR = getattr(_WAIT_TENSOR, "default", None)


class RealOutputStorages(TorchDispatchMode):
    """Give fake outputs the storage size the real kernels give them, where the two differ.

    Reduced losses: aten/src/ATen/native/Loss.cpp computes a reduced mse / smooth L1 / Huber loss into an
    elementwise buffer. It returns the scalar in that buffer's storage. So the loss keeps a buffer the size
    of its input alive until it is freed. The meta kernels return a one-element storage.

    RNN workspaces: oneDNN's RNN layer (aten.mkldnn_rnn_layer: LSTM and GRU on a CPU) returns a workspace.
    Backward needs it, and only oneDNN knows its size (gates and states per step, page-aligned). The meta
    kernel returns an empty one. So the dry run asks oneDNN. The layer runs once for real, per distinct
    shape, on uninitialized tensors of the same shapes. That is a dry run's only real compute and memory:
    one RNN layer's, while it runs.

    Entered inside the FakeTensorMode, so the tensors made here are fake.
    """

    _REDUCED_INTO_INPUT_BUFFER = frozenset(
        {torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default, torch.ops.aten.huber_loss.default}
    )

    def __init__(self) -> None:
        super().__init__()
        self._rnn_workspaces: dict[tuple, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT_TENSOR:  # the real op returns its input; the fake one a new tensor
            return args[0]
        out = func(*args, **(kwargs or {}))
        if func in self._REDUCED_INTO_INPUT_BUFFER and out.dim() == 0:
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            buffer = torch.empty(shape, dtype=out.dtype, device=out.device)
            return buffer.as_strided((), ())
        if func is torch.ops.aten.mkldnn_rnn_layer.default and out[3].numel() == 0:
            nbytes = self._rnn_workspace_bytes(func, args, kwargs or {})
            return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=out[3].device))
        return out

    def _rnn_workspace_bytes(self, func, args, kwargs) -> int:
        key = tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else tuple(a) if isinstance(a, list) else a
            for a in args
        )
        if key not in self._rnn_workspaces:

            def real(a):
                return torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a

            with unset_fake_temporarily():  # grad mode stays: without it oneDNN makes no workspace
                outputs = func(*(real(a) for a in args), **kwargs)
            self._rnn_workspaces[key] = outputs[3].untyped_storage().nbytes()
        return self._rnn_workspaces[key]


class PlaceholderScalars(TorchDispatchMode):
    """In a fake optimizer step, a scalar read from a tensor that has no value reads as 1.

    Optimizers read such values to size the step, never to size a tensor. Adafactor scales its learning
    rate by param.norm().item() (torch/optim/_adafactor.py). So the step's memory and FLOPs do not depend on
    them. The forward and backward get no such help: a model's values may decide what it computes.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point or dtype.is_complex else 1


class _DropMetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Keep torch's traceback of a meta kernel that raises off stderr: FakeTensorMode logs it at ERROR before
    re-raising (fake_tensor.py, _dispatch_impl), and the dry run reports the error in one line."""
    log, drop = logging.getLogger("torch._subclasses.fake_tensor"), _DropMetaFailures()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@contextmanager
def eager_library_decisions() -> Iterator[None]:
    """Let libraries behave on fake tensors as on real ones: those that branch on "am I being traced?" take their
    eager branch, torch's log of a failing meta kernel stays off stderr (quiet_meta_failures), and anomaly
    detection (Lightning's detect_anomaly=True) reads no gradient's values (no_nan_reads). Every fake step runs
    under it.

    Hugging Face transformers reads the position ids to tell packed sequences apart
    (masking_utils.find_packed_sequence_indices). On a fake tensor it cannot, so it assumes packing. It
    then materializes a (batch, 1, seq, seq) mask, which also makes grouped-query attention repeat k and v.
    Eagerly, on the position ids its models make themselves, it finds no packing. SDPA then masks
    causally. The dry run answers "not packed": batches of packed sequences are not modelled.
    """
    masking = sys.modules.get("transformers.masking_utils")
    finder = getattr(masking, "find_packed_sequence_indices", None)
    if finder is None:
        with quiet_meta_failures(), no_nan_reads():
            yield
        return

    def not_packed_when_fake(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else finder(position_ids)

    with (
        quiet_meta_failures(),
        no_nan_reads(),
        mock.patch.object(masking, "find_packed_sequence_indices", not_packed_when_fake),
    ):
        yield


def no_nan_reads() -> torch.autograd.set_detect_anomaly:
    """Anomaly detection as it is, less its NaN check: with it on, autograd's engine reads whether each backward
    output holds a NaN (isnan, any, item), which a fake tensor cannot answer. The check's ops (a bool tensor the
    size of each output, freed at once) are left out of the dry run; anomaly mode's Python stack per op stays."""
    return torch.autograd.set_detect_anomaly(torch.is_anomaly_enabled(), check_nan=False)
