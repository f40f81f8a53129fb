"""Building blocks shared by every layer of the reference hybrid model.

Weights are drawn from an explicit ``torch.Generator`` (never the global RNG),
so building a model has no side effect on other code's randomness and the same
seed gives bitwise the same weights on every machine. Parameters are frozen:
the model is for serving, never trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "ROPE_THETA",
    "GatedMLP",
    "RMSNorm",
    "Span",
    "apply_rope",
    "const_param",
    "normal_param",
    "rope_cos_sin",
]

ROPE_THETA = 10_000.0
"""RoPE base frequency (the usual Llama value)."""


@dataclass(frozen=True, slots=True)
class Span:
    """Where one request's new tokens sit in the packed batch.

    Rows ``start:stop`` of every packed ``[total_tokens, ...]`` tensor belong to
    this request; they are the tokens at absolute positions
    ``prefix_len .. prefix_len + (stop - start) - 1``.
    """

    start: int
    stop: int
    prefix_len: int

    @property
    def n_new(self) -> int:
        return self.stop - self.start

    @property
    def total(self) -> int:
        """Tokens in the sequence once the new ones are added."""
        return self.prefix_len + self.n_new


def normal_param(g: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    """A frozen float32 parameter drawn from ``N(0, std^2)`` with generator ``g``."""
    data = torch.randn(*shape, generator=g, dtype=torch.float32) * std
    return nn.Parameter(data, requires_grad=False)


def const_param(data: torch.Tensor) -> nn.Parameter:
    """A frozen float32 parameter holding ``data``."""
    return nn.Parameter(data.to(torch.float32), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (initialised to one)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = const_param(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * inv * self.weight


class GatedMLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, g: torch.Generator, hidden: int, inter: int, out_std: float) -> None:
        super().__init__()
        # In-projections keep unit variance on a normalised input; the output
        # projection is scaled down with depth so the residual stays O(1).
        self.gate = normal_param(g, inter, hidden, std=hidden**-0.5)
        self.up = normal_param(g, inter, hidden, std=hidden**-0.5)
        self.down = normal_param(g, hidden, inter, std=out_std * inter**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)
        return h @ self.down.T


def rope_cos_sin(positions: torch.Tensor, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[len(positions), head_dim // 2]`` in ``dtype``
    for absolute positions."""
    half = head_dim // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    # float64 angles: positions of several thousand times a frequency near one
    # lose digits in float32, and the paged and dense paths must agree.
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by its absolute ``positions`` ``[T]``
    (rotate-half convention), in ``x``'s dtype."""
    cos, sin = rope_cos_sin(positions.to(x.device), x.shape[-1], x.dtype)
    cos, sin = cos[:, None, :].to(x.device), sin[:, None, :].to(x.device)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
