"""OFFLOAD in the background: new pages and new checkpoints go to the store,
never on the TTFT path.

For each published prompt the offloader walks the nodes of its path and asks
every component's linker for what the store still lacks (per node, per
component ``stored`` flags): a node whose KV is stored but that gained a new
checkpoint sends only that checkpoint (no hit loss, no KV sent twice). The
last node is locked and every page sent is pinned until the put returned, so
nothing is evicted or moved under a transfer. A failed put leaves the flags
unset (the next prefill of that prefix retries).

A store call owns the memory it was lent until it really ended: a put that
times out is waited for (in its worker thread, so the pins and the
registered host copy stay) and, if it then succeeded, counts as landed
(`OffloadReport.late`). Each object is its page plus a checksum footer
(`linker/integrity.py`). Objects go in prefix order (nodes root first; per
node FULL, SWA, then MAMBA), so a checkpoint is sent only with its prefix. A
full store (`StoreFull`) backs that node off (its next 2, 4, ... 64 offloads
are skipped); a prefix larger than the store's capacity is never sent (said
once). Failures are logged rate-limited (`FailureLog`); the report keeps
counters and the last few errors, never an unbounded list.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from layerlift.engine.threads import run_owned
from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, PoolTransfer
from layerlift.linker.integrity import object_bytes
from layerlift.linker.ring import ring_for
from layerlift.linker.staged import ObjectLayout, OffloadPart, OffloadSegment, StagedOffload
from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreFull,
    StoreUnavailable,
)
from layerlift.overlap.device import device_of
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import TreeNode, UnifiedRadixTree

__all__ = ["OffloadReport", "Offloader"]

log = logging.getLogger("layerlift.engine")


_KEEP_ERRORS = 8  # the report keeps the last few error messages, no more
_MAX_BACKOFF = 6  # a full store skips at most 2**6 offloads of one node in a row


@dataclass(slots=True)
class OffloadReport:
    """What ``Engine.wait_offloads`` saw, as counters (bounded whatever the
    number of failures): objects and bytes put, puts failed (per error type
    in ``failures``), puts that landed after their timeout (``late``),
    offloads skipped while backing off a full store (``backed_off``) or
    because the prefix exceeds the store's capacity (``too_big``), and the
    last few error messages (``errors``, at most 8)."""

    objects: int = 0
    bytes: int = 0
    failed: int = 0
    late: int = 0
    backed_off: int = 0
    too_big: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=_KEEP_ERRORS))

    @property
    def ok(self) -> bool:
        return self.failed == 0

    @property
    def errors(self) -> list[str]:
        """The last (at most 8) error messages, oldest first."""
        return list(self.recent)

    def record_failure(self, exc: BaseException) -> None:
        self.failed += 1
        self.failures[type(exc).__name__] += 1
        self.recent.append(str(exc))


class FailureLog:
    """Rate-limited warnings for a failure that repeats (an outage): the first
    failure is logged at once; later ones are counted and summarised in one
    line at most every ``interval_s``; the first success after failures logs
    the recovery. ``clock`` is injectable for tests. Not thread-safe: call it
    from one thread (the event loop)."""

    def __init__(self, what: str, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.what, self.interval_s, self.clock, self.logger = what, interval_s, clock, logger
        self.failures = 0  # in the current run of failures
        self._unsaid = 0
        self._last_said = 0.0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._last_said = now
            self.logger.warning("%s failed (will retry; further failures are summarised every "
                                "%g s): %s", self.what, self.interval_s, exc)
            return
        self._unsaid += 1
        if now - self._last_said >= self.interval_s:
            self.logger.warning("%s failed %d more time(s) in the last %.0f s; last error: %s",
                                self.what, self._unsaid, now - self._last_said, exc)
            self._unsaid, self._last_said = 0, now

    def succeeded(self) -> None:
        if self.failures:
            self.logger.warning("%s works again after %d failure(s).", self.what, self.failures)
        self.failures = self._unsaid = 0


class Offloader:
    """Owned by the engine; every method runs on the event-loop thread."""

    def __init__(self, tree: UnifiedRadixTree, pool: KVPool,
                 linkers: dict[Component, ComponentLinker], store: Store) -> None:
        self.tree, self.pool, self.linkers, self.store = tree, pool, linkers, store
        self._tasks: set[asyncio.Task[None]] = set()
        self.report = OffloadReport()
        self.failure_log = FailureLog("offload to the store")
        self._lock = threading.Lock()  # report fields written by put threads
        self._backoff: dict[bytes, list[int]] = {}  # last page hash -> [skips left, level]
        self._said_too_big = False
        self.closing = False  # Engine.close began: nothing new is submitted
        self._threads = 0  # put threads started and not yet returned (under _lock)
        self._after_puts: Callable[[], None] | None = None  # see hand_over
        self._shut = False  # the closers ran (or are handed over): no put may start

    def submit(self, node: TreeNode) -> None:
        """Offload what the store lacks along ``node``'s path (returns at once).

        Objects go root first, per node FULL, SWA, then MAMBA (the linkers'
        order): a checkpoint is sent only with the prefix it needs. Skipped
        while the node backs off a full store, or when the prefix is larger
        than the store's capacity; nothing once the engine is closing."""
        if self.closing or self._backing_off(node):
            return
        work: list[tuple[TreeNode, PoolTransfer]] = []
        seen: set[str] = set()
        for n in node.path():
            for lk in self.linkers.values():
                t = lk.build_transfer(LinkerTransferPhase.OFFLOAD, node=n)
                if t is None:
                    continue
                fresh = [p for p, k in zip(t.pages, t.keys, strict=True) if k not in seen]
                if len(fresh) != len(t):
                    t = t.trimmed(fresh)
                if len(t):
                    seen.update(t.keys)
                    work.append((n, t))
        if not work or self._too_big(work):
            return
        self.tree.lock(node)
        for _, t in work:
            assert t.device_indices is not None
            self.pool.pin(t.component, t.device_indices)
        task = asyncio.get_running_loop().create_task(self._run(node, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, node: TreeNode, work: list[tuple[TreeNode, PoolTransfer]]) -> None:
        keys = [k for _, t in work for k in t.keys]
        pages = [(t.component, i) for _, t in work
                 for i in (t.device_indices.tolist() if t.device_indices is not None else [])]
        sizes = [self.pool.page_bytes(c) for c, _ in pages]
        try:
            # Owned: the pages stay pinned (and the node locked) until the put
            # thread returned, even if this task is cancelled meanwhile.
            await run_owned(lambda: self._put_thread(keys, pages, sizes))
        except StoreError as exc:
            self.report.record_failure(exc)
            self.failure_log.failed(exc)
            if isinstance(exc, StoreFull):
                self._back_off(node)
        else:
            for n, t in work:
                self.linkers[t.component].mark_stored(n, t)
            self.report.objects += len(keys)
            self.report.bytes += sum(sizes)
            self.failure_log.succeeded()
            if node.last_hash is not None:
                self._backoff.pop(node.last_hash, None)
        finally:
            for _, t in work:
                assert t.device_indices is not None
                self.pool.unpin(t.component, t.device_indices)
            if self.tree.contains(node):
                self.tree.unlock(node)

    def _put_thread(self, keys: list[str], pages: list[tuple[Component, int]],
                    sizes: list[int]) -> None:
        """Worker thread: the put, counted; the last one to return after
        :meth:`hand_over` runs what it was handed."""
        with self._lock:
            if self._shut:
                raise StoreUnavailable("the engine closed before this offload's put started")
            self._threads += 1
        try:
            self._put(keys, pages, sizes)
        finally:
            with self._lock:
                self._threads -= 1
                after = self._after_puts if self._threads == 0 else None
                if after is not None:
                    self._after_puts, self._shut = None, True
            if after is not None:
                after()

    def hand_over(self, cleanup: Callable[[], None]) -> bool:
        """``Engine.close`` gave up waiting: if a put thread still runs (a
        stalled store), the last one to return runs ``cleanup`` (closing
        the registration and the client the puts use) and True is
        returned; False (the caller runs it at once) when none runs. A put
        thread that starts after that fails at once (``StoreUnavailable``):
        it never touches what the cleanup closed."""
        with self._lock:
            if self._threads == 0:
                self._shut = True
                return False
            self._after_puts = cleanup
            return True

    def _put(self, keys: list[str], pages: list[tuple[Component, int]], sizes: list[int]) -> None:
        """Worker thread: put straight from the pool on CPU; through one pinned
        host copy (registered for the call) on a device (``overlap.device``:
        ordered after the forward's and the relocations' copies)."""
        device = device_of(self.pool.buffer)
        if device is None:
            self._put_objects(keys, pages, [self.pool.page_ptr(c, i) for c, i in pages], sizes)
            return
        host = device.to_host([self.pool.page_view(c, i) for c, i in pages])
        base = self.store.register(host)
        try:
            offsets = [0]
            for size in sizes[:-1]:
                offsets.append(offsets[-1] + size)
            # returns only once the put really ended: the host copy stays
            # registered while a timed-out put may still read it
            self._put_objects(keys, pages, [base + o for o in offsets], sizes)
        finally:
            self.store.unregister(base)

    def _put_objects(self, keys: list[str], pages: list[tuple[Component, int]],
                     ptrs: list[int], sizes: list[int]) -> None:
        """Worker thread: one in-place `StagedOffload` of every page (put from
        ``ptrs``, zero-copy) plus its checksum footer (computed over those
        bytes into a region of the store's staging ring, ``ring_for``), in put
        calls growing from 8 MiB, in order (a failed call sends nothing after
        it); parts are the runs of one component in the given order (the
        prefix order). A put that times out is waited for until it really
        ended (the pages and the footers are its memory until then); one that
        then succeeded counts as landed (``report.late``); a failure raises
        its StoreError."""
        spec = self.pool.spec
        parts: list[OffloadPart] = []
        begin = 0
        for i in range(1, len(pages) + 1):
            if i == len(pages) or pages[i][0] is not pages[begin][0]:
                component = pages[begin][0]
                parts.append(OffloadPart(ObjectLayout.of(spec, component),
                                         tuple(keys[begin:i]), ptrs[begin:i]))
                begin = i
        offload = StagedOffload(ring_for(self.store), self.store, parts, None,
                                source=_InPlace(), wait_timed_out=True)
        outcome = offload.run()
        if outcome.late:
            with self._lock:
                self.report.late += outcome.late
        if outcome.error is not None:
            raise outcome.error

    def _backing_off(self, node: TreeNode) -> bool:
        """Whether this offload of ``node`` is skipped (a full store)."""
        state = self._backoff.get(node.last_hash) if node.last_hash is not None else None
        if state is None or state[0] <= 0:
            return False
        state[0] -= 1
        self.report.backed_off += 1
        return True

    def _back_off(self, node: TreeNode) -> None:
        """The store was full for ``node``'s prefix: skip its next 2, 4, ..., 64 offloads."""
        if node.last_hash is None:
            return
        state = self._backoff.setdefault(node.last_hash, [0, 0])
        state[1] = min(state[1] + 1, _MAX_BACKOFF)
        state[0] = 2 ** state[1]

    def _too_big(self, work: list[tuple[TreeNode, PoolTransfer]]) -> bool:
        """A prefix larger than the store's capacity (when known) is never
        offloaded: it would only evict everything else. Said once."""
        capacity = self.store.capacity_bytes
        if capacity is None:
            return False
        need = sum(len(t) * object_bytes(self.pool.spec, t.component) for _, t in work)
        if need <= capacity:
            return False
        self.report.too_big += 1
        if not self._said_too_big:
            self._said_too_big = True
            log.warning("a prefix needs %d bytes in the store, more than its capacity of %d: "
                        "it is not offloaded (said once; see OffloadReport.too_big)",
                        need, capacity)
        return True

    @property
    def pending(self) -> bool:
        """Whether an offload is still in flight (it pins pages)."""
        return bool(self._tasks)

    async def wait(self) -> OffloadReport:
        """Wait until every submitted offload has landed or failed.

        Cancelling the caller stops the waiting only: the offloads go on
        (``asyncio.wait`` never cancels what it waits for), so a put never
        loses the pins on the pages it is still reading."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        return self.report


class _InPlace:
    """The offload's pages where they are: ``part.source`` holds each row's
    address (pinned pool pages, or the registered host copy on a device)."""

    def pages(self, seg: OffloadSegment, part: OffloadPart) -> list[int]:
        rows: list[int] = part.source[seg.lo : seg.hi]
        return rows
