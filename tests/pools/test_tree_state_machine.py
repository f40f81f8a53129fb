"""Hypothesis state machine over the unified radix tree and a real UnifiedKVPool.

Rules: insert (the engine's path: match, then publish fresh pages from the
matched page on, freeing duplicates; often a prefix of a known key with a
new checkpoint, which splits; or a prompt that leaves a known key at any
page, with a branch checkpoint there, as the engine captures it), match,
lock, unlock, evict, pool moves. The tree caps branch checkpoints at 2.
Invariants after every step: ``tree.check_integrity()``,
``pool.verify_byte_accounting()`` and "every used pool page belongs to the
tree" (nothing leaked, nothing double-owned).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layerlift.pools import Component, ModelSpec, UnifiedKVPool
from layerlift.pools.tree import TreeNode, UnifiedRadixTree

F, S, M = Component.FULL, Component.SWA, Component.MAMBA
PS, W, T = 2, 2, 2

page_values = st.lists(st.integers(0, 2), min_size=1, max_size=7)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.spec = ModelSpec.preset("tiny", page_size=PS, swa_window=W * PS,
                                     track_interval=T * PS)
        sizes = {F: 24, S: 24, M: 8}
        total = sum(n * self.spec.page_bytes(c) for c, n in sizes.items())
        self.pool = UnifiedKVPool(self.spec, total)
        self.tree = UnifiedRadixTree(self.spec, self.pool, max_branch_checkpoints=2)
        self.keys: list[np.ndarray] = []
        self.locked: list[TreeNode] = []

    def _alloc(self, c: Component, n: int) -> torch.Tensor | None:
        got = self.pool.alloc(c, n)
        if got is None:
            self.tree.evict({c: n})
            got = self.pool.alloc(c, n)
        return got

    def _publish(self, toks: np.ndarray, ckpt_mask: list[bool], swa_drop: list[bool],
                 from_zero: bool = False, branch_from_boundary: bool = False) -> None:
        """Publish fresh pages from the matched page on (``from_zero``: from
        page 0, so every page the tree has comes back as a duplicate;
        ``branch_from_boundary``: from the device boundary, with a branch
        checkpoint where the prompt leaves the tree, as the engine does)."""
        n = len(toks) // PS
        m = self.tree.match_prefix(toks)
        start = 0 if from_zero else min(m.kv_pages, n)
        branch: list[int] = []
        if branch_from_boundary:
            start = m.boundary_pages
            if start < m.kv_pages < n and m.kv_pages % T:
                branch = [m.kv_pages]
        ckpts = [b for b, keep in zip(range(T, n + 1, T), ckpt_mask, strict=False)
                 if keep and b > start] + branch
        valid = torch.tensor([not d for d in (swa_drop + [False] * n)[:n]], dtype=torch.bool)
        got = {F: self._alloc(F, n - start), S: self._alloc(S, int(valid[start:].sum())),
               M: self._alloc(M, len(ckpts))}
        if any(v is None for v in got.values()):
            for c, v in got.items():
                if v is not None:
                    self.pool.free(c, v)
            return
        full = torch.zeros(n, dtype=torch.int64)
        swa = torch.zeros(n, dtype=torch.int64)
        full[start:] = got[F]
        swa[[p for p in range(start, n) if bool(valid[p])]] = got[S]
        res = self.tree.insert(toks, full, swa, valid,
                               dict(zip(ckpts, got[M].tolist(), strict=True)), start_page=start)
        for c, dup in res.duplicates.items():
            if len(dup):
                self.pool.free(c, dup)
        self.keys.append(toks)

    @rule(pages=page_values, ckpt_mask=st.lists(st.booleans(), max_size=4),
          swa_drop=st.lists(st.booleans(), max_size=7), from_zero=st.booleans())
    def insert(self, pages: list[int], ckpt_mask: list[bool], swa_drop: list[bool],
               from_zero: bool) -> None:
        toks = np.repeat(np.asarray(pages, dtype=np.int64), PS)
        self._publish(toks, ckpt_mask, swa_drop, from_zero)

    @precondition(lambda self: bool(self.keys))
    @rule(data=st.data())
    def insert_prefix_with_checkpoint(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys))
        n = len(key) // PS
        cut = data.draw(st.integers(1, n))
        self._publish(key[: cut * PS], [True] * 4, [])

    @precondition(lambda self: bool(self.keys))
    @rule(data=st.data(), tail=page_values, ckpt_mask=st.lists(st.booleans(), max_size=4))
    def insert_branch(self, data: st.DataObject, tail: list[int], ckpt_mask: list[bool]) -> None:
        key = data.draw(st.sampled_from(self.keys))
        keep = data.draw(st.integers(1, len(key) // PS))
        new = np.repeat(np.asarray([v + 3 for v in tail], dtype=np.int64), PS)  # never a match
        self._publish(np.concatenate([key[: keep * PS], new]), ckpt_mask, [],
                      branch_from_boundary=True)

    @rule(pages=page_values)
    def match(self, pages: list[int]) -> None:
        m = self.tree.match_prefix(np.repeat(np.asarray(pages, dtype=np.int64), PS))
        d = m.boundary_pages
        assert 0 <= d <= m.kv_pages <= len(pages)
        assert (m.mamba_slot is None) == (d == 0)
        assert d % T == 0 or self.tree.is_branch_checkpoint(m.node)
        assert m.node.end_page == d
        assert torch.equal(m.full_indices, m.kv_full_indices[:d]) and len(m.swa_indices) == d

    @rule(pages=page_values)
    def lock(self, pages: list[int]) -> None:
        m = self.tree.match_prefix(np.repeat(np.asarray(pages, dtype=np.int64), PS))
        if not m.node.is_root:
            self.tree.lock(m.node)
            self.locked.append(m.node)

    @precondition(lambda self: bool(self.locked))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.tree.unlock(node)

    @rule(f=st.integers(0, 6), s=st.integers(0, 6), m=st.integers(0, 3))
    def evict(self, f: int, s: int, m: int) -> None:
        locked_before = {id(n) for n in self.locked}
        freed = self.tree.evict({F: f, S: s, M: m})
        assert all(v >= 0 for v in freed.values())
        assert all(self.tree.contains(n) for n in self.locked)
        assert locked_before == {id(n) for n in self.locked}

    @rule(pages=page_values, component=st.sampled_from(list(Component)))
    def mark_stored(self, pages: list[int], component: Component) -> None:
        m = self.tree.match_prefix(np.repeat(np.asarray(pages, dtype=np.int64), PS))
        if not m.node.is_root:
            self.tree.mark_stored(m.node, component)
            assert m.node.stored[component] or component is Component.SWA

    @rule()
    def compact(self) -> None:
        self.pool.compact_holes()

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        self.pool.verify_byte_accounting()
        pages = self.tree.stats().pages
        assert {c: self.pool.used_size(c) for c in Component} == pages
        assert self.tree.branch_checkpoint_count() <= 2


TreeMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_state_machine = TreeMachine.TestCase
