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
from layerlift.engine.model.hf_layout import TESTED_ARCHITECTURES
from layerlift.pools.spec import Component
from layerlift.testing import offload_and_drop

TOL = 1e-5
LENGTHS = [150, 205]  # restore 128 and 192 tokens (checkpoints every 64)


def test_the_list_is_sorted_and_covers_the_engine_tests() -> None:
    assert list(TESTED_ARCHITECTURES) == sorted(set(TESTED_ARCHITECTURES))
    assert set(CONFIGS) <= set(TESTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", TESTED_ARCHITECTURES)
async def test_architecture_restores_exactly(arch: str) -> None:
    tiny_kwargs(arch)  # a config exists for every listed architecture
    model = build(arch)
    kinds = set(model.spec.kinds)
    assert kinds - {Component.FULL}, f"{arch} is neither hybrid nor sliding in its tiny config"
    rng = np.random.default_rng(11)
    batch = [rng.integers(0, 128, n).tolist() for n in LENGTHS]
    cfg = EngineConfig(store="memory", namespace=f"arch-{arch}", pool_bytes=16 << 20)
    async with Engine(model, cfg) as engine:
        await engine.prefill(batch)
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        assert [r.restored_tokens for r in again] == [128, 192]
        for tokens, result in zip(batch, again, strict=True):
            delta = float((result.next_token_logprobs - cold_logprobs(model, tokens)).abs().max())
            assert delta <= TOL, f"{arch}: restored prefill differs from cold by {delta}"
        engine.pool.verify_byte_accounting()
        engine.tree.check_integrity()
