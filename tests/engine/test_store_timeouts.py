"""Store timeouts with the call still running, through the engine (issue 21).

A store call that times out goes on: a stopped master resumes and the call
then reads (put) or writes (ranged read) the memory it was lent. The engine
must keep that memory (pins, restore slots, staging, the registered host
copy) until the call really ended. Fault table: the store stalls at one call
(``exists``, the session start, a layer's ranged read, the offload's put) for
longer than its timeout, then resumes; every case is exact, quiescent, and
the next prefill restores exactly. Reproduction 1 of the issue runs on the
in-process store and on a real ``mooncake_master`` stopped with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

import anyio
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store, StoreTimeout
from layerlift.testing import FaultyStore, assert_quiescent, offload_and_drop
from layerlift.testing.faults import ProcessStall
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts

KL_TOL = 1e-6
HOLD_S = 0.5  # how long a broken engine gets to return early (a correct one never does)
WAIT_S = 30.0
POOL = 32 << 20


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def pinned(engine: Engine) -> int:
    """Pages pinned in the engine's pool (restores, offloads, held reads)."""
    return sum(int((a.pins > 0).sum()) for a in engine.pool.core.chain)


async def settle(exc: StoreTimeout | None) -> None:
    """Wait until a timed-out call really ended, then let the loop run the
    release it queued (a few turns, no wall-clock sleep)."""
    assert exc is not None and exc.future is not None
    future = exc.future
    await anyio.to_thread.run_sync(lambda: concurrent.futures.wait([future], WAIT_S))
    assert future.done(), "the timed-out read never ended"
    for _ in range(20):
        await asyncio.sleep(0)


def engine_cfg() -> EngineConfig:
    return EngineConfig(store="memory", pool_bytes=POOL, layer_wait_timeout_s=WAIT_S)


# ---- the fault table: the store stalls at one call --------------------------------------
STALL_AT = ["exists", "open_session", "get_ranges", "put_parts"]


@pytest.mark.parametrize("method", STALL_AT)
async def test_store_stalls_past_its_timeout_at_one_call(model: HybridModel, method: str) -> None:
    a, b, c = random_prompts(model, 1, [300, 280, 320])
    ref = await cold_prefills(model, [a, b, c])
    store = MemoryStore(timeout_s=0.3)
    async with Engine(model, engine_cfg(), store=store) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        store.stall_when(method)
        task = asyncio.ensure_future(engine.prefill([a, b]))
        try:
            assert await anyio.to_thread.run_sync(store.timed_out.wait, WAIT_S)
            if method == "get_ranges":
                # The layer recomputes at once; the read still writes into A's
                # restore slots, which stay pinned while it runs: a prompt
                # computed meanwhile gets other pages.
                got = await task
                (rc,) = await engine.prefill([c])
                assert_exact([rc], ref[2:])
        finally:
            store.resume()
        if method == "get_ranges":
            assert await anyio.to_thread.run_sync(store.wait_idle, WAIT_S)
            for _ in range(20):  # the release is queued on the loop
                await asyncio.sleep(0)
            (rc,) = await engine.prefill([c])  # a device hit on pages the read never touched
            assert rc.device_hit_tokens > 0
            assert_exact([rc], ref[2:])
        got = await task
        assert_exact(got, ref[:2])
        if method in ("exists", "open_session", "get_ranges"):
            assert got[0].restored_tokens == 0 or not got[0].recomputed_after_failure
        report = await engine.wait_offloads()
        # a put that timed out landed later (counted), or failed: never both
        assert set(report.failures) <= {"StoreTimeout"}, report
        assert_quiescent(engine)
        await offload_and_drop(engine, expect_ok=False)
        assert_exact(await engine.prefill([a, b]), ref[:2])  # puts what failed, if anything
        failed = report.failed
        await offload_and_drop(engine, expect_ok=False)
        assert engine.offloader.report.failed == failed, engine.offloader.report
        again = await engine.prefill([a, b])
        assert_exact(again, ref[:2])
        assert all(r.restored_tokens > 0 and not r.recomputed_after_failure for r in again), \
            [(r.restored_tokens, r.fallback_reason) for r in again]


