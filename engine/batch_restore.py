"""One batch's restore, from its fetch plan to its end.

:class:`BatchRestore` owns everything about the load of one batch: the fetch
plan over every restoring request (one store call per layer, ``BatchLoad``)
and its per-layer jobs, the batch's :class:`LayerReadiness`, which requests
read pages another one loads (``deps``), the read session, the scheduler's
task, and the engine's load lock the batch handed it. The restore
transactions themselves live in the batch's request records
(``engine/record.py``); the methods that act on them take the records.

Its life: :meth:`plan` (after PREPARE) → :meth:`start` (session, fetches) →
:meth:`commit` (publish, trim duplicates, COW sources) → :meth:`end`, once
(no fetch runs any more, session closed; what landed is finished, the rest
unpublished). The load lock is released as soon as the load landed in full
(the next batch may then look up and fetch: prefetch), or at the end.

Ownership: restore slots and staging rows are written by fetch threads; they
are released only by :meth:`end`, after the scheduler is quiescent (no
fetch runs or can start) and the session's close returned. Threads: event
loop only; blocking calls go through ``engine/threads.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable, Sequence

from layerlift.engine.context import EngineContext
from layerlift.engine.loads import BatchLoad
from layerlift.engine.record import RequestRecord
from layerlift.engine.threads import run_owned, wait_through
from layerlift.linker.store_base import StoreError
from layerlift.linker.transaction import TransactionState
from layerlift.overlap.base import LayerJob, LoadPolicy
from layerlift.overlap.readiness import LayerReadiness
from layerlift.overlap.scheduler import LayerTiming, LoadTask
from layerlift.pools.spec import Component

__all__ = ["BatchRestore", "with_dependents"]


class BatchRestore:
    """The load of one batch (see the module docstring). The caller holds
    the engine's load lock when it builds this object and hands it over."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.load: BatchLoad | None = None
        self.jobs: list[LayerJob] = []
        self.readiness = LayerReadiness(ctx.pool.spec.num_layers,
                                        default_timeout=ctx.cfg.layer_wait_timeout_s)
        self.deps: dict[int, set[Hashable]] = {}
        self.task: LoadTask | None = None
        self.session = contextlib.ExitStack()
        self._end: asyncio.Future[frozenset[Hashable]] | None = None
        self._starting: asyncio.Future[StoreError | None] | None = None
        self._holds_lock = True

    # ---- the fetch plan (PREPARED) ---------------------------------------------------
    def plan(self, records: Sequence[RequestRecord]) -> None:
        """Gather the PREPAREd transfers of ``records`` into one load: one
        job per layer covering every request, and the readiness over them."""
        stage = self.ctx.restore
        # The barrier waits for everything anyway: its best restore reads
        # whole objects in one call (the fair baseline for per-layer overlap).
        load = BatchLoad(stage.pool, stage.store, stage.link, stage.staging_alloc,
                         whole=stage.scheduler.policy is LoadPolicy.BARRIER,
                         verify=self.ctx.cfg.verify_restores)
        seen: set[str] = set()
        restoring = [r for r in records if r.txn is not None]
        for rec in restoring:
            assert rec.txn is not None
            for c, t in rec.txn.transfers.items():
                # Two requests restoring the same page: only the first (which
                # commits first, so the tree adopts its slot) loads it.
                assert t.device_indices is not None
                rows = [i for i, k in enumerate(t.keys) if k not in seen]
                seen.update(t.keys)
                idx = t.device_indices.tolist()
                load.items[c].add([t.keys[i] for i in rows], [idx[i] for i in rows], rec.rid)
        self.load, self.jobs = load, load.jobs()
        self.readiness = LayerReadiness(
            self.ctx.pool.spec.num_layers, requests=frozenset(r.rid for r in restoring),
            default_timeout=self.ctx.cfg.layer_wait_timeout_s)

    def drop(self, rids: frozenset[Hashable]) -> None:
        """Stop loading for ``rids`` (only before the jobs were issued)."""
        assert self.load is not None and self.task is None
        for items in self.load.items.values():
            items.drop_owners(rids)
        self.load.refresh(self.jobs)

    @property
    def loads_anything(self) -> bool:
        return self.load is not None and bool(self.load.keys)

    @property
    def timings(self) -> list[LayerTiming]:
        return self.task.timings if self.task is not None else []

    @property
    def ended(self) -> bool:
        """The load's end has started (no fetch will be waited for again)."""
        return self._end is not None

    # ---- LOADING -------------------------------------------------------------------
    async def start(self) -> StoreError | None:
        """Open the read session and hand the jobs to the scheduler. A
        session that fails to open is returned, not raised: nothing was
        published, the batch recomputes those restores."""
        assert self.load is not None and self._starting is None
        self._starting = asyncio.ensure_future(self._start())
        return await wait_through(self._starting)

    async def _start(self) -> StoreError | None:
        assert self.load is not None
        store, keys = self.ctx.restore.store, self.load.keys
        try:
            # Owned: a cancelled start still waits for the open to return, so
            # a session that opens after all is in ``session`` and is closed.
            await run_owned(lambda: self.session.enter_context(store.open_session(keys)))
        except StoreError as exc:
            return exc
        if self._end is not None:  # aborted while the session opened: fetch nothing
            return None
        self.task = self.ctx.restore.scheduler.start(self.jobs, self.readiness)
        landed = asyncio.ensure_future(self.task.done())
        landed.add_done_callback(self._on_landed)
        return None

    def _on_landed(self, fut: asyncio.Future[None]) -> None:
        """The load ran to its end: let the next batch look up and fetch
        (prefetch) unless something failed, in which case the lock stays
        until what did not land has been unpublished."""
        if not fut.cancelled() and fut.exception() is None \
                and not self.readiness.failed_requests():
            self.release_lock()

    @property
    def holds_lock(self) -> bool:
        """Whether the engine's load lock is still this load's."""
        return self._holds_lock

    def release_lock(self) -> None:
        if self._holds_lock:
            self._holds_lock = False
            self.ctx.lock.release()

    def stop(self, reason: str) -> None:
        """Stop issuing fetches (the running ones finish) and fail every
        layer not yet landed."""
        if self.task is not None:
            self.task.cancel(reason)
        self.readiness.cancel(reason)

    # ---- COMMITTED -----------------------------------------------------------------
    def commit(self, records: Sequence[RequestRecord]) -> dict[int, Exception]:
        """Publish every restore of ``records`` in the tree, trim the loads
        to the adopted ranges, set the COW sources (nothing waits for data).
        Returns the requests the tree refused (their transaction stays
        PREPARED; the caller fails them) with the reason."""
        assert self.load is not None
        refused: dict[int, Exception] = {}
        for rec in records:
            if rec.txn is not None:
                try:
                    self._commit_one(rec)
                except ValueError as exc:
                    refused[rec.rid] = exc
        self.load.refresh(self.jobs)
        self._record_dependencies(records)
        return refused

    def _commit_one(self, rec: RequestRecord) -> None:
        stage, load, txn = self.ctx.restore, self.load, rec.txn
        assert load is not None and txn is not None
        result = txn.commit(stage.tree, rec.plan.tokens, pending=self.readiness)
        for c, t in txn.transfers.items():  # duplicates are never loaded
            kept = result.transfers.get(c)
            assert t.device_indices is not None
            gone = set(t.device_indices.tolist())
            if kept is not None and kept.device_indices is not None:
                gone -= set(kept.device_indices.tolist())
            if gone:
                load.items[c].drop_indices(gone)
        # What came from the store is stored: never offload it again.
        for node in result.insert.nodes:
            stage.linkers[Component.FULL].mark_stored(node)
        stage.linkers[Component.MAMBA].mark_stored(result.node)
        swa_pages = txn.transfers[Component.SWA].pages
        if swa_pages:
            stage.tree.mark_stored(result.node, Component.SWA, swa_pages)

    def _record_dependencies(self, records: Sequence[RequestRecord]) -> None:
        """A request whose pages were duplicates of another request's load
        depends on that load: if it fails, both are recomputed."""
        assert self.load is not None
        owner = {(c, i): o for c, items in self.load.items.items()
                 for i, o in zip(items.indices, items.owners, strict=True)}
        for rec in records:
            if not rec.published:
                continue
            plan = rec.plan
            full, swa, _ = rec.read_tables()
            d, b = plan.device_pages, plan.boundary
            used = [(Component.FULL, int(i)) for i in full[d:b]]
            used += [(Component.SWA, int(i)) for i in swa[max(d, b - plan.spec.window_pages):b]]
            used.append((Component.MAMBA, int(rec.cow_slot())))
            self.deps[rec.rid] = {owner[u] for u in used if u in owner} - {rec.rid}

    # ---- the end ---------------------------------------------------------------------
    async def end(self, records: Sequence[RequestRecord],
                  unpin: Callable[[frozenset[Hashable]], None]) -> frozenset[Hashable]:
        """Once: wait until no fetch runs, close the session, then finish the
        restores that landed in full and unpublish the rest (with the
        requests that read their pages; a transaction never COMMITted is
        aborted). An aborted batch stops its load first, so what had not
        landed by then fails here; what had landed stays published (its
        bytes are whole). ``unpin(rids)`` drops the batch's pins on what the
        failed requests read, before they are unpublished. Returns the
        requests unpublished; later calls return the same set. A cancelled
        caller does not stop it half-way (and is cancelled once it ended)."""
        if self._end is None:
            self._end = asyncio.ensure_future(self._end_now(list(records), unpin))
        return await wait_through(self._end)

    async def _end_now(self, records: list[RequestRecord],
                       unpin: Callable[[frozenset[Hashable]], None]) -> frozenset[Hashable]:
        try:
            if self._starting is not None:  # the session's open returns first
                with contextlib.suppress(Exception):
                    await wait_through(self._starting)
            if self.task is not None:
                await self.task.wait_quiescent()
            await run_owned(self.session.close)
        finally:
            if self.load is not None:
                self.load.close_staging()
        restoring: dict[Hashable, RequestRecord] = {r.rid: r for r in records
                                                     if r.txn is not None}
        broken = with_dependents(self.readiness.failed_requests(), self.deps) & set(restoring)
        never = {rid for rid, r in restoring.items() if not r.published}
        failed = frozenset(broken | never)
        for rid, rec in restoring.items():
            assert rec.txn is not None
            if rid not in failed and rec.txn.state is TransactionState.COMMITTED:
                rec.txn.finish()
        unpin(failed)
        try:
            self._unpublish([restoring[rid] for rid in failed],
                            landed=frozenset(restoring) - broken)
        finally:
            self.release_lock()
        return failed

    @staticmethod
    def _unpublish(records: list[RequestRecord], landed: frozenset[Hashable]) -> None:
        """ABORT the restores of ``records``: their pages leave the tree and
        their slots are freed. A restore whose node another request locks
        goes after it; one that landed in full and that a later batch has
        looked up since (prefetch) stays published instead: its bytes are
        whole and that batch reads them."""
        live = (TransactionState.LOADED, TransactionState.PREPARED, TransactionState.COMMITTED)
        todo = [r for r in records if r.txn is not None and r.txn.state in live]
        while todo:
            left = []
            for rec in todo:
                assert rec.txn is not None
                try:
                    rec.txn.abort()
                except ValueError:
                    left.append(rec)
            if len(left) == len(todo):
                keep = [r for r in left if r.rid in landed and r.txn is not None
                        and r.txn.state is TransactionState.COMMITTED]
                if not keep:
                    raise RuntimeError("failed restores lock each other; cannot unpublish")
                for rec in keep:
                    assert rec.txn is not None
                    rec.txn.finish()
                left = [r for r in left if r not in keep]
            todo = left


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
