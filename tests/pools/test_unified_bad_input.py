"""Bad input raises PoolError with a sentence; nothing was partially done."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from layerlift.pools import (
    Component,
    KVPool,
    ModelSpec,
    PoolError,
    StaticKVPool,
    UnifiedKVPool,
)

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
SPEC = ModelSpec.preset("tiny")
TOTAL = 128 * SPEC.page_bytes(F)


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _prepared(kind: str) -> tuple[KVPool, dict[Component, torch.Tensor]]:
    pool: KVPool = (
        UnifiedKVPool(SPEC, TOTAL) if kind == "unified"
        else StaticKVPool(SPEC, TOTAL, fractions={F: 0.5, S: 0.3, M: 0.2})
    )
    pages: dict[Component, torch.Tensor] = {}
    for c in Component:
        got = pool.alloc(c, 3)
        assert got is not None
        pages[c] = got
    pool.pin(M, pages[M][:1])
    pool.free_deferred(S, pages[S][2:])
    return pool, pages


def _snapshot(pool: KVPool) -> tuple[object, ...]:
    sizes = tuple((pool.used_size(c), pool.available_size(c)) for c in Component)
    if isinstance(pool, UnifiedKVPool):
        arrays = tuple((a.used.tobytes(), a.pins.tobytes(), a.deferred.tobytes())
                       for a in pool.core.chain)
        return sizes + arrays
    return sizes


Case = Callable[[KVPool, dict[Component, torch.Tensor]], object]

CASES: dict[str, Case] = {
    "negative count": lambda p, g: p.alloc(F, -1),
    "non-int count": lambda p, g: p.alloc(F, 1.5),  # type: ignore[arg-type]
    "unknown component": lambda p, g: p.alloc("attention", 1),  # type: ignore[arg-type]
    "unknown component in can_alloc": lambda p, g: p.can_alloc({"kv": 1}),  # type: ignore[dict-item]
    "non-int count in can_alloc": lambda p, g: p.can_alloc({F: 1.5}),  # type: ignore[dict-item]
    "negative count in can_alloc": lambda p, g: p.can_alloc({S: -1}),
    "unknown component in free": lambda p, g: p.free("kv", g[F]),  # type: ignore[arg-type]
    "larger than the pool": lambda p, g: p.alloc(F, p.capacity(F) + 1),
    "negative in a joint demand": lambda p, g: p.alloc_many({F: 1, S: -2}),
    "double free": lambda p, g: (p.free(F, g[F][:1]), p.free(F, g[F][:2])),
    "free of a never-allocated page": lambda p, g: p.free(F, idx(int(g[F].max()) + 5)),
    "free out of range": lambda p, g: p.free(F, idx(10**6)),
    "negative index": lambda p, g: p.free(F, idx(-1)),
    "same page twice in one free": lambda p, g: p.free(F, idx(int(g[F][0]), int(g[F][0]))),
    "free of a pinned page": lambda p, g: p.free(M, g[M]),
    "free of a deferred page": lambda p, g: p.free(S, g[S][2:]),
    "deferred free twice": lambda p, g: p.free_deferred(S, g[S][2:]),
    "2-D indices": lambda p, g: p.free(F, g[F].reshape(1, -1)),
    "float indices": lambda p, g: p.free(F, g[F].float()),
    "pin of a free page": lambda p, g: p.pin(F, idx(int(g[F].max()) + 7)),
    "unpin of an unpinned page": lambda p, g: p.unpin(F, g[F][:1]),
    "unpin more than pinned": lambda p, g: p.unpin(M, torch.cat([g[M][:1], g[M][:1]])),
}

UNIFIED_ONLY: dict[str, Case] = {
    # (a static pool's regions add up to the buffer, so this is only a shortage there)
    "joint demand larger than the pool": lambda p, g: p.alloc_many(
        {c: p.capacity(c) for c in Component}),
    "move of a pinned page": lambda p, g: p.move_pages(M, g[M][:1], idx(0)),  # type: ignore[attr-defined]
    "move onto a used page": lambda p, g: p.move_pages(M, g[M][1:2], g[M][2:3]),  # type: ignore[attr-defined]
    "move into a neighbour's region": lambda p, g: p.move_pages(M, g[M][1:2], idx(0)),  # type: ignore[attr-defined]
    "make_room bad side": lambda p, g: p.make_room("left", 10),  # type: ignore[attr-defined]
    "make_room negative size": lambda p, g: p.make_room("low", -1),  # type: ignore[attr-defined]
}


@pytest.mark.parametrize("kind", ["unified", "static"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_and_changes_nothing(kind: str, case: str) -> None:
    pool, pages = _prepared(kind)
    before = _snapshot(pool)
    with pytest.raises(PoolError) as info:
        CASES[case](pool, pages)
    assert len(str(info.value)) > 15  # a sentence, not a bare value
    pool.verify_byte_accounting()
    if case != "double free":  # its first free legitimately succeeded
        assert _snapshot(pool) == before


@pytest.mark.parametrize("case", sorted(UNIFIED_ONLY))
def test_unified_bad_moves(case: str) -> None:
    pool, pages = _prepared("unified")
    before = _snapshot(pool)
    with pytest.raises(PoolError):
        UNIFIED_ONLY[case](pool, pages)
    pool.verify_byte_accounting()
    assert _snapshot(pool) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: UnifiedKVPool(SPEC, 0),
        lambda: UnifiedKVPool(SPEC, -4096),
        lambda: UnifiedKVPool(SPEC, 100),  # smaller than one page
        lambda: StaticKVPool(SPEC, 0),
        lambda: StaticKVPool(SPEC, TOTAL, fractions={F: 1.0, S: 1.0}),
        lambda: StaticKVPool(SPEC, TOTAL, fractions={F: 1.0, S: 0.0, M: 1.0}),
        lambda: StaticKVPool(SPEC, TOTAL, fractions={F: 1.0, S: 1e-9, M: 1.0}),
    ],
)
def test_bad_construction(make: Callable[[], KVPool]) -> None:
    with pytest.raises(PoolError):
        make()


def test_zero_count_is_empty() -> None:
    for pool in (UnifiedKVPool(SPEC, TOTAL), StaticKVPool(SPEC, TOTAL)):
        out = pool.alloc(F, 0)
        assert out is not None and out.numel() == 0 and out.dtype == torch.int64
        pool.verify_byte_accounting()


def test_oversize_query_is_false_not_an_error() -> None:
    for pool in (UnifiedKVPool(SPEC, TOTAL), StaticKVPool(SPEC, TOTAL)):
        assert not pool.can_alloc({F: pool.capacity(F) + 1})
        pool.verify_byte_accounting()
