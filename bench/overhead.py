"""Per-layer scheduling overhead of the overlap machinery (`layerlift bench overhead`).

What the forward loses per layer to readiness and scheduling, with zero-byte fetches and
a trivial layer (a 16x16 matmul), for 32/64 layers and batch 1/16:

* `wait_done`:   every layer already done; the forward calls `wait(l)` on one readiness
                 (batch = number of requests of that readiness).
* `wait_deps`:   every layer already done; the forward waits on a `CombinedReadiness` of
                 `batch` readiness objects (its own load + loads of other requests).
* `end_to_end`:  a `LoadScheduler` (CpuLane, OVERLAP, max_in_flight=8, stream_size=64:
                 the engine's defaults) issues one zero-byte job per layer carrying all
                 `batch` requests (as the engine does: one store call per layer for the
                 whole batch) while the forward, in a worker thread, waits on each layer:
                 includes the thread hand-offs and event-loop wake-ups.
* `per_request`: the same with `batch` separate jobs per layer (a stress case the
                 engine never issues; reported, not part of `per_layer_overhead_us`).

Overhead per layer = (median forward time with waits - median without) / layers. The
forward runs in a worker thread in both cases (the same hand-off cost on both sides).
`end_to_end` with zero-byte fetches measures the issue pipeline's throughput (one
loop -> worker -> loop round trip per unit, `max_in_flight` of them overlapped): on a
machine where a thread wake-up costs ~50 us it is bounded by OS wake-ups, not by
readiness; it is hidden whenever a layer's load or compute takes longer than that.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import torch

from layerlift.bench.args import BenchParser, int_at_least
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.overlap import (
    CombinedReadiness,
    CpuLane,
    LayerJob,
    LayerReadiness,
    LoadPolicy,
    LoadScheduler,
    ReadinessView,
)

REPS = 30
X, W = torch.ones(16, 16), torch.ones(16, 16)


def forward(num_layers: int, gate: ReadinessView | None) -> float:
    """Run the trivial forward; return the perf_counter time at which it finished."""
    x = X
    for layer in range(num_layers):
        if gate is not None:
            gate.wait(layer)
        x = torch.mm(x, W) * 0.0625
    return time.perf_counter()


def _noop() -> None:
    return None


async def timed_forward(num_layers: int, gate: ReadinessView | None) -> float:
    t0 = time.perf_counter()
    return await asyncio.to_thread(forward, num_layers, gate) - t0


def done_readiness(num_layers: int, batch: int) -> LayerReadiness:
    r = LayerReadiness(num_layers, requests=frozenset(range(batch)))
    for layer in range(num_layers):
        r.mark_done(layer)
    return r


async def end_to_end(
    sched: LoadScheduler, num_layers: int, batch: int, per_request: bool = False
) -> float:
    readiness = LayerReadiness(num_layers, requests=frozenset(range(batch)))
    if per_request:
        jobs = [
            LayerJob(layer, _noop, 0, frozenset({req}))
            for layer in range(num_layers)
            for req in range(batch)
        ]
    else:
        jobs = [LayerJob(layer, _noop, 0, frozenset(range(batch))) for layer in range(num_layers)]
    t0 = time.perf_counter()
    task = sched.start(jobs, readiness)
    end = await asyncio.to_thread(forward, num_layers, readiness)
    await task.done()
    return end - t0


async def median_of(fn: Callable[[], Awaitable[float]]) -> float:
    samples = [await fn() for _ in range(REPS)]
    return statistics.median(samples)


async def run_grid(max_in_flight: int, stream_size: int) -> list[dict[str, Any]]:
    lane = CpuLane(max_workers=2)
    sched = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=max_in_flight,
                          stream_size=stream_size)
    rows: list[dict[str, Any]] = []
    try:
        for num_layers in (32, 64):
            for batch in (1, 16):
                base = await median_of(partial(timed_forward, num_layers, None))
                single = done_readiness(num_layers, batch)
                deps = CombinedReadiness([done_readiness(num_layers, 1) for _ in range(batch)])
                cases: dict[str, Callable[[], Awaitable[float]]] = {
                    "wait_done": partial(timed_forward, num_layers, single),
                    "wait_deps": partial(timed_forward, num_layers, deps),
                    "end_to_end": partial(end_to_end, sched, num_layers, batch),
                    "per_request": partial(end_to_end, sched, num_layers, batch, True),
                }
                for mode, fn in cases.items():
                    with_waits = await median_of(fn)
                    rows.append(
                        {
                            "layers": num_layers,
                            "batch": batch,
                            "mode": mode,
                            "forward_without_us": round(base * 1e6, 1),
                            "forward_with_us": round(with_waits * 1e6, 1),
                            "per_layer_overhead_us": round(
                                (with_waits - base) / num_layers * 1e6, 2
                            ),
                        }
                    )
    finally:
        lane.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = BenchParser("layerlift bench overhead", __doc__.splitlines()[0])
    add_output_options(parser)
    parser.add_argument("--max-in-flight", type=int_at_least(1), default=8,
                        help="end_to_end scheduler bound (default: the engine's, 8)")
    parser.add_argument("--stream-size", type=int_at_least(1), default=64,
                        help="layers per worker call (default: the engine's, 64; 1 = one "
                             "hand-off per layer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    rows = asyncio.run(run_grid(args.max_in_flight, args.stream_size))
    print(
        f"{'layers':>6} {'batch':>5} {'mode':<11} {'without us':>11} {'with us':>10} {'us/layer':>9}"
    )
    for r in rows:
        print(
            f"{r['layers']:>6} {r['batch']:>5} {r['mode']:<11} {r['forward_without_us']:>11} "
            f"{r['forward_with_us']:>10} {r['per_layer_overhead_us']:>9}"
        )
    worst = max(r["per_layer_overhead_us"] for r in rows if r["mode"] != "per_request")
    wait_worst = max(r["per_layer_overhead_us"] for r in rows if r["mode"].startswith("wait"))
    stress = max(r["per_layer_overhead_us"] for r in rows if r["mode"] == "per_request")
    print(f"worst per-layer overhead: {worst} us over the grid (target < 50 us)")
    print(f"worst per-layer wait overhead (data already landed): {wait_worst} us")
    print(f"stress case, one job per request per layer: {stress} us")
    out = {"grid": rows, "per_layer_overhead_us": worst, "wait_overhead_us": wait_worst,
           "per_request_jobs_overhead_us": stress,
           "max_in_flight": args.max_in_flight, "stream_size": args.stream_size}
    write_outputs("overhead", out, args, argv, render, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
