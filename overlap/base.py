"""Interfaces of the overlap package: jobs, lanes, readiness views, errors, policies.

`overlap/` moves bytes for *layers*; it does not know trees, pools or stores. A load
is a list of `LayerJob`s (one or more per layer, each a blocking `fetch` callable that
writes bytes into memory someone else owns), a `Lane` that runs them (CPU worker
threads, or CPU threads + an H2D copy on a CUDA load stream), and a readiness object
through which the forward waits for layer `l` only.

Threads and loops:
  * the scheduler and `Lane.fetch_into` live on the asyncio event loop;
  * fetch callables run in the lane's worker threads, never on the loop;
  * the forward runs in its own thread and only calls `ReadinessView.wait`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

RequestId = Hashable
"""A request id: anything hashable that the engine chooses (int, str, ...)."""


class LoadPolicy(enum.Enum):
    """When the layers of a batch become visible to the forward.

    BARRIER: every layer is marked done only after the whole batch landed (the forward,
        which waits on layer 0 first, cannot start earlier; SGLang's hybrid behaviour).
    OVERLAP: each layer is marked done as soon as its bytes landed.
    GROUPS: layers are fetched in groups of `group_size` (one worker-thread call per
        group, fewer and larger transfers) and a group's layers are marked done together.
    """

    BARRIER = "barrier"
    OVERLAP = "overlap"
    GROUPS = "groups"

    @classmethod
    def parse(cls, text: str) -> LoadPolicy:
        """`"overlap"` -> `LoadPolicy.OVERLAP`; ValueError listing the choices otherwise."""
        try:
            return cls(text.strip().lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown load policy {text!r}; choose one of: {choices}") from None


class LayerLoadError(Exception):
    """The load of `layer` failed (or was cancelled) for `requests`.

    Attributes:
        layer: the layer whose load failed. Waiting on a later layer of the same requests
            raises the same error object (a failure at layer k fails k and all later layers).
        cause: the exception raised by the fetch, or None for a cancellation. It is also
            chained as `__cause__`.
        requests: the request ids affected; an empty frozenset means "every request of the
            batch".
    """

    def __init__(
        self,
        layer: int,
        cause: BaseException | None,
        requests: frozenset[RequestId] = frozenset(),
        message: str | None = None,
    ) -> None:
        who = "all requests" if not requests else f"requests {sorted(map(repr, requests))}"
        text = message or f"layer {layer} load failed for {who}: {cause!r}"
        super().__init__(text)
        self.layer = layer
        self.cause = cause
        self.requests = requests
        self.__cause__ = cause

    def affects(self, requests: frozenset[RequestId] | None) -> bool:
        """True when this failure concerns any of `requests` (None: any request at all)."""
        return not self.requests or requests is None or not self.requests.isdisjoint(requests)


class LayerLoadCancelled(LayerLoadError):
    """The layer was never loaded because its load was cancelled (`cause` is None) or an
    earlier layer failed (`cause` is that layer's error)."""


class LayerWaitTimeout(TimeoutError):
    """`wait(layer, timeout=...)` gave up: the layer was neither done nor failed in time.

    Nothing is changed by the timeout: the load goes on and a later wait may succeed.
    """

    def __init__(self, layer: int, timeout: float) -> None:
        super().__init__(f"layer {layer} not ready after {timeout:.3f} s")
        self.layer = layer
        self.timeout = timeout


class DeviceEvent(Protocol):
    """The part of `torch.cuda.Event` that overlap uses (a structural type, so CPU-only
    code never imports torch.cuda)."""

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@dataclass(slots=True, eq=False)
class LayerJob:
    """One fetch for one layer of a batch.

    The engine may mutate a job (e.g. trim `fetch`'s page list at COMMIT) until the
    scheduler *issues* it: a lane reads `fetch`, `nbytes`, `requests` and `h2d` only in
    `Lane.fetch_into`, on the event loop. `layer` must not change after `start()`.

    Attributes:
        layer: layer index in [0, num_layers).
        fetch: blocking callable run in a worker thread; writes the layer's bytes into
            memory the caller owns (host staging on CUDA, the pool directly on CPU) and
            raises on failure. It must not touch the event loop.
        nbytes: bytes it moves (timings and link emulation only).
        requests: request ids whose data this job carries; empty means all of the batch.
            A failure of this job fails the layer (and later layers) for these requests.
        h2d: CUDA only: (pinned host tensor, device tensor) pairs copied after `fetch`
            returns, on the lane's load stream. None on CPU.
    """

    layer: int
    fetch: Callable[[], None]
    nbytes: int = 0
    requests: frozenset[RequestId] = frozenset()
    h2d: list[tuple[Any, Any]] | None = None

    def __post_init__(self) -> None:
        if self.layer < 0:
            raise ValueError(f"LayerJob.layer must be >= 0, got {self.layer}")
        if self.nbytes < 0:
            raise ValueError(f"LayerJob.nbytes must be >= 0, got {self.nbytes}")


@dataclass(frozen=True, slots=True)
class JobFailure:
    """A job of a unit whose fetch raised: the layer, its requests, the exception."""

    layer: int
    requests: frozenset[RequestId]
    error: BaseException


@dataclass(slots=True)
class Landing:
    """What `Lane.fetch_into` reports for one unit (a list of jobs run in one thread call).

    Attributes:
        layers: the distinct layers of the unit, ascending.
        started / finished: `time.perf_counter()` when the worker began / when the last
            fetch returned (host side; H2D copies are then enqueued, not finished).
        failures: jobs whose fetch raised; the other jobs landed.
        event: CUDA only, recorded on the load stream after the unit's H2D copies; None
            on CPU (or when the unit had no copy).
        device_done: CUDA only: resolves on the loop once `event` completed on the device
            (no busy polling). None when nothing is outstanding on the device.
    """

    layers: tuple[int, ...]
    started: float = 0.0
    finished: float = 0.0
    failures: tuple[JobFailure, ...] = ()
    event: DeviceEvent | None = None
    device_done: asyncio.Future[None] | None = field(default=None)


LandedCallback = Callable[[Landing], None]
JobCallback = Callable[[int, frozenset[RequestId], BaseException | None], bool]
"""``on_job(layer, requests, error)``: called in the worker thread right after one
job's fetch returned (``error`` None) or raised, before the unit's next job runs.
Returning True stops the unit: its remaining jobs are not run (the callback's owner
marks them)."""


class Lane(ABC):
    """Runs fetch jobs off the event loop and lands their bytes where the forward reads.

    Ownership: the lane owns its worker threads (and on CUDA its load stream); the jobs'
    destination memory belongs to the caller, who must keep it alive until the unit's
    future resolved *and* `Landing.device_done` (if any) resolved.
    Thread-safety: `fetch_into` must be called on the event loop thread; `close` from
    any thread once no unit is outstanding.
    """

    name: str
    streams_jobs: bool = False
    """True when ``fetch_into`` honours ``on_job`` (a layer can be released while
    later layers of the same unit still load)."""

    @abstractmethod
    def fetch_into(
        self,
        jobs: Sequence[LayerJob],
        on_landed: LandedCallback | None = None,
        on_job: JobCallback | None = None,
    ) -> asyncio.Future[Landing]:
        """Issue `jobs` as one unit: run their fetches in order in one worker-thread call.

        The job fields are read here, synchronously (this is the "issue" moment).
        A fetch that raises is recorded in `Landing.failures`; the unit's other jobs
        still run, and the returned future never carries a fetch's exception.
        `on_landed`, if given, runs in the worker thread right after the unit landed
        (CPU: fetches returned; CUDA: H2D enqueued and `event` recorded), before the
        future resolves: use it to release the forward without an event-loop hop.
        Exceptions raised by `on_landed` propagate through the future. `on_job`, where
        the lane `streams_jobs`, runs after each job (see `JobCallback`); other lanes
        ignore it.

        Cancelling the returned future does not stop the unit (a running fetch cannot be
        interrupted); it only discards the result. Callers that need quiescence keep
        their own count of issued units.
        """

    def begin_load(self) -> None:
        """Called on the event loop before a load's first unit is issued:
        order the lane's device copies after work already queued by the
        caller (CUDA: relocation copies on the current stream). CPU: nothing."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources. Idempotent."""


class ReadinessView(Protocol):
    """The consumer side of per-layer readiness (`LayerReadiness`, `CombinedReadiness`)."""

    @property
    def num_layers(self) -> int: ...

    def wait(
        self,
        layer: int,
        timeout: float | None = None,
        *,
        requests: frozenset[RequestId] | None = None,
        stream: Any = None,
    ) -> None: ...

    async def ready(
        self,
        layer: int,
        *,
        requests: frozenset[RequestId] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- a default deadline: no wait is unbounded
    ) -> None: ...

    def done(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool: ...

    def failed(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool: ...

    def failed_requests(self) -> frozenset[RequestId]: ...
