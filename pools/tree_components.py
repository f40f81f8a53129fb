"""Per-kind logic of the unified radix tree: one class per component.

The tree walks and splits nodes; what a component keeps per node, what it
adopts on insert, how a split divides it and how it is evicted is decided
here. Chosen from :data:`TREE_COMPONENT_TYPES` (one class per kind, as vLLM's
hybrid allocator picks one manager per spec):

* FULL: every page of a node; eviction removes whole *leaf* nodes (their SWA
  pages and checkpoint go with them) and cascades to parents that become
  unlocked leaves.
* SWA: per-page indices with tombstones; eviction tombstones pages (the FULL
  pages stay).
* MAMBA: one checkpoint slot at the node's end; eviction drops checkpoints
  (the KV stays). A split head never has one: recurrent state cannot be split.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch
from layerlift.pools.spec import Component
from layerlift.pools.tree_node import ComponentData, PageData, SlotData, TreeNode

if TYPE_CHECKING:
    from layerlift.pools.tree import UnifiedRadixTree
    from layerlift.pools.tree_result import InsertBuilder

__all__ = [
    "TREE_COMPONENT_TYPES", "FullComponent", "InsertInputs", "MambaComponent",
    "SwaComponent", "TreeComponent",
]


class InsertInputs(NamedTuple):
    """What the caller of ``insert`` offers, validated (``n_pages`` entries)."""

    n_pages: int
    start_page: int
    pages: dict[Component, torch.Tensor]
    valid: dict[Component, torch.Tensor]
    checkpoints: dict[int, int]


class TreeComponent(ABC):
    """Per-kind behaviour; ``tree`` gives access to the pool and owner maps."""

    component: Component

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    @abstractmethod
    def blank(self, n_pages: int) -> ComponentData:
        """Data of a new node that holds nothing yet."""

    @abstractmethod
    def merge(self, node: TreeNode, inputs: InsertInputs, out: InsertBuilder) -> None:
        """Take what the caller offers for ``node`` where the tree lacks it
        (recorded as adopted); report offered indices the tree already has
        as duplicates. Pages before ``inputs.start_page`` are ignored."""

    @abstractmethod
    def split(self, data: ComponentData, k: int) -> tuple[ComponentData, ComponentData]:
        """Divide a node's data after its first ``k`` pages."""

    @abstractmethod
    def set_index(self, data: ComponentData, offset: int, index: int) -> None:
        """Rewrite one index (the pool moved a page)."""

    @abstractmethod
    def evict(self, demand: int) -> dict[Component, int]:
        """Free at least ``demand`` pages of this component from unlocked
        nodes, least recently used first, if possible; pages freed per
        component."""

    # ---- shared helpers ---------------------------------------------------
    def present(self, node: TreeNode) -> list[tuple[int, int]]:
        """``(offset, index)`` of everything the node holds on the device."""
        data = node.data[self.component]
        return data.present()

    def own(self, node: TreeNode) -> None:
        owners = self.tree.owners[self.component]
        for off, idx in self.present(node):
            owners[idx] = (node, off)

    def release(self, node: TreeNode) -> int:
        """Free everything the node holds of this component; returns pages."""
        held = self.present(node)
        if not held:
            return 0
        owners = self.tree.owners[self.component]
        for _, idx in held:
            del owners[idx]
        self.tree.pool.free(self.component, torch.tensor([i for _, i in held], dtype=torch.int64))
        node.data[self.component] = self.blank(node.num_pages)
        return len(held)

    def _unlocked_lru(self) -> list[TreeNode]:
        nodes = [n for n in self.tree.iter_nodes() if n.lock_ref == 0 and self.present(n)]
        nodes.sort(key=lambda n: (n.last_access[self.component], n.node_id))
        return nodes


