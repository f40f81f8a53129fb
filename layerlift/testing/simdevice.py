"""A simulated accelerator whose streams really run late: CUDA's ordering rules on the CPU.

:class:`SimDevice` implements the device seam (``layerlift.overlap.device.Device``) with
tensors in host memory. Each stream is a worker thread that runs its queued work in
issue order, each piece after a random delay drawn from a seeded generator. Exactly
the rules of ``overlap/device.py`` order anything, so a missing wait, a missing fence,
an event recorded on the wrong stream or a stale copy plan gives wrong bytes:

* ``launch(stream, work)`` queues ``work``; ``event.record(stream)`` completes when the
  stream's worker reaches it; ``event.wait(stream)`` queues a wait: later work of that
  stream starts only once the event completed;
* the *default* stream is the host's: work a thread does synchronously with that
  stream current (the CPU forward, the offloader's gather) counts as the default
  stream's. So ``event.wait(default)`` blocks the calling thread until the event
  completed, and entering ``use()`` on the default stream (or waiting on it) first
  drains what was queued on it;
* the pool's relocation copies (``pools/``: plain torch calls on the caller's current
  stream, the default one) happen eagerly on the host, but the sim queues each copy
  again on the default stream (after ``relocation_delay_s``): when the stream reaches
  it, if another stream wrote into the page's old place or its new place meanwhile,
  the new place receives the old place's bytes as they are *now*, as on a GPU where
  the copy runs late (a load that overtook it is overwritten, or its bytes are
  carried along);
* ``pinned`` staging starts filled with a poison byte, so rows nobody fetched are
  not zeros;
* ``hold(gate)`` keeps every non-default stream from starting work until ``gate`` is
  set, at most 30 s (a test orders "the load lands after the forward" with it, never
  with sleeps).

Tests must call :meth:`SimDevice.synchronize` before reading or zeroing the pool from
the test thread (as they would ``torch.cuda.synchronize``), and :meth:`close` at the end.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from layerlift.overlap.device import Device, DeviceEvent, bind

__all__ = ["POISON", "SimDevice", "SimEvent", "SimStream", "block_stream"]

POISON = 0xCD
"""The byte fresh pinned staging holds."""


class _Marker:
    """One recording of an event: completes when its stream reaches it."""

    __slots__ = ("done", "time")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.time = 0.0

    def complete(self) -> None:
        self.time = time.perf_counter()
        self.done.set()


_Item = tuple[str, Any]


class SimStream:
    """A stream: one worker thread running its queued items in order."""

    def __init__(self, device: SimDevice, name: str, seed: int, max_delay_s: float) -> None:
        self.device, self.name = device, name
        self._rng = random.Random(seed)
        self._max_delay = max_delay_s
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._issued = 0
        self._ran = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"simdevice-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"SimStream({self.name})"

    def submit(self, kind: str, payload: Any) -> None:
        with self._cond:
            if self.device.closed:
                raise RuntimeError(f"{self!r}: the simulated device is closed")
            self._issued += 1
            self._queue.put((kind, payload))

    def drain(self) -> None:
        """Block until every item issued so far ran."""
        with self._cond:
            target = self._issued
            while self._ran < target:
                self._cond.wait()
        if self.error is not None:
            raise RuntimeError(f"{self!r}: queued work raised") from self.error

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            try:
                if kind == "work":
                    self.device._before_work(self)
                    delay = self._rng.uniform(0.0, self._max_delay)
                    if delay:
                        time.sleep(delay)  # the simulated device's latency
                    payload()
                elif kind == "record":
                    payload.complete()
                elif kind == "wait":
                    payload.done.wait()
            except BaseException as exc:  # kept, raised by the next drain/synchronize
                self.error = exc
            with self._cond:
                self._ran += 1
                self._cond.notify_all()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class SimEvent:
    """A device event (see the module rules); never recorded counts as complete."""

    def __init__(self, device: SimDevice, timing: bool) -> None:
        self._device, self._timing = device, timing
        self._marker: _Marker | None = None

    def record(self, stream: Any = None) -> None:
        target = self._device._stream(stream)
        marker = _Marker()
        self._marker = marker
        target.submit("record", marker)

    def wait(self, stream: Any = None) -> None:
        target = self._device._stream(stream)
        marker = self._marker
        if marker is None:
            return
        if target is self._device.default:
            marker.done.wait()  # host work is the default stream's
            target.drain()
        else:
            target.submit("wait", marker)

    def query(self) -> bool:
        return self._marker is None or self._marker.done.is_set()

    def synchronize(self) -> None:
        if self._marker is not None:
            self._marker.done.wait()

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event's and ``end_event``'s completions."""
        if not (self._timing and isinstance(end_event, SimEvent) and end_event._timing):
            raise RuntimeError("elapsed_time needs two events created with timing=True")
        if self._marker is None or end_event._marker is None:
            raise RuntimeError("elapsed_time needs two recorded events")
        if not (self._marker.done.is_set() and end_event._marker.done.is_set()):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return (end_event._marker.time - self._marker.time) * 1e3


@dataclass(eq=False)
class _Relocation:
    """One relocation copy whose read of ``src`` the default stream has not reached."""

    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # src, dst, bytes moved
    ranges: list[tuple[int, int]]  # the byte ranges of every source and destination
    settled: list[bool] = field(default_factory=list)


