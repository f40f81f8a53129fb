"""Races on the step-by-step and external-runner paths (issue 32, items 1-3
and 9, and the same shapes found again): ``load()`` -> ``begin_external()``
-> ``done()`` / ``failed()`` / ``abort()``. Each test failed before its fix.

* A host's forward owns the batch's pages until it says it returned: every
  exit waits for that, bounded, and leaves the pages allocated (never freed
  under the forward) when the host never says so.
* ``done()`` and ``failed()`` of one forward are exclusive: a second call
  while one runs raises ``RuntimeError``; a load's end that has only begun
  never counts as ended.
* ``load()`` checks and takes its plans with no await between; a plan a
  batch has taken cannot be released, loaded again or restricted.

Concurrent steps are ordered with events (threading gates on the host's
forward and on store reads, asyncio events on the engine's own steps);
after every failure path the tests check the sanitizer's record, byte
accounting and tree integrity (``assert_quiescent``) and exactness.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, EngineError, HybridModel, ModelSpec
from layerlift.engine.batch import Batch
from layerlift.engine.handle import ExternalForward
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.results import PrefillResult, Timings
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.base import LayerLoadError
from layerlift.pools.spec import Component
from layerlift.testing import FaultyModel, FaultyStore, assert_quiescent, offload_and_drop
from layerlift.testing.controls import cancel_while_held, spy_lock_wait
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts
from layerlift.testing.sanitizer import PoolSanitizer

WAIT_S = 30.0


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def spy_end_load(batch: Batch) -> asyncio.Event:
    """An event set when ``batch`` starts ending its load."""
    entered = asyncio.Event()
    original = batch._end_load

    async def spied() -> Any:
        entered.set()
        return await original()

    batch._end_load = spied  # type: ignore[method-assign]
    return entered


def host_forward(model: Any, engine: Engine, ext: ExternalForward,
                 requests: list[ForwardRequest]) -> torch.Tensor:
    """The host's forward (its own thread): its layer hook calls the wait."""
    out = model.forward_batch(requests, engine.pool, ext.wait, lambda layer: None)
    return out.next_token_logprobs


async def serve(model: Any, engine: Engine, ext: ExternalForward) -> list[PrefillResult]:
    """Run the host forward (in the rule's context manager) until done."""
    requests = ext.requests
    for _ in range(3):
        def forward(requests: list[ForwardRequest] = requests) -> torch.Tensor:
            with ext.running():
                return host_forward(model, engine, ext, requests)
        try:
            logprobs = await anyio.to_thread.run_sync(forward)
        except LayerLoadError as err:
            requests = await ext.failed(err)
            continue
        return await ext.done(logprobs)
    raise AssertionError("the host forward kept failing")


def allocated(engine: Engine, component: Component, idx: torch.Tensor) -> bool:
    """Every page of ``idx`` is allocated (not free) in the pool."""
    (sub,) = [s for s in engine.pool.core.chain if s.name == component.value]  # type: ignore[attr-defined]
    return bool(np.asarray(sub.used)[idx.numpy()].all())


# ---- 1. the host's forward owns its pages until it says it returned ----------------------

