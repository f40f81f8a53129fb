"""``UnifiedKVPool``: the LayerLift tri-pool over one byte buffer.

Component mapping (chain low -> high bytes): FULL is the grow-up END, MAMBA
the float between, SWA the grow-down END; each page/slot is
``spec.page_bytes(component)`` bytes. The generic N-sub-pool machinery lives
in :class:`~layerlift.pools.allocator.MultiEndedAllocator`; this class only
translates :class:`Component` <-> sub-pool names and numpy <-> torch.

Why FULL at the bottom and SWA at the top with MAMBA floating: FULL and SWA
pages are long-lived in different proportions as the workload shifts, so the
two ENDs trade bytes through the float; MAMBA slots are few and large, and
are the only pages the pool ever moves (see docs/design.md §2, item 6, for why
pinned in-flight loads make those moves safe).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from layerlift.pools.allocator import MultiEndedAllocator
from layerlift.pools.base import KVPool, MoveListener, PoolError
from layerlift.pools.end_allocator import Side, SubPoolSpec
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["UnifiedKVPool", "component_of", "tri_pool_specs"]

_GROW = {Component.FULL: "up", Component.MAMBA: "float", Component.SWA: "down"}


def component_of(value: object) -> Component:
    """``value`` as a :class:`Component` (a member or its string value);
    ``PoolError`` for anything else."""
    if isinstance(value, Component):
        return value
    try:
        return Component(value)
    except ValueError:
        raise PoolError(
            f"unknown component {value!r}; use one of {[c.value for c in Component]}"
        ) from None


def tri_pool_specs(spec: ModelSpec) -> list[SubPoolSpec]:
    """The three sub-pool specs of ``spec`` in canonical chain order."""
    return [
        SubPoolSpec(c.value, spec.page_bytes(c), _GROW[c])  # type: ignore[arg-type]
        for c in (Component.FULL, Component.MAMBA, Component.SWA)
    ]


def _tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))


class UnifiedKVPool(KVPool):
    """FULL (grow-up END) + MAMBA (float) + SWA (grow-down END) in one
    ``total_bytes`` uint8 buffer on ``device``.

    All methods are for the owner thread (see ``base.py``). Raises
    ``PoolError`` for a non-positive ``total_bytes`` or one too small to hold
    a page of every component."""

    def __init__(self, spec: ModelSpec, total_bytes: int, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        specs = tri_pool_specs(spec)
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise PoolError(f"total_bytes must be a positive int, got {total_bytes!r}")
        self.buffer = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self.core = MultiEndedAllocator(total_bytes, specs, self.buffer)

    # ---- allocation ----------------------------------------------------------
    def alloc(self, component: Component, n: int) -> torch.Tensor | None:
        c = component_of(component)
        out = self.core.alloc_many({c.value: n})
        return None if out is None else _tensor(out[c.value])

    def alloc_many(self, demand: Mapping[Component, int]) -> dict[Component, torch.Tensor] | None:
        named = self._named(demand)
        out = self.core.alloc_many(named)
        return None if out is None else {Component(k): _tensor(v) for k, v in out.items()}

    def free(self, component: Component, indices: torch.Tensor) -> None:
        self.core.free(component_of(component).value, indices)

    def free_deferred(self, component: Component, indices: torch.Tensor) -> None:
        self.core.free_deferred(component_of(component).value, indices)

    def flush_deferred(self) -> int:
        return self.core.flush_deferred()

    def pin(self, component: Component, indices: torch.Tensor) -> None:
        self.core.pin(component_of(component).value, indices)

    def unpin(self, component: Component, indices: torch.Tensor) -> None:
        self.core.unpin(component_of(component).value, indices)

    def relieve_for_alloc(self, demand: Mapping[Component, int]) -> bool:
        """The shortfall ladder alone (flush -> move the float); True once
        ``demand`` fits without further moves. ``PoolError`` on bad input."""
        return self.core.relieve_for_alloc(self._named(demand))

    # ---- capacity ------------------------------------------------------------
    def available_size(self, component: Component) -> int:
        return self.core.available_size(component_of(component).value)

    def can_alloc(self, demand: Mapping[Component, int]) -> bool:
        return self.core.can_alloc(self._named(demand))

    def used_size(self, component: Component) -> int:
        return self.core.used_size(component_of(component).value)

    def capacity(self, component: Component) -> int:
        return self.core.capacity(component_of(component).value)

    # ---- relocation ------------------------------------------------------------
    def add_move_listener(self, listener: MoveListener) -> None:
        """``listener(component, old, new)`` runs after every move (make_room,
        compact_holes, move_pages, or the shortfall ladder inside ``alloc``),
        once the bytes and the accounting are already at ``new``. An exception
        it raises propagates out of that call; the move itself stands."""

        def relay(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
            listener(Component(name), old, new)

        self.core.add_listener(relay)

    def make_room(self, side: Side, nbytes: int) -> bool:
        """MAMBA vacates ``nbytes`` next to FULL (``"low"``) or SWA
        (``"high"``); see :meth:`MultiEndedAllocator.make_room`."""
        return self.core.make_room(Component.MAMBA.value, side, nbytes)

    def compact_holes(self, component: Component | None = None) -> int:
        """Fill holes (all components, or one); returns pages moved."""
        name = None if component is None else component_of(component).value
        return self.core.compact_holes(name)

    def move_pages(self, component: Component, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move live unpinned pages to free ones (bytes copied, listeners told)."""
        self.core.move_pages(component_of(component).value, src, dst)

    def verify_byte_accounting(self) -> None:
        self.core.verify_byte_accounting()

    # ---- helpers ---------------------------------------------------------------
    def frontiers(self) -> dict[Component, tuple[int, int] | None]:
        """Byte span each component claims now (``None`` when empty)."""
        return {Component(a.name): a.span() for a in self.core.chain}

    @staticmethod
    def _named(demand: Mapping[Component, int]) -> dict[str, int]:
        if not isinstance(demand, Mapping):
            raise PoolError(f"demand must map components to page counts, got {demand!r}")
        return {component_of(c).value: n for c, n in demand.items()}
