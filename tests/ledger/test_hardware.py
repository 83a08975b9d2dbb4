import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import run_json
from lmledger import cli
from lmledger.errors import UserError
from lmledger.ledger.hardware import bandwidth, cpu, gpus, matmul, memory
from lmledger.ledger.hardware import peak_flops as lookup
from lmledger.ledger.hardware.gpus import DTYPES, GPUS, PeakFlops, datasheet_peak, dtype_name, resolve
from lmledger.ledger.hardware.matmul import float32_matmul_precision
from lmledger.ledger.hardware.peak_flops import NoPeakFlops, compute_dtype_for_precision, peak_flops

# What torch.cuda.get_device_name() reports on each part (nvidia-smi / rocm-smi names), and the entry it
# must map to. B300: "NVIDIA B300 SXM6 AC" as reported in torchao's roofline table (pytorch/ao #3640).
TORCH_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA B200": "b200",
    "NVIDIA GB200": "gb200",
    "NVIDIA B300 SXM6 AC": "b300",
    "NVIDIA GB300": "gb300",
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
    "NVIDIA A10": "a10",
    "NVIDIA A10G": "a10g",
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI300X VF": "mi300x",  # an SR-IOV virtual function (cloud VMs)
    "AMD Instinct MI325X": "mi325x",
}

# Figures typed from the vendors' datasheets, dense (the "with sparsity" figures halved), per GPU:
# (fp64, fp32, tf32, bf16, fp16, fp8, int8) in TFLOP/s (TOPS for int8), memory in GB, bandwidth in TB/s.
_A100 = (19.5, 19.5, 156, 312, 312, None, 624)  # NVIDIA A100 datasheet (fp64 = FP64 Tensor Core)
_H100_SXM = (67, 67, 494.7, 989.4, 989.4, 1978.9, 1978.9)  # NVIDIA H100 datasheet, SXM column
_H100_NVL = (60, 60, 417.5, 835, 835, 1670, 1670)  # NVIDIA H100 / H200 datasheets, NVL columns
_V100_SXM2 = (7.8, 15.7, None, None, 125, None, None)  # NVIDIA V100 datasheet (fp16 = Tensor)
_V100_PCIE = (7, 14, None, None, 112, None, None)
_A10 = (None, 31.2, 62.5, 125, 125, None, 250)  # NVIDIA A10 datasheet
_CDNA3 = (163.4, 163.4, 653.7, 1307.4, 1307.4, 2614.9, 2614.9)  # AMD Instinct MI300X / MI325X data sheets
DATASHEETS = {
    "a100-40gb": (_A100, 40, 1.555),
    "a100-80gb": (_A100, 80, 2.039),
    "a100-pcie-40gb": (_A100, 40, 1.555),
    "a100-pcie-80gb": (_A100, 80, 1.935),
    "h100-sxm": (_H100_SXM, 80, 3.35),
    "h100-pcie": ((51, 51, 378, 756, 756, 1513, 1513), 80, 2.0),  # H100 datasheet, PCIe column
    "h100-nvl": (_H100_NVL, 94, 3.9),
    # No datasheet (torchtitan: between SXM and NVL): a third of the way from the NVL (400 W) to the SXM (700 W).
    "h100-sxm-500w": (tuple(n + (s - n) / 3 for s, n in zip(_H100_SXM, _H100_NVL, strict=True)), 96, 2.4),
    "h200": (_H100_SXM, 141, 4.8),  # NVIDIA H200 datasheet, SXM column
    "h200-nvl": (_H100_NVL, 141, 4.8),
    # NVIDIA's per-GPU Blackwell table (HGX B200 / GB200 NVL72 pages): sparse 2.2 / 4.5 / 9 / 9 P halved.
    "b200": ((37, 75, 1100, 2250, 2250, 4500, 4500), 180, 7.7),
    "gb200": ((40, 80, 1250, 2500, 2500, 5000, 5000), 186, 8),
    # NVIDIA HGX B300 sheet (8 GPUs: fp64 10 TF, fp32 600 TF, tf32 18 P*, bf16 36 P*, fp8 72 P*, int8 2 P*).
    "b300": ((1.25, 75, 1125, 2250, 2250, 4500, 125), 270, 7.7),
    # NVIDIA GB300 NVL72 page (72 GPUs: tf32 180 P*, bf16 360 P*, fp8 720 P*, int8 23 P*; 576 TB/s).
    "gb300": ((None, 80, 1250, 2500, 2500, 5000, 160), 279, 8),
    "l4": ((None, 30.3, 60, 121, 121, 242.5, 242.5), 24, 0.3),  # NVIDIA L4 datasheet
    "l40s": ((None, 91.6, 183, 362.05, 362.05, 733, 733), 48, 0.864),  # NVIDIA L40S datasheet
    # NVIDIA Ada architecture whitepaper, RTX 4090 (tensor figures with FP32 accumulate).
    "rtx-4090": ((None, 82.6, 82.6, 165.2, 165.2, 330.3, 660.6), 24, 1.008),
    "a10": (_A10, 24, 0.6),
    "a10g": (_A10, 24, 0.6),
    "v100": (_V100_SXM2, 16, 0.9),
    "v100-32gb": (_V100_SXM2, 32, 0.9),
    "v100-pcie": (_V100_PCIE, 16, 0.9),
    "v100-pcie-32gb": (_V100_PCIE, 32, 0.9),
    "t4": ((None, 8.1, None, None, 65, None, 130), 16, 0.32),  # NVIDIA T4 datasheet
    "mi300x": (_CDNA3, 192, 5.3),
    "mi325x": (_CDNA3, 256, 6.0),
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
    # Meta's 500 W HBM2e H100: no source prints the name torch reports for it; its key reaches it.
    assert set(TORCH_NAMES.values()) == set(GPUS) - {"h100-sxm-500w"}
    assert resolve("h100-sxm-500w").key == resolve("H100 SXM 500W").key == "h100-sxm-500w"


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100 SXM4",  # no such part
        "NVIDIA L40",  # not the L40S, and not the L4
        "NVIDIA GB200 Laptop",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "AMD Instinct MI250X",
        "NVIDIA A100 24GB",  # no such A100
        "",
    ],
)
def test_unknown_names_warn_and_return_none(name):
    with pytest.warns(UserWarning, match="no datasheet entry"):
        assert resolve(name) is None


