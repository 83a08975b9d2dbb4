"""Planning a GPU run from a machine without that GPU (issue 46): `account`, `plan train-time`, `plan max-batch` and
the any-model paths price the dry run's step with the GPU op model (accounting.gpustep), for a config that runs on a
GPU or any config given --gpu. The model's own accuracy is tests/ledger/test_gpu_time.py's and
benchmarks/published_runs.py's; here, what each command makes of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import MICRO_OVERRIDES, lmledger, one_error_line, run_json

TINY = ["--config", "configs/tiny.yaml", *MICRO_OVERRIDES]
GPU = ["--trainer.accelerator", "gpu"]
KERNELS = ("matmul", "attention", "other", "optimizer")


def _kernels_s(predicted: dict) -> float:
    return sum(predicted["seconds"][c] for c in KERNELS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU config is measured on this machine's GPU")
def test_a_gpu_config_is_planned_on_an_h100_where_this_machine_has_no_gpu(workdir, capsys):
    cpu = run_json(capsys, "account", *TINY, "--json")
    gpu = run_json(capsys, "account", *TINY, *GPU, "--json")
    predicted = gpu["time"]["predicted"]
    assert gpu["run"]["device"] == "cuda" and "dry_run_device" not in gpu["run"]
    assert predicted["priced_on"] == "h100-sxm" and any("h100-sxm assumed" in n for n in predicted["notes"])
    assert predicted["total_s"] == pytest.approx(sum(predicted["seconds"].values()))
    assert 0 < predicted["mfu"] < 1 and predicted["replayed"] == 0  # priced, nothing run here
    # its memory from the closed forms of CUDA's kernels, not a dry run of this CPU's: the state is the same, the
    # activations less (CUDA's fused RMSNorm saves its input and the rsqrt, the CPU's composite two fp32 copies)
    assert gpu["memory"]["optimizer"]["predicted"] == cpu["memory"]["optimizer"]["predicted"]
    assert gpu["memory"]["activations"]["predicted"] < cpu["memory"]["activations"]["predicted"]
    assert "priced_on" not in (cpu["time"]["predicted"] or {})  # a CPU config's step is this machine's
    # --gpu names another: an A100's fp32 GEMMs (19.5 TFLOP/s) take longer than an H100's (67)
    a100 = run_json(capsys, "account", *TINY, "--gpu", "a100-80gb", "--json")["time"]["predicted"]
    assert a100["priced_on"] == "a100-80gb" and _kernels_s(a100) > _kernels_s(predicted)
    assert a100["seconds"]["matmul"] > 1.5 * predicted["seconds"]["matmul"]
    # measuring needs the GPU itself: one line, exit 2
    assert lmledger(["account", *TINY, *GPU, "--measure"]) == 2
    assert "--trainer.accelerator gpu: this machine has no usable CUDA GPU" in one_error_line(capsys)


def test_a_gpu_without_the_configs_precision_is_no_step_time_not_a_traceback(workdir, capsys):
    """A V100 has no bf16 and an A100 no fp8: the memory is answered, the step says why it is not."""
    doc = run_json(capsys, "account", *TINY, "--trainer.precision", "bf16-mixed", "--gpu", "v100", "--json")
    assert doc["memory"]["peak"]["predicted"] > 0
    assert "V100 SXM2 16GB has no dense bf16 peak" in doc["time"]["predicted"]["none"]
    assert lmledger(["account", *TINY, "--trainer.precision", "bf16-mixed", "--gpu", "v100"]) == 0
    assert "no step-time prediction: NVIDIA Tesla V100 SXM2 16GB has no dense bf16" in capsys.readouterr().out
    # plan train-time has nothing to answer without the step: one line, exit 2
    config = yaml.safe_load(open("configs/tiny.yaml"))
    config["trainer"]["precision"] = "bf16-mixed"
    Path("bf16.yaml").write_text(yaml.safe_dump(config))
    assert lmledger(["plan", "train-time", "--config", "bf16.yaml", "--tokens", "1e9", "--gpu", "v100"]) == 2
    assert "bf16.yaml: no step-time prediction: NVIDIA Tesla V100" in one_error_line(capsys)


def test_a_compiled_config_is_priced_fused_and_says_its_memory_is_the_eager_steps(workdir, capsys):
    eager = run_json(capsys, "account", *TINY, "--gpu", "h100-sxm", "--json")
    compiled = run_json(capsys, "account", *TINY, "--config", "configs/compile/on.yaml", "--gpu", "h100-sxm", "--json")
    # the elementwise runs fuse into one kernel each: fewer bytes, fewer launches; the GEMMs are the same
    assert compiled["time"]["predicted"]["seconds"]["other"] < 0.7 * eager["time"]["predicted"]["seconds"]["other"]
    assert compiled["time"]["predicted"]["seconds"]["matmul"] == eager["time"]["predicted"]["seconds"]["matmul"]
    assert compiled["memory"] == eager["memory"]  # the eager dry run's, and the notes say so
    assert any(n.startswith("torch.compile: the memory is the eager step's") for n in compiled["notes"])
    assert not any("torch.compile" in n for n in eager["notes"])


def test_any_module_is_priced_from_its_own_dry_run_ops(workdir, capsys, monkeypatch):
    """A LightningModule lmledger did not write: one device, two DDP ranks (its buckets all-reduced), plan layout's
    data-parallel layouts over 2 GPUs, and 8 ranks of Lightning's FSDP."""
    from lmledger.accounting.layouts import _module_micro_batches

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # `examples` is at the repository root
    convnet = ["--config", "configs/examples/byte-convnet.yaml", "--model.init_args.width", "16",
               "--model.init_args.num_layers", "2", "--data.init_args.batch_size", "2",
               "--data.init_args.context_length", "16"]  # fmt: skip
    one_json = run_json(capsys, "account", *convnet, *GPU, "--gpu", "h100-sxm", "--json")
    one = one_json["time"]["predicted"]
    if not torch.cuda.is_available():  # a GPU config's memory from a dry run on this CPU, and the notes say so
        assert one_json["run"]["device"] == "cuda" and one_json["run"]["dry_run_device"] == "cpu"
        assert any(n.startswith("dry run on this machine's cpu in its place") for n in one_json["notes"])
    # two DDP ranks, as plan train-time plans them (account's rank step, any_model_at_scale): that rank's step, each
    # step's tokens over both ranks (it was planned as one device)
    days = run_json(capsys, "plan", "train-time", *convnet, "--gpu", "h100-sxm", "--trainer.devices", "2",
                    "--trainer.strategy", "ddp", "--tokens", "1e9", "--json")  # fmt: skip
    two = days["predicted"]
    assert days["num_gpus"] == 2 and days["tokens_per_step"] == 2 * 2 * 16 and days["step_s"] == two["total_s"]
    assert one["priced_on"] == two["priced_on"] == "h100-sxm" and one["collectives"] == 0 < two["collectives"]
    assert two["seconds"]["communication"] + two["hidden"]["communication"] > 30e-6  # an all-reduce's latency at least
    # each rank's compute: the same batch's, and DDP's copies of the gradients into its buckets
    assert two["seconds"]["matmul"] == pytest.approx(one["seconds"]["matmul"], rel=1e-6)
    assert two["seconds"]["other"] > one["seconds"]["other"]
    assert one["tokens_per_s"] == pytest.approx(2 * 16 / one["total_s"])
    # --num-gpus scales the toy LM's configs; a module's ranks are its fit's, and the refusal says how to give them
    capsys.readouterr()
    assert lmledger(["plan", "train-time", *convnet, "--gpu", "h100-sxm", "--num-gpus", "2", "--tokens", "1e9"]) == 2
    assert "--trainer.devices N" in capsys.readouterr().err
    # plan layout searches such a module's data-parallel layouts, each priced as account prices it: 4 sequences over 2
    # GPUs, replicated or sharded (Lightning's FSDP), a replica's 2 as 2 x 1 or 1 x 2; DDP's 2 x 1 is the step above
    assert _module_micro_batches(12) == [1, 2, 4, 12]  # a replica's share as searched
    out = run_json(capsys, "plan", "layout", *convnet, "--data.init_args.batch_size", "4", "--gpu", "h100-sxm",
                   "--num-gpus", "2", "--json")  # fmt: skip
    layouts = {(r["sharding"], r["micro_batch"], r["micro_batches"]): r for r in out["ranked"]}
    assert out["global_batch"] == 4 and out["fits"] == out["searched"] == 4 and not out["dropped"]
    assert set(layouts) == {(sharding, 2, 1) for sharding in ("ddp", "fsdp")} | {(s, 1, 2) for s in ("ddp", "fsdp")}
    assert [r["step_s"] for r in out["ranked"]] == sorted(r["step_s"] for r in out["ranked"])
    assert layouts["ddp", 2, 1]["step_s"] == pytest.approx(two["total_s"], rel=1e-9)
    assert layouts["ddp", 2, 1]["tokens_per_s"] == pytest.approx(4 * 16 / two["total_s"])
    # FSDP shards the parameters, gradients and moments; a smaller micro-batch holds fewer activations
    assert layouts["fsdp", 2, 1]["peak_bytes"] < layouts["ddp", 2, 1]["peak_bytes"] > layouts["ddp", 1, 2]["peak_bytes"]
    assert "pipeline parallelism" in out["not_searched"]
    for argv, said in (  # refused in one line: a module that applies its own TP; GPUs past a node not in nodes of 8
        (["--config", "configs/examples/hf-llama-tp.yaml", "--num-gpus", "8"], "by its own configure_model"),
        ([*convnet, "--data.init_args.batch_size", "12", "--num-gpus", "12"], "12 does not fill nodes of 8 GPUs"),
    ):  # fmt: skip
        assert lmledger(["plan", "layout", *argv]) == 2 and said in one_error_line(capsys)
    # Lightning's FSDP at 8 GPUs, asked as fit would run it (issue 28's checks refused it on a CPU machine): its
    # rank dry-run as FSDP2 (the same all-gathers and reduce-scatters a block), priced on the assumed H100
    # Under Transformer Engine too: each rank traced at bf16-true, its nn.Linears priced as te.Linear
    fsdp = run_json(capsys, "account", *convnet, *GPU, "--trainer.devices", "8", "--trainer.strategy", "fsdp",
                    "--trainer.precision", "transformer-engine", "--json")["time"]["predicted"]  # fmt: skip
    assert fsdp["priced_on"] == "h100-sxm" and any("h100-sxm assumed" in n for n in fsdp["notes"])
    assert fsdp["notes"][-1].startswith("transformer-engine: planned as bf16-true with its linears' matmuls")
    assert fsdp["collectives"] > two["collectives"] and fsdp["total_s"] == pytest.approx(sum(fsdp["seconds"].values()))


