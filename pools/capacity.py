"""Capacity memo invalidated *by construction*.

The capacity views (``available_size``, ``can_alloc``) are read by the
scheduler far more often than the allocator state changes, and computing them
walks the sub-pool chain (and, for exactness, simulates the shortfall ladder).
So they are memoized, keyed by an *epoch* that every state change bumps.

Rather than sprinkling ``invalidate()`` calls over every mutation site (and
forgetting one), every allocator state field is a :class:`_CapacityField` data
descriptor whose ``__set__`` bumps the shared epoch. The one constraint this
buys: state fields are **rebound, never mutated in place** (numpy arrays are
stored read-only to make an accidental in-place write raise). A write that
bypasses the descriptor (``obj.__dict__[...] = x``, flipping the writeable
flag) leaves a stale memo, which ``verify_byte_accounting`` catches by
recomputing and comparing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload

import numpy as np

from layerlift.pools.base import PoolAccountingError

if TYPE_CHECKING:
    from layerlift.pools.allocator import MultiEndedAllocator
    from layerlift.pools.end_allocator import SubAllocator

__all__ = [
    "CapacityEpoch",
    "CapacityMemo",
    "_CapacityField",
    "available_pages",
    "available_pages_search",
    "joint_fits",
    "overlap_error",
    "sub_errors",
    "verify_accounting",
]

T = TypeVar("T")


class CapacityEpoch:
    """A counter shared by all sub-allocators of one pool.

    Bumped by :class:`_CapacityField` on every rebind; read by
    :class:`CapacityMemo`. Single-threaded (the allocator's owner thread)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class _HasEpoch(Protocol):
    _epoch: CapacityEpoch


class _CapacityField(Generic[T]):
    """Data descriptor for one allocator state field.

    Assigning the attribute stores the value and bumps ``obj._epoch``; numpy
    arrays are frozen (``writeable = False``) so the rebind-only contract is
    enforced for the common mistake. Because it defines ``__set__``, even
    ``object.__setattr__`` goes through it; only a write into ``obj.__dict__``
    bypasses it (and is caught by the stale-memo check)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_cap_{name}"
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _CapacityField[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self._key]
        except KeyError:
            raise AttributeError(f"state field {self._name!r} was never set") from None

    def __set__(self, obj: _HasEpoch, value: T) -> None:
        if isinstance(value, np.ndarray) and value.flags.writeable:
            value.flags.writeable = False
        obj.__dict__[self._key] = value
        obj._epoch.bump()


class CapacityMemo:
    """Epoch-keyed cache: entries are valid only while the epoch is unchanged."""

    __slots__ = ("_entries", "_epoch", "_seen")

    def __init__(self, epoch: CapacityEpoch) -> None:
        self._epoch = epoch
        self._seen = epoch.value
        self._entries: dict[Hashable, Any] = {}

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The memoized value of ``key`` at the current epoch (computed on a miss)."""
        if self._seen != self._epoch.value:
            self._entries = {}
            self._seen = self._epoch.value
        if key not in self._entries:
            self._entries[key] = compute()
        value: T = self._entries[key]
        return value

    def current_entries(self) -> dict[Hashable, Any]:
        """Entries memoized at the current epoch (for ``verify_byte_accounting``)."""
        if self._seen != self._epoch.value:
            return {}
        return dict(self._entries)


# ---- the capacity views (pure functions of the allocator state) -------------
def joint_fits(core: MultiEndedAllocator, demand: Mapping[str, int]) -> bool:
    """Would ``core.alloc_many(demand)`` succeed now? Runs the real ladder on
    an O(1) clone, so the answer is exact, not an estimate. A demand larger
    than the pool is simply ``False``; unknown names and negative or
    non-int counts raise ``PoolError``."""
    if not core.check_demand(demand, oversize_ok=True):
        return False
    return core.clone().relieve_for_alloc(demand)


def available_pages(core: MultiEndedAllocator, name: str) -> int:
    """Most pages of ``name`` one ``alloc`` could return now, ladder included.

    Chains with at most one float use the closed form of the ladder's end
    state (:func:`_ladder_closed_form`); longer chains, and the tests that
    keep the closed form honest, use :func:`available_pages_search`."""
    if len(core.chain) <= 3:
        return _ladder_closed_form(core, name)
    return available_pages_search(core, name)


def available_pages_search(core: MultiEndedAllocator, name: str) -> int:
    """The reference: feasibility is monotone in the page count, so a binary
    search over exact ladder rehearsals (on clones) finds the maximum."""
    sub = core.sub(name)
    lo = sub.room(*core.bounds(core._pos[name]))  # fits now: known feasible
    hi = sub.n_pages - sub.n_used + int((sub.deferred & (sub.pins == 0)).sum())
    hi = min(hi, core.total_bytes // sub.unit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if core.clone().relieve_for_alloc({name: mid}):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _ladder_closed_form(core: MultiEndedAllocator, name: str) -> int:
    """Where the ladder ends for a request of ``name`` alone: flush, both
    ENDs compacted, then (for an END) the float packed against the far side
    as far as its pinned slots allow. Rehearsed on a clone; no search."""
    sim = core.clone()
    sim.flush_deferred()
    up, down = sim.chain[0], sim.chain[-1]
    for end in (up, down):
        sim.move(end, *end.compact_plan())  # type: ignore[attr-defined]
    sub = sim.sub(name)
    best = sub.room(*sim.bounds(sim._pos[name]))
    floats = sim.chain[1:-1]
    if sub.spec.grow == "float" or not floats or floats[0].n_used == 0:
        return best  # nothing left to slide: the compacted room is the answer
    f = floats[0]
    low_b, high_b = sim.bounds(1)
    pinned = np.flatnonzero(f.pins)
    if sub is up:  # the float may rise until a pin stops it or it hits the top
        top = min(f.n_pages, high_b // f.unit)
        limit = min(top - f.n_used, int(pinned.min()) if pinned.size else top)
        reach = min(sub.n_pages, limit * f.unit // sub.unit) - sub.n_used
    else:  # the float may sink until a pin stops it or it hits the bottom
        bottom = -(-low_b // f.unit)
        limit = max(bottom + f.n_used, int(pinned.max()) + 1 if pinned.size else bottom)
        reach = sub.n_pages - sub.n_used - (-(-limit * f.unit // sub.unit))
    return max(best, reach)


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


def overlap_error(core: MultiEndedAllocator) -> str | None:
    """A sentence naming two overlapping sub-pool regions, or None."""
    prev: tuple[str, int] | None = None
    for a in core.chain:
        span = a.span()
        if span is None:
            continue
        if span[1] > core.total_bytes:
            return f"{a.name} ends at byte {span[1]}, past the buffer ({core.total_bytes})"
        if prev is not None and span[0] < prev[1]:
            return f"{a.name} starts at byte {span[0]} inside {prev[0]} (ends at {prev[1]})"
        prev = (a.name, span[1])
    return None


def verify_accounting(core: MultiEndedAllocator) -> None:
    """Raise ``PoolAccountingError`` on overlapping regions, leaked or
    double-counted pages, pins or deferrals of free pages, or a capacity memo
    that differs from a fresh recomputation (a write that bypassed
    :class:`_CapacityField`)."""
    errors = sub_errors(core.chain)
    overlap = overlap_error(core) if not errors else None
    if overlap is not None:
        errors.append(overlap)
    if not errors:
        for key, value in core._memo.current_entries().items():
            fresh = _recompute(core, key)
            if fresh != value:
                errors.append(f"stale capacity memo: {key!r} memoized {value!r}, "
                              f"recomputed {fresh!r} (a state write bypassed the epoch)")
    if errors:
        raise PoolAccountingError("; ".join(errors))


def _recompute(core: MultiEndedAllocator, key: Hashable) -> object:
    assert isinstance(key, tuple) and len(key) == 2
    kind, arg = key
    if kind == "avail":
        return available_pages(core, arg)
    return joint_fits(core, dict(arg))
