"""In-place offloads of SGLang's host pools: objects put straight from the slots.

The staged offload (``offload.py``) copies a node's units into staging and
puts the copy; this one puts each object from SGLang's pools where its bytes
are (every layer's parts, then its footer): one pass over the bytes (the
CRC) instead of a copy and a pass. The pools are registered with the store
once, at the first in-place offload (``Offloader``), and unregistered when
the offloader stops with no call reading them.

Why it is safe: SGLang keeps the offloaded node locked (its slots neither
freed nor rewritten) until it consumed the offload's result, and the result
is given only after the last call that reads the slots ended. A put that
timed out is waited for, without bound, before the result is given (the
node stays locked meanwhile). The one way the slots can change under a put
is ``reset`` (``Offloader.quiesce``), which SGLang follows by freeing every
slot; so, per chunk:

- its footers are computed over the slots, each object's under the
  offloader's epoch lock after checking that no ``quiesce`` ran since the
  offload was taken (:class:`Revoked` otherwise: nothing more is sent);
- its put is launched (on the put thread, right before it is sent) under
  that lock after the same check, registered as a *flight* (its keys)
  before the lock is dropped, so a ``quiesce`` either comes first (and the
  put is never sent) or sees the flight;
- a ``quiesce`` whose bound passed with a flight still in the air puts the
  flight's keys in the quarantine, *held* (``Quarantine.hold``): no lookup
  offers them, no offload writes them, nothing removes them while the call
  runs; when the call ends the hold is released and the offload thread's
  repair removes the objects, whatever bytes they got.

Chunks and their pipeline are ``linker/in_place.py``'s (``grow``,
``PipelinedPuts``): the first call of ``FIRST_BYTES`` (its footers are all
the first put waits for), each next one twice as large, up to
:data:`PUT_BYTES` bytes and :data:`PUT_BUFFERS` buffers a call; the footers
of the next calls computed while one runs on a put thread. Mooncake's
TCP transport queues at most 1024 transfers a peer by default, every buffer
is one, and the same client's loads share the queue (at depth 4 and a page of
64 tokens they hold about 256), so a call stays at 512. Measured (1 GiB at
page 64, loopback, the puts landing in this process's segment): 34 calls of
at most 256 buffers put in 140 ms, 4 calls of 4000 in 100-105 ms, calls of 8
to 32 MiB alone in 170-200 ms; growing from 8 to 128 MiB (512 buffers) the
offload took 155-175 ms against 215-245 ms staged.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerlift.linker.in_place import FIRST_BYTES, Call, PipelinedPuts, grow
from layerlift.linker.integrity import CHECK_BYTES, crc32c, slice_seed
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import OffloadOutcome
from layerlift.linker.store_base import Store, StoreError

from .layout import OffloadItem, Part, PoolLayout

__all__ = ["FIRST_BYTES", "PUT_BUFFERS", "PUT_BYTES", "Flight", "InPlaceOffload", "OffloadHost",
           "Revoked", "in_place_ok", "pool_spans"]

PUT_BYTES, PUT_BUFFERS = 128 << 20, 512


class Revoked(Exception):
    """The offload was taken before a ``reset``: it must not read the slots."""


@dataclass(slots=True)
class Flight:
    """One in-place put in the air: its keys; ``held`` once a ``quiesce``
    gave up waiting for it and held its keys in the quarantine."""

    keys: tuple[str, ...]
    held: bool = False


class OffloadHost(Protocol):
    """What an in-place offload asks of its offloader (``offload.Offloader``)."""

    @property
    def store(self) -> Store: ...

    @property
    def ring(self) -> StagingRing:
        """Where the footers go (registered; regions taken with ``overflow``)."""
        ...

    def unrevoked(self, epoch: int) -> AbstractContextManager[None]:
        """Held while an object's footer is computed over the slots and while
        a put is launched, on two threads (``quiesce`` waits for it to move
        the epoch); raises
        :class:`Revoked` on entry when a ``quiesce`` ran since ``epoch``."""
        ...

    def register_pools(self) -> None:
        """The pools registered with the store (once); raises StoreError."""
        ...

    def took_off(self, keys: Sequence[str]) -> Flight:
        """A put of ``keys`` is launched (inside :meth:`unrevoked`)."""
        ...

    def landed(self, flight: Flight) -> None:
        """``flight``'s call ended."""
        ...

    def late_put(self, delta: int) -> None:
        """A put timed out (+1), then ended (-1)."""
        ...


def in_place_ok(layout: PoolLayout, min_bytes: int | None) -> bool:
    """Whether ``layout``'s objects are put in place: every part of every
    layer at least ``min_bytes`` (None: never). Below it the store's
    per-buffer cost outweighs the copy it saves."""
    if min_bytes is None or not layout.layers:
        return False
    return all(p.nbytes >= min_bytes for lp in layout.layers for p in lp.parts)


def pool_spans(layouts: Sequence[PoolLayout]) -> list[tuple[int, int]]:
    """``(start, end)`` of every part's tensor in ``layouts``: what an
    in-place put may read (``linker/registered.py`` merges them)."""
    return [_extent(p) for layout in layouts for lp in layout.layers for p in lp.parts]


