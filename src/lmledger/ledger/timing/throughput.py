"""Throughput of a fit, as a pure accumulator over a window.

The callback feeds it: a batch's tokens or samples and FLOPs, data waits, pauses such as validation.
It reads the rates at each logging step.
The accumulator knows nothing of Lightning; every time comes from its caller.
The rates:
    tokens/s (or samples/s), TFLOP/s (model FLOPs; hardware FLOPs where model FLOPs are unknown),
    MFU = model FLOP/s / peak, HFU = hardware FLOP/s / peak, and the other MFU conventions by name,
    data_wait_frac = share of the window spent between steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from lmledger.ledger.units import tera

__all__ = ["Window"]


@dataclass
class Window:
    """Batches, tokens, samples and FLOPs since `start` (seconds on the caller's clock)."""

    start: float
    batches: int = 0
    tokens: int = 0
    samples: int = 0
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # "model", "hardware", "6n", ...
    data_wait: float = 0.0
    paused: float = 0.0

    def add(self, *, tokens: int | None, samples: int, flops: dict[str, int | None]) -> None:
        self.batches += 1
        self.tokens += tokens or 0
        self.samples += samples
        for kind, n in flops.items():
            if n is not None:
                self.flops[kind] += n

    def rates(self, now: float, peak_flops_per_s: float | None, counts_tokens: bool) -> dict[str, float]:
        """perf/* values of the window ending `now`; empty until time and a batch have passed."""
        seconds = now - self.start - self.paused
        if seconds <= 0 or self.batches == 0:
            return {}
        out = {"perf/tokens_per_sec" if counts_tokens else "perf/samples_per_sec": (
            self.tokens if counts_tokens else self.samples) / seconds}  # fmt: skip
        numerator = self.flops.get("model") or self.flops.get("hardware")
        if numerator:
            out["perf/tflops"] = tera(numerator / seconds)
        out["perf/data_wait_frac"] = min(1.0, max(0.0, self.data_wait / seconds))
        if peak_flops_per_s:
            for kind, tag in _MFU_TAGS.items():
                if self.flops.get(kind):
                    out[tag] = self.flops[kind] / seconds / peak_flops_per_s
        return out


# FLOP kinds and their utilisation tags (docs/mfu.md). PaLM's full attention is perf/mfu.
_MFU_TAGS = {"model": "perf/mfu", "hardware": "perf/hfu", "6n": "perf/mfu_6n", "causal": "perf/mfu_causal"}
