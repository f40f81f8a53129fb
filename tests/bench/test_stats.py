"""The benchmark's performance model (bench/stats.py) on hand-made profiles."""

from __future__ import annotations

import numpy as np
import pytest

from layerlift.bench.stats import (
    Samples,
    efficiency,
    lower_bound,
    paired_ratio_ci,
    percentile_ci,
    recurrence,
    summarize,
    verdict,
)
from layerlift.bench.stores import Point

# (a, c, recurrence F_L, lower bound) in seconds; worked out by hand.
PROFILES = [
    pytest.param([1, 1, 1, 1], [1, 1, 1, 1], 5.0, 5.0, id="balanced"),
    pytest.param([3, 3, 3], [1, 1, 1], 10.0, 10.0, id="load-bound"),
    pytest.param([1, 1, 1], [3, 3, 3], 10.0, 10.0, id="compute-bound"),
    # Layer 1 loads and computes heavily, light layers follow: nothing can overlap
    # its compute, so the recurrence (8) sits far above the bound (4).
    pytest.param([0, 4, 0], [0, 4, 0], 8.0, 4.0, id="heavy-middle"),
    # A large first load delays everything; the rest hides under compute.
    pytest.param([5, 1, 1, 1], [2, 2, 2, 2], 13.0, 13.0, id="first-load"),
    # Loads arrive faster than compute early and slower late: the forward waits 1 s
    # for layer 2 (A_2 = 6, F_1 = 5) and then ends with the last load plus c_last.
    pytest.param([1, 1, 4, 1], [2, 2, 1, 1], 8.0, 8.0, id="late-stall"),
    pytest.param([2], [3], 5.0, 5.0, id="one-layer"),
]


@pytest.mark.parametrize(("a", "c", "model", "bound"), PROFILES)
def test_recurrence_and_bound(a: list[float], c: list[float], model: float, bound: float) -> None:
    assert recurrence(a, c) == pytest.approx(model)
    assert lower_bound(a, c) == pytest.approx(bound)
    assert lower_bound(a, c) <= recurrence(a, c) <= sum(a) + sum(c)


@pytest.mark.parametrize("bad", [([1.0], [1.0, 2.0]), ([], [])])
def test_profiles_must_match(bad: tuple[list[float], list[float]]) -> None:
    with pytest.raises(ValueError, match="one load and one compute time per layer"):
        recurrence(*bad)
    with pytest.raises(ValueError, match="one load and one compute time per layer"):
        lower_bound(*bad)


def test_efficiency() -> None:
    assert efficiency(8.0, 5.0, 5.0) == pytest.approx(1.0)
    assert efficiency(8.0, 6.5, 5.0) == pytest.approx(0.5)
    assert efficiency(8.0, 8.0, 5.0) == pytest.approx(0.0)
    assert efficiency(8.0, 9.0, 5.0) == pytest.approx(-1 / 3)  # overlap slower: negative
    assert efficiency(8.0, 7.0, 7.9995) is None  # under 1 ms of room: no ratio


def test_summarize_charges_the_overhead_to_both() -> None:
    a, c = [0.004, 0.004, 0.004, 0.004], [0.003, 0.003, 0.003, 0.003]
    overhead = 0.010
    barrier = overhead + sum(a) + sum(c)  # 0.038
    overlap = overhead + recurrence(a, c) + 0.001  # 1 ms worse than the model
    smp = Samples()
    for _ in range(3):
        smp.ttft["recompute"].append(0.100)
        smp.ttft["barrier"].append(barrier)
        smp.ttft["overlap"].append(overlap)
        for s in ("barrier", "overlap"):
            smp.fstart[s].append(0.0)
        smp.prof_a.append(a)
        smp.prof_c.append(c)
        smp.over_wait.append([0.0] * 4)
        smp.over_c.append(c)
    smp.restored.add(512)
    smp.computed.add(64)
    out = summarize("label", "emulated:1", Point("tiny", 512, 64, 1), 3, 1, smp)
    assert out["overhead_s"] == pytest.approx(overhead)
    assert out["load_s"] == pytest.approx(0.016) and out["compute_s"] == pytest.approx(0.012)
    assert out["model_overlap_s"] == pytest.approx(overhead + 0.019)  # A=4,8,12,16 ms; +3 ms
    assert out["bound_s"] == pytest.approx(overhead + max(0.016 + 0.003, 0.004 + 0.012))
    # room to the model: 38 - 29 = 9 ms, had 8 ms
    assert out["efficiency_model"] == pytest.approx(8 / 9)
    assert out["speedup"] == pytest.approx(barrier / overlap)
    assert out["restore_ok"] and out["kl_ok"]
    # no /proc/stat samples were added: no machine figure, not a made-up one
    assert out["machine_cores"] == {"recompute": None, "barrier": None, "overlap": None}
    assert out["machine_cpus"] is None


def test_paired_ratio_of_a_scaled_copy_is_exact() -> None:
    rng = np.random.default_rng(0)
    base = [rng.exponential(1.0, 40).tolist() for _ in range(3)]
    double = [[2 * x for x in g] for g in base]
    point, lo, hi = paired_ratio_ci(double, base, 50)
    assert point == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    assert verdict(lo, hi) == "higher"


def test_identical_distributions_read_as_no_measurable_difference() -> None:
    rng = np.random.default_rng(1)
    a = [rng.exponential(1.0, 60).tolist() for _ in range(3)]
    b = [rng.exponential(1.0, 60).tolist() for _ in range(3)]
    point, lo, hi = paired_ratio_ci(a, b, 90)
    assert lo < point < hi and lo < 1.0 < hi
    assert verdict(lo, hi) == "no measurable difference"
    shifted = [[0.5 * x for x in g] for g in a]
    assert verdict(*paired_ratio_ci(shifted, b, 50)[1:]) == "lower"


def test_percentile_interval_holds_the_point_and_pairs_are_checked() -> None:
    groups = [[1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0]]
    point, lo, hi = percentile_ci(groups, 50)
    assert point == pytest.approx(3.0) and lo <= point <= hi
    with pytest.raises(ValueError, match="equal sizes"):
        paired_ratio_ci([[1.0, 2.0]], [[1.0]], 50)
    with pytest.raises(ValueError, match="non-empty"):
        percentile_ci([], 50)