def test_every_entry_matches_its_datasheet():
    assert set(DATASHEETS) == set(GPUS)
    for key, (tflops, gb, tb_per_s) in DATASHEETS.items():
        spec = GPUS[key]
        for dtype, figure in zip(DTYPES, tflops, strict=True):
            if figure is None:
                assert spec.peak_flops[dtype] is None, (key, dtype)
            else:
                assert spec.peak_flops[dtype] == pytest.approx(figure * 1e12, rel=1e-9), (key, dtype)
        assert spec.memory_bytes == pytest.approx(gb * 1e9, rel=1e-9), key
        assert spec.bandwidth_bytes_per_s == pytest.approx(tb_per_s * 1e12, rel=1e-9), key


def test_ambiguous_names_say_which_entries_match():
    with pytest.warns(UserWarning, match="ambiguous: matches a100-40gb, a100-80gb;"):
        assert resolve("NVIDIA A100") is None
    with pytest.warns(UserWarning, match="ambiguous: matches a100-pcie-40gb, a100-pcie-80gb;"):
        assert resolve("NVIDIA A100 PCIe") is None
    with pytest.warns(UserWarning, match="ambiguous: matches h100-sxm, h100-pcie, h100-nvl;"):
        assert resolve("NVIDIA H100") is None
    with pytest.warns(UserWarning, match="ambiguous: matches h100-sxm, h100-pcie;"):
        assert resolve("H100 80GB") is None
    with pytest.raises(UserError, match="ambiguous: matches v100, v100-32gb;"):
        gpus.require_gpu("Tesla V100-SXM2")


