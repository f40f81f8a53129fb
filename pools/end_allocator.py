"""Sub-pool specs, per-sub-pool page accounting, and the END allocators.

A sub-pool's pages are *physical*: page ``i`` is bytes
``[i * unit_bytes, (i + 1) * unit_bytes)`` of the shared buffer. A
:class:`SubAllocator` only tracks which of its pages are used, pinned or
deferred; where it may place pages is decided by its kind (END or float) from
the byte bounds its chain neighbours leave it (see ``allocator.py``).

State fields are :class:`~layerlift.pools.capacity._CapacityField`s: every
mutation *rebinds* a fresh (read-only) array, which bumps the pool's capacity
epoch. That also makes :meth:`SubAllocator.clone` O(1) - a clone shares the
arrays and can never see a later in-place write - which is how the capacity
views simulate the shortfall ladder exactly (see ``allocator.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from layerlift.pools.base import PoolError
from layerlift.pools.capacity import CapacityEpoch, _CapacityField

__all__ = ["EndAllocator", "Grow", "SubAllocator", "SubPoolSpec", "as_index_array", "sub_errors"]

Grow = Literal["up", "down", "float"]
Side = Literal["low", "high"]


@dataclass(frozen=True, slots=True)
class SubPoolSpec:
    """One sub-pool of a unified buffer: its name, page size in bytes and how
    it grows (``"up"`` from byte 0, ``"down"`` from the top, ``"float"``
    between the two). Raises ``PoolError`` (a ``ValueError``) when invalid."""

    name: str
    unit_bytes: int
    grow: Grow

    _allowed_grow: ClassVar[tuple[str, ...]] = ("up", "down", "float")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PoolError(f"a sub-pool needs a non-empty name, got {self.name!r}")
        if isinstance(self.unit_bytes, bool) or not isinstance(self.unit_bytes, int):
            raise PoolError(f"unit_bytes of {self.name!r} must be an int, got {self.unit_bytes!r}")
        if self.unit_bytes <= 0:
            raise PoolError(f"unit_bytes of {self.name!r} must be positive, got {self.unit_bytes}")
        if self.grow not in self._allowed_grow:
            raise PoolError(
                f"grow of {self.name!r} must be one of {self._allowed_grow}, got {self.grow!r}"
            )


def as_index_array(indices: object, n_pages: int, what: str, *, unique: bool = True) -> np.ndarray:
    """Validate a 1-D int64 index tensor/array/list and return it as numpy.

    Raises ``PoolError`` for a wrong dtype or shape, an index outside
    ``[0, n_pages)`` or (with ``unique``) a repeated index."""
    arr = indices.numpy() if hasattr(indices, "numpy") else np.asarray(indices)
    if arr.ndim != 1:
        raise PoolError(f"{what}: indices must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise PoolError(f"{what}: indices must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n_pages):
        raise PoolError(f"{what}: index out of range [0, {n_pages})")
    if unique and np.unique(arr).size != arr.size:
        raise PoolError(f"{what}: the same page appears twice in one call")
    return arr


def _rebound(arr: np.ndarray, idx: np.ndarray, value: object) -> np.ndarray:
    """A writable copy of ``arr`` with ``arr[idx] = value`` (copy-on-write)."""
    out = arr.copy()
    out[idx] = value
    return out


class SubAllocator(ABC):
    """Page accounting of one sub-pool; subclasses decide placement.

    Only the pool's owner thread calls these. Public mutators validate first
    and raise ``PoolError`` before changing anything; ``take`` / ``release`` /
    ``relocate`` are internal (the caller has already validated)."""

    used = _CapacityField[np.ndarray]()
    pins = _CapacityField[np.ndarray]()  # refcounts; a pinned page never moves
    deferred = _CapacityField[np.ndarray]()  # freed, waiting to be unpinned
    n_used = _CapacityField[int]()  # redundant count: catches leaks / double counts

    def __init__(self, spec: SubPoolSpec, n_pages: int, epoch: CapacityEpoch) -> None:
        self.spec = spec
        self.n_pages = n_pages
        self._epoch = epoch
        self.used = np.zeros(n_pages, dtype=bool)
        self.pins = np.zeros(n_pages, dtype=np.int32)
        self.deferred = np.zeros(n_pages, dtype=bool)
        self.n_used = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def unit(self) -> int:
        return self.spec.unit_bytes

    def clone(self, epoch: CapacityEpoch) -> SubAllocator:
        """A copy sharing the (immutable) arrays, bumping ``epoch`` instead."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._epoch = epoch
        return new

    # ---- queries -----------------------------------------------------------
    def extent(self) -> tuple[int, int] | None:
        """``[lo, hi)`` page indices of the used pages, or ``None`` if empty."""
        if self.n_used == 0:
            return None
        used = self.used
        lo = int(used.argmax())
        hi = self.n_pages - int(used[::-1].argmax())
        return lo, hi

    def span(self) -> tuple[int, int] | None:
        """Bytes this sub-pool claims (its region, holes included); ``None``
        when empty, i.e. transparent to its neighbours."""
        ext = self.extent()
        return None if ext is None else (ext[0] * self.unit, ext[1] * self.unit)

    @abstractmethod
    def room(self, low_b: int, high_b: int) -> int:
        """Pages ``pick`` could return between neighbour bounds (bytes)."""

    @abstractmethod
    def pick(self, n: int, low_b: int, high_b: int) -> np.ndarray | None:
        """Which ``n`` free pages to take between the byte bounds ``low_b`` /
        ``high_b`` left by the neighbours, or ``None`` if they do not fit."""

    def movable(self) -> np.ndarray:
        """Boolean mask of pages that may be relocated (used and unpinned)."""
        mask: np.ndarray = self.used & (self.pins == 0)
        return mask

    # ---- validated mutators ------------------------------------------------
    def check_allocated(self, idx: np.ndarray, what: str) -> None:
        if not bool(self.used[idx].all()):
            bad = idx[~self.used[idx]][:4].tolist()
            raise PoolError(f"{what}: {self.name} pages {bad} are not allocated (double free?)")
        if bool(self.deferred[idx].any()):
            bad = idx[self.deferred[idx]][:4].tolist()
            raise PoolError(f"{what}: {self.name} pages {bad} were already freed (deferred)")

    def free(self, idx: np.ndarray) -> None:
        self.check_allocated(idx, "free")
        if bool((self.pins[idx] > 0).any()):
            bad = idx[self.pins[idx] > 0][:4].tolist()
            raise PoolError(
                f"free: {self.name} pages {bad} are pinned (an in-flight load writes into "
                "them); unpin first or use free_deferred"
            )
        self.release(idx)

    def free_deferred(self, idx: np.ndarray) -> None:
        self.check_allocated(idx, "free_deferred")
        self.deferred = _rebound(self.deferred, idx, True)

    def flush(self) -> np.ndarray:
        """Free every deferred page that is no longer pinned; returns them."""
        ready = np.flatnonzero(self.deferred & (self.pins == 0))
        if ready.size:
            self.deferred = _rebound(self.deferred, ready, False)
            self.release(ready)
        return ready

    def pin(self, idx: np.ndarray) -> None:
        self.check_allocated(idx, "pin")
        uniq, counts = np.unique(idx, return_counts=True)
        pins = self.pins.copy()
        pins[uniq] += counts.astype(np.int32)
        self.pins = pins

    def unpin(self, idx: np.ndarray) -> None:
        uniq, counts = np.unique(idx, return_counts=True)
        short = self.pins[uniq] < counts
        if bool(short.any()):
            raise PoolError(f"unpin: {self.name} pages {uniq[short][:4].tolist()} are not pinned")
        pins = self.pins.copy()
        pins[uniq] -= counts.astype(np.int32)
        self.pins = pins

    # ---- internal mutators (already validated) -----------------------------
    def take(self, idx: np.ndarray) -> None:
        assert not bool(self.used[idx].any()), "take: page already used"
        self.used = _rebound(self.used, idx, True)
        self.n_used = self.n_used + int(idx.size)

    def release(self, idx: np.ndarray) -> None:
        self.used = _rebound(self.used, idx, False)
        self.n_used = self.n_used - int(idx.size)

    def relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move the accounting of live unpinned pages ``src`` to free ``dst``."""
        assert bool(self.movable()[src].all()) and not bool(self.used[dst].any())
        used = self.used.copy()
        used[src] = False
        used[dst] = True
        deferred = self.deferred.copy()
        deferred[dst] = deferred[src]  # a deferred page stays deferred where it lands
        deferred[src] = False
        self.used = used
        self.deferred = deferred


class EndAllocator(SubAllocator):
    """An END sub-pool: ``up`` grows from byte 0, ``down`` from the top.

    ``alloc`` takes the lowest free pages (up) / highest free pages (down), so
    holes inside the region are reused before the frontier advances."""

    def __init__(self, spec: SubPoolSpec, n_pages: int, epoch: CapacityEpoch) -> None:
        assert spec.grow in ("up", "down")
        super().__init__(spec, n_pages, epoch)
        self.up = spec.grow == "up"

    def span(self) -> tuple[int, int] | None:
        ext = self.extent()
        if ext is None:
            return None
        return (0, ext[1] * self.unit) if self.up else (ext[0] * self.unit, self.n_pages * self.unit)

    def _window(self, low_b: int, high_b: int) -> tuple[int, int]:
        if self.up:
            return 0, min(self.n_pages, high_b // self.unit)
        return min(self.n_pages, -(-low_b // self.unit)), self.n_pages

    def room(self, low_b: int, high_b: int) -> int:
        lo, hi = self._window(low_b, high_b)
        return max(0, hi - lo - int(self.used[lo:hi].sum()))

    def pick(self, n: int, low_b: int, high_b: int) -> np.ndarray | None:
        lo, hi = self._window(low_b, high_b)
        free = np.flatnonzero(~self.used[lo:hi]) + lo
        if free.size < n:
            return None
        return free[:n] if self.up else free[::-1][:n].copy()

    def required_line(self, n: int) -> int:
        """The byte boundary this END needs free to take ``n`` more pages
        (up: its needed high edge; down: its needed low edge). Holes are
        reused first, so only the pages beyond the holes move the line."""
        ext = self.extent()
        if self.up:
            edge = 0 if ext is None else ext[1]
            return max(edge, self.n_used + n) * self.unit
        edge = self.n_pages if ext is None else ext[0]
        return min(edge, self.n_pages - self.n_used - n) * self.unit

    def compact_plan(self) -> tuple[np.ndarray, np.ndarray]:
        """Moves that fill this END's holes with its outermost movable pages,
        pulling its frontier back toward its own edge (pinned pages stay)."""
        ext = self.extent()
        if ext is None:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        lo, hi = ext
        region = slice(0, hi) if self.up else slice(lo, self.n_pages)
        base = region.start
        holes = np.flatnonzero(~self.used[region]) + base
        movers = np.flatnonzero(self.movable()[region] & ~self.deferred[region]) + base
        if self.up:  # lowest holes <- highest pages
            holes, movers = holes, movers[::-1]
            k = min(holes.size, movers.size)
            m = int((holes[:k] < movers[:k]).sum())
        else:  # highest holes <- lowest pages
            holes = holes[::-1]
            k = min(holes.size, movers.size)
            m = int((holes[:k] > movers[:k]).sum())
        return movers[:m].copy(), holes[:m].copy()


def sub_errors(subs: Sequence[SubAllocator]) -> list[str]:
    """Per-sub-pool accounting errors: shapes, ``n_used`` vs the used mask
    (leaks / double counts), negative pins, pins or deferrals of free pages."""
    errors: list[str] = []
    for a in subs:
        used, pins, deferred = a.used, a.pins, a.deferred
        for field, arr, dtype in (("used", used, bool), ("pins", pins, np.int32),
                                  ("deferred", deferred, bool)):
            if arr.shape != (a.n_pages,) or arr.dtype != dtype:
                errors.append(f"{a.name}.{field} has shape {arr.shape} dtype {arr.dtype}")
        if errors:
            return errors
        count = int(used.sum())
        if count != a.n_used:
            errors.append(f"{a.name}: {count} pages marked used but n_used={a.n_used} "
                          "(leaked or double-counted pages)")
        if bool((pins < 0).any()):
            errors.append(f"{a.name}: negative pin counts at {np.flatnonzero(pins < 0)[:4]}")
        if bool((pins > 0)[~used].any()):
            errors.append(f"{a.name}: pinned pages {np.flatnonzero((pins > 0) & ~used)[:4]} "
                          "are not allocated")
        if bool(deferred[~used].any()):
            errors.append(f"{a.name}: deferred pages {np.flatnonzero(deferred & ~used)[:4]} "
                          "are not allocated (double free)")
    return errors
