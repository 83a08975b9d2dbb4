"""A live FSDP2 fit (Lightning's ModelParallelStrategy, fully_shard in configure_model) is predicted per rank by
Ledger() (callbacks.fsdp2) and held to what each of 2 real gloo ranks on this CPU measures: LitLM through
`lmledger fit`, and a plain-PyTorch module with its own configure_model. A tensor-parallel mesh is measured
only, with one line. LitLM's gradient norm and clipping under FSDP2 equal a single process's on the same data.

Each fit is a few steps of a tiny model. The plain module's 2-rank fits are started as a script (this file run
as one: `python tests/callbacks/test_ledger_fsdp2.py OUT`), since Lightning's launcher for ModelParallelStrategy starts
rank 1 by running the same command again. The script fits every case of PLAIN_CASES in turn, in one launch (the
later fits reuse its two ranks and process group: one start-up, not four), test_fsdp2_accumulate's manual
optimization fit among them; each rank writes its Ledger's figures to OUT/CASE/rank{R}.json (DumpLedger)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lmledger.callbacks import Ledger
from lmledger.lit import LitLM
from lmledger.model import ModelConfig

HERE = Path(__file__).resolve()
STATE = ("params", "grads", "optimizer")
PEAK_TOLERANCE = 0.03


class DumpLedger(pl.Callback):
    """At fit end, this rank's Ledger figures (predicted and measured) to $LEDGER_DUMP/rank{R}.json."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ledger = next(c for c in trainer.callbacks if isinstance(c, Ledger))
        report = ledger.report
        lines = ("params", "grads", "optimizer", "activations", "peak")
        figures = {
            "predicted": {n: report.primary.get(n) for n in lines} if report.primary else None,
            "measured": {n: report.measured.get(n) for n in lines} if report.measured else None,
            "closed_form": {n: closed.get(n) for n in lines}
            if (closed := report.predicted.get("closed form"))
            else None,
            "why_not_predicted": ledger.why_not_predicted,
            "rank": trainer.global_rank,
            "threads": torch.get_num_threads(),
        }
        out = Path(os.environ["LEDGER_DUMP"]) / f"rank{trainer.global_rank}.json"
        out.write_text(json.dumps(figures))


