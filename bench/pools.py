"""Pool benchmark: allocator throughput, and admission under a shifting workload.

    layerlift bench pools [--json PATH] [--markdown PATH] [--plot PATH] [--requests N] [--seed S]

(1) ``alloc_ops_per_s``: alloc + free calls per second per sub-pool, for
    single pages and for 64-page requests, on a half-full pool.
(2) ``admitted_fraction``: the same request stream against a UnifiedKVPool and
    a StaticKVPool of equal bytes. Phase 1 is long, FULL-heavy requests (many
    FULL pages, the SWA window, one MAMBA slot); phase 2 short requests with
    many MAMBA checkpoint slots and relatively more SWA. Each request lives a
    random 0.5-1.5x ``--live`` arrivals, and at most 1.5x ``--live`` stay live
    (the oldest departs). A request counts as admitted when ``alloc_many``
    succeeds without freeing anything else first (the unified pool may move
    its float: that is its job); otherwise the oldest live requests are
    evicted until it fits. The static split is the fairest fixed one:
    proportional to the mean demand of the whole stream (``static_default``
    uses the library default, one typical request). ``by_total_mib`` repeats
    the comparison at other pool sizes.
Everything runs on the CPU; figures are from the allocator only.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Mapping

import numpy as np
import torch

from layerlift.bench.args import BenchParser, int_at_least
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.pools import Component, KVPool, ModelSpec, StaticKVPool, UnifiedKVPool

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
Demand = dict[Component, int]


def throughput(pool: KVPool, c: Component, batch: int, seconds: float = 0.4) -> float:
    """alloc + free calls per second for ``batch``-page requests of ``c``."""
    filler = pool.alloc(c, pool.capacity(c) // 4)  # a realistic, non-empty pool
    ops, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            pages = pool.alloc(c, batch)
            assert pages is not None
            pool.free(c, pages)
        ops += 100
    rate = ops / (time.perf_counter() - start)
    if filler is not None:
        pool.free(c, filler)
    return rate


def make_stream(spec: ModelSpec, n: int, seed: int) -> list[Demand]:
    """Phase 1 then phase 2, ``n`` requests each."""
    rng = random.Random(seed)
    window = spec.window_pages + 1
    stream: list[Demand] = []
    for _ in range(n):  # long documents: full attention dominates
        full = rng.randint(40, 80)
        stream.append({F: full, S: min(full, window), M: 1})
    for _ in range(n):  # short, branchy chats: many mamba checkpoints
        full = rng.randint(3, 8)
        stream.append({F: full, S: full, M: rng.randint(10, 24)})
    return stream


class Tracker:
    """Live requests' pages, rewritten on every move (as the tree would)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.live: dict[int, dict[Component, np.ndarray]] = {}  # id -> pages (insertion = age)
        pool.add_move_listener(self.on_move)

    def on_move(self, c: Component, old: torch.Tensor, new: torch.Tensor) -> None:
        remap = dict(zip(old.tolist(), new.tolist(), strict=True))
        for req in self.live.values():
            pages = req[c]
            if pages.size and any(int(p) in remap for p in pages):
                req[c] = np.array([remap.get(int(p), int(p)) for p in pages], dtype=np.int64)

    def admit(self, rid: int, demand: Mapping[Component, int]) -> bool:
        out = self.pool.alloc_many(demand)
        if out is None:
            return False
        self.live[rid] = {c: t.numpy().copy() for c, t in out.items()}
        return True

    def depart(self, rid: int | None = None) -> None:
        """Free request ``rid`` (default: the oldest live one)."""
        req = self.live.pop(next(iter(self.live)) if rid is None else rid)
        for c, pages in req.items():
            if pages.size:
                self.pool.free(c, torch.from_numpy(pages))


def admission(pool: KVPool, stream: list[Demand], live: int, seed: int) -> dict[str, float]:
    """Replay ``stream``: request i lives a random 0.5-1.5x ``live`` arrivals
    (at most 1.5x ``live`` requests are kept: the oldest departs). Returns the
    fraction admitted without evicting anything, overall and per phase."""
    rng = random.Random(seed)
    tracker = Tracker(pool)
    expiry: dict[int, int] = {}
    admitted, phase_admitted = 0, [0, 0]
    for i, demand in enumerate(stream):
        for rid in [r for r, t in expiry.items() if t <= i and r in tracker.live]:
            tracker.depart(rid)
        first_try = ok = tracker.admit(i, demand)
        while not ok and tracker.live:  # evict the oldest until it fits
            tracker.depart()
            ok = tracker.admit(i, demand)
        expiry[i] = i + rng.randint(live // 2, 3 * live // 2)
        if len(tracker.live) > 3 * live // 2:
            tracker.depart()
        admitted += first_try
        phase_admitted[i * 2 // len(stream)] += first_try
    pool.verify_byte_accounting()
    half = len(stream) / 2
    return {"all": admitted / len(stream), "phase1": phase_admitted[0] / half,
            "phase2": phase_admitted[1] / half}


def run(requests: int, seed: int, live: int) -> dict[str, object]:
    spec = ModelSpec.preset("tiny")
    total = 24 << 20
    rates: dict[str, dict[str, dict[str, float]]] = {}
    for name, pool in (("unified", UnifiedKVPool(spec, total)),
                       ("static", StaticKVPool(spec, total, fractions={F: 1, S: 1, M: 1}))):
        rates[name] = {c.value: {"single": throughput(pool, c, 1), "batch64": throughput(pool, c, 64)}
                       for c in Component}
    stream = make_stream(spec, requests, seed)
    mean = {c: sum(d[c] for d in stream) / len(stream) * spec.page_bytes(c) for c in Component}
    sweep: dict[str, dict[str, float]] = {}
    for mib in (16, 24, 32):
        u = admission(UnifiedKVPool(spec, mib << 20), stream, live, seed)["all"]
        st = admission(StaticKVPool(spec, mib << 20, fractions=mean), stream, live, seed)["all"]
        sweep[str(mib)] = {"unified": u, "static": st}
    results = {
        "unified": admission(UnifiedKVPool(spec, total), stream, live, seed),
        "static": admission(StaticKVPool(spec, total, fractions=mean), stream, live, seed),
        "static_default": admission(StaticKVPool(spec, total), stream, live, seed),
    }
    return {
        "admitted_fraction": {
            "unified": results["unified"]["all"],
            "static": results["static"]["all"],
            "ratio": results["unified"]["all"] / max(results["static"]["all"], 1e-9),
            "static_default": results["static_default"]["all"],
            "by_phase": {k: {p: v[p] for p in ("phase1", "phase2")} for k, v in results.items()},
            "by_total_mib": sweep,
        },
        "alloc_ops_per_s": rates,
        "config": {"preset": "tiny", "total_bytes": total, "requests_per_phase": requests,
                   "live_budget": live, "seed": seed,
                   "static_fractions": {c.value: v / sum(mean.values()) for c, v in mean.items()}},
    }


def build_parser() -> argparse.ArgumentParser:
    ap = BenchParser("layerlift bench pools", __doc__.split("\n\n")[0])
    add_output_options(ap)
    ap.add_argument("--requests", type=int_at_least(1), default=1000, help="requests per phase")
    ap.add_argument("--live", type=int_at_least(1), default=40, help="live request budget")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="request seed")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    out = run(args.requests, args.seed, args.live)
    out["wall_s"] = time.perf_counter() - start
    record = write_outputs("pools", out, args, argv, render, plot)
    print(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
