"""docs/tensorboard.md names every TensorBoard tag a fit writes: the toy LM's (with validation) and a module
without token ids (samples/s). A tag the page does not list fails here, with its name."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lmledger.callbacks import Ledger
from lmledger.data import TokenDataModule
from lmledger.lit import LitLM
from lmledger.model import ModelConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tensorboard.md"
pytestmark = pytest.mark.usefixtures("one_thread")


def documented_patterns() -> list[re.Pattern]:
    """Each backticked tag on the page as a regex: `*` and `<name>` stand for one path part; a bare
    `name` after a tag in the same line is that tag with its last part replaced (`memory/measured/params`,
    `grads` names memory/measured/grads)."""
    patterns = []
    for line in PAGE.read_text().splitlines():
        prefix = None
        for i, token in enumerate(re.findall(r"`([^`]+)`", line)):
            token = token.split(" ")[0]
            if "/" in token or (i == 0 and line.startswith("| `")):  # a table row's first cell is a tag
                prefix = token.rsplit("/", 1)[0]
            elif prefix is not None and re.fullmatch(r"[a-z_0-9]+", token):
                token = f"{prefix}/{token}"
            else:
                continue
            regex = re.escape(token).replace(r"\*", "[^/]+")
            regex = re.sub(r"<[^>]+>", "[^/]+", regex.replace(r"\<", "<").replace(r"\>", ">"))
            patterns.append(re.compile(regex))
    return patterns


def written_tags(log_dir: str) -> set[str]:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    texts = {t.removesuffix("/text_summary") for t in tags["tensors"] if t.endswith("/text_summary")}
    return {*tags["scalars"], *texts, *tags["images"]} - {"hp_metric"}


def undocumented(log_dir: str) -> list[str]:
    patterns = documented_patterns()
    return sorted(tag for tag in written_tags(log_dir) if not any(p.fullmatch(tag) for p in patterns))


def test_every_tag_of_a_toy_fit_is_documented(stdlib_data, tmp_path):
    pl.seed_everything(0, verbose=False)
    data = TokenDataModule(path=str(stdlib_data), batch_size=4, context_length=32, val_batches=1)
    module = LitLM(ModelConfig(vocab_size=data.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2,
                               d_ff=64))  # fmt: skip
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="run"),
                         log_every_n_steps=1, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Ledger(warmup_steps=1)])  # fmt: skip
    trainer.fit(module, data)
    written = written_tags(trainer.logger.log_dir)
    assert {"perf/mfu", "memory/closed_form/peak", "flops/val/model_per_batch", "ledger/table"} <= written
    assert undocumented(trainer.logger.log_dir) == []


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_every_tag_of_a_module_without_tokens_is_documented(tmp_path):
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(96, 16, generator=g), torch.randn(96, 8, generator=g)), batch_size=16)
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="run"),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Ledger(warmup_steps=1)])  # fmt: skip
    trainer.fit(Regressor(), loader)
    assert "perf/samples_per_sec" in written_tags(trainer.logger.log_dir)
    assert undocumented(trainer.logger.log_dir) == []
