"""One KL helper for tests and benchmarks: is a restored next-token
distribution the cold one?"""

from __future__ import annotations

import torch

__all__ = ["KL_EXACT", "KL_WRONG", "kl_divergence"]

KL_EXACT = 1e-9
"""At most this: the same distribution (float32 rounding of identical math)."""
KL_WRONG = 1e-6
"""More than this: a different distribution (what negative controls must reach)."""


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """KL(p || q) of two next-token distributions given as log-probs.

    Computed in float64 after renormalising both: float32 log-probs are
    normalised only to ~1e-7, which would otherwise dominate the first-order
    term. Clamped at 0 (rounding can make an exact match slightly negative).
    Raises ``ValueError`` when the shapes differ.
    """
    if p_logprobs.shape != q_logprobs.shape:
        raise ValueError(
            f"cannot compare distributions of shapes {tuple(p_logprobs.shape)} and "
            f"{tuple(q_logprobs.shape)}"
        )
    p = torch.log_softmax(p_logprobs.double(), -1)
    q = torch.log_softmax(q_logprobs.double(), -1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))
