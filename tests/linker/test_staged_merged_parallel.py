"""`StagedLoad.fetch_all` of several chunks into a host sink: up to ``depth``
chunks read, verified and copied at once on threads of the call, the layers
landing in chunk order after them (the vLLM worker's asynchronous restores
larger than one chunk).

Every call order of a failure among chunks in flight, ordered with events
(the store holds chosen calls until the test lets them go): an earlier chunk
fails while a later one is held, a later one fails while an earlier one is
held, the gate closes while a chunk is held, every read times out, and the
task running the load is cancelled while a read is held. In each, no chunk
not yet begun is read, the call returns only after every thread of it
returned, nothing lands after the failure, and the ring gets every region
back once the store's calls ended.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import pytest
import torch
from test_staged import LAYOUT, SENTINEL, Rows, encode, pages, put_raw

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import (
    CorruptSlices,
    Gate,
    HostSink,
    LoadPart,
    StagedLoad,
    TransferRevoked,
)
from layerlift.linker.store_base import ForwardingStore, Store, StoreTimeout
from layerlift.overlap import CpuLane, LayerReadiness, LoadPolicy, LoadScheduler

ROWS = 10
WAIT_S = 10.0


class Held(ForwardingStore):
    """Forwards ``get_ranges``; a call whose first range (key, offset) is in
    ``hold`` (a chunk's first slice: :func:`setup` maps the held chunks to
    theirs) waits for its event first (``let_go(chunk)``; ``release``: every
    one). ``calls`` counts the calls begun, ``in_flight`` and ``most`` those
    inside at once."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.hold: dict[tuple[str, int], threading.Event] = {}
        self.chunks: dict[int, tuple[str, int]] = {}
        self.release = threading.Event()
        self.cond = threading.Condition()
        self.calls = 0
        self.in_flight = 0
        self.most = 0

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        with self.cond:
            mine = self.hold.get((keys[0], src_offsets[0][0]))
            self.calls += 1
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.cond.notify_all()
        try:
            if mine is not None:
                assert self._wait_either(mine), "the test never released a held read"
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def _wait_either(self, mine: threading.Event) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: mine.is_set() or self.release.is_set(), WAIT_S)

    def let_go(self, chunk: int) -> None:
        with self.cond:
            self.hold[self.chunks[chunk]].set()
            self.cond.notify_all()

    def release_all(self) -> None:
        with self.cond:
            self.release.set()
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT_S), "the calls never got there"


class Reports(list[str]):
    """``on_corrupt``'s keys; ``seen`` once it was called (the load's chunks
    are halted before it is: `StagedLoad._chunk`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def __call__(self, keys: list[str]) -> None:
        self.extend(keys)
        self.seen.set()


def setup(*, hold: Sequence[int] = (), corrupt_chunk: int | None = None, depth: int = 2,
          gate: Gate | None = None, inner: MemoryStore | None = None
          ) -> tuple[StagedLoad, Held, StagingRing, Rows, torch.Tensor, list[int], Reports]:
    """Ten pages of three layers through a 16 KiB ring (chunks of 8 KiB at
    depth 2, 4 KiB at depth 4: several chunks); ``corrupt_chunk``: one slice
    of that chunk's first segment flipped in the store."""
    inner = inner if inner is not None else MemoryStore()
    keys = [f"par/p{i}" for i in range(ROWS)]
    src = pages(ROWS, 41)
    objects = {k: bytearray(encode(k, src[i])) for i, k in enumerate(keys)}
    store = Held(inner)
    ring = StagingRing(inner, 16 << 10)
    dest, landed, reported = Rows(ROWS), [], Reports()
    part = LoadPart(LAYOUT, tuple(keys), list(range(ROWS)))

    def on_layer(layer: int, event: object) -> None:
        offset, size = LAYOUT.slices[layer]
        assert torch.equal(dest.rows[:, offset : offset + size], src[:, offset : offset + size]), \
            f"layer {layer} landed before all its bytes were copied"
        landed.append(layer)

    load = StagedLoad(ring, store, [part], [[(0, j)] for j in range(3)], HostSink(dest.scatter),
                      depth=depth, gate=gate, on_layer=on_layer, on_corrupt=reported)
    merged = load._merged()
    assert len(merged) > depth >= 2 and load.fetches_all() and not load.one_call()

    def first(chunk: int) -> tuple[str, int]:  # the key and offset of a chunk's first range
        seg = merged[chunk][0].segments[0]
        return keys[seg.lo], LAYOUT.slices[seg.local][0]

    store.chunks = {k: first(k) for k in hold}
    store.hold = {first(k): threading.Event() for k in hold}
    assert len(store.hold) == len(hold), "two held chunks begin with the same range"
    if corrupt_chunk is not None:
        key, offset = first(corrupt_chunk)
        objects[key][offset + 3] ^= 0xFF
    put_raw(inner, {k: bytes(v) for k, v in objects.items()})
    return load, store, ring, dest, src, landed, reported


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def merged_threads_alive() -> bool:
    return any(t.name.startswith("layerlift-merged") for t in threading.enumerate())


