"""LoadScheduler on CpuLane: policies, failure, cancellation, bounds. Ordered by events."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from overlap_fakes import WAIT_S, FetchRecorder, ForwardThread, until

from layerlift.overlap import (
    CpuLane,
    LayerJob,
    LayerLoadCancelled,
    LayerLoadError,
    LayerReadiness,
    LayerWaitTimeout,
    LoadPolicy,
    LoadScheduler,
)


async def test_overlap_runs_earlier_layers_while_layer_k_is_blocked(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 3
    gate = rec.gate(k)
    readiness = LayerReadiness(6)
    task = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=2).start(rec.jobs(6), readiness)
    fwd = ForwardThread(readiness, is_loaded=lambda layer: rec.ended[layer].is_set())
    fwd.start()
    await until(fwd.ran_event[k - 1])
    assert fwd.layers_run() == [0, 1, 2]
    assert not rec.ended[k].is_set() and not readiness.done(k)
    gate.set()
    await task.done()
    await asyncio.to_thread(fwd.join, WAIT_S)
    assert fwd.layers_run() == list(range(6))
    assert fwd.early == []  # no layer ran before its fetch completed
    assert sorted(t.layer for t in task.timings) == list(range(6))


async def test_barrier_runs_nothing_before_every_fetch_completed(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 3
    gate = rec.gate(k)
    readiness = LayerReadiness(6)
    task = LoadScheduler(lane, LoadPolicy.BARRIER, max_in_flight=2).start(rec.jobs(6), readiness)
    fwd = ForwardThread(readiness, is_loaded=lambda layer: rec.ended[layer].is_set())
    fwd.start()
    await until(rec.started[k])
    await until(rec.ended[k - 1])
    assert fwd.layers_run() == [] and not readiness.done(0)
    gate.set()
    await task.done()
    await asyncio.to_thread(fwd.join, WAIT_S)
    assert fwd.layers_run() == list(range(6))
    first_forward_layer = fwd.ran[0][1]
    assert first_forward_layer >= rec.last_end()  # the forward started after all landed


async def test_failure_at_layer_k_surfaces_at_wait_k(lane: CpuLane) -> None:
    rec, k = FetchRecorder(), 2
    cause = OSError("ranged read failed")
    rec.fail(k, cause, only=frozenset({"a"}))
    readiness = LayerReadiness(5, requests=frozenset({"a", "b"}))
    jobs = rec.jobs(5, (frozenset({"a"}), frozenset({"b"})))
    task = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=1).start(jobs, readiness)
    await task.done()  # finishes; nothing escapes
    for layer in range(k):
        readiness.wait(layer, 0.01)
    with pytest.raises(LayerLoadError) as info:
        readiness.wait(k, 0.01)
    assert info.value.layer == k and info.value.cause is cause
    assert info.value.requests == frozenset({"a"})
    readiness.wait(k, 0.01, requests=frozenset({"b"}))  # b's job of layer k landed
    with pytest.raises(LayerLoadError):
        readiness.wait(k + 1, 0.01, requests=frozenset({"a"}))
    # Issuing stopped at the failure: later layers were never fetched, for anyone.
    with pytest.raises(LayerLoadCancelled) as later:
        readiness.wait(k + 1, 0.01, requests=frozenset({"b"}))
    assert later.value.cause is cause
    assert rec.started_layers() == {0, 1, 2}
    assert readiness.failed_requests() == frozenset({"a", "b"})
    assert [t.failed for t in sorted(task.timings, key=lambda t: t.layer)] == [False, False, True]


async def test_cancel_while_layer_1_in_flight(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(1)
    readiness = LayerReadiness(6)
    task = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=1).start(rec.jobs(6), readiness)
    await until(rec.started[1])
    task.cancel()
    for layer in range(2, 6):  # not issued: failed at once, for everyone
        assert readiness.failed(layer)
        with pytest.raises(LayerLoadCancelled):
            readiness.wait(layer, 0.01)
    quiescent = asyncio.create_task(task.wait_quiescent())
    finished, _ = await asyncio.wait([quiescent], timeout=0.05)
    assert not finished and rec.active == 1  # layer 1's fetch still writes
    gate.set()
    await asyncio.wait_for(quiescent, WAIT_S)
    assert rec.active == 0 and rec.ended[1].is_set()
    assert rec.started_layers() == {0, 1}  # unissued fetches never ran
    assert readiness.done(1)  # the in-flight layer completed normally
    task.cancel()  # idempotent


async def test_cancel_right_after_start(lane: CpuLane) -> None:
    rec = FetchRecorder()
    readiness = LayerReadiness(3)
    task = LoadScheduler(lane, max_in_flight=1).start(rec.jobs(3), readiness)
    task.cancel()  # start() issued layer 0 synchronously; layers 1, 2 never run
    await task.wait_quiescent()
    assert rec.started_layers() == {0} and readiness.done(0)
    assert readiness.failed(1) and readiness.failed(2) and readiness.settled()


async def test_ready_and_wait_timeout_with_a_blocked_layer(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(2)
    readiness = LayerReadiness(4)
    task = LoadScheduler(lane, max_in_flight=2).start(rec.jobs(4), readiness)
    await asyncio.wait_for(readiness.ready(1), WAIT_S)
    await until(rec.started[2])
    with pytest.raises(LayerWaitTimeout):
        await asyncio.to_thread(readiness.wait, 2, 0.02)
    pending = asyncio.create_task(readiness.ready(2))
    gate.set()
    await asyncio.wait_for(pending, WAIT_S)
    await task.done()
    assert readiness.all_done()


async def test_groups_mark_a_group_together(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(1)
    readiness = LayerReadiness(8)
    sched = LoadScheduler(lane, LoadPolicy.GROUPS, max_in_flight=1, group_size=4)
    task = sched.start(rec.jobs(8), readiness)
    await until(rec.started[1])
    assert rec.ended[0].is_set() and not readiness.done(0)  # landed, but its group has not
    gate.set()
    await task.done()
    assert readiness.all_done()
    issued = {t.layer: t.issued for t in task.timings}
    assert len({issued[i] for i in range(4)}) == 1 and len({issued[i] for i in range(4, 8)}) == 1
    assert issued[0] < issued[4]


async def test_max_in_flight_bound_is_respected(lane: CpuLane) -> None:
    rec = FetchRecorder()
    gates = [rec.gate(layer) for layer in range(8)]
    readiness = LayerReadiness(8)
    task = LoadScheduler(lane, max_in_flight=2).start(rec.jobs(8), readiness)
    await until(rec.started[1])
    assert not await asyncio.to_thread(rec.started[2].wait, 0.05)  # bound reached: no third
    for gate in gates:
        gate.set()
    await task.done()
    assert rec.max_active == 2 and readiness.all_done()


async def test_jobs_are_read_at_issue_time_and_bytes_land(lane: CpuLane) -> None:
    src = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
    dst = np.zeros_like(src)
    jobs = [LayerJob(layer, lambda: None, 16) for layer in range(4)]
    for layer, job in enumerate(jobs):  # engine trims/replaces before issue: this one wins
        job.fetch = lambda layer=layer: np.copyto(dst[layer], src[layer])
    readiness = LayerReadiness(5)  # layer 4 has no job: nothing to load, ready at once
    task = LoadScheduler(lane).start(jobs, readiness)
    await task.done()
    assert readiness.all_done() and np.array_equal(dst, src)
    assert sum(t.nbytes for t in task.timings) == 64


async def test_start_validates() -> None:
    lane = CpuLane(1)
    with pytest.raises(ValueError, match="layer 3"):
        LoadScheduler(lane).start([LayerJob(3, lambda: None)], LayerReadiness(2))
    with pytest.raises(ValueError, match="max_in_flight"):
        LoadScheduler(lane, max_in_flight=0)
    lane.close()
