"""StaticKVPool: three fixed regions, same interface, nothing ever moves."""

from __future__ import annotations

import itertools

import pytest
import torch

from layerlift.pools import (
    Component,
    ModelSpec,
    PoolAccountingError,
    StaticKVPool,
    typical_demand,
)

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
SPEC = ModelSpec.preset("tiny")
TOTAL = 100 * SPEC.page_bytes(F)  # 819200 B


def test_regions_are_fixed_and_disjoint() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    # FULL [0, 409600): 50 pages; MAMBA [409600, 614400): slots 27..38;
    # SWA [614400, 819200): pages 50..66
    assert pool.region(F) == (0, 50)
    assert pool.region(M) == (27, 39)
    assert pool.region(S) == (50, 66)
    spans = sorted((lo * SPEC.page_bytes(c), hi * SPEC.page_bytes(c)) for c in Component
                   for lo, hi in [pool.region(c)])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert {c: pool.capacity(c) for c in Component} == {F: 50, M: 12, S: 16}


def test_alloc_stays_in_region_and_never_borrows() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    moved: list[object] = []
    pool.add_move_listener(lambda *a: moved.append(a))
    assert pool.alloc(M, 2).tolist() == [27, 28]
    assert pool.alloc(S, 16) is not None
    assert pool.available_size(S) == 0 and pool.alloc(S, 1) is None
    assert pool.available_size(F) == 50  # FULL idle, but SWA cannot use it
    assert not pool.can_alloc({S: 1, F: 1})
    assert pool.alloc_many({S: 1, F: 1}) is None and pool.used_size(F) == 0
    pool.verify_byte_accounting()
    assert moved == []


def test_flush_is_the_only_rung() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    pages = pool.alloc(M, 12)
    assert pages is not None
    pool.pin(M, pages[:1])
    pool.free_deferred(M, pages[:3])
    assert pool.available_size(M) == 2  # the pinned deferred slot is not reclaimable yet
    got = pool.alloc(M, 2)
    assert got is not None and sorted(got.tolist()) == [28, 29]
    assert pool.alloc(M, 1) is None
    pool.unpin(M, pages[:1])
    assert pool.alloc(M, 1).tolist() == [27]
    pool.verify_byte_accounting()


def test_default_fractions_follow_typical_demand() -> None:
    demand = typical_demand(SPEC)
    pool = StaticKVPool(SPEC, 4096 * SPEC.page_bytes(F))
    weights = {c: demand[c] * SPEC.page_bytes(c) for c in Component}
    total = sum(weights.values())
    for c in Component:
        assert pool.fractions[c] == pytest.approx(weights[c] / total)


def test_verify_catches_a_page_outside_its_region() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    sub = pool._regions[F]
    used = sub.used.copy()
    used[60] = True  # inside SWA's bytes
    sub.used = used
    sub.n_used = 1
    with pytest.raises(PoolAccountingError, match="outside its region"):
        pool.verify_byte_accounting()


def test_views_work_on_static_pool() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    slot = int(pool.alloc(M, 1)[0])
    layer = SPEC.layers_of(M)[0]
    _conv, ssm = pool.mamba_view(layer)
    ssm[slot].fill_(3.0)
    assert torch.all(pool.mamba_view(layer)[1][slot] == 3.0)


def test_relieve_for_alloc_only_flushes() -> None:
    pool = StaticKVPool(SPEC, TOTAL, fractions={F: 2, M: 1, S: 1})
    pages = pool.alloc(S, 16)
    assert pages is not None
    pool.free_deferred(S, pages[:2])
    assert pool.relieve_for_alloc({S: 2}) and pool.used_size(S) == 14
    assert not pool.relieve_for_alloc({S: 3})
    pool.verify_byte_accounting()
