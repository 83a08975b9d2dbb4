"""benchmarks/published_runs.py, the GPU op model's check against published runs, on rows written here (the
shared/published table is not part of a checkout): a row it predicts, rows it says it cannot, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER = ("id,source,gpu,gpus,gpus_per_node,intra_link,inter_link,framework,arch,layers,hidden,heads,kv_heads,"
          "ffn_hidden,vocab,seq_len,tp,pp,vpp,cp,dp,sharding,micro_batch,global_batch,recompute,seq_parallel,"
          "precision,compile,metric,value,confirmed,notes")  # fmt: skip
ROWS = [
    # vTrain's first single-node row: Megatron-DeepSpeed, GPT 16 x 1024, TP 2, full recompute, 0.125 s a step
    "vtrain-s-0001,vTrain data/ground_truth_single.csv,a100-80gb,2,8,nvlink3,,megatron-deepspeed,gpt,16,1024,16,16,"
    "4096,50257,1024,2,1,1,1,1,none,2,4,full,unknown,fp16,unknown,iter_s,0.125463484,0,vTrain",
    "pp-row,a paper,a100-40gb,96,8,nvlink3,unknown,megatron,gpt,44,6144,64,64,24576,50257,2048,2,4,1,1,12,zero1,4,"
    "1536,full,0,fp16,0,iter_s,10.0,1,pipeline parallel (a made-up value)",
    "uneven-row,a paper,a100-40gb,96,8,nvlink3,unknown,megatron,gpt,45,6144,64,64,24576,50257,2048,2,4,1,1,12,zero1,4,"
    "1536,full,0,fp16,0,iter_s,10.0,1,45 layers on 4 stages",
    "unknown-row,a paper,h100-sxm,8,8,nvlink4,,torchtitan,llama,32,4096,32,8,14336,128256,8192,1,1,1,1,8,fsdp,"
    "unknown,16,full,0,bf16,0,tokens_per_s_per_gpu,5000,0,micro-batch not printed",
    # vTrain's first row again, as an MFU (a made-up value): the same dry run, read in PaLM's count
    "mfu-row,a paper,a100-80gb,2,8,nvlink3,,megatron-deepspeed,gpt,16,1024,16,16,"
    "4096,50257,1024,2,1,1,1,1,none,2,4,full,unknown,fp16,unknown,mfu,0.2,0,vTrain's shape",
    # and at a step no A100 can take: 4 x 1024 tokens of 6 x 0.2B parameters in 10 us is 250 times its peak
    "above-peak-row,a paper,a100-80gb,2,8,nvlink3,,megatron-deepspeed,gpt,16,1024,16,16,"
    "4096,50257,1024,2,1,1,1,1,none,2,4,full,unknown,fp16,unknown,iter_s,0.00001,0,a typo",
]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "published_runs.py"), *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_row_is_predicted_and_rows_it_cannot_predict_say_why(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("\n".join([HEADER, *ROWS]) + "\n")
    done = _run("--rows", str(rows))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    found = {d["id"]: d for d in (json.loads(line) for line in lines if line.startswith("{"))}
    vtrain = found["vtrain-s-0001"]
    assert vtrain["error"] == vtrain["predicted"] / vtrain["published"] - 1 and vtrain["predicted"] == vtrain["step_s"]
    assert abs(vtrain["error"]) < 0.5  # the model's own accuracy is docs/time.md's table; here, a sane step
    assert sum(vtrain["breakdown_ms"].values()) / 1e3 == pytest.approx(vtrain["step_s"], abs=1e-4)  # ms rounded
    piped = found["pp-row"]  # 1F1B over 4 stages, 32 micro-batches a replica: the bubble is there, not the whole step
    assert 0 < piped["breakdown_ms"]["bubble"] < 0.5 * piped["step_s"] * 1e3 and piped["error"] is not None
    assert found["uneven-row"]["predicted"] is None and "split evenly" in found["uneven-row"]["reason"]
    assert found["unknown-row"]["predicted"] is None and "micro_batch" in found["unknown-row"]["reason"]
    mfu = found["mfu-row"]  # 6 N + 12 L H Q T per token, 4 x 1024 tokens, over 2 GPUs' 312 TFLOP/s
    assert mfu["step_s"] == vtrain["step_s"] and mfu["error"] == mfu["predicted"] / 0.2 - 1
    n_matmul = 16 * 12 * 1024 * 1024 + 50432 * 1024  # the vocabulary padded to a multiple of 128 x TP 2
    flops = 4 * 1024 * (6 * n_matmul + 12 * 16 * 1024 * 1024)
    assert mfu["predicted"] == pytest.approx(flops / mfu["step_s"] / 2 / 312e12, rel=1e-9)
    above = found["above-peak-row"]  # predicted like the rest, and said to be out of any chip's reach
    assert above["step_s"] == vtrain["step_s"] and "peak" in above["above_peak"] and "above_peak" not in vtrain
    assert "vTrain: 1 rows, median |error|" in done.stdout and "not predicted: 2 of 6 rows" in done.stdout
    assert "above_peak" in piped  # its made-up 10 s: 6 x 20B parameters x 3.1M tokens over 96 GPUs is 1.3 x peak
    others = [abs(found[i]["error"]) for i in ("vtrain-s-0001", "mfu-row")]
    assert f"the other 2: median |error| {sum(others) / 2:.1%}, worst {max(others):.1%}" in done.stdout


def test_a_missing_or_malformed_file_is_one_line_and_exit_2(tmp_path):
    missing = _run("--rows", str(tmp_path / "nope.csv"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0 and "no such file" in missing.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    done = _run("--rows", str(bad))
    assert done.returncode == 2 and "Traceback" not in done.stderr and "format" in done.stderr


def test_an_other_rows_framework_is_the_one_its_notes_name(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    row = {"framework": "other", "precision": "fp16", "compile": "0"}
    neox = published_runs.kernels_of({**row, "notes": "gpt-neox library (Megatron + DeepSpeed based); rotary"})
    assert neox.name == "gpt-neox" and neox.pipeline_schedule == "deepspeed" and neox.loss == "megatron"
    assert published_runs.kernels_of({**row, "notes": "metaseq FSDP + Megatron TP 8"}).name == "pytorch"
    assert published_runs.kernels_of({**row, "notes": "megatron-core with TE"}).name == "megatron-core"  # not megatron


def test_an_h100_row_whose_notes_say_hbm2e_runs_on_the_500_w_part(monkeypatch):
    """torchtitan's H100s are Meta's Grand Teton parts (96 GB HBM2e, 500 W), written `h100-sxm` with a note: they are
    priced on the table's h100-sxm-500w, slower in both compute and memory than the SXM part."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    from lmledger.ledger.hardware.gpus import GPUS

    note = "GPU is the H100 96GB HBM2e part at 500 W (Grand Teton) not the standard 80GB SXM"
    assert published_runs.gpu_of({"gpu": "h100-sxm", "notes": note}) == "h100-sxm-500w"
    assert published_runs.gpu_of({"gpu": "h100-sxm", "notes": "Table 1"}) == "h100-sxm"
    assert published_runs.gpu_of({"gpu": "a100-80gb", "notes": "HBM2e"}) == "a100-80gb"  # every A100 80GB's is
    slow, sxm, nvl = GPUS["h100-sxm-500w"], GPUS["h100-sxm"], GPUS["h100-nvl"]
    assert nvl.peak_flops["bf16"] < slow.peak_flops["bf16"] < sxm.peak_flops["bf16"]  # "between SXM and NVL"
    assert slow.bandwidth_bytes_per_s < sxm.bandwidth_bytes_per_s and slow.sms == sxm.sms


