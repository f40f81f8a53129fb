"""The unified radix tree: one prefix tree for FULL, SWA and MAMBA.

Keys are page-aligned token runs. Per-kind logic (what a node keeps, how it
is adopted, split and evicted) lives in one component object per kind
(``pools/tree_components.py``, with the nodes and their per-component data;
``pools/tree_integrity.py`` validates input and checks invariants); the
tree only walks, splits, locks, retracts and keeps
the reverse maps ``owners[component][device index] -> (node, offset)`` so a
page the pool moves is rewritten in O(moved pages).

Contract (single-threaded: the event-loop thread mutates the tree):

* A node with ``lock_ref > 0`` is never evicted; ``lock`` counts on the node
  and all its ancestors, so a locked node's prefix stays too.
* Checkpoints live at node ends; splitting a node leaves the head without
  one. Most are at multiples of ``track_pages``; a *branch checkpoint* is
  one that is not (taken where a prompt left a cached one between two
  boundaries). An insert carries at most one, at most
  ``max_branch_checkpoints`` live in the tree (the least recently used
  unlocked ones are dropped first), and eviction drops them before interval
  checkpoints.
* ``evict`` and ``drop_all`` free pages through ``pool.free``; the caller
  must lock every node whose pages are pinned (in-flight loads), since the
  pool refuses to free a pinned page.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from layerlift.pools.base import KVPool
from layerlift.pools.hashing import ROOT_HASH, page_hashes
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree_components import (
    TREE_COMPONENT_TYPES,
    InsertBuilder,
    InsertInputs,
    InsertResult,
    MambaComponent,
    PageData,
    SlotData,
    TreeComponent,
    TreeIntegrityError,
    TreeNode,
)
from layerlift.pools.tree_integrity import check_offered, check_tree, validate_insert

__all__ = [
    "InsertResult", "MatchResult", "TreeIntegrityError", "TreeNode", "TreeStats",
    "UnifiedRadixTree",
]

_EVICT_ORDER = (Component.FULL, Component.SWA, Component.MAMBA)


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


class TreeStats(NamedTuple):
    """Sizes of the tree: nodes (root excluded), pages held per component
    (MAMBA: checkpoints), locked nodes, and pages an eviction could free."""

    nodes: int
    pages: dict[Component, int]
    locked_nodes: int
    evictable: dict[Component, int]


class UnifiedRadixTree:
    """Prefix cache of a hybrid model over one :class:`KVPool`.

    ``branch_checkpoints``: whether the engine should capture branch
    checkpoints (read by ``engine/compute.py``; the engine passes
    ``EngineConfig.branch_checkpoints``). ``max_branch_checkpoints``: how
    many may live at once (see the module docstring).
    """

    def __init__(self, spec: ModelSpec, pool: KVPool, *, branch_checkpoints: bool = True,
                 max_branch_checkpoints: int = 64) -> None:
        if max_branch_checkpoints < 0:
            raise ValueError(f"max_branch_checkpoints must be >= 0, got {max_branch_checkpoints}")
        self.spec = spec
        self.pool = pool
        self.max_branch_checkpoints = max_branch_checkpoints
        # Whether the engine captures branch checkpoints (EngineConfig.branch_checkpoints):
        # read by engine/compute.py; the tree accepts them either way.
        self.branch_checkpoints = branch_checkpoints
        self.page_size = spec.page_size
        self.components: dict[Component, TreeComponent] = {
            c: TREE_COMPONENT_TYPES[c](self) for c in Component
        }
        self.owners: dict[Component, dict[int, tuple[TreeNode, int]]] = {c: {} for c in Component}
        self._nodes: dict[int, TreeNode] = {}
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node(None, np.zeros(0, dtype=np.int64), 0, [])
        # A weak listener: the pool must not keep the tree (and, through it,
        # the pool's own buffer) alive in a reference cycle after both are dropped.
        on_move = weakref.WeakMethod(self._on_move)

        def relay(component: Component, old: torch.Tensor, new: torch.Tensor) -> None:
            method = on_move()
            if method is not None:
                method(component, old, new)

        pool.add_move_listener(relay)

    # ---- queries -------------------------------------------------------------
    def __len__(self) -> int:
        """Nodes, the root excluded."""
        return len(self._nodes) - 1

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root (snapshot: safe to mutate while iterating)."""
        return iter([n for n in self._nodes.values() if not n.is_root])

    def contains(self, node: TreeNode) -> bool:
        """Whether ``node`` is still part of the tree (not evicted)."""
        return self._nodes.get(node.node_id) is node

    def is_branch_checkpoint(self, node: TreeNode) -> bool:
        """Whether ``node`` holds a checkpoint off the ``track_pages`` grid."""
        return node.checkpoint is not None and node.end_page % self.spec.track_pages != 0

    def branch_checkpoint_count(self) -> int:
        return sum(1 for n in self.iter_nodes() if self.is_branch_checkpoint(n))

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> MatchResult:
        """Longest restorable prefix on the device (see :class:`MatchResult`).

        A trailing partial page of ``tokens`` is ignored. Touches the access
        time of every matched node. Never mutates the tree's structure.
        """
        toks = self._tokens(tokens, aligned=False)
        path = self._walk(toks)
        self._clock += 1
        for node, _ in path:
            node.last_access = dict.fromkeys(Component, self._clock)
        kv_pages = sum(m for _, m in path)
        swa_valid = torch.cat(
            [torch.zeros(0, dtype=torch.bool)]
            + [n.pages(Component.SWA).valid[:m] for n, m in path]
        )
        missing = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(~swa_valid, 0)])
        d, d_node, window = 0, self.root, self.spec.window_pages
        for node, m in path:
            if m == node.num_pages and node.checkpoint is not None:
                e = node.end_page
                if int(missing[e]) == int(missing[max(0, e - window)]):
                    d, d_node = e, node
        full = self._gather(path, Component.FULL)
        return MatchResult(
            boundary_pages=d,
            full_indices=full[:d].clone(),
            swa_indices=self._gather(path, Component.SWA)[:d].clone(),
            mamba_slot=d_node.checkpoint,
            node=d_node,
            kv_pages=kv_pages,
            kv_full_indices=full,
            pending=[n.pending for n, _ in path if n.end_page <= d and n.pending is not None],
        )

    # ---- insert ----------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        full: torch.Tensor,
        swa: torch.Tensor,
        swa_valid: torch.Tensor,
        checkpoints: Mapping[int, int],
        *,
        start_page: int = 0,
    ) -> InsertResult:
        """Publish a prompt's pages (see :class:`InsertResult`).

        ``tokens`` holds n whole pages; ``full``/``swa``/``swa_valid`` have n
        entries; entries before ``start_page`` are ignored but those pages must
        already be in the tree. ``checkpoints`` maps boundaries (multiples of
        ``track_pages`` in ``(start_page, n]``, plus at most one branch
        checkpoint anywhere in that range) to state slots. A branch
        checkpoint beyond ``max_branch_checkpoints`` (after dropping unlocked
        ones) is not taken: it comes back in ``duplicates``. Raises
        ``ValueError`` on bad input, before changing anything.
        """
        toks = self._tokens(tokens, aligned=True)
        inputs = validate_insert(self, len(toks) // self.page_size, full, swa, swa_valid,
                                 checkpoints, start_page)
        path = self._walk(toks)
        matched = sum(m for _, m in path)
        if matched < start_page:
            raise ValueError(
                f"start_page is {start_page} but the tree holds only {matched} pages of this "
                "prompt: pages before start_page must already be in the tree"
            )
        check_offered(self, path, inputs)
        out = InsertBuilder()
        return self._insert_walk(toks, self._admit_branch(inputs, path, out), out)

    def _admit_branch(self, inputs: InsertInputs, path: list[tuple[TreeNode, int]],
                      out: InsertBuilder) -> InsertInputs:
        """Make room for the insert's branch checkpoint under the cap, or decline it."""
        t = self.spec.track_pages
        branch = [b for b in inputs.checkpoints if b % t]
        if not branch:
            return inputs
        b = branch[0]
        if any(n.end_page == b and m == n.num_pages and n.checkpoint is not None
               for n, m in path):
            return inputs  # the tree has one there already: merge reports the duplicate
        mamba = self.components[Component.MAMBA]
        assert isinstance(mamba, MambaComponent)
        if self.max_branch_checkpoints > 0:
            mamba.trim_branches(self.max_branch_checkpoints - 1)
            if self.branch_checkpoint_count() < self.max_branch_checkpoints:
                return inputs
        out.duplicate(Component.MAMBA, inputs.checkpoints[b])
        kept = {p: s for p, s in inputs.checkpoints.items() if p != b}
        return inputs._replace(checkpoints=kept)

    def _insert_walk(self, toks: np.ndarray, inputs: InsertInputs,
                     out: InsertBuilder) -> InsertResult:
        cuts = sorted(inputs.checkpoints)
        self._clock += 1
        node, p, n = self.root, 0, inputs.n_pages
        while p < n:
            child = node.children.get(self._page_key(toks, p))
            if child is None:
                child = self._grow(node, toks, p, n, cuts)
            nxt = cuts[bisect.bisect_right(cuts, p)] if cuts and cuts[-1] > p else n
            cut = min(self._common_pages(child, toks, p), nxt - p)
            if cut < child.num_pages:
                child = self.split(child, cut)
            for comp in self.components.values():
                comp.merge(child, inputs, out)
            child.last_access = dict.fromkeys(Component, self._clock)
            if child.end_page > inputs.start_page:
                out.nodes.append(child)
            node, p = child, p + cut
        return out.build(node, {c: self._gather([(m, m.num_pages) for m in node.path()], c)
                                for c in (Component.FULL, Component.SWA)})

    def _grow(self, parent: TreeNode, toks: np.ndarray, p: int, n: int,
              cuts: list[int]) -> TreeNode:
        """A new empty child of ``parent`` for pages ``[p, next cut or n)``."""
        i = bisect.bisect_right(cuts, p)
        end = cuts[i] if i < len(cuts) and cuts[i] < n else n
        ps = self.page_size
        key = toks[p * ps : end * ps].copy()
        hashes = page_hashes(key, ps, parent.last_hash or ROOT_HASH)
        child = self._new_node(parent, key, p, hashes)
        parent.children[self._page_key(key, 0)] = child
        return child

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Split ``node`` after its first ``k`` pages; returns the new head
        (``node`` keeps the tail). The head has no checkpoint; hashes, stored
        marks (MAMBA: the head's flag is unset: nothing was ever stored at its
        new boundary), pending, lock refs and access times carry."""
        if not 0 < k < node.num_pages or node.parent is None:
            raise ValueError(f"cannot split {node} after {k} pages")
        ps = self.page_size
        parts = {c: comp.split(node.data[c], k) for c, comp in self.components.items()}
        head = self._new_node(node.parent, node.key[: k * ps].copy(), node.start_page,
                              node.hashes[:k])
        head.data = {c: h for c, (h, _) in parts.items()}
        node.data = {c: t for c, (_, t) in parts.items()}
        head.lock_ref, head.pending = node.lock_ref, node.pending
        head.last_access = dict(node.last_access)
        head.stored = {**node.stored, Component.MAMBA: False}
        node.parent.children[self._page_key(node.key, 0)] = head
        node.key, node.hashes = node.key[k * ps :].copy(), node.hashes[k:]
        node.start_page += k
        node.parent = head
        head.children[self._page_key(node.key, 0)] = node
        for part in (head, node):
            for comp in self.components.values():
                comp.own(part)
            for c in (Component.FULL, Component.SWA):
                part.stored[c] = bool(part.pages(c).stored.all())
        return head

    # ---- locks, eviction -------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (refcounted)."""
        for n in self._ancestry(node):
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock``; ``ValueError`` if the node is not locked."""
        chain = self._ancestry(node)
        if any(n.lock_ref <= 0 for n in chain):
            raise ValueError(f"unlock of {node}, which is not locked")
        for n in chain:
            n.lock_ref -= 1

    def evict(self, demand: Mapping[Component, int]) -> dict[Component, int]:
        """Free at least ``demand[c]`` pages per component where unlocked
        nodes allow, least recently used first; returns pages freed per
        component (FULL eviction also frees SWA pages and checkpoints, which
        count toward those demands). ``evict({})`` is always safe."""
        if any(v < 0 for v in demand.values()):
            raise ValueError(f"eviction demand must be non-negative, got {dict(demand)}")
        freed = dict.fromkeys(Component, 0)
        for c in _EVICT_ORDER:
            want = demand.get(c, 0) - freed[c]
            if want > 0:
                for comp, count in self.components[c].evict(want).items():
                    freed[comp] += count
        return freed

    def drop_all(self) -> None:
        """Evict every unlocked node."""
        total = sum(n.num_pages for n in self._nodes.values())
        self.evict({Component.FULL: total, Component.SWA: total, Component.MAMBA: total})

    def remove_leaf(self, node: TreeNode,
                    sinks: Mapping[Component, list[int]] | None = None) -> dict[Component, int]:
        """Free an unlocked leaf entirely and detach it; pages freed per
        component (into ``sinks`` instead, for one batched free by the caller)."""
        if not node.is_leaf or node.lock_ref or node.parent is None:
            raise ValueError(f"{node} is not an unlocked leaf")
        freed = {c: comp.release(node, None if sinks is None else sinks[c])
                 for c, comp in self.components.items()}
        del node.parent.children[self._page_key(node.key, 0)]
        del self._nodes[node.node_id]
        return freed

    def retract(self, released: Mapping[Component, torch.Tensor]) -> None:
        """Take back indices an insert adopted whose bytes are bad, *without*
        freeing them (the caller owns them again and frees them); pages of
        removed subtrees that are not in ``released`` are freed through the pool.

        Why: a restore COMMITs (the tree adopts the slots) before its
        per-layer loads finish; if a load then fails, the adopted pages hold
        partial bytes and must leave the tree. SWA pages become tombstones
        and MAMBA checkpoints are dropped. FULL pages cannot be tombstoned (a
        node always has its FULL pages), and the pages an insert adopts for
        FULL always form whole new nodes, so the nodes owning them are
        removed with their subtrees (whatever hung below a bad prefix is bad
        too).

        ``ValueError``, before anything changes, if an index is not owned by
        the tree or a subtree to remove holds a locked node.
        """
        owners = self.owners
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
                    self.remove_leaf(node)
                    removed.add(id(node))

    # ---- accounting ------------------------------------------------------------
    def stats(self) -> TreeStats:
        nodes = list(self.iter_nodes())
        pages = {c: sum(len(comp.present(n)) for n in nodes)
                 for c, comp in self.components.items()}
        evictable = {c: sum(len(comp.present(n)) for n in nodes if n.lock_ref == 0)
                     for c, comp in self.components.items()}
        return TreeStats(len(nodes), pages, sum(1 for n in nodes if n.lock_ref), evictable)

    def check_integrity(self) -> None:
        """Raise :class:`TreeIntegrityError` on any broken invariant."""
        check_tree(self)

    # ---- offload bookkeeping --------------------------------------------------
    def window_pages(self, node: TreeNode) -> list[tuple[TreeNode, int]]:
        """``(node, offset)`` of the pages ``[end - W, end)`` before ``node``'s
        end, walking up into ancestors, in page order."""
        out: list[tuple[TreeNode, int]] = []
        lo = max(0, node.end_page - self.spec.window_pages)
        cur: TreeNode | None = node
        while cur is not None and cur.end_page > lo and not cur.is_root:
            first = max(lo, cur.start_page) - cur.start_page
            out[:0] = [(cur, off) for off in range(first, cur.num_pages)]
            cur = cur.parent
        return out

    def mark_stored(self, node: TreeNode, component: Component,
                    pages: Iterable[int] | None = None) -> None:
        """Record that ``component``'s data reached the store (call after a
        successful put only; a failed put leaves the flags unset).

        ``pages`` are the transfer's entries: absolute page positions along
        ``node``'s path (MAMBA: boundaries). Default: every page of ``node``
        (FULL), its trailing window (SWA), its checkpoint (MAMBA). Giving the
        pages keeps this exact even if ``node`` was split while the put was
        in flight. A node evicted meanwhile is ignored."""
        if not self.contains(node):
            return
        if component is Component.MAMBA:
            want = {node.end_page} if pages is None else set(pages)
            for n in node.path():
                if n.end_page in want:
                    n.stored[Component.MAMBA] = True
            return
        if pages is not None:
            targets = self._positions(node, set(pages))
        elif component is Component.SWA:
            targets = self.window_pages(node)
        else:
            targets = [(node, off) for off in range(node.num_pages)]
        for owner, off in targets:
            owner.pages(component).stored[off] = True
        for owner in {id(o): o for o, _ in targets}.values():
            owner.stored[component] = bool(owner.pages(component).stored.all())

    def _positions(self, node: TreeNode, pages: set[int]) -> list[tuple[TreeNode, int]]:
        return [(n, p - n.start_page) for n in node.path()
                for p in range(n.start_page, n.end_page) if p in pages]

    # ---- walking -----------------------------------------------------------------
    def _tokens(self, tokens: Sequence[int] | np.ndarray, *, aligned: bool) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if aligned and len(toks) % self.page_size:
            raise ValueError(
                f"{len(toks)} tokens is not a whole number of pages (page_size "
                f"{self.page_size}): the tree stores page-aligned keys only"
            )
        return toks[: len(toks) - len(toks) % self.page_size]

    def _page_key(self, toks: np.ndarray, page: int) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(toks[page * ps : (page + 1) * ps].tolist())

    def _common_pages(self, node: TreeNode, toks: np.ndarray, p: int) -> int:
        rest = toks[p * self.page_size :]
        n = min(len(node.key), len(rest))
        eq = node.key[:n] == rest[:n]
        first = n if bool(eq.all()) else int(np.argmin(eq))
        return first // self.page_size

    def _walk(self, toks: np.ndarray) -> list[tuple[TreeNode, int]]:
        """``(node, matched pages)`` along the path matching ``toks``."""
        path: list[tuple[TreeNode, int]] = []
        node, p, n = self.root, 0, len(toks) // self.page_size
        while p < n:
            child = node.children.get(self._page_key(toks, p))
            if child is None:
                break
            m = self._common_pages(child, toks, p)
            path.append((child, m))
            if m < child.num_pages:
                break
            node, p = child, p + m
        return path

    def _gather(self, path: Sequence[tuple[TreeNode, int]], c: Component) -> torch.Tensor:
        parts = [n.pages(c).indices[:m] for n, m in path]
        return torch.cat([torch.zeros(0, dtype=torch.int64), *parts])

    # ---- internals -------------------------------------------------------------
    def _new_node(self, parent: TreeNode | None, key: np.ndarray, start: int,
                  hashes: list[bytes]) -> TreeNode:
        data = {c: comp.blank(len(hashes)) for c, comp in self.components.items()}
        node = TreeNode(parent, key, start, hashes, data, self._next_id)
        self._next_id += 1
        self._nodes[node.node_id] = node
        return node

    def _ancestry(self, node: TreeNode) -> list[TreeNode]:
        if not self.contains(node):
            raise ValueError(f"{node} is not in this tree (evicted?)")
        chain: list[TreeNode] = []
        cur: TreeNode | None = node
        while cur is not None:
            chain.append(cur)
            cur = cur.parent
        return chain

    def _on_move(self, component: Component, old: torch.Tensor, new: torch.Tensor) -> None:
        owners = self.owners[component]
        moved = [(owners.pop(o), n) for o, n in zip(old.tolist(), new.tolist(), strict=True)
                 if o in owners]
        comp = self.components[component]
        for (node, off), idx in moved:
            comp.set_index(node.data[component], off, idx)
            owners[idx] = (node, off)


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
