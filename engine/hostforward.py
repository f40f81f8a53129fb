"""Whether a host's own forward (external-runner mode) may still touch a batch's pages.

The engine's ownership rule (``engine/threads.py``) says memory a thread
may touch is released only after that thread returned. The engine's own
forward runs through ``run_owned``, so it knows; a host's forward runs in
the host's thread, so the host has to say so. :class:`HostForward` is that
record for one batch: the host forward counts as *running* from its first
per-layer wait (or ``ExternalForward.running()``) until the host says it
*returned* (leaving ``running()``, ``ExternalForward.returned()``,
``done()`` or ``failed()``). The batch's exit :meth:`close` s it first (no
host forward may start any more: a later wait raises) and then waits,
bounded, until a running one returned; if it never does, the batch leaves
its pages to :meth:`on_late_return`, which releases them only when the host
finally returns.

Threads: :meth:`start` and :meth:`returned` from any thread (the host's
forward thread, or the event loop); everything else on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

__all__ = ["HostForward"]

log = logging.getLogger("layerlift.engine")


class HostForward:
    """One batch's host-forward state (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._running = False
        self._closed = False  # the batch's exit began: no host forward may start
        self._waiter: asyncio.Future[None] | None = None
        self._late: Callable[[], None] | None = None  # the exit gave up: release on return

    def start(self) -> bool:
        """A host forward runs (idempotent while it runs). False, and nothing
        marked, once the batch's exit began: the forward must not start."""
        with self._lock:
            if self._closed:
                return False
            self._running = True
            return True

    def returned(self) -> bool:
        """The host forward returned: it touches none of the batch's pages
        any more. Wakes an exit waiting for it; if the exit already gave up,
        hands the pages it left behind back (on the event loop). Idempotent:
        True only for the call that found it running."""
        with self._lock:
            if not self._running:
                return False
            self._running = False
            waiter, late, self._waiter, self._late = self._waiter, self._late, None, None
        try:
            if waiter is not None:
                self._loop.call_soon_threadsafe(_settle, waiter)
            if late is not None:
                self._loop.call_soon_threadsafe(late)
        except RuntimeError:  # the event loop is closed: nothing is left to release
            log.error("a host forward returned after its engine's event loop closed; "
                      "the pages its batch left behind are not released")
        return True

    def close(self) -> None:
        """The exit began: from now on :meth:`start` refuses."""
        with self._lock:
            self._closed = True

    async def wait_returned(self, timeout_s: float) -> bool:
        """Close, then wait until a running host forward returned: True at
        once if none runs, False if it still runs after ``timeout_s``."""
        with self._lock:
            self._closed = True
            if not self._running:
                return True
            waiter = self._waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(waiter)
        except TimeoutError:
            with self._lock:
                if not self._running:  # returned in the same step as the timeout
                    return True
                self._waiter = None
            return False
        return True

    def on_late_return(self, release: Callable[[], None]) -> None:
        """The exit gave up waiting: run ``release`` on the event loop once
        the host forward returns (at once if it returned meanwhile)."""
        with self._lock:
            if self._running:
                self._late = release
                return
        release()


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
