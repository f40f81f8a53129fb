"""The public async API: ``Engine`` (prefill = restore + forward + offload).

Threads: every method runs on the event loop; the tree and the pool's
allocator state are touched only there. Blocking store calls, fetches and the
forward run in worker threads. One batch is in flight at a time (the batch
lock, held from ``load`` until its forward or abort finished); offloads of
earlier batches go on in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import anyio
import numpy as np
import torch

from layerlift.engine.compute import ComputeAlloc, alloc_compute, free_compute
from layerlift.engine.config import EngineConfig
from layerlift.engine.handle import EngineError, LoadHandle
from layerlift.engine.model import HybridModel
from layerlift.engine.offload import Offloader, OffloadReport
from layerlift.engine.plan import LookupPlan
from layerlift.engine.restore import RestoreStage
from layerlift.engine.results import PrefillResult
from layerlift.engine.stores import StoreHandle, open_store
from layerlift.linker.components import make_linkers
from layerlift.linker.keys import KeySchema
from layerlift.linker.store_base import Store
from layerlift.linker.transaction import RestoreTransaction
from layerlift.overlap.base import Lane, LoadPolicy
from layerlift.overlap.lanes import CpuLane, CudaLane
from layerlift.overlap.link import parse_link
from layerlift.overlap.scheduler import LoadScheduler
from layerlift.pools import UnifiedKVPool
from layerlift.pools.hashing import page_hashes
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["DebugSwitches", "Engine", "EngineError"]

log = logging.getLogger("layerlift.engine")


@dataclass(slots=True)
class DebugSwitches:
    """Negative controls for tests only: each one breaks correctness on purpose."""

    skip_mamba_load: bool = False
    skip_layer_waits: bool = False


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

    Tensor parallelism: each rank runs its own engine (``rank``/``world_size``
    in the config; keys carry the rank). A restore must end at a boundary
    every rank can restore, so a TP scheduler drives the step-by-step API:
    ``plan = await lookup(tokens)``, all-gather ``plan.restorable``,
    ``plan.restrict_to(other_ranks_sets)``, then ``load``. ``prefill`` is the
    single-rank path.
    """

    def __init__(self, model: HybridModel, cfg: EngineConfig, *, store: Store | None = None,
                 debug: DebugSwitches | None = None) -> None:
        need = min_pool_bytes(model.spec)
        if cfg.pool_bytes < need:
            raise ValueError(
                f"pool_bytes={cfg.pool_bytes} cannot hold one request of this model: it needs "
                f"at least {need} bytes (two checkpoint intervals of FULL and SWA pages "
                "plus three Mamba state slots)"
            )
        if torch.device(model.device).type != torch.device(cfg.device).type:
            raise ValueError(
                f"the model lives on {model.device} but the engine is configured for "
                f"{cfg.device}: build HybridModel(spec, seed, device={cfg.device!r})"
            )
        self.model, self.cfg = model, cfg
        self.debug = debug or DebugSwitches()
        self._injected = store
        self._handle: StoreHandle | None = None
        self._batch_lock = asyncio.Lock()
        self._next_id = 0
        self._started = False

    # ---- lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the store (starting the embedded master), build the pools."""
        cfg, spec = self.cfg, self.model.spec
        if self._injected is None:
            self._handle = await anyio.to_thread.run_sync(open_store, cfg)
            self.store = self._handle.store
        else:
            self.store = self._injected
        # An emulated link applies to an injected store too (the benchmark shares
        # one store between engines).
        if self._handle is not None:
            self.link = self._handle.link
        else:
            self.link = parse_link(cfg.link) if cfg.link else None
        self.pool = UnifiedKVPool(spec, cfg.pool_bytes, device=cfg.device)
        if self.pool.buffer.device.type == "cpu":
            self.store.register(self.pool.buffer)
        self.tree = UnifiedRadixTree(spec, self.pool)
        schema = KeySchema(cfg.namespace, f"{spec.fingerprint}-s{self.model.seed}", cfg.rank)
        self.linkers = make_linkers(spec, self.pool, self.tree, schema)
        self.lane = self._make_lane()
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
        self._started = True

    def _make_lane(self) -> Lane:
        if self.cfg.device.startswith("cuda"):
            return CudaLane(self.cfg.device)
        return CpuLane(max_workers=2)

    async def close(self) -> None:
        """Wait for pending offloads, then close the store and the master."""
        if not self._started:
            return
        self._started = False
        try:
            await self.wait_offloads()
        finally:
            self.lane.close()
            if self._handle is not None:
                await anyio.to_thread.run_sync(self._handle.close)
            elif self.pool.buffer.device.type == "cpu":
                self.store.unregister(self.pool.buffer.data_ptr())

    # ---- one-call API ----------------------------------------------------------
    async def prefill(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[PrefillResult]:
        """Restore what the store holds, compute the rest, offload in the
        background; one result per prompt, in order."""
        if not prompts:
            return []
        await self._batch_lock.acquire()
        plans: list[LookupPlan] = []
        try:
            plans = await self._lookup_many(prompts)
            # COMMIT before issuing: the fetches then load exactly what the tree
            # adopted (the step-by-step API issues first, as its contract says).
            handle = await self._load_locked(plans, issue=False)
            handle.commit()
            await handle.issue()
        except BaseException:
            for p in plans:
                self._release_plan(p)
            self._batch_lock.release()
            raise
        return await handle.forward()

    async def _lookup_many(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[LookupPlan]:
        t0 = time.perf_counter()
        plans = [self._match(p) for p in prompts]
        await self.restore.lookup(plans)
        for p in plans:
            p.lookup_time = time.perf_counter() - t0
        return plans

    # ---- step by step ----------------------------------------------------------
    async def lookup(self, tokens: Sequence[int] | np.ndarray) -> LookupPlan:
        """LOOKUP one prompt: device hit, restorable boundaries, chosen boundary.
        Locks the device hit until the plan is loaded and finished (or
        ``release_plan``). Waits while a batch is in flight, so a plan never
        sees data that is still loading."""
        async with self._batch_lock:
            return (await self._lookup_many([tokens]))[0]

    async def load(self, plans: Sequence[LookupPlan]) -> LoadHandle:
        """LOAD + PREPARE every plan and issue the per-layer fetches of the
        whole batch (one store call per layer); returns at once. Waits if
        another batch is in flight."""
        await self._batch_lock.acquire()
        try:
            return await self._load_locked(list(plans))
        except BaseException:
            for p in plans:
                self._release_plan(p)
            self._batch_lock.release()
            raise

    async def _load_locked(self, plans: list[LookupPlan], issue: bool = True) -> LoadHandle:
        t0 = time.perf_counter() - max((p.lookup_time for p in plans), default=0.0)
        txns: dict[int, RestoreTransaction] = {}
        computes: dict[int, ComputeAlloc] = {}
        for plan in plans:
            got = self.restore.prepare(plan)
            comp = alloc_compute(self.pool, self.tree, plan)
            if comp is None and self.offloader.pending:
                # Offloads in flight pin pages and lock nodes; they end on their
                # own, so under pressure wait for them before giving anything up.
                await self.offloader.wait()
                comp = alloc_compute(self.pool, self.tree, plan)
            if comp is None and got is not None:
                self.restore.abort_plan(plan, got, "not enough device memory to restore")
                got = None
                comp = alloc_compute(self.pool, self.tree, plan)
            if comp is None:
                self._free_batch(plans, txns, computes)
                raise EngineError(
                    f"the device pool ({self.cfg.pool_bytes} bytes) cannot hold request "
                    f"{plan.request_id} ({len(plan.tokens)} tokens) even after evicting the cache"
                )
            computes[plan.request_id] = comp
            if got is not None:
                txns[plan.request_id] = got
        batch = self.restore.make_batch(plans, txns)
        handle = LoadHandle(self, plans, batch, computes, t0, self._batch_lock.release)
        if issue:
            await handle.issue()
        return handle

    def _free_batch(self, plans: list[LookupPlan], txns: dict[int, RestoreTransaction],
                    computes: dict[int, ComputeAlloc]) -> None:
        """A batch that does not fit: free what its earlier plans already took."""
        for comp in computes.values():
            free_compute(self.pool, comp)
        by_id = {p.request_id: p for p in plans}
        for rid, txn in txns.items():
            self.restore.abort_plan(by_id[rid], txn, "the batch did not fit")

    def _alloc_compute(self, plan: LookupPlan) -> ComputeAlloc:
        comp = alloc_compute(self.pool, self.tree, plan)
        if comp is None:
            raise EngineError(f"the device pool cannot hold request {plan.request_id}")
        return comp

    # ---- plans --------------------------------------------------------------------
    def _match(self, tokens: Sequence[int] | np.ndarray) -> LookupPlan:
        spec = self.model.spec
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1 or len(arr) == 0:
            raise ValueError("a prompt must be a non-empty 1-D sequence of token ids")
        if arr.min() < 0 or arr.max() >= spec.vocab_size:
            raise ValueError(f"token ids must lie in [0, {spec.vocab_size}) for this model")
        match = self.tree.match_prefix(arr)
        self.tree.lock(match.node)
        plan = LookupPlan(self._next_id, arr, tuple(page_hashes(arr, spec.page_size)), match, spec)
        self._next_id += 1
        d, w = match.boundary_pages, spec.window_pages
        pins = [(Component.FULL, match.full_indices), (Component.SWA, match.swa_indices[max(0, d - w):]),
                (Component.MAMBA, torch.tensor([] if match.mamba_slot is None else [match.mamba_slot],
                                               dtype=torch.int64))]
        for c, idx in pins:
            if len(idx):
                self.pool.pin(c, idx)
                plan.pins.append((c, idx))
        return plan

    def _release_plan(self, plan: LookupPlan) -> None:
        if plan.released:
            return
        plan.released = True
        for c, idx in plan.pins:
            self.pool.unpin(c, idx)  # type: ignore[arg-type]
        plan.pins.clear()
        self.tree.unlock(plan.match.node)

    def release_plan(self, plan: LookupPlan) -> None:
        """Drop a plan that will not be loaded (unlocks its device hit)."""
        self._release_plan(plan)

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
