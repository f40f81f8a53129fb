"""Offloads of the SGLang linker: device slots -> staging snapshot -> store, in order.

SGLang's wrapper keeps the offloaded node locked until it consumed the
offload's result, and consumes results in the order it queued the offloads
(``pop_completed_offload``): so one worker thread runs them first in, first
out. Per offload: one ``exists`` call (objects already stored are not sent
again: a node that gained a checkpoint sends only the checkpoint), then a
:class:`~layerlift.linker.staged.StagedOffload` through the offload staging
ring: per chunk, a copy of the units' bytes into staging while the node is
still locked, their per-layer CRC-32 footers computed over that copy, one
``put``; chunks in order, the first failure ends the offload.

Promises (each a test in ``tests/hosts/sglang_host``):

- **Quiesce** (:meth:`Offloader.quiesce`, what ``reset`` calls): every queued
  offload is dropped and never starts; no offload snapshots slots after
  ``quiesce`` returned (the snapshot runs under the epoch lock ``quiesce``
  takes); results of offloads taken before it are discarded, so they never
  unlock the nodes of later offloads. A put still running when the bound
  passed sends the bytes it snapshotted before ``quiesce`` returned.
- A put that outlives the store's timeout is reported failed at once; its
  staging stays held until the call really ended, so if it lands later it
  lands the bytes the slots held when the offload was taken, under checksums
  of those same bytes: never another request's bytes under these keys.
- Any exception of an offload (a bug, a store client's ``RuntimeError``) is
  logged and reported as a failed offload; the thread goes on with the next.
- **Repair** (:class:`Quarantine`): a key whose object failed its checks on
  a load is removed from the store and offered by no lookup until it is gone;
  the next offload of that key writes fresh bytes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import DEFAULT_DEPTH, OffloadPart, OffloadSegment, StagedOffload
from layerlift.linker.store_base import Store, StoreError, StoreObjectLeased, StoreTimeout

from .layout import PoolLayout

__all__ = ["OffloadItem", "Offloader", "Quarantine"]

_log = logging.getLogger(__name__)
_REPAIR_EVERY_S = 0.25  # how often the worker retries removing quarantined keys


@dataclass(frozen=True, slots=True)
class OffloadItem:
    """One pool's part of one offload: store keys and the first row of each unit."""

    layout: PoolLayout
    keys: tuple[str, ...]
    rows: tuple[int, ...]


class Quarantine:
    """Keys whose stored object failed its checks on a load (corrupt, foreign,
    truncated). ``lookup`` treats them as missing; the offload thread removes
    them from the store (Mooncake refuses a remove while a read's lease is
    held: it retries) and forgets a key once the store no longer has it, or
    once an offload replaced it. Thread-safe."""

    def __init__(self) -> None:
        self._keys: dict[str, float] = {}  # key -> when quarantined
        self._lock = threading.Lock()
        self.removed = 0  # objects this linker removed from the store

    def add(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._keys.setdefault(key, now)

    def discard(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._keys for k in keys]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


class _Revoked(Exception):
    """The offload was taken before a ``reset``: it must not snapshot the slots."""


class _SlotSnapshot:
    """The staged offload's snapshot (``linker/staged.py``): copy the units'
    page bytes from SGLang's slots into staging, layer-major, under the
    offloader's epoch lock; an offload taken before a ``reset`` is refused
    there (``_Revoked``) instead of reading slots the reset freed."""

    def __init__(self, offloader: Offloader, epoch: int) -> None:
        self.offloader, self.epoch = offloader, epoch

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        item: OffloadItem = part.source
        base, stride = int(pages.data_ptr()), int(pages.stride(0))
        with self.offloader._epoch_lock:
            if self.epoch != self.offloader._epoch:
                raise _Revoked
            for i in range(seg.rows):
                at = base + i * stride
                row = item.rows[seg.lo + i]
                for lp in item.layout.layers:
                    for p in lp.parts:
                        ctypes.memmove(at, p.ptr(row), p.nbytes)
                        at += p.nbytes


class Offloader:
    """Runs offloads on one daemon thread, first in first out; results are
    read in the same order (``completed`` / ``pop``). Thread-safe.

    ``remove_bound_s``: how long one offload keeps retrying the removal of a
    quarantined key it is about to replace (a read's lease blocks removal)."""

    def __init__(self, store: Store, ring: StagingRing, quarantine: Quarantine,
                 remove_bound_s: float, depth: int = DEFAULT_DEPTH) -> None:
        self._store = store
        self._ring = ring
        self._depth = depth
        self.quarantine = quarantine
        self._remove_bound_s = remove_bound_s
        self._cond = threading.Condition()
        self._epoch_lock = threading.Lock()  # held by a snapshot and by quiesce's epoch bump
        self._epoch = 0
        self._queue: deque[tuple[int, list[OffloadItem]]] = deque()
        self._results: deque[bool] = deque()
        self._running = False
        self._stopping = False
        self.timed_out = 0  # puts still running after their timeout (held staging)
        self.errors = 0  # offloads that failed by an exception other than a StoreError
        self._thread = threading.Thread(target=self._run, name="layerlift-offload", daemon=True)
        self._thread.start()

    def submit(self, items: list[OffloadItem]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the offload thread is stopped")
            self._queue.append((self._epoch, items))
            self._cond.notify_all()

    def pending(self) -> int:
        """Offloads queued or running."""
        with self._cond:
            return len(self._queue) + int(self._running)

    def completed(self) -> int:
        with self._cond:
            return len(self._results)

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
        return quiet

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)

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
                continue
            epoch, items = task
            try:
                ok = self._offload(epoch, items)
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
        lease holds them: Mooncake refuses the removal until its lease TTL)."""
        try:
            self._store.remove(keys)
            left: list[str] = []
        except StoreObjectLeased as exc:
            left = list(exc.keys)
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

    def _offload(self, epoch: int, items: list[OffloadItem]) -> bool:
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
        staged = StagedOffload(
            self._ring, self._store,
            [OffloadPart(m.layout.objects, m.keys, m) for m in missing],
            _SlotSnapshot(self, epoch), depth=self._depth, timeout_s=self._ring.timeout_s,
            on_late_end=self._timed_out_ended)
        try:
            outcome = staged.run()
        except _Revoked:  # reset ran since this offload was taken
            return False
        if isinstance(outcome.error, StoreTimeout):
            with self._cond:
                self.timed_out += 1
            _log.warning("LayerLift offload: put timed out (%s); reported failed", outcome.error)
            return False
        if outcome.error is not None:
            _log.warning("LayerLift offload: put failed (%s); reported failed", outcome.error)
            return False
        self.quarantine.discard([k for m in missing for k in m.keys])
        return not kept

    def _timed_out_ended(self) -> None:
        with self._cond:
            self.timed_out -= 1
