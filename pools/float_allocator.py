"""The float sub-pool: lives between the two END frontiers and slides.

Placement policy (why): the float must never stand in an END's way for
longer than necessary, and moving pages costs a copy.

* ``free`` only punches a hole (zero copy); ``alloc`` reuses holes first.
* Otherwise it extends toward the *larger* gap, leaving the tighter side to
  the END that is closer.
* Empty, it is transparent (an END may grow through its span) and restarts
  at the midpoint between the two frontiers, as far from both as possible.
* Only when a neighbour END is short does the pool ask it to move
  (:meth:`FloatAllocator.plan_window`, used by ``make_room`` and the
  shortfall ladder); :meth:`FloatAllocator.compact_plan` fills holes.
  Pinned slots never move; a pinned slot on a side caps how far that side
  can open.
"""

from __future__ import annotations

import numpy as np

from layerlift.pools.capacity import CapacityEpoch
from layerlift.pools.end_allocator import Side, SubAllocator, SubPoolSpec

__all__ = ["FloatAllocator"]

_EMPTY = np.empty(0, np.int64)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FloatAllocator(SubAllocator):
    """A float sub-pool (e.g. MAMBA state slots) between two chain neighbours."""

    def __init__(self, spec: SubPoolSpec, n_pages: int, epoch: CapacityEpoch) -> None:
        assert spec.grow == "float"
        super().__init__(spec, n_pages, epoch)

    def _bounds(self, low_b: int, high_b: int) -> tuple[int, int]:
        """Slot indices ``[lo, hi)`` that fit between the byte bounds."""
        return _ceil_div(low_b, self.unit), min(self.n_pages, high_b // self.unit)

    def room(self, low_b: int, high_b: int) -> int:
        lo, hi = self._bounds(low_b, high_b)
        return max(0, hi - lo - int(self.used[max(lo, 0) : max(hi, 0)].sum()))

    def pick(self, n: int, low_b: int, high_b: int) -> np.ndarray | None:
        lo_idx, hi_idx = self._bounds(low_b, high_b)
        ext = self.extent()
        if ext is None:  # restart at the midpoint between the frontiers
            mid = min(max((low_b + high_b) // 2 // self.unit, lo_idx), max(hi_idx, lo_idx))
            ext = (mid, mid)
        lo, hi = ext
        holes = np.flatnonzero(~self.used[lo:hi]) + lo
        if holes.size >= n:
            return holes[:n]
        r = n - int(holes.size)
        gap_below, gap_above = max(0, lo - lo_idx), max(0, hi_idx - hi)
        if gap_below + gap_above < r:
            return None
        above = np.arange(hi, hi_idx, dtype=np.int64)
        below = np.arange(lo - 1, lo_idx - 1, -1, dtype=np.int64)
        first, second = (above, below) if gap_above >= gap_below else (below, above)
        ext_pages = np.concatenate([first[:r], second[: r - min(r, first.size)]])
        return np.concatenate([holes, ext_pages])

    def plan_window(
        self, low_line: int, high_line: int, extra: int = 0
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Moves that bring every live slot inside the byte window
        ``[low_line, high_line)`` while leaving ``extra`` free slots in it.

        Slots outside the window move to the free slots inside nearest their
        side (holes first, then the gap beyond the far edge). ``None`` when a
        pinned slot lies outside the window or the window is too small;
        ``(empty, empty)`` when nothing has to move."""
        lo, hi = self._bounds(low_line, high_line)
        hi = max(hi, lo)
        live = np.flatnonzero(self.used)
        out = live[(live < lo) | (live >= hi)]
        if bool((self.pins[out] > 0).any()):
            return None
        free_in = np.flatnonzero(~self.used[max(lo, 0) : hi]) + max(lo, 0)
        if free_in.size < out.size + extra:
            return None
        below, above = out[out < lo], out[out >= hi]
        dst_below = free_in[: below.size]
        dst_above = free_in[free_in.size - above.size :]
        return np.concatenate([below, above]), np.concatenate([dst_below, dst_above])

    def vacate_plan(
        self, side: Side, nbytes: int, low_b: int, high_b: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Moves that leave ``nbytes`` free between the ``side`` neighbour's
        frontier (``low_b`` or ``high_b``) and this float's nearest slot."""
        if side == "low":
            return self.plan_window(low_b + nbytes, high_b)
        return self.plan_window(low_b, high_b - nbytes)

    def compact_plan(self, toward: Side) -> tuple[np.ndarray, np.ndarray]:
        """Moves that fill holes with the outermost movable slots of the
        opposite side: ``toward="low"`` pulls the top edge down (opening the
        high side), ``"high"`` pushes the bottom edge up."""
        ext = self.extent()
        if ext is None:
            return _EMPTY, _EMPTY
        lo, hi = ext
        holes = np.flatnonzero(~self.used[lo:hi]) + lo
        movers = np.flatnonzero(self.movable()[lo:hi] & ~self.deferred[lo:hi]) + lo
        if toward == "low":
            movers = movers[::-1]
            k = min(holes.size, movers.size)
            m = int((holes[:k] < movers[:k]).sum())
        else:
            holes = holes[::-1]
            k = min(holes.size, movers.size)
            m = int((holes[:k] > movers[:k]).sum())
        return movers[:m].copy(), holes[:m].copy()
