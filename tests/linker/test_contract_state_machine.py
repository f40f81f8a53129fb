"""Hypothesis state machine over concurrent restores (LOAD+PREPARE, COMMIT,
finish, ABORT before and after COMMIT) interleaved with prefills that
publish pages, eviction and pool compaction, on a real tree and pool.

Invariants after every step: tree integrity, pool byte accounting, and
"every used pool page is owned by the tree or by an open restore" (no slot
leaked, none freed while still referenced).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layerlift.linker.components import make_linkers
from layerlift.linker.contract import LinkRequest, candidate_boundaries
from layerlift.linker.keys import KeySchema
from layerlift.linker.transaction import RestoreTransaction, TransactionState
from layerlift.pools import Component, ModelSpec, UnifiedKVPool
from layerlift.pools.hashing import page_hashes
from layerlift.pools.tree import TreeNode, UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
PS = 2
prompts = st.lists(st.integers(0, 1), min_size=2, max_size=5)


class Open:
    """One request's restore in flight: its transaction and the lock it holds
    on the device prefix it matched."""

    def __init__(self, txn: RestoreTransaction, matched: TreeNode, toks: np.ndarray) -> None:
        self.txn, self.matched, self.toks = txn, matched, toks


class RestoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.spec = ModelSpec.preset("tiny", page_size=PS, swa_window=2 * PS,
                                     track_interval=2 * PS)
        sizes = {F: 20, S: 20, M: 8}
        self.pool = UnifiedKVPool(self.spec, sum(n * self.spec.page_bytes(c)
                                                 for c, n in sizes.items()))
        self.tree = UnifiedRadixTree(self.spec, self.pool)
        self.linkers = make_linkers(self.spec, self.pool, self.tree,
                                    KeySchema("sm", self.spec.fingerprint, 0))
        self.open: list[Open] = []

    @rule(pages=prompts)
    def prefill_publishes(self, pages: list[int]) -> None:
        toks = np.repeat(np.asarray(pages, dtype=np.int64), PS)
        n = len(pages)
        ckpts = list(range(2, n + 1, 2))
        got = self.pool.alloc_many({F: n, S: n, M: len(ckpts)})
        if got is None:
            return
        res = self.tree.insert(toks, got[F], got[S], torch.ones(n, dtype=torch.bool),
                               dict(zip(ckpts, got[M].tolist(), strict=True)))
        for c, dup in res.duplicates.items():
            if len(dup):
                self.pool.free(c, dup)

    @rule(pages=prompts, data=st.data())
    def restore_begins(self, pages: list[int], data: st.DataObject) -> None:
        toks = np.repeat(np.asarray(pages, dtype=np.int64), PS)
        match = self.tree.match_prefix(toks)
        cands = candidate_boundaries(self.spec, match.boundary_pages, len(pages))
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        self.tree.lock(match.node)
        req = LinkRequest(tuple(page_hashes(toks, PS)), match.boundary_pages, b)
        txn = RestoreTransaction.load(self.linkers, req)
        if txn is None:
            self.tree.unlock(match.node)
            return
        txn.prepare()
        self.open.append(Open(txn, match.node, toks))

    def _pick(self, data: st.DataObject, state: TransactionState) -> Open | None:
        live = [o for o in self.open if o.txn.state is state]
        return data.draw(st.sampled_from(live)) if live else None

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), with_pending=st.booleans())
    def commit(self, data: st.DataObject, with_pending: bool) -> None:
        req = self._pick(data, TransactionState.PREPARED)
        if req is not None:
            res = req.txn.commit(self.tree, req.toks, pending="load" if with_pending else None)
            assert res.node.end_page == req.txn.boundary and res.cow_source is not None
            assert res.cow_source == res.node.checkpoint

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self._pick(data, TransactionState.COMMITTED)
        if req is not None:
            assert req.txn.result is not None
            node = req.txn.result.node
            req.txn.finish()
            self.tree.unlock(node)
            self._close(req)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), after_commit=st.booleans())
    def abort(self, data: st.DataObject, after_commit: bool) -> None:
        state = TransactionState.COMMITTED if after_commit else TransactionState.PREPARED
        req = self._pick(data, state)
        if req is None:
            return
        try:
            req.txn.abort()
        except ValueError as err:  # a dependant still locks a node below the pages
            assert after_commit and "locked" in str(err)
            return
        self._close(req)

    def _close(self, req: Open) -> None:
        self.open.remove(req)
        self.tree.unlock(req.matched)

    @rule(f=st.integers(0, 4), s=st.integers(0, 4), m=st.integers(0, 2))
    def evict(self, f: int, s: int, m: int) -> None:
        self.tree.evict({F: f, S: s, M: m})

    @rule()
    def compact(self) -> None:
        self.pool.compact_holes()

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        self.pool.verify_byte_accounting()
        for c in Component:
            held = set(self.tree.owners[c])
            for req in self.open:
                idx = req.txn.transfers[c].device_indices
                held |= set(idx.tolist())
            assert self.pool.used_size(c) == len(held), c


RestoreMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_restore_state_machine = RestoreMachine.TestCase
