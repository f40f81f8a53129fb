"""The step-by-step API's handle on one batch (``Engine.load``).

A thin public face over :class:`~layerlift.engine.batch.Batch`, which owns
the batch's state machine and all of its cleanup. Through its batch the
handle holds the engine's load lock until the load has landed and its
device lock from COMMIT until ``forward()`` returned or ``abort()`` finished.
Cancelling any awaited method aborts the batch; the cancellation is raised
once no thread of the batch runs any more.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from layerlift.engine.batch import Batch, BatchState, RerunRequired
from layerlift.engine.context import EngineError
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import PrefillResult, Timings
from layerlift.overlap.readiness import LayerReadiness

__all__ = ["EngineError", "ExternalForward", "LoadHandle", "RerunRequired", "WaitClock"]


class LoadHandle:
    """PREPAREd restores of one batch with their fetches issued."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch

    @property
    def plans(self) -> list[LookupPlan]:
        return list(self._batch.plans)

    @property
    def state(self) -> BatchState:
        """Where the batch is in its life cycle (see ``engine/batch.py``)."""
        return self._batch.state

    @property
    def readiness(self) -> LayerReadiness:
        """The batch's per-layer readiness (settled at COMMIT when nothing is
        left to load, cancelled on abort or failure)."""
        return self._batch.readiness

    async def issue(self) -> None:
        """Issue the per-layer fetches if ``Engine.load`` has not (it has)."""
        if self._batch.state is BatchState.PREPARED:
            await self._batch.issue()

    def commit(self) -> LayerReadiness:
        """COMMIT: publish the restores, trim the loads, set COW sources;
        returns the per-layer readiness (nothing waits here). Raises
        ``RuntimeError`` if the handle was committed, aborted or finished."""
        return self._batch.commit()

    async def forward(self) -> list[PrefillResult]:
        """Run the forward (committing first if needed), insert the computed
        pages, start their offload, release everything; one result per plan.

        A restore that fails at layer k is recomputed (exact results; the
        result says so). Raises ``EngineError`` if a recompute does not fit,
        ``RuntimeError`` if the handle was aborted or finished. On any
        exception, and on cancellation (the forward stops at its next layer
        and is waited for), the batch is ABORTed before the exception
        propagates: fetches stopped and waited for, restores that did not
        land unpublished, every slot freed."""
        await self.issue()
        return await self._batch.run()

    def begin_external(self) -> ExternalForward:
        """External-runner mode: the host framework runs the forward itself
        (as vLLM or SGLang own theirs). Commits if needed; see
        :class:`ExternalForward`. ``RuntimeError`` if the batch is not
        loading or committed."""
        return ExternalForward(self._batch, self._batch.begin_external())

    def abort(self) -> None:
        """ABORT: stop the loads and release everything; the tree ends as it
        was before this batch's COMMIT. Returns at once; ``await aclose()``
        waits until in-flight fetches stopped and the slots are free."""
        self._batch.abort()

    async def aclose(self) -> None:
        """Wait for an ``abort()`` to finish (no-op otherwise). After
        ``begin_external``: ``EngineError`` if the host's forward does not
        say it returned in time (see :class:`ExternalForward`)."""
        await self._batch.aclose()


