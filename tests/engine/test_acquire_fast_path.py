"""``EngineContext.acquire``: a free lock is taken at once, a queued one in order.

Every batch takes the load lock (lookup) and the device (issue) through
``acquire``. A free lock with nobody queued is taken without a task or a
wait: no event-loop pass (on a fleet of engines sharing one loop, each pass
waits for every other ready callback). A lock that a queued caller was just
handed is not taken past that caller, and a caller queued behind it still
gets ``EngineError`` at once when the engine closes (a plain
``lock.acquire()`` there would wait unwatched and return the lock after
``close()`` began).

Order comes from events and the loop's own callback queue, never sleeps.
"""

from __future__ import annotations

import asyncio

import pytest

from layerlift import Engine, EngineConfig, EngineError, HybridModel
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing.controls import spy_lock_wait

WAIT_S = 30.0


def _cfg() -> EngineConfig:
    return EngineConfig(store="memory", pool_bytes=8 << 20, offload=False)


async def test_a_free_lock_is_taken_without_an_event_loop_pass(
        tiny_model: HybridModel) -> None:
    async with Engine(tiny_model, _cfg(), store=MemoryStore()) as engine:
        ctx = engine._ctx
        for lock in (ctx.lock, ctx.device):
            ran: list[str] = []
            asyncio.get_running_loop().call_soon(ran.append, "a loop pass")
            await ctx.acquire(lock, None, "the test")
            try:
                # Failed before: two tasks and an asyncio.wait, three passes.
                assert ran == [], "acquire of a free lock let the event loop run"
                assert lock.locked()
            finally:
                lock.release()


async def test_a_lock_handed_to_a_queued_caller_is_not_taken_past_it(
        tiny_model: HybridModel) -> None:
    async with Engine(tiny_model, _cfg(), store=MemoryStore()) as engine:
        ctx = engine._ctx
        await ctx.acquire(ctx.lock, None, "the holder")
        queued = spy_lock_wait(engine)
        order: list[str] = []

        async def take(name: str) -> None:
            await ctx.acquire(ctx.lock, None, name)
            order.append(name)
            ctx.lock.release()

        first = asyncio.create_task(take("first"))
        await asyncio.wait_for(queued.wait(), WAIT_S)
        ctx.lock.release()  # handed to "first", which has not run yet
        assert not ctx.lock.locked()
        await take("second")  # queued behind "first" (it was handed the lock)
        await asyncio.wait_for(first, WAIT_S)
        assert order == ["first", "second"]
        assert not ctx.lock.locked()


async def test_a_caller_queued_behind_a_handed_lock_fails_at_once_on_close(
        tiny_model: HybridModel) -> None:
    engine = Engine(tiny_model, _cfg(), store=MemoryStore())
    await engine.start()
    try:
        ctx = engine._ctx
        await ctx.acquire(ctx.lock, None, "the holder")
        queued = spy_lock_wait(engine)
        first = asyncio.create_task(ctx.acquire(ctx.lock, None, "first"))
        await asyncio.wait_for(queued.wait(), WAIT_S)
        ctx.lock.release()  # handed to "first", which has not run yet
        # The close runs on the next loop pass, once this caller waits behind "first".
        asyncio.get_running_loop().call_soon(ctx.begin_close)
        with pytest.raises(EngineError, match="closing"):
            await ctx.acquire(ctx.lock, None, "second")  # failed with a plain lock.acquire()
        with pytest.raises(EngineError, match="closing"):
            await asyncio.wait_for(first, WAIT_S)
        assert not ctx.lock.locked(), "a caller kept the load lock after close() began"
    finally:
        await engine.close()
