"""The staging ring's registration: regions of one registered buffer; close
unregisters it and a later acquire registers again. The engine's ring
(``ring_for``) holds its store weakly."""

from __future__ import annotations

import threading

import pytest

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing, drain_janitor
from layerlift.linker.store_base import StoreError


def test_close_unregisters_and_a_later_take_registers_again() -> None:
    store = MemoryStore()
    arena = StagingRing(store, 4096, timeout_s=0.0)
    first = arena.acquire(100, zero=True)
    assert arena.registered
    first.release()
    arena.close()
    assert not arena.registered and arena.free_bytes == 4096
    with pytest.raises(StoreError):
        store.unregister(first.ptr)  # it is not registered any more
    again = arena.acquire(100, zero=True)
    assert arena.registered
    again.tensor.fill_(7)
    again.release()
    arena.close()
    arena.close()  # idempotent


def test_an_arena_does_not_keep_its_store_alive() -> None:
    """``ring_for`` (formerly ``scratch_for``) keys rings weakly by store; the
    ring must not hold the store strongly, or no store would ever be freed (a
    fleet replay grew ~1 GB per grid cell)."""
    import gc
    import weakref

    from layerlift.linker.ring import ring_for

    store = MemoryStore()
    region = ring_for(store).acquire(64, zero=True, overflow=True)
    region.release()
    gone = weakref.ref(store)
    del store, region
    gc.collect()
    assert gone() is None, "the staging ring kept its store alive"


def test_a_ring_dropped_inside_a_store_call_does_not_deadlock() -> None:
    """A ring's finalizer runs wherever the garbage collector runs: here, on a
    thread that holds the store's own (non-reentrant) lock, as a collection
    inside a store call would. It hands the unregistration to a janitor thread
    instead of calling the store there (that call waited on the lock forever),
    and the registration is gone once the lock is free."""
    import gc

    store = MemoryStore()
    ring = StagingRing(store, 4096)
    ring.acquire(64).release()  # registers its buffer
    assert len(store._registered) == 1
    with store._lock:
        del ring
        gc.collect()  # the finalizer ran here, under the store's lock, and returned
        assert len(store._registered) == 1
    assert drain_janitor(10.0), "the janitor never came round"
    assert not store._registered, "the dropped ring was never unregistered"


class _GatedUnregister(MemoryStore):
    """A store whose ``unregister`` waits for a gate (the janitor held mid-call)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def unregister(self, ptr: int) -> None:
        assert self.gate.wait(10.0)
        super().unregister(ptr)


def test_a_dropped_rings_buffer_lives_until_its_unregistration() -> None:
    """CI found this: the janitor unregistered a dropped ring late, but its
    buffer was freed at once; the next ring's buffer got the same address and
    its registration was refused as an overlap (or, a moment later, would have
    been dropped by the late unregistration of the old one). The buffer now
    goes with the janitor's job and is freed only after ``unregister``."""
    import gc
    import weakref

    store = _GatedUnregister()
    ring = StagingRing(store, 4096)
    ring.acquire(64).release()
    assert ring.buffer is not None
    old_buffer = weakref.ref(ring.buffer)
    del ring
    gc.collect()  # the janitor now waits inside unregister
    assert old_buffer() is not None, "a still-registered buffer was freed"
    fresh = StagingRing(store, 4096)
    fresh.acquire(64).release()  # a new address, so the store takes it
    assert fresh.buffer is not None
    base = fresh.buffer.data_ptr()
    store.gate.set()
    assert drain_janitor(10.0)
    assert old_buffer() is None, "the janitor kept the buffer after unregistering it"
    assert list(store._registered) == [base], "the late unregistration dropped the new ring's"
    fresh.close()
    assert not store._registered
