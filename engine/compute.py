"""Device pages a request needs to compute its suffix, and its page tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerlift.engine.plan import LookupPlan
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["ComputeAlloc", "alloc_compute", "free_compute"]


@dataclass(eq=False)
class ComputeAlloc:
    """Fresh pages for positions ``[b, P)`` (P = pages touched by the prompt),
    the request's own Mamba slot, and one slot per checkpoint to capture."""

    full: torch.Tensor
    swa: torch.Tensor
    work_slot: int
    capture: dict[int, int]  # boundary (pages) -> slot

    def demand(self) -> dict[Component, torch.Tensor]:
        slots = torch.tensor([self.work_slot, *self.capture.values()], dtype=torch.int64)
        return {Component.FULL: self.full, Component.SWA: self.swa, Component.MAMBA: slots}


def _needs(plan: LookupPlan) -> tuple[dict[Component, int], list[int]]:
    spec = plan.spec
    ps, t = spec.page_size, spec.track_pages
    b = plan.boundary
    total_pages = -(-len(plan.tokens) // ps)
    whole = len(plan.tokens) // ps
    capture = list(range((b // t + 1) * t, whole + 1, t))
    demand = {
        Component.FULL: total_pages - b,
        Component.SWA: total_pages - b,
        Component.MAMBA: 1 + len(capture),
    }
    return demand, capture


def alloc_compute(pool: KVPool, tree: UnifiedRadixTree, plan: LookupPlan) -> ComputeAlloc | None:
    """Allocate (evicting unlocked tree data on a shortfall) and pin what the
    forward of ``plan`` writes. ``None`` if the pool cannot hold it even
    after eviction."""
    demand, capture = _needs(plan)
    # More than the whole buffer can never fit (and alloc_many raises for it).
    if sum(n * pool.page_bytes(c) for c, n in demand.items()) > pool.buffer.numel():
        return None
    got = pool.alloc_many(demand)
    if got is None:
        short = {c: max(0, n - pool.available_size(c)) for c, n in demand.items()}
        tree.evict(short)
        got = pool.alloc_many(demand)
    # The sub-pools share bytes, so evicting each component's own shortfall may
    # free room in the wrong place: keep evicting (LRU) while the tree gives
    # pages back, rather than failing while cache is left.
    while got is None and any(tree.evict(demand).values()):
        got = pool.alloc_many(demand)
    if got is None:
        return None
    for c, idx in got.items():
        pool.pin(c, idx)
    slots = got[Component.MAMBA].tolist()
    return ComputeAlloc(
        full=got[Component.FULL], swa=got[Component.SWA], work_slot=slots[0],
        capture=dict(zip(capture, slots[1:], strict=True)),
    )


def free_compute(pool: KVPool, alloc: ComputeAlloc) -> None:
    """Unpin and free everything of ``alloc`` (a request that never inserted)."""
    for c, idx in alloc.demand().items():
        pool.unpin(c, idx)
        pool.free(c, idx)
