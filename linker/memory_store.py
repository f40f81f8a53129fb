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
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreIOError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
    TensorLike,
    buffer_span,
    check_batch,
)


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
      it reaches `timeout_s`, the call sleeps `timeout_s` and raises StoreTimeout.
    - `fail_call(n, exc)`: the n-th call from now (1 = the next) raises `exc`
      (default StoreUnavailable). Every method except `close` counts.
    - `fail_keys(keys, exc)`: put/get/get_ranges touching those keys raise `exc`
      (default StoreIOError).
    - `short_read_keys(keys)`: get/get_ranges of those keys raise StoreIOError.
    - `drop_key(key)`: the object disappears (eviction).
    - `calls`, `bytes_read`, `bytes_written`: what happened so far.
    """

    def __init__(self, *, timeout_s: float = 10.0, latency_s: float = 0.0) -> None:
        if timeout_s <= 0 or latency_s < 0:
            raise ValueError("timeout_s must be positive and latency_s must be >= 0.")
        self.timeout_s = timeout_s
        self.latency_s = latency_s
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

    def clear_faults(self) -> None:
        """Forget every injected fault (latency stays)."""
        with self._lock:
            self._fail_at.clear()
            self._fail_keys.clear()
            self._short_keys.clear()

    # -- plumbing --------------------------------------------------------------------------

    def _enter(self, method: str, keys: Sequence[str] = ()) -> None:
        """Log the call, apply latency and call faults; raise StoreError after close."""
        with self._lock:
            if self._closed:
                raise StoreError(f"Cannot call {method}: this MemoryStore is closed.")
            self._ncalls += 1
            self.calls.append(StoreCall(method, tuple(keys)))
            injected = self._fail_at.pop(self._ncalls, None)
        if self.latency_s >= self.timeout_s:
            time.sleep(self.timeout_s)
            raise StoreTimeout(f"MemoryStore {method} did not finish within {self.timeout_s:g} s.")
        if self.latency_s:
            time.sleep(self.latency_s)
        if injected is not None:
            raise injected

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
        self._enter("register")
        with self._lock:
            for base, length in self._registered.items():
                if base < ptr + size and ptr < base + length:
                    raise StoreError(
                        f"Memory at {ptr:#x} (+{size} bytes) overlaps memory already registered "
                        f"at {base:#x}; Mooncake refuses this too (error -600)."
                    )
            self._registered[ptr] = size
        return ptr

    def unregister(self, ptr: int) -> None:
        self._enter("unregister")
        with self._lock:
            if self._registered.pop(ptr, None) is None:
                raise StoreError(f"Memory at {ptr:#x} is not registered with this store.")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("exists", keys)
        with self._lock:
            return [k in self._objects for k in keys]

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        check_batch(keys, ptrs, sizes)
        self._enter("put", keys)
        with self._lock:
            self._check_keys(keys, reading=False)
            for ptr, size in zip(ptrs, sizes, strict=True):
                self._check_span(ptr, size)
            for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
                if key not in self._objects:
                    self._objects[key] = ctypes.string_at(ptr, size)
                    self.bytes_written += size

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        check_batch(keys, ptrs, sizes)
        self._enter("get", keys)
        with self._lock:
            present = [k for k in keys if k in self._objects]
            self._check_keys(present, reading=True)
            for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
                self._check_span(ptr, size)
                data = self._objects.get(key)
                if data is not None and len(data) != size:
                    raise StoreIOError(
                        f"Object {key} is {len(data)} bytes but {size} were requested."
                    )
            for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
                if key in self._objects:
                    ctypes.memmove(ptr, self._objects[key], size)
                    self.bytes_read += size
            return [k in self._objects for k in keys]

    def get_ranges(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        check_batch(keys, dst_ptrs, sizes, src_offsets)
        for key, p, s, o in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
            check_batch(p, s, o)
            if not p:
                raise ValueError(f"get_ranges: no slices given for {key}.")
        self._enter("get_ranges", keys)
        with self._lock:
            missing = [k for k in keys if k not in self._objects]
            if missing:
                raise StoreKeyMissing(missing)
            self._check_keys(keys, reading=True)
            for key, ptrs, lens, offs in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
                total = len(self._objects[key])
                for ptr, size, off in zip(ptrs, lens, offs, strict=True):
                    self._check_span(ptr, size)
                    if off < 0 or size < 0 or off + size > total:
                        raise StoreIOError(
                            f"Slice [{off}, {off + size}) lies outside object {key} of {total} bytes."
                        )
            for key, ptrs, lens, offs in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
                base = _address(self._objects[key])
                for ptr, size, off in zip(ptrs, lens, offs, strict=True):
                    ctypes.memmove(ptr, base + off, size)
                    self.bytes_read += size

    @contextlib.contextmanager
    def _session(self, keys: tuple[str, ...]) -> Iterator[None]:
        self._enter("open_session", keys)
        with self._lock:
            missing = [k for k in keys if k not in self._objects]
        if missing:
            raise StoreKeyMissing(missing)
        yield

    def remove(self, keys: Sequence[str]) -> None:
        self._enter("remove", keys)
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._registered.clear()
            self._objects.clear()
