"""A fixed pool of daemon threads for blocking client calls that may hang."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonPool"]

_T = TypeVar("_T")


class DaemonPool:
    """Fixed daemon threads running submitted callables in FIFO order.

    Daemon threads, unlike `ThreadPoolExecutor`'s, never hold up interpreter
    exit when a Mooncake call hangs.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._idle = threading.Condition()
        self._pending = 0  # calls submitted and not finished, hung ones included
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        with self._idle:
            self._pending += 1
        self._queue.put((future, fn))
        return future

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no submitted call is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            try:
                if future.set_running_or_notify_cancel():  # False: cancelled while queued
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the waiting caller
                        future.set_exception(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def stop(self) -> None:
        """Let every thread exit once the queued work is done. Does not wait."""
        for _ in self._threads:
            self._queue.put(None)
