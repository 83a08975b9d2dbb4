"""One JSON shape (issue 33 §1) for `account --json` in every mode and for fit's per-rank record.

Every mode fills the same keys with the same types; a mode only adds keys (per_rank, time, mfu_conventions,
a further predictor such as MoE's worst routing). Its figures read as fit's TensorBoard tags through one
translation (ledger.report.ledger_tags), which a sweep uses. docs/commands.md "The JSON shape" documents it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import MICRO_OVERRIDES, figures_of, lmledger
from lmledger.callbacks import Ledger
from lmledger.ledger.report import BYTE_LINES, RUN_KEYS, SCHEMA
from lmledger.sweep.collect import output_tags

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", *MICRO_OVERRIDES]
# Every mode has these keys, of these types.
REQUIRED = {"schema": int, "run": dict, "params": int, "sources": dict, "memory": dict, "flops": dict,
            "state_bytes_per_param": dict, "why_missing": dict, "notes": list, "rates": dict,
            "times": dict}  # fmt: skip
FLOP_KEYS = ("model", "hardware", "measured")

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_one_shape(doc: dict) -> None:
    """`doc` holds the one shape: the required keys and types, every row under predicted and measured."""
    assert json.loads(json.dumps(doc)) == doc  # plain JSON
    for key, kind in REQUIRED.items():
        assert isinstance(doc[key], kind), (key, type(doc[key]))
    assert doc["schema"] == SCHEMA
    assert set(RUN_KEYS) <= set(doc["run"]), set(RUN_KEYS) - set(doc["run"])
    assert isinstance(doc["run"]["world_size"], int) and isinstance(doc["run"]["model"], str)
    assert list(doc["sources"])[:1] == ["predicted"] and "measured" in doc["sources"]
    assert list(doc["memory"]) == list(BYTE_LINES)  # every byte line, each with every source in their order
    for line, by_source in doc["memory"].items():
        assert list(by_source) == list(doc["sources"]), line
        assert all(v is None or isinstance(v, int) for v in by_source.values()), (line, by_source)
    assert set(FLOP_KEYS) <= set(doc["flops"])
    assert all(v is None or isinstance(v, int) for v in doc["flops"].values()), doc["flops"]
    assert set(doc["state_bytes_per_param"]) == {"predicted", "measured"}
    assert all(isinstance(n, str) for n in doc["notes"]) and doc["notes"]
    measured = figures_of(doc, "measured")
    assert (doc["sources"]["measured"] is None) == all(v is None for v in measured.values())


# --- account, every mode -------------------------------------------------------------------------------

ACCOUNT = {
    "one device": [],
    "ddp 2": ["--trainer.devices", "2", "--trainer.strategy", "ddp"],
    "fsdp2 2": ["--trainer.devices", "2", "--trainer.strategy", "fsdp2"],
    "measured": ["--measure"],
}


@pytest.fixture(scope="module")
def account_docs(stdlib_data, tmp_path_factory) -> dict[str, dict]:
    """`account --json` of the tiny config in each mode, and of any model (a convnet) on one device and at scale.

    In-process (the CLI's main), in a scratch directory like conftest's workdir, once for the module."""
    work = tmp_path_factory.mktemp("shape")
    (work / "data").mkdir()
    (work / "data" / "stdlib").symlink_to(stdlib_data)
    (work / "configs").symlink_to(REPO / "configs")
    old, sys.path[:0] = os.getcwd(), [str(REPO)]  # `examples` is at the repository root
    os.chdir(work)
    docs = {}
    try:

        def account(*argv: str) -> dict:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert lmledger(["account", *argv, "--json"]) == 0
            return json.loads(out.getvalue())

        for mode, extra in ACCOUNT.items():
            docs[mode] = account(*TINY, *extra)
        convnet = ["--config", "configs/examples/byte-convnet.yaml", "--model.init_args.width", "16",
                   "--model.init_args.num_layers", "1", "--data.init_args.batch_size", "2",
                   "--data.init_args.context_length", "16"]  # fmt: skip
        docs["any model"] = account(*convnet)
        docs["any model, ddp 2"] = account(*convnet, "--trainer.devices", "2", "--trainer.strategy", "ddp")
    finally:
        os.chdir(old)
        sys.path.remove(str(REPO))
    return docs


@pytest.mark.parametrize("mode", [*ACCOUNT, "any model", "any model, ddp 2"])
def test_account_json_has_the_one_shape_in_every_mode(account_docs, mode):
    doc = account_docs[mode]
    assert_one_shape(doc)
    assert doc["memory"]["peak"]["predicted"] > doc["memory"]["params"]["predicted"] > 0
    assert doc["run"]["world_size"] == (2 if "2" in mode else 1)
    # the sweep's columns: fit's TensorBoard tags, through the one translation (ledger.report.ledger_tags)
    metrics = output_tags(doc)
    assert metrics["memory/predicted/peak"] == doc["memory"]["peak"]["predicted"]
    assert metrics["flops/hardware_per_step"] == doc["flops"]["hardware"]


def test_every_mode_fills_the_same_keys_and_modes_only_add(account_docs):
    one = account_docs["one device"]
    for mode, doc in account_docs.items():
        assert set(REQUIRED) <= set(doc), mode
        assert set(doc) - set(one) <= {"per_rank", "time", "mfu_conventions"}, (mode, set(doc) - set(one))
        assert list(figures_of(doc, "predicted")) == list(figures_of(one, "predicted")), mode


def test_per_rank_rows_are_the_configured_case(account_docs):
    """The issue's bug: at scale the rows moved under per_rank.cases; now they stay at memory.predicted."""
    ddp, fsdp2, one = account_docs["ddp 2"], account_docs["fsdp2 2"], account_docs["one device"]
    off = ddp["per_rank"]["cases"]["checkpointing off"]
    assert ddp["memory"]["peak"]["predicted"] == off["peak"] > one["memory"]["peak"]["predicted"]  # DDP's buckets
    # the dry run is the main column in every mode, the toy LM's closed forms beside it (issue 33 §2)
    for doc in (one, ddp, fsdp2):
        assert doc["sources"]["predicted"] == "dry run" and doc["sources"]["closed_form"] == "closed form"
        assert doc["memory"]["params"]["closed_form"] == doc["memory"]["params"]["predicted"]
        # one micro-batch of the same shape per rank: the same FLOPs, counted by the dry run, at scale too
        assert doc["flops"]["hardware"] == pytest.approx(doc["flops"]["closed_form"], rel=0.005)
        assert 0 < doc["flops"]["model"] < doc["flops"]["hardware"]
    # one device: the closed forms' peak (plus the dry run's buffers and batch) is fit's "closed form" column
    assert (
        abs(one["memory"]["peak"]["closed_form"] - one["memory"]["peak"]["predicted"])
        <= 0.01 * one["memory"]["peak"]["predicted"]
    )
    whole = one["memory"]["params"]["predicted"]
    assert whole / 2 <= fsdp2["memory"]["params"]["predicted"] < whole / 2 * 1.1  # FSDP2's dim-0 shards
    anywhere = account_docs["any model, ddp 2"]
    assert anywhere["memory"]["peak"]["predicted"] == anywhere["per_rank"]["cases"]["as configured"]["peak"]
    assert anywhere["memory"]["params"]["predicted"] == account_docs["any model"]["memory"]["params"]["predicted"]


def test_measured_fills_the_same_keys_beside_the_prediction(account_docs):
    doc = account_docs["measured"]
    predicted, measured = figures_of(doc, "predicted"), figures_of(doc, "measured")
    assert doc["sources"]["measured"] == "measured"
    for row in ("params", "grads", "optimizer"):
        assert measured[row] == predicted[row], row
    assert abs(measured["peak"] - predicted["peak"]) <= 0.03 * measured["peak"]
    assert doc["flops"]["measured"] == pytest.approx(doc["flops"]["hardware"], rel=0.005)
    assert doc["state_bytes_per_param"]["measured"] == pytest.approx(16)  # fp32 AdamW
    assert account_docs["one device"]["state_bytes_per_param"]["measured"] is None


# --- fit's per-rank record -----------------------------------------------------------------------------


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.cross_entropy(self.net(inputs).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(vocab: int, seq: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, vocab, (8, seq), generator=g) for _ in range(2))
    return DataLoader(TensorDataset(inputs, targets), batch_size=4)


def _moe():
    """test_pipeline's top-k MoE at its sequence length (128), where the worst routing holds more than balanced."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_moe import VOCAB
    from test_pipeline import MoELM

    return MoELM(), _loader(VOCAB, 128)


def _record(module, loader: DataLoader, tmp_path: Path) -> tuple[dict, Ledger]:
    ledger = Ledger(warmup_steps=1)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "version_0" / "checkpoints")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ledger, checkpoints])  # fmt: skip
    trainer.fit(module, loader)
    return json.loads((tmp_path / "version_0" / "ranks" / "rank0.json").read_text()), ledger


@pytest.mark.parametrize("model", ["dense", "mixture of experts"])
def test_fits_rank_record_has_the_one_shape_and_its_paths_are_the_tensorboard_tags(tmp_path, model):
    module, loader = (TinyLM(), _loader(64, 16)) if model == "dense" else _moe()
    record, ledger = _record(module, loader, tmp_path)
    seq = next(iter(loader))[0].shape[1]
    assert_one_shape(record)
    assert record["rank"] == 0 and record["run"]["world_size"] == 1 and record["step"] == 3
    assert record["run"]["strategy"] == "ddp"  # as account names a one-device run (ledger.run.sharding)
    assert record["params"] == sum(p.numel() for p in module.parameters())
    assert record["run"]["tokens_per_step"] == 4 * seq and record["run"]["batch_size"] == 4
    metrics = output_tags(record)
    scalars = ledger.report.scalars()
    assert scalars and all(metrics[tag] == value for tag, value in scalars.items()), scalars
    assert record["memory"]["peak"]["measured"] is not None
    if model == "mixture of experts":  # a further predictor only adds its key
        assert list(record["sources"]) == ["predicted", "worst_routing", "measured"]
        assert record["memory"]["peak"]["worst_routing"] > record["memory"]["peak"]["predicted"]
        assert record["flops"]["worst_routing"] >= record["flops"]["hardware"]


def test_a_measured_only_report_and_one_before_its_measurement_keep_the_shape():
    """A module the dry run cannot trace (no predictor) and a report before step 2 (no measurement): the same keys."""
    from lmledger.ledger.report import Figures, Report

    module = TinyLM()
    n = sum(p.numel() for p in module.parameters())
    state = Figures(params=4 * n, grads=4 * n, optimizer=8 * n, flops_hardware=6 * n)
    run = dict.fromkeys(RUN_KEYS) | {"model": "TinyLM", "world_size": 1}
    measured_only = Report({}, measured=state, notes=["not predicted, measured only: a reason"]).to_json(run, n)
    before = Report({"dry run": state}, notes=["per device"]).to_json(run, n)
    for doc in (measured_only, before):
        assert_one_shape(doc)
    assert measured_only["sources"] == {"predicted": None, "measured": "measured"}
    assert figures_of(measured_only, "predicted") == dict.fromkeys(BYTE_LINES)
    assert measured_only["state_bytes_per_param"] == {"predicted": None, "measured": 16.0}
    assert before["sources"] == {"predicted": "dry run", "measured": None}
    assert before["flops"] == {"model": None, "hardware": 6 * n, "measured": None}
