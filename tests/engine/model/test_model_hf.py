"""transformers' hybrid models restored through a real Mooncake master equal
transformers' own cold prefill (the external oracle), and break when they must.

Page 16, checkpoints every 64 tokens, sliding window 32: prompts of 150 and
205 tokens restore 128 and 192 tokens and compute the rest, so the splits
differ per request and a batch holds two prompts of different lengths.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import CONFIGS, build, cold_logprobs, hf_model
from reference import ArrayPool, page_table

from layerlift import Engine, EngineConfig
from layerlift.engine.model import ForwardRequest
from layerlift.engine.model.hf import TransformersModel
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.pools.spec import Component
from layerlift.testing import FaultyStore, SkipLayerWaits, offload_and_drop

TOL = 1e-5
WRONG = 1e-3
LENGTHS = [150, 205]
ARCHS = sorted(CONFIGS)



def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, n).tolist() for n in lengths]


def max_delta(model: TransformersModel, batch: Sequence[list[int]], results: Sequence[object]
              ) -> float:
    return max(float((r.next_token_logprobs - cold_logprobs(model, p)).abs().max())  # type: ignore[attr-defined]
               for p, r in zip(batch, results, strict=True))


def engine_for(model: object, store: FaultyStore, namespace: str, policy: str = "overlap"
               ) -> Engine:
    cfg = EngineConfig(store="memory", policy=policy, namespace=namespace, pool_bytes=16 << 20)
    return Engine(model, cfg, store=store)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> TransformersModel:
    return build(request.param)


@pytest.mark.mooncake
@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_restore_equals_transformers_cold_prefill(
        model: TransformersModel, policy: str, mc_client: MooncakeStore, namespace: str) -> None:
    batch = prompts(LENGTHS, seed=1)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(model, store, namespace, policy) as engine:
        first = await engine.prefill(batch)
        assert max_delta(model, batch, first) <= TOL
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        assert [r.restored_tokens for r in again] == [128, 192]
        assert max_delta(model, batch, again) <= TOL
        # A longer continuation of the first prompt restores at its deepest boundary.
        longer = [batch[0] + prompts([90], seed=2)[0]]
        await offload_and_drop(engine)
        third = await engine.prefill(longer)
        assert third[0].restored_tokens == 128
        assert max_delta(model, longer, third) <= TOL
        engine.pool.verify_byte_accounting()
        engine.tree.check_integrity()


# One per state kind: DeltaNet, Mamba-2, short-conv and KDA state; sliding KV;
# MLA's compressed latent (keys and values of different widths).
CONTROLS = [("lara_mini", "mamba"), ("nemotron_h", "mamba"), ("lfm2", "mamba"),
            ("kimi_linear", "mamba"), ("lara_mini", "swa"), ("gpt_oss", "swa"),
            ("kimi_linear", "full")]


@pytest.mark.mooncake
@pytest.mark.parametrize(("arch", "component"), CONTROLS)
async def test_skipping_a_state_kind_breaks_exactness(
        arch: str, component: str, mc_client: MooncakeStore, namespace: str) -> None:
    model = build(arch)
    assert Component(component) in model.spec.kinds
    batch = prompts(LENGTHS, seed=3)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(model, store, namespace) as engine:
        await engine.prefill(batch)
        await offload_and_drop(engine)
        store.skip_reads(component)
        wrong = await engine.prefill(batch)
        assert all(r.restored_tokens > 0 for r in wrong)
        assert max_delta(model, batch, wrong) > WRONG, f"skipping {component} went unnoticed"


@pytest.mark.mooncake
@pytest.mark.parametrize("arch", ["lara_mini", "gpt_oss"])
async def test_skipping_the_layer_waits_breaks_exactness(
        arch: str, mc_client: MooncakeStore, namespace: str) -> None:
    """Layer 0's read is held until the forward returned: without the
    per-layer wait the forward reads a layer that never landed."""
    model = build(arch)
    wrapped = SkipLayerWaits(model)
    batch = prompts(LENGTHS, seed=4)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(wrapped, store, namespace) as engine:
        await engine.prefill(batch)
        await offload_and_drop(engine)
        gate = threading.Event()
        store.gate_layer(0, gate)
        wrapped.enabled = True
        task = asyncio.create_task(engine.prefill(batch))
        try:
            assert await asyncio.to_thread(wrapped.forward_done.wait, 60.0)
        finally:
            gate.set()
        wrong = await task
        assert all(r.restored_tokens > 0 for r in wrong)
        assert max_delta(model, batch, wrong) > WRONG, "skipping the waits went unnoticed"


@pytest.mark.mooncake
@pytest.mark.parametrize("arch", ["lara_mini", "nemotron_h", "kimi_linear"])
async def test_layer_fault_mid_restore_recomputes_exactly(
        arch: str, mc_client: MooncakeStore, namespace: str) -> None:
    model = build(arch)
    batch = prompts(LENGTHS, seed=5)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(model, store, namespace) as engine:
        await engine.prefill(batch)
        await offload_and_drop(engine)
        store.fail_layer(model.spec.num_layers - 1)
        out = await engine.prefill(batch)
        assert any(r.recomputed_after_failure for r in out)
        assert max_delta(model, batch, out) <= TOL
        engine.pool.verify_byte_accounting()
        engine.tree.check_integrity()


def test_from_pretrained_loads_a_saved_tiny_model(tmp_path: Path) -> None:
    path = tmp_path / "tiny-lfm2"
    hf_model("lfm2", seed=7).save_pretrained(path)
    model = TransformersModel.from_pretrained(path, revision="r1")
    assert model.identity == "hf-tiny-lfm2@r1-float32"
    assert model.spec.layers == "MFMF" and model.vocab_size == 128
    tokens = prompts([40], seed=6)[0]
    pages = page_table(0, 3)
    out = model.forward_batch([ForwardRequest(torch.tensor(tokens), 0, pages, pages, 0)],
                              ArrayPool(model.spec, max_pages=8, max_slots=4))
    assert float((out.next_token_logprobs[0] - cold_logprobs(model, tokens)).abs().max()) <= TOL


def test_kimi_linear_pages_hold_the_mla_latent() -> None:
    """MLA keys and values differ in width: Kimi Linear's cache holds the
    compressed latent (kv_lora_rank as keys, the rope key as values), and
    the pages are exactly as wide as what the cache layer holds."""
    from layerlift.pools.spec import KVShape

    model = build("kimi_linear")
    full = model.spec.layers_of(Component.FULL)
    assert model.spec.layers == "MFMF" and len(full) == 2
    assert all(model.spec.kv_shape(g) == KVShape(1, 32, 1, 8) for g in full)
    assert model.spec.layer_bytes(Component.FULL) == 16 * (32 + 8) * 4


async def test_same_directory_name_different_checkpoints_never_share_keys(
        tmp_path: Path) -> None:
    """Finding 6 of issue 16: two checkpoints saved as ``model/`` (different
    weights) get different identities, so one's KV is never restored into
    the other; the same bytes in another ``model/`` directory share it."""
    paths = [tmp_path / d / "model" for d in ("a", "b", "c")]
    for path, seed in zip(paths, (7, 8, 7), strict=True):
        hf_model("gpt_oss", seed=seed).save_pretrained(path)
    a, b, c = (TransformersModel.from_pretrained(p) for p in paths)
    assert a.identity != b.identity and a.identity == c.identity
    assert a.identity.startswith("hf-model-") and a.identity.endswith("-float32")
    batch = prompts([150], seed=9)
    inner = MemoryStore()
    cfg = EngineConfig(store="memory", namespace="same-name", pool_bytes=16 << 20)
    async with Engine(a, cfg, store=inner) as engine:  # type: ignore[arg-type]
        await engine.prefill(batch)
        await offload_and_drop(engine)
    async with Engine(b, cfg, store=inner) as engine:  # type: ignore[arg-type]
        out = await engine.prefill(batch)
        assert out[0].restored_tokens == 0, "b restored a's KV"
        assert max_delta(b, batch, out) <= TOL
    async with Engine(c, cfg, store=inner) as engine:  # type: ignore[arg-type]
        out = await engine.prefill(batch)
        assert out[0].restored_tokens == 128  # the same bytes: a's pages are c's
        assert max_delta(c, batch, out) <= TOL


def test_chunks_at_capture_positions_equal_one_pass(model: TransformersModel) -> None:
    """Without the engine: a prompt computed in one call with checkpoints at
    64 and 128 (so in three chunks) gives transformers' per-token log-probs,
    each checkpoint equals the state of a run that stopped there, and a
    continuation from a checkpoint (copy-on-write) is exact."""
    tokens = torch.tensor(prompts([150], seed=8)[0])
    pool = ArrayPool(model.spec, max_pages=3 * 256, max_slots=8)
    pages = page_table(0, 10)
    events: list[tuple[str, int]] = []
    whole = model.forward_batch(
        [ForwardRequest(tokens, 0, pages, pages, 0, None, {64: 1, 128: 2},
                        want_token_logprobs=True)], pool,
        lambda layer: events.append(("before", layer)),
        lambda layer: events.append(("after", layer)))
    with torch.no_grad():
        cold = torch.log_softmax(model.hf(tokens[None]).logits[0].float(), dim=-1)
    assert whole.token_logprobs[0] is not None
    assert float((whole.token_logprobs[0] - cold).abs().max()) <= TOL
    n = model.spec.num_layers
    # Each of the three chunks brackets every layer with before/after, in order.
    one = events[: 2 * n]
    assert events == one * 3
    assert [e for e in one if e[0] == "before"] == [("before", i) for i in range(n)]
    assert [e for e in one if e[0] == "after"] == [("after", i) for i in range(n)]
    assert all(one.index(("before", i)) < one.index(("after", i)) for i in range(n))
    page1 = page_table(1, 10)
    model.forward_batch([ForwardRequest(tokens[:128], 0, page1, page1, 3)], pool)
    mamba = model.spec.layers_of(Component.MAMBA)
    for layer in mamba:
        for view in pool.mamba_view(layer):
            torch.testing.assert_close(view[2], view[3], atol=TOL, rtol=0)
    rest = model.forward_batch([ForwardRequest(tokens[128:], 128, pages, pages, 4, 2)], pool)
    assert float((rest.next_token_logprobs[0] - cold[-1]).abs().max()) <= TOL


def test_identity_without_a_name_hashes_the_weights() -> None:
    a, b = TransformersModel(hf_model("gpt_oss", 0)), TransformersModel(hf_model("gpt_oss", 1))
    assert a.identity.startswith("hf-weights-") and a.identity != b.identity
    assert TransformersModel(hf_model("gpt_oss", 0)).identity == a.identity


@pytest.mark.parametrize(("arch", "why"), [("mamba", "restarts the recurrent scan"),
                                           ("falcon_mamba", "restarts the recurrent scan")])
def test_unsupported_architecture_is_refused_with_the_reason(arch: str, why: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               state_size=8)
    with pytest.raises(ValueError, match=why):
        TransformersModel(AutoModelForCausalLM.from_config(cfg))
