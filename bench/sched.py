"""The scheduler alone: per-layer overlap with loads and computes that use no CPU.

``layerlift bench sched [--json PATH] [--markdown PATH] [--plot PATH]``. Each layer's load is a
timed wait of ``a_l`` on one shared wire (``EmulatedLink``: transfers queue
for it in the order they started) run by the real ``LoadScheduler`` on the
real ``CpuLane``
(the engine's defaults: ``max_in_flight=8``, ``stream_size=64``) and each
layer's compute a ``time.sleep(c_l)`` in a forward thread that first waits on
the real ``LayerReadiness`` for that layer. Nothing competes for the CPU, so
what separates the measured overlap from the recurrence model
``F_l = max(A_l, F_{l-1}) + c_l`` is the scheduler's own loss (issue,
hand-offs, wake-ups), not the contention of a 2-core machine.

The per-layer profile is a measured one (the TTFT harness's barrier run of
preset ``small``, P = 1024 on the emulated link; ``--profile`` takes another
point from a TTFT JSON), replayed with its loads scaled so that Σa/Σc is 1
(balanced), 0.5 and 2 (unbalanced). Efficiency =
``(T_barrier − T_overlap) / (T_barrier − model)`` with the model charged the
barrier's measured fixed overhead, as in the TTFT harness; ``eff strict``
charges the model nothing (the bare recurrence).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerlift.bench.args import BenchParser, int_at_least
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.bench.stats import efficiency, lower_bound, recurrence
from layerlift.overlap import CpuLane, LayerJob, LayerReadiness, LoadPolicy, LoadScheduler
from layerlift.overlap.link import EmulatedLink

__all__ = ["MEASURED_A_MS", "MEASURED_C_MS", "main", "run_profile"]

# bench/results/ttft_quick.json, emulated:0.1GB/s,10us, small, P = 1024: a_l and c_l (ms).
MEASURED_A_MS = [21.27, 5.19, 0.43, 5.2, 20.99, 5.2, 0.46, 5.18,
                 21.02, 5.19, 0.36, 5.27, 20.99, 5.21, 0.44, 5.18]  # fmt: skip
MEASURED_C_MS = [9.07, 4.11, 3.57, 4.19, 7.21, 4.01, 3.48, 4.36,
                 7.32, 4.68, 4.03, 4.41, 6.92, 4.68, 4.09, 3.97]  # fmt: skip
RATIOS = (1.0, 0.5, 2.0)


def _forward(readiness: LayerReadiness, c: Sequence[float]) -> float:
    for layer, c_l in enumerate(c):
        readiness.wait(layer)
        time.sleep(c_l)
    return time.perf_counter()


def _nothing() -> None:
    return None


async def _once(sched: LoadScheduler, a: Sequence[float], c: Sequence[float]) -> float:
    # One wire shared by every fetch (as a NIC is): a fetch occupies it for a_l from
    # when the previous one left it, so concurrent workers cannot load in parallel.
    wire = EmulatedLink(gbps=1.0)
    readiness = LayerReadiness(len(a), requests=frozenset({0}))
    jobs = [LayerJob(layer, wire.wrap(_nothing, round(a_l * 1e9)), 0, frozenset({0}))
            for layer, a_l in enumerate(a)]  # fmt: skip
    t0 = time.perf_counter()
    task = sched.start(jobs, readiness)
    end = await asyncio.to_thread(_forward, readiness, c)
    await task.done()
    return end - t0


async def run_profile(a: Sequence[float], c: Sequence[float], repeats: int) -> dict[str, Any]:
    """Barrier and overlap on profile (`a`, `c`) in seconds, alternating which runs first."""
    lane = CpuLane(max_workers=2)
    scheds = {
        "barrier": LoadScheduler(lane, LoadPolicy.BARRIER, max_in_flight=8, stream_size=64),
        "overlap": LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=8, stream_size=64),
    }
    times: dict[str, list[float]] = {"barrier": [], "overlap": []}
    try:
        await _once(scheds["overlap"], a, c)  # warm-up: threads, imports
        for rep in range(repeats):
            order = ("barrier", "overlap") if rep % 2 == 0 else ("overlap", "barrier")
            for name in order:
                times[name].append(await _once(scheds[name], a, c))
    finally:
        lane.close()
    t_b, t_o = statistics.median(times["barrier"]), statistics.median(times["overlap"])
    overhead = t_b - sum(a) - sum(c)
    model = overhead + recurrence(a, c)
    return {
        "load_s": sum(a), "compute_s": sum(c), "load_compute_ratio": sum(a) / sum(c),
        "barrier_s": t_b, "overlap_s": t_o, "overhead_s": overhead,
        "barrier_spread_s": [min(times["barrier"]), max(times["barrier"])],
        "overlap_spread_s": [min(times["overlap"]), max(times["overlap"])],
        "model_s": model, "bound_s": overhead + lower_bound(a, c),
        "efficiency_model": efficiency(t_b, t_o, model),
        "efficiency_bound": efficiency(t_b, t_o, overhead + lower_bound(a, c)),
        # strict: the model is not charged the barrier's overhead (timer overshoot,
        # hand-offs), so any of it that overlap also pays counts as loss
        "efficiency_strict": efficiency(t_b, t_o, recurrence(a, c)),
        "repeats": repeats,
    }  # fmt: skip


def _profile_from(path: str, index: int) -> tuple[list[float], list[float]]:
    point = json.loads(Path(path).read_text())["points"][index]
    return list(point["layer_load_s"]), list(point["layer_compute_s"])


def build_parser() -> argparse.ArgumentParser:
    ap = BenchParser("layerlift bench sched", __doc__, raw_description=True)
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="a `layerlift bench ttft --json` record to take the per-layer profile "
                         "from (default: the profile measured on the 2-core CPU machine)")
    ap.add_argument("--point", type=int_at_least(0), default=0,
                    help="index of the point in --profile")
    ap.add_argument("--repeats", type=int_at_least(1), default=9, help="repeats per profile")
    add_output_options(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.profile:
        try:
            a0, c = _profile_from(args.profile, args.point)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            ap.error(f"argument --profile: cannot take point {args.point} of {args.profile!r} "
                     f"({type(exc).__name__}: {exc}); give a `layerlift bench ttft --json` "
                     "record and a point index it has")
    else:
        a0, c = [x / 1e3 for x in MEASURED_A_MS], [x / 1e3 for x in MEASURED_C_MS]
    rows = []
    for target in RATIOS:
        scale = target * sum(c) / sum(a0)
        a = [x * scale for x in a0]
        rows.append(asyncio.run(run_profile(a, c, args.repeats)))
    print(f"{'a/c':>5} {'load ms':>8} {'compute ms':>10} {'barrier ms':>10} {'overlap ms':>10} "
          f"{'model ms':>8} {'bound ms':>8} {'eff model':>9} {'eff bound':>9} "
          f"{'eff strict':>10}")  # fmt: skip
    for r in rows:
        em, eb, es = r["efficiency_model"], r["efficiency_bound"], r["efficiency_strict"]
        print(f"{r['load_compute_ratio']:>5.2f} {1e3 * r['load_s']:>8.1f} "
              f"{1e3 * r['compute_s']:>10.1f} {1e3 * r['barrier_s']:>10.1f} "
              f"{1e3 * r['overlap_s']:>10.1f} {1e3 * r['model_s']:>8.1f} "
              f"{1e3 * r['bound_s']:>8.1f} {em if em is None else f'{em:.3f}':>9} "
              f"{eb if eb is None else f'{eb:.3f}':>9} "
              f"{es if es is None else f'{es:.3f}':>10}")  # fmt: skip
    write_outputs("sched", {"profiles": rows}, args, argv, render, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