def _extent(part: Part) -> tuple[int, int]:
    """``(start, end)`` of a part's rows, within its tensor's storage."""
    t = part.tensor
    start = int(t.data_ptr())
    storage = t.untyped_storage()
    end = min(start + int(t.shape[0]) * part.row_bytes,
              int(storage.data_ptr()) + int(storage.nbytes()))
    return start, end


@dataclass(frozen=True, slots=True)
class _Pool:
    """One pool's parts, read off its tensors once per offload: per layer,
    ``(bytes view of the part's rows, row bytes, unit bytes)`` of each part;
    each part's ``(base, row bytes)`` in object order; the call's buffer
    sizes of one object (its parts, then its footer)."""

    views: list[list[tuple[memoryview, int, int]]]
    bases: list[tuple[int, int]]
    sizes: list[int]

    @classmethod
    def of(cls, layout: PoolLayout) -> _Pool:
        views, bases, sizes = [], [], []
        for lp in layout.layers:
            layer = []
            for part in lp.parts:
                start, end = _extent(part)
                view = memoryview((ctypes.c_char * (end - start)).from_address(start)).cast("B")
                layer.append((view, part.row_bytes, part.nbytes))
                bases.append((start, part.row_bytes))
                sizes.append(part.nbytes)
            views.append(layer)
        return cls(views, bases, [*sizes, CHECK_BYTES * len(layout.layers)])


class InPlaceOffload:
    """One offload's ``items`` (host pools, registered) put in place, chunk
    by chunk (the module docstring). Built and run on the offload thread;
    raises :class:`Revoked` when a ``quiesce`` ran since ``epoch``."""

    def __init__(self, offloader: OffloadHost, epoch: int,
                 items: Sequence[OffloadItem]) -> None:
        self.offloader, self.epoch = offloader, epoch
        self.chunks = _plan(items)
        self._pools = {item.layout.name: _Pool.of(item.layout) for item in items}

    def run(self) -> OffloadOutcome:
        try:
            self.offloader.register_pools()
        except StoreError as exc:
            return OffloadOutcome(error=exc)
        puts: PipelinedPuts[list[tuple[OffloadItem, int]]] = PipelinedPuts(
            self.offloader.store, self._footers, launch=self._launch,
            late=self.offloader.late_put)
        return puts.run(self.chunks)

    def _footers(self, chunk: list[tuple[OffloadItem, int]],
                 outcome: OffloadOutcome) -> Call | None:
        """This thread: the chunk's footers computed over the slots into a
        region of the ring (each object's under the epoch lock), and the
        call's lists. None
        (the error in ``outcome``) when no region came; raises
        :class:`Revoked` (the region released) after a ``quiesce``."""
        off = self.offloader
        try:
            footer_bytes = sum(CHECK_BYTES * len(item.layout.layers) for item, _ in chunk)
            region = off.ring.acquire(footer_bytes, timeout_s=off.ring.timeout_s, overflow=True)
        except StoreError as exc:
            outcome.error = exc
            return None
        try:
            call = Call(region)
            table = region.tensor.numpy()
            at = 0
            for item, i in chunk:
                row, key = item.rows[i], item.keys[i]
                pool = self._pools[item.layout.name]
                crcs = [0] * len(pool.views)
                # The lock an object at a time: the put thread's launch of the
                # call before waits for one object's footer at most.
                with off.unrevoked(self.epoch):
                    for j, parts in enumerate(pool.views):
                        crc = slice_seed(key, j)
                        for view, row_bytes, n in parts:
                            lo = row * row_bytes
                            crc = crc32c(view[lo : lo + n], crc)
                        crcs[j] = crc
                footer = np.asarray(crcs, dtype="<u4").view(np.uint8)
                table[at : at + footer.nbytes] = footer
                call.keys.append(key)
                call.ptrs.append([base + row * row_bytes for base, row_bytes in pool.bases]
                                 + [region.ptr + at])
                call.sizes.append(pool.sizes)  # the same for every object of the pool
                at += footer.nbytes
        except BaseException:
            region.release()
            raise
        return call

    def _launch(self, call: Call) -> Callable[[], None]:
        """The put thread, right before the call is sent, under the epoch
        lock: no ``quiesce`` since the offload was taken (else
        :class:`Revoked`: the call is never sent), and the put registered as
        a flight, landed by the put thread once the call ended."""
        off = self.offloader
        with off.unrevoked(self.epoch):
            flight = off.took_off(call.keys)
        return lambda: off.landed(flight)


def _plan(items: Sequence[OffloadItem]) -> list[list[tuple[OffloadItem, int]]]:
    """The items' objects in order, cut into put calls (``linker/in_place.grow``)."""
    objects = [(item, i) for item in items for i in range(len(item.keys))]
    shape = {item.layout.name: (item.layout.object_bytes,
                                sum(len(lp.parts) for lp in item.layout.layers) + 1)
             for item in items}
    runs = grow([shape[item.layout.name] for item, _ in objects], PUT_BYTES, PUT_BUFFERS,
                FIRST_BYTES)
    return [objects[r.start : r.stop] for r in runs]
