"""The staging ring's registration: regions of one registered buffer; close
unregisters it and a later acquire registers again. The engine's ring
(``ring_for``) holds its store weakly."""

from __future__ import annotations

import pytest

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
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
