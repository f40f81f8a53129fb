"""Undo what one insert adopted (a restore whose load failed after COMMIT).

COMMIT publishes restored pages before they land. If the load then fails,
the pages the insert *took* hold garbage and must leave the tree, while
everything the tree had before stays: new nodes (wholly adopted FULL pages)
are removed with their subtrees, adopted SWA pages of older nodes are
tombstoned one by one, an adopted checkpoint is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from layerlift.pools.spec import Component
from layerlift.pools.tree import InsertResult, TreeNode, UnifiedRadixTree

__all__ = ["unpublish"]


def unpublish(tree: UnifiedRadixTree, tokens: Sequence[int] | np.ndarray,
              result: InsertResult) -> None:
    """Remove from ``tree`` exactly what ``result`` adopted for ``tokens``.

    The caller must have unlocked the nodes it locked and unpinned the pages
    (they are freed now). Raises ``ValueError`` if a node to remove is still
    locked by someone else.
    """
    n_pages = len(tokens) // tree.spec.page_size
    path = _path(tree, np.asarray(tokens, dtype=np.int64)[: n_pages * tree.spec.page_size])
    full = result.adopted.get(Component.FULL, [])
    first_new = min((lo for lo, _ in full), default=n_pages)
    swa_pages = {p for lo, hi in result.adopted.get(Component.SWA, []) for p in range(lo, hi)}
    checkpoints = set(result.adopted_checkpoints)
    for node in reversed(path):
        if node.start_page >= first_new:
            _remove_subtree(tree, node)
            continue
        _tombstone_swa(tree, node, swa_pages)
        if node.end_page in checkpoints and node.checkpoint is not None:
            tree.components[Component.MAMBA].release(node)
            node.stored[Component.MAMBA] = False


def _path(tree: UnifiedRadixTree, toks: np.ndarray) -> list[TreeNode]:
    return [node for node, _ in tree._walk(toks)]  # noqa: SLF001 - same package


def _remove_subtree(tree: UnifiedRadixTree, node: TreeNode) -> None:
    for child in list(node.children.values()):
        _remove_subtree(tree, child)
    if node.lock_ref:
        raise ValueError(f"cannot unpublish {node}: it is still locked")
    tree.remove_leaf(node)


def _tombstone_swa(tree: UnifiedRadixTree, node: TreeNode, pages: set[int]) -> None:
    data = node.pages(Component.SWA)
    owners = tree.owners[Component.SWA]
    freed = []
    for off in range(node.num_pages):
        if node.start_page + off in pages and bool(data.valid[off]):
            idx = int(data.indices[off])
            data.valid[off] = False
            data.stored[off] = False
            data.indices[off] = 0
            del owners[idx]
            freed.append(idx)
    if freed:
        node.stored[Component.SWA] = False
        tree.pool.free(Component.SWA, torch.tensor(freed, dtype=torch.int64))
