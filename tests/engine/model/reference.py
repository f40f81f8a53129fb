"""Test-only helpers: a plain array pool and a dense reference of the model.

The dense reference recomputes :class:`HybridModel`'s math on a whole sequence
with plain tensors - no pools, no paging, explicit causal/window masks and the
Mamba recurrence one token at a time - reusing only the model's parameters.
It is deliberately written differently from the paged, chunked model so that
the two agreeing means something.
"""

from __future__ import annotations

import torch

from layerlift.engine.model import ForwardOutput, ForwardRequest, HybridModel
from layerlift.engine.model.mamba import Mamba2Shape
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.views import kv_layer_view, mamba_layer_view

__all__ = [
    "PAGE_STRIDE",
    "TOL",
    "ArrayPool",
    "assert_lp_close",
    "assert_state_close",
    "dense_logprobs",
    "dense_state_at",
    "page_table",
    "run",
    "tokens_for",
]

PAGE_STRIDE = 256
"""Request ``r`` of a test uses pages ``r * PAGE_STRIDE + i``."""


def page_table(request: int, n_pages: int) -> torch.Tensor:
    """The page table test request ``request`` uses."""
    if n_pages > PAGE_STRIDE:
        raise ValueError(f"tests use at most {PAGE_STRIDE} pages per request")
    return torch.arange(n_pages, dtype=torch.int64) + request * PAGE_STRIDE


class ArrayPool:
    """A fixed pool: one zeroed uint8 ``buffer`` cut into a FULL, an SWA and a
    MAMBA region. Each region is indexed physically from its own start (the
    views' layout); separate regions keep FULL page ``i``, SWA page ``i`` and
    slot ``i`` from aliasing each other's bytes, which the real allocator
    guarantees by handing out disjoint pages."""

    def __init__(self, spec: ModelSpec, max_pages: int = 8 * PAGE_STRIDE, max_slots: int = 64):
        self.spec = spec
        sizes = {
            Component.FULL: max_pages * spec.page_bytes(Component.FULL),
            Component.SWA: max_pages * spec.page_bytes(Component.SWA),
            Component.MAMBA: max_slots * spec.page_bytes(Component.MAMBA),
        }
        self.buffer = torch.zeros(sum(sizes.values()), dtype=torch.uint8)
        self.regions: dict[Component, torch.Tensor] = {}
        offset = 0
        for comp, size in sizes.items():
            self.regions[comp] = self.buffer[offset : offset + size]
            offset += size

    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self.spec.kinds[layer]
        return kv_layer_view(self.regions[kind], self.spec, kind, self.spec.local_index(layer))

    def mamba_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        region = self.regions[Component.MAMBA]
        return mamba_layer_view(region, self.spec, self.spec.local_index(layer))

    def state(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every Mamba layer's (conv, ssm) state in ``slot``."""
        return [
            tuple(v[slot].clone() for v in self.mamba_view(layer))  # type: ignore[misc]
            for layer in self.spec.layers_of(Component.MAMBA)
        ]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, dim]`` pairwise (i, i + dim/2) by angle
    ``t * theta^(-i/(dim/2))``; angles in float64 as in the model."""
    t, _, dim = x.shape
    half = dim // 2
    freq = torch.tensor([10_000.0 ** (-i / half) for i in range(half)], dtype=torch.float64)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _attention(
    mixer: torch.nn.Module, x: torch.Tensor, spec: ModelSpec, window: int
) -> torch.Tensor:
    t = x.shape[0]
    h, kvh, hd = spec.dims.num_heads, spec.num_kv_heads, spec.head_dim
    q = _rope((x @ mixer.wq.T).reshape(t, h, hd))
    k = _rope((x @ mixer.wk.T).reshape(t, kvh, hd))
    v = (x @ mixer.wv.T).reshape(t, kvh, hd)
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    outs = []
    for head in range(h):
        kv = head // (h // kvh)  # grouped-query: consecutive query heads share a KV head
        scores = (q[:, head] @ k[:, kv].T) / hd**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v[:, kv])
    return torch.cat(outs, dim=-1) @ mixer.wo.T


def _mamba(
    mixer: torch.nn.Module, x: torch.Tensor, spec: ModelSpec
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Step-by-step Mamba-2 from zero state; returns output and final (conv, ssm)."""
    m = Mamba2Shape.of(spec.dims)
    proj = x @ mixer.in_proj.T
    z = proj[:, : m.d_inner]
    xbc = proj[:, m.d_inner : m.d_inner + m.conv_dim]
    dt_raw = proj[:, m.d_inner + m.conv_dim :]
    a = -torch.exp(mixer.a_log)
    conv = torch.zeros(m.conv_dim, m.d_conv - 1)
    ssm = torch.zeros(m.num_heads, m.head_dim, m.d_state)
    ys = []
    for t in range(x.shape[0]):
        window = torch.cat((conv, xbc[t][:, None]), dim=1)  # oldest input first
        conv = window[:, 1:]
        u = torch.nn.functional.silu((window * mixer.conv_w).sum(-1) + mixer.conv_b)
        xs = u[: m.d_inner].reshape(m.num_heads, m.head_dim)
        b, c = u[m.d_inner : m.d_inner + m.d_state], u[m.d_inner + m.d_state :]
        dt = torch.nn.functional.softplus(dt_raw[t] + mixer.dt_bias)
        ssm = torch.exp(dt * a)[:, None, None] * ssm + dt[:, None, None] * xs[:, :, None] * b
        ys.append((ssm @ c + mixer.d_skip[:, None] * xs).reshape(-1))
    y = torch.stack(ys) * torch.nn.functional.silu(z)
    return y @ mixer.out_proj.T, (conv, ssm)


