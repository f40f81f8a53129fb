"""``pack_runs``: how a transfer's rows are cut into chunks (one store call
each). Every row once and in order, each chunk within the budget and the
ring, as few chunks as a greedy fill makes, evened out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from layerlift.linker.transfer_plan import _fill, pack_runs

runs_st = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 64)), min_size=1, max_size=12)


class _Ring:
    """What ``pack_runs`` asks of a ring: whether a region fits it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity


def _rows(chunks: list[list[tuple[int, int, int]]]) -> list[tuple[int, int]]:
    return [(i, r) for c in chunks for i, lo, hi in c for r in range(lo, hi)]


def _bytes(chunk: list[tuple[int, int, int]], runs: list[tuple[int, int, int]]) -> int:
    return sum((hi - lo) * runs[i][2] for i, lo, hi in chunk)


@given(runs_st, st.integers(1, 400), st.integers(1, 1000))
def test_every_row_once_in_order_within_budget_and_ring(
        shape: list[tuple[int, int]], budget: int, capacity: int) -> None:
    runs = [(i, rows, row) for i, (rows, row) in enumerate(shape)]
    ring = _Ring(capacity)
    chunks = pack_runs(runs, budget, ring)
    assert _rows(chunks) == [(i, r) for i, rows, _ in runs for r in range(rows)]
    greedy = _fill(runs, budget, ring)
    assert len(chunks) == len(greedy)  # no more calls than filling each chunk
    for c in chunks:
        assert c and all(hi > lo for _, lo, hi in c)
        if sum(hi - lo for _, lo, hi in c) > 1:  # one row alone may exceed any bound
            assert _bytes(c, runs) <= budget and ring.fits(_bytes(c, runs))
    if chunks:
        assert max(_bytes(c, runs) for c in chunks) <= max(_bytes(c, runs) for c in greedy)


def test_a_layer_a_row_over_two_chunks_is_cut_in_three_even_chunks() -> None:
    row = (512 << 10) + 4  # a 512 KiB slice and its CRC
    runs = [(0, 64, row)]
    ring = _Ring(64 << 20)
    assert [sum(hi - lo for _, lo, hi in c) for c in _fill(runs, 16 << 20, ring)] == [31, 31, 2]
    assert [sum(hi - lo for _, lo, hi in c) for c in pack_runs(runs, 16 << 20, ring)] == \
        [22, 22, 20]
