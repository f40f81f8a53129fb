"""transformers' hybrid models restored through a real Mooncake master equal
LayerLift's own recompute of the same prompts bit for bit, break when they
must, and compute chunk by chunk what transformers computes in one pass.

Page 16, checkpoints every 64 tokens, sliding window 32: prompts of 150 and
205 tokens restore 128 and 192 tokens and compute the rest, so the splits
differ per request and a batch holds two prompts of different lengths. A
restore and its recompute cut a prompt at the same checkpoints, so they run
the same kernels on the same inputs (bit for bit on any CPU); the external
oracle, transformers' own ``model(full_ids)``, is compared in float64 (see
``test_model_hf_archs.py`` for why not in float32).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import CONFIGS, build, build_float64, cold_logprobs, hf_model
from reference import ArrayPool, page_table

from layerlift import Engine, EngineConfig
from layerlift.engine.model import ForwardRequest
from layerlift.engine.model.hf import TransformersModel
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.pools.spec import Component
from layerlift.testing import FaultyStore, SkipLayerWaits, offload_and_drop
from layerlift.testing.reference import assert_identical, cold_prefills

TOL = 1e-5
"""transformers in float64 against the engine, or a one-chunk float32 forward
of a model without a router: float32 rounding of the log-probs only
(measured <= 1e-6 under ATEN_CPU_CAPABILITY default, avx2 and avx512)."""
WRONG = 1e-3
LENGTHS = [150, 205]
ARCHS = sorted(CONFIGS)



def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, n).tolist() for n in lengths]


def max_delta(model: TransformersModel, batch: Sequence[list[int]], results: Sequence[object]
              ) -> float:
    """The largest difference from transformers' own cold forward."""
    return max(float((r.next_token_logprobs - cold_logprobs(model, p)).abs().max())  # type: ignore[attr-defined]
               for p, r in zip(batch, results, strict=True))


def max_diff(results: Sequence[object], refs: Sequence[object]) -> float:
    """The largest difference between results and their references."""
    return max(float((r.next_token_logprobs - f.next_token_logprobs).abs().max())  # type: ignore[attr-defined]
               for r, f in zip(results, refs, strict=True))


def engine_for(model: object, store: FaultyStore, namespace: str, policy: str = "overlap"
               ) -> Engine:
    cfg = EngineConfig(store="memory", policy=policy, namespace=namespace, pool_bytes=16 << 20)
    return Engine(model, cfg, store=store)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> TransformersModel:
    return build(request.param)


@pytest.mark.mooncake
@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_restore_equals_the_recompute(
        model: TransformersModel, policy: str, mc_client: MooncakeStore, namespace: str) -> None:
    batch = prompts(LENGTHS, seed=1)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(model, store, namespace, policy) as engine:
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        assert [r.restored_tokens for r in again] == [128, 192]
        assert_identical(again, first, what="restored prefills vs their first prefill")
        # A longer continuation of the first prompt restores at its deepest boundary.
        longer = [batch[0] + prompts([90], seed=2)[0]]
        await offload_and_drop(engine)
        third = await engine.prefill(longer)
        assert third[0].restored_tokens == 128
        cold = await cold_prefills(model, longer, pool_bytes=16 << 20)
        assert_identical(third, cold, what="a restored continuation vs its cold prefill")
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
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
        store.skip_reads(component)
        wrong = await engine.prefill(batch)
        assert all(r.restored_tokens > 0 for r in wrong)
        assert max_diff(wrong, first) > WRONG, f"skipping {component} went unnoticed"


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
        first = await engine.prefill(batch)
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
        assert max_diff(wrong, first) > WRONG, "skipping the waits went unnoticed"


