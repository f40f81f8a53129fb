"""Per-layer readiness of one batch: the producer marks layers, the forward waits on them.

One `_Entry` per layer holds: `done` (the forward may consume the layer; on CUDA the H2D
copy is *recorded*, its event stored), `landed` (the bytes are in place, device copy
included), and the failures affecting the layer, each with the request set it concerns.
A layer failed for some requests is still done for the others.

All state changes happen under one lock with one `threading.Condition` per layer, so a
producer in any thread wakes exactly that layer's waiters. The forward's fast path (layer
already done, no failure) reads two attributes without the lock and allocates nothing:
`done` only goes False -> True and failures are only appended, so a racy read can only
see an older state, which is then re-checked under the lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .base import DeviceEvent, LayerLoadCancelled, LayerLoadError, LayerWaitTimeout, RequestId

DEFAULT_WAIT_TIMEOUT_S = 60.0


class _Entry:
    __slots__ = ("cond", "done", "errors", "event", "landed", "waiters")

    def __init__(self, lock: threading.Lock) -> None:
        self.done = False
        self.landed = False
        self.event: DeviceEvent | None = None
        self.errors: list[LayerLoadError] = []
        self.cond = threading.Condition(lock)
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def error_for(self, requests: frozenset[RequestId] | None) -> LayerLoadError | None:
        for err in self.errors:
            if err.affects(requests):
                return err
        return None


def check_layer(layer: int, num_layers: int) -> None:
    """``ValueError`` unless ``layer`` is a layer index in ``[0, num_layers)``."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer!r} is not a layer of this model: it has "
                         f"{num_layers} layers, numbered 0 to {num_layers - 1}")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class LayerReadiness:
    """Readiness of `num_layers` layers of one batch of `requests`.

    Producer side (any thread): `mark_done`, `mark_landed`, `mark_failed`, `cancel`.
    Consumer side: `wait` (blocking, forward thread), `await ready` (event loop),
    `done` / `failed` / `failed_requests` / `all_done` (non-blocking, any thread).
    Waits never block forever: `wait` uses `default_timeout` unless told otherwise.
    """

    def __init__(
        self,
        num_layers: int,
        *,
        requests: frozenset[RequestId] = frozenset(),
        default_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"LayerReadiness needs at least one layer, got {num_layers}")
        if default_timeout <= 0:
            raise ValueError(f"default_timeout must be > 0 seconds, got {default_timeout}")
        self._lock = threading.Lock()
        self._entries = [_Entry(self._lock) for _ in range(num_layers)]
        self._timeout = default_timeout
        self.requests = frozenset(requests)

    @property
    def num_layers(self) -> int:
        return len(self._entries)

    def _index(self, layer: int) -> int:
        """``layer`` if it names a layer of this readiness, else ``ValueError``
        (a negative index would silently mean a layer from the end)."""
        check_layer(layer, len(self._entries))
        return layer

    def _entry(self, layer: int) -> _Entry:
        return self._entries[self._index(layer)]

    # ---- producer side -------------------------------------------------------------

    def mark_done(self, layer: int, event: DeviceEvent | None = None) -> None:
        """Layer `layer` may be consumed by the forward. Idempotent.

        Without `event` the bytes are in place (also `landed`). With a device `event`
        (`overlap.device`: recorded on the load stream after the layer's H2D copy)
        `wait` makes the caller's stream wait on it; call `mark_landed` once it
        completed.
        """
        e = self._entry(layer)
        with self._lock:
            if e.done:
                return
            e.event = event
            e.done = True
            e.landed = event is None
            waiters = self._wake(e)
        self._notify_loops(waiters)

    def mark_landed(self, layer: int) -> None:
        """The device copy recorded by `mark_done(layer, event)` completed. Idempotent."""
        e = self._entry(layer)
        with self._lock:
            if not e.done:
                raise RuntimeError(f"mark_landed({layer}) before mark_done({layer})")
            e.landed = True
            waiters = self._wake(e)
        self._notify_loops(waiters)

    def mark_failed(
        self,
        layer: int,
        exc: BaseException,
        requests: Iterable[RequestId] | None = None,
    ) -> LayerLoadError:
        """Fail `layer` and every later layer for `requests` (None: the whole batch).

        `exc` becomes the `cause` of a new `LayerLoadError`, unless it already is one (it
        is then stored as is). Layers already done stay done for other requests.
        Returns the stored error.
        """
        reqs = self.requests if requests is None else frozenset(requests)
        err = exc if isinstance(exc, LayerLoadError) else LayerLoadError(layer, exc, reqs)
        waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        with self._lock:
            for e in self._entries[self._index(layer):]:
                e.errors.append(err)
                waiters += self._wake(e)
        self._notify_loops(waiters)
        return err

    def cancel(self, reason: str = "load cancelled") -> None:
        """Fail every layer not yet done, for all requests, with `LayerLoadCancelled`."""
        waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        with self._lock:
            for layer, e in enumerate(self._entries):
                if not e.done:
                    e.errors.append(LayerLoadCancelled(layer, None, self.requests, reason))
                    waiters += self._wake(e)
        self._notify_loops(waiters)

    def _wake(self, e: _Entry) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        # Caller holds the lock.
        e.cond.notify_all()
        waiters, e.waiters = e.waiters, []
        return waiters

    @staticmethod
    def _notify_loops(
        waiters: Sequence[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]],
    ) -> None:
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                # The waiter's loop is closed: nobody can await that future any more.
                continue

    # ---- consumer side -------------------------------------------------------------

    def wait(
        self,
        layer: int,
        timeout: float | None = None,
        *,
        requests: frozenset[RequestId] | None = None,
        stream: Any = None,
    ) -> None:
        """Block until `layer` is done, then (on a device) make `stream` (None:
        the calling thread's current stream) wait on its event: the forward's
        later work is ordered after the layer's H2D copies (`overlap.device`).

        Raises `LayerLoadError` if the layer failed for any of `requests` (None: for any
        request), `LayerWaitTimeout` after `timeout` seconds (None: the default timeout).
        Never synchronises the host with the GPU. Safe from any thread but the event
        loop's (it blocks).
        """
        e = self._entry(layer)
        if not (e.done and not e.errors):
            self._wait_slow(e, layer, self._timeout if timeout is None else timeout, requests)
        if e.event is not None:
            e.event.wait(stream)

    def _wait_slow(
        self, e: _Entry, layer: int, timeout: float, requests: frozenset[RequestId] | None
    ) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                err = e.error_for(requests)
                if err is not None:
                    raise err
                if e.done:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LayerWaitTimeout(layer, timeout)
                e.cond.wait(remaining)

    async def ready(
        self,
        layer: int,
        *,
        requests: frozenset[RequestId] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- a default deadline: no wait is unbounded
    ) -> None:
        """Resolve once `layer` has *landed* (device copy complete on CUDA).

        Raises `LayerLoadError` as `wait` does, `LayerWaitTimeout` after `timeout`
        seconds (None: the default timeout), so an await never blocks forever.
        Cancelling the awaiting task just removes its waiter.
        """
        total = self._timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(total):
                await self._ready(layer, requests)
        except TimeoutError:
            raise LayerWaitTimeout(layer, total) from None

    async def _ready(self, layer: int, requests: frozenset[RequestId] | None) -> None:
        e = self._entry(layer)
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                err = e.error_for(requests)
                if err is not None:
                    raise err
                if e.landed:
                    return
                fut: asyncio.Future[None] = loop.create_future()
                e.waiters.append((loop, fut))
            try:
                await fut
            finally:
                with self._lock:
                    if (loop, fut) in e.waiters:
                        e.waiters.remove((loop, fut))

    def done(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool:
        """True when `wait(layer, requests=requests)` would return without blocking."""
        e = self._entry(layer)
        with self._lock:
            return e.done and e.error_for(requests) is None

    def failed(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool:
        """True when `wait(layer, requests=requests)` would raise `LayerLoadError`."""
        e = self._entry(layer)
        with self._lock:
            return e.error_for(requests) is not None

    def error(
        self, layer: int, *, requests: frozenset[RequestId] | None = None
    ) -> LayerLoadError | None:
        """The first failure of `layer` affecting `requests`, or None."""
        e = self._entry(layer)
        with self._lock:
            return e.error_for(requests)

    def failed_requests(self) -> frozenset[RequestId]:
        """Union of the requests of every failure (a whole-batch failure names `requests`)."""
        with self._lock:
            out: set[RequestId] = set()
            for e in self._entries:
                for err in e.errors:
                    out |= err.requests or self.requests
            return frozenset(out)

    def all_done(self) -> bool:
        """Every layer done and no failure at all."""
        with self._lock:
            return all(e.done and not e.errors for e in self._entries)

    def settled(self) -> bool:
        """Every layer is done or failed for some request (nothing left to wait for)."""
        with self._lock:
            return all(e.done or e.errors for e in self._entries)
