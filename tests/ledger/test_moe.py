"""Mixture of experts in the dry run (ledger/dryrun/moe.py): balanced and worst routing bound the real step.

Two MoE models: a plain token-choice top-k layer written here (softmax router, topk, per-expert
gather by nonzero or by argsort + bincount + split(.tolist()), expert MLPs, index_add back) and
transformers' Mixtral, tiny and built from a config (no download), on its eager experts loop and on
its default grouped_mm path. Each prediction is held to real CPU steps (dryrun.measure_step):
random routing lies between the two bounds, and a real step whose router is forced to the
assumed routing matches that bound exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lmledger.errors import UserError
from lmledger.hf import causal_lm_loss
from lmledger.ledger.count.flopcounter import CPU_SDPA_FLOP_FORMULAS, GROUPED_MM_FLOP_FORMULAS
from lmledger.ledger.dryrun import moe, moebounds
from lmledger.ledger.dryrun.engine import NotTraced, StepLedger, dry_run, measure_step

VOCAB = 32


class TopKMoE(nn.Module):
    """Embedding -> one token-choice top-k MoE layer (residual) -> LM head, loss included."""

    def __init__(
        self, d: int = 32, f: int = 256, experts: int = 4, k: int = 2, dispatch: str = "nonzero", capacity: int = 0
    ) -> None:
        super().__init__()
        self.k, self.dispatch, self.capacity = k, dispatch, capacity
        self.embed = nn.Embedding(VOCAB, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.ModuleList(nn.Linear(d, f, bias=False) for _ in range(experts))
        self.w_out = nn.ModuleList(nn.Linear(f, d, bias=False) for _ in range(experts))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.w_out[e](F.gelu(self.w_in[e](x)))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx).flatten(0, 1)
        weights, experts = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        if self.dispatch == "nonzero":
            for e in range(len(self.w_in)):
                token, slot = torch.nonzero(experts == e, as_tuple=True)
                if self.capacity:  # tokens past an expert's capacity are dropped (the residual carries them)
                    token, slot = token[: self.capacity], slot[: self.capacity]
                h = self.expert(e, x.index_select(0, token)) * weights[token, slot, None]
                out = out.index_add(0, token, h.to(out.dtype))  # bf16 under autocast
        else:  # sort the token-expert pairs by expert, split by the counts
            flat = experts.flatten()
            order = flat.argsort()
            counts = torch.bincount(flat, minlength=len(self.w_in)).tolist()
            token = order // self.k
            parts = x[token].split(counts)
            h = torch.cat([self.expert(e, part) for e, part in enumerate(parts)])
            out = out.index_add(0, token, (h * weights.flatten()[order, None]).to(out.dtype))
        return F.cross_entropy(self.head(x + out), targets.flatten())


class ForcedRouting(TorchDispatchMode):
    """A real step whose every topk picks what moe.routing_indices assumes (values gathered to match)."""

    def __init__(self, routing: str, capacity: int | None = None) -> None:
        super().__init__()
        self.routing, self.capacity = routing, capacity

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            scores, k = args[0], args[1]
            dim = args[2] if len(args) > 2 else -1
            indices = moe.routing_indices(tuple(scores.shape), dim, k, self.routing, self.capacity)
            return scores.gather(dim, indices), indices
        return out


class RoutingCounts(TorchDispatchMode):
    """Records how many token picks each expert got, per topk call of a real step."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            self.counts.append(torch.bincount(out[1].flatten(), minlength=args[0].shape[-1]).tolist())
        return out


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _plain(seed: int, dispatch: str, capacity: int = 0) -> TopKMoE:
    torch.manual_seed(seed)
    return TopKMoE(dispatch=dispatch, capacity=capacity)


def _batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """rows x 128 tokens: 8 rows (1024 tokens) where the bounds are compared, fewer where only exactness is."""
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, VOCAB, (rows, 128), generator=generator) for _ in range(2))


def _mixtral(seed: int, implementation: str, intermediate: int = 256) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        experts_implementation=implementation,
    )
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


_mixtral_step = causal_lm_loss  # the causal LM step on (inputs, targets) windows