def test_the_lectures_70b_question_from_its_config(workdir, capsys):
    """Llama 3 70B on 15T tokens on 1,024 H100s (TP 8 x FSDP 128): the step at that layout, and the days from it."""
    out = run_json(capsys, "plan", "train-time", "--config", "configs/llama3-70b.yaml", "--tokens", "15T", "--json")
    predicted = out["predicted"]
    assert out["gpu"] == "h100-sxm" and out["num_gpus"] == 1024
    assert out["tokens_per_step"] == 128 * 4 * 8192 and predicted["layout"]["tensor_parallel"] == 8
    assert out["days"] == pytest.approx(15e12 / out["tokens_per_step"] * out["step_s"] / 86400)
    # the published 70B runs at this scale on H100s (shared/published: llm-foundry's MPT-70B on 128 and 512, FSDP)
    # reached MFU 0.41 to 0.43; a TP-8 layout's exposed all-reduces leave it lower, not above
    assert 0.2 < out["mfu"] < 0.45
    assert predicted["seconds"]["communication"] > 0 and predicted["seconds"]["matmul"] > predicted["seconds"]["other"]
    # the lecture's napkin answer (6ND at MFU 0.5: 144 days) is faster than the predicted step, by the MFU's ratio
    napkin = run_json(capsys, "plan", "train-time", "--params", "70B", "--tokens", "15T", "--gpu", "h100-sxm",
                      "--num-gpus", "1024", "--mfu", "0.5", "--json")  # fmt: skip
    assert napkin["days"] < out["days"]
    # the config's own step takes neither the napkin's inputs nor its dtype: each is refused in one line
    for flags, said in ((["--mfu", "0.5"], "drop --params and --mfu"), (["--dtype", "fp8"], "drop --dtype")):
        capsys.readouterr()
        assert lmledger(["plan", "train-time", "--config", "configs/llama3-70b.yaml", "--tokens", "15T", *flags]) == 2
        assert said in capsys.readouterr().err


