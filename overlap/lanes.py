"""The two lanes: `CpuLane` (worker threads) and `CudaLane` (worker threads + load stream).

A *unit* is the list of jobs issued by one `fetch_into` call: the scheduler issues one
unit per layer (all requests' jobs of that layer) or per layer group. A unit's fetches run
in order in ONE worker-thread call, so the per-unit overhead (a thread hand-off and one
event-loop wake-up) does not grow with the batch size.

cuda-python is imported lazily and torch.cuda is reached only through `overlap.device`:
this module imports on CPU-only machines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .base import JobCallback, JobFailure, LandedCallback, Landing, Lane, LayerJob, RequestId
from .device import CudaDevice, Device, DeviceEvent
from .notify import Completion, make_notifier


@dataclass(frozen=True, slots=True)
class _Issued:
    """The fields of a job as read at issue time (later mutations of the job are ignored)."""

    layer: int
    fetch: Callable[[], None]
    requests: frozenset[RequestId]
    h2d: tuple[tuple[Any, Any], ...]


def _snapshot(jobs: Sequence[LayerJob]) -> tuple[_Issued, ...]:
    if not jobs:
        raise ValueError("fetch_into needs at least one job")
    return tuple(_Issued(j.layer, j.fetch, j.requests, tuple(j.h2d or ())) for j in jobs)


def _run_fetches(
    unit: Sequence[_Issued], on_job: JobCallback | None = None
) -> tuple[Landing, list[_Issued]]:
    """Run every fetch of `unit` in order; return the landing and the jobs that landed.
    `on_job` (if any) hears of each job as soon as it returned or raised, and may stop
    the unit there."""
    started = time.perf_counter()
    failures: list[JobFailure] = []
    landed: list[_Issued] = []
    for job in unit:
        error: Exception | None = None
        try:
            job.fetch()
        except Exception as exc:  # recorded, re-raised to the forward by the readiness
            error = exc
            failures.append(JobFailure(job.layer, job.requests, exc))
        else:
            landed.append(job)
        if on_job is not None and on_job(job.layer, job.requests, error):
            break
    layers = tuple(sorted({j.layer for j in unit}))
    return Landing(layers, started, time.perf_counter(), tuple(failures)), landed


class CpuLane(Lane):
    """Fetches run in a bounded thread pool; a unit has landed when its fetches returned.

    The destination is host memory the fetch writes directly (the pool on CPU), so there
    is no device event: `Landing.event` and `Landing.device_done` are None. It streams
    jobs: `on_job` releases each layer as soon as its own fetch returned.
    """

    streams_jobs = True

    def __init__(self, max_workers: int = 2, *, name: str = "cpu") -> None:
        if not 1 <= max_workers <= 64:
            raise ValueError(f"max_workers must be in [1, 64], got {max_workers}")
        self.name = name
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=f"layerlift-{name}")

    def fetch_into(
        self,
        jobs: Sequence[LayerJob],
        on_landed: LandedCallback | None = None,
        on_job: JobCallback | None = None,
    ) -> asyncio.Future[Landing]:
        loop = asyncio.get_running_loop()
        unit = _snapshot(jobs)
        fut: asyncio.Future[Landing] = loop.create_future()
        self._pool.submit(_deliver, loop, fut, lambda: self._run(unit, on_landed, on_job))
        return fut

    @staticmethod
    def _run(
        unit: tuple[_Issued, ...], on_landed: LandedCallback | None, on_job: JobCallback | None
    ) -> Landing:
        landing, _ = _run_fetches(unit, on_job)
        try:
            if on_landed is not None:
                on_landed(landing)
        finally:
            _wait_for_timed_out_calls(landing)
        return landing

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaLane(Lane):
    """Fetches land in pinned host staging (worker threads), then H2D on a load stream.

    Per unit, after its fetches returned, the worker launches `dst.copy_(src,
    non_blocking=True)` for every `(host, device)` pair of the jobs that did not fail on
    `self.stream`, records one event on that same stream, and hands it to the completion
    notifier (see `overlap.notify`): `Landing.device_done` resolves on the loop once the
    copies finished, without polling. Launch + record + notifier registration happen
    under one lock, so events are recorded (and watched) in issue order.

    Every stream, event and copy goes through `self.device` (`overlap.device`): a
    `CudaDevice` in production, a simulated device in tests.

    Ownership: host tensors must be pinned (`alloc_staging`) and must not be reused, nor
    the device tensors freed, before `device_done` resolved. Device tensors allocated by
    torch's caching allocator on another stream should be long-lived pool memory.
    """

    def __init__(
        self,
        device: Device | str | Any = None,
        max_workers: int = 2,
        *,
        name: str = "cuda",
        completion: Completion = Completion.AUTO,
    ) -> None:
        if not 1 <= max_workers <= 64:
            raise ValueError(f"max_workers must be in [1, 64], got {max_workers}")
        if not isinstance(device, Device):
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("CudaLane needs a CUDA device; use CpuLane on this machine")
            device = CudaDevice(device)
        self.device: Device = device
        self.name = name
        self.stream = device.new_stream()
        self._notifier = make_notifier(completion, device.stream_handle(self.stream))
        self.completion = self._notifier.mode
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=f"layerlift-{name}")
        self._enqueue_lock = threading.Lock()

    def begin_load(self) -> None:
        """Order the load stream after everything already issued on this
        device's current stream (the caller's): the pool relocates pages with
        copies on that stream, and a load must not overwrite a page before
        the copy that vacated it ran. Costs one event, no host sync."""
        device = self.device
        with device.use():
            fence = device.event()
            fence.record(device.current_stream())
            fence.wait(self.stream)

    def alloc_staging(self, nbytes: int) -> Any:
        """A pinned host uint8 tensor of `nbytes` bytes for a fetch to land in."""
        return self.device.pinned(nbytes)

    def fetch_into(
        self,
        jobs: Sequence[LayerJob],
        on_landed: LandedCallback | None = None,
        on_job: JobCallback | None = None,
    ) -> asyncio.Future[Landing]:
        # Does not stream: a unit's H2D copies share one event (see class docstring).
        loop = asyncio.get_running_loop()
        unit = _snapshot(jobs)
        device_done: asyncio.Future[None] = loop.create_future()
        fut: asyncio.Future[Landing] = loop.create_future()
        run = lambda: self._run(unit, on_landed, loop, device_done)  # noqa: E731
        self._pool.submit(_deliver, loop, fut, run)
        return fut

    def _run(
        self,
        unit: tuple[_Issued, ...],
        on_landed: LandedCallback | None,
        loop: asyncio.AbstractEventLoop,
        device_done: asyncio.Future[None],
    ) -> Landing:
        landing, landed = _run_fetches(unit)
        pairs = [pair for job in landed for pair in job.h2d]
        if pairs:
            with self._enqueue_lock:
                self.device.launch(self.stream, lambda: _copy_pairs(pairs))
                event = self._record_landing()
                self._notifier.notify(event, _resolver(loop, device_done))
            landing.event = event
            landing.device_done = device_done
        try:
            if on_landed is not None:
                on_landed(landing)
        finally:
            _wait_for_timed_out_calls(landing)
        return landing

    def _record_landing(self) -> DeviceEvent:
        """The unit's event, recorded on the load stream right after its copies
        (blocking: the watcher's synchronize() sleeps instead of spinning)."""
        event = self.device.event(blocking=True)
        event.record(self.stream)
        return event

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._notifier.close()


def _copy_pairs(pairs: Sequence[tuple[Any, Any]]) -> None:
    for host, dev in pairs:
        dev.copy_(host, non_blocking=True)


def _wait_for_timed_out_calls(landing: Landing) -> None:
    """A fetch that timed out may still write into its destination (a store
    call goes on after its caller stopped waiting; see `StoreTimeout`). Its
    failure has been reported; the unit's thread returns only once every such
    call really ended, so whoever waits for this thread may free the memory."""
    for failure in landing.failures:
        wait = getattr(failure.error, "wait_finished", None)
        if callable(wait) and not getattr(failure.error, "owned", False):
            wait()  # (a fetch that took over the call's memory marked it owned)


def _deliver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Landing], run: Callable[[], Landing]
) -> None:
    """Worker thread: run a unit and hand its outcome to `fut` with one loop wake-up.

    (Cheaper than `asyncio.wrap_future`, which costs extra loop iterations per unit.)
    """
    try:
        outcome: Landing | Exception = run()
    except Exception as exc:  # only `on_landed` can raise here; fetch errors are recorded
        outcome = exc
    try:
        loop.call_soon_threadsafe(_settle, fut, outcome)
    except RuntimeError:
        # Loop closed: nobody awaits this unit any more.
        return


def _settle(fut: asyncio.Future[Landing], outcome: Landing | Exception) -> None:
    if fut.done():
        return
    if isinstance(outcome, Exception):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> Callable[[], None]:
    def resolve() -> None:
        try:
            loop.call_soon_threadsafe(_set_if_pending, fut)
        except RuntimeError:
            # Loop closed: nobody awaits this future any more.
            return

    return resolve


def _set_if_pending(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