def four_at_once(load: StagedLoad, store: Held) -> None:
    """``fetch_all`` with its first four chunks held: four reads begin and
    a fifth waits for a slot; once released, every chunk is read once and
    never more than four at a time."""
    thread, errors = in_thread(load.fetch_all)
    store.wait_for(lambda: store.in_flight == 4)
    assert store.calls == 4  # a fifth waits for a slot
    store.release_all()
    thread.join(WAIT_S)
    assert not thread.is_alive() and errors == []
    assert store.most == 4 and store.calls == len(load._merged())


def test_depth_chunks_at_once_and_every_layer_lands_in_order_after_its_bytes() -> None:
    load, store, ring, dest, src, landed, _ = setup(hold=range(4), depth=4)
    four_at_once(load, store)
    assert torch.equal(dest.rows, src) and landed == [0, 1, 2]
    assert ring.idle() and load.wait_quiet(WAIT_S) and not merged_threads_alive()


def test_a_later_chunk_fails_while_an_earlier_one_is_held() -> None:
    load, store, ring, dest, _, landed, reported = setup(hold=[0, 1], corrupt_chunk=1)
    thread, errors = in_thread(load.fetch_all)
    store.wait_for(lambda: store.in_flight == 2)  # both begun, both held
    store.let_go(1)
    assert reported.seen.wait(WAIT_S)  # chunk 1 failed (and halted the load) ...
    assert store.in_flight == 1 and store.calls == 2  # ... while chunk 0 is held
    assert thread.is_alive(), "returned while chunk 0's read was still running"
    store.release_all()
    thread.join(WAIT_S)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], CorruptSlices)
    assert store.calls == 2, "a chunk not begun before the failure was read"
    assert reported and set(errors[0].keys) == set(reported)
    # chunk 0 verified after the failure: halted, it copied nothing either
    assert landed == [] and dest.writes == 0 and bool((dest.rows == SENTINEL).all())
    assert ring.wait_idle(WAIT_S) and not merged_threads_alive()


def test_an_earlier_chunk_fails_while_a_later_one_is_held() -> None:
    load, store, ring, dest, _, landed, reported = setup(hold=[0, 1], corrupt_chunk=0)
    thread, errors = in_thread(load.fetch_all)
    store.wait_for(lambda: store.in_flight == 2)  # both begun, both held
    store.let_go(0)
    assert reported.seen.wait(WAIT_S)  # chunk 0 failed while chunk 1 is held
    assert store.in_flight == 1 and store.calls == 2
    assert thread.is_alive(), "returned while chunk 1's read was still running"
    store.release_all()
    thread.join(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], CorruptSlices)
    assert errors[0].layer == 0 and store.calls == 2 and landed == []
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all())
    assert ring.wait_idle(WAIT_S) and not merged_threads_alive()


def test_the_gate_closes_while_a_chunk_is_held() -> None:
    gate = Gate()
    load, store, ring, dest, _, landed, _ = setup(hold=[0, 1], gate=gate)
    thread, errors = in_thread(load.fetch_all)
    store.wait_for(lambda: store.in_flight == 2)
    gate.close()
    store.release_all()
    thread.join(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], TransferRevoked)
    assert dest.writes == 0 and bool((dest.rows == SENTINEL).all()) and landed == []
    assert store.calls == 2 and ring.wait_idle(WAIT_S) and not merged_threads_alive()


def test_every_read_timing_out_keeps_its_staging_until_the_call_ends() -> None:
    inner = MemoryStore(timeout_s=0.2)
    load, store, ring, dest, _, landed, _ = setup(inner=inner)
    inner.stall()
    try:
        with pytest.raises(StoreTimeout) as info:
            load.fetch_all()
        assert info.value.owned and len(load.timed_out) == 2 and store.calls == 2
        assert len(ring.live()) == 2  # both still written into by their calls
        assert not merged_threads_alive()
    finally:
        inner.resume()
    assert all(t.wait_finished(30.0) for t in load.timed_out)
    assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
    assert dest.writes == 0 and landed == []


async def test_cancelling_the_task_while_a_read_is_held_waits_for_the_thread() -> None:
    gate = Gate()
    load, store, ring, dest, _, landed, _ = setup(hold=[0, 1], gate=gate)
    lane = CpuLane(2)
    try:
        sched = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=2, stream_size=3)
        readiness = LayerReadiness(3, default_timeout=WAIT_S)
        task = sched.start(load.all_jobs(), readiness)
        waiter = asyncio.ensure_future(task.done())
        await asyncio.to_thread(store.wait_for, lambda: store.in_flight == 2)
        waiter.cancel()  # the request went away: its waiter is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiter
        task.cancel("request aborted")
        gate.close()  # the worker revokes the load's copies
        quiet = asyncio.ensure_future(task.wait_quiescent())
        await asyncio.sleep(0)
        assert not quiet.done(), "quiescent while a thread still reads into staging"
        store.release_all()
        await asyncio.wait_for(quiet, WAIT_S)
    finally:
        lane.close()
    assert not readiness.all_done() and landed == [] and dest.writes == 0
    assert ring.wait_idle(WAIT_S) and not merged_threads_alive()
