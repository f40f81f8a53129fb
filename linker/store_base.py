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
- Methods are thread-safe: several worker threads may call one store at once.
- A missing key is a *return value* where the method returns per-key results
  (`exists`, `get`); it is an exception (`StoreKeyMissing`) where the caller
  asked for data it was promised (`get_ranges`, `open_session`).
- A failure is always an exception from the family below, never a silent miss.
- After `close()` every method except `close()` raises `StoreError`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Protocol


class StoreError(Exception):
    """Base class of every error a store raises."""


class StoreUnavailable(StoreError):
    """The store cannot serve requests: master gone, connection refused, setup failed."""


class StoreTimeout(StoreUnavailable):
    """A store call did not finish within the store's `timeout_s`."""


class StoreKeyMissing(StoreError):
    """Objects the caller required are not in the store; `.keys` names them."""

    def __init__(self, keys: Sequence[str], message: str | None = None) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        shown = ", ".join(self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(
            message or f"{len(self.keys)} object(s) are missing from the store: {shown}"
        )


class StoreIOError(StoreError):
    """A transfer failed: short read, size mismatch or a bad return code."""


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


class Store(ABC):
    """A blocking, thread-safe, time-bounded KV object store (see module docstring)."""

    timeout_s: float

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

    @abstractmethod
    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Read whole objects into memory; return per key True (read) or False (missing).

        Each object must be exactly `sizes[i]` bytes: a size mismatch or a
        short read raises StoreIOError.
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

        Raises StoreKeyMissing (with `.keys`) for missing objects, StoreIOError
        for a slice out of bounds or a failed transfer.
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
        """Remove objects, best effort: missing keys are ignored; a backend may
        keep an object that is being read (Mooncake: read lease) until later."""

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
