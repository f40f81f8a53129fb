"""The fleet grid's cells and its target checks, on a hand-made record."""

from __future__ import annotations

from typing import Any

from layerlift.bench.fleet_grid import cells, render_targets, targets


def test_cells_cut_the_routers_by_fleet_size() -> None:
    got = cells([1, 2, 8], ["round-robin", "restore-aware"], ["round-robin", "prefix"])
    assert [(n, r) for n, r, _ in got] == [(1, "round-robin"), (2, "round-robin"),
                                           (2, "restore-aware"), (8, "round-robin"),
                                           (8, "prefix")]
    assert [p.count(",") + 1 for _, _, p in got] == [5, 3, 3, 5, 1]
    assert all(p.count(",") == 4 for _, _, p in cells([1, 2], ["prefix"], ["prefix"], full=True))


def cell(n: int, router: str, p90: dict[str, float], restored: int = 0) -> dict[str, Any]:
    pols = {pol: {"ttft_p90_s": v, "tokens": {"device_hit": 50, "restored": restored,
                                              "computed": 50}} for pol, v in p90.items()}
    return {"fleet": {"instances": n, "router": router}, "policies": pols}


def test_targets_are_checked_against_the_numbers() -> None:
    rows = [
        cell(8, "round-robin", {"barrier": 1.0, "overlap": 0.8, "overlap+prefetch": 0.85,
                                "device-only": 0.7, "overlap+auto": 0.72}, restored=40),
        cell(8, "prefix", {"overlap": 0.5}),
        cell(8, "restore-aware", {"overlap": 0.6}),
    ]
    got = {(c["target"], c["where"]): c for c in targets({"settings": {"gpu-tcp25": rows}})}
    assert got[("restored >= 25 % of prompt tokens (largest fleet, round-robin, overlap)",
                "gpu-tcp25")]["met"]  # 40 of 140
    ov = got[("overlap p90 <= 0.9 x barrier p90", "gpu-tcp25 8x round-robin")]
    assert ov["value"] == 0.8 and ov["met"]
    pf = got[("overlap+prefetch p90 <= overlap p90", "gpu-tcp25 8x round-robin")]
    assert not pf["met"]
    auto = got[("overlap+auto p90 <= 1.05 x min(overlap, device-only) p90",
                "gpu-tcp25 8x round-robin")]
    assert abs(auto["value"] - 0.72 / 0.7) < 1e-9 and auto["met"]
    assert not got[("restore-aware p90 <= prefix p90", "gpu-tcp25 8x overlap")]["met"]
    assert got[("restore-aware p90 <= 0.8 x round-robin p90", "gpu-tcp25 8x overlap")]["met"]
    text = "\n".join(render_targets(list(got.values())))
    assert "**no**" in text and f"of {len(got)} checks met" in text
