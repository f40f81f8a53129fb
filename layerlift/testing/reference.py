"""Cold runs and exactness checks shared by the engine's tests.

* :func:`random_prompts`: seeded prompts of given lengths for a model;
* :func:`cold_prefills`: each prompt prefilled alone on a fresh engine
  with nothing cached (the reference a restore must equal);
* :func:`assert_exact`: every result within ``tol`` KL of its reference;
* :func:`assert_identical`: every result equal to its reference bit for bit
  (a restore against LayerLift's own recompute of the same prompt with the
  same chunking: the same kernels on the same inputs, whatever the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from layerlift.testing.kl import kl_divergence

__all__ = ["KL_RESTORED", "assert_exact", "assert_identical", "cold_prefills", "random_prompts"]

KL_RESTORED = 1e-6
"""The engine tests' bound for a restore of a float32 model against its cold
run (different chunking and attention tiles round differently; the
deterministic reference model reaches ``KL_EXACT``)."""


def random_prompts(model: Any, seed: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """One prompt of each length, token ids drawn from ``model``'s vocabulary."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.vocab_size, int(n), dtype=np.int64) for n in lengths]


async def cold_prefills(model: Any, prompts: Sequence[Any], *,
                        pool_bytes: int = 64 << 20) -> list[Any]:
    """Each prompt prefilled alone on a fresh engine (in-process store, no
    offload): the cold reference."""
    from layerlift.engine.api import Engine
    from layerlift.engine.config import EngineConfig

    cfg = EngineConfig(store="memory", offload=False, pool_bytes=pool_bytes)
    async with Engine(model, cfg) as engine:
        return [(await engine.prefill([p]))[0] for p in prompts]


def assert_exact(got: Sequence[Any], ref: Sequence[Any], tol: float = KL_RESTORED) -> None:
    """``AssertionError`` naming the KLs unless every result's next-token
    distribution is within ``tol`` of its reference."""
    kls = [kl_divergence(r.next_token_logprobs, g.next_token_logprobs)
           for g, r in zip(got, ref, strict=True)]
    assert max(kls, default=0.0) <= tol, f"results differ from cold runs: KL = {kls}"


def assert_identical(got: Sequence[Any], ref: Sequence[Any], *, what: str = "results") -> None:
    """``AssertionError`` naming ``what`` and each result's largest
    difference unless every result's next-token log-probs equal its
    reference's bit for bit (same shape, same values)."""
    assert len(got) == len(ref), f"{what}: {len(got)} results for {len(ref)} references"
    pairs = [(g.next_token_logprobs, r.next_token_logprobs) for g, r in zip(got, ref, strict=True)]
    if all(torch.equal(g, r) for g, r in pairs):
        return
    deltas = [float((g - r).abs().max()) if g.shape == r.shape else float("inf")
              for g, r in pairs]
    raise AssertionError(f"{what} differ bit for bit: max |delta log-prob| per result = {deltas}")
