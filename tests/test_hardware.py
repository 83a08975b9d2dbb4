import math
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import run_json
from lmledger import cli
from lmledger.errors import UserError
from lmledger.ledger import hardware
from lmledger.ledger.hardware import (
    DTYPES,
    GPUS,
    compute_dtype_for_precision,
    datasheet_peak,
    dtype_name,
    float32_matmul_precision,
    peak_flops,
    resolve,
)

# What torch.cuda.get_device_name() reports on each part (nvidia-smi names), and the entry it must map to.
TORCH_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA B200": "b200",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "Tesla V100-SXM2-16GB": "v100",
    "Tesla V100-SXM2-32GB": "v100-32gb",
    "Tesla V100-PCIE-16GB": "v100-pcie",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "Tesla T4": "t4",
    "NVIDIA A10G": "a10g",
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
}

# Dense figures from REFERENCE.md's table (NVIDIA datasheets), in TFLOP/s.
REFERENCE_DENSE = {
    "a100-80gb": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": None, "int8": 624},
    "a100-pcie-40gb": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": None, "int8": 624},
    "h100-sxm": {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
    "h100-pcie": {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513},
    "h100-nvl": {"fp32": 60, "tf32": 417.5, "bf16": 835, "fp16": 835, "fp8": 1670, "int8": 1670},
    "h200": {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
    "b200": {"tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500, "int8": 4500},
}


@pytest.mark.parametrize("key", GPUS)
def test_every_key_resolves_case_and_separator_insensitively(key):
    assert resolve(key) is GPUS[key]
    assert resolve(key.upper()) is GPUS[key]
    assert resolve(key.replace("-", " ")) is GPUS[key]


@pytest.mark.parametrize("name,key", TORCH_NAMES.items())
def test_torch_device_names_resolve(name, key, recwarn):
    assert resolve(name).key == key
    assert resolve(name.lower()).key == key
    assert not recwarn.list


def test_every_entry_is_reachable_from_a_torch_name():
    assert set(TORCH_NAMES.values()) == set(GPUS)


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100",  # form factor unknown: SXM and PCIe peaks differ by 30%
        "NVIDIA A100",  # memory unknown
        "NVIDIA L40",  # not the L40S, and not the L4
        "NVIDIA GB200",  # not the B200
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "AMD Instinct MI300X",
        "",
    ],
)
def test_unknown_names_warn_and_return_none(name):
    with pytest.warns(UserWarning, match="no datasheet entry"):
        assert resolve(name) is None


def test_reference_dense_figures():
    for key, figures in REFERENCE_DENSE.items():
        for dtype, tflops in figures.items():
            if tflops is None:
                assert GPUS[key].peak_flops[dtype] is None, (key, dtype)
            else:
                assert GPUS[key].peak_flops[dtype] == pytest.approx(tflops * 1e12, rel=1e-9), (key, dtype)


def test_no_sparse_figures():
    # Lightning 2.6.6 lists H200 bf16 as 2.0e15 and H100 NVL as 1978.8e12: the "with sparsity" figures.
    assert GPUS["h200"].peak_flops["bf16"] == GPUS["h100-sxm"].peak_flops["bf16"] == 989.4e12
    assert GPUS["h100-nvl"].peak_flops["bf16"] == 835e12
    assert GPUS["b200"].peak_flops["bf16"] == 2.25e15
    for key in ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "b200"):
        peaks = GPUS[key].peak_flops
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=2e-3), key
    # Dense tensor-core tf32 is half of dense bf16 on every chip with both; a sparse bf16 would be 4x.
    for spec in GPUS.values():
        tf32, bf16 = spec.peak_flops["tf32"], spec.peak_flops["bf16"]
        if tf32 is not None and bf16 is not None:
            assert bf16 <= 2.05 * tf32, spec.key


def test_memory_is_datasheet_gigabytes():
    assert GPUS["h100-sxm"].memory_bytes == 80e9  # the lecture's 80e9 bytes per "80 GB" H100
    assert GPUS["h200"].memory_bytes == 141e9
    assert GPUS["a100-40gb"].memory_bytes == 40e9
    assert GPUS["h200"].bandwidth_bytes_per_s == 4.8e12


def test_tf32_rule():
    h100, v100 = GPUS["h100-sxm"], GPUS["v100"]
    high = datasheet_peak(h100, "fp32", float32_matmul_precision="high")
    assert (high.flops_per_s, high.dtype, high.source) == (494.7e12, "tf32", "datasheet:h100-sxm")
    assert datasheet_peak(h100, "fp32", float32_matmul_precision="medium").dtype == "tf32"
    highest = datasheet_peak(h100, "fp32", float32_matmul_precision="highest")
    assert (highest.flops_per_s, highest.dtype) == (67e12, "fp32")
    # Volta has no tf32: fp32 stays fp32 whatever the setting.
    assert datasheet_peak(v100, "fp32", float32_matmul_precision="high").flops_per_s == 15.7e12
    assert datasheet_peak(v100, "bf16") is None