def _assert_random_routing_within(bounds: moebounds.MoEBounds, make, batch, step=None, precision="32-true") -> None:
    """Real steps with random routing (the routers' random initial weights) against the bounds.

    worst is an upper bound: no expert can get more than every token. balanced is not a lower one:
    where the peak falls inside the expert loop it is set by the batch of one expert (in backward,
    the first processed), and random routing may give that expert fewer than tokens·k/E. So the
    check below the balanced figure allows what one expert's shortfall frees: the largest deviation
    measured from tokens·k/E, times the bytes per token-expert row at the peak, which is the slope
    from balanced to worst ((worst - balanced) / (tokens - tokens·k/E), the peak expert's batch going
    from tokens·k/E to every token)."""
    tokens, experts, k = batch[0].numel(), 4, 2
    fair = tokens * k // experts
    per_row = (bounds.worst.peak - bounds.balanced.peak) / (tokens - fair)
    for seed in range(3):
        recorder = RoutingCounts()
        with recorder:
            measured = measure_step(make(seed), batch, step=step, optimizer=_adamw, precision=precision)
        deviation = max(abs(n - fair) for counts in recorder.counts for n in counts)
        assert deviation < fair  # routing is random, not degenerate: the allowance stays below the gap
        assert bounds.balanced.peak - deviation * per_row <= measured.peak <= bounds.worst.peak, seed
        state = (measured.params, measured.grads, measured.optimizer, measured.flops)
        assert state == (
            bounds.balanced.params,
            bounds.balanced.grads,
            bounds.balanced.optimizer,
            bounds.balanced.flops,
        )


def _same_step(predicted: StepLedger, measured: StepLedger) -> None:
    """Everything a routing decides, byte for byte and FLOP for FLOP."""
    for name in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "peak",
        "phase_peaks",
        "flops_forward",
        "flops_backward",
    ):
        assert getattr(predicted, name) == getattr(measured, name), name


def test_routing_indices_are_balanced_or_all_on_the_first_k():
    balanced = moe.routing_indices((10, 4), -1, 2, "balanced")
    assert balanced.shape == (10, 2)
    assert all(len(set(row.tolist())) == 2 for row in balanced)  # a token's k experts are distinct
    assert sorted(torch.bincount(balanced.flatten(), minlength=4).tolist()) == [5, 5, 5, 5]
    uneven = torch.bincount(moe.routing_indices((5, 3), 1, 2, "balanced").flatten(), minlength=3)
    assert sorted(uneven.tolist()) == [3, 3, 4]  # 10 picks over 3 experts: floor or ceil of 10/3
    along_dim0 = moe.routing_indices((4, 6), 0, 1, "balanced")  # top-1 over dim 0, 6 rows
    assert along_dim0.shape == (1, 6) and along_dim0.flatten().tolist() == [0, 1, 2, 3, 0, 1]
    worst = moe.routing_indices((10, 4), -1, 2, "worst")  # every expert hit, the rest on experts 2 and 3
    assert worst.tolist() == [[0, 3], [1, 3]] + [[2, 3]] * 8
    assert moe.routing_indices((3, 8), -1, 1, "worst").flatten().tolist() == [0, 1, 2]  # fewer rows than experts
    capped = torch.bincount(moe.routing_indices((10, 4), -1, 2, "worst", capacity=6).flatten(), minlength=4)
    assert capped.tolist() == [2, 6, 6, 6]  # filled to the capacity from the last expert down


@pytest.mark.parametrize(
    ("dispatch", "precision"), [("nonzero", "32-true"), ("sort", "32-true"), ("nonzero", "bf16-mixed")]
)
def test_plain_top_k_moe_is_bounded_by_balanced_and_worst_routing(dispatch, precision):
    """bf16-mixed: each hit expert's linears keep an autocast copy of their weights for backward, a
    per-expert cost that the worst routing pays by hitting every expert."""
    batch = _batch()
    bounds = moebounds.predict_moe(_plain(0, dispatch), batch, optimizer=_adamw, precision=precision)
    assert isinstance(bounds, moebounds.MoEBounds), bounds
    balanced, worst = bounds.balanced, bounds.worst
    assert bounds.routing_matters and worst.peak >= balanced.peak
    assert worst.phase_peaks["backward"] > balanced.phase_peaks["backward"]  # the experts' gradients
    assert balanced.flops == worst.flops  # token-choice: tokens x k expert rows whatever the routing
    _assert_random_routing_within(bounds, lambda seed: _plain(seed, dispatch), batch, precision=precision)
    for routing, predicted in (("balanced", balanced), ("worst", worst)):
        with ForcedRouting(routing):
            forced = measure_step(_plain(0, dispatch), batch, optimizer=_adamw, precision=precision)
        _same_step(predicted, forced)


