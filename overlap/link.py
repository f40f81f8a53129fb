"""Link emulation for the benchmark: a modeled NIC of B GB/s that costs no CPU.

On a 2-core machine a real loopback transfer competes with the forward for the cores, so
overlap gains are hidden (docs/design.md §5). `EmulatedLink.wrap(fetch, nbytes)` runs the
real copy, then *sleeps* until the modeled arrival time. Transfers share one wire: each
occupies it for `nbytes / bandwidth` starting when the previous one left it (a "busy
until" timestamp under a lock), and arrives `latency` after leaving it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class EmulatedLink:
    """A single NIC of `gbps` GB/s (10**9 bytes per second) and `latency_us` one-way latency.

    Thread-safe: wrapped fetches may run concurrently in any threads; they queue for the
    wire in the order they *started*. A fetch that raises does not sleep and releases
    nothing (its wire time stays booked, as a failed transfer's would).
    """

    gbps: float
    latency_us: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _busy_until: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.gbps}")
        if self.latency_us < 0:
            raise ValueError(f"link latency must be >= 0 us, got {self.latency_us}")

    @property
    def label(self) -> str:
        """How figures name this link, e.g. `emulated:25GB/s,5us`."""
        return f"emulated:{self.gbps:g}GB/s,{self.latency_us:g}us"

    def transfer_time(self, nbytes: int) -> float:
        """Seconds one uncontended transfer of `nbytes` takes (latency + serialisation)."""
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def _book(self, start: float, nbytes: int) -> float:
        """Reserve the wire for `nbytes` from `start` on; return the arrival time."""
        with self._lock:
            leave = max(start, self._busy_until) + nbytes / (self.gbps * 1e9)
            self._busy_until = leave
        return leave + self.latency_us * 1e-6

    def wrap(self, fetch: Callable[[], None], nbytes: int) -> Callable[[], None]:
        """A callable that runs `fetch` (the real copy) and returns at the modeled arrival."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")

        def emulated() -> None:
            arrival = self._book(time.perf_counter(), nbytes)
            fetch()
            delay = arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

        return emulated


def parse_link(spec: str) -> EmulatedLink | None:
    """`"emulated:GBPS[,LATENCY_US]"` -> EmulatedLink; `"mooncake"` -> None (the real path).

    Raises ValueError with the accepted forms otherwise.
    """
    text = spec.strip().lower()
    if text == "mooncake":
        return None
    usage = (
        f"bad link {spec!r}: use 'mooncake' or 'emulated:GBPS[,LATENCY_US]', e.g. 'emulated:25,5'"
    )
    if not text.startswith("emulated:"):
        raise ValueError(usage)
    parts = text.removeprefix("emulated:").split(",")
    if len(parts) > 2:
        raise ValueError(usage)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(usage) from None
    return EmulatedLink(*values)
