"""Tensor-parallel ranks: keys carry the rank, and a restore ends at a boundary
every rank can restore (the ranks' restorable sets intersected)."""

from __future__ import annotations

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import kl_divergence as _kl


async def test_ranks_restore_to_their_common_boundary() -> None:
    spec = ModelSpec.preset("tiny")  # page 16, checkpoints every 64 tokens (4 pages)
    model = HybridModel(spec, seed=0)
    store = MemoryStore()
    prompt = np.random.default_rng(3).integers(0, model.vocab_size, 300)

    def cfg(rank: int) -> EngineConfig:
        return EngineConfig(store="memory", pool_bytes=16 << 20, rank=rank, world_size=2)

    async with Engine(model, cfg(0), store=store) as r0, \
            Engine(model, cfg(1), store=store) as r1:
        (cold,) = await r0.prefill([prompt])        # rank 0 stores up to 256 tokens
        await r1.prefill([prompt[:140]])            # rank 1 only up to 128 tokens
        for engine in (r0, r1):
            await engine.wait_offloads()
            engine.drop_device_cache()

        p0, p1 = await r0.lookup(prompt), await r1.lookup(prompt)
        assert max(p0.restorable) == 16             # pages: rank 0 sees its own keys only
        assert max(p1.restorable) == 8              # rank 1 never sees rank 0's objects
        p0.restrict_to([p1.restorable])
        p1.restrict_to([p0.restorable])
        assert p0.boundary == p1.boundary == 8

        (restored,) = await (await r0.load([p0])).forward()
        assert restored.restored_tokens == 128 and restored.computed_tokens == 300 - 128
        assert _kl(cold.next_token_logprobs, restored.next_token_logprobs) <= 1e-9
        r1.release_plan(p1)
        for engine in (r0, r1):
            engine.tree.check_integrity()
            engine.pool.verify_byte_accounting()


async def test_ranks_without_a_common_boundary_say_so() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=MemoryStore()) as engine:
        plan = await engine.lookup(np.arange(100) % model.vocab_size)
        with pytest.raises(ValueError, match="no restorable boundary"):
            plan.restrict_to([frozenset({4})])
        engine.release_plan(plan)
