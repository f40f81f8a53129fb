"""The reference hybrid model: FULL, SWA and MAMBA layers over paged caches.

A small, deterministic (seeded, nothing downloaded) stand-in for a real hybrid
LLM. It exists so LayerLift can check what matters end to end: a prefill that
continues from restored pages and checkpoints must produce the same next-token
distribution as computing the whole prompt.

The forward runs *layer by layer for the whole batch* and calls
``before_layer(l)`` right before layer ``l`` touches any cached data of that
layer: that is where the engine waits for layer ``l``'s restored KV or state
(the overlap of restore and compute, docs/design.md §2).

Layer ``l``: ``h += mixer(norm(h))``; ``h += mlp(norm(h))`` with the mixer
chosen by ``spec.kinds[l]``; then a final norm and the LM head.

Deterministic mode (``HybridModel(..., deterministic=True)``): the forward
computes in float64 (weights, activations, attention, the scan) and meets the
cached bytes only where they are stored: KV in ``spec.kv_dtype``, conv inputs
and the Mamba state in float32, the state rounded at every page boundary
(where a restore may continue). How the prompt is split (restored prefix or
cold, which batch, which attention tiles and scan chunks) then moves the
result only by float64 rounding: a restored prefill equals a cold run of the
whole prompt within KL 1e-9 by construction, not by the luck of float32
reductions. The cost: float64 arithmetic (measured on a 2-core CPU: 1.6x the
float32 prefill for tiny128 6x1192 tokens, 1.9x for small 1x2048; far more
on GPUs with few float64 units) and twice the weight memory;
the cache layout, store keys' layout fingerprint and byte sizes are
unchanged, but the identity differs (``-f64``), since float64 computes other
KV bytes than float32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from layerlift.engine.model.api import (
    ForwardOutput,
    ForwardRequest,
    PoolViews,
    check_pool_indices,
    validate_requests,
)
from layerlift.engine.model.attention import KVIndex, PagedAttention, build_kv_index
from layerlift.engine.model.base import LayerHook
from layerlift.engine.model.layers import GatedMLP, RMSNorm, Span, normal_param
from layerlift.engine.model.mamba import MambaMixer
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["ForwardOutput", "ForwardRequest", "HybridModel", "LayerHook", "PoolViews"]

# Scale of the embedding and of the LM head's logits. Chosen so the residual
# stream is O(1) and next-token distributions are far from uniform (a KL test
# between two paths is meaningless when every output is near-uniform).
_EMBED_STD = 1.0
_LOGIT_STD = 4.0
# Residual writes of the mixers and MLPs: strong enough that the context
# (not only the last token) shapes the output, small enough that 16-32 layers
# keep activations O(1).
_MIXER_OUT = 1.5
_MLP_OUT = 0.5


class Block(nn.Module):
    """One layer: pre-norm mixer + residual, pre-norm gated MLP + residual."""

    def __init__(self, spec: ModelSpec, kind: Component, g: torch.Generator,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.kind = kind
        depth = spec.num_layers**-0.5
        dims = spec.dims
        self.mixer_norm = RMSNorm(dims.hidden_size, dims.rms_eps)
        self.mixer: PagedAttention | MambaMixer
        if kind is Component.MAMBA:
            self.mixer = MambaMixer(spec, g, out_std=_MIXER_OUT * depth,
                                    align_state=spec.page_size if deterministic else None)
        else:
            self.mixer = PagedAttention(spec, g, out_std=_MIXER_OUT * depth)
        self.mlp_norm = RMSNorm(dims.hidden_size, dims.rms_eps)
        self.mlp = GatedMLP(g, dims.hidden_size, dims.intermediate_size, _MLP_OUT * depth)


class HybridModel(nn.Module):
    """The reference hybrid model of ``spec``; weights are a pure function of
    ``spec.dims`` and ``seed`` (drawn on the CPU with a private
    ``torch.Generator``, then moved to ``device``). Computes in float32, or
    in float64 with ``deterministic=True`` (see the module docstring: a
    restore then equals a cold run within KL 1e-9 whatever the split, at the
    price of float64 arithmetic); KV is stored in ``spec.kv_dtype``, Mamba-2
    state (conv, ssm) in float32. Log-probabilities come back in float32.

    Implements the model protocol (:class:`~layerlift.engine.model.base.Model`).
    Raises ``ValueError`` when ``spec``'s state layout is not the Mamba-2
    state of its dims, or the query heads do not group over the KV heads."""

    def __init__(self, spec: ModelSpec, seed: int, device: str | torch.device = "cpu", *,
                 deterministic: bool = False) -> None:
        super().__init__()
        dims = spec.dims
        if spec.layers_of(Component.MAMBA) and spec.mamba != dims.mamba_state():
            raise ValueError(
                "HybridModel computes a Mamba-2 state (conv, ssm) from spec.dims; spec.state "
                f"{spec.mamba} is a different layout"
            )
        if dims.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({dims.num_heads}) must be a multiple of num_kv_heads "
                f"({spec.num_kv_heads}) for grouped-query attention"
            )
        self.spec = spec
        self.seed = seed
        self.deterministic = deterministic
        self.compute_dtype = torch.float64 if deterministic else torch.float32
        digest = hashlib.blake2b(repr(dims).encode(), digest_size=4).hexdigest()
        # float64 computes other KV bytes than float32: never share store keys.
        self.identity = f"hybrid-{digest}-seed{seed}" + ("-f64" if deterministic else "")
        self.vocab_size = dims.vocab_size
        g = torch.Generator().manual_seed(seed)
        d = dims.hidden_size
        self.embed = normal_param(g, dims.vocab_size, d, std=_EMBED_STD)
        self.blocks = nn.ModuleList(Block(spec, kind, g, deterministic) for kind in spec.kinds)
        self.final_norm = RMSNorm(d, dims.rms_eps)
        self.lm_head = normal_param(g, dims.vocab_size, d, std=_LOGIT_STD * d**-0.5)
        self.to(device=device, dtype=self.compute_dtype)

    @property
    def device(self) -> torch.device:
        device: torch.device = self.embed.device
        return device

    @torch.inference_mode()
    def forward_batch(
        self,
        requests: Sequence[ForwardRequest],
        pool: PoolViews,
        before_layer: LayerHook | None = None,
        after_layer: LayerHook | None = None,
    ) -> ForwardOutput:
        """Compute the new tokens of every request, layer by layer.

        For each layer ``l`` in order: ``before_layer(l)`` (once), then layer
        ``l`` for the whole batch - it performs the Mamba copy-on-write, reads
        the prefix KV/state through the page tables and slots and writes the
        new tokens' KV, the final state and the captured checkpoints - then
        ``after_layer(l)`` (once). Raises ``ValueError`` on a malformed request
        or a page/slot index outside the pool (nothing is written then). Page
        tables must be CPU tensors.
        """
        validate_requests(self.spec, self.vocab_size, requests)
        check_pool_indices(self.spec, requests, pool)
        dev = self.device
        spans = _spans(requests)
        tokens = torch.cat([r.tokens for r in requests]).to(dev)
        positions = torch.cat([torch.arange(s.prefix_len, s.total) for s in spans]).to(dev)
        dtype = self.compute_dtype
        full = build_kv_index(self.spec, spans, [r.full_pages for r in requests], 0, dev, dtype)
        swa = build_kv_index(
            self.spec, spans, [r.swa_pages for r in requests], self.spec.swa_window, dev, dtype
        )
        h = self.embed[tokens]
        for layer, block in enumerate(self.blocks):
            assert isinstance(block, Block)
            if before_layer is not None:
                before_layer(layer)
            h = self._block(block, layer, h, positions, spans, requests, pool, (full, swa))
            if after_layer is not None:
                after_layer(layer)
        return self._logprobs(self.final_norm(h), spans, requests)

    def _block(
        self,
        block: Block,
        layer: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        spans: Sequence[Span],
        requests: Sequence[ForwardRequest],
        pool: PoolViews,
        indexes: tuple[KVIndex, KVIndex],
    ) -> torch.Tensor:
        """One layer for the packed batch ``h`` ``[total_tokens, hidden]``."""
        x = block.mixer_norm(h)
        if isinstance(block.mixer, MambaMixer):
            mixed: torch.Tensor = block.mixer(x, spans, requests, pool, layer)
        else:
            index = indexes[0] if block.kind is Component.FULL else indexes[1]
            mixed = block.mixer(x, positions, spans, index, pool, layer)
        h = h + mixed
        mlp_out: torch.Tensor = block.mlp(block.mlp_norm(h))
        return h + mlp_out

    def _logprobs(
        self, h: torch.Tensor, spans: Sequence[Span], requests: Sequence[ForwardRequest]
    ) -> ForwardOutput:
        """Log-softmax of the LM head at each request's last row (and at every
        row of the requests that asked for per-token logprobs)."""
        last = torch.tensor([s.stop - 1 for s in spans], device=h.device)
        nxt = torch.log_softmax(h[last] @ self.lm_head.T, dim=-1)
        per_token: list[torch.Tensor | None] = []
        for i, (s, r) in enumerate(zip(spans, requests, strict=True)):
            if not r.want_token_logprobs:
                per_token.append(None)
                continue
            rows = torch.log_softmax(h[s.start : s.stop] @ self.lm_head.T, dim=-1).float()
            nxt[i] = rows[-1]  # one source of truth, bitwise equal to the last row
            per_token.append(rows)
        return ForwardOutput(nxt.float(), per_token)


def _spans(requests: Sequence[ForwardRequest]) -> list[Span]:
    """Rows of each request in the packed batch, in request order."""
    spans, start = [], 0
    for r in requests:
        spans.append(Span(start, start + r.n_new, r.prefix_len))
        start += r.n_new
    return spans