class _PageComponent(TreeComponent):
    """FULL and SWA: one device page per token page."""

    def blank(self, n_pages: int) -> ComponentData:
        return PageData.make(torch.zeros(n_pages, dtype=torch.int64),
                             torch.zeros(n_pages, dtype=torch.bool))

    def merge(self, node: TreeNode, inputs: InsertInputs, out: InsertBuilder) -> None:
        data = node.pages(self.component)
        offered = inputs.pages[self.component]
        offered_valid = inputs.valid[self.component]
        owners = self.tree.owners[self.component]
        first = max(inputs.start_page, node.start_page)
        for page in range(first, node.end_page):
            if not bool(offered_valid[page]):
                continue
            off, idx = page - node.start_page, int(offered[page])
            if bool(data.valid[off]):
                if int(data.indices[off]) != idx:
                    out.duplicate(self.component, idx)
                continue
            data.indices[off] = idx
            data.valid[off] = True
            owners[idx] = (node, off)
            out.adopt(self.component, page)

    def split(self, data: ComponentData, k: int) -> tuple[ComponentData, ComponentData]:
        assert isinstance(data, PageData)
        return data.split(k)

    def set_index(self, data: ComponentData, offset: int, index: int) -> None:
        assert isinstance(data, PageData)
        data.indices[offset] = index


class FullComponent(_PageComponent):
    """Full-attention KV: whole leaf nodes are evicted."""

    component = Component.FULL

    def evict(self, demand: int) -> dict[Component, int]:
        freed = dict.fromkeys(Component, 0)
        heap = [(n.last_access[Component.FULL], n.node_id, n) for n in self.tree.iter_nodes()
                if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and freed[Component.FULL] < demand:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            for comp, count in self.tree.remove_leaf(node).items():
                freed[comp] += count
            if not parent.is_root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access[Component.FULL], parent.node_id, parent))
        return freed


class SwaComponent(_PageComponent):
    """Sliding-window KV: pages are tombstoned, front of a node first (the
    pages furthest from the node's end fall out of windows first)."""

    component = Component.SWA

    def evict(self, demand: int) -> dict[Component, int]:
        freed = dict.fromkeys(Component, 0)
        owners = self.tree.owners[Component.SWA]
        for node in self._unlocked_lru():
            if freed[Component.SWA] >= demand:
                break
            data = node.pages(Component.SWA)
            take = self.present(node)[: demand - freed[Component.SWA]]
            for off, idx in take:
                data.valid[off] = False
                data.indices[off] = 0
                del owners[idx]
            self.tree.pool.free(Component.SWA,
                                torch.tensor([i for _, i in take], dtype=torch.int64))
            freed[Component.SWA] += len(take)
        return freed


class MambaComponent(TreeComponent):
    """Recurrent-state checkpoints at node ends."""

    component = Component.MAMBA

    def blank(self, n_pages: int) -> ComponentData:
        return SlotData(None)

    def merge(self, node: TreeNode, inputs: InsertInputs, out: InsertBuilder) -> None:
        slot = inputs.checkpoints.get(node.end_page)
        if slot is None or node.end_page <= inputs.start_page:
            return
        data = node.data[Component.MAMBA]
        assert isinstance(data, SlotData)
        if data.slot is not None:
            if data.slot != slot:
                out.duplicate(Component.MAMBA, slot)
            return
        data.slot = slot
        self.tree.owners[Component.MAMBA][slot] = (node, 0)
        out.adopt_checkpoint(node)

    def split(self, data: ComponentData, k: int) -> tuple[ComponentData, ComponentData]:
        assert isinstance(data, SlotData)
        return SlotData(None), SlotData(data.slot)

    def set_index(self, data: ComponentData, offset: int, index: int) -> None:
        assert isinstance(data, SlotData)
        data.slot = index

    def evict(self, demand: int) -> dict[Component, int]:
        freed = dict.fromkeys(Component, 0)
        for node in self._unlocked_lru():
            if freed[Component.MAMBA] >= demand:
                break
            freed[Component.MAMBA] += self.release(node)
        return freed


TREE_COMPONENT_TYPES: dict[Component, type[TreeComponent]] = {
    Component.FULL: FullComponent,
    Component.SWA: SwaComponent,
    Component.MAMBA: MambaComponent,
}
