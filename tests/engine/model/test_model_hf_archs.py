"""Every architecture of :data:`TESTED_ARCHITECTURES` restores exactly.

One tiny seeded config per architecture (``hf_models.tiny_kwargs``), the
in-process store: a batch of two prompts is prefilled, offloaded, dropped
from the device, and prefilled again from the store. The restored prefill
must restore tokens and equal transformers' own cold forward of each whole
prompt. Real Mooncake, both policies, faults and negative controls run for
one architecture per state kind in ``test_model_hf.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import CONFIGS, build, cold_logprobs, tiny_kwargs

from layerlift import Engine, EngineConfig
from layerlift.engine.model.hf import TransformersModel
from layerlift.engine.model.hf_layout import TESTED_ARCHITECTURES
from layerlift.pools.spec import Component, KVShape
from layerlift.testing import offload_and_drop

TOL = 1e-5
LENGTHS = [90, 140]  # restore 64 and 128 tokens (checkpoints every 64)


def test_the_list_is_sorted_and_covers_the_engine_tests() -> None:
    assert list(TESTED_ARCHITECTURES) == sorted(set(TESTED_ARCHITECTURES))
    assert set(CONFIGS) <= set(TESTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", TESTED_ARCHITECTURES)
async def test_architecture_restores_exactly(arch: str) -> None:
    tiny_kwargs(arch)  # a config exists for every listed architecture
    model = build(arch)
    kinds = set(model.spec.kinds)
    assert kinds - {Component.FULL}, f"{arch} is neither hybrid nor sliding in its tiny config"
    await _restores_exactly(arch, model)


async def test_deepseek_v3_mla_restores_exactly() -> None:
    """MLA without a hybrid: DeepSeek-V3's cache holds the latent (keys
    kv_lora_rank wide, values qk_rope_head_dim wide), restored as held."""
    model = build("deepseek_v3")
    assert set(model.spec.kinds) == {Component.FULL}
    assert {model.spec.kv_shape(g) for g in range(model.spec.num_layers)} == {KVShape(1, 32, 1, 8)}
    await _restores_exactly("deepseek_v3", model)


async def _restores_exactly(arch: str, model: TransformersModel) -> None:
    rng = np.random.default_rng(11)
    batch = [rng.integers(0, 128, n).tolist() for n in LENGTHS]
    cfg = EngineConfig(store="memory", namespace=f"arch-{arch}", pool_bytes=16 << 20)
    async with Engine(model, cfg) as engine:
        await engine.prefill(batch)
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        assert [r.restored_tokens for r in again] == [64, 128]
        for tokens, result in zip(batch, again, strict=True):
            delta = float((result.next_token_logprobs - cold_logprobs(model, tokens)).abs().max())
            assert delta <= TOL, f"{arch}: restored prefill differs from cold by {delta}"
        engine.pool.verify_byte_accounting()
        engine.tree.check_integrity()
