"""``Engine.estimate_prefill``: routing hints that agree with what a prefill
then does, and that change nothing (tree, access times, locks, pins,
allocations, pool bytes, the engine's counters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from layerlift import HybridModel
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.costmodel import CostPriors
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import FaultyStore


def prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n, dtype=np.int64) for n in lengths]


def snapshot(eng: Engine) -> dict[str, Any]:
    """Everything an estimate must leave alone."""
    nodes = sorted(eng.tree.iter_nodes(), key=lambda n: n.node_id)
    core = eng.pool.core  # type: ignore[attr-defined]
    return {
        "nodes": [(n.node_id, dict(n.last_access), n.lock_ref, n.checkpoint, n.pending)
                  for n in nodes],
        "clock": eng.tree._clock,
        "pins": [a.pins.copy().tolist() for a in core.chain],
        "used": {c: eng.pool.used_size(c) for c in eng.linkers},
        "bytes": eng.pool.buffer.clone(),
        "next_id": eng._ctx.next_id,
        "locked": (eng._ctx.lock.locked(), eng._ctx.device.locked()),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all((a[k] == b[k]).all() if k == "bytes" else a[k] == b[k] for k in a)


async def test_estimate_agrees_with_the_prefill_that_follows(tiny_model: HybridModel) -> None:
    base, other = prompts(tiny_model.vocab_size, [300, 120], seed=1)
    longer = np.concatenate([base, other])
    store = MemoryStore()
    ns = "estimate-agree"
    cfg = EngineConfig(store="memory", pool_bytes=32 << 20, namespace=ns)
    async with Engine(tiny_model, cfg, store=store) as a, \
            Engine(tiny_model, cfg, store=store) as b:
        await a.prefill([base])
        await a.wait_offloads()
        on_a = await a.estimate_prefill(longer)
        on_b = await b.estimate_prefill(longer, priors=CostPriors(2e9, 10e-6, 1e-4))
        assert on_a.device_hit_tokens > 0 and on_a.restorable_tokens == 0
        assert on_b.device_hit_tokens == 0 and on_b.restorable_tokens == on_a.device_hit_tokens
        for est in (on_a, on_b):
            assert est.prompt_tokens == len(longer)
            assert (est.device_hit_tokens + est.restorable_tokens + est.compute_tokens
                    == len(longer))
            assert est.store_available and est.ttft_s > 0
        assert on_b.restore and on_b.restore_bytes > 0 and on_b.load_s > 0
        # priors at 1e-4 s per token: compute the rest vs everything
        assert on_b.compute_s == pytest.approx(1e-4 * on_b.compute_tokens)
        assert on_b.recompute_s == pytest.approx(
            1e-4 * (on_b.compute_tokens + on_b.restorable_tokens))
        assert on_b.restore_s >= on_b.compute_s
        (rb,) = await b.prefill([longer])
        (ra,) = await a.prefill([longer])  # (b's offloads may let it restore more now)
    assert ra.device_hit_tokens == on_a.device_hit_tokens
    assert rb.restored_tokens == on_b.restorable_tokens and rb.device_hit_tokens == 0


async def test_estimate_changes_nothing(tiny_model: HybridModel) -> None:
    batch = prompts(tiny_model.vocab_size, [300, 260, 200], seed=2)
    async with Engine(tiny_model, EngineConfig(store="memory", pool_bytes=32 << 20)) as eng:
        await eng.prefill(batch[:2])
        await eng.wait_offloads()
        probe = np.concatenate([batch[0][:250], batch[2]])
        before = snapshot(eng)
        for tokens in (*batch, probe):
            await eng.estimate_prefill(tokens)
        assert same(before, snapshot(eng))
        eng.tree.check_integrity()
        # Negative control: a LOOKUP does touch the tree (access times, the
        # request counter), and the snapshot sees it.
        plan = await eng.lookup(batch[0])
        eng.release_plan(plan)
        assert not same(before, snapshot(eng))


async def test_a_failing_store_is_reported_not_raised(tiny_model: HybridModel) -> None:
    (tokens,) = prompts(tiny_model.vocab_size, [300], seed=3)
    store = FaultyStore(MemoryStore(), tiny_model.spec)
    async with Engine(tiny_model, EngineConfig(store="memory", pool_bytes=32 << 20),
                      store=store) as eng:
        await eng.prefill([tokens])
        await eng.wait_offloads()
        eng.drop_device_cache()
        ok = await eng.estimate_prefill(tokens)
        assert ok.restorable_tokens > 0
        store.down = True
        est = await eng.estimate_prefill(tokens)
        store.down = False
    assert not est.store_available and est.restorable_tokens == 0 and not est.restore
    assert est.compute_tokens == len(tokens)


async def test_malformed_prompts_raise(tiny_model: HybridModel) -> None:
    async with Engine(tiny_model, EngineConfig(store="memory", pool_bytes=32 << 20)) as eng:
        for bad in ([], [[1, 2]], [0.5, 1.5]):
            with pytest.raises(ValueError, match="prompt"):
                await eng.estimate_prefill(bad)  # type: ignore[arg-type]
