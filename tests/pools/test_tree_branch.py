"""Branch checkpoints in the unified radix tree: a checkpoint off the
``track_pages`` grid where a prompt leaves a cached one (node split at the
branch page), the cap on how many live, and eviction taking them first.
``check_integrity`` runs after every operation (``publish`` does it)."""

from __future__ import annotations

import numpy as np
import pytest
from test_tree import PS, make_pool, publish, tokens

from layerlift.pools import Component, ModelSpec, UnifiedKVPool
from layerlift.pools.tree import UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
T = 4  # track pages: the grid is 4, 8, ...


def make_tree(cap: int = 64) -> UnifiedRadixTree:
    spec = ModelSpec.preset("tiny", page_size=PS, swa_window=2 * PS, track_interval=T * PS)
    return UnifiedRadixTree(spec, make_pool(spec), max_branch_checkpoints=cap)


def branch_off(tree: UnifiedRadixTree, toks: np.ndarray, grid: tuple[int, ...] = ()):
    """The engine's path for a prompt: compute from the device boundary,
    capture the grid checkpoints and one at the branch page (kv_pages)."""
    m = tree.match_prefix(toks)
    n = len(toks) // PS
    kv, d = m.kv_pages, m.boundary_pages
    ckpts = tuple(sorted({*grid, *([kv] if d < kv < n and kv % T else [])}))
    return publish(tree, toks, tuple(b for b in ckpts if b > d), start=d), kv


def test_third_prompt_matches_up_to_the_branch_page() -> None:
    tree = make_tree()
    a = tokens(1, 2, 3, 4, 5, 6, 7, 8, 9)
    publish(tree, a, (4, 8))
    b = tokens(1, 2, 3, 4, 5, 6, 70, 80, 90)
    assert tree.match_prefix(b).boundary_pages == 4
    res, kv = branch_off(tree, b, grid=(8,))
    assert kv == 6 and 6 in res.adopted_checkpoints
    # The cached node [4, 9) was split at the branch page: [4, 6) carries the checkpoint.
    head = next(n for n in res.nodes if n.end_page == 6)
    assert head.checkpoint is not None and tree.is_branch_checkpoint(head)
    assert tree.branch_checkpoint_count() == 1
    c = tokens(1, 2, 3, 4, 5, 6, 71, 81, 91)
    m = tree.match_prefix(c)
    assert m.boundary_pages == 6 and m.mamba_slot == head.checkpoint
    assert m.kv_pages == 6


def test_split_keeps_kv_stored_marks_and_leaves_the_checkpoint_unstored() -> None:
    tree = make_tree()
    res = publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    for node in res.nodes:
        for c in Component:
            tree.mark_stored(node, c)
    res, _ = branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    head = next(n for n in tree.iter_nodes() if n.end_page == 6)
    assert head.stored[F] and not head.stored[M]  # the offloader sends only the new state
    tree.check_integrity()


def test_a_second_branch_at_the_same_page_is_a_duplicate() -> None:
    tree = make_tree()
    publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    # Two prompts of one batch matched at 4 and both branch at 6.
    branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    res = publish(tree, tokens(1, 2, 3, 4, 5, 6, 71, 81), (6,), start=4)
    assert res.adopted_checkpoints == [] and len(res.duplicates[M]) == 1
    assert tree.branch_checkpoint_count() == 1


def test_cap_drops_the_least_recent_unlocked_branch() -> None:
    tree = make_tree(cap=1)
    publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80, 9, 10))  # no branch: same path
    publish(tree, tokens(11, 12, 13, 14, 15, 16, 17), (4,))
    _, kv = branch_off(tree, tokens(11, 12, 13, 14, 15, 60, 70))
    assert kv == 5
    assert tree.branch_checkpoint_count() == 1
    assert [n.end_page for n in tree.iter_nodes() if tree.is_branch_checkpoint(n)] == [5]
    assert tree.match_prefix(tokens(1, 2, 3, 4, 5, 6, 99)).boundary_pages == 4


def test_cap_declines_a_branch_while_the_others_are_locked() -> None:
    tree = make_tree(cap=1)
    publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    held = tree.match_prefix(tokens(1, 2, 3, 4, 5, 6, 71)).node
    assert held.end_page == 6
    tree.lock(held)
    publish(tree, tokens(11, 12, 13, 14, 15, 16, 17), (4,))
    res, _ = branch_off(tree, tokens(11, 12, 13, 14, 15, 60, 70))
    assert 5 not in res.adopted_checkpoints and len(res.duplicates[M]) == 1
    assert tree.branch_checkpoint_count() == 1
    tree.unlock(held)
    tree.check_integrity()


def test_cap_zero_takes_no_branch_checkpoint() -> None:
    tree = make_tree(cap=0)
    publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    res, _ = branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    assert res.adopted_checkpoints == [] and tree.branch_checkpoint_count() == 0


def test_eviction_drops_branch_checkpoints_before_grid_ones() -> None:
    tree = make_tree()
    publish(tree, tokens(1, 2, 3, 4, 5, 6, 7, 8), (4, 8))
    branch_off(tree, tokens(1, 2, 3, 4, 5, 6, 70, 80))
    # Touch the branch last, so LRU alone would keep it.
    tree.match_prefix(tokens(1, 2, 3, 4, 5, 6, 70, 80))
    freed = tree.evict({M: 1})
    assert freed[M] == 1
    assert tree.branch_checkpoint_count() == 0
    assert tree.match_prefix(tokens(1, 2, 3, 4, 5, 6, 7, 8)).boundary_pages == 8
    tree.check_integrity()
    tree.pool.verify_byte_accounting()


def test_negative_cap_is_refused() -> None:
    spec = ModelSpec.preset("tiny", page_size=PS, swa_window=2 * PS, track_interval=T * PS)
    with pytest.raises(ValueError, match="max_branch_checkpoints"):
        UnifiedRadixTree(spec, UnifiedKVPool(spec, 1 << 20), max_branch_checkpoints=-1)
