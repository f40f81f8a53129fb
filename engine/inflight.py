"""One batch's restore while it is in flight: the read session, the
scheduler's task, the early release of the engine's load lock, and the
load's one end (finish what landed, unpublish the rest).

Owned and driven by :class:`~layerlift.engine.batch.Batch`, which decides
when each step happens; this module holds the mechanics of the load so the
batch module stays the state machine. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable

from layerlift.engine.context import EngineContext
from layerlift.engine.restore import RestoreLoad, with_dependents
from layerlift.engine.threads import run_owned, wait_through
from layerlift.linker.store_base import StoreError
from layerlift.linker.transaction import RestoreTransaction, TransactionState
from layerlift.overlap.scheduler import LayerTiming, LoadTask

__all__ = ["InFlightLoad"]


class InFlightLoad:
    """The load of one batch from its session to its end.

    ``txns`` is the batch's own dict of restore transactions (shared, not
    copied). ``unpin(rids)`` drops the batch's pins on what those requests'
    forward reads, before their restores are unpublished. The batch hands
    this object the engine's load lock it holds; the lock is released once
    the load landed in full, or at its end, whichever comes first.
    """

    def __init__(self, ctx: EngineContext, txns: dict[int, RestoreTransaction],
                 unpin: Callable[[frozenset[Hashable]], None]) -> None:
        self.ctx, self.txns, self._unpin = ctx, txns, unpin
        self.rl: RestoreLoad | None = None
        self.task: LoadTask | None = None
        self.session = contextlib.ExitStack()
        self._end: asyncio.Future[frozenset[Hashable]] | None = None
        self._holds_lock = True

    @property
    def ended(self) -> bool:
        """The load's end has started (no fetch will be waited for again)."""
        return self._end is not None

    @property
    def timings(self) -> list[LayerTiming]:
        return self.task.timings if self.task is not None else []

    async def start(self) -> StoreError | None:
        """Open the read session and hand the jobs to the scheduler. A
        session that fails to open is returned, not raised: nothing was
        published, the batch recomputes those restores."""
        rl, store = self.rl, self.ctx.restore.store
        assert rl is not None
        keys = rl.load.keys
        try:
            # Owned: a cancelled start still waits for the open to return, so
            # a session that opens after all is in ``session`` and is closed.
            await run_owned(lambda: self.session.enter_context(store.open_session(keys)))
        except StoreError as exc:
            return exc
        self.task = self.ctx.restore.scheduler.start(rl.jobs, rl.readiness)
        landed = asyncio.ensure_future(self.task.done())
        landed.add_done_callback(self._on_landed)
        return None

    def _on_landed(self, fut: asyncio.Future[None]) -> None:
        """The load ran to its end: let the next batch look up and fetch
        (prefetch) unless something failed, in which case the lock stays
        until what did not land has been unpublished."""
        if not fut.cancelled() and fut.exception() is None and self.rl is not None \
                and not self.rl.readiness.failed_requests():
            self.release_lock()

    def release_lock(self) -> None:
        if self._holds_lock:
            self._holds_lock = False
            self.ctx.lock.release()

    def stop(self, reason: str) -> None:
        """Stop issuing fetches (the running one finishes)."""
        if self.task is not None:
            self.task.cancel(reason)

    async def end(self) -> frozenset[Hashable]:
        """Once: wait until no fetch runs, close the session, then finish the
        restores that landed in full and unpublish the rest (with the
        requests that read their pages; a transaction never COMMITted is
        aborted). An aborted batch stops its load first, so what had not
        landed by then fails here; what had landed stays published (its
        bytes are whole). Returns the requests unpublished; later calls
        return the same set. Shielded: a cancelled caller does not stop it
        half-way."""
        if self._end is None:
            self._end = asyncio.ensure_future(self._end_now())
        return await wait_through(self._end)

    async def _end_now(self) -> frozenset[Hashable]:
        rl = self.rl
        try:
            if self.task is not None:
                await self.task.wait_quiescent()
            await run_owned(self.session.close)
        finally:
            if rl is not None:
                rl.load.close_staging()
        if rl is None:  # PREPARE did not finish: nothing was issued or published
            failed = frozenset(self.txns)
            try:
                self._unpublish(failed, landed=frozenset())
            finally:
                self.release_lock()
            return failed
        broken = with_dependents(rl.readiness.failed_requests(), rl.deps) & set(self.txns)
        never = {rid for rid, t in self.txns.items() if t.state is not TransactionState.COMMITTED
                 and t.state is not TransactionState.FINISHED}
        failed = broken | frozenset(never)
        for rid, txn in self.txns.items():
            if rid not in failed and txn.state is TransactionState.COMMITTED:
                txn.finish()
        self._unpin(failed)
        try:
            self._unpublish(failed, landed=frozenset(self.txns) - broken)
        finally:
            self.release_lock()
        return failed

    def _unpublish(self, failed: frozenset[Hashable], landed: frozenset[Hashable]) -> None:
        """ABORT the restores of ``failed``: their pages leave the tree and
        their slots are freed. A restore whose node another request locks
        goes after it; one that landed in full and that a later batch has
        looked up since (prefetch) stays published instead: its bytes are
        whole and that batch reads them."""
        live = (TransactionState.LOADED, TransactionState.PREPARED, TransactionState.COMMITTED)
        todo = [(rid, t) for rid, t in self.txns.items() if rid in failed and t.state in live]
        while todo:
            left = []
            for rid, txn in todo:
                try:
                    txn.abort()
                except ValueError:
                    left.append((rid, txn))
            if len(left) == len(todo):
                keep = [(rid, t) for rid, t in left
                        if rid in landed and t.state is TransactionState.COMMITTED]
                if not keep:
                    raise RuntimeError("failed restores lock each other; cannot unpublish")
                for _, txn in keep:
                    txn.finish()
                left = [x for x in left if x not in keep]
            todo = left