@pytest.mark.mooncake
@pytest.mark.parametrize("arch", ["lara_mini", "nemotron_h", "kimi_linear"])
async def test_layer_fault_mid_restore_recomputes_exactly(
        arch: str, mc_client: MooncakeStore, namespace: str) -> None:
    model = build(arch)
    batch = prompts(LENGTHS, seed=5)
    store = FaultyStore(mc_client, model.spec)
    async with engine_for(model, store, namespace) as engine:
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
        store.fail_layer(model.spec.num_layers - 1)
        out = await engine.prefill(batch)
        assert any(r.recomputed_after_failure for r in out)
        assert_identical(out, first, what="prefills recomputed after a failed layer")
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
    # one chunk, and lfm2 has no router to flip: float32 rounding only
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
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
    async with Engine(b, cfg, store=inner) as engine:  # type: ignore[arg-type]
        out = await engine.prefill(batch)
        assert out[0].restored_tokens == 0, "b restored a's KV"
        assert_identical(out, await cold_prefills(b, batch, pool_bytes=16 << 20), what="b")
        assert max_diff(out, first) > WRONG  # b's own result, not a's
    async with Engine(c, cfg, store=inner) as engine:  # type: ignore[arg-type]
        out = await engine.prefill(batch)
        assert out[0].restored_tokens == 128  # the same bytes: a's pages are c's
        assert_identical(out, first, what="c restored from a's pages vs a's prefill")


def test_chunks_at_capture_positions_continue_exactly(model: TransformersModel) -> None:
    """Without the engine: a prompt computed in one call with checkpoints at
    64 and 128 runs in three chunks, each bracketing every layer with
    before/after in order; each checkpoint equals the state of a run that
    stopped there, and a continuation from a checkpoint (copy-on-write)
    equals the run that went on (bit for bit: both cut at 64 and 128)."""
    tokens = torch.tensor(prompts([150], seed=8)[0])
    pool = ArrayPool(model.spec, max_pages=3 * 256, max_slots=8)
    pages = page_table(0, 10)
    events: list[tuple[str, int]] = []
    whole = model.forward_batch(
        [ForwardRequest(tokens, 0, pages, pages, 0, None, {64: 1, 128: 2},
                        want_token_logprobs=True)], pool,
        lambda layer: events.append(("before", layer)),
        lambda layer: events.append(("after", layer)))
    n = model.spec.num_layers
    # Each of the three chunks brackets every layer with before/after, in order.
    one = events[: 2 * n]
    assert events == one * 3
    assert [e for e in one if e[0] == "before"] == [("before", i) for i in range(n)]
    assert [e for e in one if e[0] == "after"] == [("after", i) for i in range(n)]
    assert all(one.index(("before", i)) < one.index(("after", i)) for i in range(n))
    page1 = page_table(1, 10)
    model.forward_batch([ForwardRequest(tokens[:128], 0, page1, page1, 3, None, {64: 5})], pool)
    mamba = model.spec.layers_of(Component.MAMBA)
    for layer in mamba:
        for view in pool.mamba_view(layer):
            assert torch.equal(view[1], view[5]) and torch.equal(view[2], view[3])
    rest = model.forward_batch([ForwardRequest(tokens[128:], 128, pages, pages, 4, 2,
                                               want_token_logprobs=True)], pool)
    assert whole.token_logprobs[0] is not None and rest.token_logprobs[0] is not None
    assert torch.equal(rest.token_logprobs[0], whole.token_logprobs[0][128:])


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_compute_what_transformers_computes(arch: str) -> None:
    """In float64 (``build_float64``; why not float32: ``test_model_hf_archs.py``):
    the three chunks' per-token log-probs are transformers' one pass."""
    model, float32_routers = build_float64(arch)
    tokens = torch.tensor(prompts([150], seed=8)[0])
    pool = ArrayPool(model.spec, max_pages=3 * 256, max_slots=8)
    pages = page_table(0, 10)
    whole = model.forward_batch(
        [ForwardRequest(tokens, 0, pages, pages, 0, None, {64: 1, 128: 2},
                        want_token_logprobs=True)], pool)
    with torch.no_grad():
        cold = torch.log_softmax(model.hf(tokens[None]).logits[0].float(), dim=-1)
    assert not float32_routers, "a float32 router: check its margins (test_model_hf_archs.py)"
    assert whole.token_logprobs[0] is not None
    assert float((whole.token_logprobs[0] - cold).abs().max()) <= TOL


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
