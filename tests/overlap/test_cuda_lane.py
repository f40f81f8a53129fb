"""The key scheduler tests on CudaLane: H2D on a load stream, events, device_done.

Each runs on the simulated device (streams that really run late, CI) and, where
a GPU is present, on CUDA with both completion mechanisms."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from overlap_fakes import WAIT_S, FetchRecorder, ForwardThread, until

from layerlift.overlap import (
    Completion,
    CudaLane,
    LayerJob,
    LayerLoadCancelled,
    LayerLoadError,
    LayerReadiness,
    LoadPolicy,
    LoadScheduler,
)
from layerlift.testing.simdevice import SimDevice

NUM_LAYERS, ELEMS = 6, 1 << 16

_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(params=[
    pytest.param("sim0", id="sim-seed0"),
    pytest.param("sim1", id="sim-seed1"),
    pytest.param(Completion.AUTO, id="cuda-auto", marks=[pytest.mark.gpu, _NO_GPU]),
    pytest.param(Completion.WATCHER, id="cuda-watcher", marks=[pytest.mark.gpu, _NO_GPU]),
])
async def lane(request: pytest.FixtureRequest) -> AsyncIterator[CudaLane]:
    if isinstance(request.param, str):
        sim = SimDevice(seed=int(request.param[-1]), max_delay_s=0.003)
        lane = CudaLane(sim, max_workers=2)
        yield lane
        lane.close()
        sim.close()
        return
    lane = CudaLane(max_workers=2, completion=request.param)
    yield lane
    lane.close()


def h2d_jobs(lane: CudaLane, rec: FetchRecorder) -> tuple[list[LayerJob], torch.Tensor]:
    """One job per layer: the recorder's fetch, then fill staging with `layer + 1`."""
    dst = torch.zeros(NUM_LAYERS, ELEMS, dtype=torch.uint8, device=lane.device.torch_device)
    jobs = []
    for layer in range(NUM_LAYERS):
        staging = lane.alloc_staging(ELEMS)
        record = rec.fetch_fn(layer, frozenset())

        def fetch(staging: torch.Tensor = staging, layer: int = layer, record=record) -> None:  # type: ignore[no-untyped-def]
            record()
            staging.fill_(layer + 1)

        jobs.append(LayerJob(layer, fetch, ELEMS, frozenset(), [(staging, dst[layer])]))
    return jobs, dst


def check_forward(lane: CudaLane, readiness: LayerReadiness, dst: torch.Tensor,
                  out: list[int]) -> None:
    """The forward: wait(l) (stream wait, no host sync), then read layer l on the
    device, on the device's default stream as the engine's forward does."""
    device = lane.device
    with device.use() as stream:
        sums = []
        for layer in range(readiness.num_layers):
            readiness.wait(layer, WAIT_S, stream=stream)
            sums.append(dst[layer].to(torch.int64).sum())
        done = device.event()
        done.record(stream)
        done.synchronize()
    out.extend(int(s.item()) // ELEMS for s in sums)


async def test_overlap_on_cuda_lands_bytes_and_runs_early_layers(lane: CudaLane) -> None:
    rec, k = FetchRecorder(), 3
    gate = rec.gate(k)
    jobs, dst = h2d_jobs(lane, rec)
    readiness = LayerReadiness(NUM_LAYERS)
    task = LoadScheduler(lane, LoadPolicy.OVERLAP).start(jobs, readiness)
    fwd = ForwardThread(readiness, is_loaded=lambda layer: rec.ended[layer].is_set())
    fwd.start()
    await until(fwd.ran_event[k - 1])
    assert not rec.ended[k].is_set() and not readiness.done(k)
    gate.set()
    await task.done()
    await asyncio.to_thread(fwd.join, WAIT_S)
    assert fwd.early == []
    values: list[int] = []
    await asyncio.to_thread(check_forward, lane, readiness, dst, values)
    assert values == [layer + 1 for layer in range(NUM_LAYERS)]
    for layer in range(NUM_LAYERS):
        await asyncio.wait_for(readiness.ready(layer), WAIT_S)  # landed on the device
    assert all(t.device_done is not None for t in task.timings)


async def test_barrier_on_cuda(lane: CudaLane) -> None:
    rec, k = FetchRecorder(), 2
    gate = rec.gate(k)
    jobs, dst = h2d_jobs(lane, rec)
    readiness = LayerReadiness(NUM_LAYERS)
    task = LoadScheduler(lane, LoadPolicy.BARRIER).start(jobs, readiness)
    await until(rec.started[k])
    assert not readiness.done(0)
    gate.set()
    await task.done()
    values: list[int] = []
    await asyncio.to_thread(check_forward, lane, readiness, dst, values)
    assert values == [layer + 1 for layer in range(NUM_LAYERS)]


async def test_failure_on_cuda(lane: CudaLane) -> None:
    rec, k = FetchRecorder(), 2
    cause = OSError("ranged read failed")
    rec.fail(k, cause)
    jobs, _ = h2d_jobs(lane, rec)
    readiness = LayerReadiness(NUM_LAYERS, requests=frozenset({"a"}))
    task = LoadScheduler(lane, max_in_flight=1).start(jobs, readiness)
    await task.done()
    readiness.wait(k - 1, 0.01)
    with pytest.raises(LayerLoadError) as info:
        readiness.wait(k, 0.01)
    assert info.value.cause is cause


async def test_cancel_on_cuda_is_quiescent_after_wait(lane: CudaLane) -> None:
    rec = FetchRecorder()
    gate = rec.gate(1)
    jobs, _ = h2d_jobs(lane, rec)
    readiness = LayerReadiness(NUM_LAYERS)
    task = LoadScheduler(lane, max_in_flight=1).start(jobs, readiness)
    await until(rec.started[1])
    task.cancel()
    with pytest.raises(LayerLoadCancelled):
        readiness.wait(2, 0.01)
    gate.set()
    await asyncio.wait_for(task.wait_quiescent(), WAIT_S)
    assert rec.active == 0 and rec.started_layers() == {0, 1}
    await asyncio.wait_for(readiness.ready(1), WAIT_S)  # its device copy completed too