def test_an_unknown_sequence_parallel_is_the_frameworks_default(monkeypatch):
    """torchtitan's TP plan always shards its norms' sequence; a row that leaves it unknown runs so, others not."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    sp = published_runs.sequence_parallel_of
    assert sp({"framework": "torchtitan", "seq_parallel": "unknown"}) and sp({"framework": "x", "seq_parallel": "1"})
    assert not sp({"framework": "megatron", "seq_parallel": "unknown"})
    assert not sp({"framework": "torchtitan", "seq_parallel": "0"})  # a row that says so is taken at its word


def test_a_gpt_neox_rows_flops_are_its_2022_loggers_and_count_its_20b_model_as_published(monkeypatch):
    """GPT-NeoX logged tokens x (6 P + 60 s h l) until 2023, P summed over its model-parallel ranks; with 20B's shape
    and layout, P is the 20,556,201,984 parameters its model card prints, and its vocabulary pads to 50,432."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    row = dict(zip(HEADER.split(","), ROWS[1].split(","), strict=True))
    row = {**row, **{k: int(row[k]) for k in published_runs.INT_FIELDS}, "framework": "gpt-neox", "vocab": 50257}
    b, s, h, layers = row["global_batch"], row["seq_len"], row["hidden"], row["layers"]
    params = (published_runs.logged_flops(row) / (b * s) - 60 * s * h * layers) / 6
    assert params == 20_556_201_984 and published_runs.padded_vocab(row) == 50_432
    megatron = {**row, "framework": "megatron"}  # eq. 3 with full recompute: 96 B s l h^2 (1 + s/6h + V/16lh)
    eq3 = 96 * b * s * layers * h * h * (1 + s / (6 * h) + 50257 / (16 * layers * h))
    assert published_runs.logged_flops(megatron) == pytest.approx(eq3, rel=1e-12)
    assert published_runs.logged_flops(row) < 0.95 * eq3  # recompute not counted: NeoX's TFLOP/s is a longer step


