"""One batch: its lifecycle (``engine/batch_lifecycle.py``) and its passes.

:class:`Batch` is the state machine of
:class:`~layerlift.engine.batch_lifecycle.BatchLifecycle` (states,
transitions, what it holds, the one exit) plus what RUNNING does:

* ``run()``: the engine's own forward in a worker thread, with a wait
  before every layer (``engine/forward.py``), pass after pass: a failed or
  late layer ends the load, the affected requests are recomputed and the
  forward runs again (at most ``MAX_FORWARD_ATTEMPTS`` passes); a pass that
  ran through counts only once the load's end has *finished* and every
  restore it read had landed; then results, the insert of computed pages,
  their offload, the cost model's lesson and the exit.
* ``begin_external()`` … ``external_done()`` / ``external_failed()``: the
  same passes in a host's own forward (external runner): the host waits
  per layer, says when its forward returned, and gets the requests to run
  again when a restore it read failed.

The passes change what the batch holds only through the lifecycle
(recompute, defer, end the load, close); every outcome leaves through its
exit. Threads: event loop only, except :meth:`Batch.wait_layer`,
:meth:`Batch.host_started` and :meth:`Batch.host_returned` (any thread).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from layerlift.engine.batch_lifecycle import NEXT, BatchLifecycle, BatchState, too_big
from layerlift.engine.context import EngineContext, EngineError
from layerlift.engine.forward import (
    ForwardRun,
    ForwardStopped,
    build_results,
    build_runs,
    forward_requests,
    insert_computed,
    run_forward,
)
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.record import RequestStatus
from layerlift.engine.results import PrefillResult, Timings
from layerlift.engine.threads import run_owned
from layerlift.overlap.base import LayerLoadError, LayerWaitTimeout, ReadinessView
from layerlift.overlap.readiness import LayerReadiness, check_layer

# BatchState, NEXT and too_big are the lifecycle's; importable from here too.
__all__ = ["NEXT", "Batch", "BatchState", "RerunRequired", "too_big"]

MAX_FORWARD_ATTEMPTS = 3

# What a host forward's batch waits for when only its host can move it on
# (``engine/awaiting.py``): other requests wait behind it at most
# ``layer_wait_timeout_s``, then get an EngineError that says this.
NOT_STARTED = ("handed to a host forward (begin_external) that has not started: run it, "
               "or abort that handle")
RETURNED = ("its host forward returned without done(), failed() or abort(): call one of "
            "them on that handle")
RERUN_AFTER_DONE = ("told to rerun (done() raised RerunRequired) and neither rerun nor "
                    "aborted: run the requests RerunRequired carries, or abort that handle")
RERUN_AFTER_FAILED = ("told to rerun (failed() returned the requests to run again) and "
                      "neither rerun nor aborted: run them, or abort that handle")


class RerunRequired(EngineError):
    """A host's forward read a restore that did not land in full (it skipped
    a wait); those requests now compute: run ``requests`` again."""

    def __init__(self, requests: list[ForwardRequest]) -> None:
        super().__init__("a restored layer failed after the forward read it: run the "
                         "returned requests again")
        self.requests = requests


class Batch(BatchLifecycle):
    """One batch (see the module docstring): the lifecycle's states and
    holdings, and the passes of RUNNING in the engine's forward
    (:meth:`run`) or a host's (:meth:`begin_external`)."""

    def __init__(self, ctx: EngineContext, started: float) -> None:
        super().__init__(ctx, started)
        self._ext_runs: list[ForwardRun] = []  # a host forward's page tables
        self._ext_deps: list[ReadinessView] = []  # and what its waits wait on
        self._host_call: str | None = None  # external_done / external_failed in progress

    # ---- RUNNING ------------------------------------------------------------------
    async def run(self) -> list[PrefillResult]:
        """The forward (committing first if needed), then results, insert of
        the computed pages, their offload and the exit. ``EngineError`` if a
        recompute does not fit or the forward keeps failing; any exception
        or cancellation aborts the batch before it propagates."""
        if self.state is BatchState.LOADING:
            try:
                self.commit()
            except BaseException:
                await self.aclose()
                raise
        self._to(BatchState.RUNNING)
        self.caller.progresses()
        return await self._guard(self._run())

    async def _run(self) -> list[PrefillResult]:
        ctx = self.ctx
        for _attempt in range(MAX_FORWARD_ATTEMPTS):
            if not self.records:  # every request was deferred to a later part
                await self.close(None)  # the exit ends the load
                return []
            # Checked with no await before the forward starts: once the exit has
            # begun (an abort while the previous pass was being cleaned up), no
            # new forward may run on pages the exit is releasing.
            self._check_open()
            runs, deps, stop = build_runs(self.records), self._deps(), threading.Event()
            self._forward_stop = stop
            self._forward_idle.clear()
            try:
                # The forward owns its pages until it returns: a cancellation
                # stops it at the next layer and is raised once it returned.
                out, timings = await run_owned(
                    functools.partial(run_forward, ctx.model, ctx.pool, runs, deps,
                                      self.started, stop),
                    on_cancel=functools.partial(self._stop, "batch cancelled during its forward"))
            except (LayerLoadError, LayerWaitTimeout, ForwardStopped) as err:
                if self.closed or isinstance(err, ForwardStopped):
                    # aborted while the forward ran: the exit owns the rest
                    raise self._aborted_error() from err
                await self._after_failed_pass(err)
                continue
            finally:
                self._forward_idle.set()
            if self.closed:
                raise self._aborted_error()
            if await self._after_good_pass():
                return await self._finish(runs, out.next_token_logprobs, timings)
        raise EngineError("the forward kept failing while restores were recomputed")

    async def _after_failed_pass(self, err: LayerLoadError | LayerWaitTimeout) -> None:
        """A layer's wait failed: end the load, unpublish and recompute the
        affected requests (all restoring ones after a timeout)."""
        if isinstance(err, LayerWaitTimeout):
            reason = f"restore did not land in time: {err}"
            self._stop_load(reason)
            failed = await self._end_load() | self._restoring()
        else:
            reason = f"restore failed at layer {err.layer}: {err.cause!r}"
            failed = await self._end_load() | (err.requests or self._restoring())
        self._check_open()
        await self._recompute(frozenset(failed), reason)
        self._check_open()

    async def _after_good_pass(self) -> bool:
        """The pass ran through: True once every restore it read had landed
        in full; otherwise the failed ones are set up to recompute (False).
        Always waits for the load's end to have *finished* (a load whose end
        had finished before this pass returns at once: what failed then is
        recomputed already); an end that has only begun proves nothing."""
        ended = await self._end_load()
        self._check_open()
        # Requests that compute already (a refused COMMIT) read none of it.
        failed = frozenset(r.rid for r in self.records if r.rid in ended and r.plan.restores)
        if failed:
            await self._recompute(failed, "a restored layer failed after the forward read it")
            self._check_open()
        return not failed

    async def _finish(self, runs: Sequence[ForwardRun], logprobs: torch.Tensor,
                      timings: Timings) -> list[PrefillResult]:
        results = build_results(
            self.plans, logprobs, timings, started=self.started, load_issued=self.load_issued,
            landed=self.restore.timings,
            recomputed={r.rid for r in self.records if r.status is RequestStatus.RECOMPUTED})
        for rec, run in zip(self.records, runs, strict=True):
            insert_computed(self.ctx, run)
            rec.compute = None  # the tree or the free lists own its pages now
        self._teach_cost_model(timings)
        await self.close(None)
        return results

    def _teach_cost_model(self, timings: Timings) -> None:
        """Teach ``restore="auto"`` what happened: each layer that landed
        (the lane's own records) and the forward's per-layer compute (an
        untimed host forward teaches nothing)."""
        cost = self.ctx.cost
        if cost is None:
            return
        cost.observe_layers(self.restore.timings)
        if len(timings.layer_compute) == self.ctx.pool.spec.num_layers:
            computed = sum(len(p.tokens) - p.boundary * p.spec.page_size for p in self.plans)
            cost.observe_forward(computed, sum(timings.layer_compute))

    # ---- RUNNING in a host's own forward (external runner) -------------------------
    def begin_external(self) -> list[ForwardRequest]:
        """COMMIT if needed and hand the forward to the host: one request per
        plan (page tables, state slot, COW source, checkpoints to capture).
        The host calls :meth:`wait_layer` before each layer, writes only the
        pages and slots it was given, says when its forward returned
        (:meth:`host_returned`; done and failed say it too) and ends with
        :meth:`external_done` or :meth:`external_failed`."""
        if self.state is BatchState.LOADING:
            self.commit()
        self._to(BatchState.RUNNING)
        self.caller.waits(NOT_STARTED)
        return self._external_requests()

    def _external_requests(self) -> list[ForwardRequest]:
        self._ext_runs = build_runs(self.records)
        self._ext_deps = self._deps()
        return forward_requests(self._ext_runs)

    def wait_layer(self, layer: int, timeout: float | None = None, *, stream: Any = None) -> None:
        """The host's per-layer wait (any thread but the event loop's):
        returns once layer ``layer`` of every restore may be read (on CUDA,
        ``stream`` waits on the load's event). Raises ``LayerLoadError`` or
        ``LayerWaitTimeout``: pass it to :meth:`external_failed`. The first
        wait marks the host's forward running (:meth:`host_started`); once
        the batch's exit began it raises ``EngineError`` (the forward must
        stop: its pages are being released)."""
        check_layer(layer, self.ctx.pool.spec.num_layers)
        self.host_started()
        try:
            for dep in self._ext_deps:
                dep.wait(layer, timeout, stream=stream)
        except BaseException as err:
            # The forward must stop here: from now on only the host moves the
            # batch on (failed() or abort()).
            self.caller.waits(f"its host forward's wait for layer {layer} raised {err!r} and "
                              "the host called neither failed() nor abort(): pass the error "
                              "to failed(), or abort that handle")
            raise

    def host_started(self) -> None:
        """The host's forward runs (any thread; idempotent): the exit waits
        for :meth:`host_returned` before it releases a page. ``EngineError``
        once the exit began: the forward must not start."""
        if not self._host.start():
            if self._abort_reason is not None:
                raise self._aborted_error()
            raise EngineError("this batch has ended (its results were taken, or it failed): "
                              "a host forward must not run on its pages any more")
        self.caller.progresses()

    def host_returned(self) -> None:
        """The host's forward returned and touches none of the batch's pages
        any more (any thread; idempotent). A batch whose exit gave up waiting
        for it releases what it left behind now; otherwise the batch waits
        for the host's done(), failed() or abort()."""
        if self._host.returned():
            self.caller.waits(RETURNED)

    def _claim_host_call(self, what: str) -> None:
        """``RuntimeError`` unless the batch runs a host forward and no
        other done()/failed() is in progress; then ``what`` holds the claim
        (checked and taken with no await between)."""
        if self.state is not BatchState.RUNNING or self._exit_task is not None:
            raise RuntimeError("this batch is not running a host forward")
        if self._host_call is not None:
            raise RuntimeError(
                f"{what} was called while {self._host_call} of the same forward is still "
                "running: call done() or failed() once per forward, and await it first")
        self._host_call = what
        self.caller.begin_call()

    async def external_failed(self, error: BaseException) -> list[ForwardRequest]:
        """The host's forward raised ``error``. A failed or late layer load:
        the affected requests are recomputed and the requests to run again
        are returned (their page tables changed). Anything else aborts the
        batch and is raised again. Says that the host's forward returned."""
        self.host_returned()
        self._claim_host_call("failed()")
        then: str | None = None
        try:
            if not isinstance(error, LayerLoadError | LayerWaitTimeout):
                await self.close(error)
                raise error
            await self._guard(self._after_failed_pass(error))
            requests = self._external_requests()
            then = RERUN_AFTER_FAILED
            return requests
        finally:
            self._host_call = None
            self.caller.end_call(then)

    async def external_done(self, next_token_logprobs: torch.Tensor,
                            timings: Timings | None = None) -> list[PrefillResult]:
        """The host's forward finished and wrote every page and slot it was
        given; ``next_token_logprobs`` is ``[batch, vocab]`` in plan order.
        Ends the load; if a restore it read turns out not to have landed,
        those requests are set up to recompute and :class:`RerunRequired`
        carries the requests to run again. Otherwise inserts the computed
        pages, offloads them, exits and returns the results. ``timings``: the
        host's per-layer compute, if it measured it (the cost model learns
        nothing about compute otherwise). Says that the host's forward
        returned. ``RuntimeError`` while another done()/failed() of the
        batch is in progress; ``ValueError`` for logprobs of another shape
        than ``[requests, vocab]`` (nothing changes: call it again)."""
        self.host_returned()
        if self.state is not BatchState.RUNNING or self._exit_task is not None:
            raise RuntimeError("this batch is not running a host forward")
        self._check_logprobs(next_token_logprobs)
        self._claim_host_call("done()")
        then: str | None = None
        try:
            if not await self._guard(self._after_good_pass()):
                rerun = RerunRequired(self._external_requests())
                then = RERUN_AFTER_DONE
                raise rerun
            mine = dataclasses.replace(timings) if timings is not None else Timings()
            return await self._guard(self._finish(self._ext_runs, next_token_logprobs, mine))
        finally:
            self._host_call = None
            self.caller.end_call(then)

    def _check_logprobs(self, logprobs: torch.Tensor) -> None:
        n, vocab = len(self.plans), self.ctx.vocab_size
        if logprobs.ndim != 2:
            raise ValueError(f"next_token_logprobs must be [requests, vocab] = [{n}, {vocab}], "
                             f"got {logprobs.ndim} dimension(s) {tuple(logprobs.shape)}")
        if logprobs.shape[0] != n:
            raise ValueError(f"next_token_logprobs has {logprobs.shape[0]} rows "
                             f"for {n} requests")
        if logprobs.shape[1] != vocab:
            raise ValueError(f"next_token_logprobs has {logprobs.shape[1]} columns for a model "
                             f"of {vocab} tokens: give each request's log-probabilities over "
                             "the whole vocabulary")

    def _restoring(self) -> frozenset[Hashable]:
        return frozenset(p.request_id for p in self.plans if p.restores)

    def _deps(self) -> list[ReadinessView]:
        """What the forward waits on before each layer: this batch's load
        while it runs, and loads of other batches whose nodes a plan matched
        while they were still landing."""
        deps: list[ReadinessView] = []
        if not self.restore.ended and any(r.txn is not None for r in self.records):
            deps.append(self.restore.readiness)
        for plan in self.plans:
            for pending in plan.match.pending:
                if isinstance(pending, LayerReadiness) and all(pending is not x for x in deps):
                    deps.append(pending)
        return deps
