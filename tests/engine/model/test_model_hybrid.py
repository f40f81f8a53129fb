"""Numerics of the paged hybrid model: paged == dense, split == whole, checkpoints."""

from __future__ import annotations

import pytest
import torch
from reference import (
    ArrayPool,
    assert_lp_close,
    assert_state_close,
    dense_logprobs,
    dense_state_at,
    page_table,
    run,
    tokens_for,
)

from layerlift.engine.model import ForwardRequest, HybridModel
from layerlift.pools.spec import Component, ModelSpec
from layerlift.testing import KL_EXACT, kl_divergence


@pytest.mark.parametrize(("preset", "n"), [("tiny", 333), ("tiny128", 420)])
def test_paged_forward_matches_dense_reference(preset: str, n: int) -> None:
    spec = ModelSpec.preset(preset)
    model = HybridModel(spec, seed=0)
    tokens = tokens_for(spec, n)
    out = run(model, ArrayPool(spec, max_pages=512), tokens)
    want = dense_logprobs(model, tokens)
    assert_lp_close(out.token_logprobs[0], want)
    assert torch.equal(out.next_token_logprobs[0], out.token_logprobs[0][-1])


def test_outputs_are_far_from_uniform_and_depend_on_context() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    a, b = tokens_for(spec, 200, seed=1), tokens_for(spec, 200, seed=2)
    b[-1] = a[-1]  # same last token: any difference comes from the context
    lp_a, lp_b = dense_logprobs(model, a)[-1], dense_logprobs(model, b)[-1]
    entropy = float(-(lp_a.exp() * lp_a).sum())
    assert entropy < torch.log(torch.tensor(model.vocab_size)).item() - 2.0
    kl = float((lp_a.exp() * (lp_a - lp_b)).sum())
    assert kl > 0.1, f"context barely matters (KL {kl:.3g})"


SPLIT_LAYOUTS = ["FSMSFSMM", "FFSM", "MSFM", "SMFS"]


