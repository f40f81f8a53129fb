"""Result types of the unified radix tree (no per-kind fields: dicts keyed by
:class:`Component` where a value differs per kind)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from layerlift.pools.spec import Component
from layerlift.pools.tree_node import TreeNode

__all__ = ["InsertBuilder", "InsertResult", "MatchResult", "TreeStats"]


class MatchResult(NamedTuple):
    """What the device holds for a prompt.

    ``boundary_pages`` (d) is the deepest page count at which FULL pages
    ``[0, d)``, the SWA window ``[d - W, d)`` and a MAMBA checkpoint at d all
    exist (0 if none). ``full_indices``/``swa_indices`` have d entries (SWA
    entries before the window are unspecified). ``mamba_slot`` is the
    checkpoint at d (``None`` iff d == 0). ``node`` ends exactly at d (the
    root when d == 0): lock it. ``kv_pages`` >= d counts FULL pages present
    along the path: the depth at which the prompt leaves the cached prefix,
    even where no checkpoint exists there (the engine captures a branch
    checkpoint at it); ``kv_full_indices`` are their indices. ``pending`` lists
    the non-None ``pending`` objects of the nodes covering ``[0, d)``.
    """

    boundary_pages: int
    full_indices: torch.Tensor
    swa_indices: torch.Tensor
    mamba_slot: int | None
    node: TreeNode
    kv_pages: int
    kv_full_indices: torch.Tensor
    pending: list[object]


class InsertResult(NamedTuple):
    """What an ``insert`` took from the caller.

    ``adopted[c]`` (FULL, SWA): merged page ranges ``[start, end)`` (absolute
    prompt positions) whose caller indices the tree now owns.
    ``adopted_checkpoints``: boundaries b whose caller slot the tree took.
    ``duplicates[c]`` (every component): caller indices the tree did *not*
    take because it already had that page/checkpoint: the caller must free
    them and must not load into them. ``node`` ends at the prompt's last page;
    ``new_checkpoint_nodes`` gained a checkpoint in this insert; ``nodes``
    covers ``[start_page, n)`` in order (for offload bookkeeping).
    ``canonical[c]`` (FULL, SWA): the tree's indices for pages ``[0, n)``
    after the insert (SWA entries the tree does not hold are unspecified).
    """

    adopted: dict[Component, list[tuple[int, int]]]
    adopted_checkpoints: list[int]
    duplicates: dict[Component, torch.Tensor]
    node: TreeNode
    new_checkpoint_nodes: list[TreeNode]
    nodes: list[TreeNode]
    canonical: dict[Component, torch.Tensor]


class TreeStats(NamedTuple):
    """Sizes of the tree: nodes (root excluded), pages held per component
    (MAMBA: checkpoints), locked nodes, and pages an eviction could free."""

    nodes: int
    pages: dict[Component, int]
    locked_nodes: int
    evictable: dict[Component, int]


class InsertBuilder:
    """Accumulates an :class:`InsertResult` during one insert walk."""

    def __init__(self) -> None:
        self.adopted: dict[Component, list[tuple[int, int]]] = {
            Component.FULL: [], Component.SWA: [],
        }
        self.adopted_checkpoints: list[int] = []
        self.duplicates: dict[Component, list[int]] = {c: [] for c in Component}
        self.new_checkpoint_nodes: list[TreeNode] = []
        self.nodes: list[TreeNode] = []

    def adopt(self, component: Component, page: int) -> None:
        """Record page ``page`` as taken; consecutive pages merge into one range."""
        ranges = self.adopted[component]
        if ranges and ranges[-1][1] == page:
            ranges[-1] = (ranges[-1][0], page + 1)
        else:
            ranges.append((page, page + 1))

    def adopt_checkpoint(self, node: TreeNode) -> None:
        self.adopted_checkpoints.append(node.end_page)
        self.new_checkpoint_nodes.append(node)

    def duplicate(self, component: Component, index: int) -> None:
        self.duplicates[component].append(index)

    def build(self, node: TreeNode, canonical: dict[Component, torch.Tensor]) -> InsertResult:
        dups = {c: torch.tensor(v, dtype=torch.int64) for c, v in self.duplicates.items()}
        return InsertResult(
            adopted={c: list(r) for c, r in self.adopted.items()},
            adopted_checkpoints=list(self.adopted_checkpoints),
            duplicates=dups,
            node=node,
            new_checkpoint_nodes=list(self.new_checkpoint_nodes),
            nodes=list(self.nodes),
            canonical=canonical,
        )
