"""Where a staged transfer's time goes: the transfer benchmark's profile.

:func:`profiled` times, for one sequential run on the calling thread, the
pieces of LayerLift's staged transfer that are not its own bookkeeping:

* ``store``: inside the store's data calls (``get``, ``get_ranges``, ``put``,
  ``put_parts``);
* ``session``: read sessions opened and ended;
* ``crc``: the CRC-32C checks of a load (``mismatches``) and the footers an
  offload computes (``footers``);
* ``copy``: a host sink's copy out of staging, a snapshot's copy into it
  (with the footers of a snapshot that checksums each slice as it copies
  it, as the hosts' CPU snapshot does: its ``crc`` is then 0);
* ``ring``: waiting for and taking staging regions;
* ``python``: the rest of the wall time (building the ranged call's lists,
  footer tables, chunk plans: the per-slice Python work).

A staged offload puts chunk ``k`` on its put thread while the calling
thread stages chunk ``k + 1``: its parts overlap, their sum exceeds the
wall time (``overlapped``) and the rest is not known.

It wraps the store's and ring's methods on those objects, and the two
checksum functions where the staged transfer looks them up, for the run
only (restored on exit, also on an error). Benchmark instrumentation: the
transfer itself is the one the engine and the hosts run.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from layerlift.linker import (
    load_core,
    load_in_place,
    sinks,
    staged_load,
    staged_offload,
)

__all__ = ["Profile", "profiled"]

PARTS = ("store", "session", "crc", "copy", "ring", "python")

CHECKING = (load_core, load_in_place, staged_load)
"""The load's modules that look ``mismatches`` up (the CRC checks of a load)."""


class Profile:
    """Seconds per part of one run (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.started = time.perf_counter()
        self.wall = 0.0

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timed(part):
                return fn(*args, **kwargs)

        return timed

    def split(self, layers: int, slices: int) -> dict[str, Any]:
        """The run's parts in ms, the rest as ``python``, and µs per layer
        and per slice of that rest."""
        known = sum(v for k, v in self.seconds.items() if k != "python")
        self.seconds["python"] = max(0.0, self.wall - known)
        return {"wall_ms": round(1e3 * self.wall, 2),
                # parts timed on two threads at once (the staged offload's put
                # thread): their sum exceeds the wall time, the rest is unknown
                "overlapped": known > self.wall,
                "ms": {k: round(1e3 * v, 2) for k, v in self.seconds.items()},
                "python_us_per_layer": round(1e6 * self.seconds["python"] / max(1, layers), 1),
                "python_us_per_slice": round(1e6 * self.seconds["python"] / max(1, slices), 2)}


@contextlib.contextmanager
def profiled(store: Any, ring: Any,
             snapshots: tuple[type, ...] = ()) -> Iterator[Profile]:
    """Time one run of a staged transfer over ``store`` and ``ring`` (see
    the module docstring); ``snapshots``: more snapshot classes whose
    ``read`` counts as ``copy``."""
    prof = Profile()
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, owner.__dict__.get(name) if isinstance(owner, ModuleType)
                        else None))
        setattr(owner, name, prof.wrap(part, original))

    for name in ("get", "get_ranges", "put", "put_parts"):
        patch(store, name, "store")
    original_session = store.open_session

    @contextlib.contextmanager
    def session(keys: Any) -> Iterator[None]:
        with prof.timed("session"):
            cm = original_session(keys)
            cm.__enter__()
        try:
            yield
        finally:
            with prof.timed("session"):
                cm.__exit__(None, None, None)

    patches.append((store, "open_session", None))
    store.open_session = session
    patch(ring, "acquire", "ring")
    for module in CHECKING:
        patch(module, "mismatches", "crc")
    patch(staged_offload, "footers", "crc")
    patch(sinks.HostSink, "write", "copy")
    patch(sinks.HostSnapshot, "read", "copy")
    for cls in snapshots:
        patch(cls, "read", "copy")
    try:
        yield prof
    finally:
        prof.wall = time.perf_counter() - prof.started
        for owner, name, module_value in reversed(patches):
            if isinstance(owner, ModuleType):
                setattr(owner, name, module_value)
            elif isinstance(owner, type):
                setattr(owner, name, getattr(owner, name).__wrapped__)
            else:
                delattr(owner, name)  # the instance attribute: the class's method again
