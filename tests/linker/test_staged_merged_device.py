"""`StagedLoad.fetch_all` of several chunks into a device sink, on the
simulated device (streams that run late): the vLLM worker's asynchronous
restores larger than one chunk on a GPU.

The chunks run ``depth`` at once on threads of the call, so their copies
reach the load stream in the order the threads finish, not in chunk order.
A layer lands once every chunk up to the one holding its last slice
returned, with an event recorded after every copy issued by then
(`DeviceSink.mark`). The negative control lands it with the event of the
chunk holding its last slice instead, which does not follow the copies of
an earlier chunk issued after it: the same check must catch its layer 0
done while its first rows are not in. Orders are set with a store that
holds chosen reads and a blocker queued on the load stream, never sleeps.
The last test runs a whole load on the simulation and, marked ``gpu``, on
CUDA behind a spin kernel (``bench/gpu_check.sh``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from test_staged import LAYOUT, SENTINEL, Rows, encode, pages, put_raw
from test_staged_merged_parallel import (
    WAIT_S,
    Held,
    Reports,
    four_at_once,
    in_thread,
    merged_threads_alive,
)

from layerlift.linker.load_core import _Halt
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import (
    CorruptSlices,
    DeviceSink,
    Gate,
    LoadChunk,
    LoadPart,
    LoadSegment,
    StagedLoad,
    TransferRevoked,
)
from layerlift.overlap.device import DeviceEvent
from layerlift.testing.simdevice import SimDevice, block_stream

ROWS = 10
LAYERS = 3


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    device = SimDevice(seed=11, max_delay_s=0.001)
    yield device
    device.close()


class CountingSink(DeviceSink):
    """`DeviceSink` that counts the segments it issued (``wait_writes``)."""

    def __init__(self, device: SimDevice, dest: Rows) -> None:
        super().__init__(device, dest.scatter)
        self.cond = threading.Condition()
        self.writes = 0

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> DeviceEvent | None:
        event = super().write(seg, part, rows)
        with self.cond:
            self.writes += 1
            self.cond.notify_all()
        return event

    def wait_writes(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.writes >= n, WAIT_S), "the copies never came"


class OwnEvents(StagedLoad):
    """The negative control: a landing gets the event of the chunk holding
    its layers' last slice (what that chunk's copies returned)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.own: dict[int, DeviceEvent | None] = {}
        self.landings = iter([c for c, landing in self._merged() if landing])

    def _chunk(self, chunk: LoadChunk, landing: Sequence[int],
               halt: _Halt | None = None) -> DeviceEvent | None:
        event = super()._chunk(chunk, landing, halt)
        self.own[id(chunk)] = event
        return event

    def _after_copies(self) -> DeviceEvent | None:
        return self.own[id(next(self.landings))]  # called once a landing, in chunk order


def setup(sim: SimDevice, *, hold: Sequence[int] = (), corrupt_chunk: int | None = None,
          control: bool = False, gate: Gate | None = None
          ) -> tuple[StagedLoad, Held, StagingRing, CountingSink, Rows, torch.Tensor, Reports]:
    """Ten pages of three layers through a pinned 16 KiB ring at depth 4:
    eight chunks, layer 0 over chunks 0-2 (it lands after chunk 2)."""
    inner = MemoryStore()
    keys = [f"dev-merged/p{i}" for i in range(ROWS)]
    src = pages(ROWS, 43)
    objects = {k: bytearray(encode(k, src[i])) for i, k in enumerate(keys)}
    store = Held(inner)
    ring = StagingRing(inner, 16 << 10, alloc=sim.pinned, timeout_s=WAIT_S)
    dest = Rows(ROWS)
    sink = CountingSink(sim, dest)
    part = LoadPart(LAYOUT, tuple(keys), list(range(ROWS)))
    cls = OwnEvents if control else StagedLoad
    reported = Reports()
    load = cls(ring, store, [part], [[(0, j)] for j in range(LAYERS)], sink, depth=4,
               on_corrupt=reported, gate=gate)
    merged = load._merged()
    assert len(merged) == 8 and merged[2][1] == (0,) and merged[0][1] == merged[1][1] == ()
    assert load.fetches_all() and not load.one_call()

    def first(chunk: int) -> tuple[str, int]:
        seg = merged[chunk][0].segments[0]
        return keys[seg.lo], LAYOUT.slices[seg.local][0]

    store.chunks = {k: first(k) for k in hold}
    store.hold = {first(k): threading.Event() for k in hold}
    if corrupt_chunk is not None:
        key, offset = first(corrupt_chunk)
        objects[key][offset + 3] ^= 0xFF
    put_raw(inner, {k: bytes(v) for k, v in objects.items()})
    sink.begin()
    return load, store, ring, sink, dest, src, reported


def done_without_bytes(load: StagedLoad, dest: Rows, src: torch.Tensor) -> list[int]:
    """Layers whose event completed while their bytes are not all in."""
    bad = []
    for layer in range(LAYERS):
        event = load.events[layer]
        assert event is not None, f"layer {layer} landed without an event"
        offset, size = LAYOUT.slices[layer]
        if event.query() and not torch.equal(dest.rows[:, offset : offset + size],
                                             src[:, offset : offset + size]):
            bad.append(layer)
    return bad


def test_depth_chunks_at_once_and_each_layer_event_follows_its_bytes(sim: SimDevice) -> None:
    load, store, ring, _, dest, src, _ = setup(sim, hold=range(4))
    four_at_once(load, store)
    for layer in range(LAYERS):
        event = load.events[layer]
        assert event is not None
        event.synchronize()
        offset, size = LAYOUT.slices[layer]
        assert torch.equal(dest.rows[:, offset : offset + size], src[:, offset : offset + size])
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S) and not merged_threads_alive()


