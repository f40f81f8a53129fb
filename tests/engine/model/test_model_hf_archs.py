"""Every architecture of :data:`TESTED_ARCHITECTURES` restores exactly, and
the adapter computes what transformers computes.

One tiny seeded config per architecture (``hf_models.tiny_kwargs``), the
in-process store, and in one test per architecture (one build) two oracles
that hold on every set of CPU kernels (``scripts/test_kernels.sh`` runs this
module under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and the machine's own;
``scripts/kernel_table.py`` prints the figures):

* **restore**: a batch of two prompts is prefilled, offloaded, dropped from
  the device and prefilled again from the store; each restored result must
  equal LayerLift's own first (computed) prefill of that prompt bit for bit.
  Both cut the prompt at the same positions (checkpoints every 64 tokens:
  the restore continues where the first prefill's chunk began), so the
  same kernels run on the same inputs: measured 0.0 for every architecture
  under all three kernel sets.
* **fidelity**: then the same weights widened to float64, the 140-token
  prompt prefilled cold by the engine (chunked at 64 and 128) against
  transformers' own ``model(full_ids)``. Not in float32: there the chunked and the whole
  forward differ by rounding (~1e-6), and a MoE router whose top-k margin
  is that small flips, kernel set by kernel set (granitemoehybrid: 8.1e-4
  under avx2 and avx512, 9.5e-7 under default).

Real Mooncake, both policies, faults and the negative controls that must
break exactness (one per state kind) run in ``test_model_hf.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import CONFIGS, build, cold_logprobs, tiny_kwargs, to_float64

from layerlift import Engine, EngineConfig
from layerlift.engine.model.hf import TransformersModel
from layerlift.engine.model.hf_layout import TESTED_ARCHITECTURES
from layerlift.pools.spec import Component, KVShape
from layerlift.testing import offload_and_drop
from layerlift.testing.reference import assert_identical, cold_prefills

LENGTHS = [90, 140]  # restore 64 and 128 tokens (checkpoints every 64)
FIDELITY_TOL = 1e-5
"""Engine cold vs transformers in float64: both round float64 logits to
float32 once and take a float32 log-softmax, measured <= 9.5e-7 for every
architecture under each of the three kernel sets; a wrong position, mask or
state moves log-probs by 1e-3 and more."""
ROUTER_MARGIN = 1e-5
"""A router that stays float32 in the float64 copy (Inkling2's) ranks sigmoid
scores (~0.5, float32 spacing 6e-8) computed from inputs that agree to
float32 rounding: top-k margins above this cannot flip between the chunked
and the whole forward (measured smallest margin 6.2e-5)."""


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 128, n).tolist() for n in LENGTHS]


def test_the_list_is_sorted_and_covers_the_engine_tests() -> None:
    assert list(TESTED_ARCHITECTURES) == sorted(set(TESTED_ARCHITECTURES))
    assert set(CONFIGS) <= set(TESTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", TESTED_ARCHITECTURES)
async def test_architecture_restores_exactly(arch: str) -> None:
    """Both oracles, on one build: the restore in float32, then fidelity
    with the same weights widened to float64."""
    tiny_kwargs(arch)  # a config exists for every listed architecture
    model = build(arch)
    kinds = set(model.spec.kinds)
    assert kinds - {Component.FULL}, f"{arch} is neither hybrid nor sliding in its tiny config"
    await _restores_exactly(arch, model)
    await _computes_what_transformers_computes(arch, model)


async def test_deepseek_v3_mla_restores_exactly() -> None:
    """MLA without a hybrid: DeepSeek-V3's cache holds the latent (keys
    kv_lora_rank wide, values qk_rope_head_dim wide), restored as held."""
    model = build("deepseek_v3")
    assert set(model.spec.kinds) == {Component.FULL}
    assert {model.spec.kv_shape(g) for g in range(model.spec.num_layers)} == {KVShape(1, 32, 1, 8)}
    await _restores_exactly("deepseek_v3", model)
    await _computes_what_transformers_computes("deepseek_v3", model)


async def _restores_exactly(arch: str, model: TransformersModel) -> None:
    batch = prompts()
    cfg = EngineConfig(store="memory", namespace=f"arch-{arch}", pool_bytes=16 << 20)
    async with Engine(model, cfg) as engine:
        first = await engine.prefill(batch)
        assert [r.restored_tokens for r in first] == [0, 0]
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        assert [r.restored_tokens for r in again] == [64, 128]
        assert_identical(again, first, what=f"{arch}: restored prefill vs its recompute")
        engine.pool.verify_byte_accounting()
        engine.tree.check_integrity()


async def _computes_what_transformers_computes(arch: str, model: TransformersModel) -> None:
    """``model`` is widened to float64 in place: for cold prefills only."""
    margins = to_float64(model)
    tokens = prompts()[1]  # three chunks: [0, 64), [64, 128), [128, 140)
    (cold,) = await cold_prefills(model, [tokens], pool_bytes=16 << 20)
    assert cold.restored_tokens == 0  # the float64 model must never restore float32 pages
    delta = float((cold.next_token_logprobs - cold_logprobs(model, tokens)).abs().max())
    assert min(margins, default=1.0) > ROUTER_MARGIN, (
        f"{arch}: a float32 router's top-k margin {min(margins)} is too narrow for this oracle")
    assert delta <= FIDELITY_TOL, (
        f"{arch}: the engine's cold prefill differs from transformers' by {delta} in float64")
