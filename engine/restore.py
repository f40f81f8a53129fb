"""The restore stage: LOOKUP -> LOAD/PREPARE -> COMMIT (per-layer readiness) -> ABORT.

All methods run on the event-loop thread (the tree and the pool's allocator
state are single-threaded); blocking store calls go to worker threads.

Each restoring request is one :class:`RestoreTransaction` (the contract's
LOAD/PREPARE/COMMIT/ABORT, in ``linker/``); this stage batches them: one
store lookup, one fetch per layer for every request, one readiness. COMMIT
publishes the restored pages in the tree *before* they have landed: the
adopting nodes carry the batch's :class:`LayerReadiness` in ``node.pending``
until the load finished, and the forward of layer ``l`` waits on entry ``l``
only. A load that fails after COMMIT aborts the transaction, which takes the
adopted pages back out of the tree (``UnifiedRadixTree.retract``), so nobody
reads data that never landed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import anyio
import torch

from layerlift.engine.loads import BatchLoad
from layerlift.engine.plan import LookupPlan
from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest
from layerlift.linker.restorable import choose_boundary, restorable_boundaries
from layerlift.linker.store_base import Store, StoreError
from layerlift.linker.transaction import RestoreTransaction, TransactionState
from layerlift.overlap.base import LayerJob
from layerlift.overlap.link import EmulatedLink
from layerlift.overlap.readiness import LayerReadiness
from layerlift.overlap.scheduler import LoadScheduler, LoadTask
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import InsertResult, UnifiedRadixTree

__all__ = ["RestoreBatch", "RestoreStage"]

log = logging.getLogger("layerlift.engine")


@dataclass(eq=False)
class RestoreBatch:
    """The restores of one batch, from PREPARE to the end of their load.

    ``txns`` holds one :class:`RestoreTransaction` per restoring request;
    ``load`` is the batch's per-layer fetch plan over all of them.
    """

    plans: list[LookupPlan]
    txns: dict[int, RestoreTransaction]
    load: BatchLoad
    jobs: list[LayerJob]
    readiness: LayerReadiness
    task: LoadTask | None = None
    session: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    deps: dict[int, set[Hashable]] = field(default_factory=dict)
    committed: bool = False
    finished: bool = False

    @property
    def restoring(self) -> list[LookupPlan]:
        return [p for p in self.plans if p.request_id in self.txns]

    @property
    def inserted(self) -> dict[int, InsertResult]:
        """COMMITted requests (not aborted): the tree's insert result each."""
        return {rid: t.result.insert for rid, t in self.txns.items()
                if t.result is not None and t.state is not TransactionState.ABORTED}

    def cow_slot(self, rid: int) -> int:
        result = self.txns[rid].result
        assert result is not None and result.cow_source is not None
        return result.cow_source