def test_a_transformer_engine_config_is_planned_on_a_gpu_with_its_linears_in_fp8(workdir, capsys, monkeypatch):
    """Transformer Engine runs on a CUDA GPU only, and its layer swap cannot be dry-run here: its step was refused
    ("the dry run covers ..."). It is priced on the GPU now, traced as its weights' bf16-true (Lightning's plugin
    converts the module), each linear's matmuls in fp8 with TE's casts, once a tensor; its peak is not modelled, so
    plan max-batch says so in one line."""
    wide = ["--model.config.d_model", "1024", "--model.config.d_ff", "4096", "--model.config.n_heads", "8",
            "--model.config.context_length", "4096", "--data.batch_size", "1"]  # fmt: skip

    def args(precision: str) -> list[str]:
        return ["--config", "configs/tiny.yaml", "--config", precision, *MICRO_OVERRIDES, *wide]

    def accounted(precision: str, *extra: str) -> dict:
        return run_json(capsys, "account", *args(precision), *extra, "--json")

    # either fp8 is planned on a GPU, as fit refuses it on a CPU (torchao's had been timed here, without its fp8)
    te_json, torchao_json = accounted("configs/precision/fp8-te.yaml"), accounted("configs/precision/fp8-torchao.yaml")
    te, torchao = te_json["time"]["predicted"], torchao_json["time"]["predicted"]
    assert torchao["priced_on"] == "h100-sxm"
    assert "fp8 (torchao) runs on a CUDA GPU only and this machine has none: h100-sxm assumed" in torchao["notes"]
    bf16 = accounted("configs/precision/bf16-true.yaml", "--gpu", "h100-sxm")["time"]["predicted"]
    # TE's memory is the closed forms', its activations not modelled: said once (it was said twice, the second time
    # beside "predicted for cpu", though no row shown depends on a device's kernels)
    assert sum("activation bytes are modelled for" in n for n in te_json["notes"]) == 1, te_json["notes"]
    assert not any(n.startswith("predicted for") for n in te_json["notes"])
    # torchao's memory is the dry run of the step without the Float8Linear swap (a CUDA GPU's), and a note says so
    assert any(n.startswith("fp8 (torchao): the memory is the bf16-mixed step's, without the Float8Linear swap")
               for n in torchao_json["notes"]), torchao_json["notes"]  # fmt: skip
    assert te["priced_on"] == "h100-sxm"
    assert any(n.startswith("transformer-engine runs on a CUDA GPU only") for n in te["notes"])
    for category in ("attention", "other", "optimizer"):  # outside its linears, the bf16-true step
        assert te["seconds"][category] == pytest.approx(bf16["seconds"][category])
    # fp8's peak is twice bf16's, less the casts (TE swaps the tied head too: Kernels.fp8_head)
    assert 0.5 * bf16["seconds"]["matmul"] < te["seconds"]["matmul"] < 0.95 * bf16["seconds"]["matmul"]
    # torchao's eager dynamic scaling reads and casts both operands of every matmul; TE casts each tensor once
    assert te["seconds"]["matmul"] < torchao["seconds"]["matmul"]
    # the same traces (bf16-true, micro-batch 1) rank the layouts, whose memory is theirs, and the output says so
    layouts = run_json(capsys, "plan", "layout", *args("configs/precision/fp8-te.yaml"), "--num-gpus", "1", "--json")
    assert layouts["gpu"] == "h100-sxm" and layouts["fits"] == 2  # recompute or not
    assert layouts["notes"][0].startswith("transformer-engine: planned as bf16-true")
    odd = [*args("configs/precision/fp8-te.yaml"), "--model.config.d_model", "1000", "--model.config.n_heads", "4"]
    assert lmledger(["plan", "layout", *odd, "--num-gpus", "1"]) == 2  # (account: no step, with the same reason)
    assert "and leaves ToyLM's blocks.0.attn.qkv (1000 -> 3000)" in one_error_line(capsys)
    assert lmledger(["plan", "max-batch", *args("configs/precision/fp8-te.yaml"), "--gpu", "h100-sxm"]) == 2
    assert one_error_line(capsys) == ("lmledger plan: error: no peak to size the batch by: activation bytes are "
                                      "modelled for 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, not "
                                      "transformer-engine")  # fmt: skip
    # Another module (it was refused: "the dry run covers ..."): its own dry run at bf16-true, its nn.Linears priced
    # as te.Linear; its memory is the stand-in's, and the notes say so
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # `examples` is at the repository root
    convnet = ["--config", "configs/examples/byte-convnet.yaml", "--model.init_args.width", "64",
               "--model.init_args.num_layers", "1", "--data.init_args.batch_size", "2",
               "--data.init_args.context_length", "64"]  # fmt: skip
    module_te = run_json(capsys, "account", *convnet, "--trainer.precision", "transformer-engine", "--json")
    module_bf16 = run_json(capsys, "account", *convnet, "--trainer.precision", "bf16-true", "--gpu", "h100-sxm",
                           "--json")  # fmt: skip
    te, bf16 = module_te["time"]["predicted"], module_bf16["time"]["predicted"]
    assert te["priced_on"] == "h100-sxm" and te["notes"][-1].startswith("transformer-engine: planned as bf16-true")
    assert module_te["memory"]["peak"]["predicted"] == module_bf16["memory"]["peak"]["predicted"] > 0
    for category in ("attention", "other", "optimizer"):
        assert te["seconds"][category] == pytest.approx(bf16["seconds"][category])
    assert te["seconds"]["matmul"] != pytest.approx(bf16["seconds"]["matmul"])  # the MLP's and the head's in fp8
    # (per rank: test_any_module_is_priced_from_its_own_dry_run_ops's FSDP). Its peak lacks te.Linear's own
    # tensors, so no batch is sized by it; nor is it measured here
    ddp = ["--trainer.precision", "transformer-engine", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    for at in (ddp, ddp[:2]):  # per rank, and one device
        assert lmledger(["plan", "max-batch", *convnet, *at, "--gpu", "h100-sxm"]) == 2
        assert one_error_line(capsys) == ("lmledger plan: error: no peak to size the batch by: transformer-engine's "
                                          "memory is not modelled (its step is planned as bf16-true, without "
                                          "Transformer Engine's own saved tensors and fp8 weight copies)")  # fmt: skip
    # Lightning's plugin swaps only an nn.Linear whose features divide by 8 and 16: a module with another matmul layer
    # (36 features; transformers' Conv1D, test_only_nn_linear_layers_...) is refused, not priced in fp8 throughout
    assert lmledger(["account", *convnet, "--model.init_args.width", "36", *ddp[:2]]) == 2
    assert "and leaves ByteConvNet's blocks.0.mlp.0 (36 -> 72), blocks.0.mlp.2 (72 -> 36)" in one_error_line(capsys)
    # (the plugin form, with fp32 masters: built for planning without Transformer Engine installed, its plugin not)
    assert lmledger(["account", *convnet, "--config", "configs/precision/fp8-te-fp32-master.yaml", "--measure"]) == 2
    assert one_error_line(capsys).endswith("not transformer-engine")


def test_only_nn_linear_layers_transformer_engine_swaps_are_planned_in_fp8():
    """Lightning's Transformer Engine plugin swaps an nn.Linear whose in and out features divide by 8 and 16, and
    nothing else (lightning/fabric/plugins/precision/transformer_engine.py, _convert_layers): a layer it leaves
    16-bit is named, so its matmuls are not priced in fp8 with the rest."""
    from torch import nn

    from lmledger.accounting.gpustep import unswapped_matmuls

    class Conv1D(nn.Module):  # transformers' GPT-2 layer: x @ W + b with a bare 2-D weight
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(16, 48))

    swapped = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    assert unswapped_matmuls(swapped, "transformer-engine") is None
    assert unswapped_matmuls(nn.Sequential(swapped, nn.Linear(12, 16)), "bf16-true") is None  # not TE: not asked
    found = unswapped_matmuls(
        nn.Sequential(swapped, nn.Linear(12, 16), nn.Linear(16, 8), Conv1D()), "transformer-engine"
    )
    assert "Sequential's 1 (12 -> 16), 2 (16 -> 8), 3 (Conv1D) 16-bit" in found


