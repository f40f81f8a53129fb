"""The restore stage: LOOKUP -> LOAD/PREPARE -> COMMIT (per-layer readiness) -> ABORT.

All methods run on the event-loop thread (the tree and the pool's allocator
state are single-threaded); blocking store calls go to worker threads.

COMMIT publishes the restored pages in the tree *before* they have landed:
every published node carries the batch's :class:`LayerReadiness` in
``node.pending`` until the load finished, and the forward of layer ``l``
waits on entry ``l`` only. A load that fails after COMMIT unpublishes what it
published (``UnifiedRadixTree.unpublish``), so nobody reads data that never
landed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import anyio
import torch

from layerlift.engine.loads import BatchLoad
from layerlift.engine.plan import LookupPlan
from layerlift.linker.components import ComponentLinker, CowSource, MambaLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest, LoadPhase, PoolTransfer
from layerlift.linker.restorable import choose_boundary, intersect_ranks, restorable_boundaries
from layerlift.linker.store_base import Store, StoreError
from layerlift.overlap.base import LayerJob
from layerlift.overlap.link import EmulatedLink
from layerlift.overlap.readiness import LayerReadiness
from layerlift.overlap.scheduler import LoadScheduler, LoadTask
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import InsertResult, TreeNode, UnifiedRadixTree
from layerlift.pools.tree_unpublish import unpublish

__all__ = ["RestoreBatch", "RestoreStage"]

log = logging.getLogger("layerlift.engine")


@dataclass(eq=False)
class RestoreBatch:
    """The restores of one batch between PREPARE and the end of their load."""

    plans: list[LookupPlan]
    transfers: dict[int, dict[Component, PoolTransfer]]
    load: BatchLoad
    jobs: list[LayerJob]
    readiness: LayerReadiness
    task: LoadTask | None = None
    session: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    inserted: dict[int, InsertResult] = field(default_factory=dict)
    cow: dict[int, CowSource] = field(default_factory=dict)
    deps: dict[int, set[Hashable]] = field(default_factory=dict)
    locks: dict[int, TreeNode] = field(default_factory=dict)
    committed: bool = False
    finished: bool = False

    @property
    def restoring(self) -> list[LookupPlan]:
        return [p for p in self.plans if p.request_id in self.transfers]


class RestoreStage:
    """Ties the tree, the pool, the per-kind linkers, the store and the scheduler."""

    def __init__(
        self,
        tree: UnifiedRadixTree,
        pool: KVPool,
        linkers: dict[Component, ComponentLinker],
        store: Store,
        load_factory: type[BatchLoad] | None,
        scheduler: LoadScheduler,
        *,
        world_size: int = 1,
        wait_timeout_s: float = 120.0,
    ) -> None:
        self.tree, self.pool, self.linkers, self.store = tree, pool, linkers, store
        self.scheduler = scheduler
        self.link: EmulatedLink | None = None  # set by the engine before loads start
        self.world_size = world_size
        self.wait_timeout_s = wait_timeout_s
        self._new_load = load_factory or BatchLoad
        self.store_down = False

    # ---- LOOKUP --------------------------------------------------------------
    async def lookup(self, plans: Sequence[LookupPlan], peers: Sequence[Store] = ()) -> None:
        """One ``exists`` call for every key of every plan; sets ``restorable``
        and ``boundary``. With ``peers`` (other ranks' stores), the sets are
        intersected. A store failure is not an error: the plans compute."""
        for plan in plans:
            req = LinkRequest(plan.hashes[: plan.usable_pages], plan.device_pages)
            plan.lookup = {
                c: lk.build_transfer(LinkerTransferPhase.LOOKUP, request=req)
                for c, lk in self.linkers.items()
            }
        keys = [k for p in plans for t in p.lookup.values() if t is not None for k in t.keys]
        if not keys:
            for p in plans:
                p.restorable, p.boundary = frozenset({p.device_pages}), p.device_pages
            return
        try:
            answers = [await anyio.to_thread.run_sync(s.exists, keys)
                       for s in (self.store, *peers)]
        except StoreError as exc:
            self._store_failed(plans, exc)
            return
        self._recovered()
        for rank_answers in answers:
            self._assign(plans, rank_answers)

    def _assign(self, plans: Sequence[LookupPlan], answers: list[bool]) -> None:
        pos = 0
        for plan in plans:
            found: dict[Component, list[bool]] = {}
            for c, t in plan.lookup.items():
                n = 0 if t is None else len(t.keys)
                found[c] = answers[pos : pos + n]
                pos += n
            got = restorable_boundaries(
                plan.spec, plan.device_pages, plan.usable_pages, plan.lookup, found
            )
            first = not plan.restorable
            plan.restorable = got if first else intersect_ranks([plan.restorable, got])
            plan.boundary = choose_boundary(plan.restorable)

    def _store_failed(self, plans: Sequence[LookupPlan], exc: StoreError) -> None:
        if not self.store_down:
            log.warning("store unavailable, computing instead of restoring: %s", exc)
        self.store_down = True
        for p in plans:
            p.restorable = frozenset({p.device_pages})
            p.drop_restore(f"store unavailable: {exc}")

    def _recovered(self) -> None:
        if self.store_down:
            log.warning("store is back: restoring again")
        self.store_down = False

    # ---- LOAD / PREPARE ------------------------------------------------------
    def prepare(self, plan: LookupPlan) -> dict[Component, PoolTransfer] | None:
        """LOAD + PREPARE one plan: allocate (evicting on shortfall) and pin
        its device slots. ``None``: allocation failed, the plan computes."""
        if not plan.restores:
            return None
        got = self._allocate(plan)
        if got is None:
            plan.drop_restore("not enough device memory to restore")
            return None
        for c, t in got.items():
            self.linkers[c].update_load(LoadPhase.PREPARE, t)
        return got

    def abort_plan(self, plan: LookupPlan, transfers: dict[Component, PoolTransfer],
                   reason: str) -> None:
        """ABORT one PREPAREd plan before its batch was built: free its slots."""
        for c, t in transfers.items():
            self.linkers[c].update_load(LoadPhase.ABORT, t)
        plan.drop_restore(reason)

    def make_batch(
        self, plans: Sequence[LookupPlan], transfers: dict[int, dict[Component, PoolTransfer]]
    ) -> RestoreBatch:
        """Gather the PREPAREd transfers of a batch into one load: one job
        per layer covering every request."""
        load = self._new_load(self.pool, self.store, self.link)
        for rid, per_c in transfers.items():
            for c, t in per_c.items():
                assert t.device_indices is not None
                load.items[c].add(list(t.keys), t.device_indices.tolist(), rid)
        readiness = LayerReadiness(
            self.pool.spec.num_layers, requests=frozenset(transfers),
            default_timeout=self.wait_timeout_s,
        )
        return RestoreBatch(list(plans), dict(transfers), load, load.jobs(), readiness)

    def _allocate(self, plan: LookupPlan) -> dict[Component, PoolTransfer] | None:
        req = LinkRequest(plan.hashes[: plan.usable_pages], plan.device_pages, plan.boundary)
        got: dict[Component, PoolTransfer] = {}
        for c, lk in self.linkers.items():
            t = lk.build_transfer(LinkerTransferPhase.LOAD, request=req)
            if t is None:
                for done in got.values():
                    self.linkers[done.component].discard(done)
                return None
            got[c] = t
        return got

    async def start(self, batch: RestoreBatch) -> None:
        """Open the store session and hand the jobs to the scheduler (returns
        at once; the layers load in the background). A missing key or a dead
        store here drops the batch's restores before anything was published."""
        if not batch.transfers:
            batch.finished = True
            return
        keys = batch.load.keys
        try:
            await anyio.to_thread.run_sync(
                lambda: batch.session.enter_context(self.store.open_session(keys))
            )
        except StoreError as exc:
            if batch.committed:  # published already: fail the layers, finish() unpublishes
                batch.readiness.cancel(f"store session failed: {exc}")
            else:
                self.abort_prepared(batch, f"store session failed: {exc}")
            return
        batch.task = self.scheduler.start(batch.jobs, batch.readiness)

    # ---- COMMIT ------------------------------------------------------------------
    def commit(self, batch: RestoreBatch) -> LayerReadiness:
        """Publish every restore in the tree, trim the loads to the adopted
        ranges, set the COW sources; returns the batch's per-layer readiness
        (no barrier: nothing here waits for data)."""
        if batch.committed:
            raise RuntimeError("this load was already committed")
        batch.committed = True
        for plan in batch.restoring:
            self._commit_one(batch, plan)
        batch.load.refresh(batch.jobs)
        self._record_dependencies(batch)
        return batch.readiness

    def _record_dependencies(self, batch: RestoreBatch) -> None:
        """A request whose pages were duplicates of another request's load
        depends on that load: if it fails, both are recomputed."""
        owner = {(c, i): o for c, items in batch.load.items.items()
                 for i, o in zip(items.indices, items.owners, strict=True)}
        for plan in batch.restoring:
            rid, result = plan.request_id, batch.inserted[plan.request_id]
            d, b = plan.device_pages, plan.boundary
            lo = {Component.FULL: d, Component.SWA: max(d, b - plan.spec.window_pages)}
            used = [(c, int(i)) for c in lo for i in result.canonical[c][lo[c] : b]]
            used.append((Component.MAMBA, batch.cow[rid].slot))
            batch.deps[rid] = {owner[u] for u in used if u in owner} - {rid}

    def _commit_one(self, batch: RestoreBatch, plan: LookupPlan) -> None:
        per_c = batch.transfers[plan.request_id]
        b, d, ps = plan.boundary, plan.device_pages, plan.spec.page_size
        n = b
        full = torch.zeros(n, dtype=torch.int64)
        swa = torch.zeros(n, dtype=torch.int64)
        swa_valid = torch.zeros(n, dtype=torch.bool)
        full_t, swa_t, mamba_t = per_c[Component.FULL], per_c[Component.SWA], per_c[Component.MAMBA]
        assert full_t.device_indices is not None and swa_t.device_indices is not None
        assert mamba_t.device_indices is not None
        full[list(full_t.pages)] = full_t.device_indices
        swa[list(swa_t.pages)] = swa_t.device_indices
        swa_valid[list(swa_t.pages)] = True
        result = self.tree.insert(
            plan.tokens[: b * ps], full, swa, swa_valid,
            {b: int(mamba_t.device_indices[0])}, start_page=d,
        )
        batch.inserted[plan.request_id] = result
        self.tree.lock(result.node)
        batch.locks[plan.request_id] = result.node
        dropped: dict[Component, set[int]] = {}
        for c, t in per_c.items():
            kept = self.linkers[c].update_load(LoadPhase.COMMIT, t, insert_result=result)
            kept_idx = set() if kept is None or kept.device_indices is None else set(
                kept.device_indices.tolist())
            assert t.device_indices is not None
            dropped[c] = set(t.device_indices.tolist()) - kept_idx
        for c, gone in dropped.items():
            if gone:
                batch.load.items[c].drop_indices(gone)
        mamba = self.linkers[Component.MAMBA]
        assert isinstance(mamba, MambaLinker)
        batch.cow[plan.request_id] = mamba.cow_source(result, mamba_t)
        for node in result.nodes:
            node.pending = _add_pending(node.pending, batch.readiness)
        # What came from the store is stored: never offload it again.
        for node in result.nodes:
            self.linkers[Component.FULL].mark_stored(node)
        self.linkers[Component.MAMBA].mark_stored(result.node)
        if swa_t.pages:
            self.tree.mark_stored(result.node, Component.SWA, swa_t.pages)

    # ---- end of a load -------------------------------------------------------------
    async def finish(self, batch: RestoreBatch) -> frozenset[Hashable]:
        """Wait until no fetch runs, close the session, unpin the slots and
        clear ``pending``. Returns the requests whose load failed (with the
        requests that depend on their pages); ``unpublish`` them next.
        Idempotent (a second call returns an empty set)."""
        if batch.finished:
            return frozenset()
        batch.finished = True
        if batch.task is not None:
            await batch.task.wait_quiescent()
        await anyio.to_thread.run_sync(batch.session.close)
        failed = _with_dependents(batch.readiness.failed_requests(), batch.deps)
        self._release_slots(batch)
        for node in self.tree.iter_nodes():
            if node.pending is not None:
                node.pending = _drop_pending(node.pending, batch.readiness)
        self.pool.flush_deferred()
        return frozenset(failed)

    def unpublish(self, batch: RestoreBatch, failed: frozenset[Hashable]) -> None:
        """Take the failed requests' restores out of the tree (their nodes were
        published at COMMIT but the data never fully landed). The caller has
        dropped its own pins on those pages."""
        plans = [p for p in batch.restoring
                 if p.request_id in failed and p.request_id in batch.inserted]
        for plan in plans:
            self.tree.unlock(batch.locks.pop(plan.request_id))
        for plan in plans:
            unpublish(self.tree, plan.tokens, batch.inserted.pop(plan.request_id))
        self.pool.flush_deferred()

    def release(self, batch: RestoreBatch) -> None:
        """Drop the locks COMMIT took (after the forward and the insert)."""
        for node in batch.locks.values():
            self.tree.unlock(node)
        batch.locks.clear()

    def _release_slots(self, batch: RestoreBatch) -> None:
        for per_c in batch.transfers.values():
            for c, t in per_c.items():
                assert t.device_indices is not None
                self.pool.unpin(c, t.device_indices)

    def abort_prepared(self, batch: RestoreBatch, reason: str) -> None:
        """ABORT before COMMIT and before any fetch started: free everything."""
        for per_c in batch.transfers.values():
            for c, t in per_c.items():
                self.linkers[c].update_load(LoadPhase.ABORT, t)
        for plan in batch.restoring:
            plan.drop_restore(reason)
        batch.transfers.clear()
        for items in batch.load.items.values():
            items.keys.clear(), items.indices.clear(), items.owners.clear()
        batch.finished = True


def _with_dependents(
    failed: frozenset[Hashable], deps: dict[int, set[Hashable]]
) -> frozenset[Hashable]:
    out = set(failed)
    grew = True
    while grew:
        grew = False
        for rid, on in deps.items():
            if rid not in out and not on.isdisjoint(out):
                out.add(rid)
                grew = True
    return frozenset(out)


def _add_pending(pending: object | None, readiness: LayerReadiness) -> tuple[object, ...]:
    current = () if pending is None else tuple(pending)  # type: ignore[call-overload]
    return current if readiness in current else (*current, readiness)


def _drop_pending(pending: object, readiness: LayerReadiness) -> tuple[object, ...] | None:
    rest = tuple(p for p in pending if p is not readiness)  # type: ignore[attr-defined]
    return rest or None
