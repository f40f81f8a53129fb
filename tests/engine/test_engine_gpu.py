"""The CUDA path end to end: pool in device memory, fetches landing in pinned
staging, H2D on the load stream, per-layer events waited with wait_event.
Runs wherever a GPU is present; skipped with a reason elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import FaultyStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum())


@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_cuda_restore_equals_compute(policy: str) -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, spec.vocab_size, 300).tolist() for _ in range(3)]
    cfg = EngineConfig(store="memory", policy=policy, device="cuda", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        first = await engine.prefill(prompts)
        assert (await engine.wait_offloads()).ok
        engine.drop_device_cache()
        again = await engine.prefill(prompts)
        for a, b in zip(first, again, strict=True):
            assert b.restored_tokens == 256
            assert _kl(a.next_token_logprobs, b.next_token_logprobs) <= 1e-9
        engine.tree.check_integrity()
        engine.pool.verify_byte_accounting()


async def test_cuda_failed_layer_is_recomputed() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda")
    prompt = np.random.default_rng(2).integers(0, spec.vocab_size, 300).tolist()
    store = FaultyStore(MemoryStore(), spec)
    cfg = EngineConfig(store="memory", device="cuda", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=store) as engine:
        (first,) = await engine.prefill([prompt])
        await engine.wait_offloads()
        engine.drop_device_cache()
        store.fail_layer(3)
        (again,) = await engine.prefill([prompt])
        assert again.recomputed_after_failure
        assert _kl(first.next_token_logprobs, again.next_token_logprobs) <= 1e-9
        engine.pool.verify_byte_accounting()
