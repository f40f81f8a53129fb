"""The CUDA path end to end: pool in device memory, fetches landing in pinned
staging, H2D on the load stream, per-layer events waited on the forward's
stream. Runs wherever a GPU is present; skipped with a reason elsewhere.

Between offload and restore the (empty) pool is zeroed, so a missing copy
or a missing wait cannot pass by finding the old bytes in the same slots;
the negative control skips the waits and must come out wrong."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import (
    KL_EXACT,
    KL_WRONG,
    FaultyStore,
    SkipLayerWaits,
    assert_quiescent,
    kl_divergence,
    offload_and_drop,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def _prompts(spec: ModelSpec, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, spec.dims.vocab_size, 300).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_cuda_restore_equals_compute(policy: str) -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda")
    prompts = _prompts(spec, 3, seed=1)
    cfg = EngineConfig(store="memory", policy=policy, device="cuda", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        first = await engine.prefill(prompts)
        await offload_and_drop(engine)
        again = await engine.prefill(prompts)
        for a, b in zip(first, again, strict=True):
            assert b.restored_tokens == 256
            assert kl_divergence(a.next_token_logprobs, b.next_token_logprobs) <= KL_EXACT
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_cuda_failed_layer_is_recomputed() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda")
    (prompt,) = _prompts(spec, 1, seed=2)
    store = FaultyStore(MemoryStore(), spec)
    cfg = EngineConfig(store="memory", device="cuda", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=store) as engine:
        (first,) = await engine.prefill([prompt])
        await offload_and_drop(engine)
        store.fail_layer(3)
        (again,) = await engine.prefill([prompt])
        assert again.recomputed_after_failure
        assert kl_divergence(first.next_token_logprobs, again.next_token_logprobs) <= KL_EXACT
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_cuda_skipped_waits_break_results() -> None:
    """Negative control: layer 0's fetch is held until the forward returned;
    without the per-layer waits the forward reads zeroed pages."""
    spec = ModelSpec.preset("tiny")
    model = SkipLayerWaits(HybridModel(spec, seed=0, device="cuda"))
    prompts = _prompts(spec, 2, seed=3)
    store = FaultyStore(MemoryStore(), spec)
    cfg = EngineConfig(store="memory", device="cuda", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=store) as engine:
        first = await engine.prefill(prompts)
        await offload_and_drop(engine)
        gate = threading.Event()
        store.gate_layer(0, gate)
        model.enabled = True
        task = asyncio.create_task(engine.prefill(prompts))
        try:
            assert await asyncio.to_thread(model.forward_done.wait, 60.0)
        finally:
            gate.set()
        again = await task
        assert all(r.restored_tokens > 0 for r in again)
        kls = [kl_divergence(a.next_token_logprobs, b.next_token_logprobs)
               for a, b in zip(first, again, strict=True)]
        assert max(kls) > KL_WRONG, "skipping the layer waits went unnoticed on CUDA"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
async def test_cuda_restore_on_a_second_device() -> None:
    """The forward thread runs under the pool's device and waits on that
    device's stream (a fresh thread's current device is cuda:0)."""
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda:1")
    prompts = _prompts(spec, 2, seed=4)
    cfg = EngineConfig(store="memory", device="cuda:1", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        first = await engine.prefill(prompts)
        await offload_and_drop(engine)
        again = await engine.prefill(prompts)
        for a, b in zip(first, again, strict=True):
            assert b.restored_tokens > 0
            assert kl_divergence(a.next_token_logprobs, b.next_token_logprobs) <= KL_EXACT