@pytest.mark.parametrize("layers", SPLIT_LAYOUTS)
def test_split_at_every_page_boundary_matches_whole(layers: str) -> None:
    # track_interval = page_size so a checkpoint may sit at every boundary;
    # a 48-token window so the suffix has SWA pages it must never read.
    spec = ModelSpec(layers=layers, page_size=16, swa_window=48, track_interval=16)
    model = HybridModel(spec, seed=3)
    pool = ArrayPool(spec, max_pages=4 * 256 + 1)
    poison = 4 * 256  # a page full of NaN: reading it anywhere would poison the output
    for layer in spec.layers_of(Component.SWA):
        for cache in pool.kv_view(layer):
            cache[poison] = float("nan")
    n = 150
    tokens = tokens_for(spec, n)
    whole = run(model, pool, tokens, table=0, slot=0).token_logprobs[0]
    assert whole is not None
    for b in range(16, n, 16):
        first = run(model, pool, tokens[:b], table=1, slot=1, capture={b: 2})
        assert_lp_close(first.token_logprobs[0], whole[:b])
        swa = page_table(1, -(-n // 16)).clone()
        swa[: max(0, b - spec.swa_window + 1) // 16] = poison
        rest = tokens[b:]
        for slot, cow in ((3, 2), (1, None)):  # from the checkpoint, then from the slot
            out = run(model, pool, rest, prefix_len=b, table=1, slot=slot, cow=cow, swa_table=swa)
            assert_lp_close(out.token_logprobs[0], whole[b:])


def test_captured_state_equals_state_computed_up_to_boundary() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    pool = ArrayPool(spec, max_pages=512)
    tokens = tokens_for(spec, 300)
    capture = {64: 10, 128: 11, 192: 12, 256: 13}
    run(model, pool, tokens, table=0, slot=0, capture=capture)
    assert_state_close(pool.state(0), dense_state_at(model, tokens, 300))
    for p, slot in capture.items():
        run(model, pool, tokens[:p], table=1, slot=1)
        assert_state_close(pool.state(slot), pool.state(1))
        assert_state_close(pool.state(slot), dense_state_at(model, tokens, p))


def test_capture_in_a_continuation_and_at_its_last_token() -> None:
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0)
    pool = ArrayPool(spec, max_pages=512)
    tokens = tokens_for(spec, 256)
    run(model, pool, tokens[:80], table=0, slot=0)
    run(model, pool, tokens[80:], prefix_len=80, table=0, slot=0, capture={128: 5, 256: 6})
    assert_state_close(pool.state(5), dense_state_at(model, tokens, 128))
    assert_state_close(pool.state(6), pool.state(0))


def test_kv_dtype_bfloat16_split_matches_whole() -> None:
    spec = ModelSpec.preset("tiny", dtype="bfloat16")
    model = HybridModel(spec, seed=0)
    pool = ArrayPool(spec, max_pages=512)
    tokens = tokens_for(spec, 200)
    whole = run(model, pool, tokens, table=0, slot=0).token_logprobs[0]
    assert whole is not None
    run(model, pool, tokens[:128], table=1, slot=1)
    rest = run(model, pool, tokens[128:], prefix_len=128, table=1, slot=1).token_logprobs[0]
    # Same cached bytes on both paths; only float32 rounding of the chunking
    # can differ, occasionally flipping one bfloat16 rounding of a K/V value.
    torch.testing.assert_close(rest, whole[128:], atol=2e-2, rtol=0)
    f32 = dense_logprobs(HybridModel(ModelSpec.preset("tiny"), seed=0), tokens)
    assert float((whole.exp() * (whole - f32)).sum(-1).max()) < 0.05  # close to float32 KV


# ---- deterministic mode (float64 compute around the stored bytes) ---------------------
def _row_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Largest per-row KL(p || q) of two ``[n, vocab]`` log-prob tables."""
    return max(kl_divergence(a, b) for a, b in zip(p, q, strict=True))


def test_deterministic_mode_is_a_float64_model_with_its_own_identity() -> None:
    spec = ModelSpec.preset("tiny")
    f32, f64 = HybridModel(spec, seed=0), HybridModel(spec, seed=0, deterministic=True)
    assert f64.deterministic and not f32.deterministic
    assert f64.embed.dtype == torch.float64 and f32.embed.dtype == torch.float32
    assert torch.equal(f64.embed.float(), f32.embed)  # the same weights, upcast
    assert f64.identity == f32.identity + "-f64"  # other KV bytes: other store keys
    pool = ArrayPool(spec, max_pages=512)
    out = run(f64, pool, tokens_for(spec, 100), table=0, slot=0)
    assert out.next_token_logprobs.dtype == torch.float32
    assert out.token_logprobs[0] is not None and out.token_logprobs[0].dtype == torch.float32
    # Still the model of the dense reference (computed in float64 from the same weights).
    assert_lp_close(out.token_logprobs[0], dense_logprobs(f64, tokens_for(spec, 100)).float())


# Split points: page boundaries off the 64-token scan chunks and the 256-query SWA
# tiles of a whole run (16, 80, 272), on them (256) and deep in (592).
SPLITS = [16, 80, 256, 272, 592]


@pytest.mark.parametrize("deterministic", [True, False])
def test_split_equals_whole(deterministic: bool) -> None:
    """A continuation from a checkpoint equals the whole prompt: within KL 1e-9
    per token in deterministic mode, and (documented bound of the float32
    mode) within the float32 tolerance of ``assert_lp_close`` otherwise."""
    spec = ModelSpec(layers="FSMSFSMM", page_size=16, swa_window=48, track_interval=16)
    model = HybridModel(spec, seed=3, deterministic=deterministic)
    pool = ArrayPool(spec, max_pages=8 * 256)
    n = 640
    tokens = tokens_for(spec, n)
    whole = run(model, pool, tokens, table=0, slot=0).token_logprobs[0]
    assert whole is not None
    for i, b in enumerate(SPLITS):
        run(model, pool, tokens[:b], table=1 + i, slot=1, capture={b: 2 + i})
        rest = run(model, pool, tokens[b:], prefix_len=b, table=1 + i, slot=10 + i,
                   cow=2 + i).token_logprobs[0]
        assert rest is not None
        if deterministic:
            assert _row_kl(whole[b:], rest) <= KL_EXACT, b
        else:
            assert_lp_close(rest, whole[b:])


def test_deterministic_batch_equals_single() -> None:
    """Packing other requests into the batch changes every matmul's shape; in
    deterministic mode the result moves by float64 rounding only."""
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, deterministic=True)
    pool = ArrayPool(spec, max_pages=8 * 256)
    seqs = [tokens_for(spec, n, seed=s) for s, n in ((1, 300), (2, 77), (3, 520))]
    reqs = [ForwardRequest(t, 0, page_table(i, -(-len(t) // 16)), page_table(i, -(-len(t) // 16)),
                           i, None, {}) for i, t in enumerate(seqs)]
    batch = model.forward_batch(reqs, pool).next_token_logprobs
    for i, t in enumerate(seqs):
        single = run(model, pool, t, table=4 + i, slot=4 + i).next_token_logprobs[0]
        assert kl_divergence(batch[i], single) <= KL_EXACT
