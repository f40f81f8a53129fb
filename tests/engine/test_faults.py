"""Fault injection over the public API, in every call order, on the in-process
store and on a real Mooncake master, in the pool sanitizer's checking mode
(``layerlift.testing.sanitizer``: nothing released under a running thread).

An exhaustive table: every call order a user can drive (``prefill``;
``lookup → load → commit → forward``; ``lookup → load → abort`` before and
after COMMIT; ``lookup → release_plan``) crossed with every fault point
(``exists``, entering the read session, each layer's read, the forward
raising, offload ``put``, and cancellation at each await: the lookup, the
session, a layer in flight, the forward at its first, a middle and its last
layer, the session's close — each as an anyio-style cancel, as a plain
``task.cancel()`` and as an ``asyncio.timeout`` while the thread is held
there). Every case
checks that results are exact (or a clear exception was raised), that the
engine is quiescent afterwards (lock free, no pins, no locked or pending
nodes, accounting and integrity), and that a clean prefill then restores
exactly. The pool is zeroed before each restoring run, so a restore that
reads a slot it never loaded cannot pass by finding old bytes.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, EngineError, HybridModel, ModelSpec
from layerlift.engine.results import PrefillResult
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store, StoreIOError, StoreKeyMissing, StoreUnavailable
from layerlift.testing import (
    FaultyModel,
    FaultyStore,
    InjectedForwardError,
    assert_quiescent,
    kl_divergence,
    offload_and_drop,
)
from layerlift.testing.sanitizer import PoolSanitizer

KL_TOL = 1e-6
WAIT_S = 30.0
ORDERS = ("prefill", "steps", "abort_before_commit", "abort_after_commit", "release_plan")
RESULT_ORDERS = ("prefill", "steps")
LAYERS = 8  # the tiny preset


@dataclass(frozen=True)
class Fault:
    kind: str  # none | exists | session | layer | forward | put | cancel
    layer: int | None = None
    at: str | None = None  # cancel point
    # How a cancellation arrives: "anyio" (cancel, then the gate opens at
    # once), "held" (plain ``task.cancel()`` while the thread stays held at
    # the gate for HOLD_S: the call must not return meanwhile), "timeout"
    # (an ``asyncio.timeout`` expiring while the thread is held).
    how: str | None = None

    @property
    def name(self) -> str:
        return "-".join(str(x) for x in (self.kind, self.at, self.layer, self.how)
                        if x is not None)


FAULTS = [
    Fault("none"),
    Fault("exists"),
    Fault("session"),
    *[Fault("layer", layer=i) for i in range(LAYERS)],
    Fault("forward", layer=0),
    Fault("forward", layer=LAYERS - 1),
    Fault("put"),
    *[Fault("cancel", at=at, layer=layer, how=how)
      for how in ("anyio", "held", "timeout")
      for at, layer in (("exists", None), ("session_enter", None), ("layer", 3),
                        ("forward", 0), ("forward", 2), ("forward", LAYERS - 1),
                        ("session_exit", None))
      if how != "anyio" or layer not in (0, LAYERS - 1)],
]
HOLD_S = 0.25  # how long a held thread keeps a broken engine's cancelled call returning early
_REACHES = {
    "exists": set(ORDERS),
    "session_enter": set(ORDERS) - {"release_plan"},
    "layer": set(RESULT_ORDERS),  # an abort may stop the load before the gated layer
    "forward": set(RESULT_ORDERS),
    "session_exit": set(ORDERS) - {"release_plan"},
}
CASES = [(o, f) for o in ORDERS for f in FAULTS
         if f.kind != "cancel" or o in _REACHES[f.at or ""]]


# ---- fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def batch(model: HybridModel) -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    return [rng.integers(0, model.vocab_size, n, dtype=np.int64) for n in (300, 260)]


@pytest.fixture(scope="module")
def cold(model: HybridModel, batch: list[np.ndarray]) -> list[PrefillResult]:
    async def run() -> list[PrefillResult]:
        cfg = EngineConfig(store="memory", offload=False, pool_bytes=16 << 20)
        async with Engine(model, cfg) as engine:
            return await engine.prefill(batch)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def mc_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    """One real Mooncake client for the module's cases (keys are namespaced per case)."""
    log = tmp_path_factory.mktemp("faults-mooncake") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        store = MooncakeStore(master.config(global_segment_size=64 << 20,
                                            local_buffer_size=16 << 20, timeout_s=10.0))
        try:
            yield store
        finally:
            store.close()


