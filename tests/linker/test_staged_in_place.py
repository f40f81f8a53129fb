"""A staged load in place: the engine's per-layer reads (``StagedLoad`` with a placement).

The slices land straight in registered destination memory (the engine's
pool pages, or its pinned per-batch staging on a device) and are verified
there; only the checksums go through the ring. Each case checks the bytes
that landed and the store calls made (a spy): one call per layer, each
object's footers read once with the part's first slice, a timed-out read's
destination handed to the placement, a closed gate that reads nothing. On
the in-memory store, and one round trip on a real Mooncake master.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence

import pytest
import torch
from test_staged import LAYOUT, SENTINEL, encode, offload, pages, put_raw
from test_staged_footers import RangeSpy

import layerlift.linker.staged_offload as staged_offload
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.ring import StagingRing, ring_for
from layerlift.linker.staged import (
    CorruptSlices,
    Gate,
    HostSink,
    HostSnapshot,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    OffloadPart,
    OffloadSegment,
    StagedLoad,
    StagedOffload,
    TransferRevoked,
)
from layerlift.linker.store_base import ForwardingStore, Store, StoreTimeout

N = 6
KEYS = [f"inplace/p{i}" for i in range(N)]
WHOLE = (LAYOUT.page_bytes, LAYOUT.footer_bytes)


class Pages:
    """Registered destination memory: ``rows[slot]`` is one page; row ``i`` of
    the part goes to slot ``target[i]`` (reversed, so a row-for-row mix-up
    shows). Records what ``timed_out`` was told."""

    def __init__(self, store: Store, n: int) -> None:
        self.store = store
        self.rows = torch.full((n, LAYOUT.page_bytes), SENTINEL, dtype=torch.uint8)
        self.ptr = store.register(self.rows)
        self.timeouts: list[tuple[tuple[int, int], StoreTimeout]] = []

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return (part.layout.slices[local][1],)

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        offset = part.layout.slices[seg.local][0]
        base = int(self.rows.data_ptr())
        return [base + slot * LAYOUT.page_bytes + offset for slot in part.target[seg.lo : seg.hi]]

    def pages(self, part: LoadPart) -> list[int]:
        base = int(self.rows.data_ptr())
        return [base + slot * LAYOUT.page_bytes for slot in part.target]

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        self.timeouts.append(((lo, hi), exc))
        exc.owned = True  # this destination is the test's: it waits for the call itself

    def page(self, row: int) -> torch.Tensor:
        return self.rows[N - 1 - row]

    def close(self) -> None:
        self.store.unregister(self.ptr)


def _load(ring: StagingRing, store: Store, dest: Pages, keys: Sequence[str] = KEYS,
          slots: Sequence[int] | None = None, **kw: object) -> StagedLoad:
    target = list(slots) if slots is not None else [N - 1 - i for i in range(len(keys))]
    part = LoadPart(LAYOUT, tuple(keys), target)
    layers = [[(0, j)] for j in range(len(LAYOUT.slices))]
    return StagedLoad(ring, store, [part], layers, None, placement=dest, **kw)  # type: ignore[arg-type]


def _stored(objects: dict[str, bytes] | None = None) -> tuple[RangeSpy, torch.Tensor]:
    mem = MemoryStore()
    src = pages(N, 9)
    put_raw(mem, objects or {k: encode(k, src[i]) for i, k in enumerate(KEYS)})
    return RangeSpy(mem), src


def _spoiled(src: torch.Tensor, row: int, at: int) -> dict[str, bytes]:
    objects = {k: encode(k, src[i]) for i, k in enumerate(KEYS)}
    raw = bytearray(objects[KEYS[row]])
    raw[at] ^= 0x80
    objects[KEYS[row]] = bytes(raw)
    return objects


def test_each_slice_lands_in_place_in_one_call_per_layer_with_the_footers_read_once() -> None:
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    landed: list[int] = []
    load = _load(ring, spy, dest, on_layer=lambda layer, event: landed.append(layer))
    for layer in range(len(LAYOUT.slices)):
        assert load.fetch_layer(layer) is None
    for row in range(N):
        assert torch.equal(dest.page(row), src[row])
    assert len(spy.calls) == len(LAYOUT.slices)  # one store call per layer
    assert spy.calls[0] == [[LAYOUT.slices[0], WHOLE]] * N
    for layer, call in enumerate(spy.calls[1:], start=1):
        assert call == [[LAYOUT.slices[layer]]] * N, f"layer {layer} read more than its slices"
    assert landed == [0, 1, 2]
    assert load.wait_quiet(5.0) and ring.wait_idle(5.0) and ring.close()
    dest.close()


def test_a_layer_read_before_the_footers_are_in_reads_its_own_entries() -> None:
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    load = _load(ring, spy, dest)
    load.fetch_layer(2)
    assert spy.calls[0] == [[LAYOUT.slices[2], (LAYOUT.footer_at(2), 4)]] * N
    offset, size = LAYOUT.slices[2]
    for row in range(N):
        assert torch.equal(dest.page(row)[offset : offset + size], src[row][offset : offset + size])
    assert load.wait_quiet(5.0) and ring.close()
    dest.close()


def test_a_corrupt_slice_fails_its_layer_and_is_reported() -> None:
    """Object 3's slice 1 is flipped: layer 1 raises CorruptSlices naming it
    (``on_corrupt`` first), the layer is not marked landed; layers 0 and 2 land."""
    src = pages(N, 9)
    spy, _ = _stored(_spoiled(src, 3, LAYOUT.slices[1][0] + 5))
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    reported: list[str] = []
    landed: list[int] = []
    load = _load(ring, spy, dest, on_corrupt=reported.extend,
                 on_layer=lambda layer, event: landed.append(layer))
    load.fetch_layer(0)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(1)
    assert info.value.keys == (KEYS[3],) and info.value.layer == 1
    assert reported == [KEYS[3]]
    load.fetch_layer(2)
    assert landed == [0, 2]
    assert load.wait_quiet(5.0) and ring.close()
    dest.close()


def test_without_verification_the_slices_are_read_alone_and_corruption_lands() -> None:
    """The negative control (the engine's ``verify_restores=False``): no
    checksum is read or checked, so the flipped byte is served."""
    src = pages(N, 9)
    at = LAYOUT.slices[1][0] + 5
    spy, _ = _stored(_spoiled(src, 3, at))
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    load = _load(ring, spy, dest, verify=False)
    for layer in range(len(LAYOUT.slices)):
        load.fetch_layer(layer)
    for layer, call in enumerate(spy.calls):
        assert call == [[LAYOUT.slices[layer]]] * N
    want = src[3].clone()
    want[at] ^= 0x80
    assert torch.equal(dest.page(3), want)
    assert ring.live() == [] and ring.close()
    dest.close()


def test_a_closed_gate_reads_nothing() -> None:
    spy, _ = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    gate = Gate()
    load = _load(ring, spy, dest, gate=gate)
    gate.close()
    with pytest.raises(TransferRevoked):
        load.fetch_layer(0)
    assert spy.calls == [] and bool((dest.rows == SENTINEL).all())
    assert ring.close()
    dest.close()


def test_a_timed_out_read_hands_its_destination_and_checks_over() -> None:
    """The read stalls past the store's timeout: the placement hears of it
    (it owns the destination until the call ends), the checks' region stays
    out of the ring until then, and the late read lands where it was sent."""
    store = MemoryStore(timeout_s=0.2)
    src = pages(N, 9)
    put_raw(store, {k: encode(k, src[i]) for i, k in enumerate(KEYS)})
    ring = StagingRing(store, 64 << 10)
    dest = Pages(store, N)
    load = _load(ring, store, dest)
    store.stall()
    with pytest.raises(StoreTimeout) as info:
        load.fetch_layer(0)
    exc = info.value
    assert [rows for rows, _ in dest.timeouts] == [(0, N)]
    assert dest.timeouts[0][1] is exc and exc.owned and load.timed_out == [exc]
    assert len(ring.live()) == 1 and not load.quiet  # the checks the call still writes
    store.resume()
    assert exc.wait_finished(30.0)
    assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
    offset, size = LAYOUT.slices[0]
    for row in range(N):
        assert torch.equal(dest.page(row)[offset : offset + size], src[row][offset : offset + size])
    assert ring.close()
    dest.close()


def test_a_load_rebuilt_over_fewer_rows_keeps_the_footers_verified_so_far() -> None:
    """The engine's COMMIT trims duplicates and rebuilds its load: rows whose
    footers the first load verified read their later slices alone; a row the
    first load never read reads its own entry."""
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    first = _load(ring, spy, dest, keys=KEYS[:4], slots=[5, 4, 3, 2])
    first.fetch_layer(0)
    trimmed = [KEYS[0], KEYS[2]]
    again = _load(ring, spy, dest, keys=trimmed, slots=[5, 3])
    again.adopt_footers(first)
    again.fetch_layer(1)
    assert spy.calls[-1] == [[LAYOUT.slices[1]]] * 2
    late = _load(ring, spy, dest, keys=[KEYS[0], KEYS[5]], slots=[5, 0])
    late.adopt_footers(first)
    late.fetch_layer(1)  # KEYS[5] was never read: the segment reads its own entries
    assert spy.calls[-1] == [[LAYOUT.slices[1], (LAYOUT.footer_at(1), 4)]] * 2
    offset, size = LAYOUT.slices[1]
    for row in (0, 2, 5):
        assert torch.equal(dest.page(row)[offset : offset + size], src[row][offset : offset + size])
    assert ring.close()
    dest.close()


def test_a_whole_read_is_one_call_of_pages_and_footers_verified_in_place() -> None:
    """The engine's barrier: every object whole in one call, each page into
    its slot, every slice checked; a flipped byte in any slice fails the read
    (layer 0 carries it) and names its key; without verification the pages
    alone are read."""
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Pages(spy, N)
    landed: list[int] = []
    load = _load(ring, spy, dest, on_layer=lambda layer, event: landed.append(layer))
    load.fetch_whole()
    assert spy.calls == [[[(0, LAYOUT.page_bytes), (LAYOUT.page_bytes, LAYOUT.footer_bytes)]] * N]
    for row in range(N):
        assert torch.equal(dest.page(row), src[row])
    assert landed == [0, 1, 2]
    at = LAYOUT.slices[2][0] + 3
    bad, _ = _stored(_spoiled(src, 4, at))
    bad_ring = StagingRing(bad, 64 << 10)
    dest_bad = Pages(bad, N)
    reported: list[str] = []
    with pytest.raises(CorruptSlices) as info:
        _load(bad_ring, bad, dest_bad, on_corrupt=reported.extend).fetch_whole()
    assert info.value.keys == (KEYS[4],) and info.value.layer == 0 and reported == [KEYS[4]]
    plain = _load(bad_ring, bad, dest_bad, verify=False)
    plain.fetch_whole()
    assert bad.calls[-1] == [[(0, LAYOUT.page_bytes)]] * N
    want = src[4].clone()
    want[at] ^= 0x80
    assert torch.equal(dest_bad.page(4), want)
    assert ring.wait_idle(5.0) and ring.close() and bad_ring.wait_idle(5.0) and bad_ring.close()
    dest.close()
    dest_bad.close()


def test_a_timed_out_whole_read_hands_every_part_over() -> None:
    store = MemoryStore(timeout_s=0.2)
    src = pages(N, 9)
    put_raw(store, {k: encode(k, src[i]) for i, k in enumerate(KEYS)})
    ring = StagingRing(store, 64 << 10)
    dest = Pages(store, N)
    load = _load(ring, store, dest)
    store.stall()
    with pytest.raises(StoreTimeout) as info:
        load.fetch_whole()
    exc = info.value
    assert [rows for rows, _ in dest.timeouts] == [(0, N)] and exc.owned
    assert len(ring.live()) == 1  # the footers the call still writes
    store.resume()
    assert exc.wait_finished(30.0) and load.wait_quiet(30.0) and ring.wait_idle(30.0)
    for row in range(N):
        assert torch.equal(dest.page(row), src[row])
    assert ring.close()
    dest.close()


def test_a_load_is_staged_or_in_place_never_both() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    dest = Pages(store, N)
    part = LoadPart(LAYOUT, tuple(KEYS), list(range(N)))
    sink = HostSink(lambda *a: None)
    with pytest.raises(ValueError, match="exactly one"):
        StagedLoad(ring, store, [part], [[(0, 0)]], sink, placement=dest)
    with pytest.raises(ValueError, match="exactly one"):
        StagedLoad(ring, store, [part], [[(0, 0)]], None)
    with pytest.raises(ValueError, match="only an in-place load"):
        StagedLoad(ring, store, [part], [[(0, 0)]], sink, verify=False)
    with pytest.raises(ValueError, match="only an in-place load reads whole"):
        StagedLoad(ring, store, [part], [[(0, 0)]], sink).fetch_whole()
    dest.close()


# ---- offloads in place (the engine's) -------------------------------------------------


class Source:
    """Pages put from where they are: ``part.source`` is each row's address."""

    def pages(self, seg: OffloadSegment, part: OffloadPart) -> list[int]:
        return list(part.source[seg.lo : seg.hi])


def _in_place_offload(store: Store, keys: Sequence[str], src: torch.Tensor,
                      layout: ObjectLayout = LAYOUT) -> StagedOffload:
    """``src`` (registered by the caller) offloaded in place: one part."""
    addrs = [int(src[i].data_ptr()) for i in range(len(keys))]
    part = OffloadPart(layout, tuple(keys), addrs)
    return StagedOffload(ring_for(store), store, [part], None, source=Source(),
                         wait_timed_out=True)


def test_an_in_place_offload_is_one_put_of_pages_with_footers_over_their_bytes() -> None:
    """Objects equal the independent encoding of the pages; one call; the
    in-place load reads them back exactly."""
    spy = PutSpy(MemoryStore())
    src = pages(N, 21)
    ptr = spy.register(src)
    outcome = _in_place_offload(spy, KEYS, src).run()
    assert outcome.ok and outcome.objects == N and outcome.late == 0
    assert outcome.bytes == N * LAYOUT.object_bytes
    assert spy.puts == [N]
    for i, key in enumerate(KEYS):
        assert spy.inner.object_bytes(key) == encode(key, src[i])  # type: ignore[attr-defined]
    dest = Pages(spy, N)
    load = _load(StagingRing(spy, 64 << 10), spy, dest)
    load.fetch_whole()
    for row in range(N):
        assert torch.equal(dest.page(row), src[row])
    spy.unregister(ptr)
    dest.close()


def test_a_page_no_layer_reads_is_put_without_a_footer() -> None:
    store = MemoryStore()
    layout = ObjectLayout((), 64)
    src = pages(2, 3, layout)
    ptr = store.register(src)
    outcome = _in_place_offload(store, ["bare/0", "bare/1"], src, layout).run()
    assert outcome.ok and outcome.objects == 2
    assert store.object_bytes("bare/1") == bytes(src[1].numpy())
    store.unregister(ptr)


def test_an_in_place_offload_waits_for_a_timed_out_put_and_counts_it_late() -> None:
    store = MemoryStore(timeout_s=0.2)
    src = pages(2, 22)
    ptr = store.register(src)
    keys = ["late/0", "late/1"]
    off = _in_place_offload(store, keys, src)
    store.stall()
    resumer = threading.Thread(target=lambda: (store.timed_out.wait(30.0), store.resume()))
    resumer.start()
    outcome = off.run()
    resumer.join(30.0)
    assert outcome.ok and outcome.late == 1 and outcome.objects == 2
    assert store.object_bytes(keys[1]) == encode(keys[1], src[1])
    assert ring_for(store).idle()
    store.unregister(ptr)


def test_a_failed_in_place_put_is_the_outcome_and_frees_the_source() -> None:
    store = MemoryStore()
    src = pages(2, 23)
    ptr = store.register(src)
    store.fail_call(1)
    freed: list[int] = []
    outcome = _in_place_offload(store, ["f/0", "f/1"], src).run(lambda: freed.append(1))
    assert not outcome.ok and outcome.objects == 0 and freed == [1]
    assert ring_for(store).idle()
    store.unregister(ptr)


@pytest.fixture
def small_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-place put calls of one object, then two, then three (at most)."""
    monkeypatch.setattr(staged_offload, "FIRST_BYTES", LAYOUT.object_bytes)
    monkeypatch.setattr(staged_offload, "IN_PLACE_PUT_BYTES", 3 * LAYOUT.object_bytes)


@pytest.mark.usefixtures("small_calls")
def test_an_in_place_offload_in_several_calls_stores_every_object_exactly() -> None:
    """Calls of 1, 2 and 3 objects, in order; each object the independent
    encoding of its page; the in-place load reads them back exactly."""
    spy = PutSpy(MemoryStore())
    src = pages(N, 24)
    ptr = spy.register(src)
    outcome = _in_place_offload(spy, KEYS, src).run()
    assert outcome.ok and outcome.objects == N and outcome.bytes == N * LAYOUT.object_bytes
    assert spy.puts == [1, 2, 3]
    for i, key in enumerate(KEYS):
        assert spy.inner.object_bytes(key) == encode(key, src[i])  # type: ignore[attr-defined]
    assert ring_for(spy).idle()
    spy.unregister(ptr)


@pytest.mark.usefixtures("small_calls")
def test_a_failed_second_call_keeps_the_first_and_sends_nothing_after_it() -> None:
    """The second call fails: the first call's object stays stored, the third
    call is never sent (a deeper page never without the earlier ones), the
    source is freed once, no region is left."""
    spy = PutSpy(MemoryStore())
    src = pages(N, 25)
    ptr = spy.register(src)
    spy.inner.fail_keys([KEYS[2]])  # type: ignore[attr-defined]  (in the second call)
    freed: list[int] = []
    outcome = _in_place_offload(spy, KEYS, src).run(lambda: freed.append(1))
    assert not outcome.ok and outcome.objects == 1 and freed == [1]
    assert spy.puts == [1, 2]
    assert spy.exists(KEYS) == [True] + [False] * (N - 1)
    assert ring_for(spy).idle()
    spy.unregister(ptr)


@pytest.mark.usefixtures("small_calls")
def test_the_next_call_is_sent_only_once_the_one_before_ended() -> None:
    """The second call is held inside the store: the third call's footers may
    be computed, but it is not sent until the second returned; the source
    is freed only after the last call ended."""
    held, release = threading.Event(), threading.Event()
    spy = PutSpy(MemoryStore())
    real = spy.put_parts
    freed: list[int] = []

    def holding(keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                sizes: Sequence[Sequence[int]]) -> None:
        if len(spy.puts) == 1:  # the second call
            held.set()
            assert release.wait(30.0), "the test never released the held put"
        real(keys, ptrs, sizes)

    spy.put_parts = holding  # type: ignore[method-assign]
    src = pages(N, 26)
    ptr = spy.register(src)
    result: list[object] = []
    runner = threading.Thread(target=lambda: result.append(
        _in_place_offload(spy, KEYS, src).run(lambda: freed.append(1))))
    runner.start()
    assert held.wait(30.0)
    assert spy.puts == [1] and freed == []  # bounded below: the second call is still held
    runner.join(0.2)
    assert runner.is_alive() and spy.puts == [1] and freed == []
    release.set()
    runner.join(30.0)
    outcome = result[0]
    assert isinstance(outcome, staged_offload.OffloadOutcome) and outcome.ok
    assert spy.puts == [1, 2, 3] and freed == [1]
    assert ring_for(spy).idle()
    spy.unregister(ptr)


def test_an_offload_is_staged_or_in_place_never_both() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    part = OffloadPart(LAYOUT, ("x",), [0])
    snap = HostSnapshot(lambda seg, p: torch.zeros(1, LAYOUT.page_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="exactly one"):
        StagedOffload(ring, store, [part], snap, source=Source(), wait_timed_out=True)
    with pytest.raises(ValueError, match="exactly one"):
        StagedOffload(ring, store, [part], None)
    with pytest.raises(ValueError, match="waits for a timed-out put"):
        StagedOffload(ring, store, [part], None, source=Source())


class PutSpy(ForwardingStore):
    """Forwards to ``inner``; records the number of keys of each put call."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.puts: list[int] = []

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self.puts.append(len(keys))
        self.inner.put_parts(keys, ptrs, sizes)


# ---- a real Mooncake master ---------------------------------------------------------


@pytest.fixture(scope="module")
def long_lease_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master of this module's own, with 5 s read leases."""
    log = tmp_path_factory.mktemp("in_place") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.mark.mooncake
def test_mooncake_each_slice_lands_in_place_verified(long_lease_master: EmbeddedMaster) -> None:
    """Offloaded through the staged path, read back in place into memory
    registered with a real client, one layer at a time, then a flipped slice
    caught where it landed."""
    store = MooncakeStore(long_lease_master.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    try:
        ns = f"inplace-{uuid.uuid4().hex[:8]}"
        keys = [f"{ns}/p{i}" for i in range(N)]
        ring = StagingRing(store, 1 << 20)
        src = pages(N, 13)
        assert offload(ring, store, keys, src).run().ok
        dest = Pages(store, N)
        load = _load(ring, store, dest, keys=keys)
        with store.open_session(keys):
            for layer in range(len(LAYOUT.slices)):
                load.fetch_layer(layer)
        for row in range(N):
            assert torch.equal(dest.page(row), src[row])
        bad = f"{ns}/bad"
        raw = bytearray(encode(bad, src[0]))
        raw[LAYOUT.slices[2][0]] ^= 0x01
        put_raw(store, {bad: bytes(raw)})
        spoiled = _load(ring, store, dest, keys=[bad], slots=[0])
        with store.open_session([bad]):
            spoiled.fetch_layer(0)
            with pytest.raises(CorruptSlices):
                spoiled.fetch_layer(2)
        assert ring.wait_idle(30.0) and ring.close()
        dest.close()
    finally:
        store.close()


class _HeldRead(ForwardingStore):
    """Forwards; the next ranged read reads, then waits for ``release``
    (``started`` set once it waits)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.release, self.started = threading.Event(), threading.Event()

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        self.started.set()
        assert self.release.wait(30), "the test never released the read"


def test_an_in_place_read_counts_in_flight_until_it_was_verified_and_landed() -> None:
    """From the look at the gate until the layer landed the read counts in
    ``gate.reads`` (``on_layer`` sees it counted); a gate closed while the
    read runs revokes the layer after it, and ``wait_reads`` returns only
    once that read ended: what an adapter that hands the memory back after
    ``wait_reads`` (vLLM's worker) relies on."""
    spy, src = _stored()
    held = _HeldRead(spy)
    ring = StagingRing(held, 64 << 10)
    dest = Pages(held, N)
    gate = Gate()
    seen: list[int] = []
    load = _load(ring, held, dest, gate=gate, on_layer=lambda layer, _e: seen.append(gate.reads))
    worker = threading.Thread(target=load.fetch_layer, args=(0,))
    worker.start()
    assert held.started.wait(10)
    assert gate.reads == 1 and not gate.wait_reads(0.0)
    held.release.set()
    worker.join(10)
    assert seen == [1] and gate.reads == 0 and gate.wait_reads(0.0)
    # Layer 1: the gate closes while its read runs.
    held.release.clear()
    held.started.clear()
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            load.fetch_layer(1)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=fetch)
    worker.start()
    assert held.started.wait(10)
    gate.close()  # returns at once: the read is not a copy
    assert gate.reads == 1 and not gate.wait_reads(0.1)
    held.release.set()
    assert gate.wait_reads(10)
    worker.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TransferRevoked) and seen == [1]
    offset, size = LAYOUT.slices[1]
    for row in range(N):  # the read landed (it was issued), but the layer never did
        assert torch.equal(dest.page(row)[offset : offset + size], src[row][offset : offset + size])
    assert ring.close()
    dest.close()
