"""Host staging for the SGLang linker: one registered buffer, carved into regions.

Every byte the store reads or writes for the linker passes through here, never
straight through SGLang's slots. That is what makes two promises hold whatever
the store does: a read that outlives its timeout (a stalled master resumes
later) lands in staging the linker still owns, not in slots SGLang has freed
and reused; and a put that outlives its timeout sends the bytes the slots held
when the offload was taken, under their own checksums, never what the slots
hold later.

A :class:`Region` is held by everyone who may still touch it (the batch, each
store call that timed out while using it) and returns to the arena when the
last one lets go. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from layerlift.linker.store_base import Store, StoreTimeout

__all__ = ["Arena", "Region", "hand_over"]

_log = logging.getLogger(__name__)
_ALIGN = 64


class Region:
    """``nbytes`` bytes at ``ptr`` of an :class:`Arena`, held by ``holders`` owners."""

    def __init__(self, arena: Arena, offset: int, nbytes: int) -> None:
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.ptr = arena.base + offset
        self._holders = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        """One more owner (a store call that may still write here)."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("a released staging region cannot be held again")
            self._holders += 1

    def release(self) -> None:
        """One owner fewer; the region returns to the arena with the last one."""
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self.arena._free(self.offset, self.nbytes)

    @property
    def view(self) -> torch.Tensor:
        """The region as a uint8 tensor (shares the arena's memory)."""
        return self.arena.buffer[self.offset : self.offset + self.nbytes]


class Arena:
    """A host buffer of ``nbytes`` registered with ``store`` once, handing out
    regions first-fit. ``allocate`` returns None when no free run is large
    enough (the caller then refuses the load or fails the offload)."""

    def __init__(self, store: Store, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"the staging buffer needs a positive size, got {nbytes} bytes")
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.base = int(self.buffer.data_ptr())
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free_runs: list[tuple[int, int]] = [(0, nbytes)]
        self._store = store
        store.register(self.base, nbytes)

    def allocate(self, nbytes: int) -> Region | None:
        size = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        with self._lock:
            for i, (start, length) in enumerate(self._free_runs):
                if length >= size:
                    rest = (start + size, length - size)
                    self._free_runs[i : i + 1] = [rest] if rest[1] else []
                    return Region(self, start, size)
        return None

    def _free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            runs = sorted([*self._free_runs, (offset, nbytes)])
            merged: list[tuple[int, int]] = []
            for start, length in runs:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free_runs = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free_runs)

    def idle(self) -> bool:
        """True when every region came back (no store call holds staging)."""
        return self.free_bytes == self.nbytes


def hand_over(exc: StoreTimeout, region: Region,
              on_end: Callable[[], None] | None = None) -> None:
    """A store call using ``region`` timed out and may still run: keep the
    region held until the call ended (it then returns to the arena), and mark
    the timeout as owned, so nobody waits for the call before returning."""
    future: Future[Any] | None = exc.future
    exc.owned = True
    if future is None:
        if on_end is not None:
            on_end()
        return
    region.hold()

    def done(_: Future[Any]) -> None:
        region.release()
        if on_end is not None:
            on_end()

    future.add_done_callback(done)
