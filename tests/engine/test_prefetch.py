"""Cross-batch prefetch: two batches in flight. The next batch looks up,
PREPAREs and fetches while the previous one computes, once that one's load
has landed; faults with two batches in flight stay exact and leak nothing.

Ordering comes from gates (a forward held at a layer, a layer read held in
the store), never from sleeps."""

from __future__ import annotations

import asyncio
import threading

import anyio
import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.testing import (
    FaultyModel,
    FaultyStore,
    assert_quiescent,
    kl_divergence,
    offload_and_drop,
)

WAIT_S = 30.0
LAST = 7  # the tiny preset's last layer


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def _exact(got: list[PrefillResult], ref: list[PrefillResult]) -> None:
    kls = [kl_divergence(a.next_token_logprobs, b.next_token_logprobs)
           for a, b in zip(ref, got, strict=True)]
    assert max(kls) <= 1e-6, kls


async def _stored(engine: Engine, prompts: list[np.ndarray]) -> list[PrefillResult]:
    ref = await engine.prefill(prompts)
    await offload_and_drop(engine)
    return ref


async def _wait(event: threading.Event) -> None:
    assert await anyio.to_thread.run_sync(event.wait, WAIT_S)


async def _prefetch_overlaps(model: HybridModel, inner: Store) -> None:
    rng = np.random.default_rng(11)
    a, b = (rng.integers(0, model.vocab_size, 300, dtype=np.int64) for _ in range(2))
    store, fmodel = FaultyStore(inner, model.spec), FaultyModel(model)
    async with Engine(fmodel, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        ref = await _stored(engine, [a, b])
        hold_a, hold_b_read = threading.Event(), threading.Event()
        fmodel.gate_at(LAST, hold_a)  # A computes up to its last layer, then waits
        task_a = asyncio.create_task(engine.prefill([a]))
        await _wait(fmodel.reached)
        b_read = store.gate_layer(LAST, hold_b_read).started
        task_b = asyncio.create_task(engine.prefill([b]))
        try:
            # B's fetch of the last layer runs while A's forward is still running.
            await _wait(b_read)
            assert not task_a.done()
        finally:
            hold_b_read.set()
            hold_a.set()
        (ra,), (rb,) = await task_a, await task_b
        assert ra.restored_tokens > 0 and rb.restored_tokens > 0
        _exact([ra, rb], ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_next_batch_fetches_while_the_previous_computes(model: HybridModel) -> None:
    await _prefetch_overlaps(model, MemoryStore())


@pytest.mark.mooncake
async def test_prefetch_on_mooncake(model: HybridModel, mc_client: MooncakeStore) -> None:
    await _prefetch_overlaps(model, mc_client)


async def test_a_failed_load_keeps_the_next_batch_out(model: HybridModel) -> None:
    """A's layer 3 fails while B waits to start: A keeps the load lock until
    it has unpublished what did not land (B would otherwise match pages that
    are about to leave); both results are exact."""
    rng = np.random.default_rng(12)
    a = rng.integers(0, model.vocab_size, 300, dtype=np.int64)
    b = np.concatenate([a[:200], rng.integers(0, model.vocab_size, 90, dtype=np.int64)])
    store, fmodel = FaultyStore(MemoryStore(), model.spec), FaultyModel(model)
    async with Engine(fmodel, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        ref = await _stored(engine, [a, b])
        store.fail_layer(3)
        hold = threading.Event()
        fmodel.gate_at(0, hold)  # A's first pass stops at layer 0 (before it sees the failure)
        task_a = asyncio.create_task(engine.prefill([a]))
        await _wait(fmodel.reached)
        task_b = asyncio.create_task(engine.prefill([b]))
        hold.set()
        (ra,), (rb,) = await task_a, await task_b
        assert ra.recomputed_after_failure
        _exact([ra, rb], ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_abort_after_the_next_batch_matched_its_pages(model: HybridModel) -> None:
    """A's load landed; B (sharing A's prefix) looked it up and locked it;
    then A is cancelled. A's restore stays published (its bytes are whole and
    B reads them) instead of being pulled from under B."""
    rng = np.random.default_rng(13)
    a = rng.integers(0, model.vocab_size, 300, dtype=np.int64)
    b = np.concatenate([a[:260], rng.integers(0, model.vocab_size, 120, dtype=np.int64)])
    store, fmodel = FaultyStore(MemoryStore(), model.spec), FaultyModel(model)
    async with Engine(fmodel, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        ref_a = await _stored(engine, [a])
        async with Engine(model, EngineConfig(store="memory", offload=False)) as cold:
            ref_b = await cold.prefill([b])
        hold_a, hold_b = threading.Event(), threading.Event()
        fmodel.gate_at(LAST, hold_a)
        task_a = asyncio.create_task(engine.prefill([a]))
        await _wait(fmodel.reached)
        b_lookup = store.gate("exists", hold_b).started
        task_b = asyncio.create_task(engine.prefill([b]))
        await _wait(b_lookup)  # B matched (and locked) A's restored nodes, asks the store
        task_a.cancel()
        hold_a.set()
        with pytest.raises(asyncio.CancelledError):
            await task_a
        hold_b.set()
        (rb,) = await task_b
        assert rb.device_hit_tokens > 0, "B should have matched A's restored pages"
        _exact([rb], ref_b)
        await engine.wait_offloads()
        assert_quiescent(engine)
        fmodel.clear()
        store.clear()
        _exact(await engine.prefill([a]), ref_a)
