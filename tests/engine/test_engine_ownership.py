"""Starting and closing an engine own what they open, under failure and
cancellation.

``close()`` is cancelled at each of its awaits (a batch's forward, an
offload's put, the store's own close): it must still wait for what it was
waiting for before it closes the lane, unregisters the pool or stops the
store and master, and raise the cancellation after that. Before, a
``wait_for(engine.close(), 0.2)`` with a put in flight unregistered the
pool under the put (the prefix was lost; against Mooncake the transfer read
memory being unregistered). A failed or cancelled ``start()`` left the
store client and the embedded master running.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine import api as engine_api
from layerlift.engine import stores as engine_stores
from layerlift.engine.stores import StoreHandle
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import Store
from layerlift.testing import FaultyModel, FaultyStore, assert_quiescent
from layerlift.testing.controls import cancel_while_held
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts
from layerlift.testing.sanitizer import PoolSanitizer

WAIT_S = 30.0


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def child_masters() -> list[int]:
    """Pids of this process's mooncake_master children still alive."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
            fields = rest.split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and "mooncake_master" in name:
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(params=["memory", "mooncake"])
def shared_store(request: pytest.FixtureRequest) -> Store:
    """One store two engines share (injected: the engines do not close it):
    in-process, or a real Mooncake client (``mc_client``)."""
    if request.param == "memory":
        return MemoryStore()
    store: Store = request.getfixturevalue("mc_client")
    return store


@pytest.mark.mooncake
async def test_a_cancelled_close_lands_the_put_in_flight(model: HybridModel,
                                                        shared_store: Store) -> None:
    """``wait_for(engine.close(), 0.2)`` while the offload's put is held: the
    close waits for the put, then unregisters; the timeout is raised after.
    A second engine on the same store restores the prefix exactly."""
    prompt = random_prompts(model, 21, [640])[0]
    (ref,) = await cold_prefills(model, [prompt])
    san = PoolSanitizer()
    faulty = FaultyStore(shared_store, model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20, namespace="close-put")
    engine = Engine(model, cfg, store=san.store(faulty))
    await engine.start()
    san.attach(engine.pool)
    gate = threading.Event()
    put = faulty.gate("put", gate)
    await engine.prefill([prompt])
    assert await anyio.to_thread.run_sync(put.started.wait, WAIT_S)
    closing = asyncio.create_task(asyncio.wait_for(engine.close(), 0.2))
    await cancel_while_held(closing, lambda: None, gate)
    with pytest.raises(TimeoutError):
        await closing
    assert engine.offloader.report.ok, engine.offloader.report
    san.check()
    async with Engine(model, cfg, store=shared_store) as second:
        (again,) = await second.prefill([prompt])
        assert again.restored_tokens > 0
        assert_exact([again], [ref])
        await second.wait_offloads()
        assert_quiescent(second)


async def test_a_cancelled_close_waits_for_the_forward(model: HybridModel) -> None:
    """``close()`` cancelled while a prefill's forward is held: it returns
    only after the forward stopped and the batch exited, then raises the
    cancellation; the sanitizer saw nothing freed under the forward."""
    prompt = random_prompts(model, 22, [640])[0]
    san, faulty = PoolSanitizer(), FaultyModel(model)
    gate = threading.Event()
    faulty.gate_at(3, gate)
    engine = Engine(san.model(faulty), EngineConfig(store="memory", pool_bytes=8 << 20))
    await engine.start()
    san.attach(engine.pool)
    prefill = asyncio.create_task(engine.prefill([prompt]))
    assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
    closing = asyncio.create_task(engine.close())
    await asyncio.sleep(0)
    await cancel_while_held(closing, closing.cancel, gate)
    with pytest.raises(asyncio.CancelledError):
        await closing
    with pytest.raises(Exception, match=r"closing|aborted"):
        await prefill
    assert san.checked > 0
    san.check()


async def test_a_cancelled_close_still_stops_the_master(model: HybridModel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` cancelled while the embedded store and master are being
    closed: the close goes on to the end (no master left), then raises."""
    entered, gate = threading.Event(), threading.Event()
    real_close = StoreHandle.close

    def held_close(self: StoreHandle) -> None:
        entered.set()
        gate.wait(WAIT_S)
        real_close(self)

    monkeypatch.setattr(StoreHandle, "close", held_close)
    engine = Engine(model, EngineConfig(store="embedded", pool_bytes=8 << 20,
                                        segment_bytes=32 << 20, client_buffer_bytes=16 << 20))
    before = set(child_masters())
    await engine.start()
    assert set(child_masters()) - before, "the embedded master did not start"
    closing = asyncio.create_task(engine.close())
    assert await anyio.to_thread.run_sync(entered.wait, WAIT_S)
    await cancel_while_held(closing, closing.cancel, gate)
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not set(child_masters()) - before, "the embedded master is still running"


async def test_a_failed_start_leaves_no_master(model: HybridModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure after the store opened")

    monkeypatch.setattr(engine_api, "make_linkers", broken)
    before = set(child_masters())
    engine = Engine(model, EngineConfig(store="embedded", pool_bytes=8 << 20,
                                        segment_bytes=32 << 20, client_buffer_bytes=16 << 20))
    with pytest.raises(RuntimeError, match="injected failure"):
        await engine.start()
    assert not set(child_masters()) - before, "a failed start left its master running"
    await engine.close()  # a no-op: nothing is open


@pytest.mark.parametrize("how", ["task.cancel", "timeout"])
async def test_a_cancelled_start_leaves_no_master(model: HybridModel, how: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the store opens (its thread held just after the open
    succeeded): what it opened is closed before the cancellation is raised."""
    opened, gate = threading.Event(), threading.Event()
    real_open = engine_stores.open_store

    def held_open(cfg: EngineConfig, cancel: threading.Event | None = None) -> StoreHandle:
        handle = real_open(cfg, cancel)  # the open succeeded before the cancellation
        opened.set()
        gate.wait(WAIT_S)
        return handle

    monkeypatch.setattr(engine_stores, "open_store", held_open)
    before = set(child_masters())
    engine = Engine(model, EngineConfig(store="embedded", pool_bytes=8 << 20,
                                        segment_bytes=32 << 20, client_buffer_bytes=16 << 20))
    box: dict[str, Any] = {}

    async def timed() -> None:
        async with asyncio.timeout(None) as cm:
            box["cm"] = cm
            await engine.start()

    task = asyncio.create_task(engine.start() if how == "task.cancel" else timed())
    assert await anyio.to_thread.run_sync(opened.wait, WAIT_S)
    loop = asyncio.get_running_loop()
    await cancel_while_held(
        task, task.cancel if how == "task.cancel" else lambda: box["cm"].reschedule(loop.time()),
        gate)
    with pytest.raises(asyncio.CancelledError if how == "task.cancel" else TimeoutError):
        await task
    assert not set(child_masters()) - before, "a cancelled start left its master running"
    with pytest.raises(RuntimeError, match="not started"):
        await engine.prefill([[1, 2, 3]])
