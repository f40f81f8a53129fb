"""The staging ring: one bounded host buffer, registered with the store once, lent out in regions.

Every byte a staged transfer (``linker/staged.py``) moves between the store and
a host's memory passes through a :class:`StagingRing`: the store reads into it
and writes from it, never straight into memory the host may free or reuse. The
engine's checksum footers (``engine/loads.py``, ``engine/offload.py``), the
SGLang linker and the vLLM worker each take their regions from a ring; none
keeps an arena of its own.

Size and registration. A ring has a fixed ``capacity`` (default
:data:`DEFAULT_RING_BYTES`, 64 MiB). Its buffer is allocated and registered
with the store on first use (or by :meth:`StagingRing.open`), once, and stays
registered until :meth:`StagingRing.close`. ``alloc`` chooses the memory:
plain host memory by default, pinned memory for a device path
(``Device.pinned`` of ``overlap/device.py``). The ring holds its store
weakly: it never keeps a store alive, and it is useless once the store is gone
(``RuntimeError``). :func:`ring_for` returns the one small ring of a store
(the store under any wrappers), made on first use, forgotten with the store:
the engine's footers use it.

Ownership. :meth:`StagingRing.acquire` returns a :class:`Region` with one
holder (the caller). A region is held by every party that may still touch its
bytes and returns to the ring when the last one lets go:

* the caller, until :meth:`Region.release`;
* a store call lent the region that timed out and may still run (a stalled
  master resumes later, Mooncake's worker goes on):
  :meth:`Region.hand_over` adds that call as a holder, released from the
  call's own completion, and marks the ``StoreTimeout`` owned, so whoever
  would wait for the call before freeing memory need not. A read that outlives
  its timeout therefore lands in staging still owned (never in memory given
  back to anyone), and a put that outlives it sends the bytes the region held
  when it was issued;
* a device copy that reads the region (pinned staging of an H2D copy):
  :meth:`Region.release_after` releases it only once an event recorded after
  the copy completed (a watcher thread of the ring waits for it).

A region is never handed out twice while held (the accounting test checks it
after every operation), and every byte comes back: ``free_bytes`` returns to
``capacity`` once no holder is left (``idle()``).

Waiting and errors. ``acquire`` never allocates beyond the capacity:

* a request larger than the ring raises ``ValueError`` with a sentence (a
  staged transfer sizes its chunks so that this cannot happen, and checks
  that one object's slice fits before it starts);
* when no free run is large enough it waits, bounded by ``timeout_s``, for
  holders to give regions back, then raises :class:`StagingTimeout` (a
  ``StoreError``: the transfer fails as a store failure would, nothing was
  written anywhere). ``timeout_s=0`` does not wait;
* ``overflow=True`` is for small bookkeeping buffers (the engine's footers):
  a request that does not fit *now* gets a buffer of its own, registered for
  that region only and unregistered when it returns, instead of waiting or
  raising. Staged chunks never use it;
* the store's ``StoreError`` if it refuses the registration.

Threads. Every method may be called from any thread; one lock guards the free
list and a condition wakes waiters when a region returns. A region's holders
are counted under the region's own lock; its last release takes the ring's
lock. Nothing here calls the store while holding a lock except the one-time
registration.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from layerlift.linker.store_base import Store, StoreError, StoreTimeout
from layerlift.overlap.device import DeviceEvent

_log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RING_BYTES",
    "FOOTER_RING_BYTES",
    "Region",
    "StagingRing",
    "StagingTimeout",
    "ring_for",
]

DEFAULT_RING_BYTES = 64 << 20
"""The default staging of the hosts' adapters: any transfer size streams through it."""

FOOTER_RING_BYTES = 4 << 20
"""The size of :func:`ring_for`'s ring (the engine's checksum footers only)."""

ALIGN = 64
"""Every region starts on a multiple of this many bytes of the buffer."""


class StagingTimeout(StoreError):
    """No region of the requested size came free within the bounded wait: the
    ring is held by other transfers (or by store calls that timed out and still
    run). Nothing was written; the transfer fails as on a store error."""


