"""What a dry run costs at scale: seconds and resident memory of dry-running a config's ToyLM on this machine.

The model is built on the meta device (no memory), the batch is meta tensors of the config's shape, and
lmledger.ledger.dryrun.engine.dry_run runs two training steps on fake tensors with the config's precision and
optimizer (AdamW, fused as LitLM picks it). Printed: wall seconds of the dry run, the process's peak
resident memory (resource.getrusage ru_maxrss, the whole process: Python, torch and the dry run), each
over its goal (under 60 s and under 1 GB for configs/cs336-2.7b.yaml on a 2-core CPU), and the
dry run's peak beside the closed form's (ledger.closedform.peak.peak_bytes) as a sanity check.

    python benchmarks/dryrun_scale.py [--config configs/cs336-2.7b.yaml] [--device cpu]
    python benchmarks/dryrun_scale.py --quick     # configs/tiny.yaml: checks the script runs

Run it on an otherwise idle machine: on a shared one the seconds measure the neighbours too. One run per
process (ru_maxrss is the process's high-water mark).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch
from _common import resident_bytes

from lmledger.ledger.closedform.peak import peak_bytes
from lmledger.ledger.dryrun.engine import NotTraced, dry_run
from lmledger.model import ToyLM, count_parameters
from lmledger.run_config import load_run

SECONDS_GOAL = 60.0
RESIDENT_GOAL = 1e9  # bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/cs336-2.7b.yaml")
    parser.add_argument("--device", default="cpu", help="the device the step is dry-run for (default cpu)")
    parser.add_argument("--quick", action="store_true", help="configs/tiny.yaml instead: checks the script runs")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    config = "configs/tiny.yaml" if args.quick else args.config
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)

    spec = load_run(["--config", config])
    before = resident_bytes()
    start = time.perf_counter()
    with torch.device("meta"):
        model = ToyLM(spec.config)
    batch = tuple(torch.empty(spec.batch_size, spec.seq_len, dtype=torch.long, device="meta") for _ in range(2))
    fused = spec.fused_optimizer and args.device != "meta"

    def optimizer(params):
        if spec.optimizer == "sgd":
            return torch.optim.SGD(params, lr=1e-4, momentum=0.9, fused=fused)
        return torch.optim.AdamW(params, lr=1e-4, fused=fused)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ledger = dry_run(
            model,
            batch,
            step=lambda m, b: m(*b),
            optimizer=optimizer,
            precision=spec.precision,
            device=args.device,
        )
    seconds = time.perf_counter() - start
    resident = resident_bytes()
    if isinstance(ledger, NotTraced):
        raise SystemExit(f"{config}: not traced: {ledger.reason}")

    closed = peak_bytes(
        spec.config, spec.batch_size, spec.seq_len, spec.precision, spec.optimizer, spec.strategy, spec.world_size,
        device=args.device, fused=spec.fused_optimizer,
    ).total  # fmt: skip
    print(
        f"{config}: ToyLM {count_parameters(spec.config) / 1e9:.3g}B params, batch {spec.batch_size} x {spec.seq_len}, "
        f"{spec.precision}, {spec.optimizer}, dry-run for {args.device}, {torch.get_num_threads()} thread(s)"
    )
    print(f"dry run: {seconds:.2f} s  (goal < {SECONDS_GOAL:.0f} s: ratio {seconds / SECONDS_GOAL:.3f})")
    print(
        f"peak resident memory of the process: {resident / 1e6:.0f} MB (before the dry run {before / 1e6:.0f} MB; "
        f"goal < {RESIDENT_GOAL / 1e9:.0f} GB: ratio {resident / RESIDENT_GOAL:.3f})"
    )
    print(
        f"predicted peak: dry run {ledger.peak / 1e9:.4g} GB ({ledger.peak_phase}), closed form {closed / 1e9:.4g} GB "
        f"(ratio {ledger.peak / closed:.4f})"
    )


if __name__ == "__main__":
    main()
