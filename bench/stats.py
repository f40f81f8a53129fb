"""The numbers of one benchmark point: raw samples in, the performance model out.

docs/design.md §5: with per-layer load times ``a_l`` and compute times ``c_l``
(the barrier run's profile, where the two never overlap), the barrier takes
``Σa + Σc``, per-layer overlap at best ``F_L`` with ``F_l = max(A_l, F_{l-1}) + c_l``,
and never less than ``max(Σa + c_last, a_0 + Σc)`` (the bound). The fixed overhead
(lookup, PREPARE, issue, hand-offs, logits) is charged to both unchanged.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerlift.bench.machine_cpu import Busy
from layerlift.bench.report import STRATEGIES
from layerlift.bench.stores import Point

__all__ = ["KL_TOL", "Samples", "efficiency", "lower_bound", "paired_ratio_ci", "percentile_ci",
           "recurrence", "spread", "summarize", "verdict"]

KL_TOL = 1e-9


@dataclass(slots=True)
class Samples:
    """What the repeats of one point measured (seconds)."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STRATEGIES})
    fstart: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STRATEGIES})
    prof_a: list[list[float]] = field(default_factory=list)  # overlap: load per layer
    prof_c: list[list[float]] = field(default_factory=list)  # barrier: compute per layer
    barrier_load: list[float] = field(default_factory=list)  # barrier: whole-object fetch
    over_wait: list[list[float]] = field(default_factory=list)  # overlap: wait per layer
    over_c: list[list[float]] = field(default_factory=list)  # overlap: compute per layer
    paired: list[float] = field(default_factory=list)  # per-repeat efficiency
    restored: set[int] = field(default_factory=set)
    computed: set[int] = field(default_factory=set)
    fallbacks: list[str] = field(default_factory=list)
    max_kl: float = 0.0
    # the cores busy machine-wide during each strategy's measured runs
    machine: dict[str, Busy] = field(default_factory=lambda: {s: Busy() for s in STRATEGIES})


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def spread(xs: Sequence[float]) -> dict[str, float]:
    """``min``, ``median`` and ``max`` of ``xs``, to three decimals (the
    transfer benchmarks' cells)."""
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3),
            "max": round(max(xs), 3)}  # fmt: skip


def ratio(num: float, den: float) -> float | None:
    return num / den if den > 1e-3 else None


def recurrence(a: Sequence[float], c: Sequence[float]) -> float:
    """``F_L`` of ``F_l = max(A_l, F_{l-1}) + c_l`` with ``A_l = a_0 + ... + a_l``: when
    the last layer finishes under the best per-layer overlap (layers loaded in order)."""
    if len(a) != len(c) or not len(a):
        raise ValueError(f"need one load and one compute time per layer, got {len(a)} and {len(c)}")
    f_l = 0.0
    for a_l, c_l in zip(np.cumsum(np.asarray(a, dtype=np.float64)), c, strict=True):
        f_l = max(float(a_l), f_l) + float(c_l)
    return f_l


def lower_bound(a: Sequence[float], c: Sequence[float]) -> float:
    """``max(Σa + c_last, a_0 + Σc)``: no overlap finishes sooner (docs/design.md §5)."""
    if len(a) != len(c) or not len(a):
        raise ValueError(f"need one load and one compute time per layer, got {len(a)} and {len(c)}")
    return max(float(sum(a)) + float(c[-1]), float(a[0]) + float(sum(c)))


def efficiency(t_barrier: float, t_overlap: float, reference: float) -> float | None:
    """``(T_barrier - T_overlap) / (T_barrier - reference)``: the share of the room
    between the barrier and `reference` (the bound or the model) that overlap took.
    None when that room is under 1 ms (the ratio would be noise)."""
    return ratio(t_barrier - t_overlap, t_barrier - reference)


def _single(values: set[int]) -> int | list[int]:
    return sorted(values)[0] if len(values) == 1 else sorted(values)


