"""The staged transfer: fetch -> verify -> gated copy, snapshot -> put, through a bounded ring.

On the in-memory store for the logic and its faults, on a real Mooncake
master for the registered-memory path (a transfer 8x larger than the ring,
and a read that outlives its timeout and must land in staging still owned).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from layerlift.linker.daemon_pool import DaemonPool
from layerlift.linker.integrity import copy_checksum, slice_seed
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.ring import StagingRing, StagingTimeout
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
from layerlift.linker.store_base import ForwardingStore, Store, StoreTimeout, call_bounded

LAYOUT = ObjectLayout(((0, 1000), (1000, 1000), (2000, 1000)), 3000)
SENTINEL = 0x5A


def encode(key: str, page: torch.Tensor, layout: ObjectLayout = LAYOUT) -> bytes:
    """The object as ``linker/integrity.py`` lays it out (written independently)."""
    raw = bytes(page.numpy())
    crcs = b"".join(crc32c(raw[o : o + n], slice_seed(key, j)).to_bytes(4, "little")
                    for j, (o, n) in enumerate(layout.slices))
    return raw + crcs


def put_raw(store: Store, objects: dict[str, bytes]) -> None:
    """Put pre-encoded objects (not through the code under test)."""
    for key, data in objects.items():
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        ptr = store.register(buf)
        try:
            store.put([key], [ptr], [len(data)])
        finally:
            store.unregister(ptr)


def pages(n: int, seed: int, layout: ObjectLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.page_bytes), dtype=torch.uint8, generator=g)


class Rows:
    """A destination: ``rows[slot]`` is one page; part ``target`` = the slots."""

    def __init__(self, n: int, layout: ObjectLayout = LAYOUT) -> None:
        self.layout = layout
        self.rows = torch.full((n, layout.page_bytes), SENTINEL, dtype=torch.uint8)
        self.writes = 0

    def scatter(self, chunk: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        offset, size = part.layout.slices[chunk.local]
        slots = torch.tensor(part.target[chunk.lo : chunk.hi], dtype=torch.int64)
        self.rows[:, offset : offset + size].index_copy_(0, slots, rows)
        self.writes += 1


def one_part_load(ring: StagingRing, store: Store, keys: list[str], dest: Rows,
                  **kw: object) -> StagedLoad:
    layout = dest.layout
    part = LoadPart(layout, tuple(keys), list(range(len(keys))))
    layers = [[(0, j)] for j in range(len(layout.slices))]
    return StagedLoad(ring, store, [part], layers, HostSink(dest.scatter), **kw)  # type: ignore[arg-type]


def offload(ring: StagingRing, store: Store, keys: list[str], src: torch.Tensor,
            layout: ObjectLayout = LAYOUT, **kw: object) -> StagedOffload:
    part = OffloadPart(layout, tuple(keys), src)

    def gather(chunk: OffloadSegment, p: OffloadPart) -> torch.Tensor:
        return p.source[chunk.lo : chunk.hi]

    return StagedOffload(ring, store, [part], HostSnapshot(gather), **kw)  # type: ignore[arg-type]


def round_trip(store: Store, ring: StagingRing, n: int, ns: str,
               layout: ObjectLayout = LAYOUT) -> None:
    """Offload ``n`` pages and load them back through ``ring``; byte-exact,
    and the stored objects are exactly the independently encoded ones."""
    keys = [f"{ns}/p{i}" for i in range(n)]
    src = pages(n, 1, layout)
    off = offload(ring, store, keys, src, layout, depth=2)
    assert len(off.chunks) >= 8
    freed: list[int] = []
    outcome = off.run(lambda: freed.append(1))
    assert outcome.ok and outcome.objects == n and freed == [1]
    got = torch.zeros(layout.object_bytes, dtype=torch.uint8)
    ptr = store.register(got)
    try:
        for i in (0, n // 2, n - 1):
            assert store.get([keys[i]], [ptr], [layout.object_bytes]) == [True]
            assert bytes(got.numpy()) == encode(keys[i], src[i], layout)
    finally:
        store.unregister(ptr)
    dest = Rows(n, layout)
    load = one_part_load(ring, store, keys, dest, depth=2)
    assert sum(load.nbytes(j) for j in range(len(layout.slices))) >= 8 * ring.capacity
    assert all(len(c) > 2 for c in load.chunks)  # every layer streams in several chunks
    with store.open_session(keys):  # as the adapters do around a load
        for layer in range(len(layout.slices)):
            assert load.fetch_layer(layer) is None
    assert torch.equal(dest.rows, src)
    assert load.wait_quiet(30.0) and ring.wait_idle(30.0)


def test_a_transfer_8x_the_ring_round_trips_byte_exact() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 64 << 10)
    n = 8 * (64 << 10) // LAYOUT.page_bytes + 3
    round_trip(store, ring, n, "mem")


def test_at_most_depth_chunks_hold_staging_while_layers_run_at_once() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 32 << 10, timeout_s=30.0)
    n = 60
    keys = [f"d/p{i}" for i in range(n)]
    src = pages(n, 2)
    assert offload(ring, store, keys, src).run().ok
    dest = Rows(n)
    seen: list[int] = []
    inner = dest.scatter

    def scatter(chunk: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        seen.append(len(ring.live()))
        inner(chunk, part, rows)

    dest.scatter = scatter  # type: ignore[method-assign]
    load = one_part_load(ring, store, keys, dest, depth=2)
    threads = [threading.Thread(target=load.fetch_layer, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert torch.equal(dest.rows, src)
    assert seen and max(seen) <= 2, f"more than depth chunks held staging: {max(seen)}"


def test_a_corrupt_slice_never_reaches_the_destination() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)
    n = 12
    keys = [f"c/p{i}" for i in range(n)]
    src = pages(n, 3)
    objects = {k: encode(k, src[i]) for i, k in enumerate(keys)}
    bad = bytearray(objects[keys[7]])
    bad[1000 + 17] ^= 0xFF  # a flipped byte in slice 1 of page 7
    objects[keys[7]] = bytes(bad)
    objects[keys[9]] = encode(keys[2], src[9])  # a foreign object (its own valid footer)
    put_raw(store, objects)
    dest = Rows(n)
    reported: list[str] = []
    load = one_part_load(ring, store, keys, dest, on_corrupt=reported.extend)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(0)  # page 9 is foreign in every slice
    assert keys[9] in info.value.keys and info.value.layer == 0
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(1)
    assert info.value.keys == (keys[7],) and set(reported) == {keys[7], keys[9]}
    # nothing of a failed chunk was copied; the corrupt bytes never arrived
    assert bool((dest.rows[9] == SENTINEL).all())
    assert bool((dest.rows[7, 1000:2000] == SENTINEL).all())
    assert load.wait_quiet(10.0) and ring.idle()


class CheckingSnapshot:
    """A host snapshot that checksums each slice as it copies it
    (``integrity.copy_checksum``) and returns the footers; ``spoil``: rows
    whose returned footer entry for slice 1 is off by one."""

    def __init__(self, src: torch.Tensor, spoil: frozenset[int] = frozenset()) -> None:
        self.src, self.spoil, self.calls = src, spoil, 0

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> np.ndarray:
        self.calls += 1
        slices = part.layout.slices
        table = np.empty((seg.rows, len(slices)), dtype="<u4")
        for i in range(seg.rows):
            row = seg.lo + i
            dst, src = int(pages[i].data_ptr()), int(self.src[row].data_ptr())
            for j, (o, n) in enumerate(slices):
                crc = copy_checksum(dst + o, [(src + o, n)], slice_seed(part.keys[row], j))
                table[i, j] = (crc + 1) & 0xFFFFFFFF if j == 1 and row in self.spoil else crc
        return table


def test_footers_a_snapshot_computed_as_it_copied_are_the_ones_stored() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)
    n = 12
    keys = [f"f/p{i}" for i in range(n)]
    src = pages(n, 11)
    snap = CheckingSnapshot(src)
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], snap, depth=2)
    assert len(off.chunks) >= 3 and off.run().ok and snap.calls == len(off.chunks)
    got = torch.zeros(LAYOUT.object_bytes, dtype=torch.uint8)
    ptr = store.register(got)
    try:
        for i, key in enumerate(keys):
            assert store.get([key], [ptr], [LAYOUT.object_bytes]) == [True]
            assert bytes(got.numpy()) == encode(key, src[i])
    finally:
        store.unregister(ptr)
    # Negative control: the footers stored are the snapshot's, not recomputed:
    # one wrong entry fails that slice's check on the load, nothing of it copied.
    bad = [f"g/p{i}" for i in range(n)]
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(bad))],
                        CheckingSnapshot(src, frozenset({5})), depth=2)
    assert off.run().ok
    dest = Rows(n)
    load = one_part_load(ring, store, bad, dest)
    load.fetch_layer(0)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(1)
    assert info.value.keys == (bad[5],)
    assert bool((dest.rows[5, 1000:2000] == SENTINEL).all())
    assert load.wait_quiet(10.0) and ring.wait_idle(10.0)


def test_footers_of_the_wrong_shape_from_a_snapshot_are_refused() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)

    class Short(CheckingSnapshot):
        def read(self, seg: OffloadSegment, part: OffloadPart,
                 pages: torch.Tensor) -> np.ndarray:
            return super().read(seg, part, pages)[:, :2]

    keys = [f"s/p{i}" for i in range(4)]
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], Short(pages(4, 2)))
    with pytest.raises(ValueError, match="snapshot's footers"):
        off.run()
    assert store.exists(keys) == [False] * 4 and ring.wait_idle(10.0)


def test_a_closed_gate_copies_nothing() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)
    keys = [f"g/p{i}" for i in range(4)]
    put_raw(store, {k: encode(k, p) for k, p in zip(keys, pages(4, 4), strict=True)})
    dest, gate = Rows(4), Gate()
    load = one_part_load(ring, store, keys, dest, gate=gate)
    gate.close()
    with pytest.raises(TransferRevoked):
        load.fetch_layer(0)
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and ring.idle()


def test_a_full_ring_fails_the_chunk_with_a_staging_timeout() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10, timeout_s=0.05)
    keys = ["f/p0"]
    put_raw(store, {"f/p0": encode("f/p0", pages(1, 5)[0])})
    hog = ring.acquire(16 << 10)
    dest = Rows(1)
    with pytest.raises(StagingTimeout):
        one_part_load(ring, store, keys, dest).fetch_layer(0)
    hog.release()
    assert bool((dest.rows == SENTINEL).all())


def test_what_does_not_fit_the_ring_is_refused_up_front() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 2048)
    with pytest.raises(ValueError, match="does not fit the 2048-byte staging ring"):
        offload(ring, store, ["x"], pages(1, 6))
    big = ObjectLayout(((0, 4096),), 4096)
    with pytest.raises(ValueError, match="one slice of 4100 bytes"):
        StagedLoad(ring, store, [LoadPart(big, ("x",))], [[(0, 0)]], HostSink(lambda *a: None))
    with pytest.raises(ValueError, match="reads slice 3"):
        StagedLoad(ring, store, [LoadPart(LAYOUT, ("x",))], [[(0, 3)]],
                   HostSink(lambda *a: None))


def test_a_timed_out_read_lands_in_staging_still_owned() -> None:
    store = MemoryStore(timeout_s=0.2)
    ring = StagingRing(store, 16 << 10)
    keys = [f"t/p{i}" for i in range(3)]
    src = pages(3, 7)
    put_raw(store, {k: encode(k, p) for k, p in zip(keys, src, strict=True)})
    dest = Rows(3)
    load = one_part_load(ring, store, keys, dest)
    store.stall()
    with pytest.raises(StoreTimeout) as info:
        load.fetch_layer(0)
    exc = info.value
    assert exc.owned and exc.future is not None and load.timed_out == [exc]
    ((offset, span),) = ring.live()  # still owned by the running call
    assert not load.quiet
    other = ring.acquire(span)
    assert other.offset != offset, "staging a running read writes into was lent again"
    other.release()
    store.resume()
    assert exc.wait_finished(30.0)
    assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
    assert ring.buffer is not None
    landed = ring.buffer[offset : offset + 3 * 1000].view(3, 1000)
    assert torch.equal(landed, src[:, :1000]), "the late read did not land in its staging"
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all())


def test_a_put_that_lands_late_sends_the_snapshot_bytes() -> None:
    store = MemoryStore(timeout_s=0.2)
    ring = StagingRing(store, 8 << 10)  # one object a chunk (half the ring)
    keys = ["o/p0", "o/p1"]
    src = pages(2, 8)
    snap = src.clone()
    ended = threading.Event()
    off = offload(ring, store, keys, src, on_late_end=ended.set)
    store.stall()
    outcome = off.run()
    assert isinstance(outcome.error, StoreTimeout) and outcome.error.owned
    src.fill_(0xEE)  # the host reuses its slots right after the failure was reported
    assert not ring.idle()
    store.resume()
    assert ended.wait(30.0) and ring.wait_idle(30.0)
    assert store.object_bytes(keys[0]) == encode(keys[0], snap[0])
    assert store.exists([keys[1]]) == [False]  # the offload stopped at its failed chunk


def test_the_engine_rule_waits_for_a_timed_out_put_and_counts_it_late() -> None:
    store = MemoryStore(timeout_s=0.2)
    ring = StagingRing(store, 16 << 10)
    src = pages(1, 9)
    off = offload(ring, store, ["w/p0"], src, wait_timed_out=True)
    store.stall()
    resumer = threading.Thread(target=lambda: (store.timed_out.wait(30.0), store.resume()))
    resumer.start()
    outcome = off.run()
    resumer.join(30.0)
    assert outcome.ok and outcome.late == 1 and outcome.objects == 1
    assert store.object_bytes("w/p0") == encode("w/p0", src[0])
    assert ring.idle()


def test_a_failed_put_stops_the_offload_and_frees_the_source() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 8 << 10)
    keys = [f"s/p{i}" for i in range(6)]
    off = offload(ring, store, keys, pages(6, 10), depth=4)
    assert len(off.chunks) == 6
    ring.open()
    store.fail_call(2)  # the second put
    freed: list[int] = []
    outcome = off.run(lambda: freed.append(1))
    assert not outcome.ok and outcome.objects == 1 and freed == [1]
    assert store.exists(keys) == [True] + [False] * 5  # nothing after the failure was sent


# ---- a real Mooncake master ---------------------------------------------------------


@pytest.mark.mooncake
def test_mooncake_a_transfer_8x_the_ring_round_trips_byte_exact(
        long_lease_master: EmbeddedMaster) -> None:
    """Through a ring registered once with a real client (this module's
    master leases reads for 5 s: the session master's 50 ms is shorter than a
    session start plus reads on a loaded machine)."""
    store = MooncakeStore(long_lease_master.config(global_segment_size=64 << 20,
                                                  local_buffer_size=16 << 20, timeout_s=10.0))
    try:
        ring = StagingRing(store, 1 << 20)
        layout = ObjectLayout(((0, 32 << 10), (32 << 10, 32 << 10), (64 << 10, 32 << 10)),
                              96 << 10)  # ~90 objects: few keys per session and call
        n = 8 * (1 << 20) // layout.page_bytes + 5
        round_trip(store, ring, n, f"rt-{uuid.uuid4().hex[:8]}", layout)
        assert ring.close()
    finally:
        store.close()


class LateReads(ForwardingStore):
    """A real store whose ranged reads start only once ``gate`` is set, on a
    worker the caller waits for at most ``timeout_s`` (as a slow transfer:
    the caller gets StoreTimeout, the read goes on and lands later)."""

    def __init__(self, inner: Store, gate: threading.Event, timeout_s: float) -> None:
        super().__init__(inner)
        self.gate, self.timeout_s = gate, timeout_s
        self._pool = DaemonPool(2, "late-reads")

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        def late() -> None:
            self.gate.wait(30.0)
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

        call_bounded(self._pool.submit, late, self.timeout_s, "a ranged read timed out")

    def close(self) -> None:
        self._pool.stop()


@pytest.mark.mooncake
def test_mooncake_a_timed_out_read_lands_in_staging_still_owned(
        long_lease_master: EmbeddedMaster) -> None:
    mooncake = MooncakeStore(long_lease_master.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    ns = f"late-{uuid.uuid4().hex[:8]}"
    gate = threading.Event()
    store = LateReads(mooncake, gate, timeout_s=0.2)
    try:
        ring = StagingRing(store, 1 << 20)
        keys = [f"{ns}/p{i}" for i in range(4)]
        src = pages(4, 11)
        assert offload(ring, store, keys, src).run().ok
        ring.buffer.fill_(0)  # type: ignore[union-attr]
        dest = Rows(4)
        load = one_part_load(ring, store, keys, dest)
        with store.open_session(keys):  # the adapters' read session
            with pytest.raises(StoreTimeout) as info:
                load.fetch_layer(2)
            exc = info.value
            assert exc.owned and exc.future is not None
            ((at, span),) = ring.live()  # its staging stays owned
            assert not load.quiet
            other = ring.acquire(span, timeout_s=0)
            assert other.offset != at, "staging a running read writes into was lent again"
            other.release()
            gate.set()  # the read goes on now, into the region it was lent
            assert exc.wait_finished(30.0)
            assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
            assert ring.buffer is not None
            assert torch.equal(ring.buffer[at : at + 4000].view(4, 1000), src[:, 2000:3000])
            assert dest.writes == 0 and bool((dest.rows == SENTINEL).all())
            for layer in range(3):  # the same load reads normally afterwards
                load.fetch_layer(layer)
        assert torch.equal(dest.rows, src)
        assert ring.wait_idle(30.0) and ring.close()
    finally:
        store.close()
        mooncake.close()


def test_a_layer_is_marked_landed_under_the_gate_after_its_last_chunk() -> None:
    """``on_layer`` runs under the gate after the layer's last copy: once
    ``gate.close()`` returned, a layer not marked landed never gets a copy
    (zeroing its slots then is safe), and a marked one has all its rows."""
    store = MemoryStore()
    ring = StagingRing(store, 16 << 10)
    n = 12
    keys = [f"l/p{i}" for i in range(n)]
    src = pages(n, 12)
    put_raw(store, {k: encode(k, p) for k, p in zip(keys, src, strict=True)})
    dest, gate = Rows(n), Gate()
    landed: list[int] = []
    errors: list[BaseException] = []
    in_write = threading.Event()
    go_on = threading.Event()
    inner = dest.scatter

    def scatter(chunk: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        inner(chunk, part, rows)
        if chunk.layer == 1 and chunk.lo == 0:  # layer 1's first chunk: stop the load now
            in_write.set()
            assert go_on.wait(30.0)

    dest.scatter = scatter  # type: ignore[method-assign]
    load = one_part_load(ring, store, keys, dest, gate=gate,
                         on_layer=lambda layer, event: landed.append(layer) if gate.open
                         else errors.append(RuntimeError("marked landed after the close")))
    assert len(load.chunks[1]) > 1
    load.fetch_layer(0)
    assert landed == [0]

    def run() -> None:
        try:
            load.fetch_layer(1)
        except TransferRevoked as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    assert in_write.wait(30.0)
    closing = threading.Event()
    at_close: list[int] = []

    def close() -> None:
        closing.set()
        gate.close()  # waits for the write in progress
        at_close.append(dest.writes)

    closer = threading.Thread(target=close)
    closer.start()
    assert closing.wait(30.0)
    go_on.set()
    closer.join(30.0)
    worker.join(30.0)
    assert dest.writes == at_close[0], "a copy ran after gate.close() returned"
    assert torch.equal(dest.rows[:, :1000], src[:, :1000])
    if 1 in landed:  # the worker won the lock: every chunk of layer 1 was copied first
        assert torch.equal(dest.rows[:, 1000:2000], src[:, 1000:2000]) and not errors
    else:  # stopped in the middle: layer 1 is not landed; the chunks copied
        # before the close took the gate are whole and a prefix, the rest never copied
        assert [type(e) for e in errors] == [TransferRevoked]
        rows = dest.rows[:, 1000:2000]
        copied = [bool(torch.equal(rows[i], src[i, 1000:2000])) for i in range(rows.shape[0])]
        untouched = [bool((rows[i] == SENTINEL).all()) for i in range(rows.shape[0])]
        assert all(c or u for c, u in zip(copied, untouched, strict=True)), "a torn row"
        first_untouched = untouched.index(True) if True in untouched else len(untouched)
        assert all(untouched[first_untouched:]) and not all(copied), copied


def test_require_fit_is_the_only_size_a_transfer_refuses() -> None:
    """Whatever the number of objects, a transfer of a layout that passes
    ``require_fit`` is accepted (a lookup may advertise it); one that fails
    it is refused with the size needed."""
    from layerlift.linker.staged import require_fit

    store = MemoryStore()
    ring = StagingRing(store, LAYOUT.object_bytes + 60)
    require_fit(ring, LAYOUT)
    keys = tuple(f"r/p{i}" for i in range(1000))
    StagedLoad(ring, store, [LoadPart(LAYOUT, keys)], [[(0, j)] for j in range(3)],
               HostSink(lambda *a: None))
    StagedOffload(ring, store, [OffloadPart(LAYOUT, keys)], HostSnapshot(lambda c, p: p.source))
    small = StagingRing(store, LAYOUT.object_bytes - 100)
    with pytest.raises(ValueError, match=f"at least {small.span(LAYOUT.object_bytes)} bytes"):
        require_fit(small, LAYOUT)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       counts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       capacity=st.integers(3100, 40000), depth=st.integers(1, 6))
def test_chunks_cover_every_row_once_and_fit_the_ring(sizes: list[int], counts: list[int],
                                                      capacity: int, depth: int) -> None:
    """Any request size: every (layer, part, slice, row) is read by exactly
    one chunk, every chunk fits the ring, and one holds at most
    ``capacity // depth`` bytes unless it is a single row; offloads likewise
    put every object once, in order, in chunks of at most half the ring
    (pipelined: one chunk put while the next is staged) or all of it."""
    store = MemoryStore()
    ring = StagingRing(store, capacity)
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    layout = ObjectLayout(tuple(zip(offsets, sizes, strict=True)), sum(sizes))
    parts = [LoadPart(layout, tuple(f"p{p}/k{i}" for i in range(c))) for p, c in enumerate(counts)]
    layers = [[(p, j) for p in range(len(parts))] for j in range(len(sizes))]
    load = StagedLoad(ring, store, parts, layers, HostSink(lambda *a: None), depth=depth)
    seen: list[tuple[int, int, int, int]] = []
    for layer, chunks in enumerate(load.chunks):
        for c in chunks:
            assert c.layer == layer and c.segments
            nbytes = sum(g.rows * (sizes[g.local] + 4) for g in c.segments)
            rows = sum(g.rows for g in c.segments)
            assert ring.fits(nbytes)
            assert rows == 1 or nbytes <= capacity // depth
            for g in c.segments:
                assert g.layer == layer and 0 <= g.lo < g.hi <= counts[g.part]
                seen += [(layer, g.part, g.local, i) for i in range(g.lo, g.hi)]
    want = [(j, p, j, i) for j in range(len(sizes)) for p, c in enumerate(counts) for i in range(c)]
    assert seen == want, "every row once, in the parts' order"
    if not ring.fits(layout.object_bytes):
        with pytest.raises(ValueError, match="does not fit"):
            StagedOffload(ring, store, [OffloadPart(layout, p.keys) for p in parts],
                          HostSnapshot(lambda c, p: p.source))
        return
    off = StagedOffload(ring, store, [OffloadPart(layout, p.keys) for p in parts],
                        HostSnapshot(lambda c, p: p.source), depth=depth)
    order = [(g.part, i) for c in off.chunks for g in c.segments for i in range(g.lo, g.hi)]
    assert order == [(p, i) for p, c in enumerate(counts) for i in range(c)]
    for c in off.chunks:
        rows = sum(g.rows for g in c.segments)
        assert ring.fits(rows * layout.object_bytes)
        assert rows == 1 or rows * layout.object_bytes <= capacity // min(depth, 2)


def test_a_batch_of_several_parts_is_one_store_call_per_layer_when_it_fits() -> None:
    """Four requests' parts (two layouts) of one layer share one ranged call
    and one region; each part's rows land in its own destination."""
    other = ObjectLayout(((0, 300), (300, 300), (600, 300)), 900)
    store = MemoryStore()
    ring = StagingRing(store, 256 << 10)
    parts, dests, srcs = [], [], []
    for r in range(4):
        layout = LAYOUT if r % 2 else other
        keys = [f"b{r}/p{i}" for i in range(5)]
        src = pages(5, 30 + r, layout)
        put_raw(store, {k: encode(k, p, layout) for k, p in zip(keys, src, strict=True)})
        dest = Rows(5, layout)
        parts.append(LoadPart(layout, tuple(keys), dest))
        dests.append(dest)
        srcs.append(src)

    def scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        part.target.scatter(seg, LoadPart(part.layout, part.keys, list(range(5))), rows)

    layers = [[(p, j) for p in range(4)] for j in range(3)]
    load = StagedLoad(ring, store, parts, layers, HostSink(scatter))
    assert [len(c) for c in load.chunks] == [1, 1, 1]
    before = sum(c.method == "get_ranges" for c in store.calls)
    for j in range(3):
        load.fetch_layer(j)
    assert sum(c.method == "get_ranges" for c in store.calls) - before == 3
    for dest, src in zip(dests, srcs, strict=True):
        assert torch.equal(dest.rows, src)


@pytest.mark.slow
def test_a_real_model_layout_streams_through_the_default_staging() -> None:
    """32 layers x 8 KV heads x 128 x bf16 (K and V) at 64-token pages: 256 KiB
    per layer slice, 8 MiB objects; 1 024 tokens (128 MiB, twice the default
    64 MiB ring) offload and load back byte-exact. (8 k tokens is the same
    code with 8x the pages: 3 GiB of test memory, too much for CI here.)"""
    from layerlift.linker.ring import DEFAULT_RING_BYTES

    slice_bytes = 64 * 8 * 128 * 2 * 2
    layout = ObjectLayout(tuple((j * slice_bytes, slice_bytes) for j in range(32)),
                          32 * slice_bytes)
    store = MemoryStore()
    ring = StagingRing(store, DEFAULT_RING_BYTES)
    n = 16
    keys = [f"real/p{i}" for i in range(n)]
    src = pages(n, 40, layout)
    assert offload(ring, store, keys, src, layout).run().ok
    dest = Rows(n, layout)
    load = one_part_load(ring, store, keys, dest)
    for layer in range(32):
        load.fetch_layer(layer)
    assert torch.equal(dest.rows, src)
    assert ring.wait_idle(30.0)
