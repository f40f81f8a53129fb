"""Small real fakes for overlap tests: a recording fetcher with gates, a forward thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from layerlift.overlap import LayerJob, LayerLoadError, ReadinessView, RequestId

WAIT_S = 10.0  # upper bound for any event a test waits on; never reached when correct


class Events(dict[int, threading.Event]):
    """One event a layer, made by whichever thread asks first. Not a
    ``defaultdict(threading.Event)``: there the test's thread and a worker
    asking for a missing layer at once could each make their own event, one
    waiting on an event the other never sets; ``setdefault`` keeps one."""

    def __missing__(self, layer: int) -> threading.Event:
        return self.setdefault(layer, threading.Event())


class FetchRecorder:
    """Makes `LayerJob`s whose fetch logs start/end, counts concurrency, may block or fail.

    `gate(l)` returns an Event that layer l's fetch waits on (the test opens it);
    `fail(l, exc)` makes layer l's fetches raise `exc` (after any gate) for jobs whose
    requests intersect `only` (None: all of them).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, int, float]] = []
        self.active = 0
        self.max_active = 0
        self.gates: dict[int, threading.Event] = {}
        self.started = Events()
        self.ended = Events()
        self.failures: dict[int, tuple[Exception, frozenset[RequestId] | None]] = {}

    def gate(self, layer: int) -> threading.Event:
        return self.gates.setdefault(layer, threading.Event())

    def fail(self, layer: int, exc: Exception, only: frozenset[RequestId] | None = None) -> None:
        self.failures[layer] = (exc, only)

    def job(self, layer: int, requests: frozenset[RequestId] = frozenset()) -> LayerJob:
        return LayerJob(layer, self.fetch_fn(layer, requests), 0, requests)

    def jobs(
        self, num_layers: int, requests: tuple[frozenset[RequestId], ...] = (frozenset(),)
    ) -> list[LayerJob]:
        return [self.job(layer, r) for layer in range(num_layers) for r in requests]

    def fetch_fn(self, layer: int, requests: frozenset[RequestId]) -> Callable[[], None]:
        def fetch() -> None:
            with self.lock:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                self.log.append(("start", layer, time.perf_counter()))
            self.started[layer].set()
            try:
                gate = self.gates.get(layer)
                if gate is not None:
                    assert gate.wait(WAIT_S), f"gate of layer {layer} never opened"
                failure = self.failures.get(layer)
                if failure is not None and (failure[1] is None or failure[1] & requests):
                    raise failure[0]
            finally:
                with self.lock:
                    self.active -= 1
                    self.log.append(("end", layer, time.perf_counter()))
                self.ended[layer].set()

        return fetch

    def started_layers(self) -> set[int]:
        with self.lock:
            return {layer for kind, layer, _ in self.log if kind == "start"}

    def last_end(self) -> float:
        with self.lock:
            return max(t for kind, _, t in self.log if kind == "end")


class ForwardThread(threading.Thread):
    """A simulated forward: for each layer, `wait(l)` then record "ran l" (with a time).

    `ran_event[l]` is set once layer l ran. `early` lists layers that started while
    `is_loaded(l)` was False (must stay empty). Stops at the first LayerLoadError.
    """

    def __init__(
        self,
        readiness: ReadinessView,
        is_loaded: Callable[[int], bool] | None = None,
        requests: frozenset[RequestId] | None = None,
    ) -> None:
        super().__init__(name="fake-forward", daemon=True)
        self.readiness = readiness
        self.is_loaded = is_loaded
        self.requests = requests
        self.ran: list[tuple[int, float]] = []
        self.ran_event = Events()
        self.early: list[int] = []
        self.error: LayerLoadError | None = None

    def run(self) -> None:
        for layer in range(self.readiness.num_layers):
            try:
                self.readiness.wait(layer, WAIT_S, requests=self.requests)
            except LayerLoadError as exc:
                self.error = exc
                return
            if self.is_loaded is not None and not self.is_loaded(layer):
                self.early.append(layer)
            self.ran.append((layer, time.perf_counter()))
            self.ran_event[layer].set()

    def layers_run(self) -> list[int]:
        return [layer for layer, _ in self.ran]


async def until(event: threading.Event) -> None:
    """Await a threading.Event without blocking the event loop."""
    assert await asyncio.to_thread(event.wait, WAIT_S), "event never set"
