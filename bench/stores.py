"""What the TTFT benchmark runs on: grid points, the shared store(s) of a link
mode, and the pool and store sizes a grid needs."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["LinkStores", "Point", "pool_bytes", "store_bytes"]


@dataclass(frozen=True, slots=True)
class Point:
    preset: str
    prefix: int
    suffix: int
    batch: int


class _TrackingStore:
    """Delegates to a store and remembers the keys put, so a point can be removed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.put_keys: list[str] = []

    def put(self, keys: Sequence[str], *args: Any, **kw: Any) -> Any:
        out = self._inner.put(keys, *args, **kw)
        self.put_keys.extend(keys)
        return out

    def put_parts(self, keys: Sequence[str], *args: Any, **kw: Any) -> Any:
        out = self._inner.put_parts(keys, *args, **kw)  # the engine's offload: page + footer
        self.put_keys.extend(keys)
        return out

    def forget(self) -> None:
        keys, self.put_keys = self.put_keys, []
        for i in range(0, len(keys), 512):
            # a lease still held refuses it: harmless, the keys are namespaced per point
            with contextlib.suppress(Exception):
                self._inner.remove(keys[i:i + 512])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LinkStores:
    """The store(s) of one link mode; ``store`` is what the engines get injected."""

    def __init__(self, link: str, segment_bytes: int) -> None:
        self.link = link
        self.master = None
        self._closers: list[Any] = []
        if link.startswith("cluster:"):  # a master and a storage node elsewhere (netns link)
            from layerlift.engine.stores import route_source
            from layerlift.linker.mooncake_config import MooncakeConfig
            from layerlift.linker.mooncake_store import MooncakeStore

            address = link.removeprefix("cluster:")
            client = MooncakeStore(MooncakeConfig(
                master_address=address, local_hostname=route_source(address),
                global_segment_size=0, local_buffer_size=16 << 20, timeout_s=60.0))
            self._closers.append(client)
            inner: Any = client
            self.engine_link: str | None = None
        elif parse_link(link) is None:  # mooncake
            from layerlift.linker.master import EmbeddedMaster
            from layerlift.linker.mooncake_store import MooncakeStore

            # A read lease covers a whole batch's restore (all layers, read while the
            # forward runs): the embedded default of 50 ms expires mid-restore on a busy
            # 2-core machine (LEASE_EXPIRED), so give it seconds, as `layerlift master` does.
            self.master = EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False).start()
            try:
                holder = MooncakeStore(self.master.config(global_segment_size=segment_bytes,
                                                          timeout_s=60.0))
                self._closers.append(holder)
                client = MooncakeStore(self.master.config(global_segment_size=0,
                                                          local_buffer_size=16 << 20,
                                                          timeout_s=60.0))
                self._closers.insert(0, client)
            except BaseException:
                self.close()
                raise
            inner = client
            self.engine_link = None
        else:
            inner = MemoryStore(timeout_s=60.0)
            self._closers.append(inner)
            self.engine_link = link
        self.store = _TrackingStore(inner)

    def close(self) -> None:
        for s in self._closers:
            with contextlib.suppress(Exception):
                s.close()
        self._closers.clear()
        if self.master is not None:
            self.master.stop()
            self.master = None


def pool_bytes(spec: ModelSpec, points: Sequence[Point]) -> int:
    need = 0
    for p in points:
        pages = p.batch * (math.ceil((p.prefix + p.suffix) / spec.page_size) + 2)
        per = spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)
        slots = p.batch * (3 + (p.prefix + p.suffix) // spec.track_interval + 2)
        need = max(need, 2 * pages * per + slots * spec.page_bytes(Component.MAMBA))
    return need + (8 << 20)


def store_bytes(spec: ModelSpec, points: Sequence[Point]) -> int:
    per_tok = (spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)) / spec.page_size
    # every point's prefixes (removal after a point may be refused while a lease is held)
    toks = sum(p.batch * p.prefix for p in points)
    ckpt = sum(p.batch * (p.prefix // spec.track_interval + 1) for p in points)
    return int(1.25 * (toks * per_tok + ckpt * spec.page_bytes(Component.MAMBA))) + (64 << 20)