class _Unclosed(Store):
    """Forwards to a shared store but never closes it (the fixture does)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.timeout_s = inner, inner.timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register(self, buffer: Any, nbytes: int | None = None) -> int:
        return self.inner.register(buffer, nbytes)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def exists(self, keys: Any) -> list[bool]:
        return self.inner.exists(keys)

    def put(self, keys: Any, ptrs: Any, sizes: Any) -> None:
        self.inner.put(keys, ptrs, sizes)

    def put_parts(self, keys: Any, ptrs: Any, sizes: Any) -> None:
        self.inner.put_parts(keys, ptrs, sizes)

    def get(self, keys: Any, ptrs: Any, sizes: Any) -> list[bool]:
        return self.inner.get(keys, ptrs, sizes)

    def get_ranges(self, keys: Any, dst_ptrs: Any, sizes: Any, src_offsets: Any) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

    def open_session(self, keys: Any) -> Any:
        return self.inner.open_session(keys)

    def remove(self, keys: Any) -> None:
        self.inner.remove(keys)

    def close(self) -> None:
        return None


# ---- driving the public API -------------------------------------------------------------
async def run_order(engine: Engine, order: str, prompts: list[np.ndarray],
                    box: dict[str, Any]) -> list[PrefillResult] | None:
    """Drive one call order; keeps the handle in ``box`` for the test."""
    if order == "prefill":
        return await engine.prefill(prompts)
    plans = []
    try:
        for p in prompts:
            plans.append(await engine.lookup(p))
    except BaseException:
        for plan in plans:
            engine.release_plan(plan)
        raise
    if order == "release_plan":
        for plan in plans:
            engine.release_plan(plan)
        return None
    handle = await engine.load(plans)
    box["handle"] = handle
    if order == "steps":
        handle.commit()
        return await handle.forward()
    if order == "abort_after_commit":
        handle.commit()
    handle.abort()
    await handle.aclose()
    return None


async def timed(coro: Any, box: dict[str, Any]) -> Any:
    """``coro`` under an ``asyncio.timeout`` the test can make expire."""
    async with asyncio.timeout(None) as cm:
        box["timeout"] = cm
        return await coro


def arm(fault: Fault, store: FaultyStore, model: FaultyModel,
        gate: threading.Event) -> threading.Event | None:
    """Set the fault up; for a cancellation return the event its gate sets
    when something waits on it."""
    if fault.kind == "exists":
        store.fail_exists = StoreUnavailable("injected: exists failed")
    elif fault.kind == "session":
        store.fail_session = StoreKeyMissing("injected: a key was evicted since LOOKUP")
    elif fault.kind == "layer":
        assert fault.layer is not None
        store.fail_layer(fault.layer, StoreIOError(f"injected read failure at layer {fault.layer}"))
    elif fault.kind == "forward":
        assert fault.layer is not None
        model.fail_at(fault.layer)
    elif fault.kind == "put":
        store.fail_put = StoreIOError("injected: put failed")
    elif fault.kind == "cancel":
        if fault.at == "layer":
            assert fault.layer is not None
            return store.gate_layer(fault.layer, gate).started
        if fault.at == "forward":
            assert fault.layer is not None
            model.gate_at(fault.layer, gate)
            return model.reached
        assert fault.at is not None
        return store.gate(fault.at, gate).started
    return None


def assert_exact(got: list[PrefillResult], ref: list[PrefillResult]) -> None:
    kls = [kl_divergence(r.next_token_logprobs, g.next_token_logprobs)
           for g, r in zip(got, ref, strict=True)]
    assert max(kls) <= KL_TOL, f"results differ from a cold run: KL = {kls}"


def check_outcome(order: str, fault: Fault, out: list[PrefillResult] | None,
                  error: BaseException | None) -> None:
    """What each (order, fault) must produce: exact results that say where
    their tokens came from, or a clear exception."""
    if fault.kind == "cancel":
        expected = TimeoutError if fault.how == "timeout" else asyncio.CancelledError
        assert isinstance(error, expected), f"expected {expected.__name__}, got {error!r}"
        return
    if order not in RESULT_ORDERS:
        assert error is None, f"{order} raised {error!r}"
        return
    if fault.kind == "forward":
        assert isinstance(error, InjectedForwardError), f"expected the forward's error: {error!r}"
        return
    assert error is None, f"{order} under {fault.name} raised {error!r}"
    assert out is not None
    for r in out:
        assert r.device_hit_tokens + r.restored_tokens + r.computed_tokens > 0
        if fault.kind in ("none", "put"):
            assert r.restored_tokens > 0 and r.fallback_reason is None
            assert not r.recomputed_after_failure
        elif fault.kind == "exists":
            assert r.restored_tokens == 0 and "store unavailable" in (r.fallback_reason or "")
        else:  # session or layer: the restore failed and was recomputed
            assert r.restored_tokens == 0 and r.recomputed_after_failure, r
            assert r.fallback_reason, "a recomputed request says why"


async def run_case(order: str, fault: Fault, inner: Store, model: HybridModel,
                   prompts: list[np.ndarray], cold: list[PrefillResult]) -> None:
    store, faulty_model = FaultyStore(inner, model.spec), FaultyModel(model)
    san = PoolSanitizer()  # every case runs in the sanitizer's checking mode
    cfg = EngineConfig(store="memory", namespace=f"f-{uuid.uuid4().hex[:10]}",
                       pool_bytes=16 << 20, layer_wait_timeout_s=WAIT_S)
    async with Engine(san.model(faulty_model), cfg, store=san.store(store)) as engine:
        san.attach(engine.pool)
        assert_exact(await engine.prefill(prompts), cold)  # computes, then offloads
        await offload_and_drop(engine)
        puts_failed = engine.offloader.report.failed

        gate, box = threading.Event(), {}
        waiting = arm(fault, store, faulty_model, gate)
        task = asyncio.create_task(timed(run_order(engine, order, prompts, box), box))
        try:
            if waiting is not None:
                reached = await anyio.to_thread.run_sync(waiting.wait, WAIT_S)
                assert reached, f"{order} never reached {fault.name}"
                if fault.how == "timeout":
                    box["timeout"].reschedule(asyncio.get_running_loop().time())
                else:
                    task.cancel()
                if fault.how in ("held", "timeout"):
                    done, _ = await asyncio.wait({task}, timeout=HOLD_S)
                    assert not done, f"{order} returned while its thread was held at {fault.at}"
        finally:
            gate.set()
        out: list[PrefillResult] | None = None
        error: BaseException | None = None
        try:
            out = await asyncio.wait_for(task, WAIT_S)
        except (asyncio.CancelledError, Exception) as exc:
            error = exc
        if "handle" in box:  # a cancelled abort goes on in the background
            await asyncio.wait_for(box["handle"].aclose(), WAIT_S)
        check_outcome(order, fault, out, error)
        if out is not None:
            assert_exact(out, cold)
        report = await engine.wait_offloads()
        if fault.kind == "put" and order in RESULT_ORDERS:
            assert report.failed > puts_failed, "the injected put failure went unnoticed"
        assert_quiescent(engine)

        # The engine serves on: a clean prefill is exact, and after dropping
        # the device cache the next one restores, exactly.
        store.clear()
        faulty_model.clear()
        again = await engine.prefill(prompts)
        assert_exact(again, cold)
        if out is not None and all(r.restored_tokens for r in out):
            # the same boundary from the device: the same chunking, bit for bit
            for r, a in zip(out, again, strict=True):
                if a.device_hit_tokens == r.device_hit_tokens + r.restored_tokens:
                    assert torch.equal(r.next_token_logprobs, a.next_token_logprobs)
        await offload_and_drop(engine, expect_ok=False)  # the report counts the injected put
        restored = await engine.prefill(prompts)
        assert all(r.restored_tokens > 0 for r in restored), "the next prefill did not restore"
        assert_exact(restored, cold)
        await engine.wait_offloads()
        assert_quiescent(engine)
    san.check()


# ---- the table -------------------------------------------------------------------------
@pytest.mark.parametrize(("order", "fault"), CASES, ids=[f"{o}-{f.name}" for o, f in CASES])
async def test_fault_memory_store(order: str, fault: Fault, model: HybridModel,
                                  batch: list[np.ndarray], cold: list[PrefillResult]) -> None:
    await run_case(order, fault, MemoryStore(), model, batch, cold)


@pytest.mark.mooncake
@pytest.mark.parametrize(("order", "fault"), CASES, ids=[f"{o}-{f.name}" for o, f in CASES])
async def test_fault_mooncake(order: str, fault: Fault, model: HybridModel,
                              batch: list[np.ndarray], cold: list[PrefillResult],
                              mc_shared: MooncakeStore) -> None:
    await run_case(order, fault, _Unclosed(mc_shared), model, batch, cold)


# ---- the findings that started this, as regression tests --------------------------------
async def test_device_hit_readiness_settles_at_commit(model: HybridModel,
                                                      batch: list[np.ndarray]) -> None:
    """A plan with nothing left to restore: its readiness is done at COMMIT
    (this hung forever in the README's example)."""
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        first = await engine.prefill(batch[:1])
        plan = await engine.lookup(batch[0])
        assert not plan.restores and plan.device_pages > 0
        handle = await engine.load([plan])
        readiness = handle.commit()
        for layer in range(readiness.num_layers):
            await readiness.ready(layer, timeout=5.0)
        (again,) = await handle.forward()
        assert_exact([again], first)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_evicted_key_between_lookup_and_load_recomputes(model: HybridModel) -> None:
    """Two 900-token prompts; the read session fails with StoreKeyMissing
    (Mooncake evicted a key after LOOKUP). Both results used to claim 896
    restored tokens and differed from a cold run (KL 0.26 and 2.3)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.vocab_size, 900, dtype=np.int64) for _ in range(2)]
    store = FaultyStore(MemoryStore(), model.spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=32 << 20),
                      store=store) as engine:
        ref = await engine.prefill(prompts)
        await offload_and_drop(engine)
        store.fail_session = StoreKeyMissing("injected: evicted after LOOKUP")
        got = await engine.prefill(prompts)
        assert [r.restored_tokens for r in got] == [0, 0]
        assert all(r.recomputed_after_failure and "session" in (r.fallback_reason or "")
                   for r in got)
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_step_by_step_session_failure_computes(model: HybridModel,
                                                     batch: list[np.ndarray]) -> None:
    """load issues, then commit: a failed session used to raise ValueError
    (the compute pages had been sized for the restore)."""
    store = FaultyStore(MemoryStore(), model.spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        ref = await engine.prefill(batch)
        await engine.wait_offloads()
        engine.drop_device_cache()
        plans = [await engine.lookup(p) for p in batch]
        assert all(p.restores for p in plans)
        store.fail_session = StoreKeyMissing("injected")
        handle = await engine.load(plans)
        handle.commit()
        got = await handle.forward()
        assert all(r.recomputed_after_failure and r.restored_tokens == 0 for r in got)
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_exception_after_the_forward_releases_the_lock(
        model: HybridModel, batch: list[np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """Inserting the computed pages raises: the batch still exits (the lock
    used to stay held and every later call waited forever)."""
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        ref = await engine.prefill(batch)
        await engine.wait_offloads()
        engine.drop_device_cache()
        real_insert = engine.tree.insert
        calls = {"n": 0}

        def failing_insert(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if kwargs.get("start_page", 0) > 0 and calls["n"] > 2:  # a computed suffix
                raise RuntimeError("injected: insert failed")
            return real_insert(*args, **kwargs)

        monkeypatch.setattr(engine.tree, "insert", failing_insert)
        with pytest.raises(RuntimeError, match="injected: insert failed"):
            await asyncio.wait_for(engine.prefill(batch), WAIT_S)
        monkeypatch.setattr(engine.tree, "insert", real_insert)
        await engine.wait_offloads()
        assert_quiescent(engine)
        assert_exact(await asyncio.wait_for(engine.prefill(batch), WAIT_S), ref)


async def test_load_refuses_plans_that_do_not_fit_together(model: HybridModel) -> None:
    """``load`` takes the plans as one batch: plans that fit only one at a
    time get a clear error and are released; ``prefill`` serves them in
    parts, in order, exactly."""
    from layerlift.engine.api import min_pool_bytes

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.vocab_size, 400, dtype=np.int64) for _ in range(3)]
    async with Engine(model, EngineConfig(store="memory", offload=False,
                                          pool_bytes=16 << 20)) as engine:
        ref = await engine.prefill(prompts)
    cfg = EngineConfig(store="memory", pool_bytes=min_pool_bytes(model.spec) * 3)
    async with Engine(model, cfg) as engine:
        plans = [await engine.lookup(p) for p in prompts]
        with pytest.raises(EngineError, match="do not fit in the device pool together"):
            await engine.load(plans)
        assert_quiescent(engine)
        got = await engine.prefill(prompts)
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


@pytest.mark.parametrize("length", [64, 65, 128])
async def test_a_prompt_cached_whole_is_served(model: HybridModel, length: int) -> None:
    """A prompt whose every page is cached at a checkpoint (length a multiple
    of the track interval) still computes its last token; prefilling it
    twice used to raise "device boundary 4 must lie in [0, 3]"."""
    prompt = np.arange(length, dtype=np.int64) % model.vocab_size
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        first = await engine.prefill([prompt])
        again = await engine.prefill([prompt])
        assert again[0].computed_tokens >= 1
        assert_exact(again, first)
        await engine.wait_offloads()
        engine.drop_device_cache()
        restored = await engine.prefill([prompt])
        assert restored[0].computed_tokens >= 1
        assert_exact(restored, first)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_handle_left_open_does_not_hang_the_next_load(model: HybridModel,
                                                              batch: list[np.ndarray]) -> None:
    """A step-by-step handle that is neither forwarded nor aborted keeps the
    device: the next ``load`` gives up after ``layer_wait_timeout_s`` with a
    clear error (it used to wait forever) and releases its plans."""
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, layer_wait_timeout_s=0.5)
    async with Engine(model, cfg) as engine:
        first = await engine.load([await engine.lookup(batch[0])])
        second = [await engine.lookup(batch[1])]
        with pytest.raises(EngineError, match="kept the device"):
            await engine.load(second)
        first.abort()
        await first.aclose()
        await engine.wait_offloads()
        assert_quiescent(engine)
        assert len(await engine.prefill(batch)) == 2
