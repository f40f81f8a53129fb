"""Offloads of the SGLang linker: slots -> store (in place, or through a staging snapshot), in order.

SGLang's wrapper keeps the offloaded node locked until it consumed the
offload's result, and consumes results in the order it queued the offloads
(``pop_completed_offload``): so one worker thread runs them first in, first
out. Per offload: one ``exists`` call (objects already stored are not sent
again: a node that gained a checkpoint sends only the checkpoint); then the
units of the host pools whose parts are large enough (``in_place``) are put
straight from the slots (``offload_in_place.py``: the footers computed over
the slots, no copy; the result waits for every call reading them), and the
others go as a :class:`~layerlift.linker.staged.StagedOffload` through the
offload staging ring: per chunk, a copy of the units' bytes into staging while the node is
still locked, their per-layer CRC-32C footers computed over that copy (each
layer's slice as it is copied, still in the cache), one ``put``; chunks in
order, the first failure ends the offload.

Promises (each a test in ``tests/hosts/sglang_host``):

- **Quiesce** (:meth:`Offloader.quiesce`, what ``reset`` calls): every queued
  offload is dropped and never starts; no offload snapshots slots after
  ``quiesce`` returned (the snapshot runs under the epoch lock ``quiesce``
  takes); results of offloads taken before it are discarded, so they never
  unlock the nodes of later offloads. A put still running when the bound
  passed sends the bytes it snapshotted before ``quiesce`` returned.
- A staged put that outlives the store's timeout is reported failed at once; its
  staging stays held until the call really ended, so if it lands later it
  lands the bytes the slots held when the offload was taken, under checksums
  of those same bytes: never another request's bytes under these keys.
- An in-place put that outlives its timeout is waited for: its result (and
  so SGLang's unlock of the node) comes once it ended. One still running when
  ``quiesce``'s bound passed has its keys held in the quarantine (never
  offered, removed once it ended): the slots it reads may then hold other bytes.
- Any exception of an offload (a bug, a store client's ``RuntimeError``) is
  logged and reported as a failed offload; the thread goes on with the next.
- **Device pools** (``path``, a :class:`~.device.DevicePath`): the snapshot
  gathers the units on the path's offload stream, ordered after the events
  ``offload`` recorded on the scheduler's current stream and on the forward
  stream (the slots' writers), into the pinned offload ring, and returns once
  that copy ran (``linker/staged.py``'s ``DeviceSnapshot``): the bytes put are
  what the forward wrote, copied before SGLang unlocks the node.
- **Repair** (:class:`Quarantine`): a key whose object failed its checks on
  a load is removed from the store and offered by no lookup until it is gone;
  the next offload of that key writes fresh bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from layerlift.linker.integrity import copy_checksum, slice_seed
from layerlift.linker.registered import register_spans
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import (
    DEFAULT_DEPTH,
    DeviceSnapshot,
    OffloadOutcome,
    OffloadPart,
    OffloadSegment,
    Snapshot,
    StagedOffload,
)
from layerlift.linker.store_base import Store, StoreError, StoreObjectLeased, StoreTimeout
from layerlift.overlap.device import DeviceEvent

from .device import DevicePath, gather_units
from .layout import OffloadItem, PoolLayout
from .offload_in_place import Flight, InPlaceOffload, Revoked, pool_spans
from .quarantine import Quarantine

__all__ = ["OffloadItem", "Offloader"]

_log = logging.getLogger(__name__)
_REPAIR_EVERY_S = 0.25  # how often the worker retries removing quarantined keys


class _SlotSnapshot:
    """The staged offload's snapshot (``linker/staged.py``): copy the units'
    page bytes from SGLang's slots into staging, layer-major, under the
    offloader's epoch lock; an offload taken before a ``reset`` is refused
    there (``Revoked``) instead of reading slots the reset freed. Each
    layer's slice is checksummed in staging right after its copy, while it
    is in the cache (``integrity.copy_checksum``): the footers come back
    with the bytes, and the transfer does not read the chunk a second time."""

    def __init__(self, offloader: Offloader, epoch: int) -> None:
        self.offloader, self.epoch = offloader, epoch

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> np.ndarray:
        item: OffloadItem = part.source
        layers = item.layout.layers
        assert part.layout.slices == tuple(item.layout.slices)  # slice j: layer j's parts
        base, stride = int(pages.data_ptr()), int(pages.stride(0))
        spans = [lp.spans() for lp in layers]  # read off the tensors once, not per unit
        table = np.empty((seg.rows, len(layers)), dtype="<u4")
        with self.offloader.unrevoked(self.epoch):
            for i in range(seg.rows):
                at = base + i * stride
                row, key = item.rows[seg.lo + i], part.keys[seg.lo + i]
                for j, layer in enumerate(spans):
                    pieces = [(ptr + row * row_bytes, n) for ptr, row_bytes, n in layer]
                    table[i, j] = copy_checksum(at, pieces, slice_seed(key, j))
                    at += layers[j].nbytes
        return table


class _DeviceSlotSnapshot:
    """The device path's snapshot: as :class:`_SlotSnapshot` (the epoch check
    under the epoch lock), but the gather and its D2H copy into pinned staging
    run on the offload stream, after ``ready`` (events recorded after the
    slots' writers), and ``read`` returns once the copy ran."""

    def __init__(self, offloader: Offloader, epoch: int, path: DevicePath,
                 ready: Sequence[DeviceEvent]) -> None:
        self.offloader, self.epoch = offloader, epoch
        stream = path.offload_stream
        earlier, last = list(ready[:-1]), (ready[-1] if ready else None)

        def after() -> DeviceEvent | None:
            for event in earlier:
                event.wait(stream)
            return last

        self._snapshot = DeviceSnapshot(path.device, self._gather, stream=stream, after=after)

    @staticmethod
    def _gather(seg: OffloadSegment, part: OffloadPart) -> torch.Tensor:
        item: OffloadItem = part.source
        return gather_units(item.layout.layers, item.rows[seg.lo : seg.hi])

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        with self.offloader.unrevoked(self.epoch):
            self._snapshot.read(seg, part, pages)  # footers computed over the pinned copy
        return None


class Offloader:
    """Runs offloads on one daemon thread, first in first out; results are
    read in the same order (``completed`` / ``pop``). Thread-safe.

    ``remove_bound_s``: how long one offload keeps retrying the removal of a
    quarantined key it is about to replace (a read's lease blocks removal).
    ``path``: the device path of pools on a device (None: host pools).
    ``in_place``: the host pools whose objects are put from the slots
    themselves (``offload_in_place.py``; registered with the store at the
    first such offload, unregistered by :meth:`stop` once no call reads
    them); the others' go through the ring. ``register_too``: pools
    registered with them, for the loads read straight into the slots
    (``load_in_place.py``)."""

    def __init__(self, store: Store, ring: StagingRing, quarantine: Quarantine,
                 remove_bound_s: float, depth: int = DEFAULT_DEPTH,
                 path: DevicePath | None = None,
                 in_place: Sequence[PoolLayout] = (),
                 register_too: Sequence[PoolLayout] = ()) -> None:
        self._store = store
        self.path = path
        if path is not None and (in_place or register_too):
            raise ValueError("pools on a device are offloaded through pinned staging, "
                             "never in place")
        self.in_place = {layout.name: layout for layout in in_place}
        self._to_register = {**self.in_place, **{p.name: p for p in register_too}}
        self._registered: list[int] | None = None  # the in-place pools' spans, once registered
        self._register_lock = threading.Lock()
        self._flights: list[Flight] = []  # in-place puts in the air (under _cond)
        self._ring = ring
        self._depth = depth
        self.quarantine = quarantine
        self._remove_bound_s = remove_bound_s
        self._cond = threading.Condition()
        self._epoch_lock = threading.Lock()  # held by a snapshot and by quiesce's epoch bump
        self._epoch = 0
        self._queue: deque[tuple[int, list[OffloadItem], list[DeviceEvent]]] = deque()
        self._results: deque[bool] = deque()
        self._running = False
        self._stopping = False
        self.timed_out = 0  # puts still running after their timeout (held staging)
        self.errors = 0  # offloads that failed by an exception other than a StoreError
        self._thread = threading.Thread(target=self._run, name="layerlift-offload", daemon=True)
        quarantine.subscribe(self._wake)
        self._thread.start()

    def _wake(self) -> None:
        """A key was quarantined: the idle thread starts its repair timer now."""
        with self._cond:
            self._cond.notify_all()

    def submit(self, items: list[OffloadItem], ready: Sequence[DeviceEvent] = ()) -> None:
        """Queue one offload; ``ready`` (device path): events recorded after the
        work that wrote its slots, which the gather waits on (``DevicePath.offload_ready``)."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the offload thread is stopped")
            self._queue.append((self._epoch, items, list(ready)))
            self._cond.notify_all()

    def pending(self) -> int:
        """Offloads queued or running."""
        with self._cond:
            return len(self._queue) + int(self._running)

    def completed(self) -> int:
        with self._cond:
            return len(self._results)

    def wait_completed(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` results wait (at most ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._results) >= count, timeout_s)

    def pop(self) -> bool:
        """The oldest result. Raises IndexError when none is waiting."""
        with self._cond:
            return self._results.popleft()

    def quiesce(self, timeout_s: float) -> bool:
        """Drop every queued offload, forget every result, and wait (at most
        ``timeout_s``) for the one running to return. From the moment this
        returns no offload taken before it snapshots a slot; True when the
        thread is idle."""
        with self._epoch_lock, self._cond:
            self._epoch += 1
            dropped = len(self._queue)
            self._queue.clear()
            self._results.clear()
        if dropped:
            _log.info("LayerLift reset: %d queued offload(s) dropped", dropped)
        with self._cond:
            quiet = self._cond.wait_for(lambda: not self._running, timeout_s)
            self._results.clear()
            for flight in self._flights:  # in place, still reading the slots reset frees
                if not flight.held:
                    flight.held = True
                    self.quarantine.hold(flight.keys)
                    _log.warning("LayerLift reset: an in-place put of %d object(s) still runs; "
                                 "they are withheld and removed once it ended",
                                 len(flight.keys))
        return quiet

    # ---- what an in-place offload asks of its offloader (offload_in_place.OffloadHost) ----

    @property
    def store(self) -> Store:
        return self._store

    @property
    def ring(self) -> StagingRing:
        return self._ring

    @contextmanager
    def unrevoked(self, epoch: int) -> Iterator[None]:
        """Hold the epoch lock (``quiesce`` waits for it to move the epoch)
        for the body; raise :class:`Revoked` at once if a ``quiesce`` ran
        since ``epoch``. What reads the slots or starts a put runs in it."""
        with self._epoch_lock:
            if epoch != self._epoch:
                raise Revoked
            yield

    def took_off(self, keys: Sequence[str]) -> Flight:
        """An in-place put of ``keys`` is launched (under the epoch lock)."""
        flight = Flight(tuple(keys))
        with self._cond:
            self._flights.append(flight)
        return flight

    def landed(self, flight: Flight) -> None:
        """``flight``'s call ended: a hold ``quiesce`` put on its keys is released."""
        with self._cond:
            self._flights.remove(flight)
            if flight.held:
                self.quarantine.release(flight.keys)
            self._cond.notify_all()

    def late_put(self, delta: int) -> None:
        """An in-place put timed out (+1) and then ended (-1): :attr:`timed_out`."""
        with self._cond:
            self.timed_out += delta
            self._cond.notify_all()

    def register_pools(self) -> None:
        """Register the in-place pools with the store, once (the offload
        thread before an in-place put; the scheduler thread before an
        in-place load: ``load_in_place.py``). Raises the store's error."""
        with self._register_lock:
            if self._registered is None:
                self._registered = register_spans(self._store,
                                                  pool_spans(list(self._to_register.values())))

    def stop(self, timeout_s: float, keep_registered: bool = False) -> None:
        """Stop the thread (waiting at most ``timeout_s``); unregister the
        pools once no call may read or write them (else, or with
        ``keep_registered``: an in-place load's read still runs, they stay
        registered: the store's own close forgets them)."""
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            busy = self._thread.is_alive() or bool(self._flights) or keep_registered
        if self._registered and not busy:
            spans, self._registered = self._registered, None
            for ptr in spans:
                try:
                    self._store.unregister(ptr)
                except StoreError as exc:
                    _log.warning("LayerLift: unregistering SGLang's pools failed: %s", exc)
        elif self._registered:
            _log.warning("LayerLift close: an in-place put or load still runs; SGLang's pools "
                         "stay registered with the store")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    if not self._cond.wait(_REPAIR_EVERY_S if len(self.quarantine) else None):
                        break  # the repair timer fired
                if self._stopping:
                    return
                task = self._queue.popleft() if self._queue else None
                self._running = task is not None
            if task is None:
                self._repair()
                with self._cond:  # a waiter on the quarantine's size (tests, close)
                    self._cond.notify_all()
                continue
            epoch, items, ready = task
            try:
                ok = self._offload(epoch, items, ready)
            except Exception:  # a bug or a client's own error: this offload failed, go on
                self.errors += 1
                _log.exception("LayerLift offload failed by an unexpected error; reported failed")
                ok = False
            with self._cond:
                if epoch == self._epoch:
                    self._results.append(ok)
                self._running = False
                self._cond.notify_all()

    def _repair(self) -> None:
        """Remove quarantined keys from the store; forget those it no longer has."""
        keys = self.quarantine.keys()
        if not keys:
            return
        try:
            self._remove(keys)
        except Exception as exc:  # retried at the next tick
            _log.debug("LayerLift: removing %d quarantined object(s) failed: %s", len(keys), exc)

    def _remove(self, keys: list[str]) -> list[str]:
        """One removal pass; returns the keys the store still has (a read's
        lease holds them: Mooncake refuses the removal until its lease TTL)
        and those held (an in-place put may still write them)."""
        held = {k for k, h in zip(keys, self.quarantine.held(keys), strict=True) if h}
        removable = [k for k in keys if k not in held]
        left = [k for k in keys if k in held]  # an in-place put may still write them: kept
        try:
            if removable:
                self._store.remove(removable)
        except StoreObjectLeased as exc:
            left += list(exc.keys)
        gone = [k for k in keys if k not in set(left)]
        self.quarantine.removed += len(gone)
        self.quarantine.discard(gone)
        return left

    def _replace(self, keys: list[str]) -> set[str]:
        """Remove quarantined ``keys`` before this offload writes them again,
        retrying for ``remove_bound_s`` while a lease blocks it; returns the keys
        still stored (this offload must not send them: a put would not replace them)."""
        deadline = time.monotonic() + self._remove_bound_s
        pause = 0.01
        while True:
            left = self._remove(keys)
            if not left or time.monotonic() + pause > deadline:
                return set(left)
            time.sleep(pause)  # a read's lease (Mooncake's kv lease TTL) blocks the removal
            pause = min(pause * 2, 0.25)
            keys = left

    def _offload(self, epoch: int, items: list[OffloadItem],
                 ready: Sequence[DeviceEvent] = ()) -> bool:
        all_keys = [k for item in items for k in item.keys]
        try:
            present = self._store.exists(all_keys)
            bad = [k for k, q in zip(all_keys, self.quarantine.holds(all_keys), strict=True) if q]
            kept = self._replace(bad) if bad else set()
        except StoreError as exc:
            _log.warning("LayerLift offload: exists failed (%s); the offload is reported failed",
                         exc)
            return False
        replaced = set(bad) - kept
        it = iter(zip(present, all_keys, strict=True))
        missing = []
        for item in items:
            flags = [(f and k not in replaced) or k in kept for f, k in (next(it) for _ in item.keys)]
            keep = [i for i, f in enumerate(flags) if not f]
            if keep:
                missing.append(OffloadItem(item.layout, tuple(item.keys[i] for i in keep),
                                           tuple(item.rows[i] for i in keep)))
        if kept:
            _log.warning("LayerLift offload: %d corrupt object(s) could not be removed yet "
                         "(a read holds a lease); they stay unoffered", len(kept))
        if not missing:
            return not kept
        in_place = [m for m in missing if m.layout.name in self.in_place]
        through_ring = [m for m in missing if m.layout.name not in self.in_place]
        try:
            outcome = InPlaceOffload(self, epoch, in_place).run() if in_place else None
            if through_ring and (outcome is None or outcome.ok):
                outcome = self._staged(epoch, through_ring, ready)
        except Revoked:  # reset ran since this offload was taken
            return False
        assert outcome is not None
        if isinstance(outcome.error, StoreTimeout):
            with self._cond:
                self.timed_out += 1
            _log.warning("LayerLift offload: put timed out (%s); reported failed", outcome.error)
            return False
        if outcome.error is not None:
            _log.warning("LayerLift offload: put failed (%s); reported failed", outcome.error)
            return False
        with self._cond:
            if epoch != self._epoch:  # a reset ran meanwhile: its holds stay (result dropped)
                return False
        self.quarantine.discard([k for m in missing for k in m.keys])
        return not kept

    def _staged(self, epoch: int, items: list[OffloadItem],
                ready: Sequence[DeviceEvent]) -> OffloadOutcome:
        """``items`` copied through the offload ring and put from there."""
        snapshot: Snapshot = _SlotSnapshot(self, epoch) if self.path is None else \
            _DeviceSlotSnapshot(self, epoch, self.path, ready)
        return StagedOffload(
            self._ring, self._store, [OffloadPart(m.layout.objects, m.keys, m) for m in items],
            snapshot, depth=self._depth, timeout_s=self._ring.timeout_s,
            on_late_end=self._timed_out_ended).run()

    def _timed_out_ended(self) -> None:
        with self._cond:
            self.timed_out -= 1