def test_plan_max_batch_prints_the_step_at_its_answer(workdir, capsys):
    doc = run_json(capsys, "plan", "max-batch", *TINY, "--gpu", "h100-sxm", "--json")
    step = doc["step"]
    assert step["priced_on"] == "h100-sxm" and step["layout"]["micro_batch"] == doc["max_batch"] > 0
    assert step["tokens_per_s"] == pytest.approx(doc["max_batch"] * 32 / step["total_s"])
    assert lmledger(["plan", "max-batch", *TINY, "--gpu", "h100-sxm"]) == 0
    text = capsys.readouterr().out
    assert f"at that batch: {step['line']}" in text and "matmul " in text and "exposed" in text


@pytest.mark.cuda
def test_a_fit_on_a_gpu_the_table_knows_is_priced_by_the_gpu_op_model(stdlib_data):
    """On the GPU itself the Ledger prices its dry run with the op model (no replay) and measures the step beside
    it. The band is wide: a toy step is launch-bound, its host time the model's coarsest figure."""
    from dataclasses import replace

    import lightning.pytorch as pl

    from lmledger.callbacks import Ledger
    from lmledger.callbacks.settings import LedgerSettings
    from lmledger.data import TokenDataModule
    from lmledger.ledger.hardware.gpus import find_gpu
    from lmledger.ledger.timing.steptime import StepTime
    from lmledger.lit import LitLM
    from lmledger.model import ModelConfig

    gpu = find_gpu(torch.cuda.get_device_name())
    if gpu is None or gpu.sms is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in the GPU table the op model prices")
    config = ModelConfig(d_model=128, n_layers=2, n_heads=4, d_ff=512, context_length=128)
    data = TokenDataModule(path=str(stdlib_data), batch_size=8, context_length=config.context_length)
    ledger = Ledger(settings=LedgerSettings(warmup_steps=5))
    pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=30, limit_val_batches=0, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[ledger]).fit(LitLM(replace(config, vocab_size=data.vocab_size)), data)  # fmt: skip
    assert isinstance(ledger.step_time, StepTime) and ledger.step_time.priced_on == gpu.key
    assert ledger.step_time.replayed == 0
    predicted, measured = ledger.report.times["step time"]
    assert measured is not None and 0.33 < predicted / measured < 3, (predicted, measured)


