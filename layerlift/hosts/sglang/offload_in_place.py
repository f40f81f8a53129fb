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

- its footers are computed over the slots under the offloader's epoch lock,
  after checking that no ``quiesce`` ran since the offload was taken
  (:class:`Revoked` otherwise: nothing more is sent);
- its put is launched under that lock after the same check, registered as a
  *flight* (its keys) before the lock is dropped, so a ``quiesce`` either
  comes first (and the put is never sent) or sees the flight;
- a ``quiesce`` whose bound passed with a flight still in the air puts the
  flight's keys in the quarantine, *held* (``Quarantine.hold``): no lookup
  offers them, no offload writes them, nothing removes them while the call
  runs; when the call ends the hold is released and the offload thread's
  repair removes the objects, whatever bytes they got.

Chunks: the first of :data:`FIRST_BYTES` (its footers are all the first
put waits for), each next one twice as large, up to :data:`PUT_BYTES` bytes
and :data:`PUT_BUFFERS` buffers a call. Mooncake's TCP transport queues at
most 1024 transfers a peer by default (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``;
every buffer is one, and the same client's loads share the queue: at depth 4
and a page of 64 tokens they hold about 256), so a call stays at 512. Measured
(1 GiB at page 64, loopback, the puts landing in this process's segment): 34
calls of at most 256 buffers put in 140 ms, 4 calls of 4000 in 100-105 ms,
calls of 8 to 32 MiB alone in 170-200 ms; growing from 8 to 128 MiB (512
buffers) the offload took 155-175 ms against 215-245 ms staged. The footers
of chunk ``k + 1`` are computed while chunk ``k`` is put, on a put thread of
the offload; the puts stay one at a time and in order, chunk
``k + 1`` is launched only once chunk ``k`` succeeded, and :meth:`run`
returns (or raises) only after the put thread returned.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerlift.linker.integrity import CHECK_BYTES, crc32, slice_seed
from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.staged import OffloadOutcome
from layerlift.linker.store_base import Store, StoreError, StoreIOError, StoreTimeout

from .layout import OffloadItem, Part, PoolLayout

__all__ = ["FIRST_BYTES", "PUT_BUFFERS", "PUT_BYTES", "Flight", "InPlaceOffload", "OffloadHost",
           "Revoked", "in_place_ok", "pool_spans"]

PUT_BYTES, PUT_BUFFERS = 128 << 20, 512
FIRST_BYTES = 8 << 20


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

    @property
    def epoch_lock(self) -> threading.Lock:
        """Held while footers are computed over the slots and while a put is
        launched; ``quiesce`` takes it to move the epoch."""
        ...

    def current(self, epoch: int) -> bool:
        """No ``quiesce`` since ``epoch`` (asked under :attr:`epoch_lock`)."""
        ...

    def register_pools(self) -> None:
        """The pools registered with the store (once); raises StoreError."""
        ...

    def took_off(self, keys: Sequence[str]) -> Flight:
        """A put of ``keys`` is launched (under :attr:`epoch_lock`)."""
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


@dataclass(slots=True)
class _Chunk:
    """One put call: the objects ``(item, index)`` it carries."""

    objects: list[tuple[OffloadItem, int]]
    footer_bytes: int


@dataclass(slots=True)
class _Ready:
    """A chunk whose footers are computed: its region and the call's lists."""

    region: Region
    keys: list[str]
    ptrs: list[list[int]]
    sizes: list[list[int]]


@dataclass(slots=True)
class _Result:
    ready: _Ready
    error: StoreError | None
    late: bool = False


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
        outcome = OffloadOutcome()
        try:
            self.offloader.register_pools()
        except StoreError as exc:
            outcome.error = exc
            return outcome
        putter = ThreadPoolExecutor(1, thread_name_prefix="layerlift-put") \
            if len(self.chunks) > 1 else None
        pending: Future[_Result] | None = None
        try:
            for chunk in self.chunks:
                ready = self._footers(chunk, outcome)
                try:
                    if pending is not None:
                        done, pending = pending, None
                        if not _account(done.result(), outcome):
                            break
                    if ready is None:
                        break
                    flight = self._launch(ready)
                    sending, ready = ready, None  # the put releases its region now
                    pending = _submit(putter, self._put, sending, flight)
                finally:
                    if ready is not None:  # computed, never sent
                        ready.region.release()
            if pending is not None:
                done, pending = pending, None
                _account(done.result(), outcome)
        finally:
            if pending is not None:  # something raised: the put still ends first
                wait([pending])
            if putter is not None:
                putter.shutdown(wait=True)
        return outcome

    def _footers(self, chunk: _Chunk, outcome: OffloadOutcome) -> _Ready | None:
        """This thread, under the epoch lock: the chunk's footers computed
        over the slots into a region of the ring, and the call's lists. None
        (the error in ``outcome``) when no region came; raises
        :class:`Revoked` (the region released) after a ``quiesce``."""
        off = self.offloader
        try:
            region = off.ring.acquire(chunk.footer_bytes, timeout_s=off.ring.timeout_s,
                                       overflow=True)
        except StoreError as exc:
            outcome.error = exc
            return None
        try:
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            table = region.tensor.numpy()
            at = 0
            with off.epoch_lock:
                if not off.current(self.epoch):
                    raise Revoked
                for item, i in chunk.objects:
                    row, key = item.rows[i], item.keys[i]
                    pool = self._pools[item.layout.name]
                    crcs = [0] * len(pool.views)
                    for j, parts in enumerate(pool.views):
                        crc = slice_seed(key, j)
                        for view, row_bytes, n in parts:
                            lo = row * row_bytes
                            crc = crc32(view[lo : lo + n], crc)
                        crcs[j] = crc
                    footer = np.asarray(crcs, dtype="<u4").view(np.uint8)
                    table[at : at + footer.nbytes] = footer
                    keys.append(key)
                    ptrs.append([base + row * row_bytes for base, row_bytes in pool.bases]
                                + [region.ptr + at])
                    sizes.append(pool.sizes)  # the same for every object of the pool
                    at += footer.nbytes
        except BaseException:
            region.release()
            raise
        return _Ready(region, keys, ptrs, sizes)

    def _launch(self, ready: _Ready) -> Flight:
        """Under the epoch lock: no ``quiesce`` since the offload was taken
        (else :class:`Revoked`), and the put registered as a flight."""
        off = self.offloader
        with off.epoch_lock:
            if not off.current(self.epoch):
                raise Revoked
            return off.took_off(ready.keys)

    def _put(self, ready: _Ready, flight: Flight) -> _Result:
        """The put thread (or this one): one ``put_parts``; a put that timed
        out waited for until it ended; then the region released and the
        flight landed."""
        off = self.offloader
        try:
            try:
                off.store.put_parts(ready.keys, ready.ptrs, ready.sizes)
            except StoreTimeout as exc:
                off.late_put(+1)
                try:
                    if not exc.wait_finished():  # the slots are the call's until it ended
                        return _Result(ready, _late_failure(exc))
                finally:
                    off.late_put(-1)
                return _Result(ready, None, late=True)
            except StoreError as exc:
                return _Result(ready, exc)
            return _Result(ready, None)
        finally:
            ready.region.release()
            off.landed(flight)


def _late_failure(exc: StoreTimeout) -> StoreError:
    """What a put that timed out ended with, once it ended and failed."""
    future = exc.future
    error = future.exception() if future is not None and not future.cancelled() else None
    if isinstance(error, StoreError):
        return error
    return StoreIOError(f"a put timed out and then failed: {error or exc}")


def _plan(items: Sequence[OffloadItem]) -> list[_Chunk]:
    """The items' objects in order, cut into calls: the first of `FIRST_BYTES`
    (its footers are all the put waits for), each next one twice the one
    before, up to `PUT_BYTES` bytes and `PUT_BUFFERS` buffers (one object
    at least)."""
    chunks: list[_Chunk] = []
    nbytes = count = 0
    limit = FIRST_BYTES
    for item in items:
        layout = item.layout
        size = layout.object_bytes
        buffers = sum(len(lp.parts) for lp in layout.layers) + 1
        footer = CHECK_BYTES * len(layout.layers)
        for i in range(len(item.keys)):
            if chunks and nbytes + size <= limit and count + buffers <= PUT_BUFFERS:
                chunks[-1].objects.append((item, i))
                chunks[-1].footer_bytes += footer
                nbytes, count = nbytes + size, count + buffers
            else:
                if chunks:
                    limit = min(2 * limit, PUT_BYTES)
                chunks.append(_Chunk([(item, i)], footer))
                nbytes, count = size, buffers
    return chunks


def _submit(putter: ThreadPoolExecutor | None, fn: Callable[[_Ready, Flight], _Result],
            ready: _Ready, flight: Flight) -> Future[_Result]:
    """``fn(ready, flight)`` on the put thread, or here and now (one chunk)."""
    if putter is not None:
        return putter.submit(fn, ready, flight)
    done: Future[_Result] = Future()
    done.set_result(fn(ready, flight))
    return done


def _account(result: _Result, outcome: OffloadOutcome) -> bool:
    """``result`` into ``outcome``; whether the offload goes on."""
    if result.error is not None:
        outcome.error = result.error
        return False
    outcome.late += result.late
    outcome.objects += len(result.ready.keys)
    outcome.bytes += sum(sum(row) for row in result.ready.sizes)
    return True
