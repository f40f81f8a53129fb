"""The scheduler-alone benchmark: timed waits in, the model's efficiency out."""

from __future__ import annotations

from layerlift.bench.sched import run_profile
from layerlift.bench.stats import recurrence


async def test_overlap_reaches_the_model_when_nothing_uses_the_cpu() -> None:
    a = [0.004, 0.002, 0.004, 0.002, 0.004, 0.002]
    c = [0.003] * 6
    out = await run_profile(a, c, repeats=3)
    assert out["model_s"] - out["overhead_s"] == recurrence(a, c)
    # barrier pays Σa + Σc; the overlap must take most of the room (a broken
    # scheduler that serialises loads and computes gets ~0 here)
    assert out["barrier_s"] >= sum(a) + sum(c)
    assert out["efficiency_model"] is not None and out["efficiency_model"] > 0.7, out
