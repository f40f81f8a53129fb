"""Negative controls: wrappers that break correctness on purpose.

A test that passes with a control switched on proves nothing; each control
here must make a restore inexact, and the tests check that it does. They
live outside the engine: production code never consults them.

* :class:`FaultyModel` (not a control: a fault) makes the forward raise or
  block before a chosen layer.
* :class:`SkipLayerWaits` wraps a model so that its forward does not call
  the engine's per-layer wait (the forward may read layers that have not
  landed). Switch it with ``enabled``.
* ``FaultyStore.skip_reads(component)`` (in :mod:`.faults`) makes the ranged
  reads of one component return without writing a byte: the recurrent state
  (or a KV kind) is "restored" from whatever the slots held.
* :class:`UnfencedLoads` drops a ``CudaLane``'s fence at the start of each
  load (the load stream is no longer ordered after the relocation copies);
  :class:`WrongStreamEvents` records a ``CudaLane``'s per-unit events on the
  worker's current stream instead of the load stream. Both show on the
  simulated device (:mod:`.simdevice`), where streams really run late.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from layerlift.overlap.device import device_of

__all__ = [
    "FaultyModel",
    "InjectedForwardError",
    "SkipLayerWaits",
    "UnfencedLoads",
    "WrongStreamEvents",
    "spy_lock_wait",
]


class SkipLayerWaits:
    """A model wrapper whose forward skips the engine's per-layer waits while
    ``enabled``; every other attribute is the wrapped model's.

    ``forward_done`` is set each time a forward without waits returned (on
    CUDA once its kernels ran), so a test can hold a layer's read back until
    then and show that the forward read a layer that never landed."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.enabled = False
        self.forward_done = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, requests: Any, pool: Any, before_layer: Any, after_layer: Any) -> Any:
        if not self.enabled:
            return self.inner.forward_batch(requests, pool, before_layer, after_layer)
        try:
            return self.inner.forward_batch(requests, pool, _no_wait, after_layer)
        finally:
            buffer = getattr(pool, "buffer", None)
            device = device_of(buffer) if buffer is not None else None
            if device is not None:  # the forward's kernels ran
                device.synchronize()
            self.forward_done.set()


def _no_wait(layer: int) -> None:
    return None


class InjectedForwardError(RuntimeError):
    """What :class:`FaultyModel` raises inside the forward."""


class FaultyModel:
    """A model wrapper whose forward fails or blocks before a chosen layer.

    ``fail_at(layer)``: the forward raises :class:`InjectedForwardError` just
    before computing ``layer`` (after the engine's wait for it). ``gate_at(layer,
    event)``: it blocks there until ``event`` is set (``reached`` is set when it
    does), so a test can cancel the engine while the forward runs. ``clear()``
    undoes both. Every other attribute is the wrapped model's.
    """

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.fail_layer: int | None = None
        self.gate_layer: int | None = None
        self.gate: threading.Event | None = None
        self.reached = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fail_at(self, layer: int) -> None:
        self.fail_layer = layer

    def gate_at(self, layer: int, gate: threading.Event) -> None:
        self.gate_layer, self.gate = layer, gate
        self.reached.clear()

    def clear(self) -> None:
        self.fail_layer = self.gate_layer = None
        self.gate = None

    def forward_batch(self, requests: Any, pool: Any, before_layer: Any, after_layer: Any) -> Any:
        def before(layer: int) -> None:
            before_layer(layer)
            if layer == self.gate_layer and self.gate is not None:
                self.reached.set()
                if not self.gate.wait(60.0):
                    raise InjectedForwardError(f"forward gate at layer {layer} never opened")
            if layer == self.fail_layer:
                raise InjectedForwardError(f"injected forward failure at layer {layer}")

        return self.inner.forward_batch(requests, pool, before, after_layer)


class UnfencedLoads:
    """Negative control: while ``enabled``, ``lane.begin_load`` does nothing,
    so the load stream is not ordered after the copies already issued on the
    caller's stream (the pool's relocations): a load may land in a page before
    the relocation copy that vacated it read it. Wraps the lane in place."""

    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.enabled = False
        self._fenced = lane.begin_load
        lane.begin_load = self._begin_load

    def _begin_load(self) -> None:
        if not self.enabled:
            self._fenced()


class WrongStreamEvents:
    """Negative control: while ``enabled``, a ``CudaLane`` records each unit's
    event on the recording thread's current stream (the device's default
    one) instead of the load stream that carries the unit's copies, so the
    forward's per-layer wait no longer orders it after the copies. Wraps the
    lane in place."""

    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.enabled = False
        self._right = lane._record_landing
        lane._record_landing = self._record

    def _record(self) -> Any:
        if not self.enabled:
            return self._right()
        device = self.lane.device
        event = device.event(blocking=True)
        event.record(device.current_stream())
        return event


HOLD_S = 0.5  # how long a broken engine gets to return early (a correct one never does)


async def cancel_while_held(task: asyncio.Task[Any], cancel: Callable[[], object],
                            gate: threading.Event, hold_s: float = HOLD_S) -> None:
    """Call ``cancel()`` (``task.cancel``, a timeout's ``reschedule``, or
    nothing), check that ``task`` does not finish within ``hold_s`` while
    ``gate`` holds the thread it waits for, then open the gate. A bounded
    window: a correct engine never returns there, however long it is."""
    try:
        cancel()
        done, _ = await asyncio.wait({task}, timeout=hold_s)
        assert not done, "the cancelled call returned while its worker thread still ran"
    finally:
        gate.set()


def spy_lock_wait(engine: Any) -> asyncio.Event:
    """An event set when a caller starts waiting for ``engine``'s held load
    lock (the race tests order a release or a close after that wait began)."""
    lock = engine._ctx.lock
    waiting = asyncio.Event()
    original = lock.acquire

    async def spied() -> bool:
        if lock.locked():
            waiting.set()
        return bool(await original())

    lock.acquire = spied
    return waiting
