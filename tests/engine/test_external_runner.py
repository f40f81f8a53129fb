"""External-runner mode: a host framework owns the forward; LayerLift hands it
page tables, state slots and the per-layer wait, and takes the results back.

The "host" here is the reference model's own batched forward called from a
worker thread with the host's layer hook, exactly as a serving framework
would call it; the engine never runs the forward itself."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.handle import ExternalForward
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.overlap.base import LayerLoadError
from layerlift.testing import FaultyStore, assert_quiescent, kl_divergence, offload_and_drop
from layerlift.testing.reference import random_prompts

KL_TOL = 1e-6


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def _prompts(model: HybridModel, seed: int) -> list[np.ndarray]:
    return random_prompts(model, seed, (300, 233))


async def _host_forward(model: HybridModel, engine: Engine, ext: ExternalForward,
                        requests: list[ForwardRequest]) -> torch.Tensor:
    """The host's forward: its own layer hook calls the engine's wait."""
    out = await anyio.to_thread.run_sync(
        lambda: model.forward_batch(requests, engine.pool, ext.wait, lambda layer: None))
    return out.next_token_logprobs


async def _serve_externally(model: HybridModel, engine: Engine,
                            prompts: list[np.ndarray]) -> list[PrefillResult]:
    plans = [await engine.lookup(p) for p in prompts]
    handle = await engine.load(plans)
    ext = handle.begin_external()
    requests = ext.requests
    for _ in range(3):
        try:
            logprobs = await _host_forward(model, engine, ext, requests)
        except LayerLoadError as err:
            requests = await ext.failed(err)  # recomputed: new page tables
            continue
        return await ext.done(logprobs)
    raise AssertionError("the host forward kept failing")


def _exact(got: list[PrefillResult], ref: list[PrefillResult]) -> None:
    kls = [kl_divergence(a.next_token_logprobs, b.next_token_logprobs)
           for a, b in zip(ref, got, strict=True)]
    assert max(kls) <= KL_TOL, kls


@pytest.mark.mooncake
async def test_host_forward_restores_exactly(model: HybridModel, mc_client: MooncakeStore,
                                             namespace: str) -> None:
    prompts = _prompts(model, 1)
    cfg = EngineConfig(store="memory", namespace=namespace, pool_bytes=16 << 20)
    async with Engine(model, cfg, store=FaultyStore(mc_client, model.spec)) as engine:
        ref = await engine.prefill(prompts)
        await offload_and_drop(engine)
        got = await _serve_externally(model, engine, prompts)
        assert all(r.restored_tokens > 0 and not r.recomputed_after_failure for r in got)
        _exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)
        # what the host computed was inserted: the next prefill is a device hit
        again = await engine.prefill(prompts)
        assert all(r.device_hit_tokens >= g.restored_tokens for r, g in zip(again, got, strict=True))
        _exact(again, ref)


async def test_host_forward_recomputes_a_failed_layer(model: HybridModel) -> None:
    prompts = _prompts(model, 2)
    store = FaultyStore(MemoryStore(), model.spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20),
                      store=store) as engine:
        ref = await engine.prefill(prompts)
        await offload_and_drop(engine)
        store.fail_layer(5)
        got = await _serve_externally(model, engine, prompts)
        assert all(r.recomputed_after_failure and r.restored_tokens == 0 for r in got)
        _exact(got, ref)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_host_forward_error_aborts(model: HybridModel) -> None:
    prompts = _prompts(model, 3)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        ref = await engine.prefill(prompts)
        await engine.wait_offloads()
        engine.drop_device_cache()
        handle = await engine.load([await engine.lookup(p) for p in prompts])
        ext = handle.begin_external()
        with pytest.raises(RuntimeError, match="host crashed"):
            await ext.failed(RuntimeError("host crashed"))
        with pytest.raises(RuntimeError):
            await ext.done(torch.zeros(2, model.vocab_size))
        await engine.wait_offloads()
        assert_quiescent(engine)
        _exact(await engine.prefill(prompts), ref)


async def test_done_checks_its_input(model: HybridModel) -> None:
    prompts = _prompts(model, 4)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=16 << 20)) as engine:
        handle = await engine.load([await engine.lookup(p) for p in prompts])
        ext = handle.begin_external()
        with pytest.raises(ValueError, match="rows"):
            await ext.done(torch.zeros(1, model.vocab_size))
        ext.abort()
        await ext.aclose()
        assert_quiescent(engine)


async def test_host_timings_teach_the_cost_model(model: HybridModel) -> None:
    """``done(..., timings=...)``: the host's per-layer compute reaches the
    cost model of ``restore="auto"`` (it used to learn a zero-time forward)."""
    from layerlift.engine.results import Timings

    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, restore="auto")
    async with Engine(model, cfg) as engine:
        cost = engine._ctx.cost
        assert cost is not None
        before = cost.forward_observations
        plans = [await engine.lookup(p) for p in _prompts(model, 21)]
        handle = await engine.load(plans)
        ext = handle.begin_external()
        logprobs = await _host_forward(model, engine, ext, ext.requests)
        layers = model.spec.num_layers
        await ext.done(logprobs, timings=Timings(layer_compute=[0.002] * layers))
        assert cost.forward_observations == before + 1
        await engine.wait_offloads()
        assert_quiescent(engine)
