"""Scenario tests of the unified radix tree over a real UnifiedKVPool."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

from layerlift.pools import Component, ModelSpec, UnifiedKVPool
from layerlift.pools.tree import TreeIntegrityError, UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
PS = 2  # tokens per page; W = 2 pages, T = 2 pages


def make_spec(window_pages: int = 2, track_pages: int = 2) -> ModelSpec:
    return ModelSpec.preset(
        "tiny", page_size=PS, swa_window=window_pages * PS, track_interval=track_pages * PS
    )


def make_pool(spec: ModelSpec, full: int = 64, swa: int = 64, mamba: int = 16) -> UnifiedKVPool:
    total = full * spec.page_bytes(F) + swa * spec.page_bytes(S) + mamba * spec.page_bytes(M)
    return UnifiedKVPool(spec, total)


@pytest.fixture
def spec() -> ModelSpec:
    return make_spec()


@pytest.fixture
def pool(spec: ModelSpec) -> UnifiedKVPool:
    return make_pool(spec)


@pytest.fixture
def tree(spec: ModelSpec, pool: UnifiedKVPool) -> UnifiedRadixTree:
    return UnifiedRadixTree(spec, pool)


def tokens(*pages: int) -> np.ndarray:
    """One page per argument, each filled with that value."""
    return np.repeat(np.asarray(pages, dtype=np.int64), PS)


def publish(tree: UnifiedRadixTree, toks: np.ndarray, ckpts: tuple[int, ...],
            start: int = 0, swa_valid: torch.Tensor | None = None):
    """Allocate fresh pages for [start, n) and insert them (the engine's path)."""
    pool, n = tree.pool, len(toks) // PS
    full = torch.zeros(n, dtype=torch.int64)
    swa = torch.zeros(n, dtype=torch.int64)
    full[start:] = pool.alloc(F, n - start)
    swa[start:] = pool.alloc(S, n - start)
    valid = torch.ones(n, dtype=torch.bool) if swa_valid is None else swa_valid
    slots = pool.alloc(M, len(ckpts))
    result = tree.insert(toks, full, swa, valid, dict(zip(ckpts, slots.tolist(), strict=True)),
                         start_page=start)
    for c, dup in result.duplicates.items():
        if len(dup):
            pool.free(c, dup)
    if swa_valid is not None and bool((~valid[start:]).any()):
        pool.free(S, swa[start:][~valid[start:]])
    tree.check_integrity()
    pool.verify_byte_accounting()
    return result


def used(pool: UnifiedKVPool) -> Mapping[Component, int]:
    return {c: pool.used_size(c) for c in Component}


def test_insert_then_match_reaches_deepest_checkpoint(tree: UnifiedRadixTree) -> None:
    toks = tokens(1, 2, 3, 4, 5, 6, 7)
    res = publish(tree, toks, (2, 6))
    assert res.adopted[F] == [(0, 7)] and res.adopted[S] == [(0, 7)]
    assert res.adopted_checkpoints == [2, 6]
    assert [(n.start_page, n.end_page) for n in res.nodes] == [(0, 2), (2, 6), (6, 7)]
    m = tree.match_prefix(toks)
    assert (m.boundary_pages, m.kv_pages) == (6, 7)
    assert m.node.end_page == 6 and m.mamba_slot == m.node.checkpoint
    assert torch.equal(m.kv_full_indices, res.canonical[F])
    assert torch.equal(m.full_indices, res.canonical[F][:6])


def test_match_on_a_prefix_mid_node_has_no_boundary_there(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2, 3, 4), (4,))
    m = tree.match_prefix(tokens(1, 2, 3, 9))
    assert (m.boundary_pages, m.kv_pages, m.mamba_slot) == (0, 3, None)
    assert m.node is tree.root and len(tree) == 1  # matching never splits


def test_partial_trailing_page_is_ignored_by_match(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2), (2,))
    m = tree.match_prefix(np.concatenate([tokens(1, 2), [7]]))
    assert m.boundary_pages == 2


def test_two_requests_same_prefix_adopt_once_and_leak_nothing(tree: UnifiedRadixTree,
                                                              pool: UnifiedKVPool) -> None:
    toks = tokens(1, 2, 3, 4)
    publish(tree, toks, (2, 4))
    before = used(pool)
    res = publish(tree, np.concatenate([toks, tokens(5, 6)]), (4, 6))
    assert res.adopted[F] == [(4, 6)] and res.adopted[S] == [(4, 6)]
    assert res.adopted_checkpoints == [6]
    assert len(res.duplicates[F]) == 4 and len(res.duplicates[M]) == 1
    assert used(pool) == {F: before[F] + 2, S: before[S] + 2, M: before[M] + 1}