@pytest.mark.parametrize(
    ("line", "printed"),
    [  # rows that print an MFU beside their step or throughput (their notes in shared/published/runs-dev.csv)
        (
            "korthikanti-22b-sel,Korthikanti et al. 2022 Table 5,a100-80gb,8,8,nvlink3,,megatron,gpt,48,6144,64,64,"
            "24576,51200,2048,8,1,1,1,1,none,4,4,selective,1,fp16,0,iter_s,1.1,0,MFU 41.5%",
            0.415,
        ),
        (
            "tt-202408-04,torchtitan docs/performance.md (Aug 2024),a100-80gb,64,8,nvlink3,unknown,torchtitan,llama,32,"
            "4096,32,8,14336,128256,8192,1,1,1,1,64,fsdp,1,64,selective,0,bf16,unknown,tokens_per_s_per_gpu,2904,0,"
            "MFU 56.8%",
            0.568,
        ),
        (
            "mosaic-a100-80-0002,llm-foundry benchmarking README (A100 80GB),a100-80gb,8,8,nvlink3,,llm-foundry,mpt,48,"
            "7168,56,56,28672,50368,8192,1,1,1,1,8,fsdp,1,168,full,0,bf16,unknown,tokens_per_s_per_gpu,574,1,"
            "MFU 39.38%",
            0.3938,
        ),
    ],
)
def test_an_mfu_is_read_in_the_convention_its_framework_prints(monkeypatch, line, printed):
    """An `mfu` row is predicted as its framework counts MFU: at the row's published step, mfu_of gives back the MFU
    the source prints beside it. Another framework's count would not (torchtitan's 2024 logger counts the token
    embedding, PaLM's count does not: 5% apart on Llama 3 8B)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    row = dict(zip(HEADER.split(","), line.split(","), strict=True))
    row = {**row, **{k: int(row[k]) for k in published_runs.INT_FIELDS}, "value": float(row["value"])}
    tokens = row["global_batch"] * row["seq_len"]
    seconds = row["value"] if row["metric"] == "iter_s" else tokens / row["value"] / row["gpus"]
    assert published_runs.mfu_of(row, seconds) == pytest.approx(printed, rel=0.01)
    if row["framework"] == "torchtitan":
        palm = published_runs.mfu_of({**row, "framework": "megatron"}, seconds)
        assert abs(palm / printed - 1) > 0.04
    assert published_runs.mfu_of({**row, "gpu": "v100-32gb", "precision": "bf16"}, seconds) is None  # no bf16 peak
    if row["framework"] == "llm-foundry":  # its notes print model TFLOP/s per GPU 122 too: a TFLOP/s row is read so
        assert published_runs.logged_flops(row) / seconds / row["gpus"] / 1e12 == pytest.approx(122, rel=0.01)


def test_a_gpt_row_under_context_parallel_is_built_with_rotary_positions(monkeypatch):
    """The dry run's context parallel shards rotary positions only; a GPT row with CP would otherwise be refused."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    row = dict(zip(HEADER.split(","), ROWS[0].split(","), strict=True))
    row = {**row, **{k: int(row[k]) for k in published_runs.INT_FIELDS}}
    assert published_runs.model_config(row, 2).positions == "learned"
    assert published_runs.model_config({**row, "cp": 2}, 2).positions == "rope"


