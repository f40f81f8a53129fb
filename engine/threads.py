"""Worker threads that never outlive the memory they touch.

The ownership rule of the engine: pool memory (pages, state slots, staging
rows, host copies) that a worker thread may read or write is released —
freed, unpinned, its node unlocked, the device lock handed on — only after
that thread has returned. ``await anyio.to_thread.run_sync(fn)`` does not
give that under plain asyncio cancellation: ``task.cancel()`` (what
``asyncio.wait_for`` timeouts, ``TaskGroup`` failures and a host server's
request cancellation do) makes the ``await`` raise at once while the thread
keeps running, and the caller's ``finally`` releases what the thread still
uses.

:func:`run_owned` is the one way the engine runs blocking work: it returns
(or raises) only once the thread has returned. A cancellation that arrives
meanwhile is held, ``on_cancel`` is called (to make the thread stop early,
e.g. the forward's stop flag), and the cancellation is raised again once the
thread is done — never lost. Every thread the engine starts goes through
here (or, for fetches, through the scheduler, whose ``wait_quiescent`` is
the same rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio

__all__ = ["run_owned", "wait_through"]

T = TypeVar("T")


async def run_owned(fn: Callable[[], T], *, on_cancel: Callable[[], None] | None = None) -> T:
    """Run ``fn()`` in a worker thread and wait until it has returned.

    Returns ``fn``'s result or raises its exception. If the awaiting task is
    cancelled, ``on_cancel`` runs once (on the event loop), the wait goes on
    until the thread returns, and then ``asyncio.CancelledError`` is raised
    (whatever the thread returned or raised is dropped: the caller was
    cancelled). Repeated cancellations while waiting are absorbed the same
    way. Runs on the event loop; ``fn`` runs on anyio's worker threads.
    """
    return await wait_through(asyncio.ensure_future(anyio.to_thread.run_sync(fn)),
                              on_cancel=on_cancel)


async def wait_through(fut: asyncio.Future[T], *,
                       on_cancel: Callable[[], None] | None = None) -> T:
    """Wait for ``fut`` to finish even if the caller is cancelled meanwhile.

    The same contract as :func:`run_owned` for any future (a batch's exit,
    a load's end): its result or exception once it is done; a cancellation
    of the caller calls ``on_cancel`` once and is raised after ``fut`` is
    done. ``fut`` itself is never cancelled by the caller's cancellation."""
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            if fut.cancelled():  # the awaited work itself was cancelled (loop shutdown)
                raise
            if cancelled is None:
                cancelled = exc
                if on_cancel is not None:
                    on_cancel()
            if fut.done():  # it finished in the same step as the cancellation
                break
        except BaseException as exc:
            if cancelled is not None:
                raise cancelled from exc
            raise
        else:
            if cancelled is not None:
                raise cancelled
            return result
    assert cancelled is not None
    raise cancelled

