"""An engine that is closed and dropped gives its device pool back at once.

The full benchmark grid creates four engines per point; a reference cycle
(tree <-> its components, pool -> tree listener) kept every pool alive until
the cyclic GC ran, and the process grew by gigabytes until it was killed."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore


async def test_closed_engine_frees_its_pool_without_gc() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    store = MemoryStore()
    engine = Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20), store=store)
    await engine.start()
    await engine.prefill([np.arange(200) % spec.vocab_size])
    await engine.wait_offloads()
    await engine.close()
    buffer = weakref.ref(engine.pool.buffer)
    tree = weakref.ref(engine.tree)
    gc.disable()
    try:
        del engine
        assert tree() is None, "the tree outlived its engine (a reference cycle)"
        assert buffer() is None, "the pool's buffer outlived its engine (a reference cycle)"
    finally:
        gc.enable()