def test_an_expert_capacity_caps_the_worst_case():
    """A layer that drops the tokens past an expert's capacity: told the capacity, the worst routing
    fills the heavy experts to it; not told, it sends every token to them and the layer drops most,
    which predicts less than balanced. Balanced routing (512 picks per expert) stays under 640."""
    batch, capacity = _batch(), 640
    uncapped = moebounds.predict_moe(_plain(0, "nonzero"), batch, optimizer=_adamw)
    capped = moebounds.predict_moe(_plain(0, "nonzero", capacity), batch, optimizer=_adamw, capacity=capacity)
    untold = moebounds.predict_moe(_plain(0, "nonzero", capacity), batch, optimizer=_adamw)
    assert isinstance(capped, moebounds.MoEBounds) and isinstance(uncapped, moebounds.MoEBounds), capped
    _same_step(capped.balanced, uncapped.balanced)
    backward = [bounds.phase_peaks["backward"] for bounds in (capped.balanced, capped.worst, uncapped.worst)]
    assert backward[0] < backward[1] < backward[2]  # the experts' gradients
    assert capped.worst.flops == capped.balanced.flops  # filled to capacity, nothing dropped
    assert untold.worst.peak < untold.balanced.peak and untold.worst.flops < untold.balanced.flops
    for routing, predicted in (("balanced", capped.balanced), ("worst", capped.worst)):
        with ForcedRouting(routing, capacity if routing == "worst" else None):
            forced = measure_step(_plain(0, "nonzero", capacity), batch, optimizer=_adamw)
        _same_step(predicted, forced)
    for seed in range(2):
        assert measure_step(_plain(seed, "nonzero", capacity), batch, optimizer=_adamw).peak <= capped.worst.peak
    with pytest.raises(UserError, match="capacity must be a positive number"):
        moebounds.predict_moe(_plain(0, "nonzero"), batch, capacity=0)


def test_without_an_assumption_the_dry_run_names_the_routing_and_the_fix():
    result = dry_run(_plain(0, "nonzero"), _batch(), optimizer=_adamw)
    assert isinstance(result, NotTraced) and moebounds.routing_dependent(result)
    assert "routing='balanced' and 'worst'" in result.reason
    assert "at ledger/test_moe.py:" in result.reason  # the model's line, not the ledger's
    with pytest.raises(UserError, match="routing must be one of balanced, worst"):
        dry_run(_plain(0, "nonzero"), _batch(), routing="random")
    # moebounds.dry_run_bounds: the bounds where routing decides shapes, the plain ledger where nothing routes
    bounds = moebounds.dry_run_bounds(_plain(0, "nonzero"), _batch(), optimizer=_adamw)
    assert isinstance(bounds, moebounds.MoEBounds)
    _same_step(bounds.worst, dry_run(_plain(0, "nonzero"), _batch(), optimizer=_adamw, routing="worst"))
    dense = moebounds.dry_run_bounds(nn.Linear(8, 8), torch.randn(4, 8), step=lambda m, b: m(b).square().mean())
    assert isinstance(dense, StepLedger) and dense.params == 8 * 8 * 4 + 8 * 4


def test_mixtral_eager_experts_are_bounded_by_balanced_and_worst_routing():
    batch = _batch()
    bounds = moebounds.predict_moe(_mixtral(0, "eager"), batch, step=_mixtral_step, optimizer=_adamw)
    assert isinstance(bounds, moebounds.MoEBounds), bounds
    assert bounds.routing_matters and bounds.worst.peak > bounds.balanced.peak
    _assert_random_routing_within(bounds, lambda seed: _mixtral(seed, "eager"), batch, step=_mixtral_step)
    for routing, predicted in (("balanced", bounds.balanced), ("worst", bounds.worst)):
        with ForcedRouting(routing):
            forced = measure_step(_mixtral(0, "eager"), batch, step=_mixtral_step, optimizer=_adamw)
        _same_step(predicted, forced)


