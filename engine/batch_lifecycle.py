"""One batch's lifecycle as a state machine; the only place that cleans up.

======== ==================== ================================================
state    allowed next states  who triggers it
======== ==================== ================================================
PREPARED LOADING, ABORTED     ``Batch.prepare`` (``Engine.load``, ``prefill``):
                              restore slots and compute pages allocated
LOADING  COMMITTED, ABORTED   ``issue()``: store session open, per-layer
                              fetches handed to the scheduler (or nothing to
                              load; a failed session turns every restore into
                              a recompute here)
COMMITTED RUNNING, ABORTED    ``commit()``: restores published in the tree,
                              readiness handed out (settled at once when
                              nothing is left to load)
RUNNING  DONE, ABORTED        ``run()`` / ``begin_external()`` (the passes, in
                              ``engine/batch.py``): the forward with per-layer
                              waits; a failed layer ends the load, unpublishes
                              and recomputes the affected requests, and runs
                              again
DONE     (terminal)           the passes finished: results built, computed
                              pages inserted and offloaded
ABORTED  (terminal)           ``abort()``, or any exception or cancellation in
                              any of the above
======== ==================== ================================================

:class:`BatchLifecycle` holds everything a batch owns: one
:class:`~layerlift.engine.record.RequestRecord` per request (plan, restore
transaction, compute pages, pins, status), one
:class:`~layerlift.engine.batch_restore.BatchRestore` for its load (which
holds the load lock), the device lock, and the bookkeeping of the forward
that may still touch its pages (its own worker thread, or a host's forward).
:class:`~layerlift.engine.batch.Batch` adds the passes that run in RUNNING;
they change what the batch holds only through the methods here (recompute,
defer, end the load, close).

Every outcome leaves through :meth:`BatchLifecycle._exit`: the forward has
returned, the load has ended (no fetch runs, the session is closed; restores
that landed stay published, the rest are unpublished), then record by record
every compute page is freed or owned by the tree, pins and node locks are
dropped and the plan released; the readiness is settled and the load and
device locks released. Exactness holds by construction: a result counts a
request's tokens as restored only if, once no fetch runs any more, its load
had no failure (with the requests that read its pages); otherwise the
request is recomputed and says so.

Ownership and cancellation: every method runs on the event loop; the
forward runs in a worker thread and owns its pages until it returns. Memory
a thread may touch is released only after that thread has returned
(``engine/threads.py``): a cancelled or aborted batch stops its forward at
the next layer and its fetches at the next job, waits for them, then exits;
the cancellation (``task.cancel()``, ``asyncio.wait_for``/``timeout``, a
``TaskGroup`` failure) is raised to the caller once the exit finished. A
host's own forward (external runner) runs in the host's thread, so the host
says when it returned (``engine/hostforward.py``); the exit waits for that,
bounded by ``layer_wait_timeout_s``, and if it never comes leaves the
batch's pages allocated (an ``EngineError``, logged) until it does.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Sequence
from typing import Any, Self, TypeVar

from layerlift.engine.awaiting import CallerWait
from layerlift.engine.batch_restore import BatchRestore
from layerlift.engine.compute import alloc_compute, compute_bytes, free_compute
from layerlift.engine.context import EngineContext, EngineError, release_plan
from layerlift.engine.hostforward import HostForward
from layerlift.engine.plan import LookupPlan
from layerlift.engine.record import RequestRecord, RequestStatus
from layerlift.engine.threads import wait_through
from layerlift.linker.transaction import TransactionState
from layerlift.overlap.readiness import LayerReadiness
from layerlift.pools.base import KVPool

__all__ = ["LOADED", "NEXT", "BatchLifecycle", "BatchState", "too_big"]

T = TypeVar("T")
log = logging.getLogger("layerlift.engine")

def too_big(pool: KVPool, plan: LookupPlan) -> EngineError:
    """The error for a prompt that cannot fit in the pool even alone."""
    need = compute_bytes(pool, plan, boundary=plan.device_pages)
    return EngineError(
        f"prompt {plan.request_id} ({len(plan.tokens)} tokens) cannot fit in the device pool "
        f"({pool.buffer.numel()} bytes) even alone: computing it needs {need} bytes "
        "of pages and state slots beyond its device hit")

LOADED = ("loaded step by step (Engine.load) and neither forwarded nor aborted: forward "
          "or abort that handle")
"""What a handle issued by ``Engine.load`` waits for until its caller moves it on."""


class BatchState(enum.Enum):
    PREPARED = "prepared"
    LOADING = "loading"
    COMMITTED = "committed"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"


NEXT: dict[BatchState, frozenset[BatchState]] = {
    BatchState.PREPARED: frozenset({BatchState.LOADING, BatchState.ABORTED}),
    BatchState.LOADING: frozenset({BatchState.COMMITTED, BatchState.ABORTED}),
    BatchState.COMMITTED: frozenset({BatchState.RUNNING, BatchState.ABORTED}),
    BatchState.RUNNING: frozenset({BatchState.DONE, BatchState.ABORTED}),
    BatchState.DONE: frozenset(),
    BatchState.ABORTED: frozenset(),
}
"""The allowed transitions; anything else raises ``RuntimeError``."""


class BatchLifecycle:
    """One batch from PREPARE to its exit: its state, what it holds (one
    :class:`RequestRecord` per request, in plan order, and one
    :class:`BatchRestore` for its load) and the one exit. The passes of
    RUNNING are :class:`~layerlift.engine.batch.Batch`'s.

    Locks (see :class:`EngineContext`): the caller acquires the load lock
    before :meth:`prepare` and hands it to the batch (its restore releases
    it once the load has landed in full, or at its end); :meth:`issue`
    takes the device lock after issuing the fetches (they run while it
    waits: prefetch) and the exit releases it."""

    def __init__(self, ctx: EngineContext, started: float) -> None:
        self.ctx = ctx
        self.started = started
        self.state = BatchState.PREPARED
        self.records: list[RequestRecord] = []
        self.restore = BatchRestore(ctx)
        self.load_issued = 0.0
        self._exit_task: asyncio.Task[None] | None = None
        self._holds_device = False
        loop = asyncio.get_running_loop()
        self._host = HostForward(loop)  # a host's own forward
        self.caller = CallerWait(loop, ctx.holder_waits)  # what only the caller moves on
        self._left_behind = False  # the exit gave up on a host forward: its pages stay
        self._forward_idle = asyncio.Event()  # no forward thread of this batch runs
        self._forward_idle.set()
        self._forward_stop: threading.Event | None = None
        self._abort_reason: BaseException | None = None
        self.may_defer = False  # prefill sets it: a recompute that does not fit is deferred
        self.deferred: list[LookupPlan] = []  # plans taken out of the batch (see _defer)
        ctx.live.add(self)

    @property
    def plans(self) -> list[LookupPlan]:
        return [r.plan for r in self.records]

    # ---- PREPARE ------------------------------------------------------------------
    @classmethod
    async def prepare(cls, ctx: EngineContext, plans: Sequence[LookupPlan],
                      started: float) -> tuple[Self, list[LookupPlan]]:
        """Take plans in order while they fit: restore slots (PREPAREd) and
        the pages each forward writes. A first plan that does not fit while
        another batch or an offload holds room waits for them (bounded).
        Returns the batch and the plans that did not fit (still the
        caller's). Raises ``EngineError`` when the first plan alone cannot
        fit; on any exception the batch has exited (its plans released, the
        lock released)."""
        batch = cls(ctx, started)
        rest = list(plans)
        try:
            while rest:
                if not await batch._admit(rest[0]):
                    if not batch.records:
                        # Alone it fits (checked by the caller) unless another
                        # batch or an offload holds the room: wait for them.
                        if await ctx.wait_for_room(batch, f"prompt {rest[0].request_id} "
                                                   "does not fit in the device pool now"):
                            batch._check_open()
                            continue
                        raise too_big(ctx.pool, rest[0])
                    break
                rest.pop(0)
            batch.restore.plan(batch.records)
        except BaseException as exc:
            await batch.close(exc)
            raise
        return batch, rest

    async def _admit(self, plan: LookupPlan) -> bool:
        ctx = self.ctx
        boundary, reason = plan.boundary, plan.fallback_reason
        rec = RequestRecord(plan)
        self.records.append(rec)  # in the books before any await: the exit cleans up
        plan.taken = True
        rec.txn = ctx.restore.prepare(plan)
        if rec.txn is not None:
            rec.status = RequestStatus.RESTORING
        rec.compute = alloc_compute(ctx.pool, ctx.tree, plan)
        if rec.compute is None and ctx.offloader.pending:
            # Offloads in flight pin pages and lock nodes; they end on their own,
            # but a put to a stalled store may take long: wait a bounded time,
            # then go on without the room they hold (Engine.close ends the wait).
            await ctx.wait_offloads(ctx.cfg.layer_wait_timeout_s)
            self._check_open()  # aborted meanwhile (Engine.close): the exit owns the record
            rec.compute = alloc_compute(ctx.pool, ctx.tree, plan)
        if rec.compute is None and rec.txn is not None:
            txn, rec.txn, rec.status = rec.txn, None, RequestStatus.COMPUTING
            txn.abort()
            plan.fall_back("not enough device memory to restore")
            rec.compute = alloc_compute(ctx.pool, ctx.tree, plan)
        if rec.compute is None:  # not in this batch: the caller serves it in a later one
            self.records.pop()
            # Still taken: the caller (load, prefill) waits for room with it or
            # releases it; nobody else may release or load it meanwhile.
            plan.boundary, plan.fallback_reason = boundary, reason
            return False
        return True

    # ---- LOADING ------------------------------------------------------------------
    async def issue(self, device_timeout: float | None = None) -> None:
        """Open the store session and hand the per-layer fetches to the
        scheduler, then wait for the device (the previous batch's exit; the
        fetches run meanwhile). A session that fails to open (a key evicted
        since LOOKUP, the store gone) turns every restore of the batch into a
        recompute: nothing was published yet. ``device_timeout``: raise
        ``EngineError`` (the batch exits) once the device has been held that
        long by a batch that waits for its caller (a step-by-step handle
        neither forwarded nor aborted; see ``EngineContext.acquire``). A
        batch that computes is waited for however long its forward takes."""
        self._to(BatchState.LOADING)
        await self._guard(self._issue(device_timeout))

    async def _issue(self, device_timeout: float | None) -> None:
        if self.restore.loads_anything:
            self.load_issued = time.perf_counter() - self.started  # before a layer can land
            failed = await self.restore.start()
            self._check_open()
            if failed is not None:
                await self._drop_before_commit(f"store session failed: {failed}")
                self._check_open()
        if self.restore.task is None:
            self.restore.release_lock()  # nothing in flight
        await self.ctx.acquire(self.ctx.device, device_timeout,
                               f"{self.describe()} waited for the device")
        self._holds_device = True
        # Until forward(), begin_external() or abort(): prefill calls run() with
        # no await between, so its own batch is never seen waiting.
        self.caller.waits(LOADED)
        if self._exit_task is not None and self._exit_task.done():  # its release has passed
            self._holds_device = False
            self.ctx.device.release()
        self._check_open()

    async def _drop_before_commit(self, reason: str) -> None:
        """Nothing was published: every restore becomes a recompute."""
        dropped = [r for r in self.records if r.txn is not None]
        self.restore.drop(frozenset(r.rid for r in dropped))
        for rec in dropped:
            txn, rec.txn = rec.txn, None
            assert txn is not None
            txn.abort()
        await self._recompute(frozenset(r.rid for r in dropped), reason)

    # ---- COMMITTED ----------------------------------------------------------------
    def commit(self) -> LayerReadiness:
        """Publish the restores, trim the loads, set COW sources; returns the
        per-layer readiness (nothing waits here). When nothing is left to
        load the readiness is done at once. ``RuntimeError`` if the batch is
        not LOADING (committed already, aborted, finished)."""
        self._to(BatchState.COMMITTED)
        readiness = self.restore.readiness
        try:
            refused = self.restore.commit(self.records)
            for rec in self.records:
                if rec.rid in refused:  # computed from its device hit instead, at once
                    self._switch_to_compute(rec, f"the tree refused its restore: "
                                                 f"{refused[rec.rid]}")
                    if rec.compute is None:
                        raise EngineError(
                            f"request {rec.rid}: the tree refused its restore "
                            f"({refused[rec.rid]}) and its recompute does not fit in the pool")
            for rec in self.records:
                if rec.published:
                    rec.pin_restore(self.ctx.pool)
            if self.restore.task is None:
                for layer in range(readiness.num_layers):
                    readiness.mark_done(layer)
        except BaseException as exc:
            self.abort(exc)
            raise
        return readiness

    def _unpin(self, rids: frozenset[Hashable] | None = None) -> None:
        if self._left_behind:  # a host forward may still read them: they stay pinned
            return
        for rec in self.records:
            if rids is None or rec.rid in rids:
                rec.unpin(self.ctx.pool)

    # ---- checks and stops (every state) ------------------------------------------
    def _check_open(self) -> None:
        """Raise the abort's error once the exit has begun: the run loop and
        the external-runner calls check it after every await, so only the
        exit releases and nothing is allocated or started behind it."""
        if self.closed:
            raise self._aborted_error()

    def _aborted_error(self) -> EngineError:
        why = f": {self._abort_reason!r}" if self._abort_reason is not None else ""
        where = "during its forward" if self.state is BatchState.RUNNING else "before its forward"
        return EngineError(f"the batch was aborted {where}{why}")

    def _stop(self, reason: str) -> None:
        """Cancelled or aborted: stop a running forward at its next layer and
        the load at its next job (failing the waits the forward may block in)."""
        if self._forward_stop is not None:
            self._forward_stop.set()
        self._stop_load(reason)

    # ---- a restore becomes a recompute --------------------------------------------
    async def _recompute(self, failed: frozenset[Hashable], reason: str) -> None:
        """Compute the failed restores from their device hit instead: new
        compute pages sized for the longer suffix (waiting, bounded, for the
        room another batch or an offload holds)."""
        ctx = self.ctx
        for rec in list(self.records):
            plan = rec.plan
            if rec.rid not in failed or not plan.restores:
                continue
            self._switch_to_compute(rec, reason)
            while rec.compute is None and await ctx.wait_for_room(
                    self, f"request {rec.rid} must be recomputed ({reason})"):
                self._check_open()  # the exit released this record meanwhile
                rec.compute = alloc_compute(ctx.pool, ctx.tree, plan)
            if rec.compute is None and self.may_defer:
                # The room is held by this batch's other requests or by the
                # plans of the batch looking up behind it (a longer suffix
                # needs pages the tri-pool cannot place around their pinned
                # pages and slots): serve this one in a later part instead.
                self._defer(rec)
                continue
            if rec.compute is None:
                raise EngineError(
                    f"request {rec.rid} must be recomputed ({reason}) but its "
                    f"{compute_bytes(ctx.pool, plan)} bytes of pages do not fit in the pool")

    def _switch_to_compute(self, rec: RequestRecord, reason: str) -> None:
        """Drop ``rec``'s restore: its compute pages are freed and allocated
        again for the longer suffix from its device hit (``rec.compute`` is
        None when they do not fit now). Its restore slots stay with its
        transaction until the load ended (a fetch may still write them)."""
        ctx = self.ctx
        assert rec.compute is not None
        comp, rec.compute = rec.compute, None
        free_compute(ctx.pool, comp)
        rec.plan.fall_back(reason)
        rec.status = RequestStatus.RECOMPUTED
        rec.compute = alloc_compute(ctx.pool, ctx.tree, rec.plan)

    # ---- end of the load ------------------------------------------------------------
    def _stop_load(self, reason: str) -> None:
        self.restore.stop(reason)

    async def _end_load(self) -> frozenset[Hashable]:
        """End the load once (see :meth:`BatchRestore.end`)."""
        return await self.restore.end(self.records, self._unpin)

    # ---- ABORTED / exit -------------------------------------------------------------
    def abort(self, error: BaseException | None = None) -> None:
        """ABORT: stop the loads at once and start the exit (returns at once;
        ``await aclose()`` waits until every fetch stopped and every slot is
        free). Restores published at COMMIT leave the tree unless their load
        had already ended and landed. Idempotent; no-op after the exit."""
        if self._exit_task is None:
            self._abort_reason = error or RuntimeError("aborted")
            # Stop now, not when the exit task first runs: a fetch that
            # resumes before then must not land the layers after it.
            self._stop(f"batch aborted: {self._abort_reason!r}")
            self._exit_task = asyncio.get_running_loop().create_task(
                self._exit(self._abort_reason))

    async def close(self, error: BaseException | None) -> None:
        """Run the exit (once) and wait until it finished. A cancellation of
        the caller does not stop the exit and is raised once it finished."""
        if self._exit_task is None:
            self._exit_task = asyncio.get_running_loop().create_task(self._exit(error))
        await wait_through(self._exit_task)

    async def aclose(self) -> None:
        """Wait for the exit that ``abort`` started (no-op if none); a
        cancellation is raised once the exit finished."""
        if self._exit_task is not None:
            await wait_through(self._exit_task)

    @property
    def closed(self) -> bool:
        return self._exit_task is not None

    async def _exit(self, error: BaseException | None) -> None:
        """The one exit every outcome goes through (see the module docstring).

        Nothing is released while a thread of this batch may still touch it:
        first the forward returns (stopped at its next layer on an abort),
        then the load ends (no fetch runs, the session is closed). Each later
        step runs whatever an earlier one raised; their errors are attached
        to ``error`` as notes (and logged), or raised as one ``EngineError``
        after a clean run, never instead of the error that ended the batch."""
        ctx = self.ctx
        problems: list[BaseException] = []

        def step(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:
                exc.add_note(f"while the batch's exit was {what}")
                problems.append(exc)

        lost: EngineError | None = None
        try:
            self._host.close()  # a host forward that has not started must not start now
            if error is not None:
                self._stop(f"batch aborted: {error!r}")
            await self._forward_idle.wait()  # the forward's pages are its own until it returns
            if not await self._host.wait_returned(ctx.cfg.layer_wait_timeout_s):
                lost = self._host_lost()
            try:
                await self._end_load()
            except Exception as exc:
                problems.append(exc)
            if lost is not None:  # a host forward may still write them: leave them be
                self._host.on_late_return(functools.partial(self._release_late,
                                                            list(self.records)))
            else:
                for rec in self.records:  # record by record, each step on its own
                    step(f"releasing request {rec.rid}", functools.partial(self._release, rec))
            step("flushing deferred frees", ctx.pool.flush_deferred)
            step("settling the readiness",
                 lambda: self.restore.readiness.cancel("the batch has ended"))
        finally:
            self.state = BatchState.DONE if error is None else BatchState.ABORTED
            ctx.live.discard(self)
            ctx.room_freed()
            self.restore.release_lock()
            if self._holds_device:
                self._holds_device = False
                ctx.device.release()
        if problems:
            for problem in problems:
                log.error("batch exit: %r", problem, exc_info=problem)
            ended: BaseException | None = error if error is not None else lost
            if ended is None:
                raise EngineError(f"the batch's cleanup failed: {problems[0]!r}") from problems[0]
            for problem in problems:
                ended.add_note(f"and during the cleanup: {problem!r}")
        if lost is not None:
            log.error("batch exit: %s", lost)
            raise lost from error

    def _host_lost(self) -> EngineError:
        """The error of an exit whose host forward never said it returned."""
        self._left_behind = True
        rids = [r.rid for r in self.records]
        return EngineError(
            f"the host's forward over requests {rids} did not return within "
            f"{self.ctx.cfg.layer_wait_timeout_s} s (layer_wait_timeout_s) of the batch's "
            "end: an external runner must say when its forward returned (leave "
            "ExternalForward.running(), or call returned(), done() or failed()). Its pages "
            "and slots are left allocated (not freed under a forward that may still write "
            "them) until it does")

    def _release_late(self, records: list[RequestRecord]) -> None:
        """The host forward an exit gave up on returned: release what it left."""
        ctx = self.ctx
        for rec in records:
            try:
                self._release(rec)
            except Exception as exc:
                log.error("releasing request %s after its host forward returned: %r",
                          rec.rid, exc, exc_info=exc)
        self._left_behind = False
        try:
            ctx.pool.flush_deferred()
        finally:
            ctx.room_freed()

    def _defer(self, rec: RequestRecord) -> None:
        """Take a request whose restore failed out of this batch (its
        restore is already unpublished, its compute pages freed): the caller
        serves ``self.deferred`` in a later part."""
        self.records.remove(rec)
        self._release(rec)
        self.deferred.append(rec.plan)

    def _release(self, rec: RequestRecord) -> None:
        """Everything the batch holds for one request: its compute pages,
        its pins, its landed restore's node lock, its plan's hold."""
        ctx = self.ctx
        if rec.compute is not None:
            comp, rec.compute = rec.compute, None
            free_compute(ctx.pool, comp)
        rec.unpin(ctx.pool)
        txn, rec.txn = rec.txn, None
        if txn is not None and txn.state is TransactionState.FINISHED and txn.result is not None:
            ctx.tree.unlock(txn.result.node)
        release_plan(ctx, rec.plan)

    # ---- helpers --------------------------------------------------------------------
    @property
    def holds_device(self) -> bool:
        return self._holds_device

    @property
    def holds_load_lock(self) -> bool:
        return self.restore.holds_lock

    @property
    def awaiting_caller(self) -> bool:
        """Not exited, and only its caller can move it on (see
        ``engine/awaiting.py``): a step-by-step handle issued but neither
        forwarded nor aborted, or a host forward told to rerun, whose wait
        failed, or that returned without ``done()``/``failed()``/``abort()``.
        ``prefill`` runs its batch right after ``issue`` (no await between),
        so a batch of its own is never seen here."""
        return self._exit_task is None and self.caller.since is not None

    def describe(self) -> str:
        """Which batch this is, for an error message (what it waits for,
        when it waits for its caller)."""
        how = self.caller.what if self.awaiting_caller else self.state.value
        return f"the batch of requests {[r.rid for r in self.records]} ({how})"

    @property
    def readiness(self) -> LayerReadiness:
        return self.restore.readiness

    def _to(self, state: BatchState) -> None:
        if self._exit_task is not None or state not in NEXT[self.state]:
            now = "ending" if self._exit_task is not None else self.state.value
            raise RuntimeError(f"this batch is {now}; it cannot become {state.value}")
        self.state = state

    async def _guard(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return await coro
        except BaseException as exc:
            await self.close(exc)
            raise
