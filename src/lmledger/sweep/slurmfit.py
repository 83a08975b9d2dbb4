"""Each point's predicted peak held against what its SLURM job asks for, before anything is queued.

The prediction is the one `--plan` and `lmledger account` give: per rank at the point's world size,
num_nodes x devices, from the per-rank dry run where account uses it (ledger.sharding.sharded). CPU jobs: `--mem`,
which is per node, so a node's ranks each need theirs. `--gres=gpu:TYPE:N`: the GPU's memory, per rank.
A point that cannot fit is refused in one line. Without `--mem`, the largest point's need sets it
(_need_bytes). memory_request groups the points into one array per shape (nodes x ranks a node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lmledger.errors import UserError
from lmledger.ledger.units import format_bytes
from lmledger.sweep.check import check_points
from lmledger.sweep.slurmscript import MIB, SlurmRequest, mem_bytes
from lmledger.sweep.spec import TRAINING_COMMANDS, Experiment, Point, fit_args

__all__ = ["memory_request"]

# A CPU job's memory beside the predicted tensor peak: the Python process with torch and Lightning,
# its allocator's slack, and the data loader. `lmledger fit --config configs/tiny.yaml` (20 steps,
# 1.1 MB of predicted tensors) had a max RSS of 624 MiB (getrusage of the child; 2026-12-01, a shared
# 2-core CPU). 2 GiB leaves room for bigger imports (Hugging Face transformers) and loader workers.
_PROCESS_BYTES = 2 << 30
_PEAK_MARGIN = 1.25  # and a quarter over the predicted peak: the ledger's peaks are within 2% (tests)


def _gres_gpu(gres: str | None) -> tuple[str | None, int] | None:
    """(GPU type or None, count) of a `--gres gpu[:TYPE][:N]` request; None when it asks for no GPU."""
    if not gres:
        return None
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        rest = parts[1:]
        count = int(rest.pop()) if rest and rest[-1].isdigit() else 1
        return (rest[0] if rest else None), count
    return None


def _gres_gpu_spec(kind: str):
    """The kit's GPU entry for a gres type.

    Clusters name types their own way (`h100`, `a100`). A key of `lmledger gpus` is taken as it is.
    A prefix of several keys means the one with the least memory. (h100: the 80 GB SXM/PCIe, not the
    94 GB NVL.) So a point is never sent to a GPU it may not fit."""
    from lmledger.ledger.hardware.gpus import GPUS

    name = kind.lower().replace("_", "-")
    if name in GPUS:
        return GPUS[name]
    matches = [spec for key, spec in GPUS.items() if key.startswith(name + "-")]
    if not matches:
        raise UserError(
            f"--gres gpu:{kind}: no GPU of that type in the kit's table to hold the points' peaks against; name it "
            f"by a key of `lmledger gpus` ({', '.join(GPUS)}), or ask for gpu:N without a type (not checked)"
        )
    return min(matches, key=lambda spec: spec.memory_bytes)


def _need_bytes(peak: float) -> int:
    """A CPU task's --mem for a predicted peak of `peak` bytes: the margin over it, plus the process."""
    return int(math.ceil(peak * _PEAK_MARGIN)) + _PROCESS_BYTES


def _gb(n: float) -> str:
    """A memory request, as sizes the cluster is asked for (a peak is format_bytes: 4 digits, any size)."""
    return f"{n / 1e9:,.2f} GB"


@dataclass(frozen=True)
class _Shape:
    """Where a point's ranks run: `nodes` nodes of `per_node` ranks (trainer.num_nodes, trainer.devices)."""

    nodes: int = 1
    per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def words(self) -> str:
        """ "2 nodes x 1 rank" for the refusals; "" for one rank."""
        if self.world_size == 1:
            return ""
        ranks = f"{self.per_node} rank{'s' if self.per_node > 1 else ''}"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {ranks}"


@dataclass(frozen=True)
class _Group:
    """The points of one array: a shape, the --mem (MiB) each of its nodes asks for, and the points."""

    nodes: int  # > 1: --nodes, --ntasks-per-node and srun
    per_node: int
    mem_mib: int | None
    points: tuple[Point, ...]


