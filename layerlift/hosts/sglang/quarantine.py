"""Keys whose stored object failed its checks on a load, until the store no
longer has them (the SGLang linker's repair: ``offload.py``'s offload thread
removes them; ``lookup`` offers none of them). Thread-safe; no store calls.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

__all__ = ["Quarantine"]


class Quarantine:
    """Keys whose stored object failed its checks on a load (corrupt, foreign,
    truncated). ``lookup`` treats them as missing; the offload thread removes
    them from the store (Mooncake refuses a remove while a read's lease is
    held: it retries) and forgets a key once the store no longer has it, or
    once an offload replaced it. Thread-safe. ``on_add`` callbacks (the
    offload thread's wake-up) run after a key is added, outside the lock, so
    a removal starts at once rather than at the next offload."""

    def __init__(self) -> None:
        self._keys: dict[str, float] = {}  # key -> when quarantined
        self._held: dict[str, int] = {}  # key -> holds (an in-place put may still write it)
        self._lock = threading.Lock()
        self._on_add: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.removed = 0  # objects this linker removed from the store

    def subscribe(self, on_add: Callable[[], None]) -> None:
        """Call the bound method ``on_add()`` (from the adding thread) whenever
        new keys arrive. Held weakly: the quarantine keeps no offloader alive
        (a reference cycle would leave it, its ring and the ring's store
        registration to the garbage collector)."""
        with self._lock:
            self._on_add.append(weakref.WeakMethod(on_add))

    def add(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            before = len(self._keys)
            for key in keys:
                self._keys.setdefault(key, now)
            grew = len(self._keys) > before
            listeners = list(self._on_add)
        if grew:
            for ref in listeners:
                wake = ref()
                if wake is not None:
                    wake()

    def hold(self, keys: Iterable[str]) -> None:
        """Quarantine ``keys`` and hold them: a put that may still write them
        is in the air (``offload_in_place.py``). A held key stays unoffered
        and is neither removed (:meth:`keys` leaves it out) nor discarded
        until every hold on it was released."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._keys.setdefault(key, now)
                self._held[key] = self._held.get(key, 0) + 1

    def release(self, keys: Iterable[str]) -> None:
        """Drop one hold on each of ``keys``; they stay quarantined (the
        offload thread's repair removes them). Calls no listener: the
        offload thread repairs on its own timer while keys are quarantined."""
        with self._lock:
            for key in keys:
                left = self._held.get(key, 0) - 1
                if left > 0:
                    self._held[key] = left
                else:
                    self._held.pop(key, None)

    def discard(self, keys: Iterable[str]) -> None:
        """Forget ``keys`` (replaced or gone), but those held."""
        with self._lock:
            for key in keys:
                if key not in self._held:
                    self._keys.pop(key, None)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is quarantined (held or not): never offered."""
        with self._lock:
            return [k in self._keys for k in keys]

    def held(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a hold is on it."""
        with self._lock:
            return [k in self._held for k in keys]

    def keys(self) -> list[str]:
        """The quarantined keys that may be removed now (not held)."""
        with self._lock:
            return [k for k in self._keys if k not in self._held]

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
