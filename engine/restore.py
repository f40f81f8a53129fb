"""The restore stage: LOOKUP, LOAD/PREPARE, building one batch's load, COMMIT.

All methods run on the event-loop thread (the tree and the pool's allocator
state are single-threaded); blocking store calls go to worker threads.

Each restoring request is one :class:`RestoreTransaction` (the contract's
LOAD/PREPARE/COMMIT/ABORT, in ``linker/``); this stage batches them: one
store lookup, one fetch per layer for every request, one readiness. COMMIT
publishes the restored pages in the tree *before* they have landed: the
adopting nodes carry the batch's :class:`LayerReadiness` in ``node.pending``
until the load finished, and the forward of layer ``l`` waits on entry ``l``
only. Ending a load (finish, or ABORT and unpublish) is the batch's job
(``engine/batch.py``): this stage never cleans up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from layerlift.engine.loads import BatchLoad
from layerlift.engine.plan import LookupPlan
from layerlift.engine.threads import run_owned
from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest
from layerlift.linker.restorable import choose_boundary, restorable_boundaries
from layerlift.linker.store_base import Store, StoreError
from layerlift.linker.transaction import RestoreTransaction, TransactionState
from layerlift.overlap.base import LayerJob, LoadPolicy
from layerlift.overlap.link import EmulatedLink
from layerlift.overlap.readiness import LayerReadiness
from layerlift.overlap.scheduler import LoadScheduler
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import InsertResult, UnifiedRadixTree

__all__ = ["RestoreLoad", "RestoreStage", "with_dependents"]

log = logging.getLogger("layerlift.engine")


@dataclass(eq=False)
class RestoreLoad:
    """The restores of one batch as one load: the PREPAREd transactions (one
    per restoring request), the per-layer fetch plan over all of them, its
    jobs and the batch's readiness. Owned by the batch (``engine/batch.py``),
    which alone ends it."""

    txns: dict[int, RestoreTransaction]
    load: BatchLoad
    jobs: list[LayerJob]
    readiness: LayerReadiness
    deps: dict[int, set[Hashable]] = field(default_factory=dict)

    @property
    def inserted(self) -> dict[int, InsertResult]:
        """COMMITted or FINISHED requests: the tree's insert result each."""
        live = (TransactionState.COMMITTED, TransactionState.FINISHED)
        return {rid: t.result.insert for rid, t in self.txns.items()
                if t.result is not None and t.state in live}

    def cow_slot(self, rid: int) -> int:
        result = self.txns[rid].result
        assert result is not None and result.cow_source is not None
        return result.cow_source

    def drop_items(self, rids: frozenset[Hashable]) -> None:
        """Stop loading for ``rids`` (only before the jobs were issued)."""
        for items in self.load.items.values():
            items.drop_owners(rids)
        self.load.refresh(self.jobs)


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
            answers = await run_owned(lambda: self.store.exists(keys))
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

    def build_load(self, txns: dict[int, RestoreTransaction]) -> RestoreLoad:
        """Gather the PREPAREd transfers of a batch into one load: one job
        per layer covering every request. ``txns`` is shared, not copied:
        the batch owns it and the load sees every change."""
        # The barrier waits for everything anyway: its best restore reads
        # whole objects in one call (the fair baseline for per-layer overlap).
        load = BatchLoad(self.pool, self.store, self.link, self.staging_alloc,
                         whole=self.scheduler.policy is LoadPolicy.BARRIER)
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
        return RestoreLoad(txns, load, load.jobs(), readiness)

    # ---- COMMIT ------------------------------------------------------------------
    def commit(self, rl: RestoreLoad, plans: Sequence[LookupPlan]) -> dict[int, Exception]:
        """Publish every restore of ``plans`` in the tree, trim the loads to
        the adopted ranges, set the COW sources (no barrier: nothing here
        waits for data). Returns the requests the tree refused (their
        transaction stays PREPARED; the caller fails them) with the reason."""
        refused: dict[int, Exception] = {}
        for plan in plans:
            if plan.request_id in rl.txns:
                try:
                    self._commit_one(rl, plan)
                except ValueError as exc:
                    refused[plan.request_id] = exc
        rl.load.refresh(rl.jobs)
        self._record_dependencies(rl, plans)
        return refused

    def _commit_one(self, rl: RestoreLoad, plan: LookupPlan) -> None:
        txn = rl.txns[plan.request_id]
        result = txn.commit(self.tree, plan.tokens, pending=rl.readiness)
        for c, t in txn.transfers.items():  # duplicates are never loaded
            kept = result.transfers.get(c)
            assert t.device_indices is not None
            gone = set(t.device_indices.tolist())
            if kept is not None and kept.device_indices is not None:
                gone -= set(kept.device_indices.tolist())
            if gone:
                rl.load.items[c].drop_indices(gone)
        # What came from the store is stored: never offload it again.
        for node in result.insert.nodes:
            self.linkers[Component.FULL].mark_stored(node)
        self.linkers[Component.MAMBA].mark_stored(result.node)
        swa_pages = txn.transfers[Component.SWA].pages
        if swa_pages:
            self.tree.mark_stored(result.node, Component.SWA, swa_pages)

    def _record_dependencies(self, rl: RestoreLoad, plans: Sequence[LookupPlan]) -> None:
        """A request whose pages were duplicates of another request's load
        depends on that load: if it fails, both are recomputed."""
        owner = {(c, i): o for c, items in rl.load.items.items()
                 for i, o in zip(items.indices, items.owners, strict=True)}
        inserted = rl.inserted
        for plan in plans:
            rid = plan.request_id
            if rid not in inserted:
                continue
            d, b = plan.device_pages, plan.boundary
            lo = {Component.FULL: d, Component.SWA: max(d, b - plan.spec.window_pages)}
            used = [(c, int(i)) for c in lo for i in inserted[rid].canonical[c][lo[c] : b]]
            used.append((Component.MAMBA, rl.cow_slot(rid)))
            rl.deps[rid] = {owner[u] for u in used if u in owner} - {rid}


def with_dependents(
    failed: frozenset[Hashable], deps: dict[int, set[Hashable]]
) -> frozenset[Hashable]:
    """``failed`` plus every request that (transitively) reads their pages."""
    out = set(failed)
    grew = True
    while grew:
        grew = False
        for rid, on in deps.items():
            if rid not in out and not on.isdisjoint(out):
                out.add(rid)
                grew = True
    return frozenset(out)
