"""The cost model fed known timings: its decisions flip exactly where the
arithmetic of docs/design.md §5 says, it learns nothing from an untimed
forward, prices a prefetched load by what it adds to the critical path, and
explores when recompute has won for long."""

from __future__ import annotations

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel
from layerlift.engine.costmodel import CostModel, CostPriors, restore_bytes
from layerlift.engine.plan import LookupPlan
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.scheduler import LayerTiming
from layerlift.pools import UnifiedKVPool
from layerlift.pools.spec import ModelSpec
from layerlift.pools.tree import UnifiedRadixTree
from layerlift.testing import assert_quiescent, kl_divergence, offload_and_drop

L = 8
# A known world: 100 MB/s, no per-call latency, 0.1 ms of forward per token.
KNOWN = CostPriors(bandwidth_bytes_per_s=1e8, layer_latency_s=0.0, compute_s_per_token=1e-4)


def link_records(latency: float, bytes_per_s: float, sizes: list[int],
                 t0: float = 100.0) -> list[LayerTiming]:
    """One load as the lane records it: every layer issued at ``t0``, one
    layer in flight at a time, layer ``l`` moving ``sizes[l]`` bytes."""
    out, t = [], t0
    for layer, n in enumerate(sizes):
        t += latency + n / bytes_per_s
        out.append(LayerTiming(layer, n, issued=t0, started=t0, landed=t))
    return out


def test_barrier_flips_at_the_bytes_per_token_where_loading_equals_computing() -> None:
    model = CostModel(L, KNOWN)
    # Barrier: restore R*b/1e8 + c*S against c*(R+S): the flip is at b = 1e4 B/token.
    for b, restore in [(9_900, True), (10_100, False)]:
        d = model.decide(1000, 1000 * b, 200, overlap=False)
        assert d.restore is restore, d.reason
        assert d.est_restore_s == pytest.approx(1000 * b / 1e8 + 0.02)
        assert d.est_compute_s == pytest.approx(0.12)


def test_overlap_flips_where_the_per_layer_bound_says() -> None:
    model = CostModel(L, KNOWN)
    # R = 8000 tokens, S = 800: computing costs 0.88 s; the suffix 0.08 s. A load of
    # x seconds finishes at max(x + 0.01, x / 8 + 0.08): restore iff x + 0.01 <= 0.88.
    for x, restore in [(0.86, True), (0.88, False)]:
        d = model.decide(8000, int(x * 1e8), 800, overlap=True)
        assert d.restore is restore, d.reason
        assert d.est_restore_s == pytest.approx(max(x + 0.01, x / 8 + 0.08))
    # A short load hides behind the suffix: the first layer then the whole suffix.
    d = model.decide(8000, int(0.08 * 1e8), 800, overlap=True)
    assert d.est_restore_s == pytest.approx(0.01 + 0.08)


def test_a_prefetched_load_is_priced_by_what_it_adds_after_the_batch_ahead() -> None:
    model = CostModel(L, KNOWN)
    load_bytes = int(1.0 * 1e8)  # 1 s of load; computing everything costs 0.88 s
    # With H seconds of compute ahead, the load's first 1 s overlaps them: the plan
    # adds max(1.01, max(H, 0.125) + 0.08) - H to the critical path.
    for h, restore in [(0.0, False), (0.12, False), (0.14, True), (2.0, True)]:
        d = model.decide(8000, load_bytes, 800, ahead_s=h)
        assert d.restore is restore, (h, d.reason)
        assert d.est_restore_s == pytest.approx(max(1.01, max(h, 0.125) + 0.08) - h)
        assert d.est_compute_s == pytest.approx(0.88)
    assert "behind the batch ahead" in model.decide(8000, load_bytes, 800, ahead_s=0.5).reason
    # Fully hidden, a restore costs only its suffix (the forward starts at H anyway).
    assert model.decide(8000, load_bytes, 800, ahead_s=2.0).est_restore_s == pytest.approx(0.08)
    # Barrier: max(H, 1.0) - H + 0.08.
    d = model.decide(8000, load_bytes, 800, overlap=False, ahead_s=0.5)
    assert d.est_restore_s == pytest.approx(0.58) and d.restore


def test_learned_from_lane_records_the_decision_flips_at_the_true_link() -> None:
    model = CostModel(L, alpha=0.5)
    rng = np.random.default_rng(3)
    latency, bw = 1e-3, 5e8  # what the lane sees: 1 ms per call, 0.5 GB/s
    for _ in range(40):
        model.observe_layers(link_records(latency, bw, rng.integers(1 << 16, 1 << 22, L).tolist()))
        model.observe_forward(1000, 1000 * 2e-4)
    assert model.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-3)
    assert model.layer_latency_s == pytest.approx(latency, rel=1e-3)
    assert model.compute_s_per_token == pytest.approx(2e-4, rel=1e-6)
    # Barrier, S = 0: restore iff L*latency + R*b/bw <= c*R, i.e. R >= 8e-3 / (2e-4 - b/bw).
    b = 50_000  # bytes per token: 1e-4 s of link per token
    flip = L * latency / (2e-4 - b / bw)  # 80 tokens
    assert not model.decide(int(flip * 0.9), int(flip * 0.9) * b, 0, overlap=False).restore
    assert model.decide(int(flip * 1.1), int(flip * 1.1) * b, 0, overlap=False).restore