@pytest.mark.parametrize("family", ["Qwen2Moe", "Olmoe"])
def test_other_hugging_face_moe_families_match_their_forced_routings(family):
    """Qwen2-MoE (a shared expert beside the routed ones, sigmoid-gated) and OLMoE, eager experts."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=128,
        shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, experts_implementation="eager",
        eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )  # fmt: skip

    def build() -> nn.Module:
        torch.manual_seed(0)
        return getattr(transformers, f"{family}ForCausalLM")(config)

    batch = _batch(rows=2)
    bounds = moebounds.dry_run_bounds(build(), batch, step=_mixtral_step, optimizer=_adamw)
    assert isinstance(bounds, moebounds.MoEBounds), bounds
    for routing, predicted in (("balanced", bounds.balanced), ("worst", bounds.worst)):
        with ForcedRouting(routing):
            forced = measure_step(build(), batch, step=_mixtral_step, optimizer=_adamw)
        _same_step(predicted, forced)


def test_activation_checkpointing_recomputes_the_assumed_routing():
    """Under checkpointing the MoE layer's forward runs again in backward, topk included: the recompute
    gets the same assumed indices, so its shapes match the forward's (torch.utils.checkpoint checks)."""
    batch = _batch(rows=2)

    def checkpointed(seed: int) -> nn.Module:
        model = _mixtral(seed, "eager")
        model.activation_checkpointing_enable({"use_reentrant": False})
        return model

    bounds = moebounds.predict_moe(checkpointed(0), batch, step=_mixtral_step, optimizer=_adamw)
    assert isinstance(bounds, moebounds.MoEBounds), bounds
    for routing, predicted in (("balanced", bounds.balanced), ("worst", bounds.worst)):
        with ForcedRouting(routing):
            forced = measure_step(checkpointed(0), batch, step=_mixtral_step, optimizer=_adamw)
        _same_step(predicted, forced)
    unchecked = dry_run(_mixtral(0, "eager"), batch, step=_mixtral_step, routing="balanced")
    assert bounds.balanced.activations < unchecked.activations  # checkpointing saved less


def test_mixtral_grouped_mm_dry_runs_exactly_whatever_the_routing():
    """transformers' default experts path on a CPU: one grouped GEMM over every token-expert row, so no
    shape depends on the routing; the dry run gets the CPU kernel's shapes (canary
    test_grouped_mm_meta_kernel_refuses_what_the_cpu_kernel_runs)."""
    batch = _batch(rows=2)
    model = _mixtral(0, None)
    assert model.config._experts_implementation == "grouped_mm"
    bounds = moebounds.predict_moe(model, batch, step=_mixtral_step, optimizer=_adamw)
    assert isinstance(bounds, moebounds.MoEBounds), bounds
    assert not bounds.routing_matters
    _same_step(bounds.balanced, measure_step(_mixtral(1, None), batch, step=_mixtral_step, optimizer=_adamw))


def test_grouped_mm_flop_formula_counts_what_the_eager_experts_count():
    """FlopCounterMode counts torch._grouped_mm as 0; GROUPED_MM_FLOP_FORMULAS counts the grouped path's
    forward and backward as the eager loop's per-expert mm count them (same weights, same routing)."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs, _ = _batch()
    totals = {}
    for implementation in ("eager", "grouped_mm"):
        model = _mixtral(0, implementation, intermediate=64)
        counter = FlopCounterMode(display=False, custom_mapping={**CPU_SDPA_FLOP_FORMULAS, **GROUPED_MM_FLOP_FORMULAS})
        with counter:
            model(input_ids=inputs[:2, :16], use_cache=False).logits.float().square().mean().backward()
        totals[implementation] = counter.get_flop_counts()["Global"]
    assert totals["grouped_mm"][torch.ops.aten._grouped_mm] > 0
    assert sum(totals["grouped_mm"].values()) == sum(totals["eager"].values())


class _DataDependent(nn.Module):
    """Not MoE: the positive activations only, a shape only the data decides."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h[h > 0].sum()


@pytest.mark.parametrize("routing", [None, "balanced"])
def test_a_data_dependent_shape_that_is_not_routing_stays_not_traced(routing):
    result = dry_run(_DataDependent(), torch.randn(4, 8), routing=routing)
    assert isinstance(result, NotTraced) and not moebounds.routing_dependent(result)
    assert "output shape depends on tensor values" in result.reason and "at ledger/test_moe.py:" in result.reason
    assert moebounds.dry_run_bounds(_DataDependent(), torch.randn(4, 8)) == result  # the same line, no bounds

    def item_in_step(model, batch):
        loss = model(batch).square().mean()
        return loss * 2 if loss.item() > 0 else loss

    result = dry_run(nn.Linear(8, 8), torch.randn(4, 8), step=item_in_step, routing=routing)
    assert isinstance(result, NotTraced) and "a value read from a tensor" in result.reason
