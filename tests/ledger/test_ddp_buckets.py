"""DDP's gradient buckets (ledger.sharding.ddp) and the per-rank DDP dry run (ledger.sharding.ddp_dryrun), held to
torch's own
bucketing and to real 2-process DDP on CPU (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from rank_toy import adamw as _adamw
from rank_toy import batch as _batch
from rank_toy import model as _model

from lmledger.ledger.sharding.ddp import DEFAULT_FIRST_BUCKET_BYTES, MIB, DDPSettings, assign_buckets, rebuilt_buckets
from lmledger.ledger.sharding.realranks import measure_sharded
from lmledger.ledger.sharding.sharded import predict_sharded

SETTINGS = {
    "default": DDPSettings(),
    "bucket view": DDPSettings(gradient_as_bucket_view=True),
    "0.05 MiB buckets": DDPSettings(bucket_cap_mb=0.05),
}


def test_canary_torch_ddp_bucket_defaults():
    # ledger.sharding.ddp copies these two figures; if torch changes them, the bucket prediction must follow.
    import torch.nn.parallel.distributed as ddp_module

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == DEFAULT_FIRST_BUCKET_BYTES == MIB
    assert ddp_module._DEFAULT_BUCKET_CAP_MB == 25


def test_assignment_matches_torchs_bucketing():
    # Mixed dtypes and sizes that cross the limits in several places; torch's C++ assignment is the judge.
    shapes = [(300, 300), (10,), (700, 500), (4,), (1000, 300), (64, 64), (2000,), (512, 512)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16] + [
        torch.float32
    ] * 2
    tensors = [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes, strict=True)]
    sizes = [(t.numel() * t.element_size(), str(t.dtype)) for t in tensors]
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    limits = [MIB // 2, 2 * MIB]
    ours = assign_buckets(sizes, order, limits)
    theirs, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [False] * len(order))
    assert [list(b.indices) for b in ours] == [[order[i] for i in bucket] for bucket in theirs]
    assert sum(b.nbytes for b in ours) == sum(n for n, _ in sizes)


def test_first_bucket_is_one_mib_only_at_the_default_cap():
    sizes = [(400_000, "torch.float32")] * 10
    default = rebuilt_buckets(sizes, DDPSettings())
    assert default[0].nbytes == 1_200_000  # closes once past 1 MiB
    assert all(b.nbytes <= 25 * MIB for b in default)
    custom = rebuilt_buckets(sizes, DDPSettings(bucket_cap_mb=2))
    assert [b.nbytes for b in custom] == [2_400_000, 1_600_000]  # 6 x 400 kB cross 2 MiB; the rest stays open


def _measure_all() -> dict:
    return {
        name: measure_sharded(_model(), _batch(), optimizer=_adamw, strategy="ddp", ddp=settings)
        for name, settings in SETTINGS.items()
    }


def test_ddp_per_rank_matches_two_real_gloo_ranks(gloo_ranks):
    ranks = gloo_ranks(_measure_all, 2)
    single = predict_sharded(_model(), _batch(), optimizer=_adamw, strategy="ddp", world_size=1)  # no DDP settings
    for name, settings in SETTINGS.items():
        predicted = predict_sharded(_model(), _batch(), optimizer=_adamw, strategy="ddp", world_size=2, ddp=settings)
        for rank in ranks:
            measured = rank[name]
            assert (predicted.params, predicted.grads, predicted.optimizer) == (
                measured.params,
                measured.grads,
                measured.optimizer,
            ), name
            # The real Reducer's rebuilt buckets, as DDP logs them, are the predicted ones.
            assert [b.nbytes for b in predicted.buckets] == [b.nbytes for b in measured.buckets], name
            assert abs(predicted.peak / measured.peak - 1) <= 0.02, (name, predicted.peak, measured.peak)
        # Without bucket views the buckets are a second copy of the grads, alive in every phase.
        if not settings.gradient_as_bucket_view:
            assert predicted.phase_peaks["forward"] - single.phase_peaks["forward"] == predicted.grads
        else:
            assert predicted.phase_peaks["forward"] == single.phase_peaks["forward"]
            assert predicted.peak < ranks[0]["default"].peak
    assert len(ranks[0]["0.05 MiB buckets"].buckets) > len(ranks[0]["default"].buckets)
