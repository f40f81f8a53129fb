"""The forward of one batch and what follows it: page tables per request, the
model run with a wait before every layer, results, insert of computed pages.

Plain helpers over one batch's data; :mod:`layerlift.engine.batch` decides
when each runs and cleans up after every outcome. ``run_forward`` runs in a
worker thread; everything else on the event loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerlift.engine.compute import ComputeAlloc
from layerlift.engine.context import EngineContext
from layerlift.engine.model.api import ForwardOutput, ForwardRequest
from layerlift.engine.plan import LookupPlan
from layerlift.engine.record import RequestRecord
from layerlift.engine.results import PrefillResult, Timings
from layerlift.overlap.base import ReadinessView
from layerlift.overlap.device import Device, device_of
from layerlift.overlap.scheduler import LayerTiming
from layerlift.pools.spec import Component

__all__ = [
    "ForwardRun",
    "ForwardStopped",
    "build_results",
    "build_runs",
    "forward_requests",
    "insert_computed",
    "run_forward",
]


class ForwardStopped(Exception):
    """The forward stopped at a layer boundary because its batch was cancelled."""


@dataclass(eq=False)
class ForwardRun:
    """One request's forward inputs: its page tables (cached prefix then its
    own compute pages) and where its recurrent state comes from."""

    plan: LookupPlan
    compute: ComputeAlloc
    full: torch.Tensor
    swa: torch.Tensor
    cow: int | None


def build_runs(records: Sequence[RequestRecord]) -> list[ForwardRun]:
    """Page tables for every request: a restoring one reads the canonical
    indices its COMMIT got (COW from the canonical checkpoint); any other
    reads its device hit."""
    runs = []
    for rec in records:
        assert rec.compute is not None
        full, swa, cow = rec.read_tables()
        swa = swa.clone()
        swa[: max(0, rec.plan.boundary - rec.plan.spec.window_pages)] = 0  # never read
        runs.append(ForwardRun(rec.plan, rec.compute, full, swa, cow))
    return runs


def run_forward(model: Any, pool: Any, runs: Sequence[ForwardRun],
                deps: Sequence[ReadinessView], started: float,
                stop: threading.Event | None = None) -> tuple[ForwardOutput, Timings]:
    """Worker thread: the model, with a wait for every readiness in ``deps``
    before each layer (the only place the forward waits for restored data).
    Once ``stop`` is set the next layer raises :class:`ForwardStopped` (the
    batch was cancelled: its pages are not used, so stopping early is safe).

    On a device (``overlap.device``: CUDA, or the simulated device in tests)
    the thread runs under the pool's device (a fresh thread's current device
    is cuda:0) and layer ``l``'s waits make that device's current stream,
    named explicitly, wait on the load's event: no host sync."""
    device = device_of(pool.buffer)
    if device is None:
        return _forward(model, pool, runs, deps, started, None, stop)
    with device.use() as stream:
        return _forward(model, pool, runs, deps, started, (device, stream), stop)


def forward_requests(runs: Sequence[ForwardRun]) -> list[ForwardRequest]:
    """What the model computes for each run: the suffix after the boundary,
    the page tables, the state slot, the COW source and the checkpoints."""
    reqs = []
    for r in runs:
        ps = r.plan.spec.page_size
        reqs.append(ForwardRequest(
            tokens=torch.from_numpy(r.plan.tokens[r.plan.boundary * ps:]),
            prefix_len=r.plan.boundary * ps,
            full_pages=torch.cat([r.full, r.compute.full]),
            swa_pages=torch.cat([r.swa, r.compute.swa]),
            mamba_slot=r.compute.work_slot,
            mamba_cow_src=r.cow,
            capture={p * ps: s for p, s in r.compute.capture.items()},
        ))
    return reqs