class SyncProbe(pl.Callback):
    """After every backward: whether each FSDP2 unit reduces its grads and every sharded grad is set (as it is
    after a reduce-scatter; under no sync it would stay None until the last micro-batch). To
    $LEDGER_DUMP/sync{R}.json at fit end. (test_fsdp2_accumulate's; here, so its own ranks need no Lightning.)"""

    def __init__(self) -> None:
        self.seen: list[list[bool]] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        groups = [
            group
            for module in pl_module.modules()
            if callable(getattr(module, "_get_fsdp_state", None))
            for group in module._get_fsdp_state()._fsdp_param_groups
        ]
        grads_set = all(p.grad is not None for p in pl_module.parameters())
        self.seen.append([bool(groups) and all(g.reduce_grads for g in groups), grads_set])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = Path(os.environ["LEDGER_DUMP"]) / f"sync{trainer.global_rank}.json"
        out.write_text(json.dumps(self.seen))


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_predicted_equals_measured(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["why_not_predicted"] is None, rank
        predicted, measured = rank["predicted"], rank["measured"]
        for line in STATE:
            assert predicted[line] == measured[line] > 0, (rank["rank"], line, predicted, measured)
        assert abs(measured["peak"] / predicted["peak"] - 1) <= PEAK_TOLERANCE, (rank["rank"], predicted, measured)


def _env(out: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)  # DumpLedger's module
    return {**os.environ, "OMP_NUM_THREADS": "1", "LEDGER_DUMP": str(out), "PYTHONPATH": path}


# --------------------------------------------------------------------------------------------
# (a) LitLM through `lmledger fit`
# --------------------------------------------------------------------------------------------

FSDP2 = ["--trainer.strategy", "fsdp2"]  # lmledger.strategies: ModelParallelStrategy, tensor parallel 1


def test_fsdp2_names_model_parallel_with_every_rank_data_parallel():
    import lightning.pytorch as pl

    import lmledger.fitting.cli  # noqa: F401  (registers "fsdp2")
    from lmledger.strategies import FSDP2Strategy

    trainer = pl.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    strategy = trainer.strategy
    assert isinstance(strategy, FSDP2Strategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == ("auto", 1)  # W ranks at setup


def test_litlm_fsdp2_fit_is_predicted_per_rank(workdir):
    from conftest import TINY_OVERRIDES, read_scalars

    out = workdir / "dump"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "lmledger.cli", "fit", "--config", "configs/tiny.yaml", *TINY_OVERRIDES, *FSDP2,
        "--trainer.devices", "2", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2",
        "--trainer.val_check_interval", "4", "--ledger.warmup_steps", "1",
        "--trainer.callbacks+=test_ledger_fsdp2.DumpLedger",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stderr + proc.stdout
    ranks = _ranks(out)
    _check_predicted_equals_measured(ranks)
    # Each rank holds half of every (even) tensor: the state is half the single-device closed form's whole.
    scalars = read_scalars(workdir / "runs" / "tiny" / "version_0")
    whole = 4 * sum(p.numel() for p in LitLM(_tiny_config()).model.parameters())
    assert ranks[0]["measured"]["params"] == whole // 2
    assert scalars["memory/predicted/params"][-1][1] == ranks[0]["predicted"]["params"]
    grad_norms = [v for _, v in scalars["train/grad_norm"]]
    assert len(grad_norms) == 2 and all(0 < v < float("inf") for v in grad_norms)


def _tiny_config() -> ModelConfig:
    # conftest.TINY_OVERRIDES on configs/tiny.yaml, vocabulary of the stdlib corpus (bytes)
    return ModelConfig(vocab_size=256, context_length=64, d_model=64, n_layers=2, n_heads=2, d_ff=128,
                       tie_embeddings=False)  # fmt: skip


# --------------------------------------------------------------------------------------------
# (b), (c) a plain-PyTorch LightningModule with its own configure_model
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class PlainFSDP2(pl.LightningModule):
    """fully_shard on each block, then the net, resharding after forward off; Adam."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = Net(width)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.net, mesh=mesh, reshard_after_forward=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _plain_fit(case: str) -> None:
    """One rank of the 2-rank fit of PlainFSDP2 (run as a script: Lightning starts rank 1 the same way)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data_parallel, tensor_parallel = (1, 2) if case == "tensor_parallel" else (2, 1)
    width = 33 if case == "uneven" else 32  # 33: some first dimensions do not divide by the 2 ranks
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, width, generator=g), torch.randint(0, 10, (64,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel),
        callbacks=[Ledger(warmup_steps=1), DumpLedger()],
    )  # fmt: skip
    trainer.fit(PlainFSDP2(width), torch.utils.data.DataLoader(data, batch_size=8))


PLAIN_CASES = ("plain", "uneven", "tensor_parallel", "manual")  # manual: test_fsdp2_accumulate's subject


def _plain_fits(out: Path) -> None:
    """Both ranks' script: every case's fit in turn, each dumping to OUT/CASE (rank 0 starts rank 1 at the first)."""
    from test_fsdp2_accumulate import _manual_fit

    for case in PLAIN_CASES:
        (out / case).mkdir(exist_ok=True)  # both ranks make it
        os.environ["LEDGER_DUMP"] = str(out / case)
        _manual_fit() if case == "manual" else _plain_fit(case)


def launch_plain_fits(out: Path) -> dict[str, list[dict] | str]:
    """The script's one launch (conftest's session fixture plain_fsdp2_ranks): each case's ranks' dumps. The
    script stops at the first case that fails: that case and those after it get the failure instead (a launch
    that failed with every case dumped fails them all), so each test fails alone for its own case."""
    proc = subprocess.run(
        [sys.executable, str(HERE), str(out)], capture_output=True, text=True, timeout=300, env=_env(out), cwd=out,
    )  # fmt: skip
    dumped = [c for c in PLAIN_CASES if all((out / c / f"rank{r}.json").is_file() for r in range(2))]
    if proc.returncode != 0 and len(dumped) == len(PLAIN_CASES):
        dumped = []
    failed = f"the 2-rank launch exited {proc.returncode}: {proc.stderr[-3000:]}"
    return {case: _ranks(out / case) if case in dumped else failed for case in PLAIN_CASES}


def case_ranks(launched: dict[str, list[dict] | str], case: str) -> list[dict]:
    """One case's ranks from launch_plain_fits, or its failure."""
    ranks = launched[case]
    assert isinstance(ranks, list), ranks
    return ranks


def test_plain_module_with_its_own_configure_model_is_predicted_per_rank(plain_fsdp2_ranks):
    ranks = case_ranks(plain_fsdp2_ranks, "plain")
    _check_predicted_equals_measured(ranks)
    whole = 4 * sum(p.numel() for p in Net().parameters())
    assert [r["measured"]["params"] for r in ranks] == [whole // 2, whole // 2]
    assert ranks[0]["measured"]["optimizer"] == 2 * ranks[0]["measured"]["params"]  # Adam: two moments


def test_uneven_shards_predict_rank_0_which_holds_the_most(plain_fsdp2_ranks):
    """The fake process group's rank is 0, so every rank is given rank 0's step. Where a first dimension does not
    divide by W, FSDP2 pads each rank's parameter and gradient shard to one size (equal on every rank), while
    Adam's moments follow the unpadded shard: the last rank holds less, and its peak is below the prediction."""
    ranks = case_ranks(plain_fsdp2_ranks, "uneven")
    _check_predicted_equals_measured(ranks[:1])
    last = ranks[1]
    predicted, measured = last["predicted"], last["measured"]
    assert predicted == ranks[0]["predicted"]
    assert measured["params"] == predicted["params"] and measured["grads"] == predicted["grads"]
    assert measured["optimizer"] < predicted["optimizer"]
    assert 1 - PEAK_TOLERANCE <= measured["peak"] / predicted["peak"] < 1


def test_a_tensor_parallel_mesh_is_predicted_per_rank(plain_fsdp2_ranks):
    """Issue 30: a (1 x 2) mesh is predicted on a fake 2-D mesh. This module shards over data parallel only
    (a mesh of one), so each rank holds it whole (tests/ledger/test_tensor_parallel.py has modules with TP plans)."""
    ranks = case_ranks(plain_fsdp2_ranks, "tensor_parallel")
    _check_predicted_equals_measured(ranks)
    whole = 4 * sum(p.numel() for p in Net().parameters())
    assert [r["measured"]["params"] for r in ranks] == [whole, whole]


# --------------------------------------------------------------------------------------------
# LitLM's gradient norm and clipping under FSDP2
# --------------------------------------------------------------------------------------------

CLIP = 0.05  # well below the first step's norm: clipping acts


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)) for _ in "ab"]


