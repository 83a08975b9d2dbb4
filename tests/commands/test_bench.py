import math

import pytest
import torch

from conftest import run_json
from lmledger import cli
from lmledger.bench import bench_matmul

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_matmul_cpu_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "plots" / "mfu.png"
    argv = ["bench", "matmul", "--device", "cpu", "--dtypes", "fp32,bf16,tf32,fp8", "--sizes", "32,64"]
    report = run_json(capsys, *argv, "--repeats", "3", "--json", "--plot", str(plot))

    assert report["device"] == "cpu"
    assert [(r["dtype"], r["size"]) for r in report["results"]] == [
        (dtype, size) for dtype in ("fp32", "bf16", "tf32", "fp8") for size in (32, 64)
    ]
    for r in report["results"]:
        assert r["flops"] == 2 * r["size"] ** 3
        if r["dtype"] in ("fp32", "bf16"):
            assert r["note"] is None
            assert r["seconds"] > 0 and math.isfinite(r["flops_per_s"])
            assert r["flops_per_s"] == pytest.approx(r["flops"] / r["seconds"])
            # The CPU has no datasheet: its peak comes from its own specs (or is measured), labelled so.
            assert r["peak_source"] in ("spec", "measured") and r["peak_flops"] > 0
            assert r["mfu"] == pytest.approx(r["flops_per_s"] / r["peak_flops"])
        else:
            assert r["note"].startswith("unsupported:")
            assert r["seconds"] is None and r["mfu"] is None

    assert plot.read_bytes()[:8] == PNG_SIGNATURE


def test_bench_matmul_table(capsys):
    argv = ["bench", "matmul", "--device", "cpu", "--dtypes", "fp32,fp8", "--sizes", "48", "--repeats", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert ("(spec)" in out or "(measured)" in out) and "unsupported" in out


def test_bench_refuses_to_overwrite_a_plot(tmp_path, capsys):
    plot = tmp_path / "mfu.png"
    plot.write_bytes(b"earlier results")
    assert cli.main(["bench", "matmul", "--device", "cpu", "--sizes", "32", "--plot", str(plot)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert plot.read_bytes() == b"earlier results"


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--dtypes", "fp9"], "unknown dtype"),
        (["--sizes", "0"], "--sizes"),
        (["--sizes", "a,b"], "--sizes"),
        (["--repeats", "0"], "--repeats"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bench_bad_input_is_one_line(flags, match, capsys):
    assert cli.main(["bench", "matmul", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err


def test_a_size_over_the_free_memory_is_a_skipped_row(capsys):
    """--sizes 100000 on a CPU: 40 GB a fp32 matrix, a DefaultCPUAllocator traceback. Now the row says what its
    operands need (pairs of inputs, their fp32 draws and the output) against what is free, and the rest is timed."""
    from lmledger.ledger.hardware.matmul import operand_bytes

    cpu = torch.device("cpu")
    assert operand_bytes("fp32", 100_000, cpu) == 100_000**2 * (2 * 2 * 4 + 2 * 4 + 4)  # 2 pairs: 280 GB
    assert operand_bytes("bf16", 64, cpu) == 64**2 * (16 * 2 * 2 + 2 * 4 + 2)  # 16 pairs, the cap
    report = run_json(capsys, "bench", "matmul", "--device", "cpu", "--dtypes", "fp32", "--sizes", "32,100000",
                      "--repeats", "1", "--json")  # fmt: skip
    small, huge = report["results"]
    assert small["seconds"] > 0 and huge["seconds"] is None
    assert huge["note"].startswith("skipped: the operands need 280 GB, over the ") and huge["note"].endswith("cpu")


@pytest.mark.cuda
def test_bench_matmul_cuda_all_dtypes():
    device = torch.device("cuda")
    bench = bench_matmul(["fp32", "tf32", "bf16", "fp16", "fp8"], [1024, 4096], device, repeats=5)
    sm89 = torch.cuda.get_device_capability() >= (8, 9)
    for r in bench.results:
        if r.dtype == "fp8" and not sm89:
            assert r.note.startswith("unsupported:")
            continue
        assert r.note is None, r.note
        # A dense datasheet peak is never beaten by a real matmul (a sparse one would look like MFU < 0.5).
        assert 0 < r.mfu < 1.05, (r.dtype, r.size, r.mfu)
    big_bf16 = next(r for r in bench.results if r.dtype == "bf16" and r.size == 4096)
    assert big_bf16.mfu > 0.3  # warm-up and large sizes: far above the lecture's no-warm-up 0.29
