"""Plain asyncio cancellation while a worker thread is mid-flight.

``task.cancel()`` and ``asyncio.wait_for``/``asyncio.timeout`` (what a host
server's request cancellation and a ``TaskGroup`` failure do) used to make
the engine release pool memory while the forward or a put thread still used
it: later prompts were computed into pages the cancelled forward went on
writing (KL up to 0.94 on device hits), and a cancelled ``wait_offloads``
let a put store another prompt's bytes under the first prompt's keys. Each
test holds the thread at a gate, cancels, checks that the cancelled call has
*not* returned while the thread is held (a bounded window: a correct engine
never returns there, however long the window), opens the gate, and then
checks exactness and the :class:`PoolSanitizer`'s record.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import FaultyModel, FaultyStore, assert_quiescent
from layerlift.testing.controls import HOLD_S, cancel_while_held
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts
from layerlift.testing.sanitizer import PoolSanitizer, SanitizerViolation

KL_TOL = 1e-6
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


@pytest.mark.parametrize("how", ["task.cancel", "timeout"])
@pytest.mark.parametrize("layer", [0, 4, 7])
async def test_cancelled_forward_releases_its_pages_only_after_it_returned(
        model: HybridModel, how: str, layer: int) -> None:
    """Finding 1: a new 3000-token prompt (8 MiB pool) cancelled while its
    forward runs; six later prompts are computed into the pool and hit on
    the device: all exact."""
    big = random_prompts(model, 1, [3000])[0]
    later = random_prompts(model, 2, [700, 900, 500, 800, 600, 1000])
    ref = await cold_prefills(model, later)
    san, faulty = PoolSanitizer(), FaultyModel(model)
    cfg = EngineConfig(store="memory", offload=False, pool_bytes=8 << 20)
    async with Engine(san.model(faulty), cfg) as engine:
        san.attach(engine.pool)
        gate = threading.Event()
        faulty.gate_at(layer, gate)
        box: dict[str, Any] = {}

        async def timed() -> list[PrefillResult]:
            async with asyncio.timeout(None) as cm:
                box["cm"] = cm
                return await engine.prefill([big])

        task = asyncio.create_task(engine.prefill([big]) if how == "task.cancel" else timed())
        assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
        loop = asyncio.get_running_loop()
        await cancel_while_held(
            task, task.cancel if how == "task.cancel"
            else (lambda: box["cm"].reschedule(loop.time())), gate)
        expected = asyncio.CancelledError if how == "task.cancel" else TimeoutError
        with pytest.raises(expected):
            await task
        faulty.clear()
        assert_quiescent(engine)
        computed = [(await engine.prefill([p]))[0] for p in later]
        assert_exact(computed, ref)
        hits = [(await engine.prefill([p]))[0] for p in later]
        assert all(h.device_hit_tokens > 0 for h in hits)
        assert_exact(hits, ref)
        assert_quiescent(engine)
    assert san.checked > 0
    san.check()


async def test_cancelled_wait_offloads_does_not_cut_a_put_short(model: HybridModel) -> None:
    """Finding 2: ``wait_offloads()`` cancelled while the put runs; the
    pages it reads are reused by another prompt before it ends. The store
    must hold A's bytes under A's keys: a later restore of A is exact."""
    a, b = random_prompts(model, 3, [640, 640])
    ref_a, ref_b = await cold_prefills(model, [a, b])
    san = PoolSanitizer()
    store = FaultyStore(MemoryStore(), model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=4 << 20)
    async with Engine(san.model(model), cfg, store=san.store(store)) as engine:
        san.attach(engine.pool)
        gate = threading.Event()
        put = store.gate("put", gate)
        (got_a,) = await engine.prefill([a])
        assert_exact([got_a], [ref_a])
        assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
        waiter = asyncio.create_task(engine.wait_offloads())
        await asyncio.sleep(0)  # the waiter starts waiting
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert engine.offloader.pending, "cancelling the wait stopped the offload"
        engine.drop_device_cache()
        (got_b,) = await engine.prefill([b])  # fills the pool; A's pages are still pinned
        assert_exact([got_b], [ref_b])
        gate.set()
        store.clear()
        report = await engine.wait_offloads()
        assert report.ok, report
        engine.drop_device_cache()
        (again,) = await engine.prefill([a])
        assert again.restored_tokens > 0
        assert_exact([again], [ref_a])
        await engine.wait_offloads()
        assert_quiescent(engine)
    san.check()


async def test_engine_close_waits_for_a_running_forward(model: HybridModel) -> None:
    """``Engine.close`` with a prefill still in its forward: the batch is
    aborted, its forward stopped at the next layer, and nothing is closed
    under it."""
    san, faulty = PoolSanitizer(), FaultyModel(model)
    gate = threading.Event()
    faulty.gate_at(3, gate)
    engine = Engine(san.model(faulty), EngineConfig(store="memory", pool_bytes=16 << 20))
    await engine.start()
    san.attach(engine.pool)
    task = asyncio.create_task(engine.prefill(random_prompts(model, 4, [900])))
    assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
    closing = asyncio.create_task(engine.close())
    done, _ = await asyncio.wait({closing}, timeout=HOLD_S)
    assert not done, "close returned while a forward still ran"
    gate.set()
    await asyncio.wait_for(closing, WAIT_S)
    with pytest.raises(Exception, match=r"closing|aborted"):
        await task
    san.check()


def test_the_sanitizer_catches_a_release_under_a_thread(model: HybridModel) -> None:
    """The sanitizer itself: a span over a page that is freed before the
    span ends is a violation, and the freed bytes are poisoned."""
    from layerlift.pools import UnifiedKVPool
    from layerlift.pools.spec import Component

    pool = UnifiedKVPool(model.spec, 4 << 20)
    san = PoolSanitizer()
    san.attach(pool)
    pages = pool.alloc(Component.FULL, 2)
    assert pages is not None
    ptr, size = pool.page_ptr(Component.FULL, int(pages[0])), pool.page_bytes(Component.FULL)
    with san.span("a test read", san.ranges([ptr], [size])):
        pass
    san.check()
    with san.span("a test read", san.ranges([ptr], [size])):
        pool.free(Component.FULL, pages[:1])
    with pytest.raises(SanitizerViolation, match="a test read"):
        san.check()
    assert bool((pool.page_view(Component.FULL, int(pages[0])) == 0xFF).all())


async def test_prepare_cancelled_while_waiting_for_offloads_leaks_nothing(
        model: HybridModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 5: PREPARE of a two-plan batch stored the first plan's
    restore transaction, then waited for the offloads to free room for the
    second and was cancelled there: the PREPAREd slots stayed allocated and
    pinned for good. Now the exit aborts every transaction never committed."""
    import layerlift.engine.batch_lifecycle as batch_mod

    a, b, c = random_prompts(model, 5, [600, 600, 600])
    store = FaultyStore(MemoryStore(), model.spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        await engine.prefill([a, b])
        await engine.wait_offloads()
        engine.drop_device_cache()
        gate = threading.Event()
        put = store.gate("put", gate)
        await engine.prefill([c])  # its put holds at the gate: an offload is pending
        assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
        real_alloc, calls = batch_mod.alloc_compute, {"n": 0}

        def second_does_not_fit(*args: Any) -> Any:
            calls["n"] += 1
            return None if calls["n"] == 2 else real_alloc(*args)

        waiting = asyncio.Event()
        real_wait = engine.offloader.wait

        async def signalling_wait() -> Any:
            waiting.set()
            return await real_wait()

        monkeypatch.setattr(batch_mod, "alloc_compute", second_does_not_fit)
        monkeypatch.setattr(engine.offloader, "wait", signalling_wait)
        try:
            task = asyncio.create_task(engine.prefill([a, b]))
            await asyncio.wait_for(waiting.wait(), WAIT_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
        monkeypatch.undo()
        store.clear()
        await engine.wait_offloads()
        assert_quiescent(engine)
        ref = await cold_prefills(model, [a, b])
        got = await engine.prefill([a, b])
        assert all(r.restored_tokens > 0 for r in got)
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_abort_after_the_load_landed_keeps_the_restore(model: HybridModel) -> None:
    """Finding 4: an abort after COMMIT used to unpublish every restore,
    even ones that had landed in full. A restore that landed stays
    published (its bytes are whole): the next prefill hits it on the device."""
    (a,) = random_prompts(model, 6, [700])
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        (ref,) = await engine.prefill([a])
        await engine.wait_offloads()
        engine.drop_device_cache()
        plan = await engine.lookup(a)
        assert plan.restores
        handle = await engine.load([plan])
        readiness = handle.commit()
        for layer in range(readiness.num_layers):
            await readiness.ready(layer, timeout=WAIT_S)
        handle.abort()
        await handle.aclose()
        assert_quiescent(engine)
        (again,) = await engine.prefill([a])
        assert again.device_hit_tokens >= plan.restore_tokens > 0
        assert again.restored_tokens == 0
        assert_exact([again], [ref])
        await engine.wait_offloads()
        assert_quiescent(engine)


@pytest.mark.parametrize("seed", [0, 1])
async def test_concurrent_prefills_in_a_tight_pool_wait_for_room(model: HybridModel,
                                                                 seed: int) -> None:
    """Finding 8: concurrent prefills (the next batch PREPAREs while the
    previous one computes) in a pool that holds about one prompt: a prompt
    that fits alone used to be refused ("cannot fit ... even alone") because
    the batch in flight held the room. Every prompt is served, exactly."""
    from layerlift.engine.compute import compute_bytes
    from layerlift.engine.context import match_plan, release_plan

    rng = np.random.default_rng(seed)
    shared = rng.integers(0, model.vocab_size, 512, dtype=np.int64)
    batch = [np.concatenate([shared, rng.integers(0, model.vocab_size, int(n), dtype=np.int64)])
             if i % 2 else rng.integers(0, model.vocab_size, int(n) + 512, dtype=np.int64)
             for i, n in enumerate(rng.integers(300, 1400, 8))]
    ref = await cold_prefills(model, batch)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=64 << 20)) as probe:
        ctx = probe._ctx
        needs = []
        for p in batch:
            plan = match_plan(ctx, p)
            needs.append(compute_bytes(probe.pool, plan, boundary=0))
            release_plan(ctx, plan)
    pool_bytes = int(max(needs) * 1.3)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=pool_bytes)) as engine:
        first = await asyncio.gather(*(engine.prefill([p]) for p in batch))
        assert_exact([r for (r,) in first], ref)
        await engine.wait_offloads()
        engine.drop_device_cache()
        again = await asyncio.gather(*(engine.prefill([p]) for p in batch))
        assert_exact([r for (r,) in again], ref)
        assert sum(r.restored_tokens for (r,) in again) > 0
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_cancelled_server_aclose_returns_after_the_forward(model: HybridModel) -> None:
    """``Server.aclose`` cancelled while a batch's forward is held: it
    cancels the batcher and returns only once that forward returned; the
    engine then serves exactly."""
    from layerlift.engine.serve import Server

    (p,) = random_prompts(model, 7, [800])
    later = random_prompts(model, 8, [500, 700])
    ref = await cold_prefills(model, later)
    san, faulty = PoolSanitizer(), FaultyModel(model)
    async with Engine(san.model(faulty), EngineConfig(store="memory",
                                                       pool_bytes=16 << 20)) as engine:
        san.attach(engine.pool)
        gate = threading.Event()
        faulty.gate_at(5, gate)
        server = Server(engine)
        server.start()
        request = asyncio.create_task(server.submit(p))
        assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
        closing = asyncio.create_task(server.aclose())
        await asyncio.sleep(0)  # aclose starts waiting for the batcher
        await cancel_while_held(closing, closing.cancel, gate)
        with pytest.raises(asyncio.CancelledError):
            await closing
        with pytest.raises(BaseException):  # noqa: B017 -- cancelled or failed: either is fine
            await request
        faulty.clear()
        assert_quiescent(engine)
        got = [(await engine.prefill([q]))[0] for q in later]
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)
    san.check()


async def test_engine_close_waits_for_a_running_put(model: HybridModel) -> None:
    """``Engine.close`` while an offload's put is held: close waits for it
    (the pages stay pinned), and the store then holds exact objects."""
    (p,) = random_prompts(model, 9, [700])
    (ref,) = await cold_prefills(model, [p])
    inner = MemoryStore()
    store = FaultyStore(inner, model.spec)
    san = PoolSanitizer()
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    engine = Engine(san.model(model), cfg, store=san.store(store))
    await engine.start()
    san.attach(engine.pool)
    gate = threading.Event()
    put = store.gate("put", gate)
    await engine.prefill([p])
    assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
    closing = asyncio.create_task(engine.close())
    await cancel_while_held(closing, lambda: None, gate)
    await asyncio.wait_for(closing, WAIT_S)
    san.check()
    async with Engine(model, cfg, store=inner) as again:
        (got,) = await again.prefill([p])
        assert got.restored_tokens > 0
        assert_exact([got], [ref])
