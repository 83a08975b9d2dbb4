"""What `lmledger fit` spends before its first step, beside its imports: building LightningCLI's parser.

LightningCLI builds one parser per subcommand (fit, validate, test, predict), each holding every argument of the
Trainer, the model, the data and the kit's sections. FitCLI builds only the one its command line names. Every
`lmledger fit` and each of its ranks pays this once, in a fresh process: so each sample is a process of its own,
timing its first parse (imports excluded). Arms alternate (ABBA); printed: the median seconds of each arm and their
ratio (> 1: the one parser is faster).

    python benchmarks/cli_start.py [--pairs 4] [--config configs/tiny.yaml]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import time

from lightning.pytorch.cli import LightningCLI

from lmledger.fitting.cli import FitCLI, _run_cli


class EveryParser(FitCLI):
    """LightningCLI's own choice: a parser for every subcommand."""

    def subcommands(self) -> dict[str, set[str]]:
        return LightningCLI.subcommands()


def parse_seconds(cli_class: type[FitCLI], config: str) -> float:
    """Seconds to build the parser and parse `fit --config CONFIG --print_config` (which exits after parsing)."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        _run_cli(cli_class, ["fit", "--config", config, "--print_config"], run=True)
    return time.perf_counter() - start


ARMS = {"every": EveryParser, "one": FitCLI}


def sample(arm: str, config: str) -> float:
    """One arm's first parse, in a process of its own (this script with --arm)."""
    done = subprocess.run([sys.executable, __file__, "--arm", arm, "--config", config], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--arm", choices=list(ARMS), help="time this arm's first parse here and print its seconds")
    args = parser.parse_args()
    if args.arm:
        print(parse_seconds(ARMS[args.arm], args.config))
        return
    arms: dict[str, list[float]] = {"every": [], "one": []}
    for pair in range(args.pairs):
        order = ("every", "one") if pair % 2 == 0 else ("one", "every")
        for arm in order:
            arms[arm].append(sample(arm, args.config))
    every, one = statistics.median(arms["every"]), statistics.median(arms["one"])
    print(f"parser of every subcommand: {every * 1e3:.0f} ms (median of {args.pairs})")
    print(f"parser of `fit` alone:      {one * 1e3:.0f} ms")
    print(f"ratio every/one: {every / one:.2f}; saved per process: {(every - one) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
