"""Regression tests for the holes a review of the engine found (each failed
before its fix): an abort between forward passes, stale or foreign plans in
``load``, waits without a bound, misuse that raised bare internal errors.

Each case checks what matters: results are exact or a clear error is raised,
the sanitizer saw nothing released under a running thread, the engine is
quiescent afterwards, and (for the store) a second engine restores exactly.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

from layerlift import Engine, EngineConfig, EngineError, HybridModel, ModelSpec
from layerlift.engine.batch import Batch
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.readiness import LayerReadiness
from layerlift.testing import FaultyModel, FaultyStore, assert_quiescent, offload_and_drop
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts
from layerlift.testing.sanitizer import PoolSanitizer

WAIT_S = 30.0


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def spy_end_load(batch: Batch) -> asyncio.Event:
    """An event set when ``batch`` starts ending its load (the window after
    a failed pass, before the recompute)."""
    entered = asyncio.Event()
    original = batch._end_load

    async def spied() -> Any:
        entered.set()
        return await original()

    batch._end_load = spied  # type: ignore[method-assign]
    return entered


async def load_and_forward(engine: Engine, plan: Any) -> Any:
    """``lookup``'s plan through ``load``, ``commit`` and ``forward``: its result."""
    handle = await engine.load([plan])
    handle.commit()
    (result,) = await handle.forward()
    return result


# ---- 1. an abort between forward passes ----------------------------------------------

@pytest.mark.parametrize("abort", ["handle.abort", "engine.close"])
async def test_abort_between_passes_runs_no_second_forward(model: HybridModel,
                                                           abort: str) -> None:
    """Layer 0's read fails, layer 1's read is held: the forward fails at
    layer 0 and the batch waits for the load to end before recomputing. An
    abort in that window must end the batch: before the fix the loop started
    a second pass whose compute pages the exit freed under it (later device
    hits KL 0.27, the store's copy KL 0.19)."""
    prompt, other = random_prompts(model, 11, [640, 700])
    ref, ref_other = await cold_prefills(model, [prompt, other])
    san, memory = PoolSanitizer(), MemoryStore()
    store = FaultyStore(memory, model.spec)
    # A second pass would hold at layer 2 (the first fails in layer 0's wait).
    faulty, second_pass = FaultyModel(model), threading.Event()
    # One layer per worker call: layer 1's read is in flight beside layer 0's.
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20, stream_size=1)
    engine = Engine(san.model(faulty), cfg, store=san.store(store))
    await engine.start()
    try:
        san.attach(engine.pool)
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        gate = threading.Event()
        store.fail_layer(0)
        held = store.gate_layer(1, gate)
        faulty.gate_at(2, second_pass)
        plan = await engine.lookup(prompt)
        assert plan.restores
        handle = await engine.load([plan])
        entered = spy_end_load(handle._batch)
        handle.commit()
        forward = asyncio.create_task(handle.forward())
        try:
            async with asyncio.timeout(WAIT_S):
                await entered.wait()  # the failed pass waits for the load's end
            assert await anyio.to_thread.run_sync(held.started.wait, WAIT_S)
            closing = None
            if abort == "handle.abort":
                handle.abort()
            else:
                closing = asyncio.create_task(engine.close())
                for _ in range(100):  # close() runs in a task of its own: let it abort
                    if handle._batch.closed:
                        break
                    await asyncio.sleep(0)
            assert handle._batch.closed
        finally:
            gate.set()
        reached = asyncio.ensure_future(anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S))
        try:
            await asyncio.wait({forward, reached}, return_when=asyncio.FIRST_COMPLETED)
            assert not faulty.reached.is_set(), "a second forward pass ran after the abort"
        finally:
            second_pass.set()
            faulty.reached.set()  # ends the watcher
            await reached
        faulty.clear()
        with pytest.raises(EngineError, match="aborted"):
            await forward
        await handle.aclose()
        if closing is not None:
            await closing
            engine = Engine(san.model(faulty), cfg, store=san.store(store))
            await engine.start()
            san.attach(engine.pool)
        store.clear()
        await engine.wait_offloads()
        assert_quiescent(engine)
        # Nothing wrong was left on the device or in the store.
        got = [(await engine.prefill([p]))[0] for p in (other, prompt, other, prompt)]
        assert_exact(got, [ref_other, ref, ref_other, ref])
        await engine.wait_offloads()
        assert_quiescent(engine)
    finally:
        await engine.close()
    san.check()
    async with Engine(model, cfg, store=memory) as second:  # the store's copy
        (again,) = await second.prefill([prompt])
        assert again.restored_tokens > 0
        assert_exact([again], [ref])


# ---- 2 and 6. plans that are not live, or listed twice ---------------------------------

async def test_load_refuses_plans_that_are_not_live(model: HybridModel) -> None:
    """A released plan, a plan whose handle finished, a plan of another
    engine and a plan listed twice: ``ValueError`` naming it, nothing held
    (before: device hits with KL 0.52, a leaked node lock and pins, another
    engine's page indices used)."""
    prompt = random_prompts(model, 12, [640])[0]
    (ref,) = await cold_prefills(model, [prompt])
    memory = MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg, store=memory) as engine, \
            Engine(model, cfg, store=memory) as other:
        await engine.prefill([prompt])
        await offload_and_drop(engine)

        released = await engine.lookup(prompt)
        engine.release_plan(released)
        with pytest.raises(ValueError, match="was released"):
            await engine.load([released])

        finished = await engine.lookup(prompt)
        done = await load_and_forward(engine, finished)
        assert_exact([done], [ref])
        with pytest.raises(ValueError, match="loaded already"):
            await engine.load([finished])

        foreign = await other.lookup(prompt)
        with pytest.raises(ValueError, match="another engine"):
            await engine.load([foreign])
        with pytest.raises(ValueError, match="another engine"):
            engine.release_plan(foreign)  # its pins name the other engine's pages
        other.release_plan(foreign)

        twice = await engine.lookup(prompt)
        with pytest.raises(ValueError, match="listed twice"):
            await engine.load([twice, twice])
        # A refused load holds nothing and leaves the plan the caller's.
        handle = await engine.load([twice])
        with pytest.raises(ValueError, match="is loaded"):
            engine.release_plan(twice)  # the batch releases it
        handle.commit()
        (again,) = await handle.forward()
        assert_exact([again], [ref])

        with pytest.raises(ValueError, match="at least one plan"):
            await engine.load([])
        for e in (engine, other):
            await e.wait_offloads()
            assert_quiescent(e)


