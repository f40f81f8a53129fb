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

A request's error is that request's: ``submit`` checks the prompt (a 1-D
sequence of integer token ids in ``[0, vocab_size)``, at most
``max_prompt_tokens`` long) and raises ``ValueError`` to its caller before
it is queued; when the engine fails a batch of several requests, the batch
is split in halves and each half run again (down to single requests), so
only the requests that fail alone get the error and the rest are served.

Threads: everything runs on the event loop that called ``start``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import numpy as np

from layerlift.engine.results import PrefillResult
from layerlift.engine.threads import wait_through

log = logging.getLogger("layerlift.engine")

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
    * ``max_prompt_tokens``: the longest prompt ``submit`` accepts (None: no
      bound of the server's own; the engine may still refuse one that cannot
      fit its pool, which then fails that request only).
    * ``vocab_size``: token ids must lie in ``[0, vocab_size)``; None: taken
      from ``engine.model.vocab_size`` when the engine has one.
    """

    max_batch_tokens: int = 4096
    max_batch_requests: int = 64
    max_queue: int = 1024
    prefetch: bool = False
    max_prompt_tokens: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        """Validate every field; raises ValueError with a sentence naming it."""
        for name in ("max_batch_tokens", "max_batch_requests", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be at least 1 (an integer), got {value!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {self.prefetch!r}")
        for name in ("max_prompt_tokens", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")


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


_RECENT_BATCHES = 1024


@dataclass(slots=True)
class ServerStats:
    """Counters since start: batches run, requests answered, failed, dropped,
    refused at ``submit`` (bad prompt), prompt tokens handed to the engine,
    batches split to isolate a failing request; ``batch_tokens`` holds the
    prompt tokens of the last 1024 batches only (bounded)."""

    batches: int = 0
    served: int = 0
    failed: int = 0
    dropped: int = 0
    refused: int = 0
    tokens: int = 0
    splits: int = 0
    batch_tokens: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=_RECENT_BATCHES))


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
        model_vocab = getattr(getattr(engine, "model", None), "vocab_size", None)
        self.vocab_size: int | None = self.cfg.vocab_size or (
            int(model_vocab) if isinstance(model_vocab, int) else None)
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
            task = self._task

            def stop_batcher() -> None:
                task.cancel()

            await wait_through(task, on_cancel=stop_batcher)

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
        dropped the request, ``ValueError`` for a bad prompt (empty, not 1-D,
        not integers, a token id outside ``[0, vocab_size)``, longer than
        ``max_prompt_tokens``), and whatever the engine raised for this
        request (it failed alone; see the module docstring). Cancelling the caller
        while the request is queued removes it from the queue; once its batch
        runs, the batch completes and the result is discarded."""
        fut = await self.enqueue(tokens)
        return await fut

    async def enqueue(self, tokens: Sequence[int] | np.ndarray) -> asyncio.Future[Served]:
        """Queue one prompt (waiting while the queue is full); returns the
        future of its result at once. Raises like :meth:`submit`."""
        arr = self._check_prompt(tokens)
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._closing or len(self._queue) < self.cfg.max_queue)
            return self._push(arr)

    def submit_nowait(self, tokens: Sequence[int] | np.ndarray) -> asyncio.Future[Served]:
        """Queue one prompt without waiting; returns the future of its result.
        Raises :class:`QueueFull` when ``max_queue`` requests wait already,
        :class:`ServerClosed` when closing, ``ValueError`` for a bad prompt."""
        arr = self._check_prompt(tokens)
        self._condition()
        if not self._closing and len(self._queue) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self._queue)} requests are queued (max_queue="
                            f"{self.cfg.max_queue}); retry later or await submit()")
        return self._push(arr)

    def _check_prompt(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The prompt as int64, or ``ValueError`` naming what is wrong."""
        try:
            arr = _as_prompt(tokens, self.vocab_size, self.cfg.max_prompt_tokens)
        except ValueError:
            self.stats.refused += 1
            raise
        return arr

    def _push(self, arr: np.ndarray) -> asyncio.Future[Served]:
        if self._closing:
            raise ServerClosed("the server is closing and takes no new requests")
        fut: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        pending = _Pending(arr, time.perf_counter(), fut)
        self._queue.append(pending)
        fut.add_done_callback(functools.partial(self._forget, pending))
        self._wake()
        return fut

    def _forget(self, pending: _Pending, fut: asyncio.Future[Served]) -> None:
        """A caller gave up on a queued request (its future was cancelled,
        e.g. a cancelled ``submit``): it leaves the queue now, and a
        submitter waiting for room is woken."""
        if not fut.cancelled():
            return
        for i, queued in enumerate(self._queue):  # by identity; absent once batched
            if queued is pending:
                del self._queue[i]
                if self._changed is not None and not self._closing:
                    self._wake()
                return

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
            if running:  # their threads return before the batcher ends, even if cancelled again
                await wait_through(asyncio.ensure_future(asyncio.wait(list(running))))
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
        engine error fails only the requests that fail alone (`_isolate`).

        With prefetch two of these run at once; the engine orders their
        loads and forwards (FIFO)."""
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        start = time.perf_counter()
        self.stats.batches += 1
        tokens = sum(len(p.tokens) for p in batch)
        self.stats.tokens += tokens
        self.stats.batch_tokens.append(tokens)
        try:
            outcomes = await self._isolate(batch)
        except asyncio.CancelledError:
            for p in batch:
                self._fail(p, ServerClosed("the server was cancelled while this batch ran"))
            raise
        done = time.perf_counter()
        for p, out in zip(batch, outcomes, strict=True):
            if isinstance(out, Exception):  # this request's own error
                self.stats.failed += 1
                self._fail(p, out)
                continue
            self.stats.served += 1
            if not p.future.done():
                p.future.set_result(Served(out, p.submitted, start, done, batch_id, len(batch)))

    async def _isolate(self, batch: list[_Pending]) -> list[PrefillResult | Exception]:
        """``engine.prefill`` of the batch; if it raises, each half again (down
        to single requests), so an error lands on the requests that fail
        alone. Cancellation is never caught here."""
        try:
            results = await self.engine.prefill([p.tokens for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the engine returned {len(results)} results for "
                                   f"{len(batch)} prompts")
            return list(results)
        except Exception as exc:
            if len(batch) == 1:
                return [exc]
            self.stats.splits += 1
            log.info("a batch of %d requests failed (%s); running its halves apart to find "
                     "the request it belongs to", len(batch), exc)
            mid = len(batch) // 2
            return [*await self._isolate(batch[:mid]), *await self._isolate(batch[mid:])]

    @staticmethod
    def _fail(p: _Pending, exc: BaseException) -> None:
        if not p.future.done():
            p.future.set_exception(exc)


def _as_prompt(tokens: Sequence[int] | np.ndarray, vocab_size: int | None,
               max_tokens: int | None) -> np.ndarray:
    """The prompt as a 1-D int64 array; ``ValueError`` with a sentence for a
    prompt that is empty, not 1-D, not integers, out of the vocabulary or
    too long."""
    try:
        raw = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a prompt must be a 1-D sequence of token ids: {exc}") from None
    if raw.ndim != 1 or len(raw) == 0:
        raise ValueError("a prompt must be a non-empty 1-D sequence of token ids")
    if not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {raw.dtype}")
    if raw.dtype.kind == "u" and raw.dtype.itemsize == 8 and int(raw.max()) > np.iinfo(np.int64).max:
        raise ValueError("token ids must lie in the model's vocabulary")
    arr = raw.astype(np.int64)
    if max_tokens is not None and len(arr) > max_tokens:
        raise ValueError(f"the prompt has {len(arr)} tokens; this server takes at most "
                         f"{max_tokens} (ServeConfig.max_prompt_tokens)")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the model's vocabulary {bound}")
    return arr
