"""The public async API: ``Engine`` (prefill = restore + forward + offload).

Threads: every method runs on the event loop; the tree and the pool's
allocator state are touched only there. Blocking store calls, fetches and the
forward run in worker threads. One batch loads at a time and one computes at
a time (``EngineContext``'s two locks): concurrent ``prefill`` calls
pipeline, the next batch looking up and fetching while the previous one
computes (cross-batch prefetch). Offloads go on in the background. A batch's
life cycle and all of its cleanup live in ``engine/batch_lifecycle.py``; its
passes in ``engine/batch.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Literal

import numpy as np
import torch

from layerlift.engine.batch import Batch, BatchState, too_big
from layerlift.engine.compute import compute_bytes
from layerlift.engine.config import EngineConfig
from layerlift.engine.context import (
    EngineContext,
    EngineError,
    match_plan,
    release_plan,
    release_plans,
)
from layerlift.engine.costmodel import CostModel, CostPriors
from layerlift.engine.estimate import PrefillEstimate, estimate_prefill
from layerlift.engine.handle import LoadHandle
from layerlift.engine.model.base import Model
from layerlift.engine.offload import Offloader, OffloadReport
from layerlift.engine.plan import LookupPlan, take_plans
from layerlift.engine.restore import RestoreStage
from layerlift.engine.results import PrefillResult
from layerlift.engine.stores import StoreHandle, open_store_owned
from layerlift.engine.threads import run_owned, wait_through
from layerlift.linker.components import make_linkers
from layerlift.linker.keys import KeySchema
from layerlift.linker.store_base import Store
from layerlift.overlap.base import Lane, LoadPolicy
from layerlift.overlap.device import CudaDevice, Device
from layerlift.overlap.lanes import CpuLane, CudaLane
from layerlift.overlap.link import parse_link
from layerlift.overlap.scheduler import LoadScheduler
from layerlift.pools import UnifiedKVPool
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["Engine", "EngineError", "min_pool_bytes"]

log = logging.getLogger("layerlift.engine")
Phase = Literal["closed", "starting", "started", "closing"]


def min_pool_bytes(spec: ModelSpec) -> int:
    """Bytes one request of one checkpoint interval needs (FULL + SWA pages
    of two intervals, three state slots); a smaller pool is a config error."""
    pages = 2 * spec.track_pages + 1
    return (pages * (spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA))
            + 3 * spec.page_bytes(Component.MAMBA))


class Engine:
    """Restores a hybrid model's prefix cache from a store, layer by layer,
    while its prefill forward runs. Use as ``async with Engine(model, cfg)``.

    Raises ``ValueError`` for a config that cannot work (pool too small for
    one request, a model on another device). ``store`` injects an already
    open store (tests wrap one with faults); the engine then does not close it.
    ``device`` injects the accelerator seam (``overlap.device.Device``) the
    pool lives on instead of the one ``cfg.device`` names (tests run the CUDA
    path on ``layerlift.testing.simdevice.SimDevice``); its tensors must be where
    the model's are.

    Tensor parallelism: each rank runs its own engine (``rank``/``world_size``
    in the config; keys carry the rank). A restore must end at a boundary
    every rank can restore, so a TP scheduler drives the step-by-step API:
    ``plan = await lookup(tokens)``, all-gather ``plan.restorable``,
    ``plan.restrict_to(other_ranks_sets)``, then ``load``. ``prefill`` is the
    single-rank path.
    """

    def __init__(self, model: Model, cfg: EngineConfig, *, store: Store | None = None,
                 device: Device | None = None) -> None:
        need = min_pool_bytes(model.spec)
        if cfg.pool_bytes < need:
            raise ValueError(
                f"pool_bytes={cfg.pool_bytes} cannot hold one request of this model: it needs "
                f"at least {need} bytes (two checkpoint intervals of FULL and SWA pages "
                "plus three Mamba state slots)"
            )
        where = device.torch_device if device is not None else torch.device(cfg.device)
        if torch.device(model.device).type != where.type:
            raise ValueError(
                f"the model lives on {model.device} but the engine is configured for "
                f"{cfg.device}: build HybridModel(spec, seed, device={cfg.device!r})"
            )
        self.model, self.cfg = model, cfg
        self._device = device
        self._injected = store
        self._handle: StoreHandle | None = None
        # closed -> starting -> started -> closing -> closed (start again: a new life)
        self._phase: Phase = "closed"
        self._start_task: asyncio.Task[None] | None = None
        # What start() opened, as (what, close, blocking), closed in reverse.
        self._closers: list[tuple[str, Callable[[], None], bool]] = []
        self._close_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the store (starting the embedded master), build the pools.

        A failure or a cancellation part-way closes, in reverse order, what
        was opened so far (registration, lane, store client, master) before
        it propagates; nothing is left running. A second ``start()`` while
        one runs joins it (both return once it opened, or raise what it
        raised); ``close()`` during ``start()`` stops the start, closes what
        it had opened, and the start raises ``EngineError``.
        ``RuntimeError`` if the engine is started already or still closing."""
        if self._phase == "starting" and self._start_task is not None:
            await self._join_start(self._start_task)
            return
        if self._phase != "closed":
            raise RuntimeError("this engine is started already (or still closing)")
        self._phase, self._close_task = "starting", None
        task = asyncio.get_running_loop().create_task(self._start())
        self._start_task = task
        await self._join_start(task)

    async def _start(self) -> None:
        try:
            await self._open()
        except BaseException as exc:
            try:
                await wait_through(asyncio.ensure_future(self._shutdown()))
            except Exception as problem:
                exc.add_note(f"and while closing what start() had opened: {problem!r}")
            if self._phase == "starting":
                self._phase = "closed"
            raise
        if self._phase == "starting":  # else close() began meanwhile: it closes this
            self._phase = "started"

    async def _join_start(self, task: asyncio.Task[None]) -> None:
        """Wait for the start ``task``. A cancelled caller cancels it (what
        it opened is closed) and is cancelled once it ended; a start that
        ``close()`` stopped raises ``EngineError``."""
        def stop() -> None:
            task.cancel()

        try:
            await wait_through(task, on_cancel=stop)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            raise EngineError("the engine was closed while it started") from None
        if self._phase != "started":
            raise EngineError("the engine was closed while it started")

    async def _open(self) -> None:
        """What ``start`` does; each resource opened pushes its closer first."""
        cfg, spec = self.cfg, self.model.spec
        if self._injected is None:
            self._handle = await open_store_owned(cfg)
            self._closers.append(("closing the store and its master", self._handle.close, True))
            self.store = self._handle.store
        else:
            self.store = self._injected
        # An emulated link applies to an injected store too (the benchmark shares
        # one store between engines).
        if self._handle is not None:
            self.link = self._handle.link
        else:
            self.link = parse_link(cfg.link) if cfg.link else None
        if self._device is None and cfg.device.startswith("cuda"):
            self._device = CudaDevice(cfg.device)
        where = self._device.torch_device if self._device is not None else cfg.device
        self.pool = UnifiedKVPool(spec, cfg.pool_bytes, device=where)
        if self._device is not None:
            self._device.attach_pool(self.pool)
        else:
            self.store.register(self.pool.buffer)
            ptr = self.pool.buffer.data_ptr()
            self._closers.append(("unregistering the pool",
                                  lambda: self.store.unregister(ptr), False))
        self.tree = UnifiedRadixTree(spec, self.pool, branch_checkpoints=cfg.branch_checkpoints)
        schema = KeySchema(cfg.namespace, f"{spec.fingerprint}-{self.model.identity}", cfg.rank)
        self.linkers = make_linkers(spec, self.pool, self.tree, schema)
        self.lane = self._make_lane()
        self._closers.append(("closing the lane", self.lane.close, False))
        policy = LoadPolicy(cfg.policy)
        scheduler = LoadScheduler(self.lane, policy, max_in_flight=cfg.max_in_flight,
                                  group_size=cfg.group_size, stream_size=cfg.stream_size)
        self.restore = RestoreStage(self.tree, self.pool, self.linkers, self.store,
                                    scheduler,
                                    wait_timeout_s=cfg.layer_wait_timeout_s)
        self.restore.link = self.link
        if isinstance(self.lane, CudaLane):
            self.restore.staging_alloc = self.lane.alloc_staging
        self.offloader = Offloader(self.tree, self.pool, self.linkers, self.store)
        cost = CostModel(spec.num_layers) if cfg.restore == "auto" else None
        self._ctx = EngineContext(self.model, cfg, self.pool, self.tree, self.restore,
                                  self.offloader, cost)

    def _make_lane(self) -> Lane:
        if self._device is not None:
            return CudaLane(self._device)
        return CpuLane(max_workers=2)

    async def close(self) -> None:
        """Refuse everything new (every call waiting for a lock or for room
        raises ``EngineError``), abort the batches in flight and wait until
        their threads returned, wait for pending offloads (their puts), then
        close the lane, unregister the pool, close the store and stop the
        master: nothing a worker thread or a put uses is closed under it.

        Bounded whatever the store does: pending offloads are waited for at
        most ``store_timeout_s``; a put still running then (a stalled store)
        is left to end on its own, and the registration, the store client
        and the master are closed by its thread once it returned (logged).

        Owned end to end: a cancelled ``close()`` (``task.cancel()``, a
        ``wait_for`` timeout) still waits for all of that, and the
        cancellation is raised once it finished. Idempotent; a no-op on an
        engine that never started; during ``start()`` it stops the start
        and closes what the start had opened."""
        if self._phase == "starting":
            self._phase = "closing"
            self._close_task = asyncio.get_running_loop().create_task(self._close_start())
        elif self._phase == "started":
            self._phase = "closing"
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        elif self._close_task is None:
            return
        await wait_through(self._close_task)

    async def _close_start(self) -> None:
        """``close()`` during ``start()``: stop the start (its failure path
        closes what it opened); one that had opened everything first is
        closed like a started engine."""
        task = self._start_task
        assert task is not None
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is None:
            await self._close()
        self._phase = "closed"

    async def _close(self) -> None:
        problems: list[BaseException] = []
        ctx = self._ctx
        try:
            ctx.begin_close()  # nothing new starts; every waiter raises
            while ctx.live:  # a batch that started exiting meanwhile is waited for too
                for batch in list(ctx.live):
                    batch.abort(EngineError("the engine is closing"))
                for batch in list(ctx.live):
                    try:
                        await batch.aclose()
                    except Exception as exc:  # the batch's own failure: keep closing
                        problems.append(exc)
            self.offloader.closing = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.store_timeout_s):
                    await self.offloader.wait()
        finally:
            try:
                await self._shutdown_after_puts()
            finally:
                self._phase = "closed"
        if problems:
            raise EngineError(f"a batch failed while the engine closed: {problems[0]!r}") \
                from problems[0]

    async def _shutdown_after_puts(self) -> None:
        """Run the closers now, or hand them to the last put thread still
        running (a stalled store): it runs them once its put returned."""
        closers, self._closers = self._closers, []
        if self.offloader.hand_over(lambda: _run_closers(closers)):
            log.warning("engine closed with offload puts still running (the store does not "
                        "answer within store_timeout_s=%s): the pool's registration, the "
                        "store client and the master are closed when they return",
                        self.cfg.store_timeout_s)
            return
        self._closers = closers
        await self._shutdown()

    async def _shutdown(self) -> None:
        """Run the closers in reverse order of opening, each whatever the
        ones before raised (blocking ones in owned threads); raise the first
        error after all ran."""
        first: BaseException | None = None
        while self._closers:
            what, fn, in_thread = self._closers.pop()
            try:
                if in_thread:
                    await run_owned(fn)
                else:
                    fn()
            except Exception as exc:
                exc.add_note(f"while {what}")
                log.error("engine shutdown: %r", exc, exc_info=exc)
                first = first or exc
        if first is not None:
            raise first

    # ---- one-call API ----------------------------------------------------------
    async def prefill(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[PrefillResult]:
        """Restore what the store holds, compute the rest, offload in the
        background; one result per prompt, in order.

        Prompts that do not fit in the pool together are served in parts that
        fit, in order. Raises ``ValueError`` for a malformed prompt and
        ``EngineError`` for a prompt that cannot fit even alone (naming it and
        the bytes it needs); after any exception or cancellation every lock,
        pin and slot of the call is released."""
        if not prompts:
            return []
        started = time.perf_counter()
        ctx = self._context()
        results: dict[int, PrefillResult] = {}
        todo, take = list(range(len(prompts))), len(prompts)  # prompt indices, in order
        compute_only: set[int] = set()  # deferred once after a failed restore
        while todo:
            # Prompts left over from a part are looked up again: the parts
            # before them may have put their prefixes on the device.
            part = todo[:take]
            plans = await self._lookup_locked([prompts[i] for i in part], started,
                                              self.cfg.layer_wait_timeout_s)  # holds lock
            for i, plan in zip(part, plans, strict=True):
                if i in compute_only and plan.restores:
                    plan.drop_restore("its restore failed in an earlier part")
            try:
                self._check_fits(plans)
            except BaseException:
                release_plans(ctx, plans, lock=True)
                raise
            try:
                batch, rest = await Batch.prepare(ctx, plans, started)  # exits on failure
            except BaseException as exc:
                release_plans(ctx, plans)
                if not isinstance(exc, EngineError) or take == 1:
                    raise
                take = 1  # the other prompts' device hits held room: try it alone
                continue
            release_plans(ctx, rest)
            index = dict(zip((id(p) for p in plans), part, strict=True))
            todo = todo[len(plans) - len(rest):]
            batch.may_defer = True
            await batch.issue(device_timeout=self.cfg.layer_wait_timeout_s)
            got = await batch.run()  # COMMIT, then the forward
            for plan, result in zip(batch.plans, got, strict=True):
                results[index[id(plan)]] = result
            again = [index[id(p)] for p in batch.deferred]  # served next, in order
            compute_only.update(again)
            todo, take = again + todo, len(again) + len(todo)
        return [results[i] for i in range(len(prompts))]

    def _check_fits(self, plans: Sequence[LookupPlan]) -> None:
        """``EngineError`` for a prompt whose compute alone exceeds the pool
        (checked before any part runs)."""
        for plan in plans:
            if compute_bytes(self.pool, plan, boundary=plan.device_pages) > \
                    self.pool.buffer.numel():
                raise too_big(self.pool, plan)

    async def _lookup_locked(self, prompts: Sequence[Sequence[int] | np.ndarray],
                             started: float, wait_s: float | None = None) -> list[LookupPlan]:
        """Acquire the load lock and LOOKUP every prompt; on return the
        caller holds the lock and the plans (on an exception neither).
        ``wait_s``: ``EngineError`` once a batch that waits for its caller
        (a step-by-step handle) has held the lock that long (see
        ``EngineContext.acquire``), or at once when the engine closes."""
        ctx = self._context()
        await ctx.acquire(ctx.lock, wait_s, "waiting for the load lock to look up")
        plans: list[LookupPlan] = []
        try:
            for tokens in prompts:
                plans.append(match_plan(ctx, tokens))
            await self.restore.lookup(plans)
            ctx.check_open()  # closed meanwhile: no batch may start after close() began
            if ctx.cost is not None:
                overlap = self.cfg.policy != "barrier"
                ahead = ctx.cost.compute_seconds(_tokens_ahead(ctx))
                for plan in plans:
                    if plan.restores:
                        decision = ctx.cost.decide_plan(plan, overlap=overlap, ahead_s=ahead)
                        plan.decision = decision.reason
                        if not decision.restore:
                            plan.drop_restore(decision.reason)
        except BaseException:
            release_plans(ctx, plans, lock=True)
            raise
        for plan in plans:
            plan.lookup_time = time.perf_counter() - started
        return plans

    # ---- step by step ----------------------------------------------------------
    async def lookup(self, tokens: Sequence[int] | np.ndarray) -> LookupPlan:
        """LOOKUP one prompt: device hit, restorable boundaries, chosen boundary.
        Locks the device hit until the plan is loaded and finished (or
        ``release_plan``). Waits while a batch is in flight, so a plan never
        sees data that is still loading. Raises ``EngineError`` after
        ``layer_wait_timeout_s`` if another batch's failed load is still
        unpublishing (e.g. a handle that is never forwarded or aborted)."""
        (plan,) = await self._lookup_locked([tokens], time.perf_counter(),
                                            self.cfg.layer_wait_timeout_s)
        self._context().lock.release()
        return plan

    async def load(self, plans: Sequence[LookupPlan]) -> LoadHandle:
        """LOAD + PREPARE every plan and issue the per-layer fetches of the
        whole batch (one store call per layer); returns at once. Waits if
        another batch is in flight. Raises ``EngineError`` when the plans do
        not fit in the pool together (load fewer at a time) or one cannot
        fit alone; the plans are released then. Raises ``ValueError``, and
        releases nothing, for no plans, a plan listed twice, or a plan that
        is not live: made by another engine, released (``release_plan``, or
        its handle finished) or loaded before. The plans are checked and
        taken at once, before the wait: from then on they are this load's
        (``release_plan`` and another ``load`` refuse them)."""
        ctx = self._context()
        take_plans(plans, ctx)  # checked and taken with no await between
        started = time.perf_counter() - max((p.lookup_time for p in plans), default=0.0)
        try:
            await ctx.acquire(ctx.lock, self.cfg.layer_wait_timeout_s,
                              "load() waited for the load lock")
            batch, rest = await Batch.prepare(ctx, plans, started)  # releases the lock on failure
        except BaseException:
            release_plans(ctx, plans)
            raise
        if rest:
            err = EngineError(
                f"plans {[p.request_id for p in rest]} do not fit in the device pool together "
                f"with plans {[p.request_id for p in batch.plans]}: load them in a later batch")
            release_plans(ctx, rest)  # before the await: a cancelled close must not leak them
            await batch.close(err)
            raise err
        await batch.issue(device_timeout=self.cfg.layer_wait_timeout_s)
        return LoadHandle(batch)

    async def estimate_prefill(self, tokens: Sequence[int] | np.ndarray, *,
                               priors: CostPriors | None = None) -> PrefillEstimate:
        """Routing hints for ``tokens``: device-hit, store-restorable and
        computed tokens and the estimated TTFT parts
        (:class:`~layerlift.engine.estimate.PrefillEstimate`), without
        locking, pinning, loading or touching the LRU order. Prices with the
        engine's learned cost model (``restore="auto"``), else a fresh one at
        ``priors`` (default :class:`CostPriors`). Asks the store which keys
        exist (one call); a store failure gives ``store_available=False``.
        Raises ``ValueError`` for a malformed prompt."""
        ctx = self._context()
        cost = ctx.cost or CostModel(self.model.spec.num_layers, priors)
        return await estimate_prefill(self.tree, self.linkers, self.store, tokens, cost,
                                      overlap=self.cfg.policy != "barrier",
                                      auto=ctx.cost is not None)

    def release_plan(self, plan: LookupPlan) -> None:
        """Drop a plan that will not be loaded (unlocks its device hit).
        Idempotent. ``ValueError`` for a plan another engine made (its pins
        name that engine's pages) or one a batch took (its batch releases it)."""
        ctx = self._context()
        if plan.owner is not ctx:
            raise ValueError(f"plan {plan.request_id} was made by another engine: release it "
                             "with the engine whose lookup() made it")
        if plan.taken and not plan.released:
            raise ValueError(f"plan {plan.request_id} is loaded (or being loaded): its load "
                             "releases it (a failed load, or its handle: forward, or abort "
                             "and aclose)")
        release_plan(ctx, plan)

    def _context(self) -> EngineContext:
        if self._phase != "started":
            if self._close_task is not None:
                raise EngineError("the engine is closing or closed: start a new one")
            raise RuntimeError("the engine is not started: use `async with Engine(...)`")
        return self._ctx

    # ---- cache control ------------------------------------------------------------
    def drop_device_cache(self) -> None:
        """Empty the device tree (everything not locked by work in flight), so
        the next prefill must restore from the store."""
        self.tree.drop_all()
        self.pool.flush_deferred()

    async def wait_offloads(self) -> OffloadReport:
        """Wait until every pending offload has landed or failed; the report
        says how many objects were stored and how many puts failed."""
        return await self.offloader.wait()


def _tokens_ahead(ctx: EngineContext) -> int:
    """Tokens the device still computes for batches already past their load
    (cross-batch prefetch): a load issued now runs while they compute, so the
    cost model prices it by what it adds after them. Their elapsed compute
    is not subtracted (an upper bound)."""
    live = (BatchState.LOADING, BatchState.COMMITTED, BatchState.RUNNING)
    return sum(len(p.tokens) - p.boundary * p.spec.page_size
               for b in ctx.live if b.state in live for p in b.plans)


def _run_closers(closers: list[tuple[str, Callable[[], None], bool]]) -> None:
    """The closers of an engine whose close left a put running, in reverse
    order, in the put's thread once it returned; errors are logged."""
    while closers:
        what, fn, _ = closers.pop()
        try:
            fn()
        except Exception as exc:
            log.error("engine shutdown after the last put, while %s: %r", what, exc,
                      exc_info=exc)
