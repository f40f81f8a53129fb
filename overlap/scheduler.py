"""The load scheduler: issues a batch's layer jobs in layer order and marks readiness.

`LoadScheduler.start(jobs, readiness)` runs on the event loop and returns a `LoadTask`.
Jobs are grouped into *units* (one per layer; one per `group_size` layers under GROUPS);
units are issued in layer order to the lane, at most `max_in_flight` at a time. Under
OVERLAP and GROUPS a unit's layers are marked done from the worker thread the moment its
bytes land (no event-loop hop on the forward's critical path); under BARRIER nothing is
marked before every unit landed. On a lane that streams (CPU), OVERLAP and BARRIER both
stream `stream_size` layers per worker call, so the barrier baseline pays the same
hand-offs as overlap and differs only in when the forward may start.

Failure of a job at layer k fails k and every later layer for that job's requests,
stops issuing, and fails the never-issued units for their requests. Nothing raises out
of the task: errors reach the consumer through the readiness object.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .base import (
    JobCallback,
    Landing,
    Lane,
    LayerJob,
    LayerLoadCancelled,
    LoadPolicy,
    RequestId,
)
from .readiness import LayerReadiness


@dataclass(slots=True)
class LayerTiming:
    """One layer's trip through the lane (`time.perf_counter()` seconds).

    `issued`: handed to the lane; `started`/`landed`: its unit's worker began / finished
    (host side); `device_done`: CUDA copies completed (None on CPU or when failed).
    """

    layer: int
    nbytes: int
    issued: float
    started: float = 0.0
    landed: float = 0.0
    device_done: float | None = None
    failed: bool = False


@dataclass(slots=True)
class _Unit:
    layers: tuple[int, ...]
    jobs: list[LayerJob]
    landed_at: dict[int, float] = field(default_factory=dict)  # streaming: per layer


class LoadScheduler:
    """Issues layer jobs on `lane` according to `policy`. Reusable; holds no batch state.

    max_in_flight: units issued but not yet landed (host side). group_size: layers per
    unit under GROUPS (ignored otherwise). stream_size: layers per unit under OVERLAP on
    a lane that `streams_jobs` (CPU): the unit's layers are fetched one after the other
    in one worker call and each is released the moment its own fetch returned, so the
    per-layer granularity stays while the thread hand-off (tens of microseconds on a
    small box) is paid once per `stream_size` layers.
    """

    def __init__(
        self,
        lane: Lane,
        policy: LoadPolicy = LoadPolicy.OVERLAP,
        *,
        max_in_flight: int = 2,
        group_size: int = 4,
        stream_size: int = 1,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if stream_size < 1:
            raise ValueError(f"stream_size must be >= 1, got {stream_size}")
        self.lane = lane
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.group_size = group_size if policy is LoadPolicy.GROUPS else 1
        self.streaming = (
            policy in (LoadPolicy.OVERLAP, LoadPolicy.BARRIER)
            and lane.streams_jobs
            and stream_size > 1
        )
        if self.streaming:
            self.group_size = stream_size

    def start(self, jobs: Sequence[LayerJob], readiness: LayerReadiness) -> LoadTask:
        """Start loading `jobs` into `readiness`; call on the event loop (RuntimeError else).

        Layers without any job are considered loaded. ValueError if a job's layer is out
        of range. The jobs may still be mutated until issued; only `layer` is read now.
        """
        asyncio.get_running_loop()
        for job in jobs:
            if job.layer >= readiness.num_layers:
                raise ValueError(
                    f"job for layer {job.layer} but readiness has {readiness.num_layers} layers"
                )
        units: dict[int, _Unit] = {}
        for job in sorted(jobs, key=lambda j: j.layer):
            key = job.layer // self.group_size
            unit = units.setdefault(key, _Unit((), []))
            unit.jobs.append(job)
        for unit in units.values():
            unit.layers = tuple(sorted({j.layer for j in unit.jobs}))
        task = LoadTask(self, [units[k] for k in sorted(units)], readiness)
        self.lane.begin_load()
        task._begin()
        return task


class LoadTask:
    """One batch being loaded. All methods must be called on the event loop thread.

    Driven by callbacks on the loop (no task of its own): each unit's landing releases
    an in-flight slot and issues the next unit in the same loop iteration.
    `timings` (filled as layers land) is in landing order; use `LayerTiming.layer`.
    """

    def __init__(self, sched: LoadScheduler, units: list[_Unit], readiness: LayerReadiness):
        self._sched = sched
        self._units = units
        self._readiness = readiness
        self._barrier = sched.policy is LoadPolicy.BARRIER
        self._next = 0  # index of the first unit not yet issued
        self._stopped: BaseException | None = None
        self._cancelled = False  # read by streaming workers: stop at the next layer
        self._host_inflight = 0  # units issued whose fetches have not returned
        self._outstanding = 0  # units issued whose fetches or device copies still run
        self._quiet = asyncio.Event()
        self._landed_layers: list[int] = []
        self.timings: list[LayerTiming] = []
        covered = {layer for u in units for layer in u.layers}
        self._jobless = [i for i in range(readiness.num_layers) if i not in covered]

    def _begin(self) -> None:
        if not self._barrier:
            for layer in self._jobless:
                self._readiness.mark_done(layer)
        self._pump()

    # ---- public ---------------------------------------------------------------------

    def cancel(self, reason: str = "load cancelled") -> None:
        """Stop issuing; fail every not-yet-issued layer with `LayerLoadCancelled`.

        Units already issued run to completion (a running fetch cannot be interrupted)
        and are marked as they land. Await `wait_quiescent()` before reusing or freeing
        their destination memory. Idempotent; no effect once everything was issued.
        """
        self._cancelled = True
        if self._stopped is None:
            self._stopped = LayerLoadCancelled(-1, None, frozenset(), reason)
        self._fail_unissued(None, reason)
        self._maybe_finish()

    async def wait_quiescent(self) -> None:
        """Return once no fetch or device copy of this task is running or can start."""
        await self._quiet.wait()

    async def done(self) -> None:
        """Return once every layer is settled (done or failed) and the task is quiescent."""
        await self._quiet.wait()

    @property
    def readiness(self) -> LayerReadiness:
        return self._readiness

    # ---- state machine (event loop) ----------------------------------------------------

    def _pump(self) -> None:
        """Issue units in layer order while a slot is free and nothing stopped us."""
        limit = self._sched.max_in_flight
        while self._stopped is None and self._next < len(self._units):
            if self._host_inflight >= limit:
                return
            unit = self._units[self._next]
            self._next += 1
            self._issue(unit)
        self._maybe_finish()

    def _issue(self, unit: _Unit) -> None:
        issued = time.perf_counter()
        nbytes = {layer: 0 for layer in unit.layers}
        for job in unit.jobs:
            nbytes[job.layer] += job.nbytes
        on_landed = None if self._barrier or self._sched.streaming else self._mark_landed
        on_job = self._job_marker(unit) if self._sched.streaming else None
        try:
            fut = self._sched.lane.fetch_into(unit.jobs, on_landed, on_job)
        except Exception as exc:  # the lane refused the unit (closed, invalid job)
            self._fail_unit(unit, exc)
            return
        self._host_inflight += 1
        self._outstanding += 1
        fut.add_done_callback(functools.partial(self._on_host_landed, unit, issued, nbytes))

    def _job_marker(self, unit: _Unit) -> JobCallback:
        """Worker thread (streaming): release a layer once all its jobs in this unit
        returned (under BARRIER only record when it landed: `_maybe_finish` releases
        every layer at once); a failed job marks its requests failed first. The unit
        stops at a failure or a cancellation, and its remaining layers are marked
        cancelled."""
        release = not self._barrier
        left = Counter(job.layer for job in unit.jobs)
        readiness = self._readiness
        first_error: list[BaseException] = []

        def on_job(layer: int, requests: frozenset[RequestId], error: BaseException | None) -> bool:
            if error is not None:
                readiness.mark_failed(layer, error, requests or None)
                first_error.append(error)
            left[layer] -= 1
            if left[layer] > 0:  # finish the layer: its other jobs serve other requests
                return False
            unit.landed_at[layer] = time.perf_counter()
            if release:
                readiness.mark_done(layer)
            # Stop at our own failure or a cancel; another unit's failure at a later
            # layer must not cancel the earlier layers this unit still carries.
            if not first_error and not self._cancelled:
                return False
            cause = first_error[0] if first_error else None
            reason = "not issued: an earlier layer failed or the load was cancelled"
            for lay in sorted(lay for lay, n in left.items() if n > 0):
                reqs = _layer_requests(unit, lay) or readiness.requests
                readiness.mark_failed(lay, LayerLoadCancelled(lay, cause, reqs, reason))
            return True

        return on_job

    def _mark_landed(self, landing: Landing) -> None:
        """Worker thread (OVERLAP/GROUPS): failures first, so no waiter slips past them."""
        for f in landing.failures:
            self._readiness.mark_failed(f.layer, f.error, f.requests or None)
        for layer in landing.layers:
            self._readiness.mark_done(layer, landing.event)

    def _on_host_landed(
        self, unit: _Unit, issued: float, nbytes: dict[int, int], fut: asyncio.Future[Landing]
    ) -> None:
        self._host_inflight -= 1
        if fut.cancelled() or fut.exception() is not None:
            exc = None if fut.cancelled() else fut.exception()
            self._fail_unit(unit, exc if isinstance(exc, Exception) else None)
            self._outstanding -= 1
            self._pump()
            return
        landing = fut.result()
        failed_layers = {f.layer for f in landing.failures}
        if self._barrier and not self._sched.streaming:  # streaming: on_job marked them
            for f in landing.failures:
                self._readiness.mark_failed(f.layer, f.error, f.requests or None)
        if landing.failures:
            self._stop(landing.failures[0].error)
        # A streamed unit records when each of its layers landed; a layer starts
        # when the one before it in the unit landed.
        landed = {lay: unit.landed_at.get(lay, landing.finished) for lay in unit.layers}
        starts = [landing.started, *(landed[lay] for lay in unit.layers[:-1])]
        rows = [
            LayerTiming(
                lay, nbytes[lay], issued, start, landed[lay], None, lay in failed_layers
            )
            for lay, start in zip(unit.layers, starts, strict=True)
        ]
        self.timings.extend(rows)
        self._landed_layers.extend(unit.layers)
        if landing.device_done is None:
            self._outstanding -= 1
        else:
            landing.device_done.add_done_callback(
                functools.partial(self._on_device_done, unit, rows)
            )
        self._pump()

    def _on_device_done(
        self, unit: _Unit, rows: list[LayerTiming], _: asyncio.Future[None]
    ) -> None:
        now = time.perf_counter()
        for row in rows:
            row.device_done = now
        if not self._barrier:
            for layer in unit.layers:
                self._readiness.mark_landed(layer)
        self._outstanding -= 1
        self._maybe_finish()

    def _fail_unit(self, unit: _Unit, exc: Exception | None) -> None:
        err = exc if exc is not None else LayerLoadCancelled(unit.layers[0], None)
        self._readiness.mark_failed(unit.layers[0], err)
        self._stop(err)

    def _maybe_finish(self) -> None:
        if self._quiet.is_set() or self._outstanding:
            return
        if self._next < len(self._units) and self._stopped is None:
            return
        if self._barrier:
            for layer in sorted([*self._landed_layers, *self._jobless]):
                self._readiness.mark_done(layer)
        self._quiet.set()

    def _stop(self, cause: BaseException) -> None:
        if self._stopped is None:
            self._stopped = cause
            self._fail_unissued(cause, "not issued: an earlier layer failed")

    def _fail_unissued(self, cause: BaseException | None, reason: str) -> None:
        # mark_failed(k) also fails every later layer, so each request set is marked once,
        # at the first unissued layer that carries it.
        seen: set[frozenset[RequestId]] = set()
        for unit in self._units[self._next :]:
            for layer in unit.layers:
                reqs = _layer_requests(unit, layer) or self._readiness.requests
                if reqs in seen:
                    continue
                seen.add(reqs)
                self._readiness.mark_failed(layer, LayerLoadCancelled(layer, cause, reqs, reason))
        self._next = len(self._units)


def _layer_requests(unit: _Unit, layer: int) -> frozenset[RequestId]:
    """Requests carried by `unit`'s jobs of `layer`; empty when one job covers all."""
    out: set[RequestId] = set()
    for job in unit.jobs:
        if job.layer == layer:
            if not job.requests:
                return frozenset()
            out |= job.requests
    return frozenset(out)
