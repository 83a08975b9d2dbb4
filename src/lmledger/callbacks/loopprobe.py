"""Lightning's loop per batch, measured: run by callbacks/steptime.lightning_loop_seconds in a process of its own.

An empty training_step through Trainer.fit (with the Ledger, as `lmledger fit` runs it, its own step-time
prediction off), beside the same step run bare; the difference is what Lightning's loop, hooks and
logging cost per batch on this machine.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from lmledger.callbacks.steptime import NO_STEP_TIME

__all__ = ["main"]


def main(settings: dict) -> dict:
    """In a process of its own: an empty training_step through Trainer.fit, beside the same step bare.

    Two fits: logging every batch, and never. Lightning's loop per batch = the unlogged fit's mean
    batch-to-batch time (after a warm-up) minus the bare step's median and the probe loader's own fetch
    time; a log costs the logged fit's mean minus the unlogged one's. Both arms run the same
    one-parameter module.
    """
    import tempfile

    import lightning.pytorch as lpl

    from lmledger.callbacks.ledger import Ledger
    from lmledger.callbacks.settings import LedgerSettings

    os.environ[NO_STEP_TIME] = "1"
    torch.set_num_threads(settings["threads"])
    steps, warmup = settings["steps"], 10

    class Empty(lpl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.w * batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(steps + 8, 1)), batch_size=1)

    def fit_gap(log_every: int) -> float:
        stamps: list[float] = []

        class Stamp(lpl.Callback):
            def on_train_batch_start(self, *args) -> None:
                stamps.append(time.perf_counter())

        with tempfile.TemporaryDirectory() as tmp:
            callbacks = [Stamp()]
            if settings["ledger"]:
                callbacks.append(Ledger(settings=LedgerSettings(time=False, measure=True)))
            logger = lpl.loggers.TensorBoardLogger(tmp, name="probe") if settings["logger"] else False
            trainer = lpl.Trainer(
                accelerator="cpu", devices=1, max_steps=steps, logger=logger, callbacks=callbacks,
                enable_progress_bar=settings["progress_bar"], enable_checkpointing=False,
                enable_model_summary=False, log_every_n_steps=log_every, num_sanity_val_steps=0, limit_val_batches=0,
            )  # fmt: skip
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(Empty(), data)
        gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]
        return statistics.fmean(gaps)

    logged, unlogged = fit_gap(1), fit_gap(10 * steps)
    module = Empty()
    optimizer = module.configure_optimizers()
    batch = next(iter(data))

    def bare() -> None:
        loss = module.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def fetch() -> None:
        next(iter(data))

    from lmledger.ledger.timing.steptime.replay import time_call

    bare_s = time_call(bare, torch.device("cpu"), budget_s=0.05, max_repeats=101)[0]
    it = iter(data)
    fetch_s = time_call(lambda: next(it), torch.device("cpu"), budget_s=0.01, max_repeats=5)[0]
    return {"logged_s": logged, "unlogged_s": unlogged, "bare_s": bare_s, "fetch_s": fetch_s, "steps": steps}
