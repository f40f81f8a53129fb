"""UnifiedKVPool / MultiEndedAllocator contract tests (hand-checked geometry)."""

from __future__ import annotations

import pytest
import torch

from layerlift.pools import (
    Component,
    ModelSpec,
    MultiEndedAllocator,
    PoolError,
    SubPoolSpec,
    UnifiedKVPool,
)

F, S, M = Component.FULL, Component.SWA, Component.MAMBA


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec.preset("tiny")  # FULL 8192 B, SWA 12288 B, MAMBA 15744 B per page


def make_pool(spec: ModelSpec, full_pages: int = 64) -> UnifiedKVPool:
    return UnifiedKVPool(spec, full_pages * spec.page_bytes(F))


def write_marker(pool: UnifiedKVPool, c: Component, page: int, value: int) -> None:
    view = pool.page_view(c, page)
    view[:8].view(torch.int64)[0] = value
    view[-8:].view(torch.int64)[0] = value


def read_marker(pool: UnifiedKVPool, c: Component, page: int) -> tuple[int, int]:
    view = pool.page_view(c, page)
    return int(view[:8].view(torch.int64)[0]), int(view[-8:].view(torch.int64)[0])


# ---- the 2-pool layout is a special case of the same N-pool code -------------
def _two_pool(order: str) -> MultiEndedAllocator:
    # a: 10 pages of 100 B growing up; b: 3 pages of 300 B (bytes [0, 900)) growing down
    a, b = SubPoolSpec("a", 100, "up"), SubPoolSpec("b", 300, "down")
    specs = {"ab": [a, b], "ba": [b, a], "afb": [a, SubPoolSpec("f", 50, "float"), b]}[order]
    return MultiEndedAllocator(1000, specs)


@pytest.mark.parametrize("order", ["ab", "ba", "afb"])
def test_two_pool_hand_checked(order: str) -> None:
    core = _two_pool(order)
    assert core.chain[0].name == "a" and core.chain[-1].name == "b"
    steps: list[tuple[str, str, int, list[int] | None, int, int]] = [
        # (op, pool, n or page, expected pages, expected a-avail, expected b-avail)
        ("alloc", "b", 1, [2], 6, 2),        # b takes its highest page: bytes [600, 900)
        ("alloc", "a", 6, [0, 1, 2, 3, 4, 5], 0, 0),  # a fills [0, 600): touches b
        ("alloc", "a", 1, None, 0, 0),       # no room: None, nothing changes
        ("free", "b", 2, None, 4, 1),        # b empty -> transparent: a may use [600, 1000)
        ("alloc", "a", 2, [6, 7], 2, 0),     # a's frontier at 800 B: b needs 600 B aligned
        ("free", "a", 7, None, 3, 0),        # frontier 700: ceil(700/300)=3 -> still no b page
        ("free", "a", 6, None, 4, 1),        # frontier 600: b page 2 fits again
        ("free", "a", 1, None, 5, 1),        # a hole below the frontier
        ("alloc", "a", 1, [1], 4, 1),        # holes first: frontier unchanged
        ("alloc", "b", 1, [2], 0, 0),
    ]
    for op, name, n, expected, avail_a, avail_b in steps:
        if op == "alloc":
            out = core.alloc_many({name: n})
            got = None if out is None else out[name].tolist()
            assert got == expected, (op, name, n)
        else:
            core.free(name, idx(n))
        core.verify_byte_accounting()
        assert (core.available_size("a"), core.available_size("b")) == (avail_a, avail_b)
    assert core.chain[0].span() == (0, 600) and core.chain[-1].span() == (600, 900)


