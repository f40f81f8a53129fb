"""The staged transfer's device path on the simulated device (streams that run late).

``DeviceSink`` issues each verified chunk's H2D copy and scatter on a load
stream and returns an event recorded there after them; the ring reuses the
chunk's pinned staging only once that event completed; the forward waits on
the layer's event before it reads. Three negative controls break one rule each
and must give wrong bytes that the same check catches: a skipped event wait,
an event recorded on the wrong stream, a staging region reused before its
event. Orders are set with a blocker on the load stream, never with sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from crc32c import crc32c

from layerlift.linker.integrity import slice_seed
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.staged import (
    DeviceSink,
    DeviceSnapshot,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    OffloadPart,
    OffloadSegment,
    StagedLoad,
    StagedOffload,
)
from layerlift.overlap.device import DeviceEvent
from layerlift.testing.simdevice import POISON, SimDevice, block_stream

WAIT_S = 30.0
LAYOUT = ObjectLayout(((0, 512), (512, 512)), 1024)
ROWS = 16  # objects per load: 2 chunks of 8 per layer with the ring below
SENTINEL = 0x11


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    device = SimDevice(seed=5, max_delay_s=0.001)
    yield device
    device.close()


def stored(store: MemoryStore, n: int, seed: int) -> tuple[list[str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n, LAYOUT.page_bytes), dtype=torch.uint8, generator=g)
    keys = [f"dev/{seed}/p{i}" for i in range(n)]
    for key, page in zip(keys, src, strict=True):
        raw = bytes(page.numpy())
        obj = raw + b"".join(crc32c(raw[o : o + s], slice_seed(key, j)).to_bytes(4, "little")
                             for j, (o, s) in enumerate(LAYOUT.slices))
        buf = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
        ptr = store.register(buf)
        store.put([key], [ptr], [len(obj)])
        store.unregister(ptr)
    return keys, src


class Pool:
    """'Device' memory (bound to nothing: the sink's scatter writes it on the
    load stream); the part's target lists each object's row."""

    def __init__(self, n: int) -> None:
        self.rows = torch.full((n, LAYOUT.page_bytes), SENTINEL, dtype=torch.uint8)

    def scatter(self, chunk: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        offset, size = part.layout.slices[chunk.local]
        idx = torch.tensor(part.target[chunk.lo : chunk.hi], dtype=torch.int64)
        self.rows[:, offset : offset + size].index_copy_(0, idx, rows)


def block(sim: SimDevice, stream: Any) -> threading.Event:
    """Hold ``stream`` until the returned event is set (a blocker queued on it)."""
    return block_stream(sim, stream, WAIT_S)


def make_load(sim: SimDevice, store: MemoryStore, keys: list[str], pool: Pool,
              sink: DeviceSink | None = None) -> tuple[StagedLoad, DeviceSink, StagingRing]:
    # 4 chunks of 8 rows (8 x 516 bytes) fit the ring at once: depth 4
    ring = StagingRing(store, 4 * 8 * 516 + 4 * 64, alloc=sim.pinned, timeout_s=WAIT_S)
    sink = sink or DeviceSink(sim, pool.scatter)
    part = LoadPart(LAYOUT, tuple(keys), list(range(len(keys))))
    load = StagedLoad(ring, store, [part], [[(0, 0)], [(0, 1)]], sink, depth=4)
    assert [len(c) for c in load.chunks] == [2, 2]
    return load, sink, ring


def forward_reads(sim: SimDevice, load: StagedLoad, pool: Pool, src: torch.Tensor, layer: int,
                  *, wait: bool = True) -> bool:
    """The forward: wait on the layer's event (unless the control skips it),
    then read the layer's slice; True when it holds the stored bytes."""
    event = load.events[layer]
    assert event is not None
    if wait:
        event.wait(sim.default)  # the forward's stream waits (the host's, here)
    offset, size = LAYOUT.slices[layer]
    return torch.equal(pool.rows[:, offset : offset + size], src[:, offset : offset + size])


def test_layers_land_on_the_load_stream_and_the_forward_waits_on_their_events(
        sim: SimDevice) -> None:
    store = MemoryStore()
    keys, src = stored(store, ROWS, 1)
    pool = Pool(ROWS)
    load, sink, ring = make_load(sim, store, keys, pool)
    sink.begin()
    go = block(sim, sink.stream)  # the copies run late: after both layers were issued
    for layer in (0, 1):
        assert load.fetch_layer(layer) is not None
    assert not ring.idle(), "staging was given back before its copies ran"
    go.set()
    assert forward_reads(sim, load, pool, src, 0) and forward_reads(sim, load, pool, src, 1)
    assert load.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S)


def test_control_a_skipped_event_wait_reads_wrong_bytes(sim: SimDevice) -> None:
    store = MemoryStore()
    keys, src = stored(store, ROWS, 2)
    pool = Pool(ROWS)
    load, sink, _ = make_load(sim, store, keys, pool)
    go = block(sim, sink.stream)
    load.fetch_layer(0)
    assert not forward_reads(sim, load, pool, src, 0, wait=False), \
        "the control did not catch a forward that skipped its event wait"
    go.set()
    assert forward_reads(sim, load, pool, src, 0)  # with the wait: right


