"""Capacity memo: invalidated by construction (descriptor + epoch); a write
that bypasses the descriptor is caught by verify_byte_accounting."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from layerlift.pools import (
    Component,
    ModelSpec,
    PoolAccountingError,
    UnifiedKVPool,
)
from layerlift.pools.capacity import _CapacityField
from layerlift.pools.end_allocator import SubAllocator
from layerlift.pools.ladder import available_pages, joint_fits

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
SPEC = ModelSpec.preset("tiny")
DEMANDS = [{F: 4, S: 4, M: 1}, {F: 20}, {S: 15, M: 3}, {M: 6}]


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _pool() -> UnifiedKVPool:
    pool = UnifiedKVPool(SPEC, 48 * SPEC.page_bytes(F))
    for c, n in ((F, 6), (M, 5), (S, 4)):
        assert pool.alloc(c, n) is not None
    return pool


def _fill_memo(pool: UnifiedKVPool) -> None:
    for c in Component:
        pool.available_size(c)
    for d in DEMANDS:
        pool.can_alloc(d)


def _assert_fresh(pool: UnifiedKVPool) -> None:
    for c in Component:
        assert pool.available_size(c) == available_pages(pool.core, c.value), c
    for d in DEMANDS:
        assert pool.can_alloc(d) == joint_fits(pool.core, {k.value: v for k, v in d.items()})
    pool.verify_byte_accounting()


def _pages(pool: UnifiedKVPool, c: Component) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(pool.core.sub(c.value).used))


MUTATIONS: dict[str, Callable[[UnifiedKVPool], object]] = {
    "alloc": lambda p: p.alloc(F, 3),
    "alloc_many": lambda p: p.alloc_many({F: 1, S: 2, M: 1}),
    "failed alloc": lambda p: p.alloc(S, p.capacity(S)),
    "free": lambda p: p.free(F, _pages(p, F)[:2]),
    "free hole in float": lambda p: p.free(M, _pages(p, M)[2:3]),
    "free_deferred": lambda p: p.free_deferred(S, _pages(p, S)[:1]),
    "flush": lambda p: (p.free_deferred(S, _pages(p, S)[:2]), p.flush_deferred()),
    "pin": lambda p: p.pin(M, _pages(p, M)[:1]),
    "unpin": lambda p: (p.pin(M, _pages(p, M)[-1:]), p.unpin(M, _pages(p, M)[-1:])),
    # the FULL frontier is ~10.9 slots below the float: ask for more than that
    "make_room low": lambda p: p.make_room("low", 12 * SPEC.page_bytes(M)),
    "make_room high": lambda p: p.make_room("high", 3 * SPEC.page_bytes(M)),
    "compact": lambda p: (p.free(M, _pages(p, M)[1:2]), p.compact_holes()),
    "move_pages": lambda p: p.move_pages(M, _pages(p, M)[:1], idx(int(_pages(p, M).max()) + 1)),
    "ladder": lambda p: p.relieve_for_alloc({F: 22}),  # FULL up to 229376 B: slot 14 moves
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_memo_fresh_after_every_mutation(name: str) -> None:
    pool = _pool()
    _fill_memo(pool)
    epoch = pool.core.epoch
    MUTATIONS[name](pool)
    if name == "failed alloc":  # changed nothing, so nothing to invalidate
        assert pool.core.epoch == epoch
    else:
        assert pool.core.epoch > epoch, "a mutation did not bump the capacity epoch"
    _assert_fresh(pool)


def test_every_state_field_is_a_descriptor() -> None:
    # the invalidation is by construction only if every state field goes
    # through _CapacityField: list them by reflection
    fields = {k for k, v in vars(SubAllocator).items() if isinstance(v, _CapacityField)}
    assert fields == {"used", "pins", "deferred", "n_used"}
    pool = _pool()
    for sub in pool.core.chain:
        plain = {k for k in vars(sub) if not k.startswith("_cap_")}
        assert plain <= {"spec", "n_pages", "_epoch", "up"}, plain  # config, not state


def test_in_place_write_is_refused() -> None:
    pool = _pool()
    with pytest.raises(ValueError):
        pool.core.sub("full").used[40] = True  # arrays are stored read-only


def test_setattr_goes_through_the_descriptor() -> None:
    pool = _pool()
    _fill_memo(pool)
    sub = pool.core.sub("full")
    epoch = pool.core.epoch
    used = sub.used.copy()
    used[20] = True  # below the float (which starts at byte 220416)
    object.__setattr__(sub, "used", used)  # still the descriptor: the epoch moves
    object.__setattr__(sub, "n_used", sub.n_used + 1)
    assert pool.core.epoch == epoch + 2
    _assert_fresh(pool)


def test_bypassing_write_is_caught() -> None:
    pool = _pool()
    _fill_memo(pool)
    sub = pool.core.sub("full")
    used = sub.used.copy()
    used[6:20] = True  # the FULL frontier jumps (still below the float): capacities change
    vars(sub)["_cap_used"] = used  # bypasses the descriptor: no epoch bump
    vars(sub)["_cap_n_used"] = int(used.sum())  # counts agree, so only the memo is stale
    with pytest.raises(PoolAccountingError, match="stale capacity memo"):
        pool.verify_byte_accounting()


def test_in_place_mutation_after_unfreezing_is_caught() -> None:
    pool = _pool()
    _fill_memo(pool)
    arr = pool.core.sub("swa").used
    arr.flags.writeable = True
    arr[10] = True  # a leaked page: used but not counted
    with pytest.raises(PoolAccountingError):
        pool.verify_byte_accounting()


def test_float_span_move_invalidates_every_neighbour() -> None:
    pool = _pool()
    _fill_memo(pool)
    full_before, swa_before = pool.available_size(F), pool.available_size(S)
    room_f = pool.core.sub("full").room(*pool.core.bounds(0))
    assert pool.make_room("low", 12 * SPEC.page_bytes(M))
    # the float moved up: FULL has more room without moving, SWA less
    assert pool.core.sub("full").room(*pool.core.bounds(0)) > room_f
    assert (pool.available_size(F), pool.available_size(S)) == (full_before, swa_before)
    _assert_fresh(pool)