def test_split_for_a_new_checkpoint_keeps_hashes_locks_flags(tree: UnifiedRadixTree) -> None:
    res = publish(tree, tokens(1, 2, 3, 4, 5, 6), (6,))
    node = res.node
    node.pending = "load"
    tree.mark_stored(node, F)
    tree.mark_stored(node, M)
    tree.lock(node)
    res2 = publish(tree, tokens(1, 2, 3, 4), (4,))
    head = res2.node
    assert head.end_page == 4 and head.children == {tuple(tokens(5)): node}
    assert res2.new_checkpoint_nodes == [head] and res2.adopted_checkpoints == [4]
    assert head.pending == "load" and head.lock_ref == 1 == node.lock_ref
    assert head.stored[F] and not head.stored[M] and node.stored[M]
    tree.unlock(node)
    assert head.lock_ref == 0
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)


def test_branch_inside_a_node_splits_it(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2, 3, 4), (4,))
    res = publish(tree, tokens(1, 2, 7, 8), (2, 4))
    assert res.adopted[F] == [(2, 4)] and res.adopted_checkpoints == [2, 4]
    assert len(tree) == 3
    assert tree.match_prefix(tokens(1, 2, 3, 4)).boundary_pages == 4
    assert tree.match_prefix(tokens(1, 2, 9)).boundary_pages == 2


def test_tombstoned_swa_page_is_readopted(tree: UnifiedRadixTree, pool: UnifiedKVPool) -> None:
    valid = torch.tensor([True, False, True, True])
    publish(tree, tokens(1, 2, 3, 4), (4,), swa_valid=valid)
    assert tree.match_prefix(tokens(1, 2, 3, 4)).boundary_pages == 4  # window = pages 2, 3
    res = publish(tree, tokens(1, 2, 3, 4), (4,))
    assert res.adopted[S] == [(1, 2)] and res.adopted[F] == []
    assert tree.stats().pages[S] == 4


def test_evict_mamba_keeps_kv(tree: UnifiedRadixTree, pool: UnifiedKVPool) -> None:
    publish(tree, tokens(1, 2, 3, 4), (2, 4))
    tree.match_prefix(tokens(1, 2))  # the checkpoint at 2 is now the most recent
    assert tree.evict({M: 1}) == {F: 0, S: 0, M: 1}
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert (m.kv_pages, m.boundary_pages) == (4, 2)
    assert tree.evict({M: 5}) == {F: 0, S: 0, M: 1}
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert (m.kv_pages, m.boundary_pages, m.mamba_slot) == (4, 0, None)
    tree.check_integrity()
    pool.verify_byte_accounting()


def test_evict_swa_tombstones_and_keeps_full(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2, 3, 4), (4,))
    assert tree.evict({S: 1}) == {F: 0, S: 1, M: 0}
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert m.kv_pages == 4 and m.boundary_pages == 4  # page 0 is outside the window
    tree.evict({S: 3})
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert m.kv_pages == 4 and m.boundary_pages == 0
    tree.check_integrity()


def test_evict_mamba_takes_checkpoints_without_a_window_first(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2), (2,))
    publish(tree, tokens(3, 4), (2,))
    tree.match_prefix(tokens(1, 2))  # (3, 4) is least recently used ...
    tree.evict({S: 1})               # ... loses a SWA page: its checkpoint is unusable
    tree.match_prefix(tokens(3, 4))  # ... and becomes the most recently used
    assert tree.evict({M: 1}) == {F: 0, S: 0, M: 1}
    assert tree.match_prefix(tokens(1, 2)).boundary_pages == 2
    assert tree.stats().pages[M] == 1


def test_evict_swa_takes_dead_pages_first(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2), (2,))            # older: both pages in the window of 2
    publish(tree, tokens(3, 4, 5, 6), (4,))      # newer: pages 0, 1 are in no window
    assert tree.evict({S: 2}) == {F: 0, S: 2, M: 0}
    assert tree.match_prefix(tokens(1, 2)).boundary_pages == 2
    assert tree.match_prefix(tokens(3, 4, 5, 6)).boundary_pages == 4
    tree.evict({S: 1})  # no dead page left: the least recently used live one goes
    assert tree.match_prefix(tokens(1, 2)).boundary_pages == 0
    tree.check_integrity()


def test_evict_full_removes_leaves_and_cascades(tree: UnifiedRadixTree,
                                                pool: UnifiedKVPool) -> None:
    base = used(pool)
    publish(tree, tokens(1, 2, 3, 4), (2, 4))
    publish(tree, tokens(1, 2, 5, 6), (4,))
    freed = tree.evict({F: 100})
    assert freed == {F: 6, S: 6, M: 3} and len(tree) == 0
    assert used(pool) == base