def test_peak_flops_on_a_cuda_device_follows_torch_matmul_precision(monkeypatch):
    # Pretend to be an H200 without touching CUDA: only the reported name matters for a listed GPU.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with float32_matmul_precision("highest"):
        assert peak_flops("fp32", "cuda:0") == hardware.Peak(67e12, "datasheet:h200", "fp32")
    with float32_matmul_precision("high"):
        assert peak_flops("fp32", "cuda:0") == hardware.Peak(494.7e12, "datasheet:h200", "tf32")
        assert peak_flops(torch.bfloat16, "cuda:0").flops_per_s == 989.4e12
    assert peak_flops(compute_dtype_for_precision("transformer-engine"), "cuda:0").flops_per_s == 1978.9e12


@pytest.mark.parametrize(
    "precision,dtype",
    [
        ("32-true", "fp32"),
        ("bf16-mixed", "bf16"),
        ("bf16-true", "bf16"),
        ("16-mixed", "fp16"),
        ("16-true", "fp16"),
        ("transformer-engine", "fp8"),
        ("transformer-engine-float16", "fp8"),
        ("64-true", "fp64"),
        (32, "fp32"),
        ("bf16", "bf16"),
    ],
)
def test_compute_dtype_for_precision(precision, dtype):
    assert compute_dtype_for_precision(precision) == dtype


def test_unknown_precision_and_dtype_are_user_errors():
    with pytest.raises(UserError, match="unknown precision"):
        compute_dtype_for_precision("8-mixed")
    with pytest.raises(UserError, match="unknown dtype"):
        dtype_name("fp9")


def test_dtype_names():
    assert [dtype_name(d) for d in (torch.float32, "bfloat16", torch.float16, torch.float8_e4m3fn, "FP64")] == [
        "fp32",
        "bf16",
        "fp16",
        "fp8",
        "fp64",
    ]


def test_measured_cpu_peak_is_positive_finite_and_cached(monkeypatch):
    hardware._measured_peak.cache_clear()
    calls = []
    real_time_matmul = hardware.time_matmul

    def counting_time_matmul(*args, **kwargs):
        calls.append(args)
        return real_time_matmul(*args, **kwargs)

    monkeypatch.setattr(hardware, "time_matmul", counting_time_matmul)
    first = peak_flops("fp32", "cpu")
    measured_calls = len(calls)
    second = peak_flops("fp32", "cpu")
    assert first.source == "measured" and first.dtype == "fp32"
    assert math.isfinite(first.flops_per_s) and first.flops_per_s > 0
    assert measured_calls >= 1
    assert len(calls) == measured_calls  # the second call did not measure again
    assert second == first


def test_no_cpu_peak_for_gpu_only_formats():
    with pytest.warns(UserWarning, match="no peak for fp8"):
        assert peak_flops("fp8", "cpu") is None
    with pytest.raises(ValueError, match="tf32"):
        hardware.time_matmul("tf32", 64, torch.device("cpu"), repeats=1, warmup=0)


def test_gpus_resolve_json_shape(capsys):
    entry = run_json(capsys, "gpus", "--resolve", "NVIDIA H100 80GB HBM3", "--json")
    assert set(entry) == {"name", "key", "peak_flops", "memory_bytes", "bandwidth_bytes_per_s"}
    assert entry["key"] == "h100-sxm"
    assert list(entry["peak_flops"]) == list(DTYPES)
    assert entry["peak_flops"]["bf16"] == 989.4e12
    assert entry["memory_bytes"] == 80_000_000_000
    assert entry["bandwidth_bytes_per_s"] == 3.35e12

    t4 = run_json(capsys, "gpus", "--resolve", "Tesla T4", "--json")
    assert t4["peak_flops"]["bf16"] is None and t4["peak_flops"]["fp16"] == 65e12


def test_gpus_json_is_the_whole_table(capsys):
    table = run_json(capsys, "gpus", "--json")
    assert set(table) == set(GPUS)
    assert table["b200"]["peak_flops"]["fp8"] == 4.5e15


def test_gpus_table_and_entry_print(capsys):
    assert cli.main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "h200" in out and "989.4" in out and "rtx-4090" in out
    assert cli.main(["gpus", "--resolve", "NVIDIA L40S"]) == 0
    assert "362.05" in capsys.readouterr().out


def test_unknown_gpu_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "lmledger.cli", "gpus", "--resolve", "NVIDIA Z9000", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown GPU 'NVIDIA Z9000'" in lines[0]


@pytest.mark.cuda
def test_peak_flops_on_this_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = resolve(torch.cuda.get_device_name())
    peak = peak_flops("bf16", "cuda")
    assert peak is not None and peak.flops_per_s > 0
    if spec is not None:
        assert peak.source == f"datasheet:{spec.key}"
    # The measured path (for unlisted GPUs) works here too, and stays below the dense datasheet peak.
    measured = hardware._measured_peak(f"cuda:{torch.cuda.current_device()}", "bf16")
    assert measured.source == "measured" and measured.flops_per_s > 0
    if spec is not None:
        assert measured.flops_per_s < 1.05 * spec.peak_flops["bf16"]