class SimDevice(Device):
    """The simulated device (see the module docstring).

    ``seed`` draws every stream's delays; ``max_delay_s`` bounds the delay before each
    piece of queued work; ``relocation_delay_s`` (default ``max_delay_s``) bounds the
    delay before the default stream reads a relocation's source.
    """

    def __init__(self, seed: int = 0, *, max_delay_s: float = 0.002,
                 relocation_delay_s: float | None = None) -> None:
        if max_delay_s < 0 or (relocation_delay_s is not None and relocation_delay_s < 0):
            raise ValueError("the simulated delays must be >= 0 seconds")
        self.torch_device = torch.device("cpu")
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.closed = False
        self._lock = threading.Lock()
        self._local = threading.local()
        self._streams: list[SimStream] = []
        self._gate: threading.Event | None = None
        self._pending: list[_Relocation] = []
        self._buffer: torch.Tensor | None = None
        self.relocations = 0
        self.relocation_hazards = 0
        reloc = max_delay_s if relocation_delay_s is None else relocation_delay_s
        self.default = self._add_stream("default", reloc)

    def _add_stream(self, name: str, delay: float) -> SimStream:
        with self._lock:
            stream = SimStream(self, f"{name}{len(self._streams)}",
                               self.seed * 7919 + len(self._streams), delay)
            self._streams.append(stream)
        return stream

    def _stream(self, stream: Any) -> SimStream:
        if stream is None:
            return self.current_stream()  # type: ignore[no-any-return]
        if not isinstance(stream, SimStream) or stream.device is not self:
            raise ValueError(f"{stream!r} is not a stream of this simulated device")
        return stream

    # ---- the seam --------------------------------------------------------------
    def new_stream(self) -> Any:
        return self._add_stream("stream", self.max_delay_s)

    def current_stream(self) -> Any:
        return getattr(self._local, "stream", None) or self.default

    def event(self, *, timing: bool = False, blocking: bool = False) -> DeviceEvent:
        return SimEvent(self, timing)

    @contextmanager
    def use(self, stream: Any = None) -> Iterator[Any]:
        chosen = self._stream(stream)
        before = getattr(self._local, "stream", None)
        self._local.stream = chosen
        try:
            if chosen is self.default:
                chosen.drain()  # the host's work follows what the stream queued
            yield chosen
        finally:
            self._local.stream = before

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        self._stream(stream).submit("work", work)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def to_host(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        self._stream(None).drain()
        return torch.cat(list(views)).clone()

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.drain()

    def attach_pool(self, pool: Any) -> None:
        """Bind the pool's buffer and watch its relocations (see the module rules)."""
        bind(pool.buffer, self)
        self._buffer = pool.buffer
        pool.add_move_listener(lambda c, old, new: self._on_move(pool, c, old, new))

    # ---- test controls ----------------------------------------------------------
    def hold(self, gate: threading.Event | None) -> None:
        """Non-default streams start no work until ``gate`` is set (None: release)."""
        self._gate = gate

    def close(self) -> None:
        """Drain and stop every stream. Idempotent."""
        if self.closed:
            return
        self._gate = None
        self.synchronize()
        self.closed = True
        for stream in self._streams:
            stream.stop()

    # ---- internals ---------------------------------------------------------------
    def _before_work(self, stream: SimStream) -> None:
        gate = self._gate
        if gate is not None and stream is not self.default:
            gate.wait(30.0)

    def _on_move(self, pool: Any, component: Any, old: torch.Tensor, new: torch.Tensor) -> None:
        pb = pool.page_bytes(component)
        pairs, ranges = [], []
        for o, n in zip(old.tolist(), new.tolist(), strict=True):
            src, dst = pool.page_view(component, o), pool.page_view(component, n)
            pairs.append((src, dst, dst.clone()))
            ranges += [(o * pb, (o + 1) * pb), (n * pb, (n + 1) * pb)]
        dst_ranges = [(n * pb, (n + 1) * pb) for n in new.tolist()]
        reloc = _Relocation(pairs, ranges, [False] * len(pairs))
        with self._lock:
            # A later relocation writing into a pending one's source or destination
            # is queued after it on the same stream: the earlier copy ran first, and
            # the eager bytes are what the stream would leave.
            for pending in self._pending:
                for i, (lo, hi) in enumerate(pending.ranges):
                    if any(lo < b and a < hi for a, b in dst_ranges):
                        pending.settled[i // 2] = True
            self._pending.append(reloc)
            self.relocations += 1
        self.default.submit("work", lambda: self._read_sources(reloc))

    def _read_sources(self, reloc: _Relocation) -> None:
        """The default stream reaches a relocation copy: it copies its sources now."""
        with self._lock:
            self._pending.remove(reloc)
            for i, (src, dst, moved) in enumerate(reloc.pairs):
                if reloc.settled[i]:
                    continue
                if not (torch.equal(src, moved) and torch.equal(dst, moved)):
                    dst.copy_(src)  # another stream touched the page before this copy
                    self.relocation_hazards += 1


def block_stream(device: SimDevice, stream: Any, timeout_s: float = 30.0) -> threading.Event:
    """Hold ``stream`` until the returned event is set: a blocker queued on it,
    returned once it started (so everything queued after it runs late). The
    blocker fails its stream if nobody sets the event within ``timeout_s``."""
    go, started = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        if not go.wait(timeout_s):
            raise TimeoutError(f"the blocker on {stream!r} was never released")

    device.launch(stream, work)
    if not started.wait(timeout_s):
        raise TimeoutError(f"the blocker on {stream!r} never started")
    return go
