"""Pipelined in-place puts: objects put straight from memory a host owns.

The hosts' in-place offloads (SGLang's pools: ``hosts/sglang/offload_in_place.py``;
vLLM's held blocks: ``hosts/vllm/worker_held.py``) put each object from where
its bytes are, its footer computed over those bytes into a region of a ring.
What they share is here:

- :func:`grow`: the objects cut into put calls, the first small (its footers
  are all the first put waits for), each next one twice as large, up to a
  bound of bytes and of buffers a call (Mooncake's TCP transport queues at
  most 1024 transfers a peer by default, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``,
  and every buffer is one).
- :class:`PipelinedPuts`: the calls in order on one put thread, the
  footers of the next calls computed on the calling thread meanwhile (at
  most :data:`AHEAD` calls prepared and waiting for the put thread). The
  puts stay one at a time; call ``k + 1`` is launched (``launch``, on the
  put thread, right before it is sent) only once call ``k`` succeeded (the
  first failure, a put's, a ``prepare``'s or a ``launch``'s, sends nothing
  after it: the calls prepared and not sent are released); a call that timed out is waited for until it ended (the memory is
  the call's until then); each call's region is released, and its ``ended``
  callback run, by the put thread once the call ended; :meth:`run` returns
  (or raises what ``prepare`` or ``launch`` raised) only after the put
  thread returned. So once ``run`` returned, no call reads the memory.

Why a queue and not a lockstep (footers of ``k + 1``, wait for put ``k``,
launch ``k + 1``): the two stages take turns being the slower one (on the
2-core box a 120 MiB call's footers took 10-12 ms and its put 10-14 ms, the
two alternating), and in lockstep each step lasts as long as the slower
of the two; with calls prepared ahead each stage runs at its own pace
(1 GiB at page 64, the puts landing in this process's segment: 120 ms in
lockstep, 106 ms with three calls ahead; a raw put 62 ms).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from layerlift.linker.ring import Region
from layerlift.linker.store_base import Store, StoreError, StoreIOError, StoreTimeout
from layerlift.linker.transfer_plan import OffloadOutcome

__all__ = ["AHEAD", "FIRST_BYTES", "Call", "PipelinedPuts", "grow", "late_failure"]

FIRST_BYTES = 8 << 20  # the first call of an offload: its footers are all it waits for

AHEAD = 3
"""Calls of one :class:`PipelinedPuts` prepared and not yet taken by its put
thread, at most (their footer regions are small: ``overflow`` regions)."""

C = TypeVar("C")


@dataclass(slots=True)
class Call:
    """One ``put_parts`` of objects from the host's memory; their footers in
    ``region`` (released by the put thread once the call ended)."""

    region: Region
    keys: list[str] = field(default_factory=list)
    ptrs: list[list[int]] = field(default_factory=list)
    sizes: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class _Result:
    call: Call
    error: StoreError | None
    late: bool = False


def grow(objects: Sequence[tuple[int, int]], put_bytes: int, put_buffers: int,
         first: int = FIRST_BYTES) -> list[range]:
    """``objects`` (``(bytes, buffers)`` each, in order) as consecutive runs
    of indices, one put call each: the first of at most ``first`` bytes, each
    next one up to twice the one before, at most ``put_bytes`` bytes and
    ``put_buffers`` buffers; one object at least."""
    out: list[range] = []
    start = nbytes = count = 0
    limit = first
    for i, (size, buffers) in enumerate(objects):
        if i > start and (nbytes + size > limit or count + buffers > put_buffers):
            out.append(range(start, i))
            start, nbytes, count = i, 0, 0
            limit = min(2 * limit, put_bytes)
        nbytes, count = nbytes + size, count + buffers
    if start < len(objects):
        out.append(range(start, len(objects)))
    return out


def late_failure(exc: StoreTimeout) -> StoreError:
    """What a put that timed out ended with, once it ended and failed."""
    future = exc.future
    error = future.exception() if future is not None and not future.cancelled() else None
    if isinstance(error, StoreError):
        return error
    return StoreIOError(f"a put timed out and then failed: {error or exc}")


def _nothing() -> None:
    return None


class PipelinedPuts(Generic[C]):
    """Puts of ``chunks`` (see the module docstring).

    ``prepare(chunk, outcome)``: the calling thread; the chunk's
    :class:`Call`, its footers computed; None (the error in ``outcome``)
    when no region came; it releases its region when it raises.
    ``launch(call)``: the put thread, right before the call is sent, once
    every call before it succeeded (may raise: the call is never sent,
    nothing after it either, and :meth:`run` raises it); returns the
    ``ended`` callback the put thread runs once the call ended.
    ``late(+1)`` / ``late(-1)``: a call timed out / then ended (the put
    thread). ``prepare`` and ``launch`` run on different threads, at the
    same time: a host's state both touch is under its own lock."""

    def __init__(self, store: Store, prepare: Callable[[C, OffloadOutcome], Call | None], *,
                 launch: Callable[[Call], Callable[[], None]] = lambda call: _nothing,
                 late: Callable[[int], None] = lambda delta: None,
                 ahead: int = AHEAD) -> None:
        if ahead < 1:
            raise ValueError(f"pipelined puts need ahead >= 1, got {ahead}")
        self.store, self.prepare, self.launch, self.late = store, prepare, launch, late
        self.ahead = ahead

    def run(self, chunks: Sequence[C]) -> OffloadOutcome:
        if len(chunks) <= 1:
            return self._run_one(chunks[0]) if chunks else OffloadOutcome()
        outcome = OffloadOutcome()
        line = _Line()
        putter = threading.Thread(target=self._drain, args=(line, outcome),
                                  name="layerlift-put", daemon=True)
        putter.start()
        left_cleanly = False
        try:
            for chunk in chunks:
                with line.cond:
                    line.cond.wait_for(lambda: line.stopped or len(line.calls) < self.ahead)
                    if line.stopped:
                        break
                scratch = OffloadOutcome()
                ready = self.prepare(chunk, scratch)
                with line.cond:
                    if ready is None:  # no region: the first failure, nothing more is sent
                        if outcome.error is None:
                            outcome.error = scratch.error
                        self._stop(line)
                        break
                    if line.stopped:  # the put thread stopped meanwhile: never sent
                        ready.region.release()
                        break
                    line.calls.append(ready)
                    line.cond.notify_all()
            left_cleanly = True
        finally:
            with line.cond:
                if not left_cleanly:  # prepare raised: nothing more is sent
                    self._stop(line)
                line.closed = True
                line.cond.notify_all()
            putter.join()  # every call sent has ended, every call not sent released
        if line.raised is not None:
            raise line.raised
        return outcome

    def _run_one(self, chunk: C) -> OffloadOutcome:
        """A single call: prepared, launched and put on this thread."""
        outcome = OffloadOutcome()
        ready = self.prepare(chunk, outcome)
        if ready is None:
            return outcome
        try:
            ended = self.launch(ready)
        except BaseException:
            ready.region.release()
            raise
        _account(self._put(ready, ended), outcome)
        return outcome

    def _drain(self, line: _Line, outcome: OffloadOutcome) -> None:
        """The put thread: the prepared calls in order until the calling
        thread closed the line, or the first failure; the calls it did not
        send released (also those prepared after it stopped: the calling
        thread sees ``stopped`` and releases them itself)."""
        while True:
            with line.cond:
                line.cond.wait_for(lambda: line.calls or line.closed)
                if not line.calls:
                    return
                call = line.calls.popleft()
                line.cond.notify_all()  # a slot for the next call's footers
            sent = False
            try:
                ended = self.launch(call)
                sent = True
                result = self._put(call, ended)  # releases the region, runs ended
            except BaseException as exc:  # launch raised (or a bug below it)
                if not sent:
                    call.region.release()
                with line.cond:
                    line.raised = exc
                    self._stop(line)
                continue
            with line.cond:
                if not _account(result, outcome):
                    self._stop(line)

    @staticmethod
    def _stop(line: _Line) -> None:
        """Under ``line.cond``: nothing more is sent; the calls waiting released."""
        line.stopped = True
        while line.calls:
            line.calls.popleft().region.release()
        line.cond.notify_all()

    def _put(self, call: Call, ended: Callable[[], None]) -> _Result:
        """One ``put_parts``; a call that timed out waited for until it ended;
        then the region released and ``ended`` run."""
        try:
            try:
                self.store.put_parts(call.keys, call.ptrs, call.sizes)
            except StoreTimeout as exc:
                self.late(+1)
                try:
                    if not exc.wait_finished():  # the memory is the call's until it ended
                        return _Result(call, late_failure(exc))
                finally:
                    self.late(-1)
                return _Result(call, None, late=True)
            except StoreError as exc:
                return _Result(call, exc)
            return _Result(call, None)
        finally:
            call.region.release()
            ended()


class _Line:
    """The calls prepared and not yet taken by the put thread, and how the
    two threads tell each other to stop (all under ``cond``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.calls: deque[Call] = deque()
        self.closed = False  # the calling thread prepares nothing more
        self.stopped = False  # the put thread sends nothing more
        self.raised: BaseException | None = None  # what launch raised


def _account(result: _Result, outcome: OffloadOutcome) -> bool:
    """``result`` into ``outcome``; whether the puts go on."""
    if result.error is not None:
        outcome.error = result.error
        return False
    outcome.late += result.late
    outcome.objects += len(result.call.keys)
    outcome.bytes += sum(sum(row) for row in result.call.sizes)
    return True
