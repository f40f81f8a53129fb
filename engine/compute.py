"""Device pages a request needs to compute its suffix, and its page tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerlift.engine.plan import LookupPlan
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["ComputeAlloc", "alloc_compute", "branch_page", "compute_bytes", "free_compute"]


@dataclass(eq=False)
class ComputeAlloc:
    """Fresh pages for positions ``[b, P)`` (P = pages touched by the prompt),
    the request's own Mamba slot, and one slot per checkpoint to capture
    (grid boundaries, plus the branch page when branch checkpoints are on)."""

    full: torch.Tensor
    swa: torch.Tensor
    work_slot: int
    capture: dict[int, int]  # boundary (pages) -> slot

    def demand(self) -> dict[Component, torch.Tensor]:
        slots = torch.tensor([self.work_slot, *self.capture.values()], dtype=torch.int64)
        return {Component.FULL: self.full, Component.SWA: self.swa, Component.MAMBA: slots}


def branch_page(plan: LookupPlan, boundary: int | None = None) -> int | None:
    """Where the prompt leaves the cached prefix, if that is off the
    checkpoint grid and inside the computed range (from ``boundary`` pages,
    default the plan's boundary): a branch checkpoint there lets later
    prompts that share the branch restore up to it (instead of the last grid
    boundary). ``None`` otherwise. Reads ``plan`` only."""
    spec = plan.spec
    b = plan.boundary if boundary is None else boundary
    kv, whole = plan.match.kv_pages, len(plan.tokens) // spec.page_size
    if b < kv < whole and kv % spec.track_pages:
        return kv
    return None


def _needs(plan: LookupPlan, b: int, branch: bool) -> tuple[dict[Component, int], list[int]]:
    """Pages per component the forward of ``plan`` writes from boundary ``b``
    (pages), and the boundaries whose checkpoints it captures."""
    spec = plan.spec
    ps, t = spec.page_size, spec.track_pages
    total_pages = -(-len(plan.tokens) // ps)
    whole = len(plan.tokens) // ps
    capture = list(range((b // t + 1) * t, whole + 1, t))
    at = branch_page(plan, b) if branch else None
    if at is not None:
        capture = sorted([*capture, at])
    demand = {
        Component.FULL: total_pages - b,
        Component.SWA: total_pages - b,
        Component.MAMBA: 1 + len(capture),
    }
    return demand, capture


def compute_bytes(pool: KVPool, plan: LookupPlan, boundary: int | None = None) -> int:
    """Bytes of pages and state slots the forward of ``plan`` writes (from
    ``boundary`` pages if given, else from the plan's boundary). Counts the
    branch checkpoint's slot whenever the plan has a branch page (an upper
    bound when branch checkpoints are off). Reads ``plan`` only: it never
    changes the plan, not even for a moment."""
    b = plan.boundary if boundary is None else boundary
    demand, _ = _needs(plan, b, branch=True)
    return sum(n * pool.page_bytes(c) for c, n in demand.items())


def alloc_compute(pool: KVPool, tree: UnifiedRadixTree, plan: LookupPlan) -> ComputeAlloc | None:
    """Allocate (evicting unlocked tree data on a shortfall) and pin what the
    forward of ``plan`` writes. ``None`` if the pool cannot hold it even
    after eviction."""
    demand, capture = _needs(plan, plan.boundary, tree.branch_checkpoints)
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
