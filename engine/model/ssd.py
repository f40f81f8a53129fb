"""Chunked (SSD-style) evaluation of the Mamba-2 selective-state recurrence.

The recurrence, per head ``h`` (scalar decay ``A[h] < 0``)::

    state_t = exp(dt_t * A) * state_{t-1} + dt_t * outer(x_t, B_t)    # [head_dim, d_state]
    y_t     = state_t @ C_t                                           # [head_dim]

A Python loop over tokens is far too slow for prompts of thousands of tokens,
so the sequence is cut into chunks of ``chunk`` tokens. Inside a chunk the
output is a masked matrix product (a decay-weighted causal "attention" of C
against B); across chunks only the ``[heads, head_dim, d_state]`` state is
carried, one small step per chunk. Decays are summed in log space within one
chunk only, with the stable "segment sum" (cumulative sums of masked copies,
never a difference of two large cumulative sums), so the result matches the
step-by-step recurrence to float32 rounding.

Callers can ask for the state at given token offsets (``cuts``): the sequence
is first split into segments at those offsets and every segment is padded to
whole chunks with ``dt = 0`` tokens. A ``dt = 0`` token is an exact identity
step (decay ``exp(0) = 1``, input ``0 * ...``), so padding changes nothing and
every requested state is simply the carried state at a chunk boundary.

With ``state_dtype`` the carried state passes through that dtype at every
segment end (``cuts``): exactly what a checkpoint stored there holds, so a
later continuation from that checkpoint starts from the very state this run
carried on with (the reference model's deterministic mode cuts at every page
boundary and computes in float64 around float32 checkpoints).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["CHUNK", "ssd_scan"]

CHUNK = 64
"""Default chunk length in tokens."""


def _pad_index(bounds: Sequence[int], chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Source row of every padded position (-1 = padding) and, per segment end,
    the number of chunks before that end."""
    parts: list[torch.Tensor] = []
    ends: list[int] = []
    n_chunks = 0
    for lo, hi in itertools.pairwise(bounds):
        c = -(-(hi - lo) // chunk)
        idx = torch.full((c * chunk,), -1, dtype=torch.int64)
        idx[: hi - lo] = torch.arange(lo, hi)
        parts.append(idx)
        n_chunks += c
        ends.append(n_chunks)
    return torch.cat(parts), ends


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = a[..., s+1] + ... + a[..., t]`` for ``t >= s``, ``-inf``
    above the diagonal (so ``exp`` gives the causal decay matrix)."""
    n = a.shape[-1]
    rep = a[..., :, None].expand(*a.shape, n)  # rep[..., i, j] = a_i
    strict = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    sums = rep.masked_fill(~strict, 0.0).cumsum(dim=-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(0)
    return sums.masked_fill(~causal, float("-inf"))


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a_coef: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state0: torch.Tensor,
    cuts: Sequence[int] = (),
    chunk: int = CHUNK,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run the recurrence over one sequence, starting from ``state0``.

    Shapes: ``x`` ``[T, H, P]``, ``dt`` ``[T, H]`` (already softplus-ed),
    ``a_coef`` ``[H]`` (negative), ``b``/``c`` ``[T, N]``, ``state0``
    ``[H, P, N]``. Returns ``y`` ``[T, H, P]`` (without the ``D`` skip term)
    and the state after ``j`` tokens for every ``j`` in ``cuts`` and for ``T``.
    ``state_dtype``: round the carried state through it at every segment end
    (see the module docstring); ``None`` keeps full precision.
    """
    t = x.shape[0]
    bounds = sorted({0, t, *cuts})
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(f"cuts must lie in [0, {t}], got {sorted(cuts)}")
    longest = max(hi - lo for lo, hi in itertools.pairwise(bounds))
    # Short sequences (decode-sized) should not pay for a full padded chunk.
    chunk = min(chunk, 1 << max(0, (longest - 1).bit_length()))
    src, ends = _pad_index(bounds, chunk)
    valid = (src >= 0).to(x.device)
    rows = src.clamp(min=0).to(x.device)
    nc = src.numel() // chunk
    h, p = x.shape[1], x.shape[2]
    xs = x[rows].view(nc, chunk, h, p)
    bs, cs = b[rows].view(nc, chunk, -1), c[rows].view(nc, chunk, -1)
    # dt = 0 on padding rows makes them identity steps (see module docstring).
    dts = (dt[rows] * valid[:, None]).view(nc, chunk, h).transpose(1, 2)  # [nc, H, L]
    log_decay = dts * a_coef[None, :, None]
    seg = _segsum(log_decay)  # [nc, H, L, L]
    weights = seg.exp() * (cs @ bs.transpose(1, 2))[:, None] * dts[:, :, None, :]
    y = torch.einsum("chts,cshp->cthp", weights, xs)
    # State each chunk would reach from zero, and its total decay.
    to_end = seg[:, :, -1, :].exp() * dts  # [nc, H, L]
    local = torch.einsum("chs,cshp,csn->chpn", to_end, xs, bs)
    chunk_decay = log_decay.sum(dim=-1).exp()  # [nc, H]
    carried = [state0]
    rounded = set(ends) if state_dtype is not None else set()
    for i in range(nc):
        nxt = chunk_decay[i][:, None, None] * carried[-1] + local[i]
        if i + 1 in rounded:
            nxt = nxt.to(state_dtype).to(nxt.dtype)
        carried.append(nxt)
    entering = torch.stack(carried[:-1])  # state entering each chunk
    into = log_decay.cumsum(dim=-1).exp().transpose(1, 2)  # [nc, L, H]
    y = y + torch.einsum("ctn,chpn->cthp", cs, entering) * into[..., None]
    y = y.reshape(nc * chunk, h, p)[valid]
    states = {bound: carried[end] for bound, end in zip(bounds[1:], ends, strict=True)}
    return y, states