def test_locked_nodes_are_never_evicted(tree: UnifiedRadixTree, pool: UnifiedKVPool) -> None:
    a = publish(tree, tokens(1, 2, 3, 4), (2, 4))
    publish(tree, tokens(1, 2, 5, 6), (4,))
    tree.lock(a.node)
    freed = tree.evict({F: 100, S: 100, M: 100})
    assert freed == {F: 2, S: 2, M: 1}
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert (m.boundary_pages, m.kv_pages) == (4, 4)
    tree.unlock(a.node)
    tree.drop_all()
    assert len(tree) == 0 and tree.stats().pages == {F: 0, S: 0, M: 0}
    tree.check_integrity()


def test_lru_order_per_component(tree: UnifiedRadixTree) -> None:
    publish(tree, tokens(1, 2), (2,))
    publish(tree, tokens(3, 4), (2,))
    tree.match_prefix(tokens(1, 2))  # (1, 2) is now the most recent
    tree.evict({M: 1})
    assert tree.match_prefix(tokens(1, 2)).boundary_pages == 2
    assert tree.match_prefix(tokens(3, 4)).boundary_pages == 0


def test_pool_moves_rewrite_tree_indices(tree: UnifiedRadixTree, pool: UnifiedKVPool) -> None:
    res = publish(tree, tokens(1, 2, 3, 4), (2, 4))
    old = res.canonical[F][:2].clone()
    free_dst = pool.alloc(F, 2)
    pool.free(F, free_dst)
    pool.move_pages(F, old, free_dst)
    m = tree.match_prefix(tokens(1, 2, 3, 4))
    assert torch.equal(m.full_indices[:2], free_dst)
    tree.check_integrity()
    # MAMBA is the float: freeing a low slot leaves a hole that compaction fills.
    spare = pool.alloc(M, 1)
    pool.free(M, spare)
    pool.compact_holes()
    pool.make_room("low", 4 * tree.spec.page_bytes(M))
    tree.check_integrity()
    pool.verify_byte_accounting()


@pytest.mark.parametrize(
    ("n_tokens", "ckpts", "start", "match"),
    [
        (7, {}, 0, "whole number of pages"),
        (8, {1: 0, 3: 1}, 0, "at most one branch checkpoint"),
        (8, {6: 0}, 0, r"must lie in \(0, 4\]"),
        (8, {2: 0}, 2, r"must lie in \(2, 4\]"),
        (8, {}, 5, "start_page must be in"),
        (8, {}, 2, "must already be in the tree"),
        (8, {2: 0, 4: 0}, 0, "same mamba index"),
    ],
)
def test_bad_insert_input_raises_and_changes_nothing(
    tree: UnifiedRadixTree, n_tokens: int, ckpts: dict[int, int], start: int, match: str
) -> None:
    n = n_tokens // PS
    with pytest.raises(ValueError, match=match):
        tree.insert(np.arange(n_tokens), torch.arange(n), torch.arange(n),
                    torch.ones(n, dtype=torch.bool), ckpts, start_page=start)
    assert len(tree) == 0
    tree.check_integrity()


def test_offering_a_page_the_tree_owns_elsewhere_is_refused(tree: UnifiedRadixTree) -> None:
    res = publish(tree, tokens(1, 2), (2,))
    stolen = res.canonical[F].flip(0)
    with pytest.raises(ValueError, match="another position"):
        tree.insert(tokens(1, 2), stolen, res.canonical[S], torch.ones(2, dtype=torch.bool), {})


def test_reinserting_the_trees_own_indices_is_not_a_duplicate(tree: UnifiedRadixTree) -> None:
    res = publish(tree, tokens(1, 2), (2,))
    again = tree.insert(tokens(1, 2), res.canonical[F], res.canonical[S],
                        torch.ones(2, dtype=torch.bool), {2: res.node.checkpoint})
    assert all(len(d) == 0 for d in again.duplicates.values())


def test_integrity_check_catches_corruption(tree: UnifiedRadixTree) -> None:
    res = publish(tree, tokens(1, 2, 3, 4), (4,))
    res.node.hashes[0] = b"\x01" * 16
    with pytest.raises(TreeIntegrityError, match="hash chain"):
        tree.check_integrity()


def test_integrity_check_catches_a_stale_reverse_map(tree: UnifiedRadixTree) -> None:
    res = publish(tree, tokens(1, 2), (2,))
    res.node.pages(F).indices[0] += 1
    with pytest.raises(TreeIntegrityError):
        tree.check_integrity()
