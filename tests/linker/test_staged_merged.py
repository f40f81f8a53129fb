"""A staged load read whole: `StagedLoad.fetch_all` (every layer's slices in as
few store calls as the chunk budget allows, each chunk verified as one before
any copy; into a host sink, whole objects, one range each, when the load is
one chunk of every slice) and `StagedLoad.all_jobs` (the same as a streamed
scheduler unit). Each test runs with both reads where both apply:
``objects`` (a host sink) and ``slices`` (a sink that wants contiguous rows,
as a device sink's H2D copy does).

The checks of a per-layer load hold for a merged chunk too: a corrupt or
foreign slice stops the whole chunk before any copy, a closed gate copies
nothing, a timed-out read lands in staging still owned, a layer lands only
after the chunk holding its last slice was copied. On the in-memory store for
the logic and its faults, on a real Mooncake master for the one-call read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_staged import (
    LAYOUT,
    SENTINEL,
    Rows,
    encode,
    offload,
    pages,
    put_raw,
)

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import (
    CorruptSlices,
    Gate,
    HostSink,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    StagedLoad,
    TransferRevoked,
)
from layerlift.linker.store_base import ForwardingStore, Store, StoreTimeout
from layerlift.overlap import CpuLane, LayerReadiness, LoadPolicy, LoadScheduler


class Counting(ForwardingStore):
    """Forwards to ``inner``; counts the ranged reads and the keys of each."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: list[int] = []

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.calls.append(len(keys))
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)


class ContiguousSink(HostSink):
    """A host sink that takes contiguous rows only (as a device sink)."""

    strided_rows = False

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        assert rows.is_contiguous(), "a contiguous-rows sink got strided rows"
        return super().write(seg, part, rows)


