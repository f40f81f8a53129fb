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
import weakref
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
        # A proxy, not a reference: the tree owns its components, and a cycle
        # would keep the tree and its pool's buffer alive until the next GC.
        self.tree: UnifiedRadixTree = weakref.proxy(tree)

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

    def release(self, node: TreeNode, sink: list[int] | None = None) -> int:
        """Drop everything the node holds of this component and free it
        (into ``sink`` instead, for one batched ``pool.free`` by the caller);
        returns pages."""
        held = self.present(node)
        if not held:
            return 0
        owners = self.tree.owners[self.component]
        for _, idx in held:
            del owners[idx]
        node.data[self.component] = self.blank(node.num_pages)
        if sink is None:
            self.free([i for _, i in held])
        else:
            sink.extend(i for _, i in held)
        return len(held)

    def free(self, indices: list[int]) -> None:
        """Return pages to the pool (one call)."""
        if indices:
            self.tree.pool.free(self.component, torch.tensor(indices, dtype=torch.int64))

    def _unlocked_lru(self) -> list[TreeNode]:
        nodes = [n for n in self.tree.iter_nodes() if n.lock_ref == 0 and self.present(n)]
        nodes.sort(key=lambda n: (n.last_access[self.component], n.node_id))
        return nodes


class _PageComponent(TreeComponent):
    """FULL and SWA: one device page per token page."""

    def blank(self, n_pages: int) -> ComponentData:
        return PageData.empty(n_pages)

    def merge(self, node: TreeNode, inputs: InsertInputs, out: InsertBuilder) -> None:
        data = node.pages(self.component)
        first, end = max(inputs.start_page, node.start_page), node.end_page
        if first >= end:
            return
        lo = first - node.start_page
        offered = inputs.pages[self.component][first:end]
        ok = inputs.valid[self.component][first:end]
        have, have_idx = data.valid[lo:], data.indices[lo:]
        for idx in offered[ok & have & (have_idx != offered)].tolist():
            out.duplicate(self.component, idx)
        take = ok & ~have
        if not bool(take.any()):
            return
        data.indices[lo:] = torch.where(take, offered, have_idx)
        data.valid[lo:] = have | take
        owners = self.tree.owners[self.component]
        offs = (torch.nonzero(take).flatten() + lo).tolist()
        for off, idx in zip(offs, offered[take].tolist(), strict=True):
            owners[idx] = (node, off)
            out.adopt(self.component, node.start_page + off)

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
        sinks: dict[Component, list[int]] = {c: [] for c in Component}
        heap = [(n.last_access[Component.FULL], n.node_id, n) for n in self.tree.iter_nodes()
                if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and freed[Component.FULL] < demand:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            for comp, count in self.tree.remove_leaf(node, sinks).items():
                freed[comp] += count
            if not parent.is_root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access[Component.FULL], parent.node_id, parent))
        for c, component in self.tree.components.items():
            component.free(sinks[c])
        return freed


class SwaComponent(_PageComponent):
    """Sliding-window KV: pages are tombstoned (the FULL pages stay).

    A page outside the trailing window of every checkpoint on the device is
    *dead*: no match can use it. Dead pages go first (least recently used
    node first), then live ones, front of a node first (the pages furthest
    from the node's end leave windows first).
    """

    component = Component.SWA

    def evict(self, demand: int) -> dict[Component, int]:
        freed = dict.fromkeys(Component, 0)
        nodes = self._unlocked_lru()
        live = self._live_pages()
        sink: list[int] = []
        for dead_only in (True, False):
            for node in nodes:
                want = demand - len(sink)
                if want <= 0:
                    break
                held = [(o, i) for o, i in self.present(node)
                        if not dead_only or (id(node), o) not in live]
                self._tombstone(node, held[:want], sink)
        freed[Component.SWA] = len(sink)
        self.free(sink)
        return freed

    def _live_pages(self) -> set[tuple[int, int]]:
        """``(id(node), offset)`` of pages in the window of some checkpoint."""
        live: set[tuple[int, int]] = set()
        for node in self.tree.iter_nodes():
            if node.checkpoint is not None:
                live.update((id(n), off) for n, off in self.tree.window_pages(node))
        return live

    def _tombstone(self, node: TreeNode, held: list[tuple[int, int]], sink: list[int]) -> None:
        data = node.pages(Component.SWA)
        owners = self.tree.owners[Component.SWA]
        for off, idx in held:
            data.valid[off] = False
            data.indices[off] = 0
            del owners[idx]
            sink.append(idx)


class MambaComponent(TreeComponent):
    """Recurrent-state checkpoints at node ends; eviction drops checkpoints
    whose SWA window is gone first, then branch checkpoints (not at a
    multiple of ``track_pages``), then least recently used ones."""

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
        sink: list[int] = []
        # A checkpoint whose SWA window was tombstoned is no boundary any
        # more (until the window is restored): drop those first.
        nodes = sorted(self._unlocked_lru(),
                       key=lambda n: (self._usable(n), not self.tree.is_branch_checkpoint(n)))
        for node in nodes:
            if freed[Component.MAMBA] >= demand:
                break
            freed[Component.MAMBA] += self.release(node, sink)
        self.free(sink)
        return freed

    def trim_branches(self, cap: int, keep: TreeNode | None = None) -> int:
        """Drop least recently used unlocked branch checkpoints (never
        ``keep``'s) until at most ``cap`` remain where locks allow; returns
        checkpoints dropped."""
        branches = [n for n in self._unlocked_lru() if self.tree.is_branch_checkpoint(n)]
        total = sum(1 for n in self.tree.iter_nodes() if self.tree.is_branch_checkpoint(n))
        sink: list[int] = []
        for node in branches:
            if total <= cap:
                break
            if node is not keep:
                self.release(node, sink)
                total -= 1
        self.free(sink)
        return len(sink)

    def _usable(self, node: TreeNode) -> bool:
        return all(bool(n.pages(Component.SWA).valid[off])
                   for n, off in self.tree.window_pages(node))


TREE_COMPONENT_TYPES: dict[Component, type[TreeComponent]] = {
    Component.FULL: FullComponent,
    Component.SWA: SwaComponent,
    Component.MAMBA: MambaComponent,
}
