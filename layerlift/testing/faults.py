"""Fault injection for tests (never for serving).

:class:`FaultyStore` wraps any :class:`~layerlift.linker.store_base.Store`
(a real Mooncake client included) and injects delays or failures into chosen
calls: a per-layer ranged read is recognised by its source offset, so a test
can fail "layer 5" of a restore without knowing the keys. ``skip_reads``
is a negative control: the reads of one component return without writing
the page bytes (their checksum footer entries are written as the checksum
of the bytes left in place, so the integrity check cannot catch the control:
a store that lies consistently).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from layerlift.linker.integrity import CHECK_BYTES, component_slices, crc32c, slice_seed
from layerlift.linker.store_base import Store, StoreIOError, StoreUnavailable, TensorLike
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "FaultyStore",
    "LayerFault",
    "ProcessStall",
]

_GATEABLE = frozenset({"exists", "session_enter", "session_exit", "put"})


@dataclass(slots=True)
class LayerFault:
    """What to do to the ranged read of one layer: block until ``release`` is
    set (a gate a test opens with an event, never a sleep), then fail with
    ``error`` if given. ``times`` faults that many reads (None: every one)."""

    error: BaseException | None = None
    gate: threading.Event | None = None
    times: int | None = 1
    started: threading.Event = field(default_factory=threading.Event)


class FaultyStore(Store):
    """A :class:`Store` that forwards to ``inner`` and injects faults.

    ``fail_layer(layer, exc)`` / ``gate_layer(layer, event)`` act on the
    per-layer ranged reads of ``spec``'s layer; ``fail_exists`` /
    ``fail_session`` (on entering the session) / ``fail_put`` make those
    calls raise; ``gate(call, event)`` holds a call; ``skip_reads(component)`` makes that component's
    ranged reads write nothing (a negative control); ``down = True`` makes
    every call raise ``StoreUnavailable`` (the master went away) until set
    back. Thread-safe.
    """

    def __init__(self, inner: Store, spec: ModelSpec) -> None:
        self.inner, self.spec = inner, spec
        self.timeout_s = inner.timeout_s
        self.capacity_bytes = inner.capacity_bytes
        self._lock = threading.Lock()
        self._layer_faults: dict[int, LayerFault] = {}
        self.fail_exists: BaseException | None = None
        self.fail_put: BaseException | None = None
        self.fail_session: BaseException | None = None
        self.skipped: set[str] = set()
        self._gates: dict[str, LayerFault] = {}
        self.down = False
        self.ranged_calls: list[int] = []  # layer of each ranged read, in call order

    # ---- configuration ----------------------------------------------------------
    def fail_layer(self, layer: int, error: BaseException | None = None, *,
                   times: int | None = 1) -> LayerFault:
        fault = LayerFault(error or StoreIOError(f"injected failure at layer {layer}"),
                           None, times)
        with self._lock:
            self._layer_faults[layer] = fault
        return fault

    def gate_layer(self, layer: int, gate: threading.Event) -> LayerFault:
        fault = LayerFault(None, gate, None)
        with self._lock:
            self._layer_faults[layer] = fault
        return fault

    def gate(self, call: str, gate: threading.Event) -> LayerFault:
        """Hold every ``call`` ("exists", "session_enter", "session_exit",
        "put") until ``gate`` is set; ``started`` is set when one waits. A
        test cancels the engine at exactly that await this way."""
        if call not in _GATEABLE:
            raise ValueError(f"cannot gate {call!r}; choose one of {sorted(_GATEABLE)}")
        fault = LayerFault(None, gate, None)
        with self._lock:
            self._gates[call] = fault
        return fault

    def _pass(self, call: str) -> None:
        with self._lock:
            fault = self._gates.get(call)
        if fault is not None and fault.gate is not None:
            fault.started.set()
            if not fault.gate.wait(self.timeout_s):
                raise StoreIOError(f"injected gate of {call} never opened")

    def skip_reads(self, component: str, skip: bool = True) -> None:
        """Negative control: ranged reads of ``component`` ("full", "swa",
        "mamba") return without writing a byte."""
        with self._lock:
            (self.skipped.add if skip else self.skipped.discard)(component)

    def clear(self) -> None:
        with self._lock:
            self._layer_faults.clear()
            self.skipped.clear()
            self._gates.clear()
        self.fail_exists = self.fail_put = self.fail_session = None
        self.down = False

    # ---- Store ------------------------------------------------------------------
    def _check_up(self) -> None:
        if self.down:
            raise StoreUnavailable("injected: the store is unavailable")

    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        return self.inner.register(buffer, nbytes)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_up()
        self._pass("exists")
        if self.fail_exists is not None:
            raise self.fail_exists
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self._check_up()
        self._pass("put")
        if self.fail_put is not None:
            raise self.fail_put
        self.inner.put(keys, ptrs, sizes)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self._check_up()
        self._pass("put")
        if self.fail_put is not None:
            raise self.fail_put
        self.inner.put_parts(keys, ptrs, sizes)

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """A whole-object read covers every layer of its objects: a fault set
        on any of those layers applies (the lowest layer's first)."""
        self._check_up()
        self._whole_faults(keys)
        keep = [i for i, k in enumerate(keys) if k.split("/")[-3] not in self.skipped]
        if len(keep) == len(keys):
            return self.inner.get(keys, ptrs, sizes)
        got = self.inner.get([keys[i] for i in keep], [ptrs[i] for i in keep],
                             [sizes[i] for i in keep]) if keep else []
        out = [True] * len(keys)  # skipped objects "read" without a byte written
        for i, ok in zip(keep, got, strict=True):
            out[i] = ok
        return out

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        """A per-layer read (slice ``l`` plus its footer entry) gets that
        layer's faults; a whole read (every object from offset 0 with its
        page size) gets the faults of ``get``."""
        self._check_up()
        if self._whole_read(keys, sizes, src_offsets):
            self._whole_faults(keys)
        else:
            layer = self._layer_of(keys, src_offsets, sizes)
            fault = self._take_fault(layer)
            if fault is not None:
                fault.started.set()
                if fault.gate is not None and not fault.gate.wait(self.timeout_s):
                    raise StoreIOError(f"injected gate of layer {layer} never opened")
                if fault.error is not None:
                    raise fault.error
        skip = [i for i, k in enumerate(keys) if k.split("/")[-3] in self.skipped]
        if not skip:
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
            return
        keep = [i for i in range(len(keys)) if i not in set(skip)]
        if keep:
            self.inner.get_ranges([keys[i] for i in keep], [dst_ptrs[i] for i in keep],
                                  [sizes[i] for i in keep], [src_offsets[i] for i in keep])
        for i in skip:
            self._forge_footers(keys[i], dst_ptrs[i], sizes[i])

    def _forge_footers(self, key: str, dst_ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Negative control: the reads of ``key`` were skipped; write, as the
        footer entries read beside them, the CRC-32C of the bytes left in
        place. Slices come as (layer slice, its entry) or (whole page, footer)."""
        if len(dst_ptrs) < 2:
            return
        component = Component(key.split("/")[-3])
        page, foot = dst_ptrs[0], dst_ptrs[1]
        slices = component_slices(self.spec, component)
        if sizes[1] == CHECK_BYTES:
            layer = next((j for j, (o, n) in enumerate(slices) if n == sizes[0]), 0)
            _write_crc(foot, page, sizes[0], slice_seed(key, layer))
            return
        for j, (offset, size) in enumerate(slices):
            _write_crc(foot + j * CHECK_BYTES, page + offset, size, slice_seed(key, j))

    def _whole_read(self, keys: Sequence[str], sizes: Sequence[Sequence[int]],
                    src_offsets: Sequence[Sequence[int]]) -> bool:
        if not keys or not src_offsets[0] or src_offsets[0][0] != 0:
            return False
        component = Component(keys[0].split("/")[-3])
        return bool(sizes[0][0] == self.spec.page_bytes(component))

    def _whole_faults(self, keys: Sequence[str]) -> None:
        comps = {k.split("/")[-3] for k in keys}
        for layer in range(self.spec.num_layers):
            if self.spec.layer_slice(layer)[0].value not in comps:
                continue
            fault = self._take_fault(layer)
            if fault is not None:
                with self._lock:
                    self.ranged_calls.append(layer)
                fault.started.set()
                if fault.gate is not None and not fault.gate.wait(self.timeout_s):
                    raise StoreIOError(f"injected gate of layer {layer} never opened")
                if fault.error is not None:
                    raise fault.error
                return

    def open_session(self, keys: Sequence[str]) -> contextlib.AbstractContextManager[None]:
        return self._session(tuple(keys))

    @contextlib.contextmanager
    def _session(self, keys: tuple[str, ...]) -> Iterator[None]:
        self._check_up()
        self._pass("session_enter")
        if self.fail_session is not None:
            raise self.fail_session
        with self.inner.open_session(keys):
            try:
                yield
            finally:
                self._pass("session_exit")

    def remove(self, keys: Sequence[str]) -> None:
        self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()

    # ---- helpers ----------------------------------------------------------------
    def _layer_of(self, keys: Sequence[str], src_offsets: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> int | None:
        """Which layer a ranged read serves: the component is in the key, the
        layer is the slice at that offset and size."""
        if not keys or not src_offsets or not src_offsets[0]:
            return None
        component = keys[0].split("/")[-3]
        off, size = src_offsets[0][0], sizes[0][0]
        for layer in range(self.spec.num_layers):
            c, _, o, s = self.spec.layer_slice(layer)
            if c.value == component and o == off and s == size:
                with self._lock:
                    self.ranged_calls.append(layer)
                return layer
        return None

    def _take_fault(self, layer: int | None) -> LayerFault | None:
        if layer is None:
            return None
        with self._lock:
            fault = self._layer_faults.get(layer)
            if fault is None:
                return None
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self._layer_faults[layer]
            return fault



def _write_crc(at: int, ptr: int, size: int, seed: int) -> None:
    crc = crc32c(ctypes.string_at(ptr, size), seed)
    ctypes.memmove(at, crc.to_bytes(CHECK_BYTES, "little"), CHECK_BYTES)


def _proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (None: no /proc entry)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class ProcessStall:
    """Stops (SIGSTOP) and resumes (SIGCONT) a server process, as a GC pause,
    an overloaded host or a network blip would: its clients' calls hang and
    go on once it resumes. ``release()`` resumes it if still stopped (for a
    test's ``finally``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stopped = threading.Event()

    def stop(self, wait_s: float = 5.0) -> None:
        """SIGSTOP the process and return once the kernel shows it stopped
        (``/proc/PID/stat`` state ``T``, at most ``wait_s``; where there is
        no ``/proc``, at once): a call made after ``stop`` meets a stopped
        server."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped.set()
        deadline = time.monotonic() + wait_s
        while _proc_state(self.pid) not in ("T", "t", None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"process {self.pid} was sent SIGSTOP but did not stop "
                                   f"within {wait_s:g} s")
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped.clear()

    def release(self) -> None:
        if self.stopped.is_set():
            self.resume()
