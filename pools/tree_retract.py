"""Taking back what an insert adopted, when its data turned out to be bad.

A restore COMMITs (the tree adopts the slots) *before* its per-layer loads
finish; if a load then fails, the adopted pages hold partial bytes and must
leave the tree. SWA pages become tombstones and MAMBA checkpoints are
dropped. FULL pages cannot be tombstoned (a node always has its FULL pages),
and the pages an insert adopts for FULL always form whole new nodes, so the
nodes owning them are removed together with their subtrees (whatever other
inserts hung below a bad prefix is bad too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from layerlift.pools.spec import Component
from layerlift.pools.tree_node import PageData, SlotData, TreeNode

if TYPE_CHECKING:
    from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["retract"]


def _subtree_post_order(node: TreeNode) -> list[TreeNode]:
    out: list[TreeNode] = []
    stack = [(node, False)]
    while stack:
        cur, expanded = stack.pop()
        if expanded:
            out.append(cur)
            continue
        stack.append((cur, True))
        stack.extend((ch, False) for ch in cur.children.values())
    return out


def retract(tree: UnifiedRadixTree, released: Mapping[Component, torch.Tensor]) -> None:
    """Remove the given indices from the tree *without* freeing them (the
    caller owns them again and frees them); pages of removed subtrees that
    are not in ``released`` are freed through the pool.

    ``ValueError``, before anything changes, if an index is not owned by the
    tree or a subtree to remove holds a locked node.
    """
    owners = tree.owners
    mine = {c: [int(i) for i in released.get(c, torch.zeros(0)).tolist()] for c in Component}
    for c, idx in mine.items():
        stray = [i for i in idx if i not in owners[c]]
        if stray:
            raise ValueError(f"{c.value} indices {stray[:4]} are not owned by the tree")
    doomed_roots = {id(owners[Component.FULL][i][0]): owners[Component.FULL][i][0]
                    for i in mine[Component.FULL]}
    doomed: dict[int, TreeNode] = {}
    for root in doomed_roots.values():
        for node in _subtree_post_order(root):
            doomed.setdefault(id(node), node)
    locked = [n for n in doomed.values() if n.lock_ref > 0]
    if locked:
        raise ValueError(f"cannot retract: {locked[0]} is locked (unlock dependants first)")
    for c, idx in mine.items():
        for i in idx:
            node, off = owners[c].pop(i)
            data = node.data[c]
            if isinstance(data, PageData):
                data.valid[off] = False
                data.indices[off] = 0
            else:
                assert isinstance(data, SlotData)
                data.slot = None
    removed: set[int] = set()
    for root in doomed_roots.values():
        if id(root) in removed:
            continue
        for node in _subtree_post_order(root):
            if id(node) not in removed:
                tree.remove_leaf(node)
                removed.add(id(node))
