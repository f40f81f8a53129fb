"""External-runner mode teaches the cost model only what the host measured.

The host hands its per-layer compute to ``ExternalForward.done(...,
timings=...)``, or the engine measures between the host's waits when that is
sound (a CPU pool, one wait per layer in order). An untimed forward teaches
nothing: before, every external batch taught "compute is free", and
``restore="auto"`` stopped restoring in exactly the integration mode."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.handle import ExternalForward, WaitClock
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.results import PrefillResult, Timings
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import assert_quiescent, offload_and_drop
from layerlift.testing.reference import random_prompts


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def _prompts(model: HybridModel, seed: int) -> list[np.ndarray]:
    return random_prompts(model, seed, (300, 233))


async def _external(model: HybridModel, engine: Engine, prompts: list[np.ndarray],
                    timings: Timings | None = None) -> tuple[ExternalForward, list[PrefillResult]]:
    plans = [await engine.lookup(p) for p in prompts]
    ext = (await engine.load(plans)).begin_external()
    requests: list[ForwardRequest] = ext.requests
    out = await anyio.to_thread.run_sync(
        lambda: model.forward_batch(requests, engine.pool, ext.wait, lambda layer: None))
    return ext, await ext.done(out.next_token_logprobs, timings=timings)


# ---- the clock between waits ----------------------------------------------------------
def test_wait_clock_measures_compute_between_the_waits() -> None:
    clock = WaitClock(3, measurable=True)
    for layer in range(3):
        clock.called(layer, None)
        clock.returned(layer)
    clock.calls, clock.returns = [1.0, 2.5, 4.0], [1.5, 3.0, 4.0]  # known instants
    t = clock.timings(end=6.0)
    assert t is not None
    assert t.layer_wait == pytest.approx([0.5, 0.5, 0.0])
    assert t.layer_compute == pytest.approx([1.0, 1.0, 2.0])


@pytest.mark.parametrize("case", ["gpu", "stream", "repeated", "skipped", "unfinished"])
def test_wait_clock_refuses_what_it_cannot_measure(case: str) -> None:
    clock = WaitClock(3, measurable=case != "gpu")
    order = {"repeated": [0, 0, 1, 2], "skipped": [0, 2], "unfinished": [0, 1]}.get(case,
                                                                                    [0, 1, 2])
    for layer in order:
        clock.called(layer, object() if case == "stream" else None)
        clock.returned(layer)
    assert clock.timings(end=10.0) is None
    clock.reset()
    if case == "gpu":
        assert not clock.sound  # a GPU host only enqueues: never measured
    else:
        for layer in range(3):
            clock.called(layer, None)
            clock.returned(layer)
        assert clock.timings(end=10.0) is not None


# ---- through the engine -----------------------------------------------------------------
async def test_untimed_host_forwards_keep_auto_restoring(model: HybridModel) -> None:
    """A host whose waits cannot be timed (here: it waits twice per layer) and
    that reports nothing: the cost model's compute estimate does not move,
    and a fast link keeps winning."""
    prompts = _prompts(model, 3)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, restore="auto",
                       link="emulated:100,1")
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        cost = engine._ctx.cost
        assert cost is not None
        await engine.prefill(prompts)
        before = cost.compute_s_per_token
        for _ in range(3):
            await offload_and_drop(engine)
            plans = [await engine.lookup(p) for p in prompts]
            ext = (await engine.load(plans)).begin_external()
            requests = ext.requests

            def twice(layer: int, ext: ExternalForward = ext) -> None:
                ext.wait(layer)
                ext.wait(layer)

            out = await anyio.to_thread.run_sync(
                model.forward_batch, requests, engine.pool, twice, lambda layer: None)
            got = await ext.done(out.next_token_logprobs)
            assert ext.timings is None
            assert all(r.restored_tokens > 0 for r in got), [r.restore_decision for r in got]
        assert cost.compute_s_per_token == before
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_done_measures_between_waits_or_takes_the_hosts_timings(model: HybridModel
                                                                      ) -> None:
    prompts = _prompts(model, 4)
    layers = model.spec.num_layers
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        await engine.prefill(prompts)
        await offload_and_drop(engine)
        ext, got = await _external(model, engine, prompts)
        assert all(r.restored_tokens > 0 for r in got)
        measured = ext.timings
        assert measured is not None
        assert len(measured.layer_compute) == layers and len(measured.layer_wait) == layers
        assert all(c >= 0 for c in measured.layer_compute) and sum(measured.layer_compute) > 0
        await offload_and_drop(engine)
        host = Timings(layer_compute=[1e-3] * layers)
        ext, got = await _external(model, engine, prompts, timings=host)
        assert ext.timings is host
        await engine.wait_offloads()
        assert_quiescent(engine)


@pytest.mark.parametrize(("timings", "match"), [
    (Timings(layer_compute=[0.1]), "1 entries for a model of 8 cache layers"),
    (Timings(layer_compute=[0.1] * 8, layer_wait=[0.0]), "layer_wait has 1 entries"),
    (Timings(layer_compute=[0.1] * 7 + [-1.0]), "negative"),
])
async def test_done_refuses_timings_it_cannot_use(model: HybridModel, timings: Timings,
                                                  match: str) -> None:
    prompts = _prompts(model, 5)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        plans = [await engine.lookup(p) for p in prompts]
        ext = (await engine.load(plans)).begin_external()
        requests = ext.requests
        out = await anyio.to_thread.run_sync(
            lambda: model.forward_batch(requests, engine.pool, ext.wait, lambda layer: None))
        with pytest.raises(ValueError, match=match):
            await ext.done(out.next_token_logprobs, timings=timings)
        got = await ext.done(out.next_token_logprobs)  # the batch is still running: finish it
        assert len(got) == 2 and all(isinstance(r.next_token_logprobs, torch.Tensor) for r in got)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_lookup_behind_a_running_batch_is_priced_after_it(model: HybridModel) -> None:
    """Cross-batch prefetch: a plan looked up while another batch computes is
    priced by what its load adds after that batch (the reason says how much
    hid behind it); with nothing ahead, nothing is hidden."""
    a, b = _prompts(model, 6)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, restore="auto",
                       link="emulated:100,1")
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        await engine.prefill([a, b])
        await offload_and_drop(engine)
        alone = await engine.lookup(b)
        assert alone.decision is not None and "behind the batch ahead" not in alone.decision
        engine.release_plan(alone)
        ext = (await engine.load([await engine.lookup(a)])).begin_external()  # computing a
        behind = await engine.lookup(b)
        assert behind.decision is not None and "behind the batch ahead" in behind.decision
        requests = ext.requests
        out = await anyio.to_thread.run_sync(
            model.forward_batch, requests, engine.pool, ext.wait, lambda layer: None)
        await ext.done(out.next_token_logprobs)
        engine.release_plan(behind)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_host_timings_flip_the_next_decision(model: HybridModel) -> None:
    """What the host reports is what ``restore="auto"`` decides on: after a
    host forward that says compute is nearly free the next plan recomputes;
    after one that says it is slow, the next plan restores again."""
    prompts = _prompts(model, 8)
    layers = model.spec.num_layers
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, restore="auto",
                       link="emulated:1,100")  # 1 GB/s, 100 us per call: a load costs ms
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        cost = engine._ctx.cost
        assert cost is not None
        cost.alpha = 1.0  # one observation decides: the arithmetic below is exact
        await engine.prefill(prompts)
        for per_layer, then_restore in [(1e-12, False), (0.5, True), (1e-12, False)]:
            await offload_and_drop(engine)
            plans = [await engine.lookup(p) for p in prompts]
            computed = sum(len(p.tokens) - p.boundary * p.spec.page_size for p in plans)
            ext = (await engine.load(plans)).begin_external()
            requests = ext.requests
            out = await anyio.to_thread.run_sync(
                model.forward_batch, requests, engine.pool, ext.wait, lambda layer: None)
            await ext.done(out.next_token_logprobs,
                           timings=Timings(layer_compute=[per_layer] * layers))
            assert cost.compute_s_per_token == pytest.approx(per_layer * layers / computed)
            await offload_and_drop(engine)
            nxt = await engine.lookup(prompts[0])
            assert nxt.decision is not None
            assert nxt.decision.startswith("restore" if then_restore else "recompute"), \
                nxt.decision
            assert nxt.restores is then_restore
            engine.release_plan(nxt)
        await engine.wait_offloads()
        assert_quiescent(engine)
