"""One batch in flight: restore (PREPARE done, fetches issued), COMMIT, the
forward with per-layer waits, the insert of computed pages, release.

A :class:`LoadHandle` holds the engine's batch lock from ``Engine.load`` until
``forward()`` returned or ``abort()`` finished: one batch at a time per engine
(the forward owns the device), while offloads of earlier batches go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import torch

from layerlift.engine.compute import ComputeAlloc, free_compute
from layerlift.engine.model_api import ForwardOutput, ForwardRequest
from layerlift.engine.plan import LookupPlan
from layerlift.engine.restore import RestoreBatch
from layerlift.engine.results import PrefillResult, Timings
from layerlift.overlap.base import LayerLoadError, ReadinessView
from layerlift.overlap.readiness import LayerReadiness
from layerlift.pools.spec import Component

if TYPE_CHECKING:
    from layerlift.engine.api import Engine

__all__ = ["EngineError", "LoadHandle"]


class EngineError(RuntimeError):
    """The engine cannot serve a request (e.g. the pool cannot hold it)."""


@dataclass(eq=False)
class _Run:
    """Per-request forward inputs, rebuilt for each forward attempt."""

    plan: LookupPlan
    compute: ComputeAlloc
    full: torch.Tensor
    swa: torch.Tensor
    cow: int | None


class LoadHandle:
    """PREPAREd restores of one batch with their fetches issued."""

    def __init__(self, engine: Engine, plans: list[LookupPlan], batch: RestoreBatch,
                 computes: dict[int, ComputeAlloc], started: float,
                 release_lock: Callable[[], None]) -> None:
        self.engine, self.plans, self.batch = engine, plans, batch
        self.computes = computes
        self.started = started
        self._release_lock = release_lock
        self._pins: dict[int, list[tuple[Component, torch.Tensor]]] = {}
        self._closed = False
        self.load_issued = 0.0
        self._recomputed: set[int] = set()
        self._abort_future: asyncio.Task[None] | None = None

    @property
    def readiness(self) -> LayerReadiness:
        return self.batch.readiness

    async def issue(self) -> None:
        """Open the store session and hand the per-layer fetches to the
        scheduler (returns at once). Idempotent."""
        if self.batch.task is None and not self.batch.finished:
            await self.engine.restore.start(self.batch)
            self.load_issued = time.perf_counter() - self.started

    # ---- COMMIT ----------------------------------------------------------------
    def commit(self) -> LayerReadiness:
        """Publish the restores, trim the loads, set COW sources; returns the
        per-layer readiness (nothing waits here). Raises RuntimeError if the
        handle was aborted or committed already."""
        if self._closed:
            raise RuntimeError("this load was aborted or has finished")
        readiness = self.engine.restore.commit(self.batch)
        if self.engine.debug.skip_mamba_load:  # negative control only
            self.batch.load.items[Component.MAMBA].drop_indices(
                set(self.batch.load.items[Component.MAMBA].indices))
            self.batch.load.refresh(self.batch.jobs)
        for rid, result in self.batch.inserted.items():
            plan = next(p for p in self.plans if p.request_id == rid)
            d, b, w = plan.device_pages, plan.boundary, plan.spec.window_pages
            self._pin(rid, Component.FULL, result.canonical[Component.FULL][d:b])
            self._pin(rid, Component.SWA, result.canonical[Component.SWA][max(d, b - w):b])
            self._pin(rid, Component.MAMBA, torch.tensor([self.batch.cow_slot(rid)]))
        return readiness

    def _pin(self, rid: int, c: Component, idx: torch.Tensor) -> None:
        if len(idx):
            self.engine.pool.pin(c, idx)
            self._pins.setdefault(rid, []).append((c, idx.clone()))

    def _unpin(self, rids: Collection[object]) -> None:
        for rid in list(self._pins):
            if rid in rids:
                for c, idx in self._pins.pop(rid):
                    self.engine.pool.unpin(c, idx)

    async def _finish_load(self, unpublish_all: bool = False) -> frozenset[object]:
        """End the batch's load; unpublish (and unpin) the restores that failed."""
        failed = await self.engine.restore.finish(self.batch, abort=unpublish_all)
        if failed:
            self._unpin(failed)
            self.engine.restore.unpublish(self.batch, failed)
        return failed

    # ---- forward ----------------------------------------------------------------
    async def forward(self) -> list[PrefillResult]:
        """Run the forward (committing first if needed), insert the computed
        pages, start their offload, release everything; one result per plan.

        A restore that fails at layer k is recomputed (exact results). Raises
        ``EngineError`` if a recompute does not fit in the pool, RuntimeError
        if the handle was aborted. On any exception, and on cancellation (which
        takes effect once the forward thread finished its pass: a running
        forward is never abandoned), the batch is ABORTed before the exception
        propagates: fetches stopped, restores unpublished, every slot freed.
        """
        if self._closed:
            raise RuntimeError("this load was aborted or has finished")
        if not self.batch.committed:
            self.commit()
        try:
            await self.issue()
            out, timings = await self._forward_with_retry()
            ttft = time.perf_counter() - self.started
            await self._finish_load()
        except BaseException:
            self.abort()
            assert self._abort_future is not None
            await asyncio.shield(self._abort_future)
            raise
        results = self._results(out, timings, ttft)
        self._insert_computed()
        self._close()
        return results

    async def _forward_with_retry(self) -> tuple[ForwardOutput, Timings]:
        for _attempt in range(3):
            runs = self._runs()
            deps = self._deps()
            try:
                return await anyio.to_thread.run_sync(self._forward_thread, runs, deps)
            except LayerLoadError as err:
                failed = await self._finish_load()
                failed = failed or err.requests or self.batch.readiness.requests
                self._recompute(failed, f"restore failed at layer {err.layer}: {err.cause!r}")
        raise EngineError("the forward kept failing while restores were recomputed")

    def _recompute(self, failed: frozenset[object], reason: str) -> None:
        for plan in self.plans:
            if plan.request_id not in failed or not plan.restores:
                continue
            old = self.computes.pop(plan.request_id)
            free_compute(self.engine.pool, old)
            plan.drop_restore(reason)
            self._recomputed.add(plan.request_id)
            self.computes[plan.request_id] = self.engine._alloc_compute(plan)

    def _runs(self) -> list[_Run]:
        runs = []
        for plan in self.plans:
            rid, b = plan.request_id, plan.boundary
            result = self.batch.inserted.get(rid)
            if result is not None and plan.restores:
                full, swa = result.canonical[Component.FULL][:b], result.canonical[Component.SWA][:b]
                cow: int | None = self.batch.cow_slot(rid)
            else:
                full, swa, cow = plan.match.full_indices, plan.match.swa_indices, plan.match.mamba_slot
            swa = swa.clone()
            swa[: max(0, b - plan.spec.window_pages)] = 0  # never read; keep in range
            runs.append(_Run(plan, self.computes[rid], full, swa, cow))
        return runs

    def _deps(self) -> list[ReadinessView]:
        if self.engine.debug.skip_layer_waits:  # negative control only
            return []
        deps: list[ReadinessView] = []
        if self.batch.task is not None and not self.batch.finished:
            deps.append(self.batch.readiness)
        # Nodes another batch published but had not finished loading. With the
        # batch lock held from lookup to the end of a forward this stays empty;
        # it is what keeps a plan correct if that ever changes.
        for plan in self.plans:
            for pending in plan.match.pending:
                if isinstance(pending, LayerReadiness) and all(pending is not x for x in deps):
                    deps.append(pending)
        return deps

    def _forward_thread(self, runs: Sequence[_Run],
                        deps: Sequence[ReadinessView]) -> tuple[ForwardOutput, Timings]:
        """Worker thread: the model, with a wait before every layer."""
        spec = self.engine.model.spec
        ps = spec.page_size
        reqs = [
            ForwardRequest(
                tokens=torch.from_numpy(r.plan.tokens[r.plan.boundary * ps:]),
                prefix_len=r.plan.boundary * ps,
                full_pages=torch.cat([r.full, r.compute.full]),
                swa_pages=torch.cat([r.swa, r.compute.swa]),
                mamba_slot=r.compute.work_slot,
                mamba_cow_src=r.cow,
                capture={p * ps: s for p, s in r.compute.capture.items()},
            )
            for r in runs
        ]
        timings = Timings()
        mark = [time.perf_counter()]

        def before(layer: int) -> None:
            t = time.perf_counter()
            for dep in deps:
                dep.wait(layer)
            now = time.perf_counter()
            timings.layer_wait.append(now - t)
            if layer == 0:
                timings.forward_start = now - self.started
            mark[0] = now

        def after(layer: int) -> None:
            timings.layer_compute.append(time.perf_counter() - mark[0])

        out = self.engine.model.forward_batch(reqs, self.engine.pool, before, after)
        return out, timings

    # ---- after the forward ------------------------------------------------------
    def _results(self, out: ForwardOutput, timings: Timings, ttft: float) -> list[PrefillResult]:
        timings.ttft = ttft
        timings.load_issued = self.load_issued
        task = self.batch.task
        if task is not None:
            landed = {t.layer: t.landed - self.started for t in task.timings if t.landed}
            timings.layer_landed = [landed.get(i, 0.0) for i in range(len(timings.layer_wait))]
        ps = self.engine.model.spec.page_size
        results = []
        for i, plan in enumerate(self.plans):
            t = dataclasses.replace(timings, lookup=plan.lookup_time)
            results.append(PrefillResult(
                next_token_logprobs=out.next_token_logprobs[i].float().cpu(),
                device_hit_tokens=plan.device_pages * ps,
                restored_tokens=plan.restore_tokens,
                computed_tokens=len(plan.tokens) - plan.boundary * ps,
                timings=t,
                restorable_boundaries=tuple(sorted(plan.restorable)),
                recomputed_after_failure=plan.request_id in self._recomputed,
                fallback_reason=plan.fallback_reason,
            ))
        return results

    def _insert_computed(self) -> None:
        """Publish computed pages and checkpoints; free what the tree did not take."""
        engine, pool = self.engine, self.engine.pool
        ps = engine.model.spec.page_size
        for run in self._runs():
            plan, comp = run.plan, run.compute
            for c, idx in comp.demand().items():
                pool.unpin(c, idx)
            self.computes.pop(plan.request_id)
            b, whole = plan.boundary, len(plan.tokens) // ps
            full = torch.cat([run.full, comp.full])
            swa = torch.cat([run.swa, comp.swa])
            spare = {Component.FULL: comp.full[whole - b:], Component.SWA: comp.swa[whole - b:],
                     Component.MAMBA: torch.tensor([comp.work_slot])}
            if whole > b:
                res = engine.tree.insert(
                    plan.tokens[: whole * ps], full[:whole], swa[:whole],
                    torch.ones(whole, dtype=torch.bool), comp.capture, start_page=b,
                )
                for c, dup in res.duplicates.items():
                    spare[c] = torch.cat([spare[c], dup])
                if engine.cfg.offload:
                    engine.offloader.submit(res.node)
            else:
                spare[Component.MAMBA] = torch.cat(
                    [spare[Component.MAMBA], torch.tensor(list(comp.capture.values()),
                                                          dtype=torch.int64)])
            for c, idx in spare.items():
                if len(idx):
                    pool.free(c, idx)

    # ---- abort / release -------------------------------------------------------
    def abort(self) -> None:
        """ABORT: stop the loads and release everything; the tree ends as it
        was before this batch's COMMIT. Returns at once; ``await aclose()``
        waits until in-flight fetches stopped and the slots are free."""
        if self._closed or self._abort_future is not None:
            return
        if self.batch.task is not None:
            self.batch.task.cancel("aborted")
        elif self.batch.committed:
            self.batch.readiness.cancel("aborted")
        self._abort_future = asyncio.get_running_loop().create_task(self._abort_async())

    async def _abort_async(self) -> None:
        try:
            if self.batch.committed:
                await self._finish_load(unpublish_all=True)
            else:
                if self.batch.task is not None:
                    await self.batch.task.wait_quiescent()
                await anyio.to_thread.run_sync(self.batch.session.close)
                self.engine.restore.abort_prepared(self.batch, "aborted")
            for comp in self.computes.values():
                free_compute(self.engine.pool, comp)
            self.computes.clear()
        finally:
            self._close()

    async def aclose(self) -> None:
        """Wait for an ``abort()`` to finish (no-op otherwise)."""
        if self._abort_future is not None:
            await self._abort_future

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pool = self.engine.pool
        self._unpin(set(self._pins))
        self.engine.restore.release(self.batch)
        for plan in self.plans:
            self.engine._release_plan(plan)
        pool.flush_deferred()
        self._release_lock()
