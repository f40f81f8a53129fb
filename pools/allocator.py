"""The generic N-sub-pool core: one byte buffer, a chain of sub-allocators.

Chain (low bytes -> high): ``[grow-up END, floats in input order, grow-down
END]``. Each member may use the bytes between its nearest *non-empty*
neighbours (an empty member is transparent). A 2-pool layout is the same code
with no floats.

Shortfall ladder (:meth:`MultiEndedAllocator.relieve_for_alloc`): flush
deferred frees -> recheck -> ask the float(s) next to the short END(s) to open
that side (a demand *vector*, so a single short band and a coupled
multi-band request take the same path) -> recheck -> the ENDs compact their
holes and the float slides again -> recheck -> report failure; the caller
then evicts or gives up. The moving rungs are first rehearsed on a clone, so
a failing ladder copies no bytes.

Capacity views are exact by construction: they run that very ladder on an
O(1) clone of the state (the arrays are immutable, see ``end_allocator.py``)
and are memoized per capacity epoch (see ``capacity.py``); the ladder and
the views live in ``ladder.py``.

Only the owner thread calls mutators. Misuse raises ``PoolError`` before any
state changes; shortage is a ``None`` / ``False`` return.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from layerlift.pools.base import PoolError
from layerlift.pools.capacity import CapacityEpoch, CapacityMemo
from layerlift.pools.end_allocator import (
    EndAllocator,
    Side,
    SubAllocator,
    SubPoolSpec,
    as_index_array,
)
from layerlift.pools.float_allocator import FloatAllocator
from layerlift.pools.ladder import (
    available_pages,
    joint_fits,
    overlap_error,
    relieve_after_direct_failure,
    verify_accounting,
)

__all__ = ["MultiEndedAllocator", "NameMoveListener"]

NameMoveListener = Callable[[str, torch.Tensor, torch.Tensor], None]
"""``listener(sub_pool_name, old_indices, new_indices)``, bytes already moved."""


def _chain_order(specs: Sequence[SubPoolSpec]) -> list[SubPoolSpec]:
    if len(specs) < 2:
        raise PoolError(f"a unified pool needs at least 2 sub-pools, got {len(specs)}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PoolError(f"sub-pool names must be unique, got {names}")
    ups = [s for s in specs if s.grow == "up"]
    downs = [s for s in specs if s.grow == "down"]
    if len(ups) != 1 or len(downs) != 1:
        raise PoolError(
            "a unified pool needs exactly one grow-up and one grow-down END sub-pool, "
            f"got directions {[s.grow for s in specs]}"
        )
    return [ups[0], *(s for s in specs if s.grow == "float"), downs[0]]


class MultiEndedAllocator:
    """N >= 2 sub-pools sharing ``total_bytes`` of ``buffer`` (``None`` for
    an accounting-only instance). Raises ``PoolError`` for an invalid layout."""

    def __init__(
        self, total_bytes: int, specs: Sequence[SubPoolSpec], buffer: torch.Tensor | None = None
    ) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise PoolError(f"total_bytes must be a positive int, got {total_bytes!r}")
        ordered = _chain_order(specs)
        small = [s.name for s in ordered if s.unit_bytes > total_bytes]
        if small:
            raise PoolError(f"total_bytes={total_bytes} cannot hold one page of {small}")
        if buffer is not None and buffer.numel() < total_bytes:
            raise PoolError(f"buffer has {buffer.numel()} bytes, fewer than {total_bytes}")
        self.total_bytes = total_bytes
        self.buffer = buffer
        self._epoch = CapacityEpoch()
        self._memo = CapacityMemo(self._epoch)
        self._listeners: list[NameMoveListener] = []
        self.chain: list[SubAllocator] = [self._make(s, total_bytes // s.unit_bytes) for s in ordered]
        self._pos = {a.name: i for i, a in enumerate(self.chain)}

    def _make(self, spec: SubPoolSpec, n_pages: int) -> SubAllocator:
        if spec.grow == "float":
            return FloatAllocator(spec, n_pages, self._epoch)
        return EndAllocator(spec, n_pages, self._epoch)

    def clone(self) -> MultiEndedAllocator:
        """Accounting-only copy (no buffer, no listeners) for dry runs; O(1)."""
        new = object.__new__(MultiEndedAllocator)
        new.total_bytes = self.total_bytes
        new.buffer = None
        new._epoch = CapacityEpoch()
        new._memo = CapacityMemo(new._epoch)
        new._listeners = []
        new.chain = [a.clone(new._epoch) for a in self.chain]
        new._pos = self._pos
        return new

    # ---- lookup and chain walk --------------------------------------------
    @property
    def epoch(self) -> int:
        """The capacity epoch: bumped by every state rebind (tests read it)."""
        return self._epoch.value

    def sub(self, name: str) -> SubAllocator:
        """The sub-allocator ``name``; ``PoolError`` if there is none."""
        try:
            return self.chain[self._pos[name]]
        except (KeyError, TypeError):
            raise PoolError(f"unknown sub-pool {name!r}; known: {list(self._pos)}") from None

    def bounds(self, pos: int) -> tuple[int, int]:
        """Bytes ``[low, high)`` left to chain member ``pos`` by its nearest
        non-empty neighbours (empty members are transparent)."""
        low = 0
        for a in reversed(self.chain[:pos]):
            span = a.span()
            if span is not None:
                low = span[1]
                break
        high = self.total_bytes
        for a in self.chain[pos + 1 :]:
            span = a.span()
            if span is not None:
                high = span[0]
                break
        return low, high

    def add_listener(self, listener: NameMoveListener) -> None:
        """Call ``listener(name, old, new)`` after every move, bytes in place."""
        self._listeners.append(listener)

    # ---- allocation ---------------------------------------------------------
    def check_demand(self, demand: Mapping[str, int], *, oversize_ok: bool = False) -> bool:
        """``PoolError`` for an unknown name or a negative or non-int count.
        A demand larger than the whole pool could ever hold also raises,
        unless ``oversize_ok`` (a capacity query): then it returns False."""
        total = 0
        for name, n in demand.items():
            sub = self.sub(name)
            if isinstance(n, bool) or not isinstance(n, int | np.integer):
                raise PoolError(f"page count for {name!r} must be an int, got {n!r}")
            if n < 0:
                raise PoolError(f"cannot allocate a negative number of {name} pages ({n})")
            total += int(n) * sub.unit
            if n > sub.n_pages and not oversize_ok:
                raise PoolError(
                    f"{n} {name} pages exceed the whole pool ({sub.n_pages} pages at most)"
                )
        if total > self.total_bytes and not oversize_ok:
            raise PoolError(f"demand needs {total} bytes, the pool has {self.total_bytes}")
        return total <= self.total_bytes and all(
            n <= self.sub(k).n_pages for k, n in demand.items()
        )

    def _order(self, demand: Mapping[str, int]) -> list[SubAllocator]:
        # ENDs first, then floats: the float then fits between the END lines,
        # exactly the window the ladder planned for it.
        wanted = [self.sub(k) for k, n in demand.items() if n > 0]
        return sorted(wanted, key=lambda a: (isinstance(a, FloatAllocator), self._pos[a.name]))

    def _alloc_direct(self, demand: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Allocate all of ``demand`` without moving anything, or nothing."""
        saved = [(a, a.used, a.n_used) for a in self.chain]
        out: dict[str, np.ndarray] = {k: np.empty(0, np.int64) for k in demand}
        for a in self._order(demand):
            idx = a.pick(int(demand[a.name]), *self.bounds(self._pos[a.name]))
            if idx is None:
                for b, used, n_used in saved:  # arrays are immutable: restore by rebind
                    if b.used is not used:
                        b.used, b.n_used = used, n_used
                return None
            a.take(idx)
            out[a.name] = idx
        return out

    def fits_now(self, demand: Mapping[str, int]) -> bool:
        """Would ``demand`` fit without moving anything (a dry run)?"""
        return self.clone()._alloc_direct(demand) is not None

    def alloc_many(self, demand: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """All of ``demand`` (name -> pages) or ``None`` after the ladder
        failed; raises ``PoolError`` on bad input (see :meth:`check_demand`)."""
        self.check_demand(demand)
        out = self._alloc_direct(demand)
        if out is None and relieve_after_direct_failure(self, demand):
            out = self._alloc_direct(demand)
            assert out is not None, "the ladder promised room that direct allocation did not find"
        return out

    def relieve_for_alloc(self, demand: Mapping[str, int]) -> bool:
        """The shortfall ladder; True once ``demand`` fits without moves.
        May flush deferred frees and move float pages (listeners are told).
        Raises ``PoolError`` on bad input (see :meth:`check_demand`)."""
        self.check_demand(demand)
        return self.fits_now(demand) or relieve_after_direct_failure(self, demand)

    # ---- moves ----------------------------------------------------------------
    def apply_plan(self, sub: SubAllocator, plan: tuple[np.ndarray, np.ndarray] | None) -> bool:
        """Carry out a move plan; False (nothing moved) for ``None``."""
        if plan is None:
            return False
        self.move(sub, *plan)
        return True

    def move(self, sub: SubAllocator, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole units ``src`` -> ``dst``, rebind the accounting, tell
        the listeners (in that order: listeners see the bytes in place)."""
        if src.size == 0:
            return
        src_t = torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64))
        dst_t = torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64))
        if self.buffer is not None:
            pages = self.buffer[: sub.n_pages * sub.unit].view(sub.n_pages, sub.unit)
            dev = self.buffer.device
            # gather first: src and dst are disjoint, but the gather makes that moot
            pages[dst_t.to(dev)] = pages[src_t.to(dev)]
        sub.relocate(src, dst)
        for listener in self._listeners:
            listener(sub.name, src_t.clone(), dst_t.clone())

    # ---- frees and pins -------------------------------------------------------
    def free(self, name: str, indices: object) -> None:
        """Free now; ``PoolError`` on a double free, a pinned or unknown page."""
        sub = self.sub(name)
        sub.free(as_index_array(indices, sub.n_pages, "free"))

    def free_deferred(self, name: str, indices: object) -> None:
        """Free once unpinned (at the next flush); ``PoolError`` on a double free."""
        sub = self.sub(name)
        sub.free_deferred(as_index_array(indices, sub.n_pages, "free_deferred"))

    def flush_deferred(self) -> int:
        """Free every deferred page that is no longer pinned; how many."""
        return sum(int(a.flush().size) for a in self.chain)

    def pin(self, name: str, indices: object) -> None:
        """Pin (refcounted); ``PoolError`` for pages that are not allocated."""
        sub = self.sub(name)
        sub.pin(as_index_array(indices, sub.n_pages, "pin", unique=False))

    def unpin(self, name: str, indices: object) -> None:
        """Undo one pin per listed page; ``PoolError`` if a page is not pinned."""
        sub = self.sub(name)
        sub.unpin(as_index_array(indices, sub.n_pages, "unpin", unique=False))

    # ---- relocation -----------------------------------------------------------
    def _float(self, name: str) -> FloatAllocator:
        sub = self.sub(name)
        if not isinstance(sub, FloatAllocator):
            raise PoolError(f"{name!r} grows {sub.spec.grow}; only a float sub-pool makes room")
        return sub

    def make_room(self, name: str, side: Side, nbytes: int) -> bool:
        """Float ``name`` vacates ``nbytes`` next to its ``side`` neighbour's
        frontier by moving unpinned slots (holes first). Flushes deferred
        frees first. False (nothing moved) when a pinned slot or the space
        forbids it; ``PoolError`` for a bad side, size or name."""
        sub = self._float(name)
        if side not in ("low", "high"):
            raise PoolError(f"side must be 'low' or 'high', got {side!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise PoolError(f"nbytes must be a non-negative int, got {nbytes!r}")
        self.flush_deferred()
        plan = sub.vacate_plan(side, nbytes, *self.bounds(self._pos[name]))
        return self.apply_plan(sub, plan)

    def compact_holes(self, name: str | None = None) -> int:
        """Fill holes with outermost movable pages (all sub-pools, or
        ``name``): ENDs pull their frontier back; a float shrinks its side
        facing the smaller gap. Flushes deferred frees first; returns the
        number of pages moved. Pinned pages stay."""
        subs = self.chain if name is None else [self.sub(name)]
        self.flush_deferred()
        moved = 0
        for sub in subs:
            if isinstance(sub, FloatAllocator):
                span = sub.span()
                if span is None:
                    continue
                low, high = self.bounds(self._pos[sub.name])
                toward: Side = "low" if high - span[1] < span[0] - low else "high"
                src, dst = sub.compact_plan(toward)
            else:
                assert isinstance(sub, EndAllocator)
                src, dst = sub.compact_plan()
            self.move(sub, src, dst)
            moved += int(src.size)
        return moved

    def move_pages(self, name: str, src: object, dst: object) -> None:
        """Move live pages ``src`` to free pages ``dst`` of the same sub-pool
        (bytes copied, listeners told). ``PoolError`` if a source is pinned,
        deferred or free, a destination is used, or the move would make
        regions overlap; nothing moves then."""
        sub = self.sub(name)
        s = as_index_array(src, sub.n_pages, "move_pages src")
        d = as_index_array(dst, sub.n_pages, "move_pages dst")
        if s.size != d.size:
            raise PoolError(f"move_pages: {s.size} sources but {d.size} destinations")
        sub.check_allocated(s, "move_pages")
        if bool((sub.pins[s] > 0).any()):
            raise PoolError(f"move_pages: {name} pages {s[sub.pins[s] > 0][:4].tolist()} are pinned")
        if bool(sub.used[d].any()) or np.intersect1d(s, d).size:
            raise PoolError(f"move_pages: destinations of {name} must be free pages")
        trial = self.clone()
        trial.sub(name).relocate(s, d)
        if trial.overlap_error() is not None:
            raise PoolError(f"move_pages: {name} pages would overlap a neighbour's region")
        self.move(sub, s, d)

    def overlap_error(self) -> str | None:
        """A sentence naming two overlapping sub-pool regions, or None."""
        return overlap_error(self)

    # ---- capacity views ---------------------------------------------------------
    def available_size(self, name: str) -> int:
        """Pages of ``name`` one alloc could return now (ladder included; memoized)."""
        self.sub(name)
        return self._memo.get(("avail", name), lambda: available_pages(self, name))

    def can_alloc(self, demand: Mapping[str, int]) -> bool:
        """Would ``alloc_many(demand)`` succeed now? (exact; memoized)."""
        self.check_demand(demand, oversize_ok=True)  # misuse raises before the memo
        key = ("can", tuple(sorted((k, int(v)) for k, v in demand.items() if v)))
        return self._memo.get(key, lambda: joint_fits(self, demand))

    def used_size(self, name: str) -> int:
        return self.sub(name).n_used

    def capacity(self, name: str) -> int:
        return self.sub(name).n_pages

    def verify_byte_accounting(self) -> None:
        """See :func:`~layerlift.pools.ladder.verify_accounting`."""
        verify_accounting(self)
