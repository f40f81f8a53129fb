"""Small registered host buffers without a registration per use.

Checksum footers (written by every offload, read beside every restored
slice) live in small host buffers the store must be able to read from and
write into. Registering a buffer per put or per batch costs a store call
each time (with an HTTP metadata server, a round trip to it), on the TTFT
path for restores. :class:`ScratchArena` registers one host arena per store
once and hands out regions of it; a request that does not fit gets a buffer
of its own, registered for that use only. `scratch_for(store)` returns the
arena of the store underneath any wrappers (created on first use, forgotten
with that store, which the arena holds weakly).

A region belongs to its holder until `Scratch.release()`: release it only
once no store call that was lent it still runs (see `StoreTimeout`).
"""

from __future__ import annotations

import threading
import weakref

import torch

from layerlift.linker.store_base import Store

__all__ = ["Scratch", "ScratchArena", "scratch_for"]

_ALIGN = 64


class Scratch:
    """One region of registered host memory: ``tensor`` (uint8) at ``ptr``."""

    def __init__(self, tensor: torch.Tensor, ptr: int, arena: ScratchArena | None,
                 start: int, store: Store) -> None:
        self.tensor, self.ptr = tensor, ptr
        self._arena, self._start, self._store = arena, start, store
        self._released = False

    def release(self) -> None:
        """Give the region back (idempotent). A buffer of its own is
        unregistered from the store here."""
        if self._released:
            return
        self._released = True
        if self._arena is not None:
            self._arena.give_back(self._start, self.tensor.numel())
        else:
            self._store.unregister(self.ptr)


class ScratchArena:
    """A host arena registered once with ``store``; first-fit regions. Thread-safe."""

    def __init__(self, store: Store, nbytes: int = 4 << 20) -> None:
        if nbytes <= 0:
            raise ValueError(f"a scratch arena needs a positive size, got {nbytes}")
        # Weak: ``scratch_for`` keys its arenas weakly by store, and a strong
        # reference from the value would keep every store (and its segment)
        # alive for ever (~400 MB per store a fleet replay made).
        self._store = weakref.ref(store)
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._base = 0
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (start, size), sorted

    @property
    def store(self) -> Store:
        """The arena's store; ``RuntimeError`` once it was garbage-collected."""
        store = self._store()
        if store is None:
            raise RuntimeError("this scratch arena's store no longer exists")
        return store

    def take(self, nbytes: int) -> Scratch:
        """A zeroed region of ``nbytes`` bytes (>= 1). Raises StoreError if
        the store refuses to register memory."""
        size = max(1, nbytes)
        rounded = -(-size // _ALIGN) * _ALIGN
        with self._lock:
            if self._buffer is None:
                buffer = torch.zeros(self.nbytes, dtype=torch.uint8)
                self._base = self.store.register(buffer)
                self._buffer = buffer
            for i, (start, free) in enumerate(self._free):
                if free >= rounded:
                    rest = (start + rounded, free - rounded)
                    self._free[i : i + 1] = [rest] if rest[1] else []
                    view = self._buffer[start : start + rounded]
                    view.zero_()
                    return Scratch(view[:size], self._base + start, self, start, self.store)
        own = torch.zeros(size, dtype=torch.uint8)
        return Scratch(own, self.store.register(own), None, 0, self.store)

    def give_back(self, start: int, nbytes: int) -> None:
        rounded = -(-max(1, nbytes) // _ALIGN) * _ALIGN
        with self._lock:
            self._free.append((start, rounded))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free = merged

    def close(self) -> None:
        """Unregister the arena from its store (idempotent), so the memory
        may be freed and a later buffer at the same address registered.
        Call only once no store call that was lent a region still runs;
        a later ``take`` registers a fresh arena. Raises the store's
        ``StoreError`` if it refuses."""
        with self._lock:
            buffer, self._buffer = self._buffer, None
            base, self._base = self._base, 0
            self._free = [(0, self.nbytes)]
        store = self._store()
        if buffer is not None and store is not None:  # a collected store took its registrations
            store.unregister(base)

    @property
    def registered(self) -> bool:
        """Whether the arena's memory is registered with the store now."""
        return self._buffer is not None

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)


_arenas: weakref.WeakKeyDictionary[Store, ScratchArena] = weakref.WeakKeyDictionary()
_arenas_lock = threading.Lock()


def _root(store: Store) -> Store:
    """The store that really holds registrations: wrappers (fault
    injection, checks, modelled costs) expose the store they forward to as
    ``inner`` and forward ``register`` to it."""
    for _ in range(32):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            break
        store = inner
    return store


def scratch_for(store: Store) -> ScratchArena:
    """The scratch arena of ``store``: one per underlying store (wrappers
    share their inner store's), made on first use, forgotten with it. Its
    regions are registered there, so they stay valid for the store's calls
    through any wrapper, and no arena outlives the store that registered
    its memory (nor keeps it alive)."""
    root = _root(store)
    with _arenas_lock:
        arena = _arenas.get(root)
        if arena is None:
            arena = _arenas[root] = ScratchArena(root)
        return arena
