"""Per-byte host work at real scale, and offload puts through an emulated NIC.

At token scale ``k`` (``engine/model/architectures.py``) every object the
engine moves holds ``1/k`` of the real bytes, so the host work done per byte
(the CRC-32C check of every restored slice and of every offloaded page, the
copies into and out of the store) is ``k`` times too cheap, and puts never
met a link at all. :class:`HostCostStore` wraps one instance's view of the
shared store and charges what is missing, as time slept in the calling
worker thread (the engine calls the store only from worker threads):

* a read (``get``, ``get_ranges``): after the data arrived, the check and
  copy of the other ``(k - 1) / k`` of its bytes at this machine's measured
  rates (:func:`measure_rates`: the engine's own CRC-32C check per slice and
  one memory copy), plus the slice's own transfer time at the
  ingress rate, so the check follows the transfer instead of hiding under
  the emulated link's sleep (``overlap/link.py`` sleeps until the modelled
  arrival *after* the call returned);
* a put (``put``, ``put_parts``): the same host work, then the bytes on an
  egress :class:`~layerlift.overlap.link.EmulatedLink` of the instance's NIC
  rate (a NIC is full duplex: puts do not share the wire with restores).

Nothing is charged for ``exists``, sessions or ``remove``. The charged
seconds are counted (:attr:`HostCostStore.charged`) and reported beside the
figures. Thread-safe: the counters are under a lock; the inner store is
thread-safe by contract.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from layerlift.linker.integrity import checksums
from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.overlap.link import EmulatedLink

__all__ = ["HostCostStore", "HostRates", "measure_rates"]


@dataclass(frozen=True, slots=True)
class HostRates:
    """Seconds per byte of the CRC-32C check and of one memory copy."""

    crc_s_per_byte: float
    copy_s_per_byte: float

    def __post_init__(self) -> None:
        if self.crc_s_per_byte < 0 or self.copy_s_per_byte < 0:
            raise ValueError(f"host rates must be >= 0, got {self}")

    @property
    def per_byte(self) -> float:
        return self.crc_s_per_byte + self.copy_s_per_byte


def measure_rates(nbytes: int = 64 << 20, slice_bytes: int = 256 << 10,
                  repeats: int = 3) -> HostRates:
    """The best of ``repeats`` passes here over ``nbytes`` (more than the
    caches hold): the engine's own check (``linker.integrity.checksums``,
    one CRC-32C per ``slice_bytes`` slice, as a restore verifies a layer)
    and one memory copy."""
    if nbytes < slice_bytes or slice_bytes < 1:
        raise ValueError(f"need nbytes >= slice_bytes >= 1, got {nbytes}, {slice_bytes}")
    n = nbytes // slice_bytes
    src = ctypes.create_string_buffer(n * slice_bytes)
    dst = ctypes.create_string_buffer(n * slice_bytes)
    ctypes.memset(src, 0x5A, n * slice_bytes)  # touched: not the shared zero page
    ctypes.memset(dst, 0, n * slice_bytes)
    base = ctypes.addressof(src)
    ptrs = [base + i * slice_bytes for i in range(n)]
    seeds = list(range(n))
    crc, copy = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        checksums(ptrs, slice_bytes, seeds)
        t1 = time.perf_counter()
        ctypes.memmove(dst, src, n * slice_bytes)
        t2 = time.perf_counter()
        crc.append(t1 - t0)
        copy.append(t2 - t1)
    return HostRates(min(crc) / (n * slice_bytes), min(copy) / (n * slice_bytes))


@dataclass
class Charged:
    """What a :class:`HostCostStore` charged so far (seconds, bytes)."""

    read_host_s: float = 0.0
    put_host_s: float = 0.0
    read_bytes: int = 0
    put_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, read: bool, host_s: float, nbytes: int) -> None:
        with self._lock:
            if read:
                self.read_host_s += host_s
                self.read_bytes += nbytes
            else:
                self.put_host_s += host_s
                self.put_bytes += nbytes

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {"read_host_s": self.read_host_s, "put_host_s": self.put_host_s,
                    "read_bytes": float(self.read_bytes), "put_bytes": float(self.put_bytes)}


class HostCostStore(ForwardingStore):
    """``inner`` with the host work of the missing bytes charged (see the
    module docstring). ``token_scale`` >= 1; ``ingress_gbps`` / ``egress``
    the instance's NIC (None: no link is modelled, nothing beyond the host
    work is charged). Closing it does not close ``inner`` (it is shared)."""

    def __init__(self, inner: Store, *, token_scale: int, rates: HostRates,
                 ingress_gbps: float | None, egress: EmulatedLink | None) -> None:
        if token_scale < 1:
            raise ValueError(f"token_scale must be >= 1, got {token_scale}")
        if ingress_gbps is not None and not ingress_gbps > 0:
            raise ValueError(f"ingress_gbps must be > 0, got {ingress_gbps}")
        super().__init__(inner)
        self.token_scale = token_scale
        self.rates = rates
        self.ingress_gbps = ingress_gbps
        self.egress = egress
        self.charged = Charged()

    def _extra(self, nbytes: int) -> float:
        return (self.token_scale - 1) * nbytes * self.rates.per_byte

    def _after_read(self, nbytes: int) -> None:
        host = self._extra(nbytes)
        wire = nbytes / (self.ingress_gbps * 1e9) if self.ingress_gbps else 0.0
        self.charged.add(read=True, host_s=host, nbytes=nbytes)
        if host > 0:
            time.sleep(host + wire)

    def _charged_put(self, nbytes: int, put: Callable[[], None]) -> None:
        host = self._extra(nbytes)
        self.charged.add(read=False, host_s=host, nbytes=nbytes)
        if host > 0:
            time.sleep(host)  # the CRC and copy of the real page, before it is sent
        if self.egress is not None:
            self.egress.wrap(put, nbytes)()
        else:
            put()

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self._charged_put(sum(sizes), lambda: self.inner.put(keys, ptrs, sizes))

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self._charged_put(sum(sum(row) for row in sizes),
                          lambda: self.inner.put_parts(keys, ptrs, sizes))

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        got = self.inner.get(keys, ptrs, sizes)
        self._after_read(sum(n for n, ok in zip(sizes, got, strict=True) if ok))
        return got

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        self._after_read(sum(sum(row) for row in sizes))

    def close(self) -> None:
        """Nothing of ``inner`` is closed: the fleet shares it."""
