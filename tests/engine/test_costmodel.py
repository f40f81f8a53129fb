"""The restore-or-recompute cost model: priors, online fits, decisions."""

from __future__ import annotations

import numpy as np
import pytest

from layerlift.engine.costmodel import CostModel, CostPriors, Decision, restore_bytes
from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import Timings
from layerlift.pools import UnifiedKVPool
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import UnifiedRadixTree

LAYERS = 16


def feed_link(model: CostModel, latency: float, gbps: float, rounds: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        sizes = rng.integers(16 << 10, 4 << 20, LAYERS).tolist()
        model.observe_load(sizes, [latency + x / (gbps * 1e9) for x in sizes])


def test_priors_before_any_observation() -> None:
    model = CostModel(LAYERS)
    assert model.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert model.layer_latency_s == pytest.approx(50e-6)
    assert model.compute_s_per_token == pytest.approx(2e-4)
    # 2048 tokens of ~16 KiB each at 1 GB/s (~34 ms) beat computing them (~410 ms).
    d = model.decide(2048, 2048 * (16 << 10), 64)
    assert d.restore and d.reason.startswith("restore:")
    assert d.est_restore_s < d.est_compute_s


def test_learns_link_bandwidth_and_latency() -> None:
    model = CostModel(LAYERS, alpha=0.1)
    feed_link(model, latency=2e-3, gbps=0.1, rounds=40)
    assert model.bandwidth_bytes_per_s == pytest.approx(0.1e9, rel=0.02)
    assert model.layer_latency_s == pytest.approx(2e-3, rel=0.02)
    assert model.load_observations == 40 * LAYERS


def test_learns_compute_per_token_as_a_moving_average() -> None:
    model = CostModel(LAYERS, alpha=0.5)
    for _ in range(30):
        model.observe_forward(1000, 0.5)
    assert model.compute_s_per_token == pytest.approx(5e-4, rel=1e-6)
    model.observe_forward(0, 1.0)  # nothing computed: nothing learned
    assert model.forward_observations == 30


def test_short_prefix_on_a_slow_link_is_recomputed_long_one_restored() -> None:
    model = CostModel(LAYERS, alpha=0.2)
    feed_link(model, latency=5e-3, gbps=0.5, rounds=30)  # 80 ms of latency alone
    for _ in range(10):
        model.observe_forward(512, 512 * 1e-4)
    tok_bytes = 8 << 10
    short = model.decide(64, 64 * tok_bytes, 64)
    assert not short.restore and short.reason.startswith("recompute:")
    assert short.est_compute_s < short.est_restore_s
    long = model.decide(8192, 8192 * tok_bytes, 64)
    assert long.restore


def test_overlap_estimate_never_exceeds_barrier() -> None:
    model = CostModel(LAYERS)
    for r, s in [(128, 64), (4096, 64), (512, 4096), (1, 1)]:
        ov = model.decide(r, r * 4096, s, overlap=True)
        ba = model.decide(r, r * 4096, s, overlap=False)
        assert ov.est_restore_s <= ba.est_restore_s
        assert ov.est_compute_s == ba.est_compute_s


def test_nothing_to_restore() -> None:
    assert CostModel(LAYERS).decide(0, 0, 100) == Decision(
        False, "nothing to restore", pytest.approx(0.02), pytest.approx(0.02))


def test_one_size_only_keeps_a_finite_bandwidth() -> None:
    model = CostModel(LAYERS, alpha=1.0)
    model.observe_load([1 << 20] * LAYERS, [0.01] * LAYERS)
    assert 0 < model.bandwidth_bytes_per_s < float("inf")
    assert model.load_seconds(LAYERS << 20) > 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: CostModel(0), "num_layers"),
        (lambda: CostModel(4, alpha=0.0), "alpha"),
        (lambda: CostPriors(bandwidth_bytes_per_s=0), "positive"),
        (lambda: CostModel(4).observe_load([1, 2], [0.1]), "byte counts"),
        (lambda: CostModel(4).observe_load([-1], [0.1]), "negative"),
        (lambda: CostModel(4).decide(-1, 0, 0), "negative"),
        (lambda: CostModel(4).decide(1, 1, 1, ahead_s=-1.0), "negative"),
        (lambda: CostModel(4, explore_after=0), "explore_after"),
        (lambda: CostModel(4).compute_seconds(-1), "negative"),
    ],
)
def test_bad_input_is_a_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_restore_bytes_counts_full_pages_swa_window_and_one_checkpoint() -> None:
    spec = ModelSpec.preset("tiny")  # window 4 pages
    f, s, m = (spec.page_bytes(c) for c in (Component.FULL, Component.SWA, Component.MAMBA))
    assert restore_bytes(spec, 0, 0) == 0
    assert restore_bytes(spec, 0, 8) == 8 * f + 4 * s + m
    assert restore_bytes(spec, 6, 8) == 2 * f + 2 * s + m
    with pytest.raises(ValueError, match="d <= b"):
        restore_bytes(spec, 4, 2)


def test_decide_plan_reads_the_plan() -> None:
    spec = ModelSpec.preset("tiny")
    tokens = np.zeros(300, dtype=np.int64)
    tree = UnifiedRadixTree(spec, UnifiedKVPool(spec, 4 << 20))
    # LOOKUP found 16 pages (256 tokens) in the store, nothing on the device.
    plan = LookupPlan(0, tokens, (), tree.match_prefix(tokens), spec, boundary=16)
    model = CostModel(spec.num_layers)
    got = model.decide_plan(plan)
    want = model.decide(256, restore_bytes(spec, 0, 16), 300 - 256)
    assert got == want and got.restore


def test_observe_batch_reads_engine_timings() -> None:
    model = CostModel(4, alpha=1.0)
    # Issued at 10 ms, layers of 1 MB land every 2 ms; 0.1 s of forward for 1000 tokens.
    t = Timings(load_issued=0.010, layer_landed=[0.012, 0.014, 0.016, 0.018],
                layer_compute=[0.025] * 4)
    model.observe_batch(t, [1_000_000] * 4, 1000)
    assert model.compute_s_per_token == pytest.approx(1e-4)
    assert model.load_observations == 4
    # Every layer took 2 ms for 1 MB: the fit passes through (1 MB, 2 ms).
    per_layer = model.layer_latency_s + 1e6 / model.bandwidth_bytes_per_s
    assert per_layer == pytest.approx(2e-3, rel=1e-6)
    model.observe_batch(Timings(layer_compute=[0.01] * 4), [], 100)  # no restore: compute only
    assert model.load_observations == 4 and model.forward_observations == 2
    assert model.compute_s_per_token == pytest.approx(4e-4)
    # A forward without per-layer timings (a host that reported none) teaches nothing.
    model.observe_batch(Timings(load_issued=0.010, layer_landed=[0.012, 0.014, 0.016, 0.018]),
                        [1_000_000] * 4, 1000)
    assert model.forward_observations == 2 and model.load_observations == 8
    assert model.compute_s_per_token == pytest.approx(4e-4)
    with pytest.raises(ValueError, match="byte counts"):
        model.observe_batch(t, [1], 10)