class WrongStreamSink(DeviceSink):
    """Control: records each chunk's event on another stream than the copies'."""

    def __init__(self, sim: SimDevice, scatter: Callable[[LoadSegment, LoadPart, torch.Tensor],
                                                          None]) -> None:
        super().__init__(sim, scatter)
        self.other = sim.new_stream()

    def issue(self, work: Callable[[], None]) -> DeviceEvent:
        self.device.launch(self.stream, work)
        event = self.device.event()
        event.record(self.other)
        return event


def test_control_an_event_on_the_wrong_stream_reads_wrong_bytes(sim: SimDevice) -> None:
    store = MemoryStore()
    keys, src = stored(store, ROWS, 3)
    pool = Pool(ROWS)
    sink = WrongStreamSink(sim, pool.scatter)
    load, _, _ = make_load(sim, store, keys, pool, sink)
    go = block(sim, sink.stream)
    load.fetch_layer(0)
    assert not forward_reads(sim, load, pool, src, 0), \
        "the control did not catch an event recorded on the wrong stream"
    go.set()
    sim.synchronize()


def test_control_staging_reused_before_its_event_gives_wrong_bytes(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    keys, src = stored(store, ROWS, 4)
    pool = Pool(ROWS)
    load, sink, _ = make_load(sim, store, keys, pool)
    monkeypatch.setattr(Region, "release_after", lambda self, event: self.release())
    go = block(sim, sink.stream)
    load.fetch_layer(0)  # chunk 2 reads into chunk 1's region before chunk 1's copy ran
    go.set()
    assert not forward_reads(sim, load, pool, src, 0), \
        "the control did not catch staging reused before its copy's event"


@pytest.mark.parametrize("ordered", [True, False])
def test_an_offload_gathers_after_the_forward_that_wrote_the_slots(sim: SimDevice,
                                                                    ordered: bool) -> None:
    """The snapshot runs on a stream ordered after an event recorded after
    the forward's write; its control (no such event) stores the old bytes."""
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10, alloc=sim.pinned)
    fwd = sim.new_stream()
    pool = torch.zeros((4, LAYOUT.page_bytes), dtype=torch.uint8)
    go = block(sim, fwd)
    sim.launch(fwd, lambda: pool.fill_(9))  # the forward writes the slots, late
    written = sim.event()
    written.record(fwd)

    def gather(chunk: OffloadSegment, part: OffloadPart) -> torch.Tensor:
        return pool[chunk.lo : chunk.hi]

    snapshot = DeviceSnapshot(sim, gather, after=(lambda: written) if ordered else None)
    keys = [f"off/{ordered}/p{i}" for i in range(4)]
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], snapshot)
    if ordered:  # the forward goes on while the offload runs: the event orders them
        threading.Thread(target=go.set).start()
    outcome = off.run()
    go.set()
    assert outcome.ok
    stored_page = store.object_bytes(keys[0])[: LAYOUT.page_bytes]
    assert (stored_page == bytes([9]) * LAYOUT.page_bytes) is ordered
    assert stored_page != bytes([POISON]) * LAYOUT.page_bytes


def test_the_same_device_path_on_the_simulation_and_on_cuda(any_device: Any) -> None:
    """Many chunks per layer through pinned staging on the load stream; the
    forward's stream waits on each layer's event, then reads exact bytes
    (on CUDA the load stream is made late with a spin kernel)."""
    device = any_device
    store = MemoryStore()
    n = 64
    keys, src = stored(store, n, 21)
    dest = torch.full((n, LAYOUT.page_bytes), SENTINEL, dtype=torch.uint8,
                      device=device.torch_device)

    def scatter(chunk: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        offset, size = part.layout.slices[chunk.local]
        idx = torch.tensor(part.target[chunk.lo : chunk.hi], dtype=torch.int64,
                           device=rows.device)
        dest[:, offset : offset + size].index_copy_(0, idx, rows)

    ring = StagingRing(store, 4 * 8 * 516 + 4 * 64, alloc=device.pinned, timeout_s=WAIT_S)
    sink = DeviceSink(device, scatter)
    part = LoadPart(LAYOUT, tuple(keys), list(range(n)))
    load = StagedLoad(ring, store, [part], [[(0, 0)], [(0, 1)]], sink, depth=4)
    assert min(len(c) for c in load.chunks) >= 8
    sink.begin()
    if device.torch_device.type == "cuda":
        device.launch(sink.stream, lambda: torch.cuda._sleep(50_000_000))
    for layer in (0, 1):
        event = load.fetch_layer(layer)
        assert event is not None
    with device.use():
        for layer in (0, 1):
            load.events[layer].wait(device.current_stream())  # type: ignore[union-attr]
            offset, size = LAYOUT.slices[layer]
            got = dest[:, offset : offset + size].cpu()
            assert torch.equal(got, src[:, offset : offset + size]), f"layer {layer} wrong"
    assert ring.wait_idle(WAIT_S) and load.wait_quiet(WAIT_S)
