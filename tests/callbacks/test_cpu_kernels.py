"""Issue 28 §7: CPUs differ between machines, and so do torch's CPU kernels. Tests probe what this CPU runs
(callbacks.cpukernels) and skip with the reason; a fit that meets the limit says so in one line.

oneDNN reads ONEDNN_MAX_CPU_ISA once per process: a subprocess with ONEDNN_MAX_CPU_ISA=AVX2 is the AVX2-only
CPU of the issue on any machine (its bf16 LSTM raises "could not create a primitive descriptor ...")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import SUBPROCESS_WARNINGS_HIDDEN
from lmledger.callbacks.cpukernels import cannot_run, missing_kernel_line

TESTS = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # oneDNN and aten as on a CPU without AVX-512


def avx2_only(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **AVX2_ONLY, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


class RecurrentLM(pl.LightningModule):
    """Token ids through an LSTM: oneDNN's RNN kernel (aten.mkldnn_rnn_layer) on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.head = nn.Linear(16, 1024)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.lstm(self.embed(x))[0]).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_probe_runs_the_op_and_names_what_this_cpu_lacks():
    assert cannot_run("lstm", "32-true") is None and cannot_run("matmul", "bf16-mixed") is None
    assert cannot_run.cache_info().currsize >= 2  # each probe runs once per process
    with pytest.raises(ValueError, match="no CPU probe named 'lsmt'"):
        cannot_run("lsmt", "bf16-mixed")
    code = (
        "from lmledger.callbacks.cpukernels import cannot_run; "
        "print(repr(cannot_run('lstm', 'bf16-mixed'))); print(repr(cannot_run('lstm', '32-true')))"
    )
    proc = avx2_only(code)
    bf16, fp32 = proc.stdout.strip().splitlines()
    assert "cannot run lstm in bf16-mixed: could not create a primitive descriptor for the LSTM" in bf16, proc.stderr
    assert fp32 == "None"


def test_missing_kernel_line_names_the_op_the_precision_and_the_cpu():
    err = RuntimeError(
        "could not create a primitive descriptor for the LSTM forward propagation primitive. Run workload with "
        "environment variable ONEDNN_VERBOSE=all to get additional diagnostic information."
    )
    line = missing_kernel_line(err, "bf16-mixed")
    assert "lacks the kernel for aten.mkldnn_rnn_layer (LSTM forward propagation) in bf16-mixed" in line
    assert "train in 32-true" in line and "\n" not in line
    assert missing_kernel_line(RuntimeError("CUDA error: device-side assert"), "bf16-mixed") is None
    assert missing_kernel_line(ValueError(str(err)), "bf16-mixed") is None


def test_a_fit_on_a_cpu_without_the_kernel_stops_in_one_line(workdir):
    """`lmledger fit` of an LSTM in bf16-mixed where oneDNN has no bf16 LSTM: exit 2, one line naming the
    op, the precision and the CPU, no traceback, and the run directory it claimed is undone. (In library use
    the Ledger adds the same line to the RuntimeError as a note, so its traceback ends with it.)"""
    args = ["fit", "--model", "test_cpu_kernels.RecurrentLM", "--data.init_args.batch_size", "2",
            "--data.init_args.context_length", "8", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.name", "lstm"]  # fmt: skip
    env = {**os.environ, **AVX2_ONLY, "PYTHONWARNINGS": ",".join(SUBPROCESS_WARNINGS_HIDDEN),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "lmledger.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmledger fit: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # (Lightning's info lines aside)
    said = "this CPU (AVX2) lacks the kernel for aten.mkldnn_rnn_layer (LSTM forward propagation) in bf16-mixed"
    assert said in errors[0]
    runs = workdir / "runs"
    left = sorted(str(p.relative_to(workdir)) for p in runs.rglob("*")) if runs.exists() else []
    assert left == [], left
