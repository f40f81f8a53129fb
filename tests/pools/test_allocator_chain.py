"""The generic N-sub-pool core with two floats (a chain no facade uses yet):
random operations, accounting, ownership, data and capacity exactness."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from layerlift.pools import MultiEndedAllocator, PoolError, SubPoolSpec
from layerlift.pools.ladder import _ladder_closed_form, available_pages_search

SPECS = [
    SubPoolSpec("down", 128, "down"),  # input order is irrelevant
    SubPoolSpec("f1", 160, "float"),
    SubPoolSpec("up", 96, "up"),
    SubPoolSpec("f2", 64, "float"),
]
TOTAL = 6144
NAMES = st.sampled_from(["up", "f1", "f2", "down"])


class ChainMachine(RuleBasedStateMachine):
    """Two floats (a chain no facade uses yet); subclasses drop floats."""

    specs: tuple[SubPoolSpec, ...] = tuple(SPECS)

    def __init__(self) -> None:
        super().__init__()
        self.core = MultiEndedAllocator(TOTAL, self.specs, torch.zeros(TOTAL, dtype=torch.uint8))
        self.names = {s.name for s in self.specs}
        self.live: dict[tuple[str, int], int] = {}
        self.pinned: set[tuple[str, int]] = set()
        self.marker = 1
        self.core.add_listener(self._on_move)

    def _on_move(self, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        values = {o: self.live.pop((name, o)) for o in old.tolist()}
        for o, n in zip(old.tolist(), new.tolist(), strict=True):
            assert (name, o) not in self.pinned and (name, n) not in self.live
            self.live[(name, n)] = values[o]

    def _page(self, name: str, p: int) -> torch.Tensor:
        unit = self.core.sub(name).unit
        return self.core.buffer[p * unit : (p + 1) * unit]  # type: ignore[index]

    @rule(demand=st.dictionaries(NAMES, st.integers(0, 6), min_size=1, max_size=4))
    def alloc_many(self, demand: dict[str, int]) -> None:
        demand = {k: v for k, v in demand.items() if k in self.names}
        try:
            predicted = self.core.can_alloc(demand)
            out = self.core.alloc_many(demand)
        except PoolError:
            return  # larger than the whole pool: misuse, nothing changed
        assert (out is not None) == predicted
        for name, pages in (out or {}).items():
            for p in pages.tolist():
                assert (name, p) not in self.live
                self._page(name, p)[:8].view(torch.int64)[0] = self.marker
                self.live[(name, p)] = self.marker
                self.marker += 1

    @rule(name=NAMES, data=st.data())
    def free(self, name: str, data: st.DataObject) -> None:
        if name not in self.names:
            return
        owned = sorted(p for (n, p) in self.live if n == name and (n, p) not in self.pinned)
        if owned:
            chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, unique=True))
            self.core.free(name, np.array(chosen))
            for p in chosen:
                del self.live[(name, p)]

    @rule(name=NAMES, data=st.data())
    def toggle_pin(self, name: str, data: st.DataObject) -> None:
        if name not in self.names:
            return
        owned = sorted(p for (n, p) in self.live if n == name)
        if owned:
            p = data.draw(st.sampled_from(owned))
            if (name, p) in self.pinned:
                self.core.unpin(name, np.array([p]))
                self.pinned.discard((name, p))
            else:
                self.core.pin(name, np.array([p]))
                self.pinned.add((name, p))

    @rule(name=st.sampled_from(["f1", "f2"]), side=st.sampled_from(["low", "high"]),
          nbytes=st.integers(0, 2000))
    def make_room(self, name: str, side: str, nbytes: int) -> None:
        if name not in self.names:
            return
        self.core.make_room(name, side, nbytes)  # type: ignore[arg-type]

    @rule(name=st.sampled_from([None, "up", "f1", "f2", "down"]))
    def compact(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            return
        self.core.compact_holes(name)

    @invariant()
    def consistent(self) -> None:
        self.core.verify_byte_accounting()
        for name in sorted(self.names):
            sub = self.core.sub(name)
            assert np.flatnonzero(sub.used).tolist() == sorted(p for n, p in self.live if n == name)
            avail = self.core.available_size(name)
            assert avail >= sub.room(*self.core.bounds(self.core._pos[name]))
            if len(self.names) <= 3:  # the closed form must equal the exhaustive search
                assert avail == _ladder_closed_form(self.core, name)
                assert avail == available_pages_search(self.core, name), name
        for (name, p), m in self.live.items():
            assert int(self._page(name, p)[:8].view(torch.int64)[0]) == m


class OneFloatMachine(ChainMachine):
    """Units that do not divide each other: every alignment edge case."""

    specs = tuple(s for s in SPECS if s.name != "f2")


class TwoPoolMachine(ChainMachine):
    specs = tuple(s for s in SPECS if s.grow != "float")


_SETTINGS = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ChainMachine.TestCase.settings = _SETTINGS
OneFloatMachine.TestCase.settings = _SETTINGS
TwoPoolMachine.TestCase.settings = _SETTINGS
TestAllocatorTwoFloatChain = ChainMachine.TestCase
TestAllocatorOneFloatChain = OneFloatMachine.TestCase
TestAllocatorTwoPoolChain = TwoPoolMachine.TestCase


def test_chain_order_and_transparency() -> None:
    core = MultiEndedAllocator(TOTAL, SPECS)
    assert [a.name for a in core.chain] == ["up", "f1", "f2", "down"]
    # with every float empty, the ENDs see each other directly
    assert core.available_size("up") == TOTAL // 96
    out = core.alloc_many({"f2": 1})
    assert out is not None
    # f2 starts at the midpoint of the whole buffer: 3072 B -> slot 48 of 64 B
    assert out["f2"].tolist() == [48]
    assert core.bounds(0) == (0, 48 * 64)