async def test_a_timed_out_read_keeps_its_slots_pinned_until_it_ended(
        model: HybridModel) -> None:
    """A reader engine (no offloads of its own, so its pins are the held
    read's only): layer 0's read stalls past its timeout, the batch
    recomputes and returns at once, the restore slots the read still writes
    stay pinned; once the read ended they are released and the engine is
    quiescent."""
    a, c = random_prompts(model, 4, [300, 320])
    ref = await cold_prefills(model, [a, c])
    store = MemoryStore(timeout_s=0.3)
    async with Engine(model, engine_cfg(), store=store) as writer:
        await writer.prefill([a])
        await writer.wait_offloads()
    cfg = EngineConfig(store="memory", pool_bytes=POOL, offload=False,
                       layer_wait_timeout_s=WAIT_S)
    async with Engine(model, cfg, store=store) as engine:
        store.stall_when("get_ranges")
        try:
            (got,) = await engine.prefill([a])
            assert got.recomputed_after_failure and store.timed_out.is_set()
            assert_exact([got], ref[:1])
            assert pinned(engine) > 0, "the slots were released while the read still ran"
            (rc,) = await engine.prefill([c])
            assert_exact([rc], ref[1:])
        finally:
            store.resume()
        assert await anyio.to_thread.run_sync(store.wait_idle, WAIT_S)
        for _ in range(20):  # the release is queued on the loop
            await asyncio.sleep(0)
        assert pinned(engine) == 0
        assert_quiescent(engine)
        (rc,) = await engine.prefill([c])
        assert rc.device_hit_tokens > 0
        assert_exact([rc], ref[1:])


# ---- reproduction 1: a put that times out must not land later with other bytes ----------
class PutWatch(FaultyStore):
    """Sets ``put_timed_out`` when a put raises StoreTimeout."""

    def __init__(self, inner: Store, spec: ModelSpec) -> None:
        super().__init__(inner, spec)
        self.put_timed_out = threading.Event()

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        try:
            super().put_parts(keys, ptrs, sizes)
        except StoreTimeout:
            self.put_timed_out.set()
            raise


async def reproduce_late_put(model: HybridModel, store: PutWatch, stop: Callable[[], None],
                             resume: Callable[[], None]) -> None:
    """Prefill A while the store is stopped (its put times out), empty the
    device cache, prefill B (into the pages A's put would read if they were
    released), resume: A must then restore exactly, with no failed layer
    (the put landed with A's bytes) and the report must count it landed."""
    a, b, warm = random_prompts(model, 7, [192 + 40, 400, 100])
    ref = await cold_prefills(model, [a, b])
    async with Engine(model, engine_cfg(), store=store) as engine:
        await engine.prefill([warm])  # a running engine: its scratch arena is registered
        await offload_and_drop(engine)
        stop()
        try:
            assert_exact([(await engine.prefill([a]))[0]], ref[:1])
            assert await anyio.to_thread.run_sync(store.put_timed_out.wait, WAIT_S)
            engine.drop_device_cache()
            # the timed-out put still owns A's pages: its node stays locked
            assert engine.tree.stats().locked_nodes > 0, \
                "A's pages were released while its put still ran"
            assert_exact([(await engine.prefill([b]))[0]], ref[1:])
        finally:
            resume()
        report = await engine.wait_offloads()
        assert report.late >= 1, report
        assert_quiescent(engine)
        await offload_and_drop(engine, expect_ok=False)
        got = (await engine.prefill([a]))[0]
        assert_exact([got], ref[:1])
        assert got.restored_tokens >= 192 and not got.recomputed_after_failure, \
            (got.restored_tokens, got.fallback_reason)


async def test_late_put_lands_with_its_own_bytes_memory(model: HybridModel) -> None:
    mem = MemoryStore(timeout_s=0.3)
    await reproduce_late_put(model, PutWatch(mem, model.spec), mem.stall, mem.resume)


@pytest.fixture(scope="module")
def stoppable_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master of this module's own: SIGSTOP must not stall other tests."""
    log = tmp_path_factory.mktemp("stall-engine") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.mark.mooncake
async def test_late_put_lands_with_its_own_bytes_stalled_master(
        model: HybridModel, stoppable_master: EmbeddedMaster) -> None:
    """Reproduction 1 on a real master: ``store_timeout_s=0.5``, the master
    stopped (SIGSTOP) while A's put runs, resumed (SIGCONT) after B."""
    assert stoppable_master.pid is not None
    stall = ProcessStall(stoppable_master.pid)
    client = MooncakeStore(stoppable_master.config(
        global_segment_size=64 << 20, local_buffer_size=16 << 20, timeout_s=0.5))
    try:
        store = PutWatch(client, model.spec)
        # a namespace of its own: the keys of this test never meet another's
        cfg = engine_cfg()
        object.__setattr__(cfg, "namespace", f"stall-{uuid.uuid4().hex[:8]}")
        await reproduce_late_put(model, store, stall.stop, stall.resume)
    finally:
        stall.release()
        client.close()