def _rounded(nbytes: int) -> int:
    return -(-max(1, nbytes) // ALIGN) * ALIGN


class Region:
    """``nbytes`` bytes of registered memory at ``ptr``; ``tensor`` is the uint8
    view of them. Held by every owner that may still touch it (see the module
    docstring); returns to its ring with the last release."""

    def __init__(self, ring: StagingRing, tensor: torch.Tensor, ptr: int, offset: int,
                 span: int, own: bool) -> None:
        self.ring, self.tensor, self.ptr = ring, tensor, ptr
        self.offset = offset  # in the ring's buffer (0 for a buffer of its own)
        self.span = span  # bytes it occupies in the buffer (rounded up to ALIGN)
        self.own = own  # an overflow buffer of its own (registered for this region)
        self._holders = 1
        self._lock = threading.Lock()
        self._on_free: list[Callable[[], None]] = []

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def held(self) -> bool:
        """Whether any owner still holds the region."""
        with self._lock:
            return self._holders > 0

    def hold(self) -> None:
        """One more owner. ``RuntimeError`` once the region returned."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("a staging region that returned cannot be held again")
            self._holders += 1

    def release(self) -> None:
        """One owner fewer; the last one returns the region to the ring and
        runs the ``on_free`` callbacks. ``RuntimeError`` on a release too many."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("a staging region was released more often than held")
            self._holders -= 1
            last = self._holders == 0
            callbacks, self._on_free = (self._on_free, []) if last else ([], self._on_free)
        if last:
            self.ring._give_back(self)
            for callback in callbacks:
                callback()

    def on_free(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the region returned to the ring (at once if it
        already did). Runs on the thread of the last release."""
        with self._lock:
            if self._holders > 0:
                self._on_free.append(callback)
                return
        callback()

    def hand_over(self, exc: StoreTimeout, on_end: Callable[[], None] | None = None) -> None:
        """A store call lent this region timed out and may still run: hold the
        region until the call really ended (it then returns with the call's
        completion), and mark ``exc`` owned, so nobody waits for the call before
        freeing other memory. ``on_end`` runs once the call ended (at once when
        nothing runs on). The caller still releases its own hold as usual."""
        future: Future[Any] | None = exc.future
        exc.owned = True
        if future is None:  # cancelled before it started: nothing runs on
            if on_end is not None:
                on_end()
            return
        self.hold()

        def ended(_: Future[Any]) -> None:
            self.release()
            if on_end is not None:
                on_end()

        future.add_done_callback(ended)

    def release_after(self, event: DeviceEvent | None) -> None:
        """Release the caller's hold once ``event`` (recorded after every device
        copy that reads this region) completed; None: release now. Never blocks:
        the ring's watcher thread waits for the event."""
        if event is None or event.query():
            self.release()
            return
        self.ring._watch(event, self)


class StagingRing:
    """A bounded host buffer registered with ``store`` once; regions first-fit
    (see the module docstring for ownership, waiting and errors). Thread-safe."""

    def __init__(self, store: Store, nbytes: int = DEFAULT_RING_BYTES, *,
                 alloc: Callable[[int], torch.Tensor] | None = None,
                 timeout_s: float | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a staging ring needs a positive size, got {nbytes} bytes")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"the ring's wait for free space must be >= 0 s, got {timeout_s}")
        self._store = weakref.ref(store)
        self.capacity = nbytes
        # The default bound of a wait for space: the store's call timeout (a
        # region held longer is held by a call that timed out and still runs).
        self.timeout_s = store.timeout_s if timeout_s is None else timeout_s
        self._alloc = alloc
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._buffer: torch.Tensor | None = None
        self._base = 0
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (start, size), sorted, merged
        self._live: dict[int, int] = {}  # start -> span of every region out of the buffer
        self._own = 0  # overflow regions out
        self._close_pending = False
        self._watcher: queue.SimpleQueue[tuple[DeviceEvent, Region]] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def store(self) -> Store:
        """The ring's store; ``RuntimeError`` once it was garbage-collected."""
        store = self._store()
        if store is None:
            raise RuntimeError("this staging ring's store no longer exists")
        return store

    def span(self, nbytes: int) -> int:
        """The bytes of the buffer a region of ``nbytes`` occupies (aligned)."""
        return _rounded(nbytes)

    def fits(self, nbytes: int) -> bool:
        """Whether a region of ``nbytes`` can ever be lent (it fits the capacity)."""
        return _rounded(nbytes) <= self.capacity

    # ---- lending -----------------------------------------------------------------

    def open(self) -> None:
        """Allocate and register the buffer now (else on the first ``acquire``).
        Raises the store's ``StoreError`` if it refuses."""
        with self._lock:
            self._open_locked()

    def _open_locked(self) -> torch.Tensor:
        self._close_pending = False
        if self._buffer is None:
            buffer = (self._alloc(self.capacity) if self._alloc is not None
                      else torch.zeros(self.capacity, dtype=torch.uint8))
            if buffer.dtype != torch.uint8 or buffer.numel() != self.capacity:
                raise ValueError(f"the ring's allocator must return {self.capacity} uint8 bytes")
            self._base = self.store.register(buffer)
            self._buffer = buffer
            # A ring dropped while registered (no region is alive then: each
            # holds its ring) unregisters, so the address may be registered again.
            # The finalizer holds the buffer until the janitor has unregistered
            # it: freed earlier, its address could be lent to a new ring's buffer
            # and the late unregistration would then drop *that* registration.
            self._finalizer = weakref.finalize(self, _unregister_quietly, self._store,
                                               self._base, buffer)
        return self._buffer

    def acquire(self, nbytes: int, *, timeout_s: float | None = None, zero: bool = False,
                overflow: bool = False) -> Region:
        """A region of ``nbytes`` (>= 1) bytes with the caller as its one holder.

        Waits at most ``timeout_s`` (None: the ring's ``timeout_s``) for a free
        run, then raises :class:`StagingTimeout`; ``ValueError`` if ``nbytes``
        exceeds the capacity (unless ``overflow``). ``zero`` zeroes the bytes.
        ``overflow``: when nothing fits now, a buffer of its own (registered for
        this region) instead of waiting (see the module docstring)."""
        size = max(1, nbytes)
        span = _rounded(size)
        if span > self.capacity and not overflow:
            raise ValueError(
                f"a staging region of {size} bytes does not fit the {self.capacity}-byte "
                f"staging ring; stream the transfer in smaller chunks or give the ring "
                f"at least {span} bytes")
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        with self._lock:
            buffer = self._open_locked()
            while True:
                start = self._take(span)
                if start is not None:
                    view = buffer[start : start + size]
                    if zero:
                        view.zero_()
                    return Region(self, view, self._base + start, start, span, own=False)
                if overflow:
                    self._own += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(
                        f"no {size}-byte region of the {self.capacity}-byte staging ring came "
                        f"free within {wait_s:g} s ({self.free_bytes_locked()} bytes free in "
                        f"{len(self._live)} held regions' gaps; a store call that timed out "
                        "and still runs may hold them)")
                self._freed.wait(left)
        own = torch.zeros(size, dtype=torch.uint8)
        try:
            ptr = self.store.register(own)
        except BaseException:
            with self._lock:
                self._own -= 1
            raise
        return Region(self, own, ptr, 0, span, own=True)

    def _take(self, span: int) -> int | None:
        for i, (start, free) in enumerate(self._free):
            if free >= span:
                rest = (start + span, free - span)
                self._free[i : i + 1] = [rest] if rest[1] else []
                self._live[start] = span
                return start
        return None

    def _give_back(self, region: Region) -> None:
        if region.own:
            store = self._store()
            with self._lock:
                self._own -= 1
            if store is not None:
                store.unregister(region.ptr)
            return
        unregister: tuple[Store, int] | None = None
        with self._lock:
            span = self._live.pop(region.offset)
            assert span == region.span, "a region returned with another span than it was lent"
            self._free.append((region.offset, span))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free = merged
            self._freed.notify_all()
            if self._close_pending and not self._live:
                unregister = self._close_locked()
        if unregister is not None:
            unregister[0].unregister(unregister[1])

    def _watch(self, event: DeviceEvent, region: Region) -> None:
        """Release ``region`` once ``event`` completed, on the watcher thread
        (one FIFO: events of one load stream complete in order; an event of
        another stream may wait behind a later one, so a release can come
        late, never early)."""
        with self._lock:
            if self._watcher is None:
                self._watcher = queue.SimpleQueue()
                threading.Thread(target=_watch_events, args=(self._watcher,),
                                 name="layerlift-ring-events", daemon=True).start()
            self._watcher.put((event, region))

    # ---- the ring's state -------------------------------------------------------

    def close(self) -> bool:
        """Unregister the buffer from the store, so the memory may be freed and a
        later buffer at the same address registered (idempotent). With regions
        still held (a timed-out call), the unregistration waits for the last one
        to return and ``close`` returns False; an ``acquire`` meanwhile keeps the
        ring open. Returns True once unregistered now. A later ``acquire``
        registers a fresh buffer. Raises the store's ``StoreError`` if it refuses."""
        with self._lock:
            if self._live:
                self._close_pending = True
                return False
            unregister = self._close_locked()
        if unregister is not None:
            unregister[0].unregister(unregister[1])
        return True

    def _close_locked(self) -> tuple[Store, int] | None:
        buffer, self._buffer = self._buffer, None
        base, self._base = self._base, 0
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._free = [(0, self.capacity)]
        self._close_pending = False
        store = self._store()
        if buffer is None or store is None:  # a collected store took its registrations
            return None
        return store, base

    @property
    def registered(self) -> bool:
        """Whether the ring's buffer is registered with the store now."""
        return self._buffer is not None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The ring's buffer (None before the first use / after ``close``)."""
        return self._buffer

    def free_bytes_locked(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffer not lent out (aligned spans)."""
        with self._lock:
            return self.free_bytes_locked()

    def largest_free(self) -> int:
        """The largest region that ``acquire`` would lend without waiting."""
        with self._lock:
            return max((n for _, n in self._free), default=0)

    def live(self) -> list[tuple[int, int]]:
        """``(offset, span)`` of every region lent out of the buffer, by offset."""
        with self._lock:
            return sorted(self._live.items())

    def idle(self) -> bool:
        """True when every region came back (no holder of any region is left)."""
        with self._lock:
            return not self._live and not self._own

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until ``idle()`` (at most ``timeout_s``); returns ``idle()``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._live or self._own:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._freed.wait(left)
            return True


_JanitorJob = tuple[weakref.ref[Store], int, torch.Tensor] | threading.Event
_janitor_jobs: queue.SimpleQueue[_JanitorJob] = queue.SimpleQueue()
_janitor_lock = threading.Lock()
_janitor: threading.Thread | None = None


def _unregister_quietly(store_ref: weakref.ref[Store], base: int,
                        buffer: torch.Tensor) -> None:
    """A dropped ring's finalizer. It may run wherever the garbage collector
    runs, even on a thread inside one of the store's own calls (holding the
    store's lock): so it only hands the unregistration to the janitor thread,
    with the buffer, which the janitor lets go only once it is unregistered."""
    _janitor_jobs.put((store_ref, base, buffer))
    _start_janitor()


def drain_janitor(timeout_s: float | None = None) -> bool:
    """Block until every dropped ring queued so far is unregistered (tests,
    and a host's shutdown). Returns False if ``timeout_s`` ran out first."""
    done = threading.Event()
    _janitor_jobs.put(done)
    _start_janitor()
    return done.wait(timeout_s)


def _start_janitor() -> None:
    """Start the janitor unless it runs (or a fork left its thread behind).
    Never blocks: a finalizer may run in the middle of this very function
    (a collection while the thread is being made). Whoever holds the lock
    then is starting the janitor, which will find the job in the queue."""
    global _janitor
    if _janitor is not None and _janitor.is_alive():
        return
    if not _janitor_lock.acquire(blocking=False):
        return
    try:
        if _janitor is None or not _janitor.is_alive():
            _janitor = threading.Thread(target=_unregister_dropped, name="layerlift-ring-janitor",
                                        daemon=True)
            _janitor.start()
    finally:
        _janitor_lock.release()


def _unregister_dropped() -> None:
    while True:
        job = _janitor_jobs.get()
        if isinstance(job, threading.Event):
            job.set()
            continue
        store_ref, base, buffer = job
        store = store_ref()
        if store is not None:  # else a collected store took its registrations
            try:
                store.unregister(base)
            except StoreError:  # a closed store forgot it already
                pass
            except Exception:  # the janitor outlives one store's bug
                _log.exception("LayerLift: unregistering a dropped staging ring failed")
        # Only now may the buffer's memory (and so its address) be reused.
        del store, buffer, job


def _watch_events(pending: queue.SimpleQueue[tuple[DeviceEvent, Region]]) -> None:
    while True:
        event, region = pending.get()
        try:
            event.synchronize()
        finally:
            region.release()


_rings: weakref.WeakKeyDictionary[Store, StagingRing] = weakref.WeakKeyDictionary()
_rings_lock = threading.Lock()


def root_store(store: Store) -> Store:
    """The store that really holds registrations: wrappers (fault injection,
    checks, modelled costs) expose the store they forward to as ``inner`` and
    forward ``register`` to it."""
    for _ in range(32):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            break
        store = inner
    return store


def ring_for(store: Store) -> StagingRing:
    """The small ring (:data:`FOOTER_RING_BYTES`) of ``store``: one per
    underlying store (wrappers share their inner store's), made on first use,
    forgotten with it. Its regions are registered there, so they stay valid for
    the store's calls through any wrapper; it neither outlives nor keeps alive
    the store that registered its memory."""
    root = root_store(store)
    with _rings_lock:
        ring = _rings.get(root)
        if ring is None:
            ring = _rings[root] = StagingRing(root, FOOTER_RING_BYTES, timeout_s=0.0)
        return ring