def test_plan_layout_ranks_the_layouts_that_fit(workdir, capsys, monkeypatch):
    """A micro ToyLM, 2 sequences a step, over 2 H100s (one layer: no pipeline): TP 1 x 2 replicas (replicated or
    FSDP, micro-batch 1) and TP 2 (micro-batch 1 or 2), with and without recompute: 8 layouts, all fit. The table
    printed is of the same search (not run twice)."""
    args = [*TINY, "--data.batch_size", "2", "--gpu", "h100-sxm", "--num-gpus", "2"]
    out = run_json(capsys, "plan", "layout", *args, "--tokens", "1e9", "--json")
    ranked = out["ranked"]
    assert out["global_batch"] == 2 and out["tokens_per_step"] == 2 * 32 and out["fits"] == len(ranked) == 8
    assert out["notes"] == []  # traced as it runs: only Transformer Engine's stand-in trace is noted
    assert [r["step_s"] for r in ranked] == sorted(r["step_s"] for r in ranked)
    assert {r["tensor_parallel"] for r in ranked} == {1, 2} and {r["sharding"] for r in ranked} == {"ddp", "fsdp"}
    for r in ranked:
        assert r["tensor_parallel"] * r["pipeline_parallel"] * r["data_parallel"] == 2
        assert r["sequence_parallel"] == (r["tensor_parallel"] > 1)  # tiny.yaml's embedding is its own
        assert r["schedule"] is None and r["chunks_per_rank"] == 1  # one layer: no pipeline to interleave
        assert r["micro_batch"] * r["micro_batches"] * r["data_parallel"] == 2 and r["peak_bytes"] < out["memory_bytes"]
        assert r["days"] == pytest.approx(1e9 / r["tokens_per_s"] / 86400)
        assert sum(r["breakdown_s"].values()) == pytest.approx(r["step_s"], rel=1e-6)
        why = r["mfu_explained"]  # its MFU as three factors (ledger.timing.gpu.explain); recompute runs a forward more
        assert why["model_over_run"] * why["kernel_rate"] * why["kernel_share"] == pytest.approx(r["mfu"], rel=1e-9)

    def why(tp: int, recompute: str) -> dict:
        (row,) = [r for r in ranked if (r["tensor_parallel"], r["recompute"], r["micro_batch"], r["sharding"])
                  == (tp, recompute, 1, "fsdp" if tp == 1 else "ddp")]  # fmt: skip
        return row["mfu_explained"]

    for tp in (1, 2):  # the same layout with and without recompute: the kernels run the blocks' forward again (not
        # the head's), so the model's share of the FLOPs run falls by more than nothing and less than a third
        assert 1.05 < why(tp, "none")["model_over_run"] / why(tp, "full")["model_over_run"] < 4 / 3
    import lmledger.accounting.layouts as layouts

    monkeypatch.setattr(layouts, "plan_layouts", lambda argv, gpu, num_gpus, tokens, top: out)
    assert lmledger(["plan", "layout", *args, "--top", "8"]) == 0
    text = capsys.readouterr().out
    assert "ranked by predicted time" in text and "links: NVLink 4" in text and "sp: tensor parallel with" in text
    assert f"the first layout: why MFU {ranked[0]['mfu']:.2g}: the kernels run " in text


