"""The transfer contract: PoolTransfer, per-component LOOKUP/OFFLOAD/LOAD,
and one request's PREPARE / COMMIT / ABORT over a real tree and pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerlift.linker.components import ComponentLinker, make_linkers
from layerlift.linker.contract import (
    HitPolicy,
    LinkerTransferPhase,
    LinkRequest,
    LoadPhase,
    PoolTransfer,
)
from layerlift.linker.keys import KeySchema
from layerlift.linker.transaction import RestoreTransaction
from layerlift.pools import Component, ModelSpec, PoolError, UnifiedKVPool
from layerlift.pools.hashing import page_hashes
from layerlift.pools.tree import InsertResult, UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
PS = 2
LOOKUP, LOAD, OFFLOAD = LinkerTransferPhase.LOOKUP, LinkerTransferPhase.LOAD, \
    LinkerTransferPhase.OFFLOAD


class Rig:
    """A spec, a real pool, a tree and the three linkers."""

    def __init__(self, window_pages: int = 2, track_pages: int = 2,
                 sizes: tuple[int, int, int] = (64, 64, 16)) -> None:
        self.spec = ModelSpec.preset("tiny", page_size=PS, swa_window=window_pages * PS,
                                     track_interval=track_pages * PS)
        total = sum(n * self.spec.page_bytes(c) for c, n in zip((F, S, M), sizes, strict=True))
        self.pool = UnifiedKVPool(self.spec, total)
        self.tree = UnifiedRadixTree(self.spec, self.pool)
        self.schema = KeySchema("test", self.spec.fingerprint, 0)
        self.linkers: dict[Component, ComponentLinker] = make_linkers(
            self.spec, self.pool, self.tree, self.schema)

    def publish(self, toks: np.ndarray, ckpts: tuple[int, ...]) -> InsertResult:
        """Insert freshly computed pages (what a prefill does)."""
        n = len(toks) // PS
        slots = self.pool.alloc(M, len(ckpts))
        res = self.tree.insert(toks, self.pool.alloc(F, n), self.pool.alloc(S, n),
                               torch.ones(n, dtype=torch.bool),
                               dict(zip(ckpts, slots.tolist(), strict=True)))
        for c, dup in res.duplicates.items():
            if len(dup):
                self.pool.free(c, dup)
        return res

    def offload(self, node: object, *, store: bool = True) -> dict[Component, PoolTransfer]:
        out = {}
        for c, lk in self.linkers.items():
            t = lk.build_transfer(OFFLOAD, node=node)
            if t is not None:
                out[c] = t
                if store:
                    lk.mark_stored(node, t)
        return out

    def request(self, toks: np.ndarray, boundary: int | None = None) -> LinkRequest:
        d = self.tree.match_prefix(toks).boundary_pages
        return LinkRequest(tuple(page_hashes(toks, PS)), d, boundary)

    def snapshot(self) -> tuple[object, ...]:
        nodes = sorted(
            (n.start_page, n.end_page, tuple(n.key.tolist()), tuple(n.pages(F).indices.tolist()),
             tuple(n.pages(S).indices.tolist()), tuple(n.pages(S).valid.tolist()),
             n.checkpoint, n.lock_ref, tuple(n.stored.values()))
            for n in self.tree.iter_nodes())
        return (tuple(nodes), tuple(self.pool.used_size(c) for c in Component),
                tuple(self.pool.available_size(c) for c in Component))

    def check(self) -> None:
        self.tree.check_integrity()
        self.pool.verify_byte_accounting()


def tokens(*pages: int) -> np.ndarray:
    return np.repeat(np.asarray(pages, dtype=np.int64), PS)


# ---- PoolTransfer ------------------------------------------------------------------
def test_pool_transfer_validates_and_trims() -> None:
    t = PoolTransfer(F, (2, 3, 4), ("a", "b", "c"), torch.tensor([7, 8, 9]), HitPolicy.ALL_PAGES)
    kept = t.trimmed([4, 2, 99])
    assert kept.pages == (2, 4) and kept.keys == ("a", "c")
    assert kept.device_indices.tolist() == [7, 9] and len(t.trimmed([])) == 0
    with pytest.raises(ValueError, match="keys"):
        PoolTransfer(F, (1, 2), ("a",), None, HitPolicy.ALL_PAGES)
    with pytest.raises(ValueError, match="trailing"):
        PoolTransfer(S, (1,), ("a",), None, HitPolicy.TRAILING_PAGES)
    with pytest.raises(ValueError, match="ascending"):
        PoolTransfer(F, (2, 1), ("a", "b"), None, HitPolicy.ALL_PAGES)


# ---- LOOKUP ------------------------------------------------------------------------
def test_lookup_transfers_per_component() -> None:
    rig = Rig(window_pages=2, track_pages=2)
    toks = tokens(*range(7))
    hashes = page_hashes(toks, PS)
    req = LinkRequest(tuple(hashes), 1)
    got = {c: lk.build_transfer(LOOKUP, request=req) for c, lk in rig.linkers.items()}
    # Every page boundary in (d, n] is a candidate: checkpoints sit on the
    # track grid and at branch pages, and LOOKUP asks about each.
    assert got[F].pages == (1, 2, 3, 4, 5, 6) and got[F].hit_policy is HitPolicy.ALL_PAGES
    assert got[S].pages == (1, 2, 3, 4, 5, 6) and got[S].trailing == 2
    assert got[M].pages == (2, 3, 4, 5, 6, 7) and got[M].trailing == 1
    assert got[M].keys == tuple(rig.schema.keys("mamba", list(hashes[1:7])))
    assert got[F].keys[0] == rig.schema.key("full", hashes[1])
    assert all(t.device_indices is None for t in got.values())
    wide = Rig(window_pages=1, track_pages=3)
    req = LinkRequest(tuple(page_hashes(tokens(*range(9)), PS)), 3)
    assert wide.linkers[S].build_transfer(LOOKUP, request=req).pages == (3, 4, 5, 6, 7, 8)
    none = LinkRequest(tuple(hashes[:1]), 1)  # the device holds every page: nothing to ask
    assert rig.linkers[F].build_transfer(LOOKUP, request=none) is None


# ---- OFFLOAD -----------------------------------------------------------------------
def test_offload_sends_each_thing_once_and_retries_after_a_failed_put() -> None:
    rig = Rig(window_pages=2, track_pages=2)
    res = rig.publish(tokens(1, 2, 3, 4, 5), (4,))
    node = res.nodes[0]
    sent = rig.offload(node, store=False)  # the put failed: nothing marked
    assert sent[F].pages == (0, 1, 2, 3) and sent[S].pages == (2, 3) and sent[M].pages == (4,)
    assert sent[M].keys == (rig.schema.key("mamba", node.hashes[-1]),)
    assert torch.equal(sent[F].device_indices, node.pages(F).indices)
    again = rig.offload(node)
    assert {c: t.pages for c, t in again.items()} == {c: t.pages for c, t in sent.items()}
    assert rig.offload(node) == {}
    assert node.stored[F] and node.stored[M] and not node.stored[S]  # pages 0, 1 never sent
    tail = rig.offload(res.nodes[1])
    assert set(tail) == {F}  # no checkpoint at page 5: no SWA window, no state


def test_new_checkpoint_after_a_branch_sends_only_the_checkpoint() -> None:
    rig = Rig(window_pages=4, track_pages=2)
    first = rig.publish(tokens(1, 2, 3, 4), (4,))
    rig.offload(first.node)
    branch = rig.publish(tokens(1, 2, 8, 9), (2, 4))
    head = branch.nodes[0]
    assert (head.end_page, head.stored[F], head.stored[S], head.stored[M]) == (2, True, True, False)
    sent = rig.offload(head)
    assert set(sent) == {M} and sent[M].pages == (2,)  # no FULL/SWA page re-sent
    assert set(rig.offload(branch.node)) == {F, S, M}
    assert rig.offload(head) == {} and rig.offload(first.node) == {}
    rig.check()


def test_a_split_while_the_put_is_in_flight_marks_both_parts() -> None:
    rig = Rig(window_pages=2, track_pages=2)
    node = rig.publish(tokens(1, 2, 3, 4), (4,)).node
    sent = {c: rig.linkers[c].build_transfer(OFFLOAD, node=node) for c in Component}
    head = rig.publish(tokens(1, 2), (2,)).node  # splits ``node`` before the put ends
    for c, t in sent.items():
        rig.linkers[c].mark_stored(node, t)
    assert head.stored[F] and node.stored[F] and node.stored[M] and not head.stored[M]
    assert set(rig.offload(head, store=False)) == {S, M}  # the window [0, 2) is new
    rig.check()


def test_new_checkpoint_whose_window_was_never_stored_sends_the_window() -> None:
    rig = Rig(window_pages=2, track_pages=2)
    first = rig.publish(tokens(1, 2, 3, 4, 5, 6), (6,))
    rig.offload(first.node)
    branch = rig.publish(tokens(1, 2, 3, 4), (4,))
    sent = rig.offload(branch.node)
    assert set(sent) == {S, M} and sent[S].pages == (2, 3) and sent[M].pages == (4,)


# ---- LOAD / PREPARE / COMMIT / ABORT ------------------------------------------------
def restore(rig: Rig, toks: np.ndarray, b: int) -> RestoreTransaction:
    txn = RestoreTransaction.load(rig.linkers, rig.request(toks, b))
    assert txn is not None
    txn.prepare()
    return txn


def test_restore_commit_publishes_and_sets_the_cow_source() -> None:
    rig = Rig()
    toks = tokens(1, 2, 3, 4, 5)
    txn = restore(rig, toks, 4)
    assert {c: t.pages for c, t in txn.transfers.items()} == {
        F: (0, 1, 2, 3), S: (2, 3), M: (4,)}
    with pytest.raises(PoolError):
        rig.pool.free(F, txn.transfers[F].device_indices)  # pinned
    res = txn.commit(rig.tree, toks, pending="loading")
    assert res.cow_from_load and res.cow_source == int(txn.transfers[M].device_indices[0])
    assert {c: t.pages for c, t in res.transfers.items()} == {F: (0, 1, 2, 3), S: (2, 3), M: (4,)}
    m = rig.tree.match_prefix(toks)
    assert (m.boundary_pages, m.mamba_slot, m.pending) == (4, res.cow_source, ["loading"])
    assert res.node.lock_ref == 1
    txn.finish()
    assert rig.tree.match_prefix(toks).pending == []
    rig.tree.unlock(res.node)
    rig.check()
    assert rig.tree.stats().pages == {c: rig.pool.used_size(c) for c in Component}


def test_two_requests_restoring_the_same_prefix_load_each_slot_once() -> None:
    rig = Rig()
    toks = tokens(1, 2, 3, 4, 5, 6)
    first, second, third = restore(rig, toks, 4), restore(rig, toks, 6), restore(rig, toks, 4)
    a = first.commit(rig.tree, toks)
    b = second.commit(rig.tree, toks)
    assert {c: t.pages for c, t in b.transfers.items()} == {F: (4, 5), S: (4, 5), M: (6,)}
    assert b.insert.adopted[F] == [(4, 6)] and len(b.insert.duplicates[F]) == 4
    c = third.commit(rig.tree, toks)
    assert c.transfers == {} and not c.cow_from_load and c.cow_source == a.cow_source
    loaded = [int(i) for r in (a, b, c) for t in r.transfers.values() for i in t.device_indices]
    assert len(loaded) == len(set(loaded)) == 4 + 1 + 2 + 2 + 2 + 1  # no slot loaded twice
    assert rig.pool.used_size(F) == 4 + 6 + 4  # duplicates are pinned until finish()
    for txn in (first, second, third):
        txn.finish()
    for r in (a, b, c):
        rig.tree.unlock(r.node)
    rig.check()
    assert rig.tree.stats().pages == {F: 6, S: 4, M: 2}
    assert rig.tree.stats().pages == {c_: rig.pool.used_size(c_) for c_ in Component}


def test_abort_after_prepare_restores_the_exact_previous_state() -> None:
    rig = Rig()
    rig.publish(tokens(1, 2), (2,))
    toks = tokens(1, 2, 3, 4, 5)
    before = rig.snapshot()
    txn = restore(rig, toks, 4)
    assert txn.transfers[F].pages == (2, 3)  # pages before d are the device's
    assert rig.snapshot() != before
    txn.abort()
    assert rig.snapshot() == before
    rig.check()
    unprepared = RestoreTransaction.load(rig.linkers, rig.request(toks, 4))
    unprepared.abort()
    assert rig.snapshot() == before
    done = restore(rig, toks, 4)
    done.commit(rig.tree, toks)
    done.finish()
    with pytest.raises(ValueError, match="finished"):
        done.abort()


def test_abort_after_commit_takes_the_adopted_pages_back() -> None:
    rig = Rig()
    rig.publish(tokens(1, 2), (2,))
    toks = tokens(1, 2, 3, 4, 5)
    before = rig.snapshot()
    txn = restore(rig, toks, 4)
    res = txn.commit(rig.tree, toks, pending="loading")
    assert rig.tree.match_prefix(toks).boundary_pages == 4
    dependant = rig.publish(tokens(1, 2, 3, 4, 7, 8), (6,))  # built on the bad pages
    rig.tree.lock(dependant.node)
    with pytest.raises(ValueError, match="locked"):
        txn.abort()
    rig.tree.unlock(dependant.node)
    txn.abort()  # a layer failed: nobody may read the partial pages, nor what hangs below
    assert rig.snapshot() == before
    assert rig.tree.match_prefix(toks).pending == []
    rig.check()
    assert not rig.tree.contains(res.node)


def test_abort_after_commit_restores_tombstones_and_checkpoints() -> None:
    rig = Rig()
    first = rig.publish(tokens(1, 2, 3, 4), (2, 4))
    rig.tree.evict({M: 1})  # the checkpoint at 2 (least recently used)
    rig.tree.match_prefix(tokens(1, 2, 3, 4))
    rig.tree.evict({S: 1})  # tombstone page 0, outside the window of 4
    assert rig.tree.match_prefix(tokens(1, 2)).boundary_pages == 0
    before = rig.snapshot()
    txn = restore(rig, tokens(1, 2), 2)
    res = txn.commit(rig.tree, tokens(1, 2))
    assert res.insert.adopted[S] == [(0, 1)] and res.insert.adopted_checkpoints == [2]
    txn.abort()
    assert rig.snapshot() == before and first.node.checkpoint is not None
    rig.check()


def test_load_evicts_on_shortfall_and_gives_up_cleanly() -> None:
    rig = Rig(sizes=(8, 8, 4))
    i = 0
    while rig.pool.can_alloc({F: 2, S: 2, M: 1}):
        rig.publish(tokens(10 + i, 20 + i), (2,))
        i += 1
    toks = tokens(1, 2, 3, 4)
    demand = {F: 4, S: 2, M: 1}
    assert i >= 2 and not rig.pool.can_alloc(demand)
    txn = RestoreTransaction.load(rig.linkers, rig.request(toks, 4))
    assert txn is not None  # the tree evicted least recently used data to make room
    assert sum(rig.tree.stats().pages.values()) < 5 * i
    txn.abort()
    rig.check()
    for node in list(rig.tree.iter_nodes()):
        rig.tree.lock(node)
    while rig.pool.can_alloc({M: 1}):
        rig.pool.alloc(M, 1)
    before = rig.snapshot()
    assert RestoreTransaction.load(rig.linkers, rig.request(toks, 4)) is None
    assert rig.snapshot() == before  # the FULL/SWA slots taken first were given back
    rig.check()


def test_bad_boundaries_and_phases_raise() -> None:
    rig = Rig()
    toks = tokens(1, 2, 3, 4)
    # 3 is off the track grid but a page boundary: a branch checkpoint may sit there
    for b in (None, 0, 5, 6):
        with pytest.raises(ValueError, match="boundary"):
            rig.linkers[F].build_transfer(LOAD, request=rig.request(toks, b))
    with pytest.raises(ValueError, match="node"):
        rig.linkers[F].build_transfer(OFFLOAD)
    txn = restore(rig, toks, 4)
    with pytest.raises(ValueError, match="InsertResult"):
        rig.linkers[F].update_load(LoadPhase.COMMIT, txn.transfers[F])
    with pytest.raises(ValueError, match="expected loaded"):
        txn.prepare()
    txn.abort()


def test_keys_of_another_fingerprint_are_refused() -> None:
    rig, other = Rig(), Rig(track_pages=4)
    with pytest.raises(ValueError, match="fingerprint"):
        make_linkers(rig.spec, rig.pool, rig.tree, other.schema)
    toks = tokens(1, 2, 3, 4)
    foreign = RestoreTransaction.load(other.linkers, other.request(toks, 4))
    with pytest.raises(ValueError, match="fingerprint"):
        rig.linkers[F].update_load(LoadPhase.PREPARE, foreign.transfers[F])
    foreign.abort()
