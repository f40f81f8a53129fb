"""The per-component linker interface.

A :class:`ComponentLinker` builds the transfers of one component for the
three phases (OFFLOAD from a tree node, LOOKUP and LOAD for a request) and
drives one load through PREPARE / COMMIT / ABORT. The per-kind rules (which
entries a restore needs, what a node still has to send, how entries are
keyed) are the abstract methods; the concrete kinds live in
``linker/components.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch

from layerlift.linker.contract import (
    HitPolicy,
    LinkerTransferPhase,
    LinkRequest,
    LoadPhase,
    PoolTransfer,
    candidate_boundaries,
    check_keys,
)
from layerlift.linker.keys import KeySchema
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import InsertResult, TreeNode, UnifiedRadixTree

__all__ = ["ComponentLinker", "CowSource"]


class CowSource(NamedTuple):
    """Where a restored request's recurrent state comes from: the canonical
    node's checkpoint ``slot`` (a pointer, never copied at COMMIT) and
    whether that slot is still being filled by this request's load
    (``from_load``: the forward's copy-on-write must wait for the load)."""

    slot: int
    from_load: bool


class ComponentLinker(ABC):
    """Transfer logic of one component over one tree, pool and key schema."""

    component: ClassVar[Component]
    hit_policy: ClassVar[HitPolicy]

    def __init__(
        self, spec: ModelSpec, pool: KVPool, tree: UnifiedRadixTree, schema: KeySchema
    ) -> None:
        self.spec, self.pool, self.tree, self.schema = spec, pool, tree, schema

    # ---- per-kind rules --------------------------------------------------------
    @classmethod
    @abstractmethod
    def trailing(cls, spec: ModelSpec) -> int:
        """N of TRAILING_PAGES, 0 for ALL_PAGES."""

    @classmethod
    @abstractmethod
    def needed(cls, spec: ModelSpec, d: int, b: int) -> list[int]:
        """Entries (pages, or boundaries for MAMBA) needed to restore from
        device boundary d to boundary b."""

    @abstractmethod
    def offload_entries(self, node: TreeNode) -> list[tuple[int, bytes, int]]:
        """``(page, hash, device index)`` the store still lacks for ``node``."""

    @classmethod
    def restorable_at(cls, spec: ModelSpec, d: int, b: int, available: set[int]) -> bool:
        """The hit rule: can this component restore from d to b?"""
        return all(p in available for p in cls.needed(spec, d, b))

    def key_hash(self, request: LinkRequest, entry: int) -> bytes:
        """The page hash that keys ``entry`` (MAMBA overrides: page b - 1)."""
        return request.hashes[entry]

    # ---- phases ------------------------------------------------------------------
    def build_transfer(
        self,
        phase: LinkerTransferPhase,
        *,
        node: TreeNode | None = None,
        request: LinkRequest | None = None,
    ) -> PoolTransfer | None:
        """OFFLOAD needs ``node``; LOOKUP needs ``request``; LOAD needs a
        ``request`` with a ``boundary`` and allocates device slots (on
        shortfall: evict the shortfall from the tree, retry once). ``None``:
        nothing to send / nothing to look up / allocation failed (recompute)."""
        if phase is LinkerTransferPhase.OFFLOAD:
            if node is None:
                raise ValueError("OFFLOAD needs the node to send")
            return self._offload(node)
        if request is None:
            raise ValueError(f"{phase.name} needs the request's page hashes")
        d = request.device_pages
        if phase is LinkerTransferPhase.LOOKUP:
            cands = candidate_boundaries(self.spec, d, request.n_pages)
            entries = sorted({e for b in cands for e in self.needed(self.spec, d, b)})
            return self._transfer(request, entries, None) if entries else None
        b = request.boundary
        if b is None or not d < b <= request.n_pages:
            raise ValueError(f"LOAD needs a boundary b in ({d}, {request.n_pages}]; got {b}")
        entries = self.needed(self.spec, d, b)
        slots = self._alloc(len(entries))
        return None if slots is None else self._transfer(request, entries, slots)

    def update_load(
        self, phase: LoadPhase, transfer: PoolTransfer, *, insert_result: InsertResult | None = None
    ) -> PoolTransfer | None:
        """PREPARE pins the slots. COMMIT (needs ``insert_result``) frees the
        slots the tree did not adopt with ``free_deferred`` (they stay pinned
        while a load may still write them; the caller unpins every PREPAREd
        slot once its load finished) and returns the transfer trimmed to what
        was adopted (``None`` if nothing). ABORT, after PREPARE only, unpins
        and frees every slot (deferred while another pin holds it); the tree
        is not touched. Raises ``ValueError``
        for keys of another schema or a transfer without device indices."""
        check_keys(self.schema, transfer)
        idx = transfer.device_indices
        if idx is None:
            raise ValueError("a load transfer must carry device indices")
        if phase is LoadPhase.PREPARE:
            self.pool.pin(self.component, idx)
            return transfer
        if phase is LoadPhase.ABORT:
            self.pool.unpin(self.component, idx)
            # Deferred: a read that timed out and still runs keeps its pages
            # pinned (engine/loads.py); they are freed once it ended.
            self.pool.free_deferred(self.component, idx)
            self.pool.flush_deferred()
            return None
        if insert_result is None:
            raise ValueError("COMMIT needs the tree's InsertResult")
        keep = set(self.adopted_entries(insert_result)) & set(transfer.pages)
        dropped = [p for p in transfer.pages if p not in keep]
        if dropped:
            self.pool.free_deferred(self.component, transfer.indices_of(dropped))
        return transfer.trimmed(keep) if keep else None

    def discard(self, transfer: PoolTransfer) -> None:
        """Free the slots of a LOAD transfer that was never PREPAREd."""
        if transfer.device_indices is not None and len(transfer):
            self.pool.free(self.component, transfer.device_indices)

    def adopted_entries(self, result: InsertResult) -> list[int]:
        """Entries of this component the tree took in ``result``."""
        return [p for lo, hi in result.adopted.get(self.component, []) for p in range(lo, hi)]

    def mark_stored(self, node: TreeNode, transfer: PoolTransfer | None = None) -> None:
        """Call after a successful put of an OFFLOAD transfer: records it in the
        tree so it is not sent again. A failed put must not call this."""
        pages = None if transfer is None else transfer.pages
        self.tree.mark_stored(node, self.component, pages)

    # ---- helpers -----------------------------------------------------------------
    def _offload(self, node: TreeNode) -> PoolTransfer | None:
        if not self.tree.contains(node) or node.is_root:
            return None
        entries = self.offload_entries(node)
        if not entries:
            return None
        return PoolTransfer(
            self.component,
            tuple(p for p, _, _ in entries),
            tuple(self.schema.keys(self.component.value, [h for _, h, _ in entries])),
            torch.tensor([i for _, _, i in entries], dtype=torch.int64),
            self.hit_policy,
            self.trailing(self.spec),
        )

    def _transfer(
        self, request: LinkRequest, entries: Sequence[int], slots: torch.Tensor | None
    ) -> PoolTransfer:
        hashes = [self.key_hash(request, e) for e in entries]
        return PoolTransfer(
            self.component,
            tuple(entries),
            tuple(self.schema.keys(self.component.value, hashes)),
            slots,
            self.hit_policy,
            self.trailing(self.spec),
        )

    def _alloc(self, n: int) -> torch.Tensor | None:
        got = self.pool.alloc(self.component, n)
        if got is None:
            short = max(1, n - self.pool.available_size(self.component))
            self.tree.evict({self.component: short})
            got = self.pool.alloc(self.component, n)
        return got