@pytest.mark.parametrize("says", ["running", "returned"])
@pytest.mark.parametrize("exit_by", ["ext.abort", "engine.close"])
async def test_abort_waits_until_the_host_forward_returned(model: HybridModel, says: str,
                                                           exit_by: str) -> None:
    """The host's forward is held in layer 3 when the batch is aborted (or
    the engine closed): the exit must not return while it runs (before: it
    returned at once and freed the pages under it; the review measured a
    sanitizer violation and a later device hit at KL 0.03). The host's next wait raises; once it says it
    returned (leaving ``running()``, or ``returned()``) everything is
    released and later prompts are exact."""
    prompt, other = random_prompts(model, 31, [900, 700])
    ref, ref_other = await cold_prefills(model, [prompt, other])
    san, faulty, memory = PoolSanitizer(), FaultyModel(model), MemoryStore()
    host = san.model(faulty)
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    engine = Engine(model, cfg, store=san.store(memory))
    await engine.start()
    try:
        san.attach(engine.pool)
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        plan = await engine.lookup(prompt)
        assert plan.restores
        ext = (await engine.load([plan])).begin_external()
        gate = threading.Event()
        faulty.gate_at(3, gate)

        def forward() -> torch.Tensor:
            if says == "running":
                with ext.running():
                    return host_forward(host, engine, ext, ext.requests)
            return host_forward(host, engine, ext, ext.requests)

        async def run_host() -> torch.Tensor:
            try:
                return await anyio.to_thread.run_sync(forward)
            finally:
                if says == "returned":
                    ext.returned()

        hosting = asyncio.create_task(run_host())
        assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)

        async def leave() -> None:
            if exit_by == "ext.abort":
                ext.abort()
                await ext.aclose()
            else:
                await engine.close()

        leaving = asyncio.create_task(leave())
        await cancel_while_held(leaving, lambda: None, gate)
        async with asyncio.timeout(WAIT_S):
            await leaving
        with pytest.raises(EngineError, match="aborted"):
            await hosting  # its next wait raised: the forward stopped there
        faulty.clear()
        with pytest.raises(EngineError), ext.running():  # an ended batch refuses a forward
            pass
        assert san.checked > 0
        san.check()
        if exit_by == "engine.close":
            engine = Engine(model, cfg, store=san.store(memory))
            await engine.start()
            san.attach(engine.pool)
        await engine.wait_offloads()
        assert_quiescent(engine)
        got = [(await engine.prefill([p]))[0] for p in (other, prompt, other, prompt)]
        assert_exact(got, [ref_other, ref, ref_other, ref])
        await engine.wait_offloads()
        assert_quiescent(engine)
    finally:
        await engine.close()
    san.check()