@pytest.mark.parametrize(
    ("field", "value"),
    [("micro_batch", "0"), ("layers", "-4"), ("hidden", "4.5"), ("precision", "fp4"), ("recompute", "sometimes"),
     ("sharding", "weird"), ("seq_parallel", "maybe"), ("compile", "yes"), ("metric", "joules"), ("vpp", "0"),
     ("value", "-1")],
)  # fmt: skip
def test_a_value_readme_does_not_allow_is_the_rows_reason(monkeypatch, tmp_path, field, value):
    """A row with a value outside README.md's is not predicted, and its line says which (a zero micro-batch used to
    end the whole run in a ZeroDivisionError)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    names = HEADER.split(",")
    row = dict(zip(names, ROWS[0].split(","), strict=True)) | {field: value}
    path = tmp_path / "rows.csv"
    path.write_text(HEADER + "\n" + ",".join(row[n] for n in names) + "\n")
    (read,) = published_runs.read_rows(path)
    assert published_runs.why_not(read) == f"{field} {read[field]!r}: not a value README.md allows"
    path.write_text(HEADER + "\n" + ROWS[0] + "\n")
    assert published_runs.why_not(published_runs.read_rows(path)[0]) is None  # the row as it was is predicted


def test_a_row_whose_notes_say_async_tp_runs_it(monkeypatch):
    """Async TP is opt-in (torchtitan's enable_async_tensor_parallel): a row runs it where its notes say so."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    row = {"framework": "torchtitan", "precision": "fp8", "compile": "1"}
    assert published_runs.kernels_of({**row, "notes": "FSDP 32 x TP 8 with async TP; Float8 on nn.Linear"}).async_tp
    assert not published_runs.kernels_of({**row, "notes": "FSDP 32 x TP 8; Float8 on nn.Linear"}).async_tp


def test_vtrains_own_files_become_rows_published_runs_reads(monkeypatch, tmp_path):
    """benchmarks/vtrain_rows.py writes vTrain's ground truth (both files, their own columns) as README.md rows, the
    way runs-dev.csv writes them: the first single-node run here is runs-dev.csv's vtrain-s-0001 (ROWS above)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    data = tmp_path / "vtrain" / "data"
    data.mkdir(parents=True)
    (data / "ground_truth_single.csv").write_text(
        "\ufeff# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,tensor parallelism,"
        "data parallelism,pipeline parallelism,iteration time (ms)\n2,4,2,1024,16,16,1024,2,1,1,125.463484\n"
        "8,32,4,1024,16,24,1024,2,2,2,219.732754\n")  # fmt: skip
    (data / "ground_truth_multi.csv").write_text(
        "Parameters (billion),# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
        "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
        "3.6,64,512,8,3072,32,30,2048,1,64,1,3566.5\n")  # fmt: skip
    script = str(REPO / "benchmarks" / "vtrain_rows.py")
    done = subprocess.run([sys.executable, script, "--vtrain", str(tmp_path / "vtrain")], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (tmp_path / "rows.csv").write_text(done.stdout)
    rows = published_runs.read_rows(tmp_path / "rows.csv")
    assert [published_runs.why_not(r) for r in rows] == [None, None, None]
    dev = dict(zip(HEADER.split(","), ROWS[0].split(","), strict=True))
    same = ("gpu", "gpus", "framework", "arch", "layers", "hidden", "ffn_hidden", "vocab", "seq_len", "tp", "pp", "dp",
            "micro_batch", "global_batch", "recompute", "precision", "metric", "value")  # fmt: skip
    assert {k: str(rows[0][k]) for k in same} == {k: dev[k] for k in same}
    assert rows[1]["sharding"] == "ddp" and rows[0]["sharding"] == "none"  # replicated where it has data parallelism
    assert rows[2]["inter_link"] == "100Gb/s" and rows[2]["value"] == 3.5665 and "3.6B" in rows[2]["notes"]
    missing = subprocess.run([sys.executable, script, "--vtrain", str(tmp_path)], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and missing.stderr.count("\n") == 1


def test_a_summary_whose_every_row_is_above_its_peak_says_so(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_runs

    lines = published_runs.summary([{"source": "llm.c x", "error": 1.45, "predicted": 0.37, "above_peak": "136%"}])
    assert "overall: 1 rows, median |error| 145.0%, worst 145.0%" in lines
    assert "above their chip's peak as published: 1 (their lines say so); no other row" in lines
