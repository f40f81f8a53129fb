"""`MemoryStore`: an in-process `Store` with settable latency and faults, for unit tests.

Objects are `bytes` in a dict; reads and writes go through `ctypes.memmove` on
the caller's pointers, exactly like a zero-copy backend. Every method has the
same semantics as `MooncakeStore` (the conformance suite proves it), plus a
stricter check: pointers must lie inside registered memory (Mooncake silently
falls back to a slower copy there; here it raises StoreError, so a missing
`register` shows up in unit tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import NamedTuple, TypeVar

from layerlift.linker.daemon_pool import DaemonPool
from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreFull,
    StoreIOError,
    StoreKeyMissing,
    StoreObjectSize,
    StoreTimeout,
    StoreUnavailable,
    TensorLike,
    buffer_span,
    call_bounded,
    check_batch,
    check_ranges,
)

_T = TypeVar("_T")
_LOCAL_CALLS = frozenset({"register", "unregister"})


def _address(data: bytes) -> int:
    """Address of the bytes object's buffer (no copy; valid while `data` lives)."""
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return address


class StoreCall(NamedTuple):
    """One entry of `MemoryStore.calls`."""

    method: str
    keys: tuple[str, ...]


class MemoryStore(Store):
    """Thread-safe in-memory `Store` with fault and latency injection.

    - `latency_s`: sleep per call, in the calling thread, outside the lock. If
      it reaches `timeout_s`, the call runs on a background worker instead:
      the caller gets StoreTimeout after `timeout_s` while the call goes on
      and takes effect (reads and writes the caller's memory) after
      `latency_s`, exactly like a Mooncake call on a slow master.
    - `stall()` / `resume()`: a stopped master. Calls made while stalled
      (except `register`/`unregister`, local to a Mooncake client) run
      on a background worker and take effect only after `resume()`; their
      callers get StoreTimeout (carrying the running call) after `timeout_s`.
      `held` is set once a call waits for `resume()`; `stall_when(method)`
      stalls the store at the next call of `method` (a master that stops
      mid-restore); `timed_out` is set whenever a caller got StoreTimeout.
    - `capacity_bytes`: a full store. A put whose new objects do not fit
      stores those that do, in order, and raises StoreFull for the rest.
    - `fail_call(n, exc)`: the n-th call from now (1 = the next) raises `exc`
      (default StoreUnavailable). Every method except `close` counts.
    - `fail_keys(keys, exc)`: put/get/get_ranges touching those keys raise `exc`
      (default StoreIOError).
    - `short_read_keys(keys)`: get/get_ranges of those keys raise StoreIOError.
    - `drop_key(key)`: the object disappears (eviction).
    - `calls`, `bytes_read`, `bytes_written`: what happened so far.
    """

    def __init__(self, *, timeout_s: float = 10.0, latency_s: float = 0.0,
                 capacity_bytes: int | None = None) -> None:
        if timeout_s <= 0 or latency_s < 0:
            raise ValueError("timeout_s must be positive and latency_s must be >= 0.")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (or None), got {capacity_bytes}.")
        self.timeout_s = timeout_s
        self.latency_s = latency_s
        self.capacity_bytes = capacity_bytes
        self.held = threading.Event()
        self.timed_out = threading.Event()
        self._stall_on: set[str] = set()
        self._running = threading.Event()
        self._running.set()
        self._workers: DaemonPool | None = None
        self.calls: list[StoreCall] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._registered: dict[int, int] = {}
        self._closed = False
        self._ncalls = 0
        self._fail_at: dict[int, StoreError] = {}
        self._fail_keys: dict[str, StoreError] = {}
        self._short_keys: set[str] = set()

    # -- fault injection ---------------------------------------------------------------

    def fail_call(self, n: int = 1, exc: StoreError | None = None) -> None:
        """Make the n-th call from now raise `exc` (default StoreUnavailable)."""
        if n < 1:
            raise ValueError(f"fail_call(n): n counts calls from now and must be >= 1, got {n}.")
        with self._lock:
            self._fail_at[self._ncalls + n] = exc or StoreUnavailable("Injected store failure.")

    def fail_keys(self, keys: Iterable[str], exc: StoreError | None = None) -> None:
        """Make put/get/get_ranges of these keys raise `exc` (default StoreIOError)."""
        with self._lock:
            for key in keys:
                self._fail_keys[key] = exc or StoreIOError(f"Injected transfer failure on {key}.")

    def short_read_keys(self, keys: Iterable[str]) -> None:
        """Make get/get_ranges of these keys raise StoreIOError (a short read)."""
        with self._lock:
            self._short_keys.update(keys)

    def drop_key(self, key: str) -> None:
        """Remove an object behind the caller's back, as an eviction would."""
        with self._lock:
            self._objects.pop(key, None)

    def stall(self) -> None:
        """Stop the "master": calls from now on take effect only after `resume()`."""
        self.held.clear()
        self._running.clear()

    def stall_when(self, method: str) -> None:
        """Stall the store (as `stall()`) when `method` is next called; that
        call is the first one held."""
        with self._lock:
            self._stall_on.add(method)

    def resume(self) -> None:
        """Let stalled calls take effect (in the background, in their order)."""
        self._running.set()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no slow or stalled call still runs in the background
        (False on timeout)."""
        with self._lock:
            workers = self._workers
        return True if workers is None else workers.wait_idle(timeout_s)

    def clear_faults(self) -> None:
        """Forget every injected fault (latency stays)."""
        with self._lock:
            self._fail_at.clear()
            self._fail_keys.clear()
            self._short_keys.clear()

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, method: str, keys: Sequence[str], body: Callable[[], _T]) -> _T:
        """Log the call, then run `body` with latency and call faults applied:
        inline, or (slow or stalled) on a background worker that the caller
        waits for at most `timeout_s`. Raises StoreError after close."""
        with self._lock:
            if self._closed:
                raise StoreError(f"Cannot call {method}: this MemoryStore is closed.")
            self._ncalls += 1
            self.calls.append(StoreCall(method, tuple(keys)))
            injected = self._fail_at.pop(self._ncalls, None)
            if method in self._stall_on:
                self._stall_on.discard(method)
                self.held.clear()
                self._running.clear()
            # register/unregister are local to a Mooncake client: a stopped
            # master does not hold them
            stalled = not self._running.is_set() and method not in _LOCAL_CALLS
            slow = self.latency_s >= self.timeout_s
            if (stalled or slow) and self._workers is None:
                self._workers = DaemonPool(4, "memory-store")
            workers = self._workers

        def run() -> _T:
            if stalled:
                self.held.set()
                self._running.wait()
            if self.latency_s:
                time.sleep(self.latency_s)
            if injected is not None:
                raise injected
            with self._lock:
                if self._closed:
                    raise StoreError(f"MemoryStore {method}: the store was closed meanwhile.")
            return body()

        if workers is None or not (stalled or slow):
            return run()
        try:
            return call_bounded(
                workers.submit, run, self.timeout_s,
                f"MemoryStore {method} did not finish within {self.timeout_s:g} s "
                "(the call may still run).",
            )
        except StoreTimeout:
            self.timed_out.set()
            raise

    def _check_keys(self, keys: Iterable[str], reading: bool) -> None:
        """Raise injected key faults (caller holds the lock)."""
        for key in keys:
            if key in self._fail_keys:
                raise self._fail_keys[key]
            if reading and key in self._short_keys:
                raise StoreIOError(f"Short read of {key}: the transfer ended early.")

    def _check_span(self, ptr: int, size: int) -> None:
        """Raise StoreError unless [ptr, ptr + size) is registered (caller holds the lock)."""
        for base, length in self._registered.items():
            if base <= ptr and ptr + size <= base + length:
                return
        raise StoreError(
            f"{size} bytes at {ptr:#x} are not inside memory registered with this store; "
            "call register() first."
        )

    # -- Store -----------------------------------------------------------------------------

    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        ptr, size = buffer_span(buffer, nbytes)

        def body() -> int:
            with self._lock:
                for base, length in self._registered.items():
                    if base < ptr + size and ptr < base + length:
                        raise StoreError(
                            f"Memory at {ptr:#x} (+{size} bytes) overlaps memory already "
                            f"registered at {base:#x}; Mooncake refuses this too (error -600)."
                        )
                self._registered[ptr] = size
            return ptr

        try:
            return self._call("register", (), body)
        except StoreTimeout as exc:  # a registration that lands later is undone
            if exc.future is not None:
                exc.future.add_done_callback(lambda f: self._undo_register(f, ptr))
            raise

    def _undo_register(self, future: Future[int], ptr: int) -> None:
        if not future.cancelled() and future.exception() is None:
            with self._lock:
                self._registered.pop(ptr, None)

    def unregister(self, ptr: int) -> None:
        def body() -> None:
            with self._lock:
                if self._registered.pop(ptr, None) is None:
                    raise StoreError(f"Memory at {ptr:#x} is not registered with this store.")

        self._call("unregister", (), body)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        def body() -> list[bool]:
            with self._lock:
                return [k in self._objects for k in keys]

        return self._call("exists", keys, body)

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        check_batch(keys, ptrs, sizes)
        self._put(keys, [[p] for p in ptrs], [[n] for n in sizes], "put")

    def put_parts(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> None:
        self._put(keys, ptrs, sizes, "put_parts")

    def _put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
             sizes: Sequence[Sequence[int]], method: str) -> None:
        check_batch(keys, ptrs, sizes)
        for p, n in zip(ptrs, sizes, strict=True):
            check_batch(p, n)

        def body() -> None:
            with self._lock:
                self._check_keys(keys, reading=False)
                for row, lens in zip(ptrs, sizes, strict=True):
                    for ptr, size in zip(row, lens, strict=True):
                        self._check_span(ptr, size)
                full: list[str] = []
                for key, row, lens in zip(keys, ptrs, sizes, strict=True):
                    if key in self._objects:
                        continue
                    if self.capacity_bytes is not None and \
                            self.used_bytes + sum(lens) > self.capacity_bytes:
                        full.append(key)
                        continue
                    self._objects[key] = b"".join(
                        ctypes.string_at(p, n) for p, n in zip(row, lens, strict=True))
                    self.bytes_written += sum(lens)
            if full:
                raise StoreFull(
                    f"MemoryStore put: no space for {len(full)} object(s) "
                    f"(capacity {self.capacity_bytes} bytes), e.g. {full[0]}.")

        self._call(method, keys, body)

    @property
    def used_bytes(self) -> int:
        """Bytes of every object held."""
        return sum(len(v) for v in self._objects.values())

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        check_batch(keys, ptrs, sizes)

        def body() -> list[bool]:
            with self._lock:
                present = [k for k in keys if k in self._objects]
                self._check_keys(present, reading=True)
                wrong: list[tuple[str, int, int]] = []
                for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
                    self._check_span(ptr, size)
                    data = self._objects.get(key)
                    if data is not None and len(data) != size:
                        wrong.append((key, len(data), size))
                if wrong:
                    key, has, want = wrong[0]
                    raise StoreObjectSize(
                        [k for k, _, _ in wrong],
                        f"Object {key} is {has} bytes but {want} were requested "
                        f"({len(wrong)} object(s) of another size).")
                for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
                    if key in self._objects:
                        ctypes.memmove(ptr, self._objects[key], size)
                        self.bytes_read += size
                return [k in self._objects for k in keys]

        return self._call("get", keys, body)

    def get_ranges(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        check_ranges(keys, dst_ptrs, sizes, src_offsets)
        self._call("get_ranges", keys, lambda: self._ranged(keys, dst_ptrs, sizes, src_offsets))

    def _ranged(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        with self._lock:
            missing = [k for k in keys if k not in self._objects]
            if missing:
                raise StoreKeyMissing(missing)
            self._check_keys(keys, reading=True)
            short: list[str] = []
            first = ""
            for key, ptrs, lens, offs in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
                total = len(self._objects[key])
                for ptr, size, off in zip(ptrs, lens, offs, strict=True):
                    self._check_span(ptr, size)
                    if off + size > total and key not in short:
                        short.append(key)
                        first = first or (f"Slice [{off}, {off + size}) lies outside object "
                                          f"{key} of {total} bytes")
            if short:
                raise StoreObjectSize(short, f"{first} ({len(short)} object(s) shorter than "
                                             "the slices read: truncated or foreign).")
            for key, ptrs, lens, offs in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
                base = _address(self._objects[key])
                for ptr, size, off in zip(ptrs, lens, offs, strict=True):
                    ctypes.memmove(ptr, base + off, size)
                    self.bytes_read += size

    @contextlib.contextmanager
    def _session(self, keys: tuple[str, ...]) -> Iterator[None]:
        def body() -> list[str]:
            with self._lock:
                return [k for k in keys if k not in self._objects]

        missing = self._call("open_session", keys, body)
        if missing:
            raise StoreKeyMissing(missing)
        yield

    def remove(self, keys: Sequence[str]) -> None:
        def body() -> None:
            with self._lock:
                for key in keys:
                    self._objects.pop(key, None)

        self._call("remove", keys, body)

    def replace_object(self, key: str, data: bytes) -> None:
        """Overwrite an object's bytes behind the caller's back (a corrupted or
        foreign object, for integrity tests). Raises KeyError if it is absent."""
        with self._lock:
            if key not in self._objects:
                raise KeyError(key)
            self._objects[key] = bytes(data)

    def object_bytes(self, key: str) -> bytes:
        """The stored bytes of one object (tests). Raises KeyError if absent."""
        with self._lock:
            return self._objects[key]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._registered.clear()
            self._objects.clear()
            workers, self._workers = self._workers, None
        self._running.set()  # stalled calls end (they see the store closed)
        if workers is not None:
            workers.stop()