def test_no_sparse_figures():
    # Lightning 2.6.6 lists H200 bf16 as 2.0e15 and H100 NVL as 1978.8e12: the "with sparsity" figures.
    assert GPUS["h200"].peak_flops["bf16"] == GPUS["h100-sxm"].peak_flops["bf16"] == 989.4e12
    assert GPUS["h100-nvl"].peak_flops["bf16"] == 835e12
    assert GPUS["b200"].peak_flops["bf16"] == 2.25e15
    for key in ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "b200", "gb200", "b300", "gb300", "mi300x"):
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
        assert peak_flops("fp32", "cuda:0") == PeakFlops(67e12, "datasheet:h200", "fp32")
    with float32_matmul_precision("high"):
        assert peak_flops("fp32", "cuda:0") == PeakFlops(494.7e12, "datasheet:h200", "tf32")
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


def _cpu(flags: str, machine: str = "x86_64", cores: int = 2, ghz: float | None = 2.6) -> cpu.CpuInfo:
    return cpu.CpuInfo("test CPU", machine, cores, 2 * cores, ghz, "cpuinfo MHz", frozenset(flags.split()))


@pytest.mark.parametrize(
    "flags,machine,dtype,flop_per_cycle",
    [
        # Two FMA pipes x lanes x 2 FLOP: AVX-512 16 fp32 lanes, AVX2 8; AVX without FMA: 8 add + 8 mul.
        ("sse2 avx avx2 fma avx512f", "x86_64", "fp32", 64),
        ("sse2 avx avx2 fma avx512f", "x86_64", "fp64", 32),
        ("sse2 avx avx2 fma", "x86_64", "fp32", 32),
        ("sse2 avx", "x86_64", "fp32", 16),
        ("sse2", "x86_64", "fp32", 8),
        # AMX: 1024 bf16 operations per cycle per core (Intel's AMX overview); AVX512-BF16: 2 x 32 x 2.
        ("avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile", "x86_64", "bf16", 1024),
        ("avx2 fma avx512f avx512_bf16", "x86_64", "bf16", 128),
        ("avx2 fma avx512f avx512_fp16", "x86_64", "fp16", 128),
        ("avx2 fma", "x86_64", "bf16", 32),  # no native bf16: converted, multiplied as fp32
        ("fp asimd", "aarch64", "fp32", 32),  # 4 NEON FMA pipes x 4 lanes x 2
    ],
)
def test_cpu_spec_peak_is_cores_times_clock_times_flop_per_cycle(flags, machine, dtype, flop_per_cycle):
    peak = cpu.cpu_spec_peak(dtype, _cpu(flags, machine, cores=4, ghz=3.0))
    assert peak.source == "spec" and peak.dtype == dtype
    assert peak.flops_per_s == pytest.approx(4 * 3.0e9 * flop_per_cycle)
    assert peak.detail.startswith(f"spec: 4 cores x 3 GHz (cpuinfo MHz) x {flop_per_cycle} FLOP/cycle")


def test_no_cpu_spec_peak_without_a_clock_or_a_known_vector_unit():
    assert cpu.cpu_spec_peak("fp32", _cpu("avx2 fma", ghz=None)) is None
    assert cpu.cpu_spec_peak("fp32", _cpu("", machine="riscv64")) is None
    assert cpu.cpu_spec_peak("fp32", _cpu("fp", machine="aarch64")) is None
    assert cpu.cpu_spec_peak("fp8", _cpu("avx2 fma avx512f amx_bf16")) is None


def test_cpu_info_counts_physical_cores_this_process_may_use():
    info = cpu.cpu_info()
    assert 1 <= info.cores <= info.logical_cpus <= (os.cpu_count() or 1)
    assert info.logical_cpus == len(os.sched_getaffinity(0))
    if info.ghz is not None:
        assert 0.2 < info.ghz < 7  # GHz of any CPU made


