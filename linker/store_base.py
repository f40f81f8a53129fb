"""The `Store` protocol: what the loader needs from an external KV object store.

A store holds immutable byte objects under string keys (see `keys.py` for the
schema). Objects are written from, and read into, memory the caller owns and
has registered with the store (`register`), so a backend such as Mooncake can
move the bytes without an extra copy.

Contract shared by every backend (the conformance suite in
`tests/linker/test_store_conformance.py` runs the same assertions on each):

- Every method is synchronous and may block. Async code calls them in worker
  threads, never on the event loop. Every call is bounded in time by the
  store's `timeout_s`; a call that does not finish in time raises
  `StoreTimeout`.
- A timed-out call may still be running (the backend's worker goes on; a
  stalled master resumes): it still reads or writes the caller's memory.
  `StoreTimeout.wait_finished()` blocks until it really ended; a caller that
  lent memory to the call keeps that memory until then (report the failure
  first, then wait). A call still queued when its timeout hit is cancelled.
- Methods are thread-safe: several worker threads may call one store at once.
- A missing key is a *return value* where the method returns per-key results
  (`exists`, `get`); it is an exception (`StoreKeyMissing`) where the caller
  asked for data it was promised (`get_ranges`, `open_session`).
- A failure is always an exception from the family below, never a silent miss.
- After `close()` every method except `close()` raises `StoreError`.
"""

from __future__ import annotations

import contextlib
import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


class StoreError(Exception):
    """Base class of every error a store raises."""


class StoreUnavailable(StoreError):
    """The store cannot serve requests: master gone, connection refused, setup failed."""


class StoreTimeout(StoreUnavailable):
    """A store call did not finish within the store's `timeout_s`.

    The call may still run: `future` is its concurrent future (None when
    nothing runs on: the call was cancelled before it started, or the backend
    runs calls inline). `wait_finished()` blocks until the call ended and
    returns its outcome, so memory lent to it is released only then.
    """

    def __init__(self, message: str, future: Future[Any] | None = None) -> None:
        super().__init__(message)
        self.future = future
        # False when the call that runs on was lent none of the caller's
        # memory (a read's session start or renewal, before the read was
        # issued): nothing it does can touch a destination or a source.
        self.lent = True
        # Set by a caller that took over the memory lent to the call (it is
        # released in the call's own completion): whoever would otherwise
        # wait for the call before returning need not.
        self.owned = False

    def wait_finished(self, timeout_s: float | None = None) -> bool:
        """Block until the timed-out call ended (at most `timeout_s`; None:
        without bound). Returns True if it ended and succeeded (a put then
        landed after all), False if it failed, was cancelled or still runs."""
        future = self.future
        if future is None:
            return False
        wait([future], timeout=timeout_s)
        if not future.done() or future.cancelled():
            return False
        return future.exception() is None



