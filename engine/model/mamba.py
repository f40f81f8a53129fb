"""Mamba-2-style mixer whose recurrent state lives in pool slots.

Per layer a slot holds ``conv`` ``[conv_dim, d_conv-1]`` (the last ``d_conv-1``
pre-convolution inputs, oldest first; zeros at sequence start) and ``ssm``
``[heads, head_dim, d_state]``, both float32. A forward continues *exactly*
from the slot's state, writes the state after its last token back into the
slot and, on request, the state at intermediate boundaries into other slots
(checkpoints).

The mixer computes in its weights' dtype. Whatever it reads back later (the
conv inputs kept in ``conv``, the ``ssm`` state) is rounded to the slot's
dtype before it is used, so a continuation from a slot computes what the
uninterrupted run did. With ``align_state`` (the reference model's
deterministic mode) the ``ssm`` state is also rounded at every multiple of
that many tokens (every page boundary), where a restore may continue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerlift.engine.model.api import ForwardRequest, PoolViews
from layerlift.engine.model.layers import Span, const_param, normal_param
from layerlift.engine.model.ssd import ssd_scan
from layerlift.pools.spec import ModelDims, ModelSpec

__all__ = ["Mamba2Shape", "MambaMixer"]


@dataclass(frozen=True, slots=True)
class Mamba2Shape:
    """The mixer's widths, from the reference model's :class:`ModelDims`."""

    num_heads: int
    head_dim: int
    d_state: int
    d_conv: int

    @classmethod
    def of(cls, dims: ModelDims) -> Mamba2Shape:
        return cls(dims.mamba_heads, dims.mamba_head_dim, dims.mamba_d_state, dims.mamba_d_conv)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.d_state


def _dt_bias(g: torch.Generator, heads: int) -> torch.Tensor:
    """Mamba-2's init: ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1]."""
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(heads, generator=g) * (hi - lo) + lo)
    return dt + torch.log(-torch.expm1(-dt))  # inverse softplus


class MambaMixer(nn.Module):
    """``in_proj -> (z, xBC, dt)``; causal depthwise conv + SiLU on xBC; split
    into x ``[heads, head_dim]``, B, C ``[d_state]`` (one group); selective scan
    with ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` and skip ``D``;
    ``y * silu(z)``; ``out_proj``."""

    def __init__(self, spec: ModelSpec, g: torch.Generator, out_std: float,
                 align_state: int | None = None) -> None:
        super().__init__()
        m = Mamba2Shape.of(spec.dims)
        self.m = m
        self.align_state = align_state
        d = spec.dims.hidden_size
        self.in_proj = normal_param(g, 2 * m.d_inner + 2 * m.d_state + m.num_heads, d, std=d**-0.5)
        self.conv_w = normal_param(g, m.conv_dim, m.d_conv, std=m.d_conv**-0.5)
        self.conv_b = normal_param(g, m.conv_dim, std=0.1)
        self.dt_bias = const_param(_dt_bias(g, m.num_heads))
        self.a_log = const_param(torch.log(1.0 + 15.0 * torch.rand(m.num_heads, generator=g)))
        self.d_skip = const_param(torch.ones(m.num_heads))
        self.out_proj = normal_param(g, d, m.d_inner, std=out_std * m.d_inner**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        spans: Sequence[Span],
        requests: Sequence[ForwardRequest],
        pool: PoolViews,
        layer: int,
    ) -> torch.Tensor:
        """Mix every packed row of ``x`` ``[total_tokens, hidden]``, reading and
        writing the requests' state slots of ``layer``. Must run only after the
        engine's ``before_layer(layer)``: it performs the copy-on-write."""
        m = self.m
        z, xbc, dt_raw = torch.split(
            x @ self.in_proj.T, [m.d_inner, m.conv_dim, m.num_heads], dim=-1
        )
        conv_v, ssm_v = pool.mamba_view(layer)
        y = torch.empty(x.shape[0], m.d_inner, dtype=x.dtype, device=x.device)
        for span, req in zip(spans, requests, strict=True):
            rows = slice(span.start, span.stop)
            y[rows] = self._one(xbc[rows], dt_raw[rows], req, conv_v, ssm_v)
        return torch.matmul(y * F.silu(z), self.out_proj.T)

    def _load_state(
        self, req: ForwardRequest, conv_v: torch.Tensor, ssm_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state at ``prefix_len``, after the copy-on-write / zero init."""
        slot = req.mamba_slot
        if req.mamba_cow_src is not None:
            conv_v[slot].copy_(conv_v[req.mamba_cow_src])
            ssm_v[slot].copy_(ssm_v[req.mamba_cow_src])
        elif req.prefix_len == 0:
            conv_v[slot].zero_()
            ssm_v[slot].zero_()
        return conv_v[slot].clone(), ssm_v[slot].clone()

    def _one(
        self,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        req: ForwardRequest,
        conv_v: torch.Tensor,
        ssm_v: torch.Tensor,
    ) -> torch.Tensor:
        """One request: conv + scan from its slot; returns ``y`` ``[n_new, d_inner]``."""
        m = self.m
        n, dtype = xbc.shape[0], xbc.dtype
        conv0, ssm0 = self._load_state(req, conv_v, ssm_v)
        # The conv input history: the saved last d_conv-1 inputs, then the new ones,
        # rounded as the slot will keep them (a no-op when both are float32).
        xbc = xbc.to(conv_v.dtype).to(dtype)
        hist = torch.cat((conv0.to(dtype), xbc.T), dim=1)  # [conv_dim, d_conv-1+n]
        if dtype == torch.float64:
            # F.conv1d's float64 path on CPUs is ~25x slower than this multiply-sum
            # over sliding windows (oldest input first); float32 keeps F.conv1d.
            windows = hist.unfold(1, m.d_conv, 1)  # [conv_dim, n, d_conv]
            xc = (windows * self.conv_w[:, None, :]).sum(-1) + self.conv_b[:, None]
        else:
            xc = F.conv1d(hist[None], self.conv_w[:, None, :], self.conv_b, groups=m.conv_dim)[0]
        xc = F.silu(xc.T)  # [n, conv_dim]
        xs, b, c = torch.split(xc, [m.d_inner, m.d_state, m.d_state], dim=-1)
        xs = xs.reshape(n, m.num_heads, m.head_dim)
        dt = F.softplus(dt_raw + self.dt_bias)
        cuts = {p - req.prefix_len for p in req.capture}
        if self.align_state is not None:
            a = self.align_state
            cuts.update(range(-(-(req.prefix_len + 1) // a) * a - req.prefix_len, n, a))
        y, states = ssd_scan(xs, dt, -torch.exp(self.a_log), b, c, ssm0.to(dtype), sorted(cuts),
                             state_dtype=ssm_v.dtype)
        y = y + self.d_skip[:, None] * xs
        k = m.d_conv - 1
        for pos, slot in req.capture.items():
            j = pos - req.prefix_len
            conv_v[slot].copy_(hist[:, j : j + k])
            ssm_v[slot].copy_(states[j])
        conv_v[req.mamba_slot].copy_(hist[:, n : n + k])
        ssm_v[req.mamba_slot].copy_(states[n])
        return torch.reshape(y, (n, m.d_inner))
