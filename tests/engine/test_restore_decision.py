"""Restore or recompute, per request (``EngineConfig(restore="auto")``): the
cost model learned from the engine's own timings decides, the result says
which and why, and either way the result is exact."""

from __future__ import annotations

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import assert_quiescent, kl_divergence


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


async def _round(model: HybridModel, link: str | None, restore: str) -> list[object]:
    """Compute, then restore twice: the first restore teaches the cost model
    the link (it starts from priors), the second is decided on what it saw."""
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, model.vocab_size, 300, dtype=np.int64) for _ in range(2)]
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, link=link, restore=restore)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        ref = await engine.prefill(prompts)
        for _ in range(2):
            await engine.wait_offloads()
            engine.drop_device_cache()
            got = await engine.prefill(prompts)
            for a, b in zip(ref, got, strict=True):
                assert kl_divergence(a.next_token_logprobs, b.next_token_logprobs) <= 1e-6
        await engine.wait_offloads()
        assert_quiescent(engine)
        return got  # type: ignore[return-value]


async def test_a_slow_link_computes_and_says_why(model: HybridModel) -> None:
    # 1 MB/s with 5 ms per call: loading 256 tokens of a tiny model loses to computing them
    got = await _round(model, "emulated:0.001,5000", "auto")
    for r in got:
        assert r.restored_tokens == 0  # type: ignore[attr-defined]
        assert r.restore_decision.startswith("recompute")  # type: ignore[attr-defined]
        assert r.fallback_reason == r.restore_decision  # type: ignore[attr-defined]


async def test_a_fast_link_restores_and_says_why(model: HybridModel) -> None:
    got = await _round(model, "emulated:100,1", "auto")
    for r in got:
        assert r.restored_tokens > 0  # type: ignore[attr-defined]
        assert r.restore_decision.startswith("restore")  # type: ignore[attr-defined]


async def test_always_restores_without_a_decision(model: HybridModel) -> None:
    got = await _round(model, "emulated:0.001,5000", "always")
    for r in got:
        assert r.restored_tokens > 0 and r.restore_decision is None  # type: ignore[attr-defined]


def test_restore_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="restore must be 'always' or 'auto'"):
        EngineConfig(restore="sometimes")