def _fit_check(experiment: Experiment, points: list[Point]) -> tuple[dict[str, float], dict[str, _Shape]]:
    """Point id -> predicted peak bytes per rank at the point's shape (for points predictable without
    building), and point id -> its shape (every config-reading point; the rest run as one rank).

    The peak is what `lmledger account` (and `sweep --plan`) predicts for the point's arguments: at world size
    num_nodes x devices, one rank's dry run (ledger.sharding.sharded) where account traces the strategy (DDP over
    several ranks, FSDP2), else the closed forms."""
    from lmledger.accounting import account, traced_at_scale
    from lmledger.ledger.predict import predict

    checked = check_points(replace(experiment, points=tuple(points)))
    peaks, shapes = {}, {}
    for point in points:
        shapes[point.id] = _Shape(*checked.shapes.get(point.id, (1, 1)))
        spec = checked.specs.get(point.id)
        if spec is None:
            continue
        if traced_at_scale(spec):
            peak = account(spec, False, fit_args(point))["memory"]["peak"]["predicted"]
        else:
            peak = predict(spec).peak  # the closed forms: what account shows for it, in milliseconds
        if peak is not None:
            peaks[point.id] = float(peak)
    return peaks, shapes


def _per_rank(point: Point, shapes: dict[str, _Shape], each: str = "per rank") -> str:
    """ " per rank (2 nodes x 1 rank)" for a point on several ranks, else "" (" per GPU" for each="per GPU")."""
    words = shapes[point.id].words()
    return f" {each} ({words})" if words else f" {each}" if each != "per rank" else ""


def memory_request(experiment: Experiment, points: list[Point], request: SlurmRequest) -> list[_Group]:
    """The arrays to queue: the points grouped by shape, each group with the --mem (MiB) its nodes ask for,
    after holding every point's predicted peak per rank, at its shape, against the request.

    A point that cannot fit is refused in one line, before anything is queued."""
    peaks, shapes = _fit_check(experiment, points)

    def node_need(point: Point) -> int:  # --mem is per node: each of its ranks needs its own process and peak
        return shapes[point.id].per_node * _need_bytes(peaks[point.id])

    gpu = _gres_gpu(request.gres)
    asked = None if request.mem is None else mem_bytes(request.mem)
    if gpu is not None and gpu[0] is not None:
        spec = _gres_gpu_spec(gpu[0])
        for point in points:
            if peaks.get(point.id, 0) > spec.memory_bytes:
                peak = format_bytes(peaks[point.id])
                raise UserError(
                    f"point {point.id}: predicted peak {peak}{_per_rank(point, shapes, 'per GPU')} "
                    f"does not fit the {_gb(spec.memory_bytes)} of a {spec.name} (--gres {request.gres}); nothing "
                    "was queued: shrink the point or ask for a larger GPU"
                )
    elif gpu is None and asked is not None:
        for point in points:
            if point.id in peaks and node_need(point) > asked:
                per_node = shapes[point.id].per_node
                ranks = f", x {per_node} ranks a node: {_gb(node_need(point))}" if per_node > 1 else ""
                raise UserError(
                    f"point {point.id}: predicted peak {format_bytes(peaks[point.id])}{_per_rank(point, shapes)} "
                    f"(+{_PEAK_MARGIN - 1:.0%} and {_gb(_PROCESS_BYTES)} for the process: "
                    f"{_gb(_need_bytes(peaks[point.id]))}{ranks}) does not fit --mem {request.mem} ({_gb(asked)}); "
                    "nothing was queued: ask for more, or leave --mem out and the prediction sets it"
                )
    by_shape: dict[tuple[int, int], list[Point]] = {}
    for point in points:
        shape = shapes[point.id]
        # Several nodes: one SLURM task a rank (srun). One node: one task; Lightning starts the ranks itself.
        many = shape.nodes > 1 and point.subcommand in TRAINING_COMMANDS
        by_shape.setdefault((shape.nodes, shape.per_node) if many else (1, 1), []).append(point)
    groups = []
    for (nodes, per_node), members in sorted(by_shape.items()):
        if asked is not None:
            mem = max(1, asked // MIB)
        elif gpu is not None or not any(p.id in peaks for p in members):
            mem = None  # a GPU job, or nothing predicted: the cluster's default
        else:
            mem = math.ceil(max(node_need(p) for p in members if p.id in peaks) / MIB)
        groups.append(_Group(nodes, per_node, mem, tuple(members)))
    return groups