def test_peak_flops_on_the_cpu_is_measured_once_per_machine(monkeypatch, tmp_path):
    spec = cpu.cpu_spec_peak("fp32")
    if spec is None:
        pytest.skip("this OS reports no CPU clock or flags")
    monkeypatch.setenv("LMLEDGER_CACHE_DIR", str(tmp_path))
    calls = []
    real = matmul.best_matmul_rate
    monkeypatch.setattr(matmul, "best_matmul_rate", lambda *a: calls.append(a) or real(*a[:2], 1))
    with float32_matmul_precision("highest"):
        first, second = peak_flops("fp32", "cpu"), peak_flops(torch.float32, "cpu")
    assert first == second  # the machine's figure: the same whatever the load
    assert len(calls) == 1  # measured once, then read from the cache
    assert first.flops_per_s >= spec.flops_per_s
    assert first.detail.startswith("spec: ") if first.source == "spec" else "above the" in first.detail


def test_measured_cpu_peak_is_cached_per_machine_with_when_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("LMLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_rate(device, dtype, rounds):
        calls.append((device, dtype, rounds))
        return 1.5e11 + len(calls)

    monkeypatch.setattr(matmul, "best_matmul_rate", fake_rate)
    first = cpu.measured_cpu_peak("fp32")
    assert calls == [("cpu", "fp32", cpu.CPU_MEASURE_TRIES)]
    assert (first.flops_per_s, first.source, first.dtype) == (1.5e11 + 1, "measured", "fp32")
    assert re.match(r"measured \d{4}-\d\d-\d\d, best of 5 \(cache: ", first.detail)
    cache = tmp_path / "cache" / cpu.CPU_PEAKS_FILE
    [(key, entry)] = json.loads(cache.read_text()).items()
    assert key.endswith("| fp32") and f"torch {torch.__version__}" in key
    assert entry["flops_per_s"] == 1.5e11 + 1 and entry["tries"] == 5 and entry["measured_at"]

    assert cpu.measured_cpu_peak("fp32") == first  # read back, not measured again
    assert len(calls) == 1
    assert cpu.measured_cpu_peak("fp32", refresh=True).flops_per_s == 1.5e11 + 2
    cpu.measured_cpu_peak("bf16")  # another dtype is another entry
    assert len(json.loads(cache.read_text())) == 2

    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring unreadable CPU peak cache"):
        assert cpu.measured_cpu_peak("fp32").flops_per_s == 1.5e11 + 4
    assert not list(cache.parent.glob(".*.tmp"))


def test_the_cpu_peak_is_never_below_a_measured_matmul(tmp_path, monkeypatch):
    # The two CPU peaks side by side: the peak MFU divides by is the larger, so no matmul beats it; a VM
    # that reports its nominal clock (this one: 2.2 GHz) has a spec below what its cores reach.
    spec = cpu.cpu_spec_peak("fp32")
    if spec is None:
        pytest.skip("this OS reports no CPU clock or flags")
    monkeypatch.setenv("LMLEDGER_CACHE_DIR", str(tmp_path))
    measured = cpu.measured_cpu_peak("fp32", tries=3)
    peak = cpu.cpu_peak("fp32")
    assert peak.flops_per_s == max(spec.flops_per_s, measured.flops_per_s)
    assert peak.source == ("spec" if spec.flops_per_s >= measured.flops_per_s else "measured")
    assert measured.flops_per_s > 0.1 * spec.flops_per_s  # a sane share of it, even on a shared machine
    fresh = matmul.best_matmul_rate("cpu", "fp32", 1)
    assert fresh <= peak.flops_per_s * 1.05  # a later measurement does not beat it either (5%: noise)


def test_no_cpu_peak_for_gpu_only_formats(recwarn):
    # A missing peak is a value with its reason, not a warning to catch and scrape.
    for dtype in ("fp8", "tf32", "int8"):
        missing = peak_flops(dtype, "cpu")
        assert isinstance(missing, NoPeakFlops), dtype
        assert missing.reason.startswith(f"no peak for {dtype} on cpu: ")
    assert "GPU tensor-core format" in peak_flops("fp8", "cpu").reason
    assert "not benchmarked" in peak_flops("int8", "cpu").reason
    assert not recwarn.list
    with pytest.raises(ValueError, match="tf32"):
        matmul.time_matmul("tf32", 64, torch.device("cpu"), repeats=1, warmup=0)


def test_gpus_resolve_json_shape(capsys):
    entry = run_json(capsys, "gpus", "--resolve", "NVIDIA H100 80GB HBM3", "--json")
    assert set(entry) == {
        "name",
        "key",
        "peak_flops",
        "memory_bytes",
        "bandwidth_bytes_per_s",
        "sms",
        "l2_bytes",
        "arch",
    }
    assert entry["key"] == "h100-sxm" and entry["sms"] == 132 and entry["arch"] == "hopper"
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


def test_ambiguous_gpu_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "lmledger.cli", "gpus", "--resolve", "NVIDIA A100"], capture_output=True, text=True
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    [line] = proc.stderr.strip().splitlines()
    assert "ambiguous: matches a100-40gb, a100-80gb;" in line