def _lit(strategy) -> LitLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    lit = LitLM(config)
    lit._trainer = SimpleNamespace(strategy=strategy)  # what gradient_norm and configure_model read
    return lit


def _clipped(lit: LitLM) -> tuple[float, dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(lit.parameters(), lr=1.0)
    norm = lit.gradient_norm()
    assert type(norm) is torch.Tensor  # not FSDP2's DTensor of partial norms: NonFiniteGuard all-reduces it
    lit.configure_gradient_clipping(optimizer, gradient_clip_val=CLIP)
    grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in lit.named_parameters()}
    return float(norm), grads


def _fsdp2_rank() -> tuple[float, dict[str, torch.Tensor]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    lit = _lit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    lit._device_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    lit.configure_model()
    assert all(type(p).__name__ == "DTensor" for p in lit.parameters())
    x, y = _batches()[dist.get_rank()]
    lit(x, y).backward()  # FSDP2 reduce-scatters the mean of the two ranks' gradients
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:  # the step-time prediction prices the all-reduces the norm declares
        lit.gradient_norm()  # kept: _clipped's reads it back
    declared = lit.collectives_per_step(SimpleNamespace(world_size=2))
    return (*_clipped(lit), (comm.get_total_counts(), declared))


def test_litlm_gradient_norm_and_clipping_under_fsdp2_equal_one_process():
    from lmledger.ledger.sharding.sharded import spawn_gloo_ranks

    ranks = spawn_gloo_ranks(_fsdp2_rank, 2)
    lit = _lit(pl.strategies.SingleDeviceStrategy(device="cpu"))
    (x0, y0), (x1, y1) = _batches()
    ((lit(x0, y0) + lit(x1, y1)) / 2).backward()
    norm, grads = _clipped(lit)
    assert norm > 2 * CLIP  # clipping acts
    for rank_norm, rank_grads, (ran, declared) in ranks:
        assert ran == declared == 1  # the partial norm's all-reduce over the shards
        assert rank_norm == pytest.approx(norm, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(rank_grads[name], grad, rtol=1e-4, atol=1e-7)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert float(clipped) == pytest.approx(CLIP, rel=1e-4)


# --------------------------------------------------------------------------------------------
# Canaries: what callbacks.fsdp2 relies on in Lightning
# --------------------------------------------------------------------------------------------


def test_canary_callbacks_setup_runs_before_configure_model(tmp_path):
    """Lightning's Trainer._run: callbacks' setup (call._call_setup_hook), then configure_model; the Ledger
    keeps its unsharded copy in setup."""
    order = []

    class Recorder(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            order.append("callback setup")

    class Module(PlainFSDP2):
        def configure_model(self):
            order.append("configure_model")

    data = torch.utils.data.TensorDataset(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Recorder()], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    assert order == ["callback setup", "configure_model"]


def test_canary_device_mesh_reads_the_module_attribute():
    """LightningModule.device_mesh is `_device_mesh` (ModelParallelStrategy sets it): the fake copy's own
    configure_model is handed the fake mesh so."""
    module = PlainFSDP2()
    mesh = object()
    module._device_mesh = mesh
    assert module.device_mesh is mesh


if __name__ == "__main__":
    _plain_fits(Path(sys.argv[1]))
