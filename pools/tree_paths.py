"""Path helpers of the unified radix tree: walking a prompt down the tree,
gathering indices along a path, and the offload bookkeeping that walks up
from a node (its trailing SWA window, ``mark_stored``).

A mixin of :class:`layerlift.pools.tree.UnifiedRadixTree`; it only reads
``root``, ``page_size``, ``spec`` and ``contains``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree_node import TreeNode

__all__ = ["TreePaths"]


class TreePaths(ABC):
    """Walks and path bookkeeping shared by the tree's operations."""

    root: TreeNode
    page_size: int
    spec: ModelSpec

    @abstractmethod
    def contains(self, node: TreeNode) -> bool:
        """Whether ``node`` is still in the tree (not evicted)."""

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

