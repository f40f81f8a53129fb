"""Interfaces of the device pools (synchronous; no asyncio, no store).

Ownership and threading
-----------------------
A :class:`KVPool` owns one byte buffer shared by the FULL, SWA and MAMBA
sub-pools. *Allocator state* (which pages are used, pinned, where the
frontiers are) is mutated only by one thread at a time - in LayerLift, the
event-loop thread. Other threads (the forward, fetch workers) may read and
write the *bytes* of pages they were handed, but only pages that are pinned or
that they own, because unpinned pages can be moved by :meth:`make_room` /
:meth:`compact_holes`.

Indices
-------
Page ``i`` of component ``c`` is always the byte range
``[i * page_bytes(c), (i + 1) * page_bytes(c))`` of the buffer (physical
indexing), so a page's address never depends on other pools. Index tensors
are 1-D ``torch.int64`` on the CPU.

Errors
------
Shortage is a return value (``alloc`` returns ``None``). Misuse raises
:class:`PoolError` (a ``ValueError``) with a sentence saying what was wrong;
after any raised error the accounting still verifies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch

from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.views import kv_layer_view, mamba_layer_view

__all__ = ["KVPool", "MoveListener", "PoolAccountingError", "PoolError"]

MoveListener = Callable[[Component, torch.Tensor, torch.Tensor], None]
"""Called as ``listener(component, old_indices, new_indices)`` after pages
were moved; the bytes are already at the new indices."""


class PoolError(ValueError):
    """Misuse of a pool: double free, unknown component, pinned page freed..."""


class PoolAccountingError(AssertionError):
    """``verify_byte_accounting`` found an inconsistency (a bug, not misuse)."""


class KVPool(ABC):
    """FULL + SWA + MAMBA pages in one byte buffer.

    Implementations: ``UnifiedKVPool`` (two END pools growing toward each
    other with a float pool between, boundaries move with the load) and
    ``StaticKVPool`` (three fixed regions, the baseline).
    """

    spec: ModelSpec
    buffer: torch.Tensor  # 1-D uint8, on the pool's device

    # ---- allocation --------------------------------------------------------
    @abstractmethod
    def alloc(self, component: Component, n: int) -> torch.Tensor | None:
        """``n`` fresh pages of ``component``, or ``None`` when even the
        shortfall ladder (flush deferred frees, move the float) cannot find
        room; the caller then evicts from the tree or gives up. ``n == 0``
        returns an empty tensor. Raises ``PoolError`` if ``n`` is negative or
        larger than the whole pool could ever hold."""

    @abstractmethod
    def alloc_many(self, demand: Mapping[Component, int]) -> dict[Component, torch.Tensor] | None:
        """All of ``demand`` or nothing (a coupled multi-band request goes
        through the same ladder as a single band)."""

    @abstractmethod
    def free(self, component: Component, indices: torch.Tensor) -> None:
        """Return pages now. Raises ``PoolError`` on a double free, an index
        out of range, or a pinned page (nothing is freed then)."""

    @abstractmethod
    def free_deferred(self, component: Component, indices: torch.Tensor) -> None:
        """Free pages once they are no longer pinned (e.g. a duplicate slot an
        in-flight load still writes into). They count as used until the next
        flush finds them unpinned."""

    @abstractmethod
    def flush_deferred(self) -> int:
        """Free every deferred page that is not pinned; returns how many."""

    @abstractmethod
    def pin(self, component: Component, indices: torch.Tensor) -> None:
        """Pin pages (refcounted): pinned pages are never moved or freed.
        Raises ``PoolError`` for pages that are not allocated."""

    @abstractmethod
    def unpin(self, component: Component, indices: torch.Tensor) -> None:
        """Undo one ``pin``; raises ``PoolError`` if a page is not pinned."""

    # ---- capacity ----------------------------------------------------------
    @abstractmethod
    def available_size(self, component: Component) -> int:
        """Pages of ``component`` that ``alloc`` could return now, counting
        room the ladder can open by moving unpinned pages (memoized)."""

    @abstractmethod
    def can_alloc(self, demand: Mapping[Component, int]) -> bool:
        """Joint view: would ``alloc_many(demand)`` succeed now?"""

    def relieve_for_alloc(self, demand: Mapping[Component, int]) -> bool:
        """The shortfall ladder alone, without allocating: flush deferred
        frees (a unified pool also moves unpinned float pages, telling the
        move listeners). True once ``alloc_many(demand)`` would succeed
        without further moves; False means evict or give up. Raises
        ``PoolError`` on misuse. This default only flushes."""
        if self.can_alloc(demand):
            self.flush_deferred()  # can_alloc counts flushable pages as free
            return True
        return False

    @abstractmethod
    def used_size(self, component: Component) -> int:
        """Allocated pages of ``component`` (deferred ones included)."""

    @abstractmethod
    def capacity(self, component: Component) -> int:
        """The most pages of ``component`` the pool could ever hold."""

    # ---- relocation ------------------------------------------------------
    @abstractmethod
    def add_move_listener(self, listener: MoveListener) -> None:
        """Register an owner to be told about every page move."""

    @abstractmethod
    def verify_byte_accounting(self) -> None:
        """Raise ``PoolAccountingError`` on overlapping regions, leaked or
        double-counted pages, or a stale capacity memo."""

    # ---- bytes ------------------------------------------------------------
    def page_bytes(self, component: Component) -> int:
        return self.spec.page_bytes(component)

    def page_ptr(self, component: Component, index: int) -> int:
        """Address of page ``index`` (for zero-copy store transfers)."""
        return int(self.buffer.data_ptr()) + index * self.page_bytes(component)

    def page_view(self, component: Component, index: int) -> torch.Tensor:
        """The bytes of one page (a uint8 view, no copy)."""
        pb = self.page_bytes(component)
        return self.buffer[index * pb : (index + 1) * pb]

    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of global FULL/SWA layer ``layer``."""
        return kv_layer_view(
            self.buffer, self.spec, self.spec.kinds[layer], self.spec.local_index(layer)
        )

    def mamba_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The state tensors of global MAMBA layer ``layer`` (one view per
        tensor of ``spec.mamba``, each ``[max_slots, *shape]``)."""
        if self.spec.kinds[layer] is not Component.MAMBA:
            raise PoolError(f"layer {layer} is {self.spec.kinds[layer].value}, not mamba")
        return mamba_layer_view(self.buffer, self.spec, self.spec.local_index(layer))