def test_a_tp_configs_gpu_step_takes_its_sequence_parallel(workdir, capsys):
    """A TP config with `--model.sequence_parallel true` is priced on the GPU with it, as fit runs it: TP's
    all-reduces become reduce-scatters and all-gathers (more collectives); without the flag, plain TP
    (accounting.gpustep, behind account --gpu, plan train-time and plan max-batch). plan layout tries it itself."""
    tp2 = [*TINY, "--trainer.devices", "2", "--trainer.strategy", "lmledger.strategies.FSDP2Strategy",
           "--trainer.strategy.tensor_parallel_size", "2", "--gpu", "h100-sxm", "--tokens", "1e9",
           "--json"]  # fmt: skip
    # (through plan train-time: account's step is the same toy_gpu_step, beside per-rank memory this test does not read)
    plain = run_json(capsys, "plan", "train-time", *tp2)["predicted"]
    split = run_json(capsys, "plan", "train-time", *tp2, "--model.sequence_parallel", "true")["predicted"]
    assert plain["layout"]["tensor_parallel"] == split["layout"]["tensor_parallel"] == 2
    assert (plain["layout"]["sequence_parallel"], split["layout"]["sequence_parallel"]) == (False, True)
    assert split["collectives"] > plain["collectives"] > 0


def test_plan_layout_gives_the_range_of_the_peaks_it_dropped(monkeypatch, capsys):
    """Layouts dropped for memory are one group with their lowest and highest peak, in the JSON and in one printed line
    beside the GPU's memory; other reasons are kept as they are. (The search itself is test_layout_search's; here its
    result is given.)"""
    import lmledger.accounting.layouts as layouts

    def dropped(peak_gb, pp):
        where = " (pipeline rank 0)" if pp > 1 else ""
        return {"dropped": f"its peak {peak_gb:.1f} GB{where} is over the GPU's 80 GB", "peak_bytes": peak_gb * 1e9,
                "tensor_parallel": 8 // pp, "pipeline_parallel": pp, "data_parallel": 1, "micro_batch": 1,
                "recompute": "none"}  # fmt: skip

    split = {"dropped": "the global batch 2 does not split over 4 data-parallel replicas"}
    unpriced = {**dropped(60.0, 1), "dropped": "no step time: an op the GPU model cannot price"}
    rows = [dropped(95.25, 1), dropped(412.0, 2), dropped(80.5, 4), split, unpriced]
    reasons = layouts._dropped_reasons(rows, 80 * 10**9)
    assert reasons == [{"reason": "its peak is over the GPU's memory", "count": 3, "peak_bytes": [80.5e9, 412e9]},
                       {"reason": split["dropped"], "count": 1},
                       {"reason": unpriced["dropped"], "count": 1}]  # fmt: skip
    out = {"global_batch": 2, "seq_len": 32, "num_gpus": 8, "gpu": "h100-sxm", "fits": 0, "searched": 4, "ranked": [],
           "dropped": rows[:4], "dropped_reasons": reasons[:2], "lowest_peak": rows[2], "memory_bytes": 80 * 10**9,
           "not_searched": "nothing", "links": {"intra_node": "NVLink 4", "gpus_per_node": 8, "inter_node": "none"},
           "notes": []}  # fmt: skip
    monkeypatch.setattr(layouts, "plan_layouts", lambda *args: out)
    assert lmledger(["plan", "layout", "--config", "configs/tiny.yaml", "--num-gpus", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "dropped 3: peaks of 80.5 to 412.0 GB, over the GPU's 80 GB" in lines
    assert "dropped 1: the global batch 2 does not split over 4 data-parallel replicas" in lines
    assert lines[0].startswith("none of the 4 layouts fits on 8 x h100-sxm: the lowest peak is 80.5 GB (TP 2 x PP 4")
    one = {**out, "searched": 1, "dropped": [split], "dropped_reasons": reasons[1:2], "lowest_peak": None}
    monkeypatch.setattr(layouts, "plan_layouts", lambda *args: one)
    assert lmledger(["plan", "layout", "--config", "configs/tiny.yaml", "--num-gpus", "8"]) == 0
    # dropped for its batch split, not its memory: it said "does not fit", which reads as a memory verdict
    assert capsys.readouterr().out.splitlines()[0] == "no layout runs on 8 x h100-sxm"  # 7 GPUs: DP 7