@pytest.fixture(params=["objects", "slices"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def whole_load(ring: StagingRing, store: Store, keys: list[str], dest: Rows,
               landed: list[int] | None = None, src: torch.Tensor | None = None,
               kind: str = "objects", reads: Sequence[int] = (0, 1, 2),
               **kw: object) -> StagedLoad:
    """A one-part, three-layer load; ``landed`` hears each layer as it lands;
    with ``src``, every row of a landing layer must be in the destination."""
    part = LoadPart(LAYOUT, tuple(keys), list(range(len(keys))))

    def on_layer(layer: int, event: object) -> None:
        offset, size = LAYOUT.slices[layer]
        if src is not None:
            assert torch.equal(dest.rows[:, offset : offset + size],
                               src[:, offset : offset + size]), \
                f"layer {layer} landed before all its bytes were copied"
        if landed is not None:
            landed.append(layer)

    sink = (HostSink if kind == "objects" else ContiguousSink)(dest.scatter)
    return StagedLoad(ring, store, [part], [[(0, j)] if j in reads else [] for j in range(3)],
                      sink, on_layer=on_layer, **kw)  # type: ignore[arg-type]


def stored(store: Store, n: int, ns: str, seed: int) -> tuple[list[str], torch.Tensor]:
    keys = [f"{ns}/p{i}" for i in range(n)]
    src = pages(n, seed)
    put_raw(store, {k: encode(k, src[i]) for i, k in enumerate(keys)})
    return keys, src


def test_a_load_within_one_chunk_is_one_store_call_for_every_layer(kind: str) -> None:
    inner = MemoryStore()
    store = Counting(inner)
    ring = StagingRing(inner, 64 << 10)  # depth 4: chunks of 16 KiB
    keys, src = stored(inner, 4, "one", 21)  # 3 layers x 4 rows x ~1 KiB
    dest, landed = Rows(4), []
    load = whole_load(ring, store, keys, dest, landed, src, kind)
    assert load.one_call()
    assert load.fetch_all() is None
    # one call: each object whole (one range), or every layer's slice of it
    assert store.calls == [4 if kind == "objects" else 3 * 4]
    assert torch.equal(dest.rows, src) and landed == [0, 1, 2]
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_load_of_some_slices_reads_those_slices_only() -> None:
    """Layers 0 and 2 only (layer 1 is not restored): never the whole object."""
    inner = MemoryStore()
    store = Counting(inner)
    ring = StagingRing(inner, 64 << 10)
    keys, src = stored(inner, 4, "some", 29)
    dest, landed = Rows(4), []
    load = whole_load(ring, store, keys, dest, landed, reads=(0, 2))
    assert load.one_call()
    load.fetch_all()
    assert store.calls == [2 * 4] and landed == [0, 1, 2]
    assert torch.equal(dest.rows[:, :1000], src[:, :1000])
    assert torch.equal(dest.rows[:, 2000:], src[:, 2000:])
    assert bool((dest.rows[:, 1000:2000] == SENTINEL).all())
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_load_beyond_one_chunk_lands_each_layer_after_its_last_slice() -> None:
    inner = MemoryStore()
    store = Counting(inner)
    ring = StagingRing(inner, 16 << 10)  # chunks of 4 KiB: three or four rows each
    keys, src = stored(inner, 10, "many", 22)
    dest, landed = Rows(10), []
    load = whole_load(ring, store, keys, dest, landed, src)
    assert not load.one_call()
    load.fetch_all()
    per_layer = sum(len(chunks) for chunks in load.chunks)
    assert 1 < len(store.calls) <= per_layer  # never more calls than one a layer's chunk
    assert sum(store.calls) == 3 * 10  # every slice read once
    assert torch.equal(dest.rows, src) and landed == [0, 1, 2]
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_corrupt_slice_stops_its_whole_chunk_before_any_copy(kind: str) -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    keys, src = stored(store, 4, "bad", 23)
    raw = bytearray(encode(keys[2], src[2]))
    raw[2000 + 5] ^= 0xFF  # layer 2's slice of page 2
    store.remove([keys[2]])
    put_raw(store, {keys[2]: bytes(raw)})
    dest, landed, reported = Rows(4), [], []
    load = whole_load(ring, store, keys, dest, landed, kind=kind, on_corrupt=reported.extend)
    assert load.one_call()
    with pytest.raises(CorruptSlices) as info:
        load.fetch_all()
    assert info.value.keys == (keys[2],) and reported == [keys[2]] and info.value.layer == 2
    # layers 0 and 1 verified, but they share the chunk: nothing was copied
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_truncated_object_is_corrupt_and_nothing_is_copied(kind: str) -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    keys, src = stored(store, 4, "short", 30)
    store.remove([keys[1]])
    put_raw(store, {keys[1]: encode(keys[1], src[1])[:1500]})  # half its first slice gone
    dest, landed, reported = Rows(4), [], []
    load = whole_load(ring, store, keys, dest, landed, kind=kind, on_corrupt=reported.extend)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_all()
    assert keys[1] in info.value.keys and keys[1] in reported
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_closed_gate_copies_nothing_of_a_merged_chunk(kind: str) -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    keys, _ = stored(store, 4, "gate", 24)
    dest, landed, gate = Rows(4), [], Gate()
    load = whole_load(ring, store, keys, dest, landed, kind=kind, gate=gate)
    gate.close()
    with pytest.raises(TransferRevoked):
        load.fetch_all()
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []
    assert load.wait_quiet(10.0) and ring.idle()


def test_a_timed_out_merged_read_lands_in_staging_still_owned(kind: str) -> None:
    store = MemoryStore(timeout_s=0.2)
    ring = StagingRing(store, 64 << 10)
    keys, src = stored(store, 3, "late", 25)
    dest, landed = Rows(3), []
    load = whole_load(ring, store, keys, dest, landed, kind=kind)
    store.stall()
    try:
        with pytest.raises(StoreTimeout) as info:
            load.fetch_all()
        exc = info.value
        assert exc.owned and load.timed_out == [exc]
        ((offset, span),) = ring.live()  # still owned by the running call
        other = ring.acquire(span)
        assert other.offset != offset, "staging a running read writes into was lent again"
        other.release()
    finally:
        store.resume()
    assert exc.wait_finished(30.0)
    assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
    assert ring.buffer is not None
    if kind == "objects":  # whole objects, back to back
        first = ring.buffer[offset : offset + 3 * LAYOUT.object_bytes].view(
            3, LAYOUT.object_bytes)[:, : LAYOUT.page_bytes]
        assert torch.equal(first, src), "the late read did not land in its staging"
    else:  # layer 0's rows come first
        first = ring.buffer[offset : offset + 3 * 1000].view(3, 1000)
        assert torch.equal(first, src[:, :1000]), "the late read did not land in its staging"
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []


def test_an_in_place_load_has_no_merged_read() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)

    class Nowhere:
        def addresses(self, seg: object, part: object) -> list[int]:
            raise AssertionError("never read")

        def pages(self, part: object) -> list[int]:
            return []

        def timed_out(self, *args: object) -> None:
            raise AssertionError("never read")

    load = StagedLoad(ring, store, [LoadPart(LAYOUT, ("k",), [0])], [[(0, 0)]], None,
                      placement=Nowhere())  # type: ignore[arg-type]
    assert not load.one_call()
    with pytest.raises(ValueError, match="staged loads"):
        load.fetch_all()


async def _streamed(load: StagedLoad, layers: int) -> LayerReadiness:
    """``all_jobs`` as one streamed unit (as the vLLM worker runs them)."""
    lane = CpuLane(2)
    try:
        sched = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=2, stream_size=layers)
        readiness = LayerReadiness(layers, default_timeout=30.0)
        task = sched.start(load.all_jobs(), readiness)
        await asyncio.wait_for(task.done(), 30.0)
        return readiness
    finally:
        lane.close()


