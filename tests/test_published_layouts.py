"""benchmarks/published_layouts.py: the layout search ranks a published layout among the others, on a row written
here (the shared/published table is not part of a checkout)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_published_runs import HEADER

REPO = Path(__file__).resolve().parents[1]
ROWS = [
    # a small GPT on 2 A100s at TP 2: the search weighs it against TP 1 and a pipeline of 2 stages
    "small-tp2,Narayanan et al. SC21 Table 1,a100-80gb,2,8,nvlink3,,megatron,gpt,2,512,8,8,2048,50257,512,2,1,"
    "unknown,1,1,ddp,unknown,2,full,0,unknown,unknown,tflops_per_gpu,100,0,a made-up row",
    "no-batch,Korthikanti et al. 2022 Table 5,a100-80gb,4,8,nvlink3,,megatron,gpt,4,512,8,8,2048,50257,512,2,1,"
    "1,1,2,ddp,1,unknown,full,0,fp16,0,iter_s,1.0,0,its global batch not printed",
]


def test_a_published_layout_gets_its_rank_among_the_searched_ones(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("\n".join([HEADER, *ROWS]) + "\n")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "published_layouts.py"), "--rows", str(rows)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = {d["id"]: d for d in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    small = found["small-tp2"]
    assert small["published"] == [2, 1] and 1 <= small["rank"] <= small["of"]
    assert small["of"] == 3  # (TP, PP) of 2 GPUs: (1, 1), (2, 1), (1, 2), each at its best micro-batch
    first, mine = small["first"], small["published_layout"]
    assert first["step_s"] <= mine["step_s"] and (small["rank"] == 1) == (first["step_s"] == mine["step_s"])
    assert found["no-batch"]["rank"] is None and "global_batch" in found["no-batch"]["reason"]
    assert "published layout in the top 3:" in done.stdout and "of 1 rows ranked (2 read)" in done.stdout