def test_napkin_commands_import_neither_torch_nor_lightning():
    code = (
        "import sys, lmledger.cli, lmledger.commands.plan, lmledger.commands.gpus; "
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_a_closed_pipe_ends_quietly():
    # `lmledger gpus --json | head -c 600`: the reader leaves before the table is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lmledger.cli", "gpus", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141  # 128 + SIGPIPE, as `yes | head` reports
    assert proc.stderr == ""


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
    assert isinstance(peak, PeakFlops) and peak.flops_per_s > 0
    if spec is not None:
        assert peak.source == f"datasheet:{spec.key}"
    # The measured path (for unlisted GPUs) works here too, and stays below the dense datasheet peak.
    measured = lookup._measured_peak(f"cuda:{torch.cuda.current_device()}", "bf16")
    assert measured.source == "measured" and measured.flops_per_s > 0
    if spec is not None:
        assert measured.flops_per_s < 1.05 * spec.peak_flops["bf16"]


def test_the_lines_a_missing_peak_gives_say_why(recwarn):
    """The throughput callback's peak line and account's MFU line carry NoPeakFlops's reason, word for word."""
    from lmledger.callbacks.peak_flops import resolve_peak

    reason = "no peak for fp8 on cpu: fp8 is a GPU tensor-core format (no CPU kernel worth timing)"
    assert resolve_peak("transformer-engine", torch.device("cpu")) == (None, f"no peak, so no MFU/HFU: {reason}")
    assert resolve_peak("bf16-mixed", torch.device("cpu"), fp8="torchao")[1].endswith(reason)
    assert not recwarn.list


def test_the_usable_cache_ends_where_half_the_bytes_come_from_dram():
    # The Intel VM's sweep (2026-12-07, GB/s): its /sys says 480 MiB, one thread reads from cache up to ~64 MiB.
    mib = 1 << 20
    swept = {4: 27.8, 8: 27.4, 16: 26.3, 32: 23.5, 45: 20.5, 64: 19.8, 90: 19.0, 128: 16.4, 256: 13.4, 960: 14.7}
    rates = {k * mib: v * 1e9 for k, v in swept.items()}
    half = 2 * 27.8 * 14.7 / (27.8 + 14.7)  # 19.2 GB/s: half the bytes from each level
    assert bandwidth.usable_cache(rates) == 64 * mib
    assert 19.0 < half < 19.8
    # The edge is the first size to fall under it, even where a larger one reads faster again (a busy moment).
    assert bandwidth.usable_cache({**rates, 45 * mib: 15e9}) == 32 * mib
    # A sweep that sees no edge keeps its largest size (usable_cpu_cache caps it at what /sys reports); one that
    # falls at once, its smallest.
    assert bandwidth.usable_cache({4 * mib: 14e9, 8 * mib: 14e9, 960 * mib: 14e9}) == 960 * mib
    assert bandwidth.usable_cache({4 * mib: 14e9, 8 * mib: 9e9, 960 * mib: 14e9}) == 4 * mib


def test_the_usable_cpu_cache_is_swept_once_per_machine_and_never_above_what_sys_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("LMLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    mib, swept = 1 << 20, []
    monkeypatch.setattr(bandwidth, "cpu_cache_levels", lambda: [48 << 10, 2 * mib, 480 * mib])

    def read_rates(sizes, tries):
        swept.append(sizes)
        return {s: (28e9 if s <= 64 * mib else 14e9) for s in sizes}

    monkeypatch.setattr(bandwidth, "_read_rates", read_rates)
    usable = bandwidth.usable_cpu_cache()
    [sizes] = swept
    assert sizes[0] == 4 * mib and sizes[-1] == min(960 * mib, memory.free_memory(torch.device("cpu")) // 4)
    assert all(1.4 < b / a < 1.42 for a, b in zip(sizes[:-2], sizes[1:-1], strict=True))  # sqrt(2) apart, to the top
    assert 45 * mib < usable <= 64 * mib
    [entry] = json.loads((tmp_path / "cache" / "cpu-cache.json").read_text()).values()
    assert entry["bytes"] == usable and entry["measured_at"] and len(entry["read_bytes_per_s"]) == len(sizes)
    assert bandwidth.usable_cpu_cache() == usable and len(swept) == 1  # read back
    monkeypatch.setattr(bandwidth, "_read_rates", lambda sizes, tries: dict.fromkeys(sizes, 28e9))
    assert bandwidth.usable_cpu_cache(refresh=True) == 480 * mib  # all cached: the level /sys reports, no more
    monkeypatch.setattr(bandwidth, "cpu_cache_levels", lambda: [1 * mib])
    assert bandwidth.usable_cpu_cache() == 1 * mib  # one level: nothing to sweep past


def test_stays_cached_measures_only_where_the_answer_turns_on_it(monkeypatch):
    from lmledger.ledger.timing.steptime import replay

    mib, asked = 1 << 20, []
    monkeypatch.setattr(replay, "cpu_cache_levels", lambda: [48 << 10, 2 * mib, 480 * mib])
    monkeypatch.setattr(replay, "usable_cpu_cache", lambda: asked.append(1) or 64 * mib)
    cpu_device = torch.device("cpu")
    assert replay.cache_bytes(cpu_device) == 480 * mib
    assert replay.stays_cached(cpu_device, 4 * mib) and not replay.stays_cached(cpu_device, 481 * mib)
    assert asked == []
    assert replay.stays_cached(cpu_device, 64 * mib) and not replay.stays_cached(cpu_device, 446 * mib)
    assert len(asked) == 2


def test_a_multi_rank_fit_measures_the_usable_cache_on_local_rank_0_before_the_ranks_meet(tmp_path, monkeypatch):
    # Ranks sweeping at once would share the cache, and the machine's cache file would keep half of it.
    from lmledger.callbacks import steptime
    from lmledger.ledger.count.ops import OpRecord, OpSummary
    from lmledger.ledger.timing.steptime import calibrate, rankwait, replay

    monkeypatch.setenv("LMLEDGER_CACHE_DIR", str(tmp_path))
    mib, asked = 1 << 20, []
    monkeypatch.setattr(replay, "cpu_cache_levels", lambda: [48 << 10, 2 * mib, 480 * mib])
    monkeypatch.setattr(replay, "usable_cpu_cache", lambda: asked.append(1) or 64 * mib)
    calibrations = ((steptime, "lightning_loop_seconds"), (calibrate, "collective_model"), (rankwait, "rank_wait"))
    for module, name in calibrations:
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    step = OpSummary.of([OpRecord("aten.mm.default", "forward", "matmul", 8, 0, 0, "float32",
                                  storages=((1, 100 * mib),), output_storages=((2, 10 * mib),))], None)  # fmt: skip
    steptime._calibrate_ranks(2, 2, step, {})
    assert asked == [1]
