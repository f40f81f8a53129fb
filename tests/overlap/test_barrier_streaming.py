"""BARRIER on a streaming lane: the same single worker call as OVERLAP (a fair
baseline), nothing released before every layer landed, per-layer landing times kept,
and a failure mid-stream fails the right layers. Ordered by events."""

from __future__ import annotations

import asyncio

import pytest
from overlap_fakes import WAIT_S, FetchRecorder, ForwardThread, until

from layerlift.overlap import (
    CpuLane,
    LayerLoadCancelled,
    LayerLoadError,
    LayerReadiness,
    LoadPolicy,
    LoadScheduler,
)


async def test_barrier_streams_and_releases_only_at_the_end(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 4
    gate = rec.gate(k)
    readiness = LayerReadiness(6)
    sched = LoadScheduler(lane, LoadPolicy.BARRIER, max_in_flight=8, stream_size=64)
    assert sched.streaming
    task = sched.start(rec.jobs(6), readiness)
    fwd = ForwardThread(readiness, is_loaded=lambda layer: rec.ended[layer].is_set())
    fwd.start()
    await until(rec.started[k])
    assert rec.ended[k - 1].is_set()  # earlier layers landed ...
    assert fwd.layers_run() == [] and not readiness.done(0)  # ... and none was released
    gate.set()
    await task.done()
    await asyncio.to_thread(fwd.join, WAIT_S)
    assert fwd.layers_run() == list(range(6))
    assert fwd.ran[0][1] >= rec.last_end()  # the forward started after all landed
    assert rec.max_active == 1  # one worker call, layers one after another
    landed = {t.layer: t.landed for t in task.timings}
    assert [landed[i] < landed[i + 1] for i in range(5)] == [True] * 5  # per-layer times


async def test_barrier_stream_failure_fails_the_layer_and_the_rest(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 2
    cause = OSError("ranged read failed")
    rec.fail(k, cause)
    readiness = LayerReadiness(5)
    sched = LoadScheduler(lane, LoadPolicy.BARRIER, max_in_flight=8, stream_size=64)
    task = sched.start(rec.jobs(5), readiness)
    await task.done()  # nothing escapes the task
    for layer in range(k):
        readiness.wait(layer, 0.01)
    with pytest.raises(LayerLoadError) as info:
        readiness.wait(k, 0.01)
    assert info.value.cause is cause
    with pytest.raises((LayerLoadError, LayerLoadCancelled)):
        readiness.wait(k + 1, 0.01)
    assert not rec.started[k + 1].is_set()  # the stream stopped at the failure
