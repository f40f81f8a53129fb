"""Whether a batch waits for its caller, since when, and for what.

The engine's locks are held by batches that make progress on their own
(a lookup, a load, a forward: each of their waits is bounded) and by
batches that only their caller can move on: a step-by-step handle loaded
but neither forwarded nor aborted, or a host forward (external runner)
that was told to rerun, whose wait failed, or that returned without
``done()`` / ``failed()``. Another request waits behind the first kind as
long as it takes and behind the second kind at most
``layer_wait_timeout_s`` (``EngineContext.acquire`` and ``wait_for_room``),
then gets an ``EngineError`` naming the holder and what it waits for; the
holder itself stays valid for its caller's next step.

:class:`CallerWait` is that record for one batch. Threads: any. A host's
forward thread reports its waits and its return; the event loop reads it
and claims it around ``done()`` / ``failed()``. Every change to "waits"
wakes the lock waiters (``notify``, called on the event loop), so that a
bound counts from the moment the holder stopped moving, not from the next
poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

__all__ = ["CallerWait"]


class CallerWait:
    """One batch's "waits for its caller" state (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        self._loop = loop
        self._notify = notify
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic; None while the batch progresses
        self._what = ""
        self._in_call = False  # done()/failed() in progress: the engine moves the batch

    def waits(self, what: str) -> None:
        """From now on only the caller moves the batch on: ``what`` says
        what it waits for (a sentence fragment naming the caller's next
        step). Ignored while ``done()`` / ``failed()`` is in progress."""
        with self._lock:
            if self._in_call:
                return
            self._since, self._what = time.monotonic(), what
        self._wake()

    def progresses(self) -> None:
        """The batch moves on by itself (a forward runs, a pass ends)."""
        with self._lock:
            self._since = None

    def begin_call(self) -> None:
        """``done()`` / ``failed()`` took the batch: it progresses until
        :meth:`end_call`, whatever the host's thread reports meanwhile."""
        with self._lock:
            self._in_call, self._since = True, None

    def end_call(self, then: str | None) -> None:
        """The call ended; ``then``: what the batch waits for now (None: it
        has ended, or moves on by itself)."""
        with self._lock:
            self._in_call = False
        if then is not None:
            self.waits(then)

    @property
    def since(self) -> float | None:
        """Since when (``time.monotonic()``) the batch waits for its caller;
        None while it progresses."""
        return self._since

    @property
    def what(self) -> str:
        """What the caller is waited for (meaningful while :attr:`since` is set)."""
        return self._what

    def _wake(self) -> None:
        # A closed event loop (RuntimeError) has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._notify)
