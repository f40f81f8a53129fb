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

from layerlift.engine.model import HybridModel
from layerlift.pools.spec import Component, ModelSpec


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
