"""The restore stage of an engine: LOOKUP and LOAD/PREPARE, per plan.

All methods run on the event-loop thread (the tree and the pool's allocator
state are single-threaded); blocking store calls go to worker threads that
are waited for even when the caller is cancelled (``engine/threads.py``).

Each restoring request is one :class:`RestoreTransaction` (the contract's
LOAD/PREPARE/COMMIT/ABORT, in ``linker/``). This stage asks the store once
for every key of a batch (LOOKUP) and PREPAREs one plan at a time; one
batch's load over all of its transactions (one fetch per layer, the
readiness, COMMIT, the end) is :class:`~layerlift.engine.batch_restore.BatchRestore`.
This stage never cleans up: the batch does (``engine/batch.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from layerlift.engine.plan import LookupPlan
from layerlift.engine.threads import run_owned
from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest
from layerlift.linker.restorable import choose_boundary, restorable_boundaries
from layerlift.linker.store_base import Store, StoreError
from layerlift.linker.transaction import RestoreTransaction
from layerlift.overlap.link import EmulatedLink
from layerlift.overlap.scheduler import LoadScheduler
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["RestoreStage"]

log = logging.getLogger("layerlift.engine")


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
            plan.fall_back("not enough device memory to restore")
            return None
        txn.prepare()
        return txn
