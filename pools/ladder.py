"""The shortfall ladder and the capacity views: functions of a chain of
sub-allocators, read through the :class:`Chain` protocol.

The ladder (flush deferred frees -> recheck -> the float opens the short side
-> recheck -> the ENDs compact, the float slides again -> recheck) is what
:meth:`~layerlift.pools.allocator.MultiEndedAllocator.relieve_for_alloc`
runs. The capacity views (``available_pages``, ``joint_fits``) answer "would
this fit?" by running that very ladder on an O(1) clone, so they are exact;
``verify_accounting`` recomputes them to catch a stale memo.

Imports run one way: ``capacity`` (epoch, memo) <- ``end_allocator`` (specs,
the sub-allocator base, ENDs) <- ``float_allocator`` <- this module <-
``allocator`` (the core that implements :class:`Chain`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Protocol

import numpy as np

from layerlift.pools.base import PoolAccountingError
from layerlift.pools.capacity import CapacityMemo
from layerlift.pools.end_allocator import EndAllocator, SubAllocator, sub_errors
from layerlift.pools.float_allocator import FloatAllocator

__all__ = [
    "Chain",
    "available_pages",
    "available_pages_search",
    "joint_fits",
    "overlap_error",
    "relieve_after_direct_failure",
    "verify_accounting",
]


class Chain(Protocol):
    """What the ladder and the views read and drive: the core allocator
    (:class:`~layerlift.pools.allocator.MultiEndedAllocator`)."""

    chain: list[SubAllocator]
    total_bytes: int
    _pos: dict[str, int]
    _memo: CapacityMemo

    def clone(self) -> Chain: ...
    def sub(self, name: str) -> SubAllocator: ...
    def bounds(self, pos: int) -> tuple[int, int]: ...
    def check_demand(self, demand: Mapping[str, int], *, oversize_ok: bool = False) -> bool: ...
    def fits_now(self, demand: Mapping[str, int]) -> bool: ...
    def relieve_for_alloc(self, demand: Mapping[str, int]) -> bool: ...
    def flush_deferred(self) -> int: ...
    def move(self, sub: SubAllocator, src: np.ndarray, dst: np.ndarray) -> None: ...
    def apply_plan(self, sub: SubAllocator,
                   plan: tuple[np.ndarray, np.ndarray] | None) -> bool: ...


# ---- the shortfall ladder (module level: it drives the whole chain) -----------
def relieve_after_direct_failure(core: Chain, demand: Mapping[str, int]) -> bool:
    """The shortfall ladder past the first (failed) direct attempt: flush
    deferred frees -> recheck -> the moving rungs. True once ``demand`` fits
    without further moves."""
    if core.flush_deferred() and core.fits_now(demand):
        return True
    # Rehearse the moving rungs on an O(1) clone (they are deterministic):
    # bytes are copied only when the ladder is known to succeed.
    return _moving_rungs(core.clone(), demand) and _moving_rungs(core, demand)


def _moving_rungs(core: Chain, demand: Mapping[str, int]) -> bool:
    """Float opens the short side -> recheck -> ENDs compact -> float again."""
    if _float_open_short_side(core, demand) and core.fits_now(demand):
        return True
    # Last rung: the ENDs fill their own holes (frontiers retreat toward
    # their edges), then the float slides again into the bytes they left.
    for end in (core.chain[0], core.chain[-1]):
        assert isinstance(end, EndAllocator)
        core.move(end, *end.compact_plan())
    if core.fits_now(demand):
        return True
    return _float_open_short_side(core, demand) and core.fits_now(demand)


def _float_open_short_side(core: Chain, demand: Mapping[str, int]) -> bool:
    """Move the float(s) next to the ENDs so that every END line of the
    demand vector is free and each such float keeps room for its own
    share. False when a pinned slot or the sizes make that impossible."""
    up, down = core.chain[0], core.chain[-1]
    assert isinstance(up, EndAllocator) and isinstance(down, EndAllocator)
    live = [(i, a) for i, a in enumerate(core.chain[1:-1], 1) if a.n_used > 0]
    if not live:
        return False
    (i0, first), (i1, last) = live[0], live[-1]
    assert isinstance(first, FloatAllocator) and isinstance(last, FloatAllocator)
    # An END with no demand keeps its side where it is (an empty END is
    # transparent: the float may use the bytes up to the buffer edge).
    a, b = int(demand.get(up.name, 0)), int(demand.get(down.name, 0))
    low_line = up.required_line(a) if a else core.bounds(i0)[0]
    high_line = down.required_line(b) if b else core.bounds(i1)[1]
    if first is last:
        plan = first.plan_window(low_line, high_line, demand.get(first.name, 0))
        return core.apply_plan(first, plan)
    top = core.bounds(i0)[1]
    if not core.apply_plan(first, first.plan_window(low_line, top, demand.get(first.name, 0))):
        return False
    bottom = core.bounds(i1)[0]
    return core.apply_plan(last, last.plan_window(bottom, high_line, demand.get(last.name, 0)))


# ---- the capacity views (pure functions of the allocator state) -------------
def joint_fits(core: Chain, demand: Mapping[str, int]) -> bool:
    """Would ``core.alloc_many(demand)`` succeed now? Runs the real ladder on
    an O(1) clone, so the answer is exact, not an estimate. A demand larger
    than the pool is simply ``False``; unknown names and negative or
    non-int counts raise ``PoolError``."""
    if not core.check_demand(demand, oversize_ok=True):
        return False
    return core.clone().relieve_for_alloc(demand)


def available_pages(core: Chain, name: str) -> int:
    """Most pages of ``name`` one ``alloc`` could return now, ladder included.

    Chains with at most one float use the closed form of the ladder's end
    state (:func:`_ladder_closed_form`); longer chains, and the tests that
    keep the closed form honest, use :func:`available_pages_search`."""
    if len(core.chain) <= 3:
        return _ladder_closed_form(core, name)
    return available_pages_search(core, name)


def available_pages_search(core: Chain, name: str) -> int:
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


def _ladder_closed_form(core: Chain, name: str) -> int:
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


def overlap_error(core: Chain) -> str | None:
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


def verify_accounting(core: Chain) -> None:
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


def _recompute(core: Chain, key: Hashable) -> object:
    assert isinstance(key, tuple) and len(key) == 2
    kind, arg = key
    if kind == "avail":
        return available_pages(core, arg)
    return joint_fits(core, dict(arg))
