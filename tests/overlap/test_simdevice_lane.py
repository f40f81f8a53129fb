"""The simulated device keeps CUDA's ordering rules and nothing more: work on a
stream runs late and in order, events complete when their stream reaches them,
``wait`` orders one stream after another, the default stream is the host's,
and a relocation copy overtaken by another stream's write carries that write.
Every order is set up with events, never with sleeps."""

from __future__ import annotations

import threading

import pytest
import torch

from layerlift import Component, ModelSpec
from layerlift.overlap.device import device_of
from layerlift.pools import UnifiedKVPool
from layerlift.testing.simdevice import POISON, SimDevice

WAIT_S = 30.0


@pytest.fixture
def sim() -> SimDevice:
    device = SimDevice(seed=3, max_delay_s=0.001)
    yield device  # type: ignore[misc]
    device.close()


def blocker() -> tuple[threading.Event, threading.Event, object]:
    """Work that blocks its stream until ``go`` is set; ``started`` says it runs."""
    started, go = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        assert go.wait(WAIT_S)

    return started, go, work


def test_launched_work_runs_late_and_events_complete_in_order(sim: SimDevice) -> None:
    stream = sim.new_stream()
    x = torch.zeros(4, dtype=torch.uint8)
    started, go, work = blocker()
    sim.launch(stream, work)  # type: ignore[arg-type]
    sim.launch(stream, lambda: x.fill_(7))
    ev = sim.event()
    ev.record(stream)
    assert started.wait(WAIT_S)
    assert not ev.query() and int(x.sum()) == 0  # issued, not run
    go.set()
    ev.synchronize()
    assert ev.query() and torch.equal(x, torch.full((4,), 7, dtype=torch.uint8))


def test_wait_orders_one_stream_after_another_and_nothing_else_does(sim: SimDevice) -> None:
    a, b = sim.new_stream(), sim.new_stream()
    for ordered in (False, True):
        x, y = torch.zeros(1), torch.zeros(1)
        started, go, work = blocker()
        sim.launch(a, work)  # type: ignore[arg-type]
        sim.launch(a, lambda x=x: x.fill_(1.0))
        ev = sim.event()
        ev.record(a)
        if ordered:
            ev.wait(b)
        sim.launch(b, lambda x=x, y=y: y.copy_(x))
        done = sim.event()
        done.record(b)
        assert started.wait(WAIT_S)
        if not ordered:
            done.synchronize()  # b ran while a was still blocked: it read the old x
            assert float(y) == 0.0
        else:
            assert not done.query()
        go.set()
        sim.synchronize()
        assert float(y) == (1.0 if ordered else 0.0)


def test_waiting_on_the_default_stream_blocks_the_host(sim: SimDevice) -> None:
    stream = sim.new_stream()
    started, go, work = blocker()
    sim.launch(stream, work)  # type: ignore[arg-type]
    ev = sim.event()
    ev.record(stream)
    returned = threading.Event()

    def host() -> None:
        with sim.use() as current:
            assert current is sim.default
            ev.wait()  # the current stream is the default one: host work waits
            returned.set()

    thread = threading.Thread(target=host)
    thread.start()
    assert started.wait(WAIT_S)
    assert not returned.is_set()
    go.set()
    thread.join(WAIT_S)
    assert returned.is_set() and ev.query()


def test_timing_events_and_bad_streams(sim: SimDevice) -> None:
    start, end = sim.event(timing=True), sim.event(timing=True)
    start.record()
    end.record()
    end.synchronize()
    start.synchronize()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="timing=True"):
        sim.event().elapsed_time(end)
    other = SimDevice(seed=0)
    try:
        with pytest.raises(ValueError, match="not a stream of this simulated device"):
            sim.launch(other.new_stream(), lambda: None)
    finally:
        other.close()
    assert int(sim.pinned(16).unique().item()) == POISON
    with pytest.raises(ValueError, match=">= 0"):
        SimDevice(max_delay_s=-1.0)


def test_a_relocation_overtaken_by_another_stream_carries_its_write() -> None:
    """The pool moves a page (copy on the default stream, queued late); a
    load stream then writes into the vacated page. Unordered, the late copy
    reads the load's bytes into the moved page; with the fence (record on the
    default stream, wait on the load stream) the moved page keeps its bytes."""
    spec = ModelSpec.preset("tiny")
    for fenced in (False, True):
        sim = SimDevice(seed=1, max_delay_s=0.0)
        try:
            pool = UnifiedKVPool(spec, 2 << 20)
            sim.attach_pool(pool)
            assert device_of(pool.buffer) is sim
            c = Component.MAMBA
            src = pool.alloc(c, 1)
            spare = pool.alloc(c, 1)
            assert src is not None and spare is not None
            pool.free(c, spare)
            pool.page_view(c, int(src)).fill_(11)
            started, go, work = blocker()
            sim.launch(sim.default, work)  # type: ignore[arg-type]  # the stream is busy
            pool.move_pages(c, src, spare)
            assert torch.equal(pool.page_view(c, int(spare)),
                               torch.full_like(pool.page_view(c, int(spare)), 11))
            load = sim.new_stream()
            if fenced:
                fence = sim.event()
                fence.record(sim.default)
                fence.wait(load)
            vacated = pool.page_view(c, int(src))
            landed = sim.event()
            sim.launch(load, lambda v=vacated: v.fill_(99))
            landed.record(load)
            assert started.wait(WAIT_S)
            if not fenced:
                landed.synchronize()  # the load overtook the relocation copy
            go.set()
            sim.synchronize()
            moved = int(pool.page_view(c, int(spare)).float().mean())
            assert moved == (11 if fenced else 99)
            assert sim.relocations == 1 and sim.relocation_hazards == (0 if fenced else 1)
        finally:
            sim.close()


def test_to_host_follows_the_default_stream(sim: SimDevice) -> None:
    x = torch.zeros(8, dtype=torch.uint8)
    sim.launch(sim.default, lambda: x.fill_(5))
    host = sim.to_host([x[:4], x[4:]])
    assert torch.equal(host, torch.full((8,), 5, dtype=torch.uint8))
    sim.close()
    with pytest.raises(RuntimeError, match="closed"):
        sim.launch(sim.default, lambda: None)


def test_the_seam_finds_a_buffers_device_and_refuses_what_cannot_work() -> None:
    import gc

    from layerlift.overlap import Completion, CudaLane
    from layerlift.overlap.device import CudaDevice, bind

    sim = SimDevice(seed=0)
    try:
        buffer = torch.zeros(8, dtype=torch.uint8)
        assert device_of(buffer) is None  # plain host memory: the CPU path
        bind(buffer, sim)
        assert device_of(buffer) is sim
        del buffer
        gc.collect()
        assert device_of(torch.zeros(8, dtype=torch.uint8)) is None
        with pytest.raises(RuntimeError, match="needs a CUDA stream"):
            CudaLane(sim, completion=Completion.HOST_FUNC)
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="needs a CUDA device"):
                CudaDevice()
            with pytest.raises(RuntimeError, match="needs a CUDA device"):
                CudaLane()
    finally:
        sim.close()
