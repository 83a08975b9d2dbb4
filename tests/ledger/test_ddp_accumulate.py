"""DDP under gradient accumulation and manual optimization (ledger.sharding.ddp_dryrun), held to real 2-process DDP
on CPU (gloo) and to a live 2-rank Lightning fit.

Under no_sync (every micro-batch of an optimizer step but the last, as Lightning runs them) the Reducer's
hooks do nothing: the grads accumulate in param.grad beside the buckets, even with gradient_as_bucket_view,
and the last micro-batch's backward copies them in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from rank_toy import adamw as _adamw
from rank_toy import batch as _batch
from rank_toy import model as _model

from lmledger.ledger.dryrun.engine import NotTraced
from lmledger.ledger.sharding.ddp import DDPSettings
from lmledger.ledger.sharding.realranks import measure_sharded
from lmledger.ledger.sharding.sharded import predict_sharded

VIEW = {"copies": DDPSettings(), "bucket view": DDPSettings(gradient_as_bucket_view=True)}
SETTINGS = {
    **VIEW,
    "0.1 MiB bucket views": DDPSettings(gradient_as_bucket_view=True, bucket_cap_mb=0.1),
    # never rebuilt: the first buckets, laid out in registration order, are the steady state's
    "find_unused, 0.1 MiB buckets": DDPSettings(find_unused_parameters=True, bucket_cap_mb=0.1),
}
# (accumulate, settings): one bucket, and several that fill one after another in the last micro-batch
CASES = [(k, view) for k in (2, 4) for view in VIEW] + [(2, name) for name in SETTINGS if "0.1 MiB" in name]
MANUAL = [(step, view) for step in ("manual", "manual, half under no_sync") for view in VIEW]
ALL = CASES + MANUAL


def _manual_step(model, batch):
    """A manual-optimization training step as a LightningModule writes it (the dry run supplies
    `optimizers` and `manual_backward`)."""
    opt = model.optimizers()
    opt.zero_grad()
    model.manual_backward(model(*batch))
    opt.step()


_SYNC = [True]  # the dry run's stand-in for the DDP wrapper's require_backward_grad_sync


@contextmanager
def _no_sync_in_the_dry_run() -> Iterator[None]:
    _SYNC[0] = False
    try:
        yield
    finally:
        _SYNC[0] = True


def _half_under_no_sync(model, batch):
    """Two backwards per step, the first under the strategy's block_backward_sync (on real ranks, the
    harness's stand-in for Lightning's trainer; in the dry run, a flag that `synced` reads)."""
    trainer = getattr(model, "trainer", None)
    no_sync = trainer.strategy.block_backward_sync if trainer is not None else _no_sync_in_the_dry_run
    opt = model.optimizers()
    opt.zero_grad()
    with no_sync():
        model.manual_backward(model(*batch) / 2)
    model.manual_backward(model(*batch) / 2)
    opt.step()


def _measure_all() -> dict:
    out = {
        (k, view): measure_sharded(_model(), _batch(), optimizer=_adamw, ddp=SETTINGS[view], accumulate=k)
        for k, view in CASES
    }
    for view, settings in VIEW.items():
        out["manual", view] = measure_sharded(
            _model(), _batch(), step=_manual_step, optimizer=_adamw, ddp=settings, manual=True
        )
        out["manual, half under no_sync", view] = measure_sharded(
            _model(), _batch(), step=_half_under_no_sync, optimizer=_adamw, ddp=settings, manual=True
        )
    return out


@pytest.fixture(scope="module")
def ranks(gloo_ranks) -> list[dict]:
    return gloo_ranks(_measure_all, 2)


@pytest.fixture(scope="module")
def predicted() -> dict:
    return {case: _predict(case, world_size=2) for case in ALL}


def _predict(case, **kwargs):
    k, view = case
    if k == "manual":
        kwargs.update(step=_manual_step, manual=True)
    elif k == "manual, half under no_sync":
        kwargs.update(step=_half_under_no_sync, manual=True, synced=lambda: _SYNC[0])
    else:
        kwargs.update(accumulate=k)
    return predict_sharded(_model(), _batch(), optimizer=_adamw, strategy="ddp", ddp=SETTINGS[view], **kwargs)


@pytest.mark.parametrize("case", ALL, ids=str)
def test_each_rank_matches_the_prediction(ranks, predicted, case):
    ours = predicted[case]
    assert not isinstance(ours, NotTraced), ours
    for rank in ranks:
        measured = rank[case]
        assert (ours.params, ours.grads, ours.optimizer) == (
            measured.params, measured.grads, measured.optimizer,
        )  # fmt: skip
        assert [b.nbytes for b in ours.buckets] == [b.nbytes for b in measured.buckets]
        assert abs(ours.peak / measured.peak - 1) <= 0.02, (ours.phase_peaks, measured.phase_peaks)
        assert ours.peak_phase == measured.peak_phase
    assert len(ours.buckets) > 1 if "0.1 MiB" in case[1] else len(ours.buckets) == 1


def test_no_sync_keeps_grads_beside_the_buckets_even_as_views(ranks, predicted):
    """Bucket views save the second copy of the grads in the optimizer step only: the micro-batches after the
    first hold the accumulating grads and the buckets, views or not."""
    for k in (2, 4):
        copies, views = (predicted[k, view] for view in VIEW)
        grads = copies.grads
        assert views.phase_peaks["later micro-batches"] == copies.phase_peaks["later micro-batches"]
        assert copies.phase_peaks["optimizer step"] - views.phase_peaks["optimizer step"] == grads
        assert views.grads == grads  # the buckets, which the grads are views of
        for rank in ranks:
            measured = rank[k, "copies"], rank[k, "bucket view"]
            later = [m.phase_peaks["later micro-batches"] for m in measured]
            assert abs(later[0] / later[1] - 1) <= 0.02


def test_a_manual_step_under_its_own_no_sync_fills_no_bucket():
    """`synced` says when the training step turns the Reducer off: the buckets stay allocated but are never
    written, and with bucket views the grads stay their own tensors (no view frees them)."""
    kwargs = dict(step=_manual_step, optimizer=_adamw, world_size=2, manual=True, ddp=VIEW["bucket view"])
    synced = predict_sharded(_model(), _batch(), **kwargs)
    unsynced = predict_sharded(_model(), _batch(), **kwargs, synced=lambda: False)
    single = predict_sharded(_model(), _batch(), step=_manual_step, optimizer=_adamw, manual=True)
    assert unsynced.peak == single.peak + unsynced.comm_buffers
    assert unsynced.phase_peaks["optimizer step"] - synced.phase_peaks["optimizer step"] == synced.grads


def test_a_manual_steps_own_no_sync_is_followed(predicted):
    """With bucket views a backward under no_sync leaves the grads their own tensors beside the buckets, until
    the synchronised one after it copies them in: followed (`synced`, as the real ranks measure it), that is
    one more copy of the grads than a dry run that took every backward as synchronised."""
    ours = predicted["manual, half under no_sync", "bucket view"]
    every_backward_synced = predict_sharded(
        _model(), _batch(), step=_half_under_no_sync, optimizer=_adamw, world_size=2, manual=True,
        ddp=VIEW["bucket view"],
    )  # fmt: skip
    assert ours.peak - every_backward_synced.peak == ours.grads


def test_accumulation_beyond_ddp_is_one_line():
    result = predict_sharded(_model(), _batch(), optimizer=_adamw, strategy="zero3", world_size=2, accumulate=2)
    assert isinstance(result, NotTraced) and "\n" not in result.reason and "measured only" in result.reason


LIVE = textwrap.dedent(
    """
    import json
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lmledger.callbacks import Ledger
    from lmledger.model import ModelConfig, ToyLM

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ToyLM(ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=2,
                                         d_ff=128))

        def training_step(self, batch, batch_idx):
            return self.net(*batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    if __name__ == "__main__":
        torch.manual_seed(0)
        ids = torch.randint(0, 256, (64, 32))
        ledger = Ledger(warmup_steps=0)
        trainer = pl.Trainer(strategy="ddp", devices=2, accelerator="cpu", accumulate_grad_batches=2, max_steps=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[ledger])
        trainer.fit(Tiny(), DataLoader(TensorDataset(ids, ids.roll(1, 1)), batch_size=4))
        p, m = ledger.predicted, ledger.measured
        with open(f"ledger_rank{trainer.global_rank}.json", "w") as out:  # the ranks share one stdout
            json.dump({"why": ledger.why_not_predicted, "predicted": p and p.peak, "measured": m and m.peak,
                       "phases": p and [p.peak_phase, m.peak_phase], "grads": p and [p.grads, m.grads]}, out)
    """
)


def test_a_live_two_rank_fit_with_accumulation_is_predicted(tmp_path, predicted):
    script = tmp_path / "fit_ddp_accumulate.py"
    script.write_text(LIVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # each rank's own ledger
        got = json.loads((tmp_path / f"ledger_rank{rank}.json").read_text())
        assert got["why"] is None and got["predicted"] is not None, got
        assert abs(got["measured"] / got["predicted"] - 1) <= 0.02, got
        assert got["grads"][0] == got["grads"][1] and got["phases"][0] == got["phases"][1], got
        # The same model and micro-batch as the harness's case: its buckets and no_sync schedule, to the byte.
        assert got["predicted"] == predicted[2, "copies"].peak, got
