"""OFFLOAD in the background: new pages and new checkpoints go to the store,
never on the TTFT path.

For each published prompt the offloader walks the nodes of its path and asks
every component's linker for what the store still lacks (per node, per
component ``stored`` flags): a node whose KV is stored but that gained a new
checkpoint sends only that checkpoint (no hit loss, no KV sent twice). The
last node is locked and every page sent is pinned until the put returned, so
nothing is evicted or moved under a transfer. A failed put leaves the flags
unset (the next prefill of that prefix retries).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import anyio

from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, PoolTransfer
from layerlift.linker.store_base import Store, StoreError
from layerlift.overlap.device import device_of
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import TreeNode, UnifiedRadixTree

__all__ = ["OffloadReport", "Offloader"]

log = logging.getLogger("layerlift.engine")


@dataclass(slots=True)
class OffloadReport:
    """What ``Engine.wait_offloads`` saw: objects put, puts failed, last error."""

    objects: int = 0
    bytes: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed == 0


class Offloader:
    """Owned by the engine; every method runs on the event-loop thread."""

    def __init__(self, tree: UnifiedRadixTree, pool: KVPool,
                 linkers: dict[Component, ComponentLinker], store: Store) -> None:
        self.tree, self.pool, self.linkers, self.store = tree, pool, linkers, store
        self._tasks: set[asyncio.Task[None]] = set()
        self.report = OffloadReport()

    def submit(self, node: TreeNode) -> None:
        """Offload what the store lacks along ``node``'s path (returns at once)."""
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
        if not work:
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
            await anyio.to_thread.run_sync(self._put, keys, pages, sizes)
        except StoreError as exc:
            self.report.failed += 1
            self.report.errors.append(str(exc))
            log.warning("offload of %d objects failed (will retry later): %s", len(keys), exc)
        else:
            for n, t in work:
                self.linkers[t.component].mark_stored(n, t)
            self.report.objects += len(keys)
            self.report.bytes += sum(sizes)
        finally:
            for _, t in work:
                assert t.device_indices is not None
                self.pool.unpin(t.component, t.device_indices)
            if self.tree.contains(node):
                self.tree.unlock(node)

    def _put(self, keys: list[str], pages: list[tuple[Component, int]], sizes: list[int]) -> None:
        """Worker thread: put straight from the pool on CPU; through one pinned
        host copy (registered for the call) on a device (``overlap.device``:
        ordered after the forward's and the relocations' copies)."""
        device = device_of(self.pool.buffer)
        if device is None:
            self.store.put(keys, [self.pool.page_ptr(c, i) for c, i in pages], sizes)
            return
        host = device.to_host([self.pool.page_view(c, i) for c, i in pages])
        base = self.store.register(host)
        try:
            offsets = [0]
            for size in sizes[:-1]:
                offsets.append(offsets[-1] + size)
            self.store.put(keys, [base + o for o in offsets], sizes)
        finally:
            self.store.unregister(base)

    @property
    def pending(self) -> bool:
        """Whether an offload is still in flight (it pins pages)."""
        return bool(self._tasks)

    async def wait(self) -> OffloadReport:
        """Wait until every submitted offload has landed or failed."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        return self.report
