"""What one engine's batches share, and the plans that enter a batch.

:class:`EngineContext` is the engine's working set handed to each batch
(model, pools, tree, restore stage, offloader, the load and device locks),
so a batch
never reaches into :class:`~layerlift.engine.api.Engine`'s private state.
``match_plan`` / ``release_plan`` are the two ends of a plan's hold on the
device tree: a plan locks its device-hit node and pins the pages its forward
will read until it is released (by its batch's exit, or by the caller when it
is never loaded).

Threads: everything here runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerlift.engine.config import EngineConfig
from layerlift.engine.costmodel import CostModel
from layerlift.engine.offload import Offloader
from layerlift.engine.plan import LookupPlan
from layerlift.engine.restore import RestoreStage
from layerlift.pools.base import KVPool
from layerlift.pools.hashing import page_hashes
from layerlift.pools.spec import Component
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["EngineContext", "EngineError", "match_plan", "release_plan", "release_plans"]


class EngineError(RuntimeError):
    """The engine cannot serve a request (e.g. the pool cannot hold it)."""


_LOCK_NAMES = {True: "load lock", False: "device"}


@dataclass(eq=False)
class EngineContext:
    """One engine's shared parts and its two locks.

    ``lock`` (the load lock) is held from LOOKUP through a batch's PREPARE
    and fetches until its load has landed (or ended): one batch loads at a
    time, and nobody looks up nodes whose load is still in flight.
    ``device`` is held by a batch from just before COMMIT until its exit: one
    forward at a time. A batch takes ``device`` while still holding
    ``lock``; the next batch can look up, PREPARE and fetch (prefetch) while
    the previous one computes once that one's load has landed, so the
    running batch's layers keep the link to themselves."""

    model: Any
    cfg: EngineConfig
    pool: KVPool
    tree: UnifiedRadixTree
    restore: RestoreStage
    offloader: Offloader
    cost: CostModel | None = None  # restore="auto": restore or recompute, learned
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    device: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_id: int = 0
    live: set[Any] = field(default_factory=set)
    """Batches not yet exited (``engine/batch.py``): ``Engine.close`` aborts
    and waits for them before it closes the lane and the store."""
    room: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced by a fresh event) each time a batch exits: what a
    batch waits on when another batch holds the room it needs."""
    closing: bool = False
    """``Engine.close`` has begun: nothing new starts (no lookup, batch or
    offload), and every wait for a lock or for room raises ``EngineError``."""
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when ``closing`` turns True: wakes every waiter."""
    room_waiters: set[Any] = field(default_factory=set)
    """Batches inside :meth:`wait_for_room` (they free nothing while they wait)."""
    holder_waiting: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) each time a batch starts waiting for its caller
    (``engine/awaiting.py``): wakes :meth:`acquire` so that its bound counts
    from then."""
    _queued: dict[asyncio.Lock, int] = field(default_factory=dict, repr=False)
    """Callers of :meth:`acquire` waiting for each lock."""

    def room_freed(self) -> None:
        """A batch exited (its pages went to the tree or the free lists)."""
        self.room.set()
        self.room = asyncio.Event()

    def holder_waits(self) -> None:
        """A batch began waiting for its caller (on the event loop)."""
        self.holder_waiting.set()
        self.holder_waiting = asyncio.Event()

    def begin_close(self) -> None:
        """``Engine.close`` starts: refuse everything new, wake every waiter."""
        self.closing = True
        self.closed.set()
        self.room_freed()

    def check_open(self) -> None:
        """``EngineError`` once the engine is closing."""
        if self.closing:
            raise EngineError("the engine is closing or closed: start a new one")

    async def acquire(self, lock: asyncio.Lock, bound: float | None, what: str) -> None:
        """Acquire ``lock`` (``self.lock`` or ``self.device``) for ``what``.

        Waits as long as whatever holds it makes progress: a batch still
        looking up, loading or computing (its own waits are bounded) ends by
        itself. The one holder that does not is a batch that waits for its
        caller (:attr:`Batch.awaiting_caller`: loaded step by step, neither
        forwarded nor aborted; a host forward told to rerun, whose wait
        failed, or that returned without ``done()``/``failed()``): once such
        a holder has waited ``bound`` seconds for its caller while this call
        waited, ``EngineError`` names it and what it waits for. Raises
        ``EngineError`` at once when the engine closes (the lock is not
        taken then). On any exception or cancellation the lock is not held.

        A lock that is free with nobody queued for it is taken at once: that
        ``lock.acquire()`` never yields, so nothing can close the engine or
        take the lock in between, and it costs no task and no wait (three
        event-loop passes fewer on every batch's lookup and issue)."""
        self.check_open()
        if not lock.locked() and not self._queued.get(lock):
            await lock.acquire()
            return
        self._queued[lock] = self._queued.get(lock, 0) + 1
        try:
            await self._acquire_waiting(lock, bound, what)
        finally:
            self._queued[lock] -= 1

    async def _acquire_waiting(self, lock: asyncio.Lock, bound: float | None,
                               what: str) -> None:
        """:meth:`acquire` when ``lock`` is held or others are queued for it
        (counted in ``_queued``, so a lock handed to a queued waiter is not
        taken past it)."""
        started = time.monotonic()
        got = asyncio.ensure_future(lock.acquire())
        closed = asyncio.ensure_future(self.closed.wait())
        try:
            while True:
                self.check_open()
                step = bound
                held = self._idle_holder(lock)
                since = None if held is None else held.caller.since
                if since is not None and bound is not None:
                    idle = time.monotonic() - max(started, since)
                    if idle >= bound:
                        raise EngineError(
                            f"{what}: {held.describe()} kept the "
                            f"{_LOCK_NAMES[lock is self.lock]} for {idle:.1f} s waiting for "
                            f"its caller (layer_wait_timeout_s={bound})")
                    step = bound - idle
                # A holder that starts waiting for its caller wakes this wait.
                moved = asyncio.ensure_future(self.holder_waiting.wait())
                try:
                    await asyncio.wait((got, closed, moved), timeout=step,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
                if got.done():
                    self.check_open()
                    return
        except BaseException:
            if got.done() and not got.cancelled() and got.exception() is None:
                lock.release()
            else:
                got.cancel()
            raise
        finally:
            closed.cancel()

    def _idle_holder(self, lock: asyncio.Lock) -> Any:
        """The batch holding ``lock`` if it waits for its caller, else None.
        The load lock counts only once that batch's load has settled (a
        load in flight releases the lock when it lands)."""
        for batch in self.live:
            if lock is self.device and batch.holds_device and batch.awaiting_caller:
                return batch
            if lock is self.lock and batch.holds_load_lock and batch.awaiting_caller \
                    and batch.readiness.settled():
                return batch
        return None

    async def wait_for_room(self, me: Any, need: str) -> bool:
        """Wait until another batch in flight exits or the pending offloads
        end (they hold pages); False at once if neither holds anything.
        Waits as long as another batch computes (it holds the device, is not
        a handle waiting for its caller and is not waiting for room itself:
        its exit frees the room); ``EngineError`` naming what holds the room
        once it stayed held ``layer_wait_timeout_s`` by nothing that
        progresses (batches waiting for the device, for room or for their
        caller, offloads to a stalled store), or at once when the engine
        closes. ``me``: the waiting batch."""
        bound = self.cfg.layer_wait_timeout_s
        while True:
            self.check_open()
            others = [b for b in self.live if b is not me]
            if not others and not self.offloader.pending:
                return False
            room = self.room
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(room.wait()),
                                                asyncio.ensure_future(self.closed.wait())]
            if self.offloader.pending:
                waits.append(asyncio.ensure_future(self.offloader.wait()))
            self.room_waiters.add(me)
            try:
                done, _ = await asyncio.wait(waits, timeout=bound,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.room_waiters.discard(me)
                for w in waits:
                    w.cancel()
            self.check_open()
            if done:
                return True
            if any(b.holds_device and not b.awaiting_caller and b not in self.room_waiters
                   for b in self.live if b is not me):
                continue  # another batch computes: its exit frees the room
            held = "; ".join(b.describe() for b in others) or "no other batch"
            raise EngineError(
                f"{need}, and the room stayed held for {bound} s by "
                f"{len(others)} other batch(es) none of which computes ({held}), and "
                f"{'pending' if self.offloader.pending else 'no'} offloads")

    async def wait_offloads(self, bound: float) -> None:
        """Wait until the pending offloads ended, at most ``bound`` seconds;
        ``EngineError`` at once when the engine closes."""
        waits = [asyncio.ensure_future(self.offloader.wait()),
                 asyncio.ensure_future(self.closed.wait())]
        try:
            await asyncio.wait(waits, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.check_open()

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)


def match_plan(ctx: EngineContext, tokens: Sequence[int] | np.ndarray) -> LookupPlan:
    """Match ``tokens`` against the device tree: lock the deepest device
    boundary and pin what the forward will read there. Raises ``ValueError``
    for a prompt that is not a non-empty 1-D sequence of valid token ids
    (nothing is locked then)."""
    spec = ctx.pool.spec
    arr = np.asarray(tokens)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError("a prompt must be a non-empty 1-D sequence of token ids")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() >= ctx.vocab_size:
        raise ValueError(f"token ids must lie in [0, {ctx.vocab_size}) for this model")
    # At least one token is computed (it gives the next-token distribution):
    # match only the pages before the last token, or a prompt cached whole at
    # a checkpoint would have nothing left to compute.
    usable = (len(arr) - 1) // spec.page_size
    match = ctx.tree.match_prefix(arr[: usable * spec.page_size])
    ctx.tree.lock(match.node)
    plan = LookupPlan(ctx.next_id, arr, tuple(page_hashes(arr, spec.page_size)), match, spec,
                      owner=ctx)
    ctx.next_id += 1
    d, w = match.boundary_pages, spec.window_pages
    slot = [] if match.mamba_slot is None else [match.mamba_slot]
    pins = [(Component.FULL, match.full_indices),
            (Component.SWA, match.swa_indices[max(0, d - w):]),
            (Component.MAMBA, torch.tensor(slot, dtype=torch.int64))]
    for c, idx in pins:
        if len(idx):
            ctx.pool.pin(c, idx)
            plan.pins.append((c, idx))
    return plan


def release_plans(ctx: EngineContext, plans: Sequence[LookupPlan], *,
                  lock: bool = False) -> None:
    """Release every plan of ``plans`` (see :func:`release_plan`) and, with
    ``lock``, the load lock the caller holds: what a caller does with plans
    that will not be loaded, on every failure path."""
    for plan in plans:
        release_plan(ctx, plan)
    if lock:
        ctx.lock.release()


def release_plan(ctx: EngineContext, plan: LookupPlan) -> None:
    """Drop a plan's hold on the device tree (unpin, unlock). Idempotent."""
    if plan.released:
        return
    plan.released = True
    for c, idx in plan.pins:
        ctx.pool.unpin(c, idx)  # type: ignore[arg-type]
    plan.pins.clear()
    if ctx.tree.contains(plan.match.node):
        ctx.tree.unlock(plan.match.node)
