"""Learning, without busy polling, that a CUDA event recorded on the load stream completed.

Two mechanisms, chosen by `Completion`:

* HOST_FUNC (AUTO picks it when cuda-python is importable): `cuLaunchHostFunc` enqueues a
  host function on the load stream right after the event; the driver calls it on its own
  thread once the preceding copies finished. Zero threads of ours, lowest latency.
  Caveat, and why WATCHER exists: the stream does not run later work until the host
  function returns, and ours must take the GIL (ctypes does it), so a busy interpreter
  can delay the *next* copy by up to one GIL switch interval. The function only calls
  `loop.call_soon_threadsafe`, never a CUDA API (forbidden in host functions).
* WATCHER: one daemon thread takes (event, callback) pairs in record order and calls
  `event.synchronize()` (blocks without the GIL, no polling) then the callback. Events
  on one stream complete in record order, so FIFO watching adds no delay beyond the
  previous event's. Never stalls the stream.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .base import DeviceEvent


class Completion(enum.Enum):
    """How a `CudaLane` learns that a unit's copies completed (see module docstring)."""

    AUTO = "auto"
    HOST_FUNC = "host_func"
    WATCHER = "watcher"


class Notifier(Protocol):
    mode: Completion

    def notify(self, event: DeviceEvent, callback: Callable[[], None]) -> None:
        """Call `callback` (any thread) once `event` completed. Call right after recording
        the event, in record order (the caller serialises)."""

    def close(self) -> None: ...


def _import_driver() -> Any | None:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
        except ImportError:
            return None
    return driver


def make_notifier(completion: Completion, stream_handle: int | None) -> Notifier:
    """Build the notifier for `completion` on the stream whose raw handle is given
    (`Device.stream_handle`; None for a device without driver streams, e.g. the
    simulated one: AUTO then watches, HOST_FUNC raises `RuntimeError`)."""
    if completion is Completion.WATCHER:
        return WatcherNotifier()
    if stream_handle is None:
        if completion is Completion.HOST_FUNC:
            raise RuntimeError("Completion.HOST_FUNC needs a CUDA stream; this device has none")
        return WatcherNotifier()
    driver = _import_driver()
    if driver is None:
        if completion is Completion.HOST_FUNC:
            raise RuntimeError("Completion.HOST_FUNC needs cuda-python (pip install cuda-python)")
        return WatcherNotifier()
    return HostFuncNotifier(driver, stream_handle)


class WatcherNotifier:
    """One watcher thread: `event.synchronize()` in record order, then the callback."""

    mode = Completion.WATCHER

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[DeviceEvent, Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="layerlift-watcher", daemon=True)
        self._thread.start()

    def notify(self, event: DeviceEvent, callback: Callable[[], None]) -> None:
        self._queue.put((event, callback))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            event, callback = item
            event.synchronize()
            callback()

    def close(self) -> None:
        """Finish the queued notifications, then stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


_HOST_FN_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFuncNotifier:
    """`cuLaunchHostFunc` on the load stream; one ctypes trampoline, callbacks by token."""

    mode = Completion.HOST_FUNC

    def __init__(self, driver: Any, stream_handle: int) -> None:
        self._driver = driver
        self._stream = driver.CUstream(stream_handle)
        self._pending: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._trampoline = _HOST_FN_TYPE(self._fire)  # kept alive as long as self
        address = ctypes.cast(self._trampoline, ctypes.c_void_p).value
        self._fn = driver.CUhostFn(address)

    def _fire(self, token: int | None) -> None:
        # Runs on a CUDA driver thread; must not call CUDA. ctypes holds the GIL here.
        with self._lock:
            callback = self._pending.pop(token or 0, None)
        if callback is not None:
            callback()

    def notify(self, event: DeviceEvent, callback: Callable[[], None]) -> None:
        token = next(self._tokens)
        with self._lock:
            self._pending[token] = callback
        result = self._driver.cuLaunchHostFunc(self._stream, self._fn, token)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            with self._lock:
                self._pending.pop(token, None)
            raise RuntimeError(f"cuLaunchHostFunc failed: {err!r}")

    def close(self) -> None:
        """Nothing to stop; pending callbacks still fire when the stream reaches them."""