async def test_all_jobs_release_every_layer_after_the_one_read(kind: str) -> None:
    inner = MemoryStore()
    store = Counting(inner)
    ring = StagingRing(inner, 64 << 10)
    keys, src = stored(inner, 4, "jobs", 26)
    dest, landed = Rows(4), []
    load = whole_load(ring, store, keys, dest, landed, src, kind)
    readiness = await _streamed(load, 3)
    assert readiness.all_done() and store.calls == [4 if kind == "objects" else 12]
    assert torch.equal(dest.rows, src) and landed == [0, 1, 2]


async def test_all_jobs_fail_every_layer_when_the_one_read_fails(kind: str) -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    keys, src = stored(store, 4, "jobsbad", 27)
    foreign = encode(keys[0], src[1])  # page 1's slot holds page 0's object
    store.remove([keys[1]])
    put_raw(store, {keys[1]: foreign})
    dest, landed = Rows(4), []
    load = whole_load(ring, store, keys, dest, landed, kind=kind)
    readiness = await _streamed(load, 3)
    assert not readiness.all_done()
    assert all(readiness.error(layer) is not None for layer in range(3))
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []
    assert load.wait_quiet(10.0) and ring.idle()


@pytest.mark.mooncake
def test_mooncake_a_merged_read_is_one_call_and_byte_exact(
        long_lease_master: EmbeddedMaster, kind: str) -> None:
    mooncake = MooncakeStore(long_lease_master.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    store = Counting(mooncake)
    try:
        ring = StagingRing(mooncake, 1 << 20)
        keys = [f"merged-{uuid.uuid4().hex[:8]}/p{i}" for i in range(24)]
        src = pages(24, 28)
        assert offload(ring, mooncake, keys, src).run().ok
        dest, landed = Rows(24), []
        load = whole_load(ring, store, keys, dest, landed, src, kind)
        assert load.one_call()
        with mooncake.open_session(keys):  # the adapters' read session
            load.fetch_all()
        assert store.calls == [24 if kind == "objects" else 3 * 24]
        assert torch.equal(dest.rows, src) and landed == [0, 1, 2]
        assert load.wait_quiet(30.0) and ring.wait_idle(30.0) and ring.close()
    finally:
        mooncake.close()


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       counts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       skip=st.sets(st.integers(0, 3), max_size=2),
       capacity=st.sampled_from([8 << 10, 16 << 10, 64 << 10, 1 << 20]),
       depth=st.integers(1, 4))
def test_a_merged_plan_reads_every_row_once_and_lands_layers_in_order(
        sizes: list[int], counts: list[int], skip: set[int], capacity: int, depth: int) -> None:
    """Any load (some layers without reads): the merged chunks read every
    (layer, part, slice, row) of the per-layer plan exactly once, in layer
    order, each chunk within the ring and the budget unless one row; every
    layer lands exactly once, in order, with the chunk holding its last
    slice; whole objects are read only when every slice of every row is."""
    store = MemoryStore()
    ring = StagingRing(store, capacity)
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    layout = ObjectLayout(tuple(zip(offsets, sizes, strict=True)), sum(sizes))
    parts = [LoadPart(layout, tuple(f"p{p}/k{i}" for i in range(c))) for p, c in enumerate(counts)]
    layers = [[] if j in skip else [(p, j) for p in range(len(parts))] for j in range(len(sizes))]
    try:
        load = StagedLoad(ring, store, parts, layers, HostSink(lambda *a: None), depth=depth)
    except ValueError:  # a slice larger than the ring: refused up front, as per layer
        return
    plan = load._merged()
    per_layer = [(g.layer, g.part, g.local, i) for chunks in load.chunks for c in chunks
                 for g in c.segments for i in range(g.lo, g.hi)]
    merged = [(g.layer, g.part, g.local, i) for c, _ in plan for g in c.segments
              for i in range(g.lo, g.hi)]
    assert merged == per_layer
    for c, _ in plan:
        nbytes = sum(g.rows * (sizes[g.local] + (layout.footer_bytes if g.local == 0 else 4))
                     for g in c.segments)
        rows = sum(g.rows for g in c.segments)
        assert ring.fits(nbytes) and (rows == 1 or nbytes <= capacity // depth)
    landing = [layer for _, lands in plan for layer in lands]
    if plan:
        assert landing == list(range(len(sizes)))
        for k, (_, lands) in enumerate(plan):  # a layer lands no earlier than its last row
            for layer in lands:
                assert all(g.layer != layer for later, _ in plan[k + 1:] for g in later.segments)
    full = all(j not in skip for j in range(len(sizes))) and any(counts)
    assert load._objects_whole() == (full and len(plan) == 1)