async def test_a_stale_plan_beside_a_live_one_corrupts_nothing(model: HybridModel) -> None:
    """A stale plan loaded together with a live plan of the same prefix:
    refused whole; the live plan then restores exactly, and so does a later
    prefill (before: the live request's slots were never loaded but stayed
    published, a later device hit gave KL 0.038)."""
    prompt = random_prompts(model, 13, [640])[0]
    (ref,) = await cold_prefills(model, [prompt])
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg) as engine:
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        stale = await engine.lookup(prompt)
        engine.release_plan(stale)
        live = await engine.lookup(prompt)
        with pytest.raises(ValueError, match="was released"):
            await engine.load([live, stale])
        got = await load_and_forward(engine, live)
        assert got.restored_tokens > 0
        (hit,) = await engine.prefill([prompt])
        assert hit.device_hit_tokens > 0
        assert_exact([got, hit], [ref, ref])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_restrict_to_failing_leaves_the_plan_loadable(model: HybridModel) -> None:
    prompt = random_prompts(model, 14, [640])[0]
    (ref,) = await cold_prefills(model, [prompt])
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg) as engine:
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        plan = await engine.lookup(prompt)
        before = (plan.restorable, plan.boundary)
        with pytest.raises(ValueError, match="share no restorable boundary"):
            plan.restrict_to([frozenset({10_000})])
        assert (plan.restorable, plan.boundary) == before
        got = await load_and_forward(engine, plan)
        assert_exact([got], [ref])
        await engine.wait_offloads()
        assert_quiescent(engine)


# ---- 5. waits with a bound ----------------------------------------------------------

async def test_prefill_behind_a_stalled_put_ends_within_its_bound(model: HybridModel) -> None:
    """A put to a stalled store pins the pages of the prompt it sends; the
    next prompt needs that room. The prefill raises a clear ``EngineError``
    within a few ``layer_wait_timeout_s`` (before: it waited until the store
    answered), and prefills normally once the put ends."""
    first, big = random_prompts(model, 15, [1500, 2600])
    (ref_big,) = await cold_prefills(model, [big])
    store = FaultyStore(MemoryStore(), model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=6 << 20, layer_wait_timeout_s=0.5)
    async with Engine(model, cfg, store=store) as engine:
        gate = threading.Event()
        put = store.gate("put", gate)
        try:
            await engine.prefill([first])
            assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
            with pytest.raises(EngineError, match=r"room stayed held|does not fit"):
                async with asyncio.timeout(WAIT_S):
                    await engine.prefill([big])
        finally:
            gate.set()
        store.clear()
        await engine.wait_offloads()
        (got,) = await engine.prefill([big])
        assert_exact([got], [ref_big])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_prefill_behind_a_handle_that_holds_the_device_is_bounded(
        model: HybridModel) -> None:
    """A step-by-step handle committed but never forwarded holds the device;
    a prefill behind it raises ``EngineError`` after ``layer_wait_timeout_s``
    instead of waiting for ever, and the handle then still runs exactly."""
    a, b = random_prompts(model, 16, [300, 300])
    ref_a, ref_b = await cold_prefills(model, [a, b])
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20, layer_wait_timeout_s=0.5)
    async with Engine(model, cfg) as engine:
        handle = await engine.load([await engine.lookup(a)])
        handle.commit()
        with pytest.raises(EngineError, match="kept the device"):
            async with asyncio.timeout(WAIT_S):
                await engine.prefill([b])
        (got_a,) = await handle.forward()
        (got_b,) = await engine.prefill([b])
        assert_exact([got_a, got_b], [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


# ---- 8. misuse gets a clear error ---------------------------------------------------

def test_readiness_refuses_a_layer_it_does_not_have() -> None:
    readiness = LayerReadiness(4)
    for bad in (4, -1, 10):
        with pytest.raises(ValueError, match="not a layer of this model"):
            readiness.done(bad)
        with pytest.raises(ValueError, match="not a layer of this model"):
            readiness.wait(bad, 0.01)
        with pytest.raises(ValueError, match="not a layer of this model"):
            readiness.mark_done(bad)
    readiness.mark_done(3)
    assert readiness.done(3)


async def test_ready_refuses_a_layer_it_does_not_have() -> None:
    readiness = LayerReadiness(4)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="not a layer of this model"):
            await readiness.ready(bad, timeout=0.01)


async def test_external_wait_refuses_a_layer_the_model_does_not_have(
        model: HybridModel) -> None:
    prompt = random_prompts(model, 17, [300])[0]
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg) as engine:
        handle = await engine.load([await engine.lookup(prompt)])
        ext = handle.begin_external()
        for bad in (model.spec.num_layers, -1):
            with pytest.raises(ValueError, match="not a layer of this model"):
                await anyio.to_thread.run_sync(ext.wait, bad)
        ext.abort()
        await ext.aclose()
        await engine.wait_offloads()
        assert_quiescent(engine)