def test_layout_validation() -> None:
    a, b, f = SubPoolSpec("a", 8, "up"), SubPoolSpec("b", 8, "down"), SubPoolSpec("f", 8, "float")
    for bad in ([a], [a, f], [a, SubPoolSpec("a", 8, "down")], [a, b, SubPoolSpec("c", 8, "up")]):
        with pytest.raises(PoolError):
            MultiEndedAllocator(64, bad)
    with pytest.raises(PoolError):
        MultiEndedAllocator(4, [a, b])  # smaller than one page
    for args in (("x", 0, "up"), ("x", -1, "up"), ("", 8, "up"), ("x", 8, "sideways")):
        with pytest.raises(PoolError):
            SubPoolSpec(*args)  # type: ignore[arg-type]
    core = MultiEndedAllocator(256, [b, SubPoolSpec("g", 8, "float"), f, a])
    assert [s.name for s in core.chain] == ["a", "g", "f", "b"]  # [up, floats in input order, down]


# ---- tri-pool placement ----------------------------------------------------------
def test_tri_pool_placement(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    assert pool.alloc(F, 3).tolist() == [0, 1, 2]
    assert pool.alloc(S, 2).tolist() == [41, 40]  # grow-down END: highest indices first
    # frontiers: FULL ends at 3*8192=24576 B, SWA starts at 40*12288=491520 B;
    # midpoint 258048 B -> slot 16 (16*15744=251904)
    mid = 16
    assert pool.alloc(M, 1).tolist() == [mid]  # an empty float starts at the midpoint
    # slots fitting: [ceil(24576/15744)=2, 491520//15744=31); gaps 14 below, 14 above:
    # ties extend upward
    assert pool.alloc(M, 3).tolist() == [17, 18, 19]
    pool.free(M, idx(mid))
    assert pool.alloc(M, 1).tolist() == [mid]  # a hole is reused first (zero copy)
    pool.verify_byte_accounting()


def test_empty_float_is_transparent(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    m = pool.alloc(M, 2)
    assert m is not None
    pool.free(M, m)
    n = pool.capacity(F)
    assert pool.available_size(F) == n
    assert pool.alloc(F, n) is not None  # grows through the float's old span
    pool.verify_byte_accounting()


# ---- data follows relocation ---------------------------------------------------
def _tracked(pool: UnifiedKVPool) -> dict[tuple[Component, int], int]:
    live: dict[tuple[Component, int], int] = {}

    def listener(c: Component, old: torch.Tensor, new: torch.Tensor) -> None:
        moved = {(c, o): live.pop((c, o)) for o in old.tolist()}
        for o, nw in zip(old.tolist(), new.tolist(), strict=True):
            live[(c, nw)] = moved[(c, o)]

    pool.add_move_listener(listener)
    return live


def _check_markers(pool: UnifiedKVPool, live: dict[tuple[Component, int], int]) -> None:
    for (c, page), value in live.items():
        assert read_marker(pool, c, page) == (value, value), (c, page)


def test_data_follows_make_room_and_compaction(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    live = _tracked(pool)
    counter = iter(range(1, 10**6))
    for c, n in ((M, 8), (F, 4), (S, 3)):
        pages = pool.alloc(c, n)
        assert pages is not None
        for p in pages.tolist():
            v = next(counter)
            write_marker(pool, c, p, v)
            live[(c, p)] = v
    m_pages = sorted(p for (c, p) in live if c is M)
    pool.free(M, idx(*m_pages[2:6:2]))
    for p in m_pages[2:6:2]:
        del live[(M, p)]
    assert pool.make_room("low", 4 * spec.page_bytes(M))
    _check_markers(pool, live)
    assert pool.make_room("high", 3 * spec.page_bytes(M))
    _check_markers(pool, live)
    pool.compact_holes()
    _check_markers(pool, live)
    got = pool.alloc(F, pool.available_size(F))  # the ladder slides the float up
    assert got is not None
    _check_markers(pool, live)
    pool.verify_byte_accounting()


# ---- pinned pages never move ----------------------------------------------------
def test_pinned_slot_never_moves(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    live = _tracked(pool)
    slots = pool.alloc(M, 4)
    assert slots is not None
    for s in slots.tolist():
        write_marker(pool, M, s, 1000 + s)
        live[(M, s)] = 1000 + s
    low = min(slots.tolist())
    pool.pin(M, idx(low))
    assert not pool.make_room("low", 20 * spec.page_bytes(M))  # the pin blocks that side
    assert read_marker(pool, M, low) == (1000 + low, 1000 + low)
    # FULL can grow up to the pinned slot, not past it
    limit = low * spec.page_bytes(M) // spec.page_bytes(F)
    assert pool.available_size(F) == limit
    assert pool.alloc(F, limit + 1) is None
    assert pool.alloc(F, limit) is not None
    assert (M, low) in live and read_marker(pool, M, low) == (1000 + low, 1000 + low)
    _check_markers(pool, live)
    pool.compact_holes()
    assert (M, low) in live
    with pytest.raises(PoolError):
        pool.move_pages(M, idx(low), idx(low + 10))
    pool.verify_byte_accounting()
    pool.unpin(M, idx(low))
    pool.verify_byte_accounting()


def test_ladder_works_around_pinned_high_slot(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    slots = pool.alloc(M, 4)
    assert slots is not None
    assert slots.tolist() == [16, 17, 18, 19]  # midpoint of the empty buffer
    pool.pin(M, idx(19))
    # slots 16..18 can slide above the pin, the pinned one stays: FULL may grow
    # up to 19*15744 = 299136 B -> 36 pages of 8192 B, no further.
    assert pool.available_size(F) == 36
    assert pool.alloc(F, 37) is None
    got = pool.alloc(F, 36)
    assert got is not None and got.tolist() == list(range(36))
    assert bool(pool.core.sub("mamba").used[19]) and pool.used_size(M) == 4
    assert sorted(torch.nonzero(torch.from_numpy(pool.core.sub("mamba").used.copy())).flatten().tolist()) == [19, 20, 21, 22]
    pool.verify_byte_accounting()


def test_deferred_free_waits_for_unpin(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    pages = pool.alloc(S, 3)
    assert pages is not None
    pool.pin(S, pages[:1])
    pool.free_deferred(S, pages)
    assert pool.used_size(S) == 3
    assert pool.flush_deferred() == 2
    assert pool.used_size(S) == 1
    pool.unpin(S, pages[:1])
    assert pool.flush_deferred() == 1
    assert pool.used_size(S) == 0
    pool.verify_byte_accounting()


def test_alloc_many_is_all_or_nothing(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    assert pool.alloc(F, 30) is not None
    before = {c: pool.used_size(c) for c in Component}
    assert not pool.can_alloc({F: 10, S: 10, M: 5})
    assert pool.alloc_many({F: 10, S: 10, M: 5}) is None
    assert {c: pool.used_size(c) for c in Component} == before
    pool.free(F, torch.arange(20, 30))
    before = {c: pool.used_size(c) for c in Component}
    assert {c: pool.used_size(c) for c in Component} == before
    assert pool.can_alloc({F: 10, S: 10, M: 5})
    out = pool.alloc_many({F: 10, S: 10, M: 5})
    assert out is not None and {c: len(v) for c, v in out.items()} == {F: 10, S: 10, M: 5}
    pool.verify_byte_accounting()


def test_coupled_demand_slides_float(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    m = pool.alloc(M, 2)
    assert m is not None
    # both ENDs short at once: the float must end up between the two new lines
    demand = {F: 25, S: 18}
    assert pool.can_alloc(demand)
    out = pool.alloc_many(demand)
    assert out is not None
    pool.verify_byte_accounting()
    assert pool.used_size(M) == 2


def test_relieve_for_alloc_is_the_ladder_alone(spec: ModelSpec) -> None:
    pool = make_pool(spec)
    live = _tracked(pool)
    slots = pool.alloc(M, 3)  # at the midpoint
    assert slots is not None
    for s in slots.tolist():
        write_marker(pool, M, s, 7 + s)
        live[(M, s)] = 7 + s
    demand = {F: 40}
    assert not pool.core.fits_now({"full": 40})
    assert pool.relieve_for_alloc(demand)  # moves the float, allocates nothing
    assert pool.used_size(F) == 0 and pool.core.fits_now({"full": 40})
    _check_markers(pool, live)
    assert not pool.relieve_for_alloc({F: 60})  # impossible: nothing moves
    assert pool.alloc(F, 40) is not None
    pool.verify_byte_accounting()
