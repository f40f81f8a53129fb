"""A simulated model: the real engine's forward path, with compute time from a
compute model instead of arithmetic.

:class:`SimulatedModel` implements the model protocol
(:mod:`layerlift.engine.model.base`) for any :class:`~layerlift.pools.spec.ModelSpec`
(a published architecture's layout from
:func:`~layerlift.engine.model.architectures.simulated_spec`, or the
reference model's own). Its ``forward_batch`` does what the engine relies on,
layer by layer: ``before_layer(l)`` (the wait for layer ``l``'s restore),
then it *reads* the cached prefix of layer ``l`` (the last prefix page, the
recurrent state at ``mamba_cow_src`` or ``mamba_slot``), *writes* every new
page, the final state and each ``capture`` checkpoint, and spends layer
``l``'s time from the :class:`~layerlift.engine.model.compute_model.ComputeModel`
as a timed wait (no CPU), then ``after_layer(l)``.

What it writes is a stamp, not KV: one element per page (K[page, 0, 0, 0])
and per state slot (the first element of the first state tensor), chained
over the pages from the prefix's stamp: ``s = (31 * s_prev + sum(tokens of
the page) + layer + 1) mod 251`` (exact in BF16). The next-token
distribution is a point mass on ``sum_l (l + 1) * s_last(l) mod vocab``. So
a request served from restored or device pages gives the same output as a
cold one only if every layer's cached stamp arrived before it was read: the
replay's exactness check means something here too (it checks the per-layer
waits and the page bookkeeping, not numerics: that is real mode's job).

Time per layer: the layer starts when its wait returned, or, if the wait did
not block, when the previous layer's modeled time ended (sleep overshoot
does not accumulate); it ends ``layer_seconds[l]`` later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from layerlift.engine.model.api import (
    ForwardOutput,
    ForwardRequest,
    PoolViews,
    check_pool_indices,
    validate_requests,
)
from layerlift.engine.model.base import LayerHook
from layerlift.engine.model.compute_model import ComputeModel, SeqWork
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["STAMP_MOD", "SimulatedModel"]

STAMP_MOD = 251  # prime, below 256: every stamp is exact in BF16
_MUL = 31
_WAITED_S = 50e-6  # a before_layer that took longer than this blocked


class SimulatedModel:
    """A model of ``spec`` whose layers take ``compute``'s time; one
    simulated token stands for ``token_scale`` real ones in the compute.

    ``simulated`` is always True (results built from it are marked so).
    ``clock`` / ``sleep`` default to ``time.perf_counter`` / ``time.sleep``
    (tests pass a fake pair). Raises ``ValueError`` for a scale below 1 or
    a vocabulary below 2."""

    simulated = True

    def __init__(self, spec: ModelSpec, compute: ComputeModel, *, token_scale: int = 1,
                 vocab_size: int = 512, name: str | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if token_scale < 1:
            raise ValueError(f"token_scale must be >= 1, got {token_scale}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.spec = spec
        self.compute = compute
        self.token_scale = token_scale
        self.vocab_size = vocab_size
        self.identity = (f"simulated-{name or spec.name}-{spec.fingerprint}-k{token_scale}-"
                         f"v{vocab_size}")
        self._clock, self._sleep = clock, sleep
        self.modeled_s = 0.0  # sum of every layer's modeled time so far

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def layer_seconds(self, requests: Sequence[ForwardRequest]) -> list[float]:
        """The modeled time of every layer for ``requests`` (real tokens =
        simulated tokens * ``token_scale``)."""
        k = self.token_scale
        work = [SeqWork(r.prefix_len * k, r.n_new * k) for r in requests]
        out: list[float] = self.compute.layer_seconds(self.spec.kinds, work)
        return out

    def forward_batch(self, requests: Sequence[ForwardRequest], pool: PoolViews,
                      before_layer: LayerHook | None = None,
                      after_layer: LayerHook | None = None) -> ForwardOutput:
        """See the module docstring and :meth:`Model.forward_batch`. Raises
        ``ValueError`` for a malformed request (as the reference model), or
        one that asks for per-token log-probs (not simulated)."""
        validate_requests(self.spec, self.vocab_size, requests)
        check_pool_indices(self.spec, requests, pool)
        if any(r.want_token_logprobs for r in requests):
            raise ValueError("the simulated model computes no per-token log-probs")
        durations = self.layer_seconds(requests)
        chains = [_Chain(self.spec.page_size, r) for r in requests]
        finals = torch.zeros(len(requests), self.spec.num_layers, dtype=torch.int64)
        end = self._clock()
        for layer, kind in enumerate(self.spec.kinds):
            t0 = self._clock()
            if before_layer is not None:
                before_layer(layer)
            t1 = self._clock()
            start = t1 if t1 - t0 > _WAITED_S else end
            if kind is Component.MAMBA:
                finals[:, layer] = _mamba_layer(pool, layer, requests, chains)
            else:
                finals[:, layer] = _attention_layer(pool, layer, kind, requests, chains)
            end = start + durations[layer]
            self.modeled_s += durations[layer]
            delay = end - self._clock()
            if delay > 0:
                self._sleep(delay)
            if after_layer is not None:
                after_layer(layer)
        weights = torch.arange(1, self.spec.num_layers + 1, dtype=torch.int64)
        picks = (finals * weights).sum(dim=1) % self.vocab_size
        logits = torch.full((len(requests), self.vocab_size), -30.0)
        logits[torch.arange(len(requests)), picks] = 0.0
        return ForwardOutput(torch.log_softmax(logits, dim=-1), [None] * len(requests))


class _Chain:
    """One request's page stamps as ``P * prev + C + (layer + 1) * G`` (mod
    251), ``prev`` the stamp of the page (or state) before its first new page."""

    def __init__(self, page_size: int, req: ForwardRequest) -> None:
        toks = req.tokens.numpy()
        self.page_size = page_size
        self.first = req.prefix_len // page_size
        m = -(-req.n_new // page_size)
        sums = np.add.reduceat(toks, np.arange(0, req.n_new, page_size)) % STAMP_MOD
        p = np.empty(m, dtype=np.int64)
        c = np.empty(m, dtype=np.int64)
        g = np.empty(m, dtype=np.int64)
        pp, cc, gg = 1, 0, 0
        for j in range(m):
            pp = pp * _MUL % STAMP_MOD
            cc = (cc * _MUL + int(sums[j])) % STAMP_MOD
            gg = (gg * _MUL + 1) % STAMP_MOD
            p[j], c[j], g[j] = pp, cc, gg
        self.p, self.c, self.g = torch.from_numpy(p), torch.from_numpy(c), torch.from_numpy(g)
        self.pages = m

    def stamps(self, prev: int, layer: int) -> torch.Tensor:
        return (self.p * prev + self.c + (layer + 1) * self.g) % STAMP_MOD


def _attention_layer(pool: PoolViews, layer: int, kind: Component,
                     requests: Sequence[ForwardRequest], chains: Sequence[_Chain]) -> torch.Tensor:
    """Read each request's last prefix page stamp, write its new pages'."""
    k, _ = pool.kv_view(layer)
    finals = torch.empty(len(requests), dtype=torch.int64)
    pages, values = [], []
    for i, (r, ch) in enumerate(zip(requests, chains, strict=True)):
        table = r.full_pages if kind is Component.FULL else r.swa_pages
        prev = int(k[int(table[ch.first - 1]), 0, 0, 0]) if ch.first else 0
        s = ch.stamps(prev, layer)
        pages.append(table[ch.first : ch.first + ch.pages])
        values.append(s)
        finals[i] = s[-1]
    k[torch.cat(pages), 0, 0, 0] = torch.cat(values).to(k.dtype)
    return finals


def _mamba_layer(pool: PoolViews, layer: int, requests: Sequence[ForwardRequest],
                 chains: Sequence[_Chain]) -> torch.Tensor:
    """Read each request's starting state stamp (COW source, own slot or
    zero), write the final state and every captured checkpoint."""
    state = pool.mamba_view(layer)[0]
    col = state.flatten(1).select(1, 0)  # a view: each slot's first element
    assert col.data_ptr() == state.data_ptr()
    finals = torch.empty(len(requests), dtype=torch.int64)
    slots, values = [], []
    for i, (r, ch) in enumerate(zip(requests, chains, strict=True)):
        src = r.mamba_cow_src if r.mamba_cow_src is not None else (
            r.mamba_slot if r.prefix_len > 0 else None)
        prev = int(col[src]) if src is not None else 0
        s = ch.stamps(prev, layer)
        for pos, slot in r.capture.items():
            page = pos // ch.page_size - ch.first - 1
            slots.append(slot)
            values.append(s[page : page + 1])
        slots.append(r.mamba_slot)
        values.append(s[-1:])
        finals[i] = s[-1]
    col[torch.tensor(slots, dtype=torch.int64)] = torch.cat(values).to(col.dtype)
    return finals

