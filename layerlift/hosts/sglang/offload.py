"""Offloads of the SGLang linker: device slots -> staging snapshot -> store, in order.

SGLang's wrapper keeps the offloaded node locked until it consumed the
offload's result, and consumes results in the order it queued the offloads
(``pop_completed_offload``): so one worker thread runs them first in, first
out. Per offload: one ``exists`` call (objects already stored are not sent
again: a node that gained a checkpoint sends only the checkpoint), a copy of
the missing units' bytes into staging while the node is still locked, their
per-layer CRC-32 footers computed over that copy, then one ``put``.

A put that outlives the store's timeout is reported failed at once; its
staging stays held until the call really ended, so if it lands later it lands
the bytes the slots held when the offload was taken, under checksums of those
same bytes: never another request's bytes under these keys.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from layerlift.linker.integrity import CHECK_BYTES, checksums, slice_seed
from layerlift.linker.store_base import Store, StoreError, StoreTimeout

from .layout import PoolLayout
from .staging import Arena, Region, hand_over

__all__ = ["OffloadItem", "Offloader"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadItem:
    """One pool's part of one offload: store keys and the first row of each unit."""

    layout: PoolLayout
    keys: tuple[str, ...]
    rows: tuple[int, ...]


def _stage(items: Sequence[OffloadItem], region: Region) -> tuple[list[str], list[int], list[int]]:
    """Copy every unit into ``region`` as a whole object (page, then footer)."""
    keys, ptrs, sizes = [], [], []
    at = region.ptr
    for item in items:
        layout = item.layout
        for key, row in zip(item.keys, item.rows, strict=True):
            src_at = at
            for lp in layout.layers:
                for part in lp.parts:
                    ctypes.memmove(src_at, part.ptr(row), part.nbytes)
                    src_at += part.nbytes
            footer = np.empty(len(layout.layers), dtype="<u4")
            for j, (offset, size) in enumerate(layout.slices):
                footer[j] = checksums([at + offset], size, [slice_seed(key, j)])[0]
            ctypes.memmove(at + layout.page_bytes, footer.ctypes.data, CHECK_BYTES * len(footer))
            keys.append(key)
            ptrs.append(at)
            sizes.append(layout.object_bytes)
            at += layout.object_bytes
    return keys, ptrs, sizes


class Offloader:
    """Runs offloads on one daemon thread, first in first out; results are
    read in the same order (``completed`` / ``pop``). Thread-safe."""

    def __init__(self, store: Store, arena: Arena) -> None:
        self._store = store
        self._arena = arena
        self._queue: queue.Queue[list[OffloadItem] | None] = queue.Queue()
        self._results: deque[bool] = deque()
        self._lock = threading.Lock()
        self.timed_out = 0  # puts still running after their timeout (held staging)
        self._thread = threading.Thread(target=self._run, name="layerlift-offload", daemon=True)
        self._thread.start()

    def submit(self, items: list[OffloadItem]) -> None:
        self._queue.put(items)

    def pending(self) -> int:
        """Offloads queued or running."""
        return self._queue.unfinished_tasks

    def completed(self) -> int:
        with self._lock:
            return len(self._results)

    def pop(self) -> bool:
        """The oldest result. Raises IndexError when none is waiting."""
        with self._lock:
            return self._results.popleft()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued offload ran (True) or ``timeout_s`` passed."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, name="layerlift-offload-drain", daemon=True).start()
        return done.wait(timeout_s)

    def clear(self) -> None:
        with self._lock:
            self._results.clear()

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is None:
                    return
                ok = self._offload(items)
                with self._lock:
                    self._results.append(ok)
            finally:
                self._queue.task_done()

    def _offload(self, items: list[OffloadItem]) -> bool:
        try:
            present = self._store.exists([k for item in items for k in item.keys])
        except StoreError as exc:
            _log.warning("LayerLift offload: exists failed (%s); the offload is reported failed",
                         exc)
            return False
        it = iter(present)
        missing = []
        for item in items:
            flags = [next(it) for _ in item.keys]
            keep = [i for i, f in enumerate(flags) if not f]
            if keep:
                missing.append(OffloadItem(item.layout, tuple(item.keys[i] for i in keep),
                                           tuple(item.rows[i] for i in keep)))
        if not missing:
            return True
        region = self._arena.allocate(sum(len(m.keys) * m.layout.object_bytes for m in missing))
        if region is None:
            _log.warning("LayerLift offload: the staging buffer is full; offload reported failed")
            return False
        try:
            keys, ptrs, sizes = _stage(missing, region)
            self._store.put(keys, ptrs, sizes)
            return True
        except StoreTimeout as exc:
            with self._lock:
                self.timed_out += 1
            hand_over(exc, region, self._timed_out_ended)
            _log.warning("LayerLift offload: put timed out (%s); reported failed", exc)
            return False
        except StoreError as exc:
            _log.warning("LayerLift offload: put failed (%s); reported failed", exc)
            return False
        finally:
            region.release()

    def _timed_out_ended(self) -> None:
        with self._lock:
            self.timed_out -= 1