def _forward(model: Any, pool: Any, runs: Sequence[ForwardRun], deps: Sequence[ReadinessView],
             started: float, on: tuple[Device, Any] | None,
             stop: threading.Event | None) -> tuple[ForwardOutput, Timings]:
    stream = on[1] if on is not None else None
    reqs = forward_requests(runs)
    # Per layer: the wait before its first use, and its compute summed over every
    # stretch between before_layer(l) and after_layer(l) (a model that runs
    # requests or chunks one after another brackets each of them). A stretch ends
    # at the hook before it ends, so one decoder layer holding several cache
    # layers is counted once.
    layers = len(model.spec.kinds)
    timings = Timings(layer_wait=[0.0] * layers, layer_compute=[0.0] * layers)
    waited: set[int] = set()
    mark = [time.perf_counter()]

    def before(layer: int) -> None:
        if stop is not None and stop.is_set():
            raise ForwardStopped(f"the batch was cancelled before layer {layer}")
        if layer not in waited:  # later calls start a stretch without waiting
            waited.add(layer)
            t = time.perf_counter()
            for dep in deps:
                dep.wait(layer, stream=stream)
            now = time.perf_counter()
            timings.layer_wait[layer] = now - t
            if layer == 0:
                timings.forward_start = now - started
        mark[0] = time.perf_counter()

    def after(layer: int) -> None:
        now = time.perf_counter()
        timings.layer_compute[layer] += now - mark[0]
        mark[0] = now

    if on is None:
        return model.forward_batch(reqs, pool, before, after), timings
    # On a GPU the host only enqueues: time each stretch with device events on
    # the forward's stream (read once, after the forward).
    device = on[0]
    spans: list[tuple[int, Any, Any]] = []
    last: list[Any] = [None]  # the event of the latest hook

    def before_cuda(layer: int) -> None:
        before(layer)
        last[0] = device.event(timing=True)
        last[0].record(stream)

    def after_cuda(layer: int) -> None:
        if last[0] is None:
            return  # a model that skipped before_layer (a negative control): untimed
        end = device.event(timing=True)
        end.record(stream)
        spans.append((layer, last[0], end))
        last[0] = end

    out = model.forward_batch(reqs, pool, before_cuda, after_cuda)
    if spans:
        spans[-1][2].synchronize()
        for layer, a, b in spans:
            timings.layer_compute[layer] += a.elapsed_time(b) / 1e3
    return out, timings


def build_results(plans: Sequence[LookupPlan], logprobs: torch.Tensor, timings: Timings, *,
                  started: float, load_issued: float, landed: Sequence[LayerTiming],
                  recomputed: set[int]) -> list[PrefillResult]:
    """One result per plan, in order. ``restored_tokens`` is what the plan's
    boundary says: the batch calls this only once every restore that is
    still counted has landed in full."""
    timings.ttft = time.perf_counter() - started
    timings.load_issued = load_issued
    if landed:
        at = {t.layer: t.landed - started for t in landed if t.landed}
        timings.layer_landed = [at.get(i, 0.0) for i in range(len(timings.layer_wait))]
    results = []
    for i, plan in enumerate(plans):
        ps = plan.spec.page_size
        results.append(PrefillResult(
            next_token_logprobs=logprobs[i].float().cpu(),
            device_hit_tokens=plan.device_pages * ps,
            restored_tokens=plan.restore_tokens,
            computed_tokens=len(plan.tokens) - plan.boundary * ps,
            timings=dataclasses.replace(timings, lookup=plan.lookup_time),
            restorable_boundaries=tuple(sorted(plan.restorable)),
            recomputed_after_failure=plan.request_id in recomputed,
            fallback_reason=plan.fallback_reason,
            restore_decision=plan.decision,
        ))
    return results


def insert_computed(ctx: EngineContext, run: ForwardRun) -> None:
    """Publish one request's computed pages and checkpoints (and offload
    them); free what the tree did not take. Once this returns, the tree or
    the free lists own every page of ``run.compute`` (the caller drops it from
    its books); if the tree's insert raises, nothing changed hands."""
    pool, comp, plan = ctx.pool, run.compute, run.plan
    ps = plan.spec.page_size
    b, whole = plan.boundary, len(plan.tokens) // ps
    full = torch.cat([run.full, comp.full])
    swa = torch.cat([run.swa, comp.swa])
    spare = {Component.FULL: comp.full[whole - b:], Component.SWA: comp.swa[whole - b:],
             Component.MAMBA: torch.tensor([comp.work_slot])}
    if whole > b:
        res = ctx.tree.insert(
            plan.tokens[: whole * ps], full[:whole], swa[:whole],
            torch.ones(whole, dtype=torch.bool), comp.capture, start_page=b,
        )
        for c, dup in res.duplicates.items():
            spare[c] = torch.cat([spare[c], dup])
    else:
        spare[Component.MAMBA] = torch.cat(
            [spare[Component.MAMBA], torch.tensor(list(comp.capture.values()), dtype=torch.int64)])
    for c, idx in comp.demand().items():
        pool.unpin(c, idx)
    if whole > b and ctx.cfg.offload:
        ctx.offloader.submit(res.node)
    for c, idx in spare.items():
        if len(idx):
            pool.free(c, idx)