async def test_a_host_that_never_returns_gets_a_clear_error_and_keeps_its_pages(
        model: HybridModel) -> None:
    """The host's forward does not return within ``layer_wait_timeout_s``
    of the abort: ``aclose()`` raises an ``EngineError`` naming the rule
    (before: it returned at once and freed the pages under the forward);
    its pages stay allocated while other prompts are served (exactly);
    once it says it returned they are released."""
    prompt, other = random_prompts(model, 32, [900, 800])
    ref, ref_other = await cold_prefills(model, [prompt, other])
    san, faulty = PoolSanitizer(), FaultyModel(model)
    host = san.model(faulty)
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20, layer_wait_timeout_s=0.5)
    async with Engine(model, cfg, store=san.store(MemoryStore())) as engine:
        san.attach(engine.pool)
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        ext = (await engine.load([await engine.lookup(prompt)])).begin_external()
        (req,) = ext.requests
        mine = req.full_pages[req.prefix_len // model.spec.page_size:]
        gate = threading.Event()
        faulty.gate_at(2, gate)

        async def run_host() -> torch.Tensor:
            try:
                return await anyio.to_thread.run_sync(
                    lambda: host_forward(host, engine, ext, ext.requests))
            finally:
                ext.returned()  # only once the thread has returned

        hosting = asyncio.create_task(run_host())
        try:
            assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
            ext.abort()
            with pytest.raises(EngineError, match=r"did not return.*running\(\).*returned\(\)"):
                async with asyncio.timeout(WAIT_S):
                    await ext.aclose()
            assert allocated(engine, Component.FULL, mine), "freed under a running forward"
            (served,) = await engine.prefill([other])  # the engine goes on around them
            assert_exact([served], [ref_other])
            assert allocated(engine, Component.FULL, mine)
        finally:
            gate.set()
        with pytest.raises(EngineError):
            await hosting  # it returned: the pages it left behind are released now
        faulty.clear()
        san.check()
        await engine.wait_offloads()
        assert_quiescent(engine)
        got = [(await engine.prefill([p]))[0] for p in (prompt, other, prompt)]
        assert_exact(got, [ref, ref_other, ref])
        await engine.wait_offloads()
        assert_quiescent(engine)
    san.check()


async def test_close_behind_a_host_that_never_returns_is_bounded(model: HybridModel) -> None:
    """``Engine.close()`` while a host's forward is held and never says it
    returned: close waits ``layer_wait_timeout_s``, then raises an
    ``EngineError`` naming the rule (before: it returned at once with the
    pages freed under the forward); the pages stay allocated until the
    host returns, then they are released."""
    prompt = random_prompts(model, 42, [900])[0]
    (ref,) = await cold_prefills(model, [prompt])
    san, faulty, memory = PoolSanitizer(), FaultyModel(model), MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20, layer_wait_timeout_s=0.5)
    engine = Engine(model, cfg, store=san.store(memory))
    await engine.start()
    gate = threading.Event()
    try:
        san.attach(engine.pool)
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        ext = (await engine.load([await engine.lookup(prompt)])).begin_external()
        (req,) = ext.requests
        mine = req.full_pages[req.prefix_len // model.spec.page_size:]
        faulty.gate_at(5, gate)

        async def run_host() -> torch.Tensor:
            try:
                return await anyio.to_thread.run_sync(
                    lambda: host_forward(san.model(faulty), engine, ext, ext.requests))
            finally:
                ext.returned()

        hosting = asyncio.create_task(run_host())
        assert await anyio.to_thread.run_sync(faulty.reached.wait, WAIT_S)
        with pytest.raises(EngineError, match="did not return"):
            async with asyncio.timeout(WAIT_S):
                await engine.close()
        assert allocated(engine, Component.FULL, mine), "freed under a running forward"
    finally:
        gate.set()
    with pytest.raises(EngineError):
        await hosting
    assert not allocated(engine, Component.FULL, mine), "not released once it returned"
    engine.pool.verify_byte_accounting()
    engine.tree.check_integrity()
    san.check()
    async with Engine(model, cfg, store=memory) as second:  # the store's copy
        (again,) = await second.prefill([prompt])
        assert again.restored_tokens > 0
        assert_exact([again], [ref])


# ---- 2. done() and failed() are exclusive; an end that began is not an end --------------

async def test_a_second_done_while_the_first_ends_the_load_raises(model: HybridModel) -> None:
    """Two ``done()`` calls at once: the second used to see the load's end
    *begun* and finish the batch at once (results and an insert before the
    end was known). Now it raises ``RuntimeError``; the first returns the
    results, exact."""
    prompts = random_prompts(model, 33, [700, 500])
    ref = await cold_prefills(model, prompts)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        await engine.prefill(prompts)
        await offload_and_drop(engine)
        handle = await engine.load([await engine.lookup(p) for p in prompts])
        ext = handle.begin_external()
        entered = spy_end_load(handle._batch)
        logprobs = await anyio.to_thread.run_sync(
            lambda: host_forward(model, engine, ext, ext.requests))
        first = asyncio.create_task(ext.done(logprobs))
        async with asyncio.timeout(WAIT_S):
            await entered.wait()
        assert not first.done()
        theirs = Timings(layer_compute=[1.0] * model.spec.num_layers)
        with pytest.raises(RuntimeError, match="still running"):
            await ext.done(logprobs, timings=theirs)
        with pytest.raises(RuntimeError, match="still running"):
            await ext.failed(LayerLoadError(0, RuntimeError("late")))
        got = await first
        assert ext.timings is not theirs  # the refused call changed nothing
        assert all(r.restored_tokens > 0 and not r.recomputed_after_failure for r in got)
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_done_while_failed_ends_the_load_raises(model: HybridModel) -> None:
    """Layer 4's read fails; the host passes the error to ``failed()`` and,
    while it ends the load, calls ``done()`` with what its forward had: the
    restore is not verified, so ``done()`` must raise (before: it returned
    results that counted the failed restore as restored, and their pages
    were inserted; the review measured KL 0.03 and wrong pages in the store). ``failed()`` then returns the requests to run again, which
    recompute exactly; nothing wrong reached the device or the store."""
    prompt = random_prompts(model, 34, [900])[0]
    (ref,) = await cold_prefills(model, [prompt])
    memory = MemoryStore()
    store = FaultyStore(memory, model.spec)
    san = PoolSanitizer()
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg, store=san.store(store)) as engine:
        san.attach(engine.pool)
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        store.fail_layer(4)
        handle = await engine.load([await engine.lookup(prompt)])
        ext = handle.begin_external()
        entered = spy_end_load(handle._batch)
        with pytest.raises(LayerLoadError) as caught:
            await anyio.to_thread.run_sync(
                lambda: host_forward(san.model(model), engine, ext, ext.requests))
        failing = asyncio.create_task(ext.failed(caught.value))
        async with asyncio.timeout(WAIT_S):
            await entered.wait()
        unverified = torch.zeros(1, model.vocab_size)
        with pytest.raises(RuntimeError, match="still running"):
            await ext.done(unverified)
        requests = await failing
        store.clear()
        logprobs = await anyio.to_thread.run_sync(
            lambda: host_forward(san.model(model), engine, ext, requests))
        (got,) = await ext.done(logprobs)
        assert got.recomputed_after_failure and got.restored_tokens == 0
        assert_exact([got], [ref])
        await engine.wait_offloads()
        assert_quiescent(engine)
        (hit,) = await engine.prefill([prompt])
        assert hit.device_hit_tokens > 0
        assert_exact([hit], [ref])
        await engine.wait_offloads()
        assert_quiescent(engine)
    san.check()
    async with Engine(model, cfg, store=memory) as second:  # the store's copy
        (again,) = await second.prefill([prompt])
        assert_exact([again], [ref])


