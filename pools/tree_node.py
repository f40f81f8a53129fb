"""Nodes of the unified radix tree and their per-component data.

A node covers a page-aligned run of tokens ``[start_page, end_page)`` of every
prompt that passes through it. What the device holds for those pages is kept
per component in ``node.data``:

* FULL and SWA: :class:`PageData` - one device page index per page, a
  ``valid`` mask (FULL pages are always valid while the node exists; a SWA
  page that was evicted is a *tombstone*: ``valid`` False, its index
  meaningless) and a ``stored`` mask (the page is known to be in the external
  store).
* MAMBA: :class:`SlotData` - the state slot of the checkpoint taken at the
  node's *end* (recurrent state is only valid at exactly one boundary), or
  ``None``.

Nodes carry no per-kind logic; that lives in ``pools/tree_components.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerlift.pools.spec import Component

__all__ = ["ComponentData", "PageData", "SlotData", "TreeIntegrityError", "TreeNode"]


class TreeIntegrityError(AssertionError):
    """``UnifiedRadixTree.check_integrity`` found an inconsistency (a bug)."""


@dataclass(slots=True)
class PageData:
    """Device pages of one page-indexed component (FULL or SWA) of one node.

    All three tensors have one entry per page of the node; ``indices`` is
    int64, ``valid`` and ``stored`` are bool. Entries of ``indices`` where
    ``valid`` is False carry no meaning.
    """

    indices: torch.Tensor
    valid: torch.Tensor
    stored: torch.Tensor

    @classmethod
    def empty(cls, n: int) -> PageData:
        """``n`` pages, none present, none stored."""
        return cls(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool),
                   torch.zeros(n, dtype=torch.bool))

    @classmethod
    def make(cls, indices: torch.Tensor, valid: torch.Tensor) -> PageData:
        """Fresh data (nothing stored yet); copies its inputs."""
        idx = indices.to(torch.int64).clone()
        val = valid.to(torch.bool).clone()
        idx[~val] = 0
        return cls(idx, val, torch.zeros(len(idx), dtype=torch.bool))

    def split(self, k: int) -> tuple[PageData, PageData]:
        """The first ``k`` pages and the rest (copies)."""
        head = PageData(self.indices[:k].clone(), self.valid[:k].clone(), self.stored[:k].clone())
        tail = PageData(self.indices[k:].clone(), self.valid[k:].clone(), self.stored[k:].clone())
        return head, tail

    def present(self) -> list[tuple[int, int]]:
        """``(offset, device index)`` of every valid page."""
        offs = torch.nonzero(self.valid).flatten().tolist()
        return [(o, int(self.indices[o])) for o in offs]


@dataclass(slots=True)
class SlotData:
    """The MAMBA checkpoint at a node's end: a state slot, or ``None``."""

    slot: int | None = None

    def present(self) -> list[tuple[int, int]]:
        """``[(0, slot)]`` when the checkpoint exists, else ``[]``."""
        return [] if self.slot is None else [(0, self.slot)]


ComponentData = PageData | SlotData


class TreeNode:
    """One node of the unified radix tree.

    ``children`` are keyed by the tokens of their first page. ``hashes`` holds
    one chained page hash per page (chained from the parent's last hash).
    ``lock_ref`` counts locks on this node *or any descendant*: a node with
    ``lock_ref > 0`` is never evicted. ``last_access`` is a per-component
    logical clock (not wall time). ``stored`` is the offload bookkeeping per
    component (see ``UnifiedRadixTree.mark_stored``). ``pending`` is opaque
    to the tree: the engine hangs an in-flight load's readiness there.
    """

    __slots__ = (
        "children", "data", "hashes", "key", "last_access", "lock_ref", "node_id",
        "parent", "pending", "start_page", "stored",
    )

    def __init__(
        self,
        parent: TreeNode | None,
        key: np.ndarray,
        start_page: int,
        hashes: list[bytes],
        data: dict[Component, ComponentData],
        node_id: int,
    ) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.start_page = start_page
        self.hashes = hashes
        self.data = data
        self.node_id = node_id
        self.lock_ref = 0
        self.last_access: dict[Component, int] = dict.fromkeys(Component, 0)
        self.stored: dict[Component, bool] = dict.fromkeys(Component, False)
        self.pending: object | None = None

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def end_page(self) -> int:
        return self.start_page + self.num_pages

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def last_hash(self) -> bytes | None:
        """Hash of the node's last page (``None`` for the root)."""
        return self.hashes[-1] if self.hashes else None

    def pages(self, component: Component) -> PageData:
        """FULL or SWA page data; raises ``ValueError`` for MAMBA."""
        data = self.data[component]
        if not isinstance(data, PageData):
            raise ValueError(f"{component.value} is not a page-indexed component")
        return data

    @property
    def checkpoint(self) -> int | None:
        """The MAMBA state slot at this node's end, or ``None``."""
        data = self.data[Component.MAMBA]
        assert isinstance(data, SlotData)
        return data.slot

    def path(self) -> list[TreeNode]:
        """Nodes from the root's first child down to this node (root excluded)."""
        out: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, pages=[{self.start_page}, {self.end_page}), "
            f"ckpt={self.checkpoint}, lock={self.lock_ref})"
        )
