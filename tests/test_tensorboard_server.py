"""The real TensorBoard server, started on a ledger run, serves `perf/mfu` back over its HTTP data API."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from conftest import one_intra_op_thread, read_scalars
from lmledger.callbacks import LedgerSettings, ledger_callbacks
from lmledger.data import TokenDataModule
from lmledger.lit import LitLM
from lmledger.model import ModelConfig

STARTUP_S = 90  # a loaded 2-core machine can take a while to import TensorBoard and read the run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fit_tiny_run(data, log_dir) -> str:
    L.seed_everything(0, verbose=False)
    datamodule = TokenDataModule(path=str(data), batch_size=4, context_length=32)
    config = ModelConfig(
        vocab_size=datamodule.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2, d_ff=64
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=TensorBoardLogger(str(log_dir), name="tiny"),
        callbacks=ledger_callbacks(LedgerSettings(warmup_steps=1)),
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LitLM(config), datamodule)
    return trainer.logger.log_dir


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_tensorboard_serves_the_ledger_tags(stdlib_data, tmp_path):
    logdir = tmp_path / "runs"
    with one_intra_op_thread():
        run_dir = fit_tiny_run(stdlib_data, logdir)
    expected = read_scalars(run_dir)["perf/mfu"]
    assert expected

    port = free_port()
    log = (tmp_path / "tensorboard.log").open("w")
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
               "--port", str(port), "--load_fast", "false", "--reload_interval", "1"]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    query = urllib.parse.urlencode({"run": "tiny/version_0", "tag": "perf/mfu"})
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
    try:
        served, deadline = None, time.monotonic() + STARTUP_S
        while served is None and time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(
                    f"tensorboard exited with {server.returncode}: {(tmp_path / 'tensorboard.log').read_text()}"
                )
            try:
                served = get_json(url) or None  # [] until the run is loaded
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or the run not read yet (400)
            if served is None:
                time.sleep(0.5)
        assert served is not None, f"no perf/mfu from tensorboard within {STARTUP_S} s"
        assert [step for _, step, _ in served] == [step for step, _ in expected]
        assert [value for _, _, value in served] == pytest.approx([value for _, value in expected], rel=1e-6)
        assert all(0 < value <= 1 for _, _, value in served)
        tags = get_json(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")["tiny/version_0"]
        assert {"perf/tokens_per_sec", "flops/model_per_step", "memory/predicted/peak"} <= set(tags)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()
