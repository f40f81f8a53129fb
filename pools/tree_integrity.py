"""Input validation and integrity checks of the unified radix tree.

``validate_insert``/``check_offered`` turn bad caller input into a
``ValueError`` *before* the tree changes. ``check_tree`` verifies every
structural invariant and raises :class:`TreeIntegrityError` (an
``AssertionError``: a bug, not misuse) with a sentence naming the node.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from layerlift.pools.hashing import ROOT_HASH, page_hashes
from layerlift.pools.spec import Component
from layerlift.pools.tree_components import (
    InsertInputs,
    PageData,
    SlotData,
    TreeIntegrityError,
    TreeNode,
    TreeView,
)

__all__ = ["check_offered", "check_tree", "validate_insert"]


def _vector(name: str, t: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or len(t) != n:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D tensor with one entry per page ({n}), got {shape}")
    return t.to(dtype).cpu()


def validate_insert(
    tree: TreeView, n: int, full: torch.Tensor, swa: torch.Tensor,
    swa_valid: torch.Tensor, checkpoints: Mapping[int, int], start_page: int,
) -> InsertInputs:
    """Check shapes, ranges and checkpoint positions; ``ValueError`` otherwise."""
    if not 0 <= start_page <= n:
        raise ValueError(f"start_page must be in [0, {n}] for a {n}-page prompt, got {start_page}")
    f = _vector("full", full, n, torch.int64)
    s = _vector("swa", swa, n, torch.int64)
    v = _vector("swa_valid", swa_valid, n, torch.bool)
    t = tree.spec.track_pages
    for b, slot in checkpoints.items():
        if not start_page < b <= n:
            raise ValueError(
                f"checkpoint at page {b} is invalid: checkpoints must lie in ({start_page}, {n}]"
            )
        if slot < 0:
            raise ValueError(f"checkpoint slot {slot} at page {b} is negative")
    branch = [b for b in checkpoints if b % t]
    if len(branch) > 1:
        raise ValueError(
            f"checkpoints at pages {sorted(branch)} are not multiples of track_pages ({t}): "
            "an insert may carry at most one branch checkpoint"
        )
    offered = {
        Component.FULL: f[start_page:].tolist(),
        Component.SWA: s[start_page:][v[start_page:]].tolist(),
        Component.MAMBA: list(checkpoints.values()),
    }
    for c, idx in offered.items():
        if any(i < 0 for i in idx):
            raise ValueError(f"{c.value} indices must be non-negative")
        if len(set(idx)) != len(idx):
            raise ValueError(f"the same {c.value} index is offered for two positions")
    return InsertInputs(
        n_pages=n, start_page=start_page,
        pages={Component.FULL: f, Component.SWA: s},
        valid={Component.FULL: torch.ones(n, dtype=torch.bool), Component.SWA: v},
        checkpoints={int(b): int(x) for b, x in checkpoints.items()},
    )


def check_offered(
    tree: TreeView, path: list[tuple[TreeNode, int]], inputs: InsertInputs
) -> None:
    """``ValueError`` if an offered index is owned by the tree at another position."""
    here: dict[int, tuple[TreeNode, int]] = {}
    for node, m in path:
        for off in range(m):
            here[node.start_page + off] = (node, off)
    for c in (Component.FULL, Component.SWA):
        owners = tree.owners[c]
        valid = inputs.valid[c].tolist()
        offered = inputs.pages[c].tolist()
        for page in range(inputs.start_page, inputs.n_pages):
            idx = offered[page]
            if valid[page] and idx in owners and here.get(page) != owners[idx]:
                raise ValueError(
                    f"{c.value} page {idx} offered for position {page} already belongs to "
                    f"the tree at another position"
                )
    ends = {node.end_page: node for node, m in path if m == node.num_pages}
    for b, slot in inputs.checkpoints.items():
        owner = tree.owners[Component.MAMBA].get(slot)
        if owner is not None and ends.get(b) is not owner[0]:
            raise ValueError(f"mamba slot {slot} offered for boundary {b} belongs to another node")


def _fail(msg: str) -> None:
    raise TreeIntegrityError(msg)


def _check_node(tree: TreeView, node: TreeNode) -> None:
    ps, parent = tree.page_size, node.parent
    if parent is None or not tree.contains(parent):
        _fail(f"{node} has a parent that is not in the tree")
    assert parent is not None
    if node.num_pages < 1 or len(node.key) != node.num_pages * ps:
        _fail(f"{node} has a key of {len(node.key)} tokens for {node.num_pages} pages")
    if parent.children.get(tuple(node.key[:ps].tolist())) is not node:
        _fail(f"{node} is not its parent's child under its first page")
    if node.start_page != parent.end_page:
        _fail(f"{node} starts at {node.start_page} but its parent ends at {parent.end_page}")
    if node.hashes != page_hashes(node.key, ps, parent.last_hash or ROOT_HASH):
        _fail(f"{node} has a broken hash chain")
    if node.lock_ref < sum(ch.lock_ref for ch in node.children.values()):
        _fail(f"{node} has lock_ref below the sum of its children's")
    for c in (Component.FULL, Component.SWA):
        data = node.data[c]
        if not isinstance(data, PageData) or any(
                len(t) != node.num_pages for t in (data.indices, data.valid, data.stored)):
            _fail(f"{node} has {c.value} data of the wrong length")
    if not bool(node.pages(Component.FULL).valid.all()):
        _fail(f"{node} lacks FULL pages (FULL eviction removes whole nodes)")
    for c in (Component.FULL, Component.SWA):
        if node.stored[c] != bool(node.pages(c).stored.all()):
            _fail(f"{node} has a {c.value} stored flag that disagrees with its page marks")


def check_tree(tree: TreeView) -> None:
    """Verify links, keys, hashes, locks, ownership, reverse maps and pool use."""
    root = tree.root
    if root.parent is not None or root.num_pages or root.lock_ref < 0:
        _fail("the root must have no parent, no pages and a non-negative lock_ref")
    if not isinstance(root.data[Component.MAMBA], SlotData) or root.checkpoint is not None:
        _fail("the root must not hold a checkpoint")
    reached, stack = 0, [root]
    while stack:
        cur = stack.pop()
        reached += 1
        stack.extend(cur.children.values())
    if reached != len(tree) + 1:
        _fail(f"{reached} nodes reachable from the root, {len(tree) + 1} registered")
    seen: dict[Component, dict[int, tuple[TreeNode, int]]] = {c: {} for c in Component}
    for node in tree.iter_nodes():
        _check_node(tree, node)
        if node.lock_ref < 0:
            _fail(f"{node} has a negative lock_ref")
        for c, comp in tree.components.items():
            for off, idx in comp.present(node):
                if idx in seen[c]:
                    _fail(f"{c.value} index {idx} is owned by {seen[c][idx][0]} and {node}")
                seen[c][idx] = (node, off)
    branches = sum(1 for n in tree.iter_nodes() if tree.is_branch_checkpoint(n))
    if branches > tree.max_branch_checkpoints:
        _fail(f"{branches} branch checkpoints exceed the cap of {tree.max_branch_checkpoints}")
    for c in Component:
        if seen[c] != tree.owners[c]:
            _fail(f"the {c.value} reverse map disagrees with the nodes' indices")
        used = tree.pool.used_size(c)
        if len(seen[c]) > used:
            _fail(f"the tree holds {len(seen[c])} {c.value} pages but the pool has {used} used")
        _check_allocated(tree, c, list(seen[c]))


def _check_allocated(tree: TreeView, c: Component, indices: list[int]) -> None:
    """Every owned index must be allocated (and not freed-deferred) in the
    pool. ``KVPool`` has no public per-page query, so this reads the
    allocator of pools built on ``MultiEndedAllocator`` (``pool.core``) and
    is skipped for other pools (``used_size`` still bounds the count)."""
    core = getattr(tree.pool, "core", None)
    if core is None or not hasattr(core, "sub") or not indices:
        return
    sub = core.sub(c.value)
    idx = np.asarray(indices, dtype=np.int64)
    if int(idx.max()) >= len(sub.used):
        _fail(f"{c.value} index {int(idx.max())} is beyond the pool")
    bad = idx[~sub.used[idx] | sub.deferred[idx]]
    if len(bad):
        _fail(f"{c.value} pages {bad[:4].tolist()} are owned by the tree but free in the pool")
