"""``StaticKVPool``: the baseline with three fixed regions, no moves.

The buffer is split once, at construction, into FULL | MAMBA | SWA byte
regions by ``fractions``; a component can never use another's idle bytes.
This is what the unified pool is measured against (``layerlift bench pools``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from layerlift.pools.base import KVPool, MoveListener, PoolAccountingError, PoolError
from layerlift.pools.capacity import CapacityEpoch
from layerlift.pools.end_allocator import SubAllocator, SubPoolSpec, as_index_array, sub_errors
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.unified import component_of

__all__ = ["StaticKVPool", "typical_demand"]

_ORDER = (Component.FULL, Component.MAMBA, Component.SWA)


def typical_demand(spec: ModelSpec, tokens: int = 2048) -> dict[Component, int]:
    """Pages one typical request of ``tokens`` tokens holds: every FULL page,
    the SWA window (+1 page being written), and two MAMBA slots (the working
    state and the checkpoint at its cached prefix boundary)."""
    full = math.ceil(tokens / spec.page_size)
    return {
        Component.FULL: full,
        Component.SWA: min(full, spec.window_pages + 1),
        Component.MAMBA: 2,
    }


class _Region(SubAllocator):
    """A sub-pool confined to page indices ``[lo, hi)``; takes lowest free."""

    def __init__(self, spec: SubPoolSpec, n_pages: int, lo: int, hi: int, epoch: CapacityEpoch) -> None:
        super().__init__(spec, n_pages, epoch)
        self.lo, self.hi = lo, hi

    def room(self, low_b: int = 0, high_b: int = 0) -> int:
        return self.hi - self.lo - self.n_used

    def pick(self, n: int, low_b: int = 0, high_b: int = 0) -> np.ndarray | None:
        free = np.flatnonzero(~self.used[self.lo : self.hi]) + self.lo
        return free[:n] if free.size >= n else None


class StaticKVPool(KVPool):
    """Three fixed regions of one ``total_bytes`` buffer.

    ``fractions`` maps each component to its share of the bytes (normalized;
    default: proportional to :func:`typical_demand`). Same interface as
    :class:`UnifiedKVPool`; nothing ever moves, so move listeners are never
    called. Raises ``PoolError`` for a non-positive size, a missing or
    non-positive fraction, or a region too small for one page."""

    def __init__(
        self,
        spec: ModelSpec,
        total_bytes: int,
        fractions: Mapping[Component, float] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise PoolError(f"total_bytes must be a positive int, got {total_bytes!r}")
        self.spec = spec
        self.fractions = self._normalize(spec, fractions)
        self.buffer = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self._epoch = CapacityEpoch()
        self._regions: dict[Component, _Region] = {}
        start = 0
        for i, c in enumerate(_ORDER):
            end = total_bytes if i == len(_ORDER) - 1 else start + int(total_bytes * self.fractions[c])
            unit = spec.page_bytes(c)
            lo, hi = -(-start // unit), end // unit
            if hi <= lo:
                raise PoolError(f"the {c.value} region ({end - start} bytes) cannot hold one page")
            sub_spec = SubPoolSpec(c.value, unit, "up")
            self._regions[c] = _Region(sub_spec, total_bytes // unit, lo, hi, self._epoch)
            start = end

    @staticmethod
    def _normalize(spec: ModelSpec, fractions: Mapping[Component, float] | None) -> dict[Component, float]:
        if fractions is None:
            demand = typical_demand(spec)
            fractions = {c: demand[c] * spec.page_bytes(c) for c in _ORDER}
        given = {component_of(c): float(f) for c, f in fractions.items()}
        missing = [c.value for c in _ORDER if c not in given]
        if missing or any(f <= 0 or not math.isfinite(f) for f in given.values()):
            raise PoolError(f"fractions need a positive share for every component, got {fractions!r}")
        total = sum(given.values())
        return {c: given[c] / total for c in _ORDER}

    def _sub(self, component: Component) -> _Region:
        return self._regions[component_of(component)]

    def region(self, component: Component) -> tuple[int, int]:
        """Page indices ``[lo, hi)`` of ``component``'s fixed region."""
        r = self._sub(component)
        return r.lo, r.hi

    # ---- allocation ----------------------------------------------------------
    def alloc(self, component: Component, n: int) -> torch.Tensor | None:
        c = component_of(component)
        out = self.alloc_many({c: n})
        return None if out is None else out[c]

    def alloc_many(self, demand: Mapping[Component, int]) -> dict[Component, torch.Tensor] | None:
        named = self._check(demand)
        assert named is not None
        if not self._fits(named):
            self.flush_deferred()  # the only rung a static pool has
            if not self._fits(named):
                return None
        out: dict[Component, torch.Tensor] = {}
        for c, n in named.items():
            r = self._regions[c]
            idx = r.pick(n)
            assert idx is not None
            r.take(idx)
            out[c] = torch.from_numpy(np.array(idx, dtype=np.int64))
        return out

    def _check(
        self, demand: Mapping[Component, int], *, oversize_ok: bool = False
    ) -> dict[Component, int] | None:
        """Validated demand; ``PoolError`` on misuse. A count larger than its
        region raises too, unless ``oversize_ok`` (then ``None``)."""
        named: dict[Component, int] = {}
        oversize = False
        for c, n in demand.items():
            comp = component_of(c)
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
                raise PoolError(f"page count for {comp.value} must be a non-negative int, got {n!r}")
            r = self._regions[comp]
            if n > r.hi - r.lo:
                if not oversize_ok:
                    raise PoolError(f"{n} {comp.value} pages exceed its region ({r.hi - r.lo} pages)")
                oversize = True
            named[comp] = int(n)
        return None if oversize else named

    def _fits(self, named: Mapping[Component, int]) -> bool:
        return all(self._regions[c].room() >= n for c, n in named.items())

    def free(self, component: Component, indices: torch.Tensor) -> None:
        r = self._sub(component)
        r.free(as_index_array(indices, r.n_pages, "free"))

    def free_deferred(self, component: Component, indices: torch.Tensor) -> None:
        r = self._sub(component)
        r.free_deferred(as_index_array(indices, r.n_pages, "free_deferred"))

    def flush_deferred(self) -> int:
        return sum(int(r.flush().size) for r in self._regions.values())

    def pin(self, component: Component, indices: torch.Tensor) -> None:
        r = self._sub(component)
        r.pin(as_index_array(indices, r.n_pages, "pin", unique=False))

    def unpin(self, component: Component, indices: torch.Tensor) -> None:
        r = self._sub(component)
        r.unpin(as_index_array(indices, r.n_pages, "unpin", unique=False))

    # ---- capacity --------------------------------------------------------------
    def available_size(self, component: Component) -> int:
        r = self._sub(component)
        return r.room() + int((r.deferred & (r.pins == 0)).sum())

    def can_alloc(self, demand: Mapping[Component, int]) -> bool:
        named = self._check(demand, oversize_ok=True)
        return named is not None and all(self.available_size(c) >= n for c, n in named.items())

    def used_size(self, component: Component) -> int:
        return self._sub(component).n_used

    def capacity(self, component: Component) -> int:
        r = self._sub(component)
        return r.hi - r.lo

    def add_move_listener(self, listener: MoveListener) -> None:
        """Accepted for interface parity; a static pool never moves pages."""

    def verify_byte_accounting(self) -> None:
        errors = sub_errors(list(self._regions.values()))
        for c, r in self._regions.items():
            outside = np.flatnonzero(r.used[: r.lo]).size + np.flatnonzero(r.used[r.hi :]).size
            if outside:
                errors.append(f"{c.value}: {outside} used pages outside its region")
        if errors:
            raise PoolAccountingError("; ".join(errors))