def summarize(label: str, link: str, pt: Point, repeats: int, warmup: int,
              smp: Samples) -> dict[str, Any]:
    """One JSON point (the keys the README and the plot read)."""
    p50 = {s: pct(smp.ttft[s], 50) for s in STRATEGIES}
    a = np.median(np.asarray(smp.prof_a), axis=0)
    c = np.median(np.asarray(smp.prof_c), axis=0)
    load_s, compute_s = float(a.sum()), float(c.sum())
    # The barrier reads whole objects in one call: its own load time, not the
    # per-layer profile, is what its TTFT spent loading.
    barrier_load = float(np.median(smp.barrier_load)) if smp.barrier_load else load_s
    overhead = p50["barrier"] - barrier_load - compute_s
    bound = overhead + lower_bound(a, c)
    model = overhead + recurrence(a, c)
    waits = np.median(np.asarray(smp.over_wait), axis=0)
    return {
        "link": label, "link_arg": link, "preset": pt.preset, "prefix_tokens": pt.prefix,
        "suffix_tokens": pt.suffix, "batch": pt.batch, "repeats": repeats, "warmup": warmup,
        "ttft_s": p50,
        "ttft_p90_s": {s: pct(smp.ttft[s], 90) for s in STRATEGIES},
        "ttft_all_s": smp.ttft,
        "load_s": load_s, "barrier_load_s": barrier_load, "compute_s": compute_s,
        "overhead_s": overhead,
        "bound_s": bound, "model_overlap_s": model,
        "efficiency": efficiency(p50["barrier"], p50["overlap"], bound),
        "efficiency_paired": float(np.median(smp.paired)) if smp.paired else None,
        # against what per-layer overlap can reach for this profile, not the bound
        "efficiency_model": efficiency(p50["barrier"], p50["overlap"], model),
        "load_compute_ratio": load_s / compute_s if compute_s > 0 else None,
        "speedup": p50["barrier"] / p50["overlap"] if p50["overlap"] > 0 else None,
        "speedup_vs_recompute": p50["recompute"] / p50["overlap"] if p50["overlap"] > 0 else None,
        "overlap_slower_pct": 100.0 * (p50["overlap"] / p50["barrier"] - 1.0),
        "forward_start_s": {s: pct(smp.fstart[s], 50) for s in ("barrier", "overlap")},
        "overlap_wait_first_s": float(waits[0]),
        "overlap_wait_rest_s": float(waits[1:].sum()),
        "overlap_compute_s": float(np.median(np.asarray(smp.over_c), axis=0).sum()),
        "layer_load_s": [float(x) for x in a],
        "layer_compute_s": [float(x) for x in c],
        "overlap_layer_wait_s": [float(x) for x in waits],
        "restored_tokens": _single(smp.restored),
        "computed_tokens": _single(smp.computed),
        "expected_restored_tokens": pt.prefix,
        "restore_ok": not smp.fallbacks,
        "problems": smp.fallbacks[:5],
        "max_kl": smp.max_kl,
        "kl_ok": smp.max_kl <= KL_TOL,
        "machine_cores": {s: smp.machine[s].cores for s in STRATEGIES},
        "machine_cpus": max(b.cpus for b in smp.machine.values()) or None,
    }


# ---- repeated replays: intervals from paired per-request resampling ------------------
def _boot_index(sizes: Sequence[int], n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, sum(sizes)]`` indices into the concatenated groups, each
    row resampling every group within itself (a stratified bootstrap)."""
    rng = np.random.default_rng(seed)
    cols, start = [], 0
    for n in sizes:
        cols.append(start + rng.integers(0, n, size=(n_boot, n)))
        start += n
    return np.concatenate(cols, axis=1)


def _groups(groups: Sequence[Sequence[float]]) -> tuple[np.ndarray, list[int]]:
    sizes = [len(g) for g in groups]
    if not sizes or min(sizes) < 1:
        raise ValueError("need at least one non-empty group of samples")
    return np.concatenate([np.asarray(g, dtype=np.float64) for g in groups]), sizes


def percentile_ci(groups: Sequence[Sequence[float]], q: float, *, n_boot: int = 2000,
                  seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Percentile ``q`` of the pooled groups (one group per repeat) and its
    ``level`` bootstrap interval (resampling within each group)."""
    x, sizes = _groups(groups)
    boot = np.percentile(x[_boot_index(sizes, n_boot, seed)], q, axis=1)
    a = (1 - level) / 2
    return (float(np.percentile(x, q)), float(np.quantile(boot, a)),
            float(np.quantile(boot, 1 - a)))


def paired_ratio_ci(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]], q: float,
                    *, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """``pct(num, q) / pct(den, q)`` over the pooled groups and its ``level``
    bootstrap interval. Group ``g`` of both holds the same requests in the
    same order (one repeat, two configurations): each bootstrap row draws
    the same requests for both (paired), within each group. ``ValueError``
    for groups that do not pair up or a percentile of 0 in ``den``."""
    a, sizes = _groups(num)
    b, sizes_b = _groups(den)
    if sizes != sizes_b:
        raise ValueError(f"paired groups need equal sizes, got {sizes} and {sizes_b}")
    point_den = float(np.percentile(b, q))
    if point_den <= 0:
        raise ValueError("the denominator's percentile is not positive")
    idx = _boot_index(sizes, n_boot, seed)
    ratios = np.percentile(a[idx], q, axis=1) / np.percentile(b[idx], q, axis=1)
    lo = (1 - level) / 2
    return (float(np.percentile(a, q)) / point_den, float(np.quantile(ratios, lo)),
            float(np.quantile(ratios, 1 - lo)))


def verdict(lo: float, hi: float, one: float = 1.0) -> str:
    """How a ratio's interval reads: "no measurable difference" when it
    spans ``one``, else "lower" or "higher"."""
    if lo <= one <= hi:
        return "no measurable difference"
    return "lower" if hi < one else "higher"