@pytest.mark.parametrize("control", [False, True], ids=["mark", "own-event-control"])
def test_a_layer_event_follows_an_earlier_chunks_copies_issued_after_it(
        sim: SimDevice, control: bool) -> None:
    """Chunk 0 (layer 0's first rows) is held while chunks 1-7 are read and
    copied, and the stream runs their copies; then the stream is blocked and
    chunk 0 let go: its copies queue behind the blocker. Layer 0 lands
    after chunk 2; its event must not complete before chunk 0's copies ran."""
    load, store, ring, sink, dest, src, _ = setup(sim, hold=[0], control=control)
    thread, errors = in_thread(load.fetch_all)
    segments = sum(len(c.segments) for c, _ in load._merged())
    sink.wait_writes(segments - 1)  # every chunk but the held one issued its copies
    sink.mark().synchronize()  # ... and the stream ran them
    go = block_stream(sim, sink.stream, WAIT_S)
    try:
        store.let_go(0)
        thread.join(WAIT_S)
        assert not thread.is_alive() and errors == []
        assert bool((dest.rows[:4, :1000] == SENTINEL).all())  # chunk 0's copies wait
        bad = done_without_bytes(load, dest, src)
    finally:
        go.set()
    if control:
        assert bad == [0], "the control's layer 0 event should complete without chunk 0's rows"
    else:
        assert bad == []
        for layer in range(LAYERS):
            event = load.events[layer]
            assert event is not None
            event.synchronize()
        assert done_without_bytes(load, dest, src) == []
        assert torch.equal(dest.rows, src)
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S) and not merged_threads_alive()


def test_a_later_chunk_fails_while_an_earlier_one_is_held(sim: SimDevice) -> None:
    """Chunks 0-3 are read at once and held; chunk 1 is corrupt and let go
    first: the load halts, chunks 0, 2 and 3 (verified after the failure)
    issue no copy, no chunk after them is read, no layer lands, the call
    returns only after their threads did, every region comes back."""
    load, store, ring, sink, dest, _, reported = setup(sim, hold=range(4), corrupt_chunk=1)
    thread, errors = in_thread(load.fetch_all)
    store.wait_for(lambda: store.in_flight == 4)
    store.let_go(1)
    assert reported.seen.wait(WAIT_S)  # chunk 1 failed (and halted the load) ...
    assert store.in_flight == 3 and thread.is_alive()  # ... while the others are held
    store.release_all()
    thread.join(WAIT_S)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], CorruptSlices)
    assert store.calls == 4, "a chunk not begun before the failure was read"
    sim.synchronize()
    assert sink.writes == 0 and bool((dest.rows == SENTINEL).all())
    assert load.events == [None] * LAYERS
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S) and not merged_threads_alive()


def test_the_gate_closes_while_a_chunk_is_held(sim: SimDevice) -> None:
    """The gate closes while chunk 0 is held and the chunks after it were
    copied: chunk 0 copies nothing, no layer lands (layer 0 needed chunk 0),
    the call returns once every thread did, and staging comes back once
    the stream ran the copies issued before the close."""
    gate = Gate()
    load, store, ring, sink, dest, _, _ = setup(sim, hold=[0], gate=gate)
    thread, errors = in_thread(load.fetch_all)
    segments = sum(len(c.segments) for c, _ in load._merged())
    sink.wait_writes(segments - 1)
    gate.close()
    writes = sink.writes
    store.let_go(0)
    thread.join(WAIT_S)
    assert not thread.is_alive() and len(errors) == 1
    assert isinstance(errors[0], TransferRevoked)
    sim.synchronize()
    assert sink.writes == writes and bool((dest.rows[:4, :1000] == SENTINEL).all())
    assert load.events == [None] * LAYERS
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S) and not merged_threads_alive()


def test_a_whole_device_load_on_the_simulation_and_on_cuda(any_device: Any) -> None:
    """Sixty-four pages of three layers read whole, several chunks at once,
    into device memory behind a late load stream (a spin kernel on CUDA):
    the forward's stream waits on each layer's event, then reads exact
    bytes; staging comes back once the copies ran."""
    device = any_device
    inner = MemoryStore()
    n = 64
    keys = [f"dev-whole/p{i}" for i in range(n)]
    src = pages(n, 47)
    put_raw(inner, {k: encode(k, src[i]) for i, k in enumerate(keys)})
    dest = torch.full((n, LAYOUT.page_bytes), SENTINEL, dtype=torch.uint8,
                      device=device.torch_device)

    def scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        offset, size = part.layout.slices[seg.local]
        idx = torch.tensor(part.target[seg.lo : seg.hi], dtype=torch.int64, device=rows.device)
        dest[:, offset : offset + size].index_copy_(0, idx, rows)

    ring = StagingRing(inner, 32 << 10, alloc=device.pinned, timeout_s=WAIT_S)
    sink = DeviceSink(device, scatter)
    part = LoadPart(LAYOUT, tuple(keys), list(range(n)))
    load = StagedLoad(ring, inner, [part], [[(0, j)] for j in range(LAYERS)], sink, depth=4)
    assert load.fetches_all() and len(load._merged()) > 8
    sink.begin()
    if device.torch_device.type == "cuda":
        device.launch(sink.stream, lambda: torch.cuda._sleep(50_000_000))
    assert load.fetch_all() is not None
    with device.use():
        for layer in range(LAYERS):
            event = load.events[layer]
            assert event is not None
            event.wait(device.current_stream())
            offset, size = LAYOUT.slices[layer]
            got = dest[:, offset : offset + size].cpu()
            assert torch.equal(got, src[:, offset : offset + size]), f"layer {layer} wrong"
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S) and not merged_threads_alive()