class ReadWatch(FaultyStore):
    """Sets ``read_timed_out`` when a ranged read raises StoreTimeout."""

    def __init__(self, inner: Store, spec: ModelSpec) -> None:
        super().__init__(inner, spec)
        self.read_timed_out = threading.Event()
        self.timeout: StoreTimeout | None = None

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        try:
            super().get_ranges(keys, dst_ptrs, sizes, src_offsets)
        except StoreTimeout as exc:
            self.timeout = exc
            self.read_timed_out.set()
            raise


@pytest.fixture(scope="module")
def store_node(stoppable_master: EmbeddedMaster,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    """A storage node (``layerlift store-node``, 64 MiB) in its own process:
    the engine's client contributes no memory, so every read goes to it."""
    node = subprocess.Popen(
        [sys.executable, "-m", "layerlift.cli", "store-node",
         "--master", stoppable_master.master_address,
         "--metadata", stoppable_master.metadata_url, "--bytes", "64M"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        cwd=tmp_path_factory.mktemp("node"), env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    try:
        assert node.stdout is not None
        line = node.stdout.readline()
        assert line.startswith(b"ready"), line
        yield node
    finally:
        os.kill(node.pid, signal.SIGCONT)
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


@pytest.mark.mooncake
async def test_a_layer_read_from_a_stalled_node_keeps_its_slots(
        model: HybridModel, stoppable_master: EmbeddedMaster,
        store_node: subprocess.Popen[bytes]) -> None:
    """Layer 3's ranged read is held at a gate, the storage node that holds
    the objects is stopped (SIGSTOP), the gate opens: the read times out but
    runs on. The batch recomputes and ends at once, but the restore slots
    the read writes into stay pinned until the node resumed (SIGCONT) and
    the read ended: a prompt computed meanwhile gets other pages and its
    later device hit is exact; the next prefill restores exactly."""
    a, c = random_prompts(model, 9, [300, 320])
    ref = await cold_prefills(model, [a, c])
    client = MooncakeStore(stoppable_master.config(
        global_segment_size=0, local_buffer_size=16 << 20, timeout_s=0.5))
    stopped = False
    try:
        store = ReadWatch(client, model.spec)
        async with Engine(model, engine_cfg(), store=store) as writer:
            await writer.prefill([a])
            await writer.wait_offloads()
        # a reader with no offloads of its own: its pins are the held read's only
        reader = EngineConfig(store="memory", pool_bytes=POOL, offload=False,
                              layer_wait_timeout_s=WAIT_S)
        async with Engine(model, reader, store=store) as engine:
            gate = threading.Event()
            fault = store.gate_layer(3, gate)
            task = asyncio.ensure_future(engine.prefill([a]))
            try:
                assert await anyio.to_thread.run_sync(fault.started.wait, WAIT_S)
                os.kill(store_node.pid, signal.SIGSTOP)
                stopped = True
                gate.set()
                assert await anyio.to_thread.run_sync(store.read_timed_out.wait, WAIT_S)
                got = await task
                assert_exact(got, ref[:1])
                assert pinned(engine) > 0, "A's slots were released while its read still ran"
                (rc,) = await engine.prefill([c])
                assert_exact([rc], ref[1:])
            finally:
                gate.set()
                if stopped:
                    os.kill(store_node.pid, signal.SIGCONT)
                    stopped = False
            await settle(store.timeout)
            (rc,) = await engine.prefill([c])  # a device hit on pages the read never touched
            assert rc.device_hit_tokens > 0
            assert_exact([rc], ref[1:])
            assert pinned(engine) == 0
            store.clear()
            engine.drop_device_cache()
            engine.pool.buffer.zero_()
            (again,) = await engine.prefill([a])
            assert_exact([again], ref[:1])
            assert again.restored_tokens > 0 and not again.recomputed_after_failure
            assert_quiescent(engine)
    finally:
        if stopped:
            os.kill(store_node.pid, signal.SIGCONT)
        client.close()