class RestoreStage:
    """Ties the tree, the pool, the per-kind linkers, the store and the scheduler."""

    def __init__(
        self,
        tree: UnifiedRadixTree,
        pool: KVPool,
        linkers: dict[Component, ComponentLinker],
        store: Store,
        scheduler: LoadScheduler,
        *,
        wait_timeout_s: float = 120.0,
    ) -> None:
        self.tree, self.pool, self.linkers, self.store = tree, pool, linkers, store
        self.scheduler = scheduler
        self.link: EmulatedLink | None = None  # set by the engine before loads start
        self.staging_alloc: Callable[[int], torch.Tensor] | None = None  # CUDA lane's
        self.wait_timeout_s = wait_timeout_s
        self.store_down = False

    # ---- LOOKUP --------------------------------------------------------------
    async def lookup(self, plans: Sequence[LookupPlan]) -> None:
        """One ``exists`` call for every key of every plan; sets ``restorable``
        and ``boundary`` (this rank's view: with tensor parallelism the caller
        intersects the ranks' sets, ``LookupPlan.restrict_to``). A store
        failure is not an error: the plans compute."""
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
            answers = await anyio.to_thread.run_sync(self.store.exists, keys)
        except StoreError as exc:
            self._store_failed(plans, exc)
            return
        self._recovered()
        self._assign(plans, answers)

    def _assign(self, plans: Sequence[LookupPlan], answers: list[bool]) -> None:
        pos = 0
        for plan in plans:
            found: dict[Component, list[bool]] = {}
            for c, t in plan.lookup.items():
                n = 0 if t is None else len(t.keys)
                found[c] = answers[pos : pos + n]
                pos += n
            plan.restorable = restorable_boundaries(
                plan.spec, plan.device_pages, plan.usable_pages, plan.lookup, found
            )
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
    def prepare(self, plan: LookupPlan) -> RestoreTransaction | None:
        """LOAD + PREPARE one plan: allocate (evicting on shortfall) and pin
        its device slots. ``None``: allocation failed, the plan computes."""
        if not plan.restores:
            return None
        request = LinkRequest(plan.hashes[: plan.usable_pages], plan.device_pages, plan.boundary)
        txn = RestoreTransaction.load(self.linkers, request)
        if txn is None:
            plan.drop_restore("not enough device memory to restore")
            return None
        txn.prepare()
        return txn

    def abort_plan(self, plan: LookupPlan, txn: RestoreTransaction, reason: str) -> None:
        """ABORT one PREPAREd plan before its batch was built: free its slots."""
        txn.abort()
        plan.drop_restore(reason)

    def make_batch(
        self, plans: Sequence[LookupPlan], txns: dict[int, RestoreTransaction]
    ) -> RestoreBatch:
        """Gather the PREPAREd transfers of a batch into one load: one job
        per layer covering every request."""
        load = BatchLoad(self.pool, self.store, self.link, self.staging_alloc)
        seen: set[str] = set()
        for rid, txn in txns.items():
            for c, t in txn.transfers.items():
                # Two requests of a batch restoring the same page: only the first
                # (which commits first, so the tree adopts its slot) loads it.
                assert t.device_indices is not None
                rows = [i for i, k in enumerate(t.keys) if k not in seen]
                seen.update(t.keys)
                idx = t.device_indices.tolist()
                load.items[c].add([t.keys[i] for i in rows], [idx[i] for i in rows], rid)
        readiness = LayerReadiness(
            self.pool.spec.num_layers, requests=frozenset(txns),
            default_timeout=self.wait_timeout_s,
        )
        return RestoreBatch(list(plans), dict(txns), load, load.jobs(), readiness)

    async def start(self, batch: RestoreBatch) -> None:
        """Open the store session and hand the jobs to the scheduler (returns
        at once; the layers load in the background). A missing key or a dead
        store here drops the batch's restores before anything was published."""
        if not batch.txns:
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

    def _commit_one(self, batch: RestoreBatch, plan: LookupPlan) -> None:
        txn = batch.txns[plan.request_id]
        result = txn.commit(self.tree, plan.tokens, pending=batch.readiness)
        for c, t in txn.transfers.items():  # duplicates are never loaded
            kept = result.transfers.get(c)
            assert t.device_indices is not None
            gone = set(t.device_indices.tolist())
            if kept is not None and kept.device_indices is not None:
                gone -= set(kept.device_indices.tolist())
            if gone:
                batch.load.items[c].drop_indices(gone)
        # What came from the store is stored: never offload it again.
        for node in result.insert.nodes:
            self.linkers[Component.FULL].mark_stored(node)
        self.linkers[Component.MAMBA].mark_stored(result.node)
        swa_pages = txn.transfers[Component.SWA].pages
        if swa_pages:
            self.tree.mark_stored(result.node, Component.SWA, swa_pages)

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
            used.append((Component.MAMBA, batch.cow_slot(rid)))
            batch.deps[rid] = {owner[u] for u in used if u in owner} - {rid}

    # ---- end of a load -------------------------------------------------------------
    async def finish(self, batch: RestoreBatch, *, abort: bool = False) -> frozenset[Hashable]:
        """Wait until no fetch runs, close the session and the staging, and
        finish every transaction whose data landed (clears ``pending``,
        unpins). Returns the requests whose load failed, with the requests
        that depend on their pages (with ``abort``: every request): ``unpublish``
        them next. Idempotent (a second call returns an empty set)."""
        if batch.finished:
            return frozenset()
        batch.finished = True
        if batch.task is not None:
            await batch.task.wait_quiescent()
        await anyio.to_thread.run_sync(batch.session.close)
        batch.load.close_staging()
        failed = _with_dependents(batch.readiness.failed_requests(), batch.deps)
        if abort:  # ABORT after COMMIT: every restore leaves, landed or not
            failed = frozenset(batch.txns)
        for rid, txn in batch.txns.items():
            if rid not in failed and txn.state is TransactionState.COMMITTED:
                txn.finish()
        return failed

    def unpublish(self, batch: RestoreBatch, failed: frozenset[Hashable]) -> None:
        """ABORT the failed requests' restores: their pages leave the tree
        (published at COMMIT, never fully landed) and their slots are freed.
        The caller has dropped its own pins on those pages. A request whose
        node is locked by a dependant is retried after the dependant."""
        todo = [t for rid, t in batch.txns.items()
                if rid in failed and t.state is not TransactionState.ABORTED]
        while todo:
            left = []
            for txn in todo:
                try:
                    txn.abort()
                except ValueError:
                    left.append(txn)
            if len(left) == len(todo):
                raise RuntimeError("failed restores lock each other; cannot unpublish")
            todo = left

    def release(self, batch: RestoreBatch) -> None:
        """Drop the locks COMMIT took (after the forward and the insert)."""
        for txn in batch.txns.values():
            if txn.state is TransactionState.FINISHED and txn.result is not None:
                self.tree.unlock(txn.result.node)

    def abort_prepared(self, batch: RestoreBatch, reason: str) -> None:
        """ABORT before COMMIT, once no fetch runs: free everything."""
        for plan in batch.restoring:
            self.abort_plan(plan, batch.txns[plan.request_id], reason)
        batch.txns.clear()
        for items in batch.load.items.values():
            items.keys.clear()
            items.indices.clear()
            items.owners.clear()
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