class ExternalForward:
    """A batch whose forward the host runs (external-runner mode).

    ``requests[i]`` is plan ``i``'s share: the tokens to compute, the
    absolute position they start at, the FULL/SWA page tables (restored
    prefix, then fresh pages for the new tokens), the recurrent state slot to
    write, the slot to copy the state from first (COW) and the checkpoints to
    capture. The host, per layer ``l``: calls :meth:`wait` (blocking, from its
    layer hook; the vLLM connector's ``wait_for_layer_load``), computes, and
    writes the new KV and state only into what it was given. Then exactly one
    of: ``await done(next_token_logprobs)`` (results; the computed pages are
    inserted and offloaded) or ``await failed(exc)`` (a failed load: returns
    the requests to run again; anything else aborts the batch and raises).
    ``done`` raises :class:`RerunRequired` (carrying new requests) when a
    restore the host read had not landed.

    The forward-returned rule: the batch's pages and slots are the host
    forward's while it runs, and nothing releases them under it. The forward
    counts as running from its first :meth:`wait` (or from entering
    :meth:`running`) until the host says it returned: leaving ``with
    run.running():``, :meth:`returned`, ``done`` or ``failed``. Every exit
    (:meth:`abort` then :meth:`aclose`, ``Engine.close``) waits for that.
    After an abort the host's next :meth:`wait` raises ``EngineError`` (stop
    there). A host that does not say it returned within
    ``layer_wait_timeout_s`` of the exit gets an ``EngineError`` from
    ``aclose`` (and ``Engine.close``) naming this rule; its batch's pages
    then stay allocated, logged, until it does say so: never freed under a
    forward that may still write them. On a GPU "returned" means the host's
    work on those pages has completed (synchronize its stream first). Run
    the forward as ``with run.running(): model(...)`` in the thread that runs
    it, so that every way out of it (an exception, a cancelled caller) says
    so.

    Timings (what ``restore="auto"`` learns the compute cost from): the host
    passes its per-layer compute to ``done(..., timings=Timings(layer_compute
    =[...]))``; without them they are measured between the waits when that
    is sound (see :class:`WaitClock`); otherwise the batch teaches the cost
    model nothing about compute. ``timings`` holds what ``done`` used.
    """

    def __init__(self, batch: Batch, requests: list[ForwardRequest]) -> None:
        self._batch = batch
        self.requests = requests
        pool = batch.ctx.pool
        self._layers = pool.spec.num_layers
        self._clock = WaitClock(self._layers, measurable=pool.buffer.device.type == "cpu")
        self.timings: Timings | None = None

    def wait(self, layer: int, timeout: float | None = None, *, stream: Any = None) -> None:
        """Block until layer ``layer`` may be read (default timeout: the
        engine's ``layer_wait_timeout_s``); on CUDA ``stream`` (None: the
        current one) waits on the load's event instead of the host. Marks
        the forward running (see the class docstring); ``EngineError`` once
        the batch is aborted or ended: stop the forward."""
        self._clock.called(layer, stream)
        self._batch.wait_layer(layer, timeout, stream=stream)
        self._clock.returned(layer)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """``with run.running(): <the host's forward>``, in the thread that
        runs it: the forward counts as running inside, and as returned once
        the block is left, however it is left. ``EngineError`` on entry if
        the batch is aborted or ended already (do not run the forward)."""
        self._batch.host_started()
        try:
            yield
        finally:
            self._batch.host_returned()

    def returned(self) -> None:
        """The host's forward has returned: it reads and writes none of the
        batch's pages and slots any more (on a GPU: its work on them has
        completed). Any thread; idempotent. ``done`` and ``failed`` say it
        too; call it yourself before :meth:`abort` when the forward ran."""
        self._batch.host_returned()

    async def failed(self, error: BaseException) -> list[ForwardRequest]:
        """The host's forward raised ``error`` (it has returned). A failed
        or late layer load (``LayerLoadError``, ``LayerWaitTimeout``): the
        affected requests are recomputed and the requests to run again are
        returned; anything else aborts the batch and is raised again.
        ``RuntimeError`` if the batch is not running a host forward or
        ``done``/``failed`` is in progress for it."""
        self.requests = await self._batch.external_failed(error)
        self._clock.reset()  # the requests run again: a new forward to time
        return self.requests

    async def done(self, next_token_logprobs: torch.Tensor, *,
                   timings: Timings | None = None) -> list[PrefillResult]:
        """The forward finished: results (see the class docstring).
        ``timings``: the host's own measurement, ``layer_compute`` with one
        entry per cache layer (seconds; ``layer_wait`` optional, the same
        length). The forward has returned (see the class docstring).
        ``ValueError`` for timings of another length or negative, or logprobs
        that are not ``[requests, vocab]``; ``RuntimeError`` if the batch is
        not running a host forward or ``done``/``failed`` is in progress for
        it (a second concurrent call)."""
        end = time.perf_counter()
        if timings is not None:
            check_host_timings(timings, self._layers)
        used = timings if timings is not None else self._clock.timings(end)
        try:
            results = await self._batch.external_done(next_token_logprobs, used)
        except RerunRequired as rerun:
            self.timings = used
            self.requests = rerun.requests
            self._clock.reset()
            raise
        # Set once the batch took this call (a refused one changes nothing).
        self.timings = used
        return results

    def abort(self) -> None:
        """Abandon the host forward: ABORT the batch (then ``await aclose()``).
        The host's next :meth:`wait` raises; the exit releases nothing until
        the forward returned (see the class docstring)."""
        self._batch.abort()

    async def aclose(self) -> None:
        """Wait for the exit that :meth:`abort` started: once the forward
        returned, everything is released. ``EngineError`` (pages left
        allocated) if the forward does not say it returned within
        ``layer_wait_timeout_s``."""
        await self._batch.aclose()


def check_host_timings(timings: Timings, layers: int) -> None:
    """``ValueError`` unless ``timings.layer_compute`` has one non-negative
    entry per cache layer (and ``layer_wait`` none or the same)."""
    if len(timings.layer_compute) != layers:
        raise ValueError(f"timings.layer_compute has {len(timings.layer_compute)} entries for "
                         f"a model of {layers} cache layers: give one per layer (seconds)")
    if timings.layer_wait and len(timings.layer_wait) != layers:
        raise ValueError(f"timings.layer_wait has {len(timings.layer_wait)} entries for "
                         f"{layers} cache layers: give one per layer or none")
    if min(timings.layer_compute + timings.layer_wait) < 0:
        raise ValueError("per-layer compute and wait times must not be negative")


class WaitClock:
    """Per-layer times a host's forward reveals through its waits.

    Sound only when the host computes synchronously and waits once per layer
    in order: on a CPU pool, every wait without a ``stream``, layers 0, 1,
    ... each once. Then layer ``l`` computes from its wait's return to layer
    ``l + 1``'s wait (the last layer: to ``done``; it includes the host's LM
    head). Anything else (a GPU, where the host only enqueues; repeated or
    skipped waits) gives ``None``: nothing is learned rather than a wrong
    figure. Called from the host's forward thread, read after it returned.
    """

    def __init__(self, layers: int, *, measurable: bool) -> None:
        self.layers, self.measurable = layers, measurable
        self.reset()

    def reset(self) -> None:
        self.sound = self.measurable
        self.calls: list[float] = []
        self.returns: list[float] = []

    def called(self, layer: int, stream: Any) -> None:
        if stream is not None or layer != len(self.calls):
            self.sound = False
        self.calls.append(time.perf_counter())

    def returned(self, layer: int) -> None:
        self.returns.append(time.perf_counter())

    def timings(self, end: float) -> Timings | None:
        """What the waits measured, ``end`` being when the forward finished."""
        n = self.layers
        if not self.sound or len(self.calls) != n or len(self.returns) != n:
            return None
        starts = [*self.calls[1:], end]
        return Timings(layer_wait=[r - c for c, r in zip(self.calls, self.returns, strict=True)],
                       layer_compute=[max(0.0, s - r)
                                      for r, s in zip(self.returns, starts, strict=True)])