# ---- 3. load() checks and takes its plans at once ---------------------------------------

async def test_plans_waiting_for_the_load_lock_are_taken(model: HybridModel) -> None:
    """``load([b])`` waits for the load lock (another batch's load is in
    flight): meanwhile ``release_plan(b)`` and a second ``load([b])`` must
    be refused with a ``ValueError`` naming the rule (before: both were
    accepted, and the batch ran on a plan that was not live: freed pages,
    then a raw error from the tree)."""
    a, b = random_prompts(model, 35, [700, 600])
    ref_a, ref_b = await cold_prefills(model, [a, b])
    store = FaultyStore(MemoryStore(), model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg, store=store) as engine:
        await engine.prefill([a, b])
        await offload_and_drop(engine)
        gate = threading.Event()
        held = store.gate_layer(1, gate)
        try:
            plan, plan_a = await engine.lookup(b), await engine.lookup(a)
            first = await engine.load([plan_a])  # its load holds the lock
            assert await anyio.to_thread.run_sync(held.started.wait, WAIT_S)
            waiting = spy_lock_wait(engine)
            loading = asyncio.create_task(engine.load([plan]))
            async with asyncio.timeout(WAIT_S):
                await waiting.wait()
            with pytest.raises(ValueError, match="is loaded"):
                engine.release_plan(plan)
            with pytest.raises(ValueError, match="loaded already"):
                await engine.load([plan])
            with pytest.raises(ValueError, match="restrict_to"):
                plan.restrict_to([plan.restorable])
        finally:
            gate.set()
        store.clear()
        first.commit()
        (got_a,) = await first.forward()
        second = await loading
        (got_b,) = await second.forward()
        assert got_b.restored_tokens > 0
        assert_exact([got_a, got_b], [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_plan_waiting_for_room_stays_taken(model: HybridModel) -> None:
    """``load([b])`` whose plan does not fit while a committed handle holds
    the room waits for that room with its plan out of the batch: the plan
    stays taken (before: ``release_plan`` was accepted in that window and
    the batch then admitted a released plan)."""
    a, b = random_prompts(model, 36, [2600, 2600])
    ref_a, ref_b = await cold_prefills(model, [a, b])
    cfg = EngineConfig(store="memory", pool_bytes=5 << 20, offload=False)
    async with Engine(model, cfg) as engine:
        first = await engine.load([await engine.lookup(a)])
        first.commit()
        plan = await engine.lookup(b)
        room = engine._ctx.room
        loading = asyncio.create_task(engine.load([plan]))
        waiting = asyncio.Event()
        original = engine._ctx.wait_for_room

        async def spied(me: Any, need: str) -> bool:
            waiting.set()
            return await original(me, need)

        engine._ctx.wait_for_room = spied  # type: ignore[method-assign]
        async with asyncio.timeout(WAIT_S):
            await waiting.wait()
        assert engine._ctx.room is room  # nothing exited: it waits for the room
        with pytest.raises(ValueError, match="is loaded"):
            engine.release_plan(plan)
        (got_a,) = await first.forward()  # the room frees: b is admitted
        second = await loading
        (got_b,) = await second.forward()
        assert_exact([got_a, got_b], [ref_a, ref_b])
        assert_quiescent(engine)


# ---- 9. a taken plan's boundary is fixed; done() checks the vocabulary ------------------

@pytest.mark.parametrize("call", ["restrict_to", "drop_restore"])
async def test_a_loaded_plans_boundary_cannot_move(model: HybridModel, call: str) -> None:
    """``restrict_to`` after ``load`` used to move the boundary under the
    batch (16 -> 12 pages; the forward failed with a pool double free);
    ``drop_restore`` is the same shape (found again): both refused."""
    prompt = random_prompts(model, 37, [900])[0]
    (ref,) = await cold_prefills(model, [prompt])
    cfg = EngineConfig(store="memory", pool_bytes=8 << 20)
    async with Engine(model, cfg) as engine:
        await engine.prefill([prompt])
        await offload_and_drop(engine)
        plan = await engine.lookup(prompt)
        lower = frozenset(x for x in plan.restorable if x < plan.boundary)
        assert lower, plan.restorable
        before = (plan.restorable, plan.boundary)
        handle = await engine.load([plan])
        with pytest.raises(ValueError, match=rf"{call}\(\) must come before Engine.load"):
            if call == "restrict_to":
                plan.restrict_to([lower])
            else:
                plan.drop_restore("the caller changed its mind")
        assert (plan.restorable, plan.boundary) == before
        handle.commit()
        (got,) = await handle.forward()
        assert got.restored_tokens == before[1] * model.spec.page_size
        assert_exact([got], [ref])
        await engine.wait_offloads()
        assert_quiescent(engine)


@pytest.mark.parametrize("shape", [lambda n, v: (n, v - 1), lambda n, v: (n, v + 7),
                                   lambda n, v: (n,), lambda n, v: (n, 1, v)],
                         ids=["narrower", "wider", "1-d", "3-d"])
async def test_done_refuses_logprobs_of_another_vocabulary(
        model: HybridModel, shape: Callable[[int, int], tuple[int, ...]]) -> None:
    prompts = random_prompts(model, 38, [500, 400])
    ref = await cold_prefills(model, prompts)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg) as engine:
        ext = (await engine.load([await engine.lookup(p) for p in prompts])).begin_external()
        logprobs = await anyio.to_thread.run_sync(
            lambda: host_forward(model, engine, ext, ext.requests))
        with pytest.raises(ValueError, match="vocab"):
            await ext.done(torch.zeros(shape(2, model.vocab_size)))
        got = await ext.done(logprobs)  # nothing changed: the right call still works
        assert_exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_serving_with_the_rule_is_exact(model: HybridModel) -> None:
    """The documented host loop (``with ext.running():`` around the forward,
    ``failed()`` for a failed layer): exact, restored or recomputed."""
    prompts = random_prompts(model, 39, [700, 500])
    ref = await cold_prefills(model, prompts)
    store = FaultyStore(MemoryStore(), model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg, store=store) as engine:
        await engine.prefill(prompts)
        for fail in (None, 3):
            await offload_and_drop(engine)
            if fail is not None:
                store.fail_layer(fail)
            ext = (await engine.load([await engine.lookup(p) for p in prompts])).begin_external()
            got = await serve(model, engine, ext)
            assert all(r.recomputed_after_failure is (fail is not None) for r in got)
            assert_exact(got, ref)
            store.clear()
            await engine.wait_offloads()
            assert_quiescent(engine)


# ---- the same shapes, found again -------------------------------------------------------

async def test_a_cancelled_load_releases_the_plans_that_did_not_fit(
        model: HybridModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load([a, b])`` where ``b`` does not fit beside ``a``: the batch of
    ``a`` is closed, then ``b`` released; a cancellation during that close
    skipped the release (``b``'s device-hit lock and pins leaked). Now
    ``b`` is released before the await."""
    a, prefix = random_prompts(model, 40, [2600, 600])
    b = np.concatenate([prefix, random_prompts(model, 41, [2000])[0]])
    ref_a, ref_b = await cold_prefills(model, [a, b])
    cfg = EngineConfig(store="memory", pool_bytes=4 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        await engine.prefill([prefix])
        await engine.wait_offloads()
        plan_a, plan_b = await engine.lookup(a), await engine.lookup(b)
        assert plan_a.restores and plan_b.device_pages > 0
        entered, proceed = asyncio.Event(), asyncio.Event()
        original = Batch._end_load

        async def held(self: Batch) -> Any:
            entered.set()
            await proceed.wait()
            return await original(self)

        monkeypatch.setattr(Batch, "_end_load", held)
        loading = asyncio.create_task(engine.load([plan_a, plan_b]))
        async with asyncio.timeout(WAIT_S):
            await entered.wait()  # the batch of a is closing
        loading.cancel()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await loading
        monkeypatch.undo()
        assert plan_a.released and plan_b.released
        await engine.wait_offloads()
        assert_quiescent(engine)
        got = [(await engine.prefill([p]))[0] for p in (a, b)]
        assert_exact(got, [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)
