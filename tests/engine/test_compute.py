"""`compute_bytes` sizes a forward without touching the plan it reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from layerlift import ModelSpec
from layerlift.engine.compute import alloc_compute, compute_bytes
from layerlift.engine.plan import LookupPlan
from layerlift.pools import Component, UnifiedKVPool
from layerlift.pools.tree import UnifiedRadixTree

SPEC = ModelSpec.preset("tiny", track_interval=512)


class WatchedPlan(LookupPlan):
    """A plan that records every attribute set after construction."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_watching", False):
            self.__dict__.setdefault("_sets", []).append(name)
        object.__setattr__(self, name, value)


def test_compute_bytes_never_sets_an_attribute_of_the_plan() -> None:
    pool = UnifiedKVPool(SPEC, 16 << 20)
    tree = UnifiedRadixTree(SPEC, pool)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 800)
    b = np.concatenate([a[:700], rng.integers(1000, 2000, 100)])
    n = len(a) // SPEC.page_size
    full, swa = pool.alloc(Component.FULL, n), pool.alloc(Component.SWA, n)
    slot = int(pool.alloc(Component.MAMBA, 1)[0])
    tree.insert(a, full, swa, torch.ones(n, dtype=torch.bool), {32: slot})
    match = tree.match_prefix(b)
    plan = WatchedPlan(0, b, (), match, SPEC, boundary=match.boundary_pages)
    object.__setattr__(plan, "_watching", True)
    from_device = compute_bytes(pool, plan, boundary=0)
    at_plan = compute_bytes(pool, plan)
    assert plan.__dict__.get("_sets", []) == [] and plan.boundary == 32
    # From page 0 the forward writes 32 more FULL and SWA pages and captures
    # the grid checkpoint at 32 as well as the branch one at 43.
    page = pool.page_bytes(Component.FULL) + pool.page_bytes(Component.SWA)
    assert from_device - at_plan == 32 * page + pool.page_bytes(Component.MAMBA)
    got = alloc_compute(pool, tree, plan)
    assert got is not None
    assert at_plan == sum(len(idx) * pool.page_bytes(c) for c, idx in got.demand().items())
