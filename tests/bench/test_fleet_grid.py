"""The fleet grid's cells, and its report on a hand-made repeated record:
paired intervals, the noise floor, targets met only with their interval."""

from __future__ import annotations

from typing import Any

import numpy as np

from layerlift.bench.fleet_grid import cells, render_fidelity
from layerlift.bench.fleet_report import comparisons, noise_floor, render, targets


def test_cells_cut_the_routers_by_fleet_size() -> None:
    got = cells([1, 2, 8], ["round-robin", "restore-aware"], ["round-robin", "prefix"])
    assert [(n, r) for n, r, _ in got] == [(1, "round-robin"), (2, "round-robin"),
                                           (2, "restore-aware"), (8, "round-robin"),
                                           (8, "prefix")]
    assert [p.count(",") + 1 for _, _, p in got] == [5, 3, 3, 5, 1]
    assert all(p.count(",") == 4 for _, _, p in cells([1, 2], ["prefix"], ["prefix"], full=True))


def row(n: int, router: str, seed: int, scale: dict[str, float],
        restored: int = 0) -> dict[str, Any]:
    """One replay record: every policy's TTFTs are ``scale[policy]`` times
    the seed's base TTFTs (so every paired ratio is exact)."""
    base = np.random.default_rng(seed).exponential(0.5, 30) + 0.01
    pols, details, ttft = {}, {}, {}
    for pol, k in scale.items():
        xs = (base * k).tolist()
        ttft[pol] = xs
        pols[pol] = {"ttft_p50_s": float(np.median(xs)), "within_slo_fraction": 0.5,
                     "tokens": {"device_hit": 50, "restored": restored, "computed": 50},
                     "offered_tokens_per_s": 100.0, "prompt_tokens_per_s": 100.0,
                     "served_s": 10.0}
        details[pol] = {"loop_lag": {"arrival_p99_s": 0.001}, "max_kl": 0.0,
                        "host_cost": {"read_host_s": 0.3},
                        "forward_clock": {"modeled_s": 5.0, "host_s": 0.03}}
    return {"fleet": {"instances": n, "router": router, "slo_ms": 500.0},
            "scaling": {"seed": seed, "requests": 30},
            "setting": {"profile": "p", "links": ["emulated:1,10"], "token_scale": 64},
            "policies": pols, "details": details, "ttft_s": ttft}


def record() -> dict[str, Any]:
    settings = {}
    for name in ("gpu-rdma", "gpu-tcp25"):
        rows = []
        for seed in (0, 1, 2):
            rows += [row(8, "round-robin", seed, {"device-only": 1.0, "barrier": 1.0,
                                                   "overlap": 0.8, "overlap+prefetch": 0.88,
                                                   "overlap+auto": 0.82}, restored=40),
                     row(8, "prefix", seed, {"overlap": 0.5}),
                     row(8, "restore-aware", seed, {"overlap": 0.6})]
        settings[name] = rows
    return {"settings": settings, "meta": {"command": "layerlift bench fleet-grid",
                                           "wall_s": 60.0, "cpus": 2,
                                           "load_average": {"start": [1.0] * 3,
                                                            "end": [1.5] * 3}}}


def test_paired_comparisons_and_the_noise_floor() -> None:
    rec = record()
    comps = {(c["setting"], c["where"], c["what"], c["q"]): c for c in comparisons(rec)}
    ov = comps[("gpu-tcp25", "8x round-robin", "overlap / barrier", 90)]
    assert abs(ov["value"] - 0.8) < 1e-9 and abs(ov["hi"] - 0.8) < 1e-9
    assert ov["verdict"] == "lower" and ov["seeds"] == 3
    ra = comps[("gpu-rdma", "8x overlap", "restore-aware / prefix", 50)]
    assert abs(ra["value"] - 1.2) < 1e-9 and ra["verdict"] == "higher"
    noise = noise_floor(rec)
    assert noise and all(e["verdict"] == "no measurable difference" for e in noise)


def test_targets_need_their_whole_interval() -> None:
    got = {(c["target"], c["where"]): c for c in targets(record())}
    assert got[("restored >= 25 % of prompt tokens (largest fleet, round-robin, overlap)",
                "gpu-tcp25")]["met"] == "yes"  # 40 of 140
    assert got[("overlap p90 <= 0.9 x barrier p90", "gpu-tcp25 8x round-robin")]["met"] == "yes"
    assert got[("overlap+prefetch p90 <= overlap p90", "gpu-tcp25 8x round-robin")]["met"] == "no"
    assert got[("overlap+auto p90 <= 1.05 x overlap p90", "gpu-tcp25 8x round-robin")][
        "met"] == "yes"
    assert got[("restore-aware p90 <= 1 x prefix p90", "gpu-tcp25 8x overlap")]["met"] == "no"
    assert got[("restore-aware p90 <= 0.8 x round-robin p90", "gpu-tcp25 8x overlap")][
        "met"] == "yes"
    text = render(record())
    assert "## Noise floor: identical configurations" in text
    assert "no measurable difference" in text and "**no**" in text
    assert "checks met with their whole interval." in text
    assert "load average (1 min) at start 1.00, end 1.50 on 2 CPUs" in text
    assert "0.80 [0.80, 0.80]" in text  # overlap / barrier in the setting table


def test_fidelity_is_reported_whole_with_its_scope() -> None:
    def rec(p50: dict[str, float]) -> dict[str, Any]:
        return {"meta": {"command": "c"}, "scaling": {"seed": 0},
                "setting": {"token_scale": 1, "profile": "cpu-measured:tiny"},
                "policies": {k: {"ttft_p50_s": v, "ttft_p90_s": 2 * v,
                                 "tokens": {"device_hit": 1, "restored": 1, "computed": 1}}
                             for k, v in p50.items()}}
    text = render_fidelity(rec({"a": 1.0, "b": 1.0}), rec({"a": 0.5, "b": 1.1}))
    assert "p50: simulated minus real from -50 % to +10 %" in text
    assert "within 15 %: 1 of 2" in text
    assert "one instance, token scale 1" in text
