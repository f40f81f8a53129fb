"""Table-driven hit-rule cases: which page counts b can restore.

A boundary b is restorable from the device boundary d iff FULL pages
``[d, b)``, the SWA window ``[max(d, b - W), b)`` and a MAMBA checkpoint at
exactly b are in the store (b on the track grid, or a branch page where a
checkpoint was taken off it); d itself always is.
"""

from __future__ import annotations

import numpy as np
import pytest

from layerlift.linker.components import make_linkers
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest, PoolTransfer
from layerlift.linker.keys import KeySchema
from layerlift.linker.restorable import choose_boundary, intersect_ranks, restorable_boundaries
from layerlift.pools import Component, ModelSpec, UnifiedKVPool
from layerlift.pools.hashing import page_hashes
from layerlift.pools.tree import UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA


def make_spec(page_size: int, window_pages: int, track_pages: int) -> ModelSpec:
    return ModelSpec.preset("tiny", page_size=page_size, swa_window=window_pages * page_size,
                            track_interval=track_pages * page_size)


def lookup(spec: ModelSpec, d: int, n: int) -> dict[Component, PoolTransfer | None]:
    pool = UnifiedKVPool(spec, 4 * sum(spec.page_bytes(c) for c in Component))
    linkers = make_linkers(spec, pool, UnifiedRadixTree(spec, pool),
                           KeySchema("test", spec.fingerprint, 0))
    hashes = tuple(page_hashes(np.arange(n * spec.page_size), spec.page_size))
    req = LinkRequest(hashes, d)
    return {c: lk.build_transfer(LinkerTransferPhase.LOOKUP, request=req)
            for c, lk in linkers.items()}


def restorable(spec: ModelSpec, d: int, n: int, *, no_full: set[int] = frozenset(),
               no_swa: set[int] = frozenset(), ckpts: set[int] | None = None) -> frozenset[int]:
    """The store holds every page except ``no_full``/``no_swa`` and the
    checkpoints ``ckpts`` (default: every one on the track grid)."""
    transfers = lookup(spec, d, n)
    t = spec.track_pages
    have = {F: lambda p: p not in no_full, S: lambda p: p not in no_swa,
            M: lambda b: b % t == 0 if ckpts is None else b in ckpts}
    exists = {c: [have[c](p) for p in t.pages] for c, t in transfers.items() if t is not None}
    return restorable_boundaries(spec, d, n, transfers, exists)


# (page_size, W, T, n, d, no_full, no_swa, ckpts, expected)
CASES = [
    # the seed rule: KV and SWA complete, a checkpoint only at the full prefix's tail
    (4, 2, 2, 8, 0, set(), set(), {8}, {0, 8}),
    (4, 2, 2, 8, 0, set(), set(), None, {0, 2, 4, 6, 8}),
    (1, 2, 2, 8, 0, {3}, set(), None, {0, 2}),
    (4, 2, 2, 8, 0, set(), {3}, None, {0, 2, 6, 8}),
    (4, 2, 2, 8, 0, set(), {1}, None, {0, 4, 6, 8}),
    (2, 4, 2, 8, 0, set(), {0}, None, {0, 6, 8}),  # window clipped at 0 for b = 2, 4
    (2, 4, 2, 8, 4, set(), {3}, None, {4, 6, 8}),  # pages before d are the device's
    (2, 4, 2, 8, 4, {3}, set(), None, {4, 6, 8}),
    (4, 1, 4, 10, 0, set(), set(), None, {0, 4, 8}),  # 10 is not a multiple of T
    (4, 2, 4, 10, 2, set(), set(), None, {2, 4, 8}),  # d need not be a multiple of T
    (4, 2, 2, 8, 8, set(), set(), None, {8}),  # nothing beyond the device
    (4, 2, 2, 8, 0, set(), set(), set(), {0}),  # no checkpoint at all
    (4, 8, 2, 8, 0, set(), {7}, {4, 8}, {0, 4}),
    (16, 2, 1, 3, 0, {2}, set(), {1, 3}, {0, 1}),
    # a branch checkpoint off the grid (page 3) is a boundary like any other
    (4, 2, 2, 8, 0, set(), set(), {3, 8}, {0, 3, 8}),
    (4, 2, 4, 10, 0, set(), set(), {4, 7, 8}, {0, 4, 7, 8}),
    (4, 2, 4, 10, 0, set(), {5}, {4, 7, 8}, {0, 4, 8}),  # 7's window lacks page 5
]


@pytest.mark.parametrize(("ps", "w", "t", "n", "d", "no_full", "no_swa", "ckpts", "expected"),
                         CASES)
def test_hit_rule_table(ps: int, w: int, t: int, n: int, d: int, no_full: set[int],
                        no_swa: set[int], ckpts: set[int] | None, expected: set[int]) -> None:
    spec = make_spec(ps, w, t)
    assert restorable(spec, d, n, no_full=no_full, no_swa=no_swa, ckpts=ckpts) == expected


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_a_missing_page_at_every_position(w: int, t: int) -> None:
    spec, n = make_spec(2, w, t), 9
    cands = set(range(t, n + 1, t))
    for p in range(n):
        assert restorable(spec, 0, n, no_full={p}) == {0} | {b for b in cands if b <= p}
        assert restorable(spec, 0, n, no_swa={p}) == {0} | {
            b for b in cands if not max(0, b - w) <= p < b}
    for b_missing in cands:
        assert restorable(spec, 0, n, ckpts=cands - {b_missing}) == {0} | (cands - {b_missing})


def test_multi_rank_intersection_and_choice() -> None:
    spec = make_spec(4, 2, 2)
    rank0 = restorable(spec, 0, 8, no_swa={3})        # {0, 2, 6, 8}
    rank1 = restorable(spec, 0, 8, ckpts={2, 4, 8})    # {0, 2, 4, 8}
    both = intersect_ranks([rank0, rank1])
    assert both == {0, 2, 8} and choose_boundary(both) == 8
    rank2 = restorable(spec, 0, 8, no_full={5})        # {0, 2, 4}
    assert choose_boundary(intersect_ranks([rank0, rank1, rank2])) == 2


def test_a_component_without_answers_restores_nothing() -> None:
    spec = make_spec(4, 2, 2)
    transfers = lookup(spec, 0, 8)
    exists = {F: [True] * len(transfers[F].pages), S: [True] * len(transfers[S].pages)}
    assert restorable_boundaries(spec, 0, 8, transfers, exists) == {0}


def test_bad_answers_raise() -> None:
    spec = make_spec(4, 2, 2)
    transfers = lookup(spec, 0, 8)
    exists = {c: [True] * len(t.pages) for c, t in transfers.items()}
    exists[M] = exists[M][:-1]
    with pytest.raises(ValueError, match="existence answers"):
        restorable_boundaries(spec, 0, 8, transfers, exists)
    with pytest.raises(ValueError, match="at least one rank"):
        intersect_ranks([])
    with pytest.raises(ValueError, match="empty"):
        choose_boundary(frozenset())


def test_keys_of_another_fingerprint_never_match() -> None:
    spec, other = make_spec(4, 2, 2), make_spec(4, 2, 4)
    transfers = lookup(other, 0, 8)
    exists = {c: [True] * len(t.pages) for c, t in transfers.items()}
    with pytest.raises(ValueError, match="fingerprint"):
        restorable_boundaries(spec, 0, 8, transfers, exists,
                              schema=KeySchema("test", spec.fingerprint, 0))
