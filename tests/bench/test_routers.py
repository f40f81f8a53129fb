"""The fleet's routers: round-robin, least-loaded, prefix (device hit, ties
by load) and restore-aware (queue + the instance's own TTFT estimate), on
real engines sharing one store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from layerlift import HybridModel
from layerlift.bench.routers import ROUTERS, make_router
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.costmodel import CostPriors
from layerlift.linker.memory_store import MemoryStore

# 1 GB/s, 10 us per layer call, 1 ms per computed token: restoring beats computing.
PRIORS = CostPriors(1e9, 10e-6, 1e-3)


@dataclass
class View:
    engine: Any
    queued_tokens: int = 0
    queued_s: float = 0.0


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n, dtype=np.int64)


async def test_round_robin_and_least_loaded() -> None:
    views = [View(None, 30), View(None, 10), View(None, 10)]
    rr = make_router("round-robin")
    assert [(await rr.route(toks(5), views)).instance for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = make_router("least-loaded")
    assert (await ll.route(toks(5), views)).instance == 1  # ties to the lowest index
    views[1].queued_tokens = 11
    assert (await ll.route(toks(5), views)).instance == 2
    with pytest.raises(ValueError, match="at least one instance"):
        await rr.route(toks(5), [])
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")
    assert set(ROUTERS) == {"round-robin", "least-loaded", "prefix", "restore-aware"}


@pytest.fixture(scope="module")
def tiny_model() -> HybridModel:
    from layerlift import ModelSpec

    return HybridModel(ModelSpec.preset("tiny"), seed=0)


@pytest.fixture
async def fleet(tiny_model: HybridModel) -> AsyncIterator[list[View]]:
    """Three engines on one store; instance 0 computed (and offloaded) a prompt."""
    store = MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=32 << 20, namespace="routers")
    async with Engine(tiny_model, cfg, store=store) as a, \
            Engine(tiny_model, cfg, store=store) as b, \
            Engine(tiny_model, cfg, store=store) as c:
        await a.prefill([toks(400)])
        await a.wait_offloads()
        yield [View(a), View(b), View(c)]


async def test_prefix_router_follows_the_device_hit_then_the_load(fleet: list[View]) -> None:
    prefix = make_router("prefix")
    hit = np.concatenate([toks(400)[:320], toks(60, seed=9)])
    assert (await prefix.route(hit, fleet)).instance == 0
    fleet[0].queued_tokens = 10_000  # a long queue does not move it off its hit
    assert (await prefix.route(hit, fleet)).instance == 0
    fleet[1].queued_tokens = 50  # no hit anywhere: least queued wins
    assert (await prefix.route(toks(100, seed=5), fleet)).instance == 2


async def test_restore_aware_weighs_the_queue_against_a_restore(fleet: list[View]) -> None:
    router = make_router("restore-aware", PRIORS)
    hit = np.concatenate([toks(400)[:320], toks(60, seed=9)])
    route = await router.route(hit, fleet)
    assert route.instance == 0 and route.est_s > 0  # device hit, empty queue
    # A busy instance 0: instance 1 restores the prefix from the store instead.
    fleet[0].queued_s = 10.0
    fleet[1].queued_tokens = 5
    route = await router.route(hit, fleet)
    assert route.instance == 2  # both can restore; 2 has the shorter queue
    est = await fleet[2].engine.estimate_prefill(hit, priors=PRIORS)
    assert est.restorable_tokens > 0 and route.est_s == pytest.approx(est.ttft_s)
    # prefix routing would stay on the busy instance
    assert (await make_router("prefix").route(hit, fleet)).instance == 0
