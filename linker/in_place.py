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
- :class:`PipelinedPuts`: the calls in order, the footers of call ``k + 1``
  computed while call ``k`` runs on a put thread. The puts stay one at a time;
  call ``k + 1`` is launched only once call ``k`` succeeded (a failure sends
  nothing after it); a call that timed out is waited for until it ended (the
  memory is the call's until then); each call's region is released, and its
  ``ended`` callback run, by the put thread once the call ended; :meth:`run`
  returns (or raises what ``prepare`` or ``launch`` raised) only after the
  put thread returned. So once ``run`` returned, no call reads the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from layerlift.linker.ring import Region
from layerlift.linker.store_base import Store, StoreError, StoreIOError, StoreTimeout
from layerlift.linker.transfer_plan import OffloadOutcome

__all__ = ["FIRST_BYTES", "Call", "PipelinedPuts", "grow", "late_failure"]

FIRST_BYTES = 8 << 20  # the first call of an offload: its footers are all it waits for

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

    ``prepare(chunk, outcome)``: this thread; the chunk's :class:`Call`, its
    footers computed; None (the error in ``outcome``) when no region came; it
    releases its region when it raises. ``launch(call)`` (this thread, right
    before the call is handed to the put thread; may raise, and then the call
    is never sent): returns the ``ended`` callback the put thread runs once
    the call ended. ``late(+1)`` / ``late(-1)``: a call timed out / then ended."""

    def __init__(self, store: Store, prepare: Callable[[C, OffloadOutcome], Call | None], *,
                 launch: Callable[[Call], Callable[[], None]] = lambda call: _nothing,
                 late: Callable[[int], None] = lambda delta: None) -> None:
        self.store, self.prepare, self.launch, self.late = store, prepare, launch, late

    def run(self, chunks: Sequence[C]) -> OffloadOutcome:
        outcome = OffloadOutcome()
        putter = ThreadPoolExecutor(1, thread_name_prefix="layerlift-put") \
            if len(chunks) > 1 else None
        pending: Future[_Result] | None = None
        try:
            for chunk in chunks:
                ready = self.prepare(chunk, outcome)
                try:
                    if pending is not None:
                        done, pending = pending, None
                        if not _account(done.result(), outcome):
                            break
                    if ready is None:
                        break
                    ended = self.launch(ready)
                    sending, ready = ready, None  # the put thread releases it now
                    pending = self._submit(putter, sending, ended)
                finally:
                    if ready is not None:  # prepared, never sent
                        ready.region.release()
            if pending is not None:
                done, pending = pending, None
                _account(done.result(), outcome)
        finally:
            if pending is not None:  # something raised: the put still ends first
                wait([pending])
            if putter is not None:
                putter.shutdown(wait=True)
        return outcome

    def _submit(self, putter: ThreadPoolExecutor | None, call: Call,
                ended: Callable[[], None]) -> Future[_Result]:
        """The put on the put thread, or here and now (a single call)."""
        if putter is not None:
            return putter.submit(self._put, call, ended)
        done: Future[_Result] = Future()
        done.set_result(self._put(call, ended))
        return done

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


def _account(result: _Result, outcome: OffloadOutcome) -> bool:
    """``result`` into ``outcome``; whether the puts go on."""
    if result.error is not None:
        outcome.error = result.error
        return False
    outcome.late += result.late
    outcome.objects += len(result.call.keys)
    outcome.bytes += sum(sum(row) for row in result.call.sizes)
    return True
