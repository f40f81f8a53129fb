"""Hypothesis state machine over the tri-pool: every operation, every step
checked against byte accounting, a model of ownership and the data itself."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from layerlift.pools import Component, ModelSpec, PoolError, UnifiedKVPool
from layerlift.pools.ladder import available_pages, available_pages_search

SPEC = ModelSpec.preset("tiny")
COMPONENTS = st.sampled_from(list(Component))
Key = tuple[Component, int]


class TriPoolMachine(RuleBasedStateMachine):
    """Model: ``live`` page -> marker, pins, deferred; moves rewrite keys via
    the listener, exactly as the tree does."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = UnifiedKVPool(SPEC, 40 * SPEC.page_bytes(Component.FULL))
        self.live: dict[Key, int] = {}
        self.pins: Counter[Key] = Counter()
        self.deferred: set[Key] = set()
        self.next_marker = 1
        self.moves = 0
        self.pool.add_move_listener(self._on_move)

    def _on_move(self, c: Component, old: torch.Tensor, new: torch.Tensor) -> None:
        pairs = list(zip(old.tolist(), new.tolist(), strict=True))
        assert all(self.pins[(c, o)] == 0 for o, _ in pairs), "a pinned page moved"
        values = {o: self.live.pop((c, o)) for o, _ in pairs}
        was_deferred = {o for o, _ in pairs if (c, o) in self.deferred}
        self.deferred -= {(c, o) for o in was_deferred}
        for o, n in pairs:
            self._claim(c, n)
            self.live[(c, n)] = values[o]
            if o in was_deferred:
                self.deferred.add((c, n))
        self.moves += len(pairs)

    # ---- helpers -------------------------------------------------------------
    def _write(self, c: Component, pages: torch.Tensor) -> None:
        for p in pages.tolist():
            self._claim(c, p)
            view = self.pool.page_view(c, p)
            view[:8].view(torch.int64)[0] = self.next_marker
            view[-8:].view(torch.int64)[0] = self.next_marker
            self.live[(c, p)] = self.next_marker
            self.next_marker += 1

    def _claim(self, c: Component, p: int) -> None:
        """``(c, p)`` is being (re)used: it must be free, or a deferred
        unpinned page the ladder flushed in the same operation."""
        if (c, p) in self.live:
            assert (c, p) in self.deferred and self.pins[(c, p)] == 0, "reused a live page"
            self.deferred.discard((c, p))
            del self.live[(c, p)]

    def _owned(self, c: Component, *, pinned: bool | None = None) -> list[int]:
        pages = [p for (k, p) in self.live if k is c and (k, p) not in self.deferred]
        if pinned is not None:
            pages = [p for p in pages if (self.pins[(c, p)] > 0) is pinned]
        return sorted(pages)

    def _forget_flushed(self) -> None:
        # the ladder may flush at any alloc: drop deferred pages the pool freed
        for c, p in list(self.deferred):
            if not bool(self.pool.core.sub(c.value).used[p]):
                assert self.pins[(c, p)] == 0, "a pinned deferred page was freed"
                self.deferred.discard((c, p))
                del self.live[(c, p)]

    # ---- rules -----------------------------------------------------------------
    @rule(c=COMPONENTS, n=st.integers(0, 9))
    def alloc(self, c: Component, n: int) -> None:
        predicted = self.pool.can_alloc({c: n})
        out = self.pool.alloc(c, n)
        self._forget_flushed()
        assert (out is not None) == predicted, "can_alloc disagreed with alloc"
        if out is not None:
            assert out.numel() == n
            self._write(c, out)

    @rule(f=st.integers(0, 8), s=st.integers(0, 8), m=st.integers(0, 4))
    def alloc_many(self, f: int, s: int, m: int) -> None:
        demand = {Component.FULL: f, Component.SWA: s, Component.MAMBA: m}
        predicted = self.pool.can_alloc(demand)
        out = self.pool.alloc_many(demand)
        self._forget_flushed()
        assert (out is not None) == predicted, "can_alloc disagreed with alloc_many"
        if out is not None:
            for c, pages in out.items():
                self._write(c, pages)

    @rule(c=COMPONENTS, data=st.data())
    def free(self, c: Component, data: st.DataObject) -> None:
        owned = self._owned(c, pinned=False)
        if not owned:
            return
        chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, unique=True))
        self.pool.free(c, torch.tensor(chosen, dtype=torch.int64))
        for p in chosen:
            del self.live[(c, p)]
        with_error = chosen[:1]
        try:  # a double free is misuse: raised, nothing changes
            self.pool.free(c, torch.tensor(with_error, dtype=torch.int64))
            raise AssertionError("double free was accepted")
        except PoolError:
            pass

    @rule(c=COMPONENTS, data=st.data())
    def free_deferred(self, c: Component, data: st.DataObject) -> None:
        owned = self._owned(c)
        if not owned:
            return
        chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, unique=True))
        self.pool.free_deferred(c, torch.tensor(chosen, dtype=torch.int64))
        self.deferred |= {(c, p) for p in chosen}

    @rule()
    def flush(self) -> None:
        expected = sum(1 for k in self.deferred if self.pins[k] == 0)
        assert self.pool.flush_deferred() == expected
        self._forget_flushed()

    @rule(c=COMPONENTS, data=st.data())
    def pin(self, c: Component, data: st.DataObject) -> None:
        owned = self._owned(c)
        if not owned:
            return
        chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, max_size=3, unique=True))
        self.pool.pin(c, torch.tensor(chosen, dtype=torch.int64))
        for p in chosen:
            self.pins[(c, p)] += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, n in self.pins.items() if n > 0)
        if not pinned:
            return
        c, p = data.draw(st.sampled_from(pinned))
        self.pool.unpin(c, torch.tensor([p], dtype=torch.int64))
        self.pins[(c, p)] -= 1

    @rule(side=st.sampled_from(["low", "high"]), units=st.integers(0, 12))
    def make_room(self, side: str, units: int) -> None:
        self.pool.make_room(side, units * SPEC.page_bytes(Component.MAMBA))  # type: ignore[arg-type]
        self._forget_flushed()

    @rule(c=st.sampled_from([None, *Component]))
    def compact(self, c: Component | None) -> None:
        self.pool.compact_holes(c)
        self._forget_flushed()

    # ---- invariants ------------------------------------------------------------
    @invariant()
    def accounting_verifies(self) -> None:
        self.pool.verify_byte_accounting()

    @invariant()
    def model_matches_pool(self) -> None:
        for c in Component:
            sub = self.pool.core.sub(c.value)
            assert np.flatnonzero(sub.used).tolist() == sorted(p for k, p in self.live if k is c)
            assert np.flatnonzero(sub.deferred).tolist() == sorted(
                p for k, p in self.deferred if k is c)
            for p in np.flatnonzero(sub.pins).tolist():
                assert int(sub.pins[p]) == self.pins[(c, p)]

    @invariant()
    def markers_intact(self) -> None:
        for (c, p), marker in self.live.items():
            view = self.pool.page_view(c, p)
            assert int(view[:8].view(torch.int64)[0]) == marker, (c, p)
            assert int(view[-8:].view(torch.int64)[0]) == marker, (c, p)

    @invariant()
    def memo_is_fresh(self) -> None:
        # the memo filled at the previous step must have been invalidated by
        # this step's mutation: memoized == recomputed from scratch
        # (and the closed form equals the exhaustive ladder search)
        for c in Component:
            memo = self.pool.available_size(c)
            assert memo == available_pages(self.pool.core, c.value)
            assert memo == available_pages_search(self.pool.core, c.value), c


TriPoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestUnifiedTriPoolStateMachine = TriPoolMachine.TestCase
