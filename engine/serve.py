"""The serving loop a host server embeds: a queue of prefills, continuous
batching under a token budget, backpressure and clean shutdown.

    async with Server(engine, ServeConfig(max_batch_tokens=4096)) as server:
        served = await server.submit(tokens)       # waits for room, then for the result
        served.result.next_token_logprobs, served.queue_s, served.ttft_s

One task (the *batcher*) takes queued requests in FIFO order into a batch
while the batch's prompt tokens stay within ``max_batch_tokens`` (a request
larger than the budget runs alone) and hands the batch to
``engine.prefill``; the next batch is formed when that call returns. The
server talks to the engine only through ``await engine.prefill(prompts)``.

Prompt length is the batch's cost: it bounds computed + restored tokens
before LOOKUP has said how many are device hits (which cost almost nothing).

Cross-batch prefetch (``ServeConfig.prefetch``): the batcher keeps two
batches in flight. The next batch is formed as soon as the current one was
handed to the engine, and its ``prefill`` call starts at once; the engine
pipelines concurrent calls (one batch loads while the previous one
computes), so its LOOKUP and LOAD run during the current forward. Without
prefetch, the next batch is formed when the current one returned (more
requests coalesce into it, but its restore starts only then).
``Server._run_batch`` is the one place that calls the engine.

Threads: everything runs on the event loop that called ``start``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import numpy as np

from layerlift.engine.results import PrefillResult
from layerlift.engine.threads import wait_through

__all__ = [
    "PrefillEngine", "QueueFull", "ServeConfig", "Served", "Server", "ServerClosed",
    "ServerStats",
]


class QueueFull(Exception):
    """``submit_nowait`` found ``max_queue`` requests waiting already."""


class ServerClosed(RuntimeError):
    """The server is closing or closed: the request was refused, or it was
    still queued when ``aclose(cancel_pending=True)`` dropped it."""


class PrefillEngine(Protocol):
    """What the server needs from an engine (``layerlift.Engine`` is one).
    With ``prefetch``, two ``prefill`` calls run concurrently: the engine must
    allow that (``layerlift.Engine`` pipelines them)."""

    async def prefill(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[PrefillResult]:
        ...


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """How the server batches.

    * ``max_batch_tokens``: prompt tokens per batch (a request longer than
      this runs alone).
    * ``max_batch_requests``: requests per batch.
    * ``max_queue``: requests waiting (not yet in a batch) before ``submit``
      waits and ``submit_nowait`` raises :class:`QueueFull`.
    * ``prefetch``: cross-batch prefetch: two batches in flight, the next
      one's LOOKUP/LOAD running while the current forward runs.
    """

    max_batch_tokens: int = 4096
    max_batch_requests: int = 64
    max_queue: int = 1024
    prefetch: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_requests", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Served:
    """One request's result and its serving times (``time.perf_counter`` seconds).

    ``queue_s`` = batch start − submit; ``ttft_s`` = result − submit. The
    batch starts when it is handed to the engine (with prefetch it may then
    still wait inside the engine for the previous batch's load).
    """

    result: PrefillResult
    submitted: float
    batch_start: float
    finished: float
    batch_id: int
    batch_size: int

    @property
    def queue_s(self) -> float:
        return self.batch_start - self.submitted

    @property
    def ttft_s(self) -> float:
        return self.finished - self.submitted


@dataclass(slots=True)
class ServerStats:
    """Counters since start: batches run, requests answered, failed, dropped."""

    batches: int = 0
    served: int = 0
    failed: int = 0
    dropped: int = 0
    batch_tokens: list[int] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Pending:
    tokens: np.ndarray
    submitted: float
    future: asyncio.Future[Served]


class Server:
    """Continuous batching of prefills over one engine. Use as
    ``async with Server(engine, cfg)`` or ``start()`` / ``aclose()``."""

    def __init__(self, engine: PrefillEngine, cfg: ServeConfig | None = None) -> None:
        self.engine = engine
        self.cfg = cfg or ServeConfig()
        self.stats = ServerStats()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._next_batch_id = 0
        self._notifiers: set[asyncio.Task[None]] = set()

    # ---- lifecycle ---------------------------------------------------------------
    async def __aenter__(self) -> Server:
        self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose(cancel_pending=exc is not None)

    def start(self) -> None:
        """Start the batcher on the running loop. ``RuntimeError`` if started twice."""
        if self._task is not None:
            raise RuntimeError("the server was already started")
        self._changed = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._batcher(), name="layerlift-serve")

    async def aclose(self, cancel_pending: bool = False) -> None:
        """Stop taking requests and wait for the batcher to end.

        ``cancel_pending=False`` serves everything queued first;
        ``True`` fails queued requests (and blocked ``submit`` calls) with
        :class:`ServerClosed`. The batch already running always finishes (the
        engine never abandons a running forward). Idempotent. Cancelling
        ``aclose`` itself cancels the batcher (the engine aborts its batch)
        and is raised once the batcher ended: no thread of its batches runs.
        """
        cond = self._condition()
        async with cond:
            self._closing = True
            if cancel_pending:
                while self._queue:
                    self._fail(self._queue.popleft(),
                               ServerClosed("the server closed before this request ran"))
                    self.stats.dropped += 1
            cond.notify_all()
        if self._task is not None:
            # A cancelled aclose cancels the batcher (the engine aborts its
            # batches) and returns once it ended: their threads have returned.
            await wait_through(self._task, on_cancel=self._task.cancel)

    @property
    def prefetch_active(self) -> bool:
        """Whether the next batch is handed to the engine while the current
        one runs (``cfg.prefetch``)."""
        return self.cfg.prefetch

    @property
    def queued(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    # ---- submitting ------------------------------------------------------------------
    async def submit(self, tokens: Sequence[int] | np.ndarray) -> Served:
        """Queue one prompt (waiting while the queue is full) and wait for its
        result. Raises :class:`ServerClosed` if the server is closing or
        dropped the request, ``ValueError`` for an empty prompt, and whatever
        the engine raised for the batch that held it. Cancelling the caller
        while the request is queued removes it from the queue; once its batch
        runs, the batch completes and the result is discarded."""
        fut = await self.enqueue(tokens)
        return await fut

    async def enqueue(self, tokens: Sequence[int] | np.ndarray) -> asyncio.Future[Served]:
        """Queue one prompt (waiting while the queue is full); returns the
        future of its result at once. Raises like :meth:`submit`."""
        arr = _as_prompt(tokens)
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._closing or len(self._queue) < self.cfg.max_queue)
            return self._push(arr)

    def submit_nowait(self, tokens: Sequence[int] | np.ndarray) -> asyncio.Future[Served]:
        """Queue one prompt without waiting; returns the future of its result.
        Raises :class:`QueueFull` when ``max_queue`` requests wait already,
        :class:`ServerClosed` when closing."""
        arr = _as_prompt(tokens)
        self._condition()
        if not self._closing and len(self._queue) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self._queue)} requests are queued (max_queue="
                            f"{self.cfg.max_queue}); retry later or await submit()")
        return self._push(arr)

    def _push(self, arr: np.ndarray) -> asyncio.Future[Served]:
        if self._closing:
            raise ServerClosed("the server is closing and takes no new requests")
        fut: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(arr, time.perf_counter(), fut))
        self._wake()
        return fut

    def _wake(self) -> None:
        cond = self._condition()
        if cond.locked():  # _push from inside `async with cond`: notify directly
            cond.notify_all()
        else:
            self._spawn_notify()

    def _spawn_notify(self) -> None:
        # Keep a reference: the loop holds tasks weakly.
        task = asyncio.get_running_loop().create_task(self._notify())
        self._notifiers.add(task)
        task.add_done_callback(self._notifiers.discard)

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            raise RuntimeError("the server is not started: use `async with Server(...)`")
        return self._changed

    # ---- batching ----------------------------------------------------------------------
    async def _batcher(self) -> None:
        slots = asyncio.Semaphore(2 if self.prefetch_active else 1)
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                await slots.acquire()
                batch = await self._next_batch()
                if not batch:
                    break
                task = asyncio.get_running_loop().create_task(self._run_batch(batch))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _t: slots.release())
            while running:
                await asyncio.gather(*running)
        finally:  # however the batcher ends, nobody is left waiting
            for task in running:  # cancelled: the engine aborts its batches
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            self._closing = True
            while self._queue:
                self._fail(self._queue.popleft(), ServerClosed("the server stopped"))
            self._spawn_notify()  # wake blocked submitters: they see the server closed

    async def _next_batch(self) -> list[_Pending]:
        """Wait for work; take the head of the queue and every following
        request while the budget holds (FIFO: a request that does not fit
        ends the batch). Empty when closing with nothing queued."""
        cond = self._condition()
        async with cond:
            while True:
                while self._queue and self._queue[0].future.done():  # caller gave up
                    self._queue.popleft()
                if self._queue or self._closing:
                    break
                await cond.wait()
            batch = self._take_batch()
            cond.notify_all()  # room in the queue for waiting submitters
        return batch

    def _take_batch(self) -> list[_Pending]:
        """Pop the next batch under the budget without waiting (empty if
        nothing is queued)."""
        batch: list[_Pending] = []
        tokens = 0
        while self._queue and len(batch) < self.cfg.max_batch_requests:
            head = self._queue[0]
            if head.future.done():  # the caller gave up
                self._queue.popleft()
                continue
            if batch and tokens + len(head.tokens) > self.cfg.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += len(head.tokens)
        return batch

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """Run one batch through the engine and answer its awaiters. An
        engine error fails this batch's requests only.

        With prefetch two of these run at once; the engine orders their
        loads and forwards (FIFO)."""
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        start = time.perf_counter()
        self.stats.batches += 1
        self.stats.batch_tokens.append(sum(len(p.tokens) for p in batch))
        try:
            results = await self.engine.prefill([p.tokens for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the engine returned {len(results)} results for "
                                   f"{len(batch)} prompts")
        except asyncio.CancelledError:
            for p in batch:
                self._fail(p, ServerClosed("the server was cancelled while this batch ran"))
            raise
        except Exception as exc:  # the engine's error belongs to this batch's awaiters
            self.stats.failed += len(batch)
            for p in batch:
                self._fail(p, exc)
            return
        done = time.perf_counter()
        for p, res in zip(batch, results, strict=True):
            self.stats.served += 1
            if not p.future.done():
                p.future.set_result(Served(res, p.submitted, start, done, batch_id, len(batch)))

    @staticmethod
    def _fail(p: _Pending, exc: BaseException) -> None:
        if not p.future.done():
            p.future.set_exception(exc)


def _as_prompt(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError("a prompt must be a non-empty 1-D sequence of token ids")
    return arr
