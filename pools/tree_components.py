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

Also here, so that this file reads on its own: the nodes and what each
component keeps per node (``PageData`` for FULL and SWA, ``SlotData`` for
MAMBA), the insert's validated inputs and its result builder, and
:class:`TreeView`, what a component (and the integrity checker) reads from
its tree. Imports run one way: this file <- ``tree_integrity.py`` <- ``tree.py``.

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

Nodes carry no per-kind logic; that lives in the component classes below.
"""

from __future__ import annotations

import heapq
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "TREE_COMPONENT_TYPES", "ComponentData", "FullComponent", "InsertBuilder", "InsertInputs",
    "InsertResult", "MambaComponent", "PageData", "SlotData", "SwaComponent", "TreeComponent",
    "TreeIntegrityError", "TreeNode", "TreeView",
]


# ---- nodes and what each component keeps per node -------------------------
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


# ---- one insert's inputs and result ----------------------------------------
class InsertInputs(NamedTuple):
    """What the caller of ``insert`` offers, validated (``n_pages`` entries)."""

    n_pages: int
    start_page: int
    pages: dict[Component, torch.Tensor]
    valid: dict[Component, torch.Tensor]
    checkpoints: dict[int, int]


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


class TreeView(Protocol):
    """What a component and the integrity checker read from their tree
    (:class:`~layerlift.pools.tree.UnifiedRadixTree` implements it)."""

    spec: ModelSpec
    pool: KVPool
    page_size: int
    root: TreeNode
    max_branch_checkpoints: int
    components: dict[Component, TreeComponent]
    owners: dict[Component, dict[int, tuple[TreeNode, int]]]

    def __len__(self) -> int: ...
    def iter_nodes(self) -> Iterator[TreeNode]: ...
    def contains(self, node: TreeNode) -> bool: ...
    def is_branch_checkpoint(self, node: TreeNode) -> bool: ...
    def window_pages(self, node: TreeNode) -> list[tuple[TreeNode, int]]: ...
    def remove_leaf(self, node: TreeNode, sinks: Mapping[Component, list[int]] | None = None
                    ) -> dict[Component, int]: ...


class TreeComponent(ABC):
    """Per-kind behaviour; ``tree`` gives access to the pool and owner maps."""

    component: Component

    def __init__(self, tree: TreeView) -> None:
        # A proxy, not a reference: the tree owns its components, and a cycle
        # would keep the tree and its pool's buffer alive until the next GC.
        self.tree: TreeView = weakref.proxy(tree)

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
