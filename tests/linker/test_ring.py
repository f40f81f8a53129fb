"""StagingRing: bounded, registered once, regions held by every owner.

Logic on the in-memory store; a Hypothesis state machine checks the ring's
accounting after every operation (every byte comes back, no two live regions
overlap, a region's bytes are not touched by anyone else while it is held).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import ALIGN, Region, StagingRing, StagingTimeout, ring_for
from layerlift.linker.store_base import StoreError, StoreTimeout

STORE = MemoryStore()  # a ring holds its store weakly: keep one alive for the tests


def test_registered_once_and_regions_are_inside_the_registered_buffer() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 4096)
    assert not ring.registered
    regions = [ring.acquire(100) for _ in range(4)]
    assert ring.registered
    registers = [c for c in store.calls if c.method == "register"]
    assert len(registers) == 1, "the ring registers its buffer once, not per region"
    for r in regions:
        r.tensor.fill_(3)
        store.put([f"k{r.ptr}"], [r.ptr], [r.nbytes])  # registered: the store accepts it
        r.release()
    assert ring.idle() and ring.free_bytes == 4096


def test_a_region_larger_than_the_ring_is_refused_with_a_sentence() -> None:
    ring = StagingRing(STORE, 4096)
    with pytest.raises(ValueError, match="does not fit the 4096-byte staging ring"):
        ring.acquire(4097)
    assert not ring.registered  # refused before anything was allocated


def test_a_full_ring_waits_bounded_then_raises_staging_timeout() -> None:
    ring = StagingRing(STORE, 4096, timeout_s=0.05)
    held = ring.acquire(4096)
    with pytest.raises(StagingTimeout, match="came free within"):
        ring.acquire(64)
    assert isinstance(StagingTimeout("x"), StoreError)  # fails a transfer as a store error
    held.release()
    ring.acquire(64, timeout_s=0).release()


def test_a_waiting_acquire_gets_the_region_a_release_returns() -> None:
    ring = StagingRing(STORE, 4096, timeout_s=30.0)
    held = ring.acquire(4096)
    got: list[Region] = []
    waiting = threading.Thread(target=lambda: got.append(ring.acquire(1000)))
    waiting.start()
    held.release()  # wakes the waiter (a condition, no polling)
    waiting.join(30.0)
    assert got and got[0].offset == 0
    got[0].release()


def test_a_handed_over_region_returns_only_when_the_timed_out_call_ended() -> None:
    ring = StagingRing(STORE, 4096)
    region = ring.acquire(512)
    call: Future[None] = Future()
    call.set_running_or_notify_cancel()
    exc = StoreTimeout("late", call)
    ended = threading.Event()
    region.hand_over(exc, ended.set)
    assert exc.owned
    region.release()  # the caller lets go; the call still holds it
    assert not ring.idle() and ring.live() == [(0, 512)]
    again = ring.acquire(512)
    assert again.offset != region.offset, "a region held by a running call was lent again"
    again.release()
    call.set_result(None)
    assert ended.is_set() and ring.idle()


def test_release_after_waits_for_the_event() -> None:
    class Event:
        def __init__(self) -> None:
            self.done = threading.Event()

        def record(self, stream: object = None) -> None: ...

        def wait(self, stream: object = None) -> None: ...

        def query(self) -> bool:
            return self.done.is_set()

        def synchronize(self) -> None:
            self.done.wait()

        def elapsed_time(self, end_event: object) -> float:
            return 0.0

    ring = StagingRing(STORE, 4096)
    region = ring.acquire(100)
    event = Event()
    freed = threading.Event()
    region.on_free(freed.set)
    region.release_after(event)
    assert not freed.is_set() and not ring.idle()
    event.done.set()
    assert freed.wait(30.0) and ring.wait_idle(30.0)


def test_overflow_gives_a_registered_buffer_of_its_own_and_unregisters_it() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 256)
    own = ring.acquire(1000, overflow=True, zero=True)
    assert own.own and own.nbytes == 1000 and int(own.tensor.sum()) == 0
    store.put(["k"], [own.ptr], [1000])
    own.release()
    with pytest.raises(StoreError):
        store.unregister(own.ptr)  # already unregistered
    assert ring.idle()


def test_close_defers_while_a_region_is_held_and_a_later_acquire_registers_again() -> None:
    store = MemoryStore()
    ring = StagingRing(store, 4096)
    region = ring.acquire(64)
    base = ring.acquire(64)
    base.release()
    assert ring.close() is False and ring.registered
    region.release()  # the last one: now unregistered
    assert not ring.registered
    with pytest.raises(StoreError):
        store.unregister(region.ptr)
    ring.acquire(10).release()
    assert ring.registered and ring.close() is True and ring.close() is True


def test_ring_for_is_shared_through_wrappers_and_does_not_keep_the_store_alive() -> None:
    import gc
    import weakref

    from layerlift.linker.store_base import ForwardingStore

    store = MemoryStore()
    assert ring_for(ForwardingStore(store)) is ring_for(store)
    ring_for(store).acquire(64).release()
    gone = weakref.ref(store)
    del store
    gc.collect()
    assert gone() is None, "the ring kept its store alive"


def test_release_too_many_raises() -> None:
    region = StagingRing(STORE, 4096).acquire(1)
    region.release()
    with pytest.raises(RuntimeError):
        region.release()
    with pytest.raises(RuntimeError):
        region.hold()


class RingAccounting(RuleBasedStateMachine):
    """Random acquires, holds, hand-overs and releases; after every step the
    ring's books must balance and every live region keep its own bytes."""

    CAPACITY = 16 * ALIGN

    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryStore()
        self.ring = StagingRing(self.store, self.CAPACITY, timeout_s=0.0)
        self.held: list[tuple[Region, int, int]] = []  # region, holds by us, its byte tag
        self.calls: list[tuple[Region, Future[None]]] = []  # running calls holding a region
        self.tag = 0

    @rule(size=st.integers(1, 6 * ALIGN))
    def acquire(self, size: int) -> None:
        try:
            region = self.ring.acquire(size)
        except StagingTimeout:
            assert self.ring.largest_free() < self.ring.span(size)
            return
        self.tag = self.tag % 250 + 1
        region.tensor.fill_(self.tag)
        self.held.append((region, 1, self.tag))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def hold(self, i: int) -> None:
        region, n, tag = self.held[i % len(self.held)]
        region.hold()
        self.held[i % len(self.held)] = (region, n + 1, tag)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        k = i % len(self.held)
        region, n, tag = self.held[k]
        region.release()
        if n == 1:
            self.held.pop(k)
        else:
            self.held[k] = (region, n - 1, tag)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def time_out(self, i: int) -> None:
        """A store call lent the region times out: it holds the region on."""
        region = self.held[i % len(self.held)][0]
        call: Future[None] = Future()
        call.set_running_or_notify_cancel()
        region.hand_over(StoreTimeout("late", call))
        self.calls.append((region, call))

    @precondition(lambda self: self.calls)
    @rule(i=st.integers(0, 1000))
    def call_ends(self, i: int) -> None:
        _, call = self.calls.pop(i % len(self.calls))
        call.set_result(None)

    @invariant()
    def books_balance(self) -> None:
        live = self.ring.live()
        ends = 0
        for offset, span in live:
            assert offset >= ends, f"live regions overlap at {offset}"
            assert offset % ALIGN == 0 and span % ALIGN == 0
            ends = offset + span
        assert ends <= self.CAPACITY
        assert self.ring.free_bytes + sum(s for _, s in live) == self.CAPACITY
        ours = {r.offset for r, _, _ in self.held} | {r.offset for r, _ in self.calls}
        assert {o for o, _ in live} == ours, "a region returned early or never returned"
        for region, _, tag in self.held:
            assert bool((region.tensor == tag).all()), "a live region's bytes were lent again"

    def teardown(self) -> None:
        for region, n, _ in self.held:
            for _ in range(n):
                region.release()
        for _, call in self.calls:
            call.set_result(None)
        assert self.ring.idle() and self.ring.free_bytes == self.CAPACITY


RingAccounting.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_ring_accounting = RingAccounting.TestCase


def test_zeroed_regions_start_at_zero() -> None:
    ring = StagingRing(STORE, 4096)
    r = ring.acquire(128)
    r.tensor.fill_(9)
    r.release()
    z = ring.acquire(128, zero=True)
    assert torch.count_nonzero(z.tensor) == 0
    z.release()
