"""Races of the engine's life cycle and of its waits (issue 32, items 4-8).

Each test failed before its fix: a prefill behind a step-by-step handle
whose load failed waited for ever; ``close()`` waited for a put stuck on a
stalled store; a prefill waiting for the load lock was served after
``close()``; ``close()`` during ``start()`` did nothing and two concurrent
starts opened two masters; a pipelined prefill failed while the previous
batch's forward simply ran longer than ``layer_wait_timeout_s``, with an
error blaming a handle that did not exist.

The store is a real Mooncake client where it matters (``mc_client`` /
``mc_tiny`` from ``tests/engine/conftest.py``); stalls are gates of
``FaultyStore`` / ``FaultyModel`` opened by the test; order comes from
events, never sleeps. A window in which a correct engine never returns
(``asyncio.wait(..., timeout=...)``) is the only timed part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from layerlift import Engine, EngineConfig, EngineError, HybridModel
from layerlift.engine import stores as engine_stores
from layerlift.engine.stores import StoreHandle
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.overlap.base import LayerLoadError
from layerlift.testing import FaultyModel, FaultyStore, assert_quiescent, offload_and_drop
from layerlift.testing.controls import spy_lock_wait
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts

WAIT_S = 30.0
BOUND_S = 0.5  # layer_wait_timeout_s of the tests that check a bound


def child_masters() -> set[int]:
    """Pids of mooncake_master processes whose parent is this test process."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
            name, ppid = head.split("(", 1)[1], int(tail.split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and name.startswith("mooncake_master"):
            pids.add(int(stat.parent.name))
    return pids


async def settled(readiness: Any) -> None:
    """Wait (in a thread) until every layer of ``readiness`` landed or failed."""
    def wait_all() -> None:
        for layer in range(readiness.num_layers):
            with contextlib.suppress(LayerLoadError):
                readiness.wait(layer, WAIT_S)

    await anyio.to_thread.run_sync(wait_all)
    assert readiness.settled()


def embedded_cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(store="embedded", pool_bytes=8 << 20, segment_bytes=32 << 20,
                        client_buffer_bytes=16 << 20, **kw)


# ---- 4. prefill's wait for the load lock has a bound ---------------------------------

async def test_prefill_behind_a_handle_whose_load_failed_is_bounded(
        tiny_model: HybridModel, mc_tiny: FaultyStore, namespace: str) -> None:
    """A handle whose restore failed at layer 2 keeps the load lock until it
    is forwarded or aborted. A prefill behind it raises ``EngineError``
    naming the handle within its bound (before: it waited for ever, while
    ``lookup()`` raised after the bound); the handle then still aborts and
    the prefill runs exactly."""
    a, b = random_prompts(tiny_model, 41, [640, 300])
    (ref_b,) = await cold_prefills(tiny_model, [b])
    cfg = EngineConfig(store="memory", namespace=namespace, pool_bytes=8 << 20,
                       layer_wait_timeout_s=BOUND_S)
    async with Engine(tiny_model, cfg, store=mc_tiny) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        mc_tiny.fail_layer(2)
        plan = await engine.lookup(a)
        assert plan.restores
        handle = await engine.load([plan])
        await settled(handle.readiness)
        assert engine._ctx.lock.locked(), "the failed load should keep the load lock"
        with pytest.raises(EngineError, match=r"requests \[\d+\].*kept the load lock"):
            async with asyncio.timeout(10.0):
                await engine.prefill([b])
        handle.abort()
        await handle.aclose()
        (got_b,) = await engine.prefill([b])
        assert_exact([got_b], [ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


# ---- 5. close() is bounded while a put is stuck -------------------------------------

async def test_close_returns_while_a_put_is_stuck_and_the_put_keeps_its_memory(
        tiny_model: HybridModel, mc_client: MooncakeStore, namespace: str) -> None:
    """A put held in the store (a stalled master) while ``close()`` runs:
    close returns within its bound (``store_timeout_s``) instead of waiting
    for the put; the pool stays registered for the put until it returned,
    the put lands, and then its thread unregisters the pool. A fresh engine
    restores the prefix exactly (the put's pages were whole)."""
    (prompt,) = random_prompts(tiny_model, 51, [640])
    (ref,) = await cold_prefills(tiny_model, [prompt])
    store = FaultyStore(mc_client, tiny_model.spec)
    store.timeout_s = 4 * WAIT_S  # the gate holds the put until the test opens it
    cfg = EngineConfig(store="memory", namespace=namespace, pool_bytes=8 << 20,
                       store_timeout_s=BOUND_S)
    engine = Engine(tiny_model, cfg, store=store)
    await engine.start()
    gate = threading.Event()
    put = store.gate("put", gate)
    try:
        await engine.prefill([prompt])
        assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
        with pytest.raises(TimeoutError):  # wait_offloads is bounded by its caller
            async with asyncio.timeout(BOUND_S):
                await engine.wait_offloads()
        pool_ptr = engine.pool.buffer.data_ptr()
        offloader = engine.offloader
        closing = asyncio.create_task(engine.close())
        done, _ = await asyncio.wait({closing}, timeout=WAIT_S)
        assert done, "close() waited for a put stuck in the store"
        await closing
        assert pool_ptr in mc_client._registered, "the pool was unregistered under a put"
        with pytest.raises(EngineError, match="closing or closed"):
            await engine.prefill([prompt])
    finally:
        gate.set()
    report = await offloader.wait()  # the put's thread has returned
    assert report.ok and report.objects > 0, report
    assert pool_ptr not in mc_client._registered, "the put's thread did not unregister the pool"
    async with Engine(tiny_model, cfg, store=mc_client) as fresh:
        (got,) = await fresh.prefill([prompt])
        assert got.restored_tokens > 0
        assert_exact([got], [ref])
        await fresh.wait_offloads()


# ---- 6. close() reaches a prefill waiting for the load lock ---------------------------

async def test_a_prefill_waiting_for_the_load_lock_fails_when_the_engine_closes(
        tiny_model: HybridModel, mc_tiny: FaultyStore, namespace: str) -> None:
    """A handle's restore is held at layer 1 (it keeps the load lock); a
    prefill waits for the lock; ``close()`` aborts the handle, whose exit
    hands the lock on. The prefill must raise ``EngineError`` (before: it
    looked up and was served after close had closed the lane and
    unregistered the pool), and nothing is left in flight."""
    a, b = random_prompts(tiny_model, 61, [640, 300])
    cfg = EngineConfig(store="memory", namespace=namespace, pool_bytes=8 << 20)
    engine = Engine(tiny_model, cfg, store=mc_tiny)
    await engine.start()
    gate = threading.Event()
    try:
        await engine.prefill([a])
        await offload_and_drop(engine)
        held = mc_tiny.gate_layer(1, gate)
        handle = await engine.load([await engine.lookup(a)])
        assert await anyio.to_thread.run_sync(held.started.wait, WAIT_S)
        waiting = spy_lock_wait(engine)
        behind = asyncio.create_task(engine.prefill([b]))
        await waiting.wait()
        closing = asyncio.create_task(engine.close())
        done, _ = await asyncio.wait({behind}, timeout=10.0)
        gate.set()  # the handle's fetch returns; its exit hands the lock on
        assert done, "the waiting prefill was not woken by close()"
        with pytest.raises(EngineError, match="clos"):
            await behind
        await closing
        assert not engine._ctx.live
        assert handle.state.value == "aborted"
    finally:
        gate.set()
        await engine.close()


async def test_a_prefill_waiting_for_a_stalled_put_fails_when_the_engine_closes(
        tiny_model: HybridModel) -> None:
    """A put held in the store pins the pages the next prompt needs; that
    prefill waits for the offloads (bounded by the default 120 s). ``close()``
    must end that wait at once with ``EngineError`` (before: the prefill
    waited out its bound, and close waited for the put)."""
    first, big = random_prompts(tiny_model, 62, [1500, 2600])
    store = FaultyStore(MemoryStore(), tiny_model.spec)
    store.timeout_s = 4 * WAIT_S  # the gate holds the put until the test opens it
    cfg = EngineConfig(store="memory", pool_bytes=6 << 20, store_timeout_s=BOUND_S)
    engine = Engine(tiny_model, cfg, store=store)
    await engine.start()
    gate = threading.Event()
    put = store.gate("put", gate)
    try:
        await engine.prefill([first])
        assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
        waiting = asyncio.Event()
        original = engine.offloader.wait

        async def spied() -> Any:
            waiting.set()
            return await original()

        engine.offloader.wait = spied  # type: ignore[method-assign]
        behind = asyncio.create_task(engine.prefill([big]))
        await waiting.wait()
        closing = asyncio.create_task(engine.close())
        done, _ = await asyncio.wait({behind, closing}, timeout=10.0,
                                     return_when=asyncio.ALL_COMPLETED)
        assert behind in done, "the prefill waiting for the offloads was not woken by close()"
        assert closing in done, "close() waited for the stalled put"
        with pytest.raises(EngineError, match="clos"):
            await behind
    finally:
        gate.set()
        await engine.close()
    await engine.offloader.wait()


# ---- 7. start and close as one state machine -----------------------------------------

async def test_close_during_start_closes_what_start_opened(
        tiny_model: HybridModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` while ``start()`` opens the embedded store (its thread held
    just after the master and the client came up): the start raises
    ``EngineError``, no master is left, and the engine serves nothing
    (before: close returned at once and the start then opened an engine
    that served with its master alive)."""
    opened, gate = threading.Event(), threading.Event()
    real_open = engine_stores.open_store

    def held_open(cfg: EngineConfig, cancel: threading.Event | None = None) -> StoreHandle:
        handle = real_open(cfg, cancel)
        opened.set()
        gate.wait(WAIT_S)
        return handle

    monkeypatch.setattr(engine_stores, "open_store", held_open)
    before = child_masters()
    engine = Engine(tiny_model, embedded_cfg())
    starting = asyncio.create_task(engine.start())
    try:
        assert await anyio.to_thread.run_sync(opened.wait, WAIT_S)
        closing = asyncio.create_task(engine.close())
        await asyncio.sleep(0)  # close() has begun (it is the next task to run)
    finally:
        gate.set()
    try:
        with pytest.raises(EngineError, match="closed while it started"):
            await starting
        await closing
        assert not child_masters() - before, "close() during start() left a master running"
        with pytest.raises(EngineError, match="closing or closed"):
            await engine.prefill([[1, 2, 3]])
        await engine.start()  # a closed engine starts again
    finally:
        await engine.close()
    assert not child_masters() - before


async def test_two_concurrent_starts_open_once(tiny_model: HybridModel) -> None:
    """Two ``start()`` at once: the second joins the first (one master, one
    client); the engine serves, and ``close()`` closes it cleanly (before:
    two masters, and close raised ``StoreError: ... not registered``)."""
    before = child_masters()
    engine = Engine(tiny_model, embedded_cfg())
    try:
        await asyncio.gather(engine.start(), engine.start())
        assert len(child_masters() - before) == 1, "two starts opened two masters"
        (got,) = await engine.prefill([list(range(1, 200))])
        assert got.computed_tokens > 0
        with pytest.raises(RuntimeError, match="started already"):
            await engine.start()
    finally:
        await engine.close()
    assert not child_masters() - before


# ---- 8. the device wait bounds only a holder that waits for its caller ----------------

async def test_a_pipelined_prefill_waits_for_a_long_forward(tiny_model: HybridModel) -> None:
    """Prefill B waits for the device while prefill A's forward runs longer
    than ``layer_wait_timeout_s`` (held at layer 2): B must wait, not fail
    (before: ``EngineError`` blaming a step-by-step handle that did not
    exist); both results are exact."""
    a, b = random_prompts(tiny_model, 81, [300, 310])
    ref_a, ref_b = await cold_prefills(tiny_model, [a, b])
    faulty, gate = FaultyModel(tiny_model), threading.Event()
    faulty.gate_at(2, gate)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(faulty, cfg) as engine:
        first = asyncio.create_task(engine.prefill([a]))
        try:
            assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
            faulty.clear()  # B's forward runs through
            second = asyncio.create_task(engine.prefill([b]))
            done, _ = await asyncio.wait({second}, timeout=8 * BOUND_S)
            assert not done, f"B gave up behind a running forward: {second.exception()!r}"
        finally:
            gate.set()
        (got_a,), (got_b,) = await first, await second
        assert_exact([got_a, got_b], [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_prefill_waiting_for_room_waits_for_a_long_forward(
        tiny_model: HybridModel) -> None:
    """Prefill B does not fit beside prefill A's pages while A's forward runs
    (held at layer 2) longer than ``layer_wait_timeout_s``: B waits for A's
    exit instead of failing with "the room stayed held" (before: EngineError
    after the bound), and both results are exact."""
    a, b = random_prompts(tiny_model, 83, [2600, 1500])
    ref_a, ref_b = await cold_prefills(tiny_model, [a, b])
    faulty, gate = FaultyModel(tiny_model), threading.Event()
    faulty.gate_at(2, gate)
    cfg = EngineConfig(store="memory", pool_bytes=6 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(faulty, cfg) as engine:
        first = asyncio.create_task(engine.prefill([a]))
        try:
            assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
            faulty.clear()
            room = engine._ctx.room
            second = asyncio.create_task(engine.prefill([b]))
            done, _ = await asyncio.wait({second}, timeout=8 * BOUND_S)
            assert not done, f"B gave up behind a running forward: {second.exception()!r}"
            assert not room.is_set() and engine._ctx.room_waiters, "B did not wait for room"
        finally:
            gate.set()
        (got_a,), (got_b,) = await first, await second
        assert_exact([got_a, got_b], [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_the_device_wait_names_the_handle_that_holds_it(tiny_model: HybridModel) -> None:
    """A handle loaded but never forwarded holds the device: a prefill behind
    it raises ``EngineError`` after the bound naming that handle's requests
    (before: a message about "a step-by-step handle" that named nothing)."""
    a, b = random_prompts(tiny_model, 82, [300, 300])
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(tiny_model, cfg) as engine:
        plan = await engine.lookup(a)
        handle = await engine.load([plan])
        with pytest.raises(EngineError, match=rf"requests \[{plan.request_id}\] \(loaded step "
                                              r"by step.*kept the device"):
            async with asyncio.timeout(WAIT_S):
                await engine.prefill([b])
        handle.abort()
        await handle.aclose()
        await engine.wait_offloads()
        assert_quiescent(engine)
