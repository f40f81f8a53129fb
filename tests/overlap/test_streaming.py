"""OVERLAP with streaming units (CpuLane, stream_size > 1): several layers per worker
call, each released as soon as its own fetch returned. Ordered by events."""

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


def _sched(lane: CpuLane, max_in_flight: int = 1) -> LoadScheduler:
    return LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=max_in_flight, stream_size=4)


async def test_each_layer_of_a_unit_is_released_on_its_own(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 2
    gate = rec.gate(k)  # layer 2 sits in the middle of the first unit (layers 0-3)
    readiness = LayerReadiness(6)
    task = _sched(lane).start(rec.jobs(6), readiness)
    fwd = ForwardThread(readiness, is_loaded=lambda layer: rec.ended[layer].is_set())
    fwd.start()
    await until(fwd.ran_event[k - 1])
    assert fwd.layers_run() == [0, 1]
    assert not readiness.done(k) and rec.started_layers() == {0, 1, 2}
    gate.set()
    await task.done()
    await asyncio.to_thread(fwd.join, WAIT_S)
    assert fwd.layers_run() == list(range(6))
    assert fwd.early == []
    assert len({t.issued for t in task.timings}) == 2  # two worker calls for six layers


async def test_failure_mid_unit_stops_the_unit(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 1
    cause = OSError("ranged read failed")
    rec.fail(k, cause, only=frozenset({"a"}))
    readiness = LayerReadiness(6, requests=frozenset({"a", "b"}))
    jobs = rec.jobs(6, (frozenset({"a"}), frozenset({"b"})))
    task = _sched(lane).start(jobs, readiness)
    await task.done()
    readiness.wait(0, 0.01)
    with pytest.raises(LayerLoadError) as info:
        readiness.wait(k, 0.01)
    assert info.value.cause is cause and info.value.requests == frozenset({"a"})
    readiness.wait(k, 0.01, requests=frozenset({"b"}))  # b's job of the layer still ran
    with pytest.raises(LayerLoadCancelled):
        readiness.wait(k + 1, 0.01, requests=frozenset({"b"}))
    assert rec.started_layers() == {0, 1}  # the rest of the unit never ran


async def test_cancel_takes_effect_at_the_next_layer(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(1)
    readiness = LayerReadiness(6)
    task = _sched(lane).start(rec.jobs(6), readiness)
    await until(rec.started[1])
    task.cancel()
    for layer in (4, 5):  # the unissued unit fails at once
        assert readiness.failed(layer)
    gate.set()
    await asyncio.wait_for(task.wait_quiescent(), WAIT_S)
    assert rec.active == 0 and rec.started_layers() == {0, 1}
    assert readiness.done(1)  # the layer in flight completed normally
    for layer in (2, 3):  # the rest of the running unit was never fetched
        with pytest.raises(LayerLoadCancelled):
            readiness.wait(layer, 0.01)


async def test_a_later_units_failure_keeps_the_earlier_layers(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(1)  # unit A (layers 0-3) is held at layer 1 ...
    cause = OSError("ranged read failed")
    rec.fail(4, cause)  # ... while unit B (layers 4-7) fails at its first layer
    readiness = LayerReadiness(8)
    task = _sched(lane, max_in_flight=2).start(rec.jobs(8), readiness)
    await until(rec.ended[4])
    gate.set()
    await task.done()
    for layer in range(4):  # earlier layers land: a forward may still use them
        readiness.wait(layer, 0.01)
    with pytest.raises(LayerLoadError) as info:
        readiness.wait(4, 0.01)
    assert info.value.cause is cause
