"""An engine that is closed and dropped gives its device pool back at once.

The full benchmark grid creates four engines per point; a reference cycle
(tree <-> its components, pool -> tree listener) kept every pool alive until
the cyclic GC ran, and the process grew by gigabytes until it was killed."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from layerlift import Component, Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore
from layerlift.pools import UnifiedKVPool
from layerlift.pools.tree import UnifiedRadixTree
from layerlift.testing import KL_EXACT, FaultyStore, kl_divergence


async def test_closed_engine_is_not_kept_by_a_reference_cycle() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    store = MemoryStore()
    engine = Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20), store=store)
    await engine.start()
    await engine.prefill([np.arange(200) % model.vocab_size])
    await engine.wait_offloads()
    await engine.close()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds in cycles stays in gc.garbage
    try:
        del engine
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage
                  if isinstance(o, UnifiedRadixTree | UnifiedKVPool | Engine)]
        assert not cyclic, f"only the cyclic GC would have freed {sorted(set(cyclic))}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_cancelled_prefill_releases_everything() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    store = FaultyStore(MemoryStore(), spec)
    prompt = np.random.default_rng(5).integers(0, model.vocab_size, 300)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        (cold,) = await engine.prefill([prompt])
        await engine.wait_offloads()
        engine.drop_device_cache()
        gate = threading.Event()
        fault = store.gate_layer(3, gate)
        task = asyncio.create_task(engine.prefill([prompt]))
        assert await asyncio.to_thread(fault.started.wait, 10.0)
        task.cancel()
        gate.set()  # the forward thread finishes its pass, then the batch is aborted
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.tree.check_integrity()
        engine.pool.verify_byte_accounting()
        await engine.wait_offloads()
        engine.drop_device_cache()
        assert all(engine.pool.used_size(c) == 0 for c in Component)
        (again,) = await engine.prefill([prompt])  # the engine serves on, exactly
        assert again.restored_tokens > 0
        assert kl_divergence(cold.next_token_logprobs, again.next_token_logprobs) <= KL_EXACT
