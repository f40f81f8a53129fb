"""Paged grouped-query attention for FULL and sliding-window (SWA) layers.

K and V live in the pool's pages (``[max_pages, page_size, kv_heads,
head_dim]`` per layer, in ``spec.kv_dtype``). A forward first writes the new
tokens' (RoPE-rotated) K/V into their pages, then reads the request's keys back
*through the page table*, so the new tokens see exactly the bytes a later
continuation will see (this keeps a split prompt bitwise-consistent with a
whole one even for 16-bit KV). Attention computes in the dtype of its
weights (float32, or float64 in the reference model's deterministic mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerlift.engine.model.api import PoolViews
from layerlift.engine.model.layers import Span, apply_rope, normal_param
from layerlift.pools.spec import ModelSpec

__all__ = ["SWA_TILE", "KVIndex", "PagedAttention", "Tile", "build_kv_index"]


# Queries per attention tile of a sliding-window layer: each tile reads only
# the keys its window reaches, so long SWA prefills cost O(T * (tile + window))
# instead of O(T^2).
SWA_TILE = 256


@dataclass(frozen=True, slots=True)
class Tile:
    """Queries ``q0:q1`` (rows within the request) attend to gathered keys
    ``k0:k1``; ``mask`` is an additive float mask ``[q1-q0, k1-k0]``, or
    ``None`` when the tile is exactly causal (square, aligned at position 0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class KVIndex:
    """Where one batch reads and writes the KV of one layer kind.

    Built once per batch (not per layer) so page tables and masks cross to the
    device once. ``write_pages``/``write_offsets`` give (page, offset) of every
    packed new token; per request, ``read_pages[i]`` are the pages its keys are
    gathered from (the first gathered key is at position ``key_start[i]``) and
    ``tiles[i]`` cover its queries.
    """

    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    read_pages: list[torch.Tensor]
    key_start: list[int]
    tiles: list[list[Tile]]


def _tiles(span: Span, key_start: int, window: int, device: torch.device,
           dtype: torch.dtype) -> list[Tile]:
    """Attention tiles of one request (positions are absolute until the end)."""
    if not window and span.prefix_len == 0:
        return [Tile(0, span.n_new, 0, span.n_new, None)]
    step = SWA_TILE if window else span.n_new
    tiles = []
    for q_lo in range(span.prefix_len, span.total, step):
        q_hi = min(q_lo + step, span.total)
        k_lo = max(key_start, q_lo - window + 1) if window else key_start
        q_pos = torch.arange(q_lo, q_hi)[:, None]
        k_pos = torch.arange(k_lo, q_hi)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        tiles.append(
            Tile(
                q_lo - span.prefix_len,
                q_hi - span.prefix_len,
                k_lo - key_start,
                q_hi - key_start,
                mask.to(device),
            )
        )
    return tiles


def build_kv_index(
    spec: ModelSpec,
    spans: Sequence[Span],
    tables: Sequence[torch.Tensor],
    window: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> KVIndex:
    """The :class:`KVIndex` of a batch; ``window`` = 0 means full attention;
    tile masks in ``dtype`` (the attention's compute dtype)."""
    ps = spec.page_size
    writes, reads, starts, tiles = [], [], [], []
    for span, table in zip(spans, tables, strict=True):
        writes.append(table[torch.arange(span.prefix_len, span.total) // ps])
        first_page = 0
        if window:
            # Pages wholly before the first new token's window are never read
            # (their table entries may be stale or already reused).
            first_page = max(0, span.prefix_len - window + 1) // ps
        reads.append(table[first_page : -(-span.total // ps)].to(device))
        starts.append(first_page * ps)
        tiles.append(_tiles(span, first_page * ps, window, device, dtype))
    all_pos = torch.cat([torch.arange(s.prefix_len, s.total) for s in spans])
    return KVIndex(torch.cat(writes).to(device), (all_pos % ps).to(device), reads, starts, tiles)


class PagedAttention(nn.Module):
    """Causal grouped-query attention over paged KV (FULL or SWA: the window
    lives in the :class:`KVIndex` tiles, so both kinds share this code)."""

    def __init__(self, spec: ModelSpec, g: torch.Generator, out_std: float) -> None:
        super().__init__()
        self.spec = spec
        d, h, kvh, hd = spec.dims.hidden_size, spec.dims.num_heads, spec.num_kv_heads, spec.head_dim
        self.wq = normal_param(g, h * hd, d, std=d**-0.5)
        self.wk = normal_param(g, kvh * hd, d, std=d**-0.5)
        self.wv = normal_param(g, kvh * hd, d, std=d**-0.5)
        self.wo = normal_param(g, d, h * hd, std=out_std * (h * hd) ** -0.5)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        spans: Sequence[Span],
        index: KVIndex,
        pool: PoolViews,
        layer: int,
    ) -> torch.Tensor:
        """Attend for every packed row of ``x`` ``[total_tokens, hidden]`` at
        absolute ``positions``; writes the new K/V into the pages of ``layer``
        first, then reads every key (old and new) back through the pages."""
        spec = self.spec
        t = x.shape[0]
        q = apply_rope((x @ self.wq.T).view(t, spec.dims.num_heads, spec.head_dim), positions)
        k = apply_rope((x @ self.wk.T).view(t, spec.num_kv_heads, spec.head_dim), positions)
        v = (x @ self.wv.T).view(t, spec.num_kv_heads, spec.head_dim)
        k_cache, v_cache = pool.kv_view(layer)
        k_cache[index.write_pages, index.write_offsets] = k.to(k_cache.dtype)
        v_cache[index.write_pages, index.write_offsets] = v.to(v_cache.dtype)
        # [heads, T, head_dim] layout for SDPA.
        q = q.transpose(0, 1)
        out = torch.empty_like(q)
        for i, span in enumerate(spans):
            n_keys = span.total - index.key_start[i]
            keys, vals = (self._gather(c, index.read_pages[i], n_keys, q.dtype)
                          for c in (k_cache, v_cache))
            for tile in index.tiles[i]:
                rows = slice(span.start + tile.q0, span.start + tile.q1)
                out[:, rows] = self._attend(
                    q[:, rows], keys[:, tile.k0 : tile.k1], vals[:, tile.k0 : tile.k1], tile.mask
                )
        return torch.matmul(out.transpose(0, 1).reshape(t, -1), self.wo.T)

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor, n_keys: int,
                dtype: torch.dtype) -> torch.Tensor:
        """One request's keys (or values) as ``dtype`` ``[num_heads, n_keys, head_dim]``:
        one ``index_select`` of its pages, flatten, and repeat each KV head for
        the ``num_heads // num_kv_heads`` query heads it serves."""
        spec = self.spec
        flat = cache.index_select(0, pages).reshape(-1, spec.num_kv_heads, spec.head_dim)
        group = spec.dims.num_heads // spec.num_kv_heads
        return flat[:n_keys].to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)

    @staticmethod
    def _attend(
        q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA of one tile; ``mask`` ``None`` means plain causal."""
        out = F.scaled_dot_product_attention(
            q[None], keys[None], vals[None], attn_mask=mask, is_causal=mask is None
        )
        return out[0]
