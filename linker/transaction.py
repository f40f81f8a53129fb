"""One request's restore: LOAD -> PREPARE -> COMMIT (-> finish) or ABORT.

::

    txn = RestoreTransaction.load(linkers, LinkRequest(hashes, d, b))  # None: recompute
    txn.prepare()                       # at once: pin the slots (the pool never moves them)
    res = txn.commit(tree, tokens, pending=readiness)
    # issue loads for res.transfers only (duplicates were freed, never load them);
    # the forward copies its state from res.cow_source (COW, no copy at COMMIT)
    txn.finish()                        # after the loads landed (or failed): unpin

``abort()`` after PREPARE (or right after LOAD) frees every slot and leaves
the tree and pool exactly as they were before PREPARE. ``abort()`` after
COMMIT (a load failed midway) also takes the adopted pages back out of the
tree, so no request is ever answered from partial bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from layerlift.linker.components import ComponentLinker, MambaLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest, LoadPhase, PoolTransfer
from layerlift.pools.spec import Component
from layerlift.pools.tree import InsertResult, TreeNode, UnifiedRadixTree

__all__ = ["CommitResult", "RestoreTransaction", "TransactionState"]


class TransactionState(Enum):
    LOADED = "loaded"
    PREPARED = "prepared"
    COMMITTED = "committed"
    FINISHED = "finished"
    ABORTED = "aborted"


class CommitResult(NamedTuple):
    """What COMMIT hands the request.

    ``cow_source``: the canonical checkpoint slot at the restored boundary
    (a pointer; ``cow_from_load`` says whether this request's own load still
    fills it). ``transfers``: per component, the entries to actually load
    (trimmed to what the tree adopted; components with nothing left are
    absent). ``node`` ends at the restored boundary and is locked once on
    the request's behalf (the caller unlocks it). ``insert`` is the tree's
    raw result.
    """

    cow_source: int | None
    transfers: dict[Component, PoolTransfer]
    node: TreeNode
    cow_from_load: bool
    insert: InsertResult


class RestoreTransaction:
    """The per-component LOAD transfers of one request and their life cycle."""

    def __init__(
        self,
        linkers: Mapping[Component, ComponentLinker],
        request: LinkRequest,
        transfers: Mapping[Component, PoolTransfer],
    ) -> None:
        if request.boundary is None:
            raise ValueError("a restore transaction needs the request's boundary")
        if set(transfers) != set(linkers) or set(linkers) != set(Component):
            raise ValueError("a restore transaction needs one linker and transfer per component")
        self.linkers = dict(linkers)
        self.request = request
        self.transfers = dict(transfers)
        self.state = TransactionState.LOADED
        self._commit: CommitResult | None = None
        self._pending: object | None = None
        self._pending_nodes: list[TreeNode] = []

    @classmethod
    def load(
        cls, linkers: Mapping[Component, ComponentLinker], request: LinkRequest
    ) -> RestoreTransaction | None:
        """Allocate device slots for every component (LOAD); ``None`` if any
        allocation fails (everything taken so far is freed: recompute)."""
        got: dict[Component, PoolTransfer] = {}
        for c, linker in linkers.items():
            transfer = linker.build_transfer(LinkerTransferPhase.LOAD, request=request)
            if transfer is None:
                for done, t in got.items():
                    linkers[done].discard(t)
                return None
            got[c] = transfer
        return cls(linkers, request, got)

    @property
    def result(self) -> CommitResult | None:
        """What ``commit`` returned (``None`` before COMMIT)."""
        return self._commit

    @property
    def boundary(self) -> int:
        assert self.request.boundary is not None
        return self.request.boundary

    def prepare(self) -> None:
        """PREPARE: pin every slot so the pool neither moves nor frees it."""
        self._expect(TransactionState.LOADED)
        for c, t in self.transfers.items():
            self.linkers[c].update_load(LoadPhase.PREPARE, t)
        self.state = TransactionState.PREPARED

    def commit(
        self,
        tree: UnifiedRadixTree,
        tokens: Sequence[int] | np.ndarray,
        *,
        pending: object | None = None,
    ) -> CommitResult:
        """COMMIT: insert the loaded pages into ``tree`` (pages before the
        device boundary are the tree's own), free the duplicates (deferred:
        still pinned), trim the transfers to what the tree adopted, hang
        ``pending`` on every node that adopted something, lock the boundary
        node and return the COW source. ``ValueError`` from the tree (e.g.
        the matched prefix was evicted) leaves the transaction PREPARED."""
        self._expect(TransactionState.PREPARED)
        if any(lk.tree is not tree for lk in self.linkers.values()):
            raise ValueError("commit to a tree other than the linkers' tree")
        result = tree.insert(*self._insert_args(tokens), start_page=self.request.device_pages)
        trimmed: dict[Component, PoolTransfer] = {}
        for c, t in self.transfers.items():
            kept = self.linkers[c].update_load(LoadPhase.COMMIT, t, insert_result=result)
            if kept is not None:
                trimmed[c] = kept
        mamba = self.linkers[Component.MAMBA]
        assert isinstance(mamba, MambaLinker)
        cow = mamba.cow_source(result, self.transfers[Component.MAMBA])
        self._pending = pending
        if pending is not None:
            self._pending_nodes = _adopting_nodes(result)
            for node in self._pending_nodes:
                node.pending = pending
        tree.lock(result.node)
        self.state = TransactionState.COMMITTED
        self._commit = CommitResult(cow.slot, trimmed, result.node, cow.from_load, result)
        return self._commit

    def finish(self) -> None:
        """After the loads of a COMMITTED transaction landed: clear the
        ``pending`` it hung on nodes, unpin every slot (adopted ones become
        movable, deferred duplicates freeable) and flush the pool's deferred
        frees. The lock on ``result.node`` stays the caller's."""
        self._expect(TransactionState.COMMITTED)
        self._clear_pending()
        pool = self.linkers[Component.FULL].pool
        for c, t in self.transfers.items():
            if t.device_indices is not None and len(t):
                pool.unpin(c, t.device_indices)
        pool.flush_deferred()
        self.state = TransactionState.FINISHED

    def abort(self) -> None:
        """ABORT: release every slot and leave the tree as it was.

        Before COMMIT: unpin (if PREPAREd) and free every slot; the tree was
        never touched. After COMMIT (a load failed midway, the adopted slots
        hold partial bytes): drop the request's lock, take the adopted pages
        back out of the tree (``UnifiedRadixTree.retract``: SWA tombstoned,
        checkpoints dropped, adopted FULL nodes removed with their subtrees;
        splits the insert made stay, they change no data), then unpin and
        free every slot. ``ValueError`` after ``finish`` or when a dependant
        request still locks a node below the retracted pages (abort those
        first: they waited on this load's ``pending``)."""
        if self.state is TransactionState.LOADED:
            for c, t in self.transfers.items():
                self.linkers[c].discard(t)
        elif self.state is TransactionState.COMMITTED:
            self._retract()
        else:
            self._expect(TransactionState.PREPARED)
            for c, t in self.transfers.items():
                self.linkers[c].update_load(LoadPhase.ABORT, t)
        self.state = TransactionState.ABORTED

    def _retract(self) -> None:
        assert self._commit is not None
        tree, pool = self.linkers[Component.FULL].tree, self.linkers[Component.FULL].pool
        adopted = {c: t.device_indices for c, t in self._commit.transfers.items()
                   if t.device_indices is not None}
        tree.unlock(self._commit.node)
        try:
            tree.retract(adopted)
        except ValueError:
            tree.lock(self._commit.node)
            raise
        self._clear_pending()
        for c, t in self.transfers.items():
            if t.device_indices is not None and len(t):
                pool.unpin(c, t.device_indices)
        for c, idx in adopted.items():
            if len(idx):
                # Deferred: a page another batch still pins (it matched the
                # node before the retract) is freed once that batch unpins it.
                pool.free_deferred(c, idx)
        pool.flush_deferred()

    # ---- helpers -----------------------------------------------------------------
    def _clear_pending(self) -> None:
        tree = self.linkers[Component.FULL].tree
        for node in self._pending_nodes:
            if tree.contains(node) and node.pending is self._pending:
                node.pending = None
        self._pending_nodes = []

    def _expect(self, state: TransactionState) -> None:
        if self.state is not state:
            raise ValueError(f"restore transaction is {self.state.value}, expected {state.value}")

    def _insert_args(
        self, tokens: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, int]]:
        b = self.boundary
        spec = self.linkers[Component.FULL].spec
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(toks) < b * spec.page_size:
            raise ValueError(f"{len(toks)} tokens do not cover the boundary of {b} pages")
        cols = {c: torch.zeros(b, dtype=torch.int64) for c in (Component.FULL, Component.SWA)}
        swa_valid = torch.zeros(b, dtype=torch.bool)
        for c, col in cols.items():
            t = self.transfers[c]
            if len(t):
                assert t.device_indices is not None
                col[torch.tensor(t.pages, dtype=torch.int64)] = t.device_indices
        swa_pages = self.transfers[Component.SWA].pages
        if swa_pages:
            swa_valid[torch.tensor(swa_pages, dtype=torch.int64)] = True
        mamba = self.transfers[Component.MAMBA]
        assert mamba.device_indices is not None
        checkpoints = {
            p: int(i) for p, i in zip(mamba.pages, mamba.device_indices.tolist(), strict=True)
        }
        toks = toks[: b * spec.page_size]
        return toks, cols[Component.FULL], cols[Component.SWA], swa_valid, checkpoints


def _adopting_nodes(result: InsertResult) -> list[TreeNode]:
    """Nodes of ``result`` that took at least one page or checkpoint."""
    pages = {p for ranges in result.adopted.values() for lo, hi in ranges for p in range(lo, hi)}
    new = {id(n) for n in result.new_checkpoint_nodes}
    return [
        n
        for n in result.nodes
        if id(n) in new or any(n.start_page <= p < n.end_page for p in pages)
    ]