class StoreKeyMissing(StoreError):
    """Objects the caller required are not in the store; `.keys` names them."""

    def __init__(self, keys: Sequence[str], message: str | None = None) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        shown = ", ".join(self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(
            message or f"{len(self.keys)} object(s) are missing from the store: {shown}"
        )


class StoreObjectLeased(StoreError):
    """`remove` could not remove these objects (`.keys`) now: a read lease
    holds them (Mooncake: -706 until its ``--default_kv_lease_ttl`` after the
    last read or ``exists``). Every other key of the call was removed."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        shown = ", ".join(self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(f"{len(self.keys)} object(s) are leased by a read and were not "
                         f"removed: {shown}")


class StoreIOError(StoreError):
    """A transfer failed: short read, size mismatch or a bad return code."""


class StoreIntegrityError(StoreIOError):
    """Bytes read from the store do not match the checksum stored with them
    (a corrupted, truncated or foreign object): the read counts as failed."""


class StoreObjectSize(StoreIntegrityError):
    """Objects (`.keys`) are not of the size the read expects: shorter than a
    slice `get_ranges` asked for, or (`get`) of another size than requested.
    Backends raise it only once the object's own size shows it (not for a
    failed transfer): the object is truncated or foreign, so a reader may
    treat it like a checksum mismatch and quarantine the keys."""

    def __init__(self, keys: Sequence[str], message: str | None = None) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        shown = ", ".join(self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(
            message or f"{len(self.keys)} object(s) are not of the size the read expects "
                       f"(truncated or foreign): {shown}")


class StoreFull(StoreIOError):
    """The store has no space for an object (Mooncake: NO_AVAILABLE_HANDLE)."""


class TensorLike(Protocol):
    """The part of `torch.Tensor` that `register` uses (keeps torch out of the protocol)."""

    def data_ptr(self) -> int: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...

    def is_contiguous(self) -> bool: ...


def buffer_span(buffer: TensorLike | int, nbytes: int | None) -> tuple[int, int]:
    """Return `(ptr, nbytes)` of a contiguous tensor or of a raw pointer plus a size.

    Raises ValueError for a non-contiguous tensor, a raw pointer without `nbytes`,
    or a non-positive size.
    """
    if isinstance(buffer, int):
        if nbytes is None:
            raise ValueError("register(ptr, nbytes): a raw pointer needs its size in bytes.")
        ptr = buffer
    else:
        if not buffer.is_contiguous():
            raise ValueError("Only contiguous tensors can be registered with a store.")
        ptr = buffer.data_ptr()
        if nbytes is None:
            nbytes = buffer.numel() * buffer.element_size()
    if nbytes <= 0 or ptr <= 0:
        raise ValueError(f"Cannot register {nbytes} bytes at address {ptr:#x}.")
    return ptr, nbytes


def check_batch(keys: Sequence[object], *columns: Sequence[object]) -> None:
    """Raise ValueError unless every column has one entry per key (or per
    entry of the first column)."""
    for column in columns:
        if len(column) != len(keys):
            raise ValueError(
                f"Batch arguments disagree: {len(keys)} keys but {len(column)} entries."
            )


def check_ranges(
    keys: Sequence[str],
    dst_ptrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    src_offsets: Sequence[Sequence[int]],
) -> None:
    """The argument checks of `Store.get_ranges`, shared by every backend:
    one row per key, one entry per slice in each row, at least one slice
    per key, no negative size or offset. Raises ValueError."""
    check_batch(keys, dst_ptrs, sizes, src_offsets)
    for key, p, s, o in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
        check_batch(p, s, o)
        if not p:
            raise ValueError(f"get_ranges: no slices given for {key}.")
        if any(n < 0 for n in s) or any(n < 0 for n in o):
            raise ValueError(f"get_ranges: a slice of {key} has a negative size or offset.")


def call_bounded(
    submit: Callable[[Callable[[], _T]], Future[_T]],
    fn: Callable[[], _T],
    timeout_s: float,
    message: str,
) -> _T:
    """Run `fn` through `submit` and wait at most `timeout_s` for it.

    On a timeout, a call still queued is cancelled (StoreTimeout without a
    future); a running one keeps running and its future travels with the
    StoreTimeout (see `StoreTimeout.wait_finished`).
    """
    future = submit(fn)
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        running = None if future.cancel() else future
        raise StoreTimeout(message, running) from None


class Store(ABC):
    """A blocking, thread-safe, time-bounded KV object store (see module docstring)."""

    timeout_s: float
    # Bytes the store can hold in all, when known (None: unknown). A writer
    # never sends a batch larger than this: it would only evict everything.
    capacity_bytes: int | None = None

    @abstractmethod
    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        """Register memory the store may read from or write into; return its address.

        `buffer` is a contiguous tensor (its whole storage span, unless `nbytes`
        is given) or a raw pointer with `nbytes`. The memory must stay alive
        until `unregister` or `close`. Raises ValueError for a bad span,
        StoreError if the backend refuses it (e.g. it overlaps a registered span).
        """

    @abstractmethod
    def unregister(self, ptr: int) -> None:
        """Forget memory registered at `ptr`. Raises StoreError if it was not registered."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Return, per key, whether the object is in the store."""

    @abstractmethod
    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Store `sizes[i]` bytes at `ptrs[i]` under `keys[i]`, for every i.

        A key that already exists is left as it is and counts as success.
        Raises StoreIOError (out of space, bad return code), StoreUnavailable.
        """

    def put_parts(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> None:
        """Like `put`, but object `keys[i]` is the concatenation of the buffers
        `ptrs[i][j]` of `sizes[i][j]` bytes (a page plus its checksum footer,
        both zero-copy where the backend supports it: `MemoryStore` and
        `MooncakeStore` do). This default copies the parts into one host
        buffer it registers for the call, then `put`s from it; the buffer is
        kept until the put really ended, even after a StoreTimeout."""
        check_batch(keys, ptrs, sizes)
        for row_ptrs, row_sizes in zip(ptrs, sizes, strict=True):
            check_batch(row_ptrs, row_sizes)
        if all(len(p) == 1 for p in ptrs):
            self.put(keys, [p[0] for p in ptrs], [n[0] for n in sizes])
            return
        totals = [sum(row) for row in sizes]
        staging = ctypes.create_string_buffer(max(1, sum(totals)))
        base = ctypes.addressof(staging)
        at, starts = base, []
        for row, lens in zip(ptrs, sizes, strict=True):
            starts.append(at)
            for ptr, size in zip(row, lens, strict=True):
                ctypes.memmove(at, ptr, size)
                at += size
        self.register(base, max(1, sum(totals)))
        try:
            try:
                self.put(keys, starts, totals)
            except StoreTimeout as exc:
                if not exc.wait_finished():
                    raise
        finally:
            self.unregister(base)

    @abstractmethod
    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Read whole objects into memory; return per key True (read) or False (missing).

        Each object must be exactly `sizes[i]` bytes: a size mismatch raises
        StoreObjectSize (naming the keys), a short read StoreIOError.
        """

    @abstractmethod
    def get_ranges(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        """Read many byte slices of many objects in one call.

        For object `keys[i]`, slice j is `sizes[i][j]` bytes starting at
        `src_offsets[i][j]`, written to `dst_ptrs[i][j]`. This is the per-layer
        load: slice l of every page object of a batch. Call it on keys of an
        open session (`open_session`); without one, a backend that needs a
        session opens and closes one itself (correct, slower).

        Raises StoreKeyMissing (with `.keys`) for missing objects,
        StoreObjectSize (with `.keys`) for objects shorter than a slice asked
        for (truncated or foreign: the object's own size shows it),
        StoreIOError for a failed transfer.
        """

    def open_session(self, keys: Sequence[str]) -> contextlib.AbstractContextManager[None]:
        """Context manager: a read session over `keys` for repeated `get_ranges`.

        Raises StoreKeyMissing on entry if any key is missing (nothing stays
        open then). Sessions nest and overlap: a key's session ends when the
        last session holding it exits.
        """
        return self._session(tuple(keys))

    @contextlib.contextmanager
    def _session(self, keys: tuple[str, ...]) -> Iterator[None]:
        missing = [k for k, ok in zip(keys, self.exists(keys), strict=True) if not ok]
        if missing:
            raise StoreKeyMissing(missing)
        yield

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Remove objects; missing keys are ignored. An object a backend keeps
        because it is being read (Mooncake: a read lease, granted by reads and
        by `exists`) is not removed: the call removes the others and raises
        StoreObjectLeased naming the kept ones (retry after the lease)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store and everything registered. Idempotent; never raises
        for a store that is already closed."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ForwardingStore(Store):
    """A :class:`Store` that forwards every call to ``inner``: the base of
    wrappers that change a few calls (fault injection, checks, modelled
    costs) and pass the rest through. Unknown attributes come from
    ``inner`` too. ``close`` closes ``inner``; a wrapper over a shared store
    overrides it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.timeout_s = inner.timeout_s
        self.capacity_bytes = inner.capacity_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        return self.inner.register(buffer, nbytes)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self.inner.put(keys, ptrs, sizes)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self.inner.put_parts(keys, ptrs, sizes)

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        return self.inner.get(keys, ptrs, sizes)

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

    def open_session(self, keys: Sequence[str]) -> contextlib.AbstractContextManager[None]:
        return self.inner.open_session(keys)

    def remove(self, keys: Sequence[str]) -> None:
        self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()