def test_lane_records_skip_failed_and_unlanded_layers_and_queueing() -> None:
    model = CostModel(4, alpha=1.0)
    recs = [LayerTiming(0, 1000, issued=10.0, landed=10.5),
            LayerTiming(1, 1000, issued=10.0, landed=11.0),  # queued behind layer 0: 0.5 s
            LayerTiming(2, 1000, issued=10.0, failed=True),
            LayerTiming(3, 0, issued=10.0, landed=11.2)]  # moved nothing
    model.observe_layers(recs)
    assert model.load_observations == 2
    # Both kept layers took 0.5 s for 1000 B: the fit passes through that point.
    assert model.layer_latency_s + 1000 / model.bandwidth_bytes_per_s == pytest.approx(0.5)
    # On a GPU a layer has landed once its copies completed on the device.
    gpu = CostModel(4, alpha=1.0)
    gpu.observe_layers([LayerTiming(0, 1000, issued=10.0, landed=10.2, device_done=10.5),
                        LayerTiming(1, 1000, issued=10.0, landed=10.6, device_done=11.0)])
    assert gpu.layer_latency_s + 1000 / gpu.bandwidth_bytes_per_s == pytest.approx(0.5)


def test_an_untimed_forward_teaches_nothing() -> None:
    """External-runner mode without timings: zero seconds means not measured,
    so restore="auto" keeps its estimate instead of learning that compute is free."""
    model = CostModel(L, KNOWN)
    for _ in range(10):
        model.observe_forward(5000, 0.0)
    assert model.forward_observations == 0
    assert model.compute_s_per_token == pytest.approx(1e-4)
    assert model.decide(1000, 1000 * 9_900, 200, overlap=False).restore


def plan_for(spec: ModelSpec, restore_pages: int, total: int) -> LookupPlan:
    tokens = np.zeros(total, dtype=np.int64)
    tree = UnifiedRadixTree(spec, UnifiedKVPool(spec, 4 << 20))
    return LookupPlan(0, tokens, (), tree.match_prefix(tokens), spec, boundary=restore_pages)


def test_recompute_winning_for_long_explores_the_link() -> None:
    spec = ModelSpec.preset("tiny")
    # A link so slow that recompute always wins on its estimate.
    model = CostModel(spec.num_layers, CostPriors(bandwidth_bytes_per_s=1e3), explore_after=3)
    plan = plan_for(spec, 16, 300)
    got = [model.decide_plan(plan) for _ in range(8)]
    assert [d.restore for d in got] == [False, False, False, True, False, False, False, True]
    assert got[3].reason.startswith("explore:") and "3 decisions" in got[3].reason
    assert got[3].est_restore_s > got[3].est_compute_s  # the estimate did not change
    # A fresh link measurement resets the streak.
    model.decide_plan(plan)
    model.decide_plan(plan)
    model.observe_load([1 << 20] * spec.num_layers, [1.0] * spec.num_layers)
    assert model.recompute_streak == 0
    assert [model.decide_plan(plan).restore for _ in range(4)] == [False, False, False, True]
    # Plans with nothing to restore neither count nor explore.
    assert not model.decide_plan(plan_for(spec, 0, 300)).restore
    never = CostModel(spec.num_layers, CostPriors(bandwidth_bytes_per_s=1e3), explore_after=None)
    assert not any(never.decide_plan(plan).restore for _ in range(50))


def test_exploring_picks_up_a_link_that_got_faster() -> None:
    """The link was slow (recompute won), then became fast: only the
    exploring restore's measurement lets the model notice."""
    spec = ModelSpec.preset("tiny")
    model = CostModel(spec.num_layers, alpha=0.5, explore_after=4)
    sizes = [1 << 16, 1 << 20] * (spec.num_layers // 2)
    for _ in range(20):  # slow: 2 MB/s and 20 ms per call
        model.observe_layers(link_records(20e-3, 2e6, sizes))
    plan = plan_for(spec, 16, 300)
    nbytes = restore_bytes(spec, 0, 16)
    decisions = []
    for _ in range(12):
        d = model.decide_plan(plan)
        decisions.append(d.restore)
        if d.restore:  # the engine restored and the lane measured: now 10 GB/s, 10 us
            model.observe_layers(link_records(10e-6, 1e10, [nbytes // spec.num_layers] * 8
                                              + sizes))
    assert decisions[:5] == [False, False, False, False, True]
    assert all(decisions[5:]), decisions


async def test_the_engine_explores_a_slow_link_and_stays_exact() -> None:
    """On a link where recompute wins, every ``explore_after + 1``-th plan
    restores anyway (its result says why) and is as exact as the rest."""
    model = HybridModel(ModelSpec.preset("tiny"), seed=0)
    prompt = np.random.default_rng(9).integers(0, model.vocab_size, 300, dtype=np.int64)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, restore="auto",
                       link="emulated:0.001,5000")  # 1 MB/s, 5 ms per call
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        cost = engine._ctx.cost
        assert cost is not None
        cost.explore_after = 2
        (ref,) = await engine.prefill([prompt])
        got = []
        for _ in range(7):
            await offload_and_drop(engine)
            got += await engine.prefill([prompt])
        # The first restore (on the priors) measures the link; then recompute wins.
        kinds = [r.restore_decision.split(":")[0] for r in got]  # type: ignore[union-attr]
        assert kinds == ["restore"] + ["recompute", "recompute", "explore"] * 2, kinds
        assert [r.restored_tokens > 0 for r in got] == [True] + [False, False, True] * 2
        assert max(kl_divergence(ref.next_token_logprobs, r.next_token_logprobs)
                   for r in got) <= 1e-9
        await engine.wait_offloads()
        assert_quiescent(engine)