def _dense(
    model: HybridModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    spec = model.spec
    eps = spec.dims.rms_eps
    h = model.embed[tokens]
    states = []
    for kind, block in zip(spec.kinds, model.blocks, strict=True):
        x = _rms(h, block.mixer_norm.weight, eps)
        if kind is Component.MAMBA:
            mixed, state = _mamba(block.mixer, x, spec)
            states.append(state)
        else:
            window = spec.swa_window if kind is Component.SWA else 0
            mixed = _attention(block.mixer, x, spec, window)
        h = h + mixed
        x = _rms(h, block.mlp_norm.weight, eps)
        mlp = block.mlp
        h = h + (torch.nn.functional.silu(x @ mlp.gate.T) * (x @ mlp.up.T)) @ mlp.down.T
    h = _rms(h, model.final_norm.weight, eps)
    return torch.log_softmax(h @ model.lm_head.T, dim=-1), states


@torch.no_grad()
def dense_logprobs(model: HybridModel, tokens: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]``: the next-token log-probabilities after every token."""
    return _dense(model, tokens)[0]


@torch.no_grad()
def dense_state_at(
    model: HybridModel, tokens: torch.Tensor, p: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every Mamba layer's (conv, ssm) state after the first ``p`` tokens."""
    return _dense(model, tokens[:p])[1]


# ---- helpers shared by the model tests ------------------------------------

TOL = 1e-5


def assert_lp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Log-probs agree to 1e-5, relative for values below -1 (a logprob of -25
    carries float32 rounding of a few ulps, ~2e-6 each)."""
    err = (got - want).abs() / want.abs().clamp(min=1.0)
    assert float(err.max()) <= TOL, f"max relative error {float(err.max()):.3g}"


def tokens_for(spec: ModelSpec, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.dims.vocab_size, (n,), generator=g)


def run(
    model: HybridModel,
    pool: ArrayPool,
    tokens: torch.Tensor,
    *,
    prefix_len: int = 0,
    table: int = 0,
    slot: int = 0,
    cow: int | None = None,
    capture: dict[int, int] | None = None,
    swa_table: torch.Tensor | None = None,
) -> ForwardOutput:
    """Compute ``tokens`` after ``prefix_len`` cached ones, pages from test table ``table``."""
    n_pages = -(-(prefix_len + tokens.numel()) // model.spec.page_size)
    pages = page_table(table, n_pages)
    req = ForwardRequest(
        tokens,
        prefix_len,
        pages,
        pages if swa_table is None else swa_table,
        slot,
        cow,
        capture or {},
        want_token_logprobs=True,
    )
    return model.forward_batch([req], pool)


def assert_state_close(
    got: list[tuple[torch.Tensor, torch.Tensor]], want: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    assert len(got) == len(want)
    for (gc, gs), (wc, ws) in zip(got, want, strict=True):
        torch.testing.assert_close(gc, wc, atol=TOL, rtol=0)
        torch.testing.assert_close(gs, ws, atol=TOL, rtol=0)
