"""A simulated model: the real engine's forward path, with compute time from a
compute model instead of arithmetic.

:class:`SimulatedModel` implements the model protocol
(:mod:`layerlift.engine.model.base`) for any :class:`~layerlift.pools.spec.ModelSpec`
(a published architecture's layout from
:func:`~layerlift.engine.model.architectures.simulated_spec`, or the
reference model's own). Its ``forward_batch`` does what the engine relies on,
layer by layer: ``before_layer(l)`` (the wait for layer ``l``'s restore),
then it *reads* the cached prefix of layer ``l`` (every page it attends to,
the recurrent state at ``mamba_cow_src`` or ``mamba_slot``), *writes* every
new page, the final state and each ``capture`` checkpoint, and spends layer
``l``'s time from the :class:`~layerlift.engine.model.compute_model.ComputeModel`
as a timed wait (no CPU), then ``after_layer(l)``.

What it writes is a stamp, not KV: every element of a new page's K and V,
and of every state tensor of a written slot, holds the page's (the slot's)
stamp, chained over the pages from the prefix's: ``s = (31 * s_prev + sum(tokens
of the page) + layer + 1) mod 251`` (exact in BF16). What it reads is checked
whole: each cached page the layer attends to (FULL: the whole prefix; SWA: the
pages inside the last token's window) and each state it starts from is
reduced to a digest of the min and max of its K and V (of every state
tensor), equal to the stamp only when every element holds it; the layer's
result adds the position-weighted sum of the stamps of every page it attends
to, read or written. The next-token distribution is a point mass on ``sum_l
(l + 1) * result(l) mod vocab``. So a request served from restored or device
pages gives the same output as a cold one only if every page and state it
read arrived whole before it was read (a damaged one goes unnoticed in about
1 of 251 cases): the replay's exactness check means something here too (it
checks the per-layer waits and the page bookkeeping, not numerics: that is
real mode's job).

Time per layer: the layer starts when its wait returned, or, if the wait did
not block, when the previous layer's modeled time ended (sleep overshoot
does not accumulate); it ends ``layer_seconds[l]`` later. The model keeps
the split of its forwards' wall time (:meth:`SimulatedModel.clock_split`):
modeled GPU time, time blocked on restores, and host time (the rest), so a
replay can report host work as what it is.
"""

from __future__ import annotations

import threading
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
        self._lock = threading.Lock()
        self.modeled_s = 0.0  # sum of every layer's modeled (GPU) time so far
        self.waited_s = 0.0  # time forwards blocked in before_layer (restore waits)
        self.host_s = 0.0  # the rest of the forwards' wall time: host work, not GPU time
        self.forwards = 0

    def _account(self, modeled: float, waited: float, wall: float) -> None:
        with self._lock:  # forwards of several engines run in their own threads
            self.modeled_s += modeled
            self.waited_s += waited
            self.host_s += max(0.0, wall - modeled - waited)
            self.forwards += 1

    def clock_split(self) -> dict[str, float]:
        """The counters so far: modeled GPU seconds, seconds blocked on
        restores, host seconds (wall time of the forwards beyond both: stamp
        work, sleep overshoot, waiting for a core) and the forward count."""
        with self._lock:
            return {"modeled_s": self.modeled_s, "waited_s": self.waited_s,
                    "host_s": self.host_s, "forwards": float(self.forwards)}

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
        end = began = self._clock()
        waited = 0.0
        for layer, kind in enumerate(self.spec.kinds):
            t0 = self._clock()
            if before_layer is not None:
                before_layer(layer)
            t1 = self._clock()
            if t1 - t0 > _WAITED_S:
                waited += t1 - t0
            start = t1 if t1 - t0 > _WAITED_S else end
            if kind is Component.MAMBA:
                finals[:, layer] = _mamba_layer(pool, layer, requests, chains)
            else:
                finals[:, layer] = _attention_layer(pool, layer, kind, self.spec.swa_window,
                                                    requests, chains)
            end = start + durations[layer]
            delay = end - self._clock()
            if delay > 0:
                self._sleep(delay)
            if after_layer is not None:
                after_layer(layer)
        self._account(sum(durations), waited, self._clock() - began)
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


def _page_digest(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Per page of ``pages``: its stamp when every element of its K and V
    holds the same stamp; otherwise (a page partly or wrongly written) some
    other value in all but about 1 of 251 cases."""
    if not len(pages):
        return torch.empty(0, dtype=torch.int64)
    kk, vv = k[pages].flatten(1), v[pages].flatten(1)
    parts = (kk.amin(1), kk.amax(1), vv.amin(1), vv.amax(1))
    return _decode(parts)


def _decode(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_i (i + 1) * parts[i] / sum_i (i + 1)`` (mod 251): the common
    value when all parts are equal."""
    total = torch.zeros_like(parts[0], dtype=torch.int64)
    for i, x in enumerate(parts):
        total = total + (i + 1) * x.to(torch.int64)
    weight = len(parts) * (len(parts) + 1) // 2
    return total * pow(weight, -1, STAMP_MOD) % STAMP_MOD


def _fold(stamps: torch.Tensor, first: int) -> int:
    """``sum_j (first + j + 1) * stamps[j]`` (mod 251): the layer's view of
    every page it attends to, each at its own position."""
    pos = torch.arange(first + 1, first + 1 + len(stamps), dtype=torch.int64)
    return int((pos * stamps).sum()) % STAMP_MOD


def _attention_layer(pool: PoolViews, layer: int, kind: Component, window: int,
                     requests: Sequence[ForwardRequest], chains: Sequence[_Chain]) -> torch.Tensor:
    """Read every cached page the layer attends to (FULL: the whole prefix;
    SWA: the pages wholly inside the last token's window), write every
    element of each new page's K and V. The layer's result folds the stamps
    of all pages inside that span, read or written: the same for a cold run
    and a served one only if every read page arrived whole."""
    k, v = pool.kv_view(layer)
    ps = k.shape[1]
    finals = torch.empty(len(requests), dtype=torch.int64)
    pages, values = [], []
    for i, (r, ch) in enumerate(zip(requests, chains, strict=True)):
        table = r.full_pages if kind is Component.FULL else r.swa_pages
        lo = 0 if kind is Component.FULL else -(-max(0, r.total - window) // ps)
        r0 = min(lo, ch.first - 1) if ch.first else 0  # the chain needs page first - 1
        read = _page_digest(k, v, table[r0 : ch.first])
        prev = int(read[-1]) if ch.first else 0
        s = ch.stamps(prev, layer)
        pages.append(table[ch.first : ch.first + ch.pages])
        values.append(s)
        span = torch.cat([read, s])[lo - r0 :]
        finals[i] = (int(s[-1]) + _fold(span, lo)) % STAMP_MOD
    idx = torch.cat(pages)
    stamp = torch.cat(values).to(k.dtype).view(-1, 1, 1, 1)
    k[idx] = stamp.expand(-1, *k.shape[1:])
    v[idx] = stamp.expand(-1, *v.shape[1:])
    return finals


def _state_digest(tensors: Sequence[torch.Tensor], slot: int) -> int:
    """The stamp of ``slot`` when every element of every state tensor holds
    it (see :func:`_page_digest`)."""
    parts = []
    for t in tensors:
        x = t[slot]
        parts += [x.amin(), x.amax()]
    return int(_decode(parts))


def _mamba_layer(pool: PoolViews, layer: int, requests: Sequence[ForwardRequest],
                 chains: Sequence[_Chain]) -> torch.Tensor:
    """Read each request's starting state (COW source, own slot or zero:
    every element of every state tensor), write the final state and every
    captured checkpoint (every element)."""
    tensors = pool.mamba_view(layer)
    finals = torch.empty(len(requests), dtype=torch.int64)
    slots, values = [], []
    for i, (r, ch) in enumerate(zip(requests, chains, strict=True)):
        src = r.mamba_cow_src if r.mamba_cow_src is not None else (
            r.mamba_slot if r.prefix_len > 0 else None)
        prev = _state_digest(tensors, src) if src is not None else 0
        s = ch.stamps(prev, layer)
        for pos, slot in r.capture.items():
            page = pos // ch.page_size - ch.first - 1
            slots.append(slot)
            values.append(s[page : page + 1])
        slots.append(r.mamba_slot)
        values.append(s[-1:])
        finals[i] = s[-1]
    idx = torch.tensor(slots, dtype=torch.int64)
    stamp = torch.cat(values)
    for t in tensors:
        t[idx] = stamp.to(t.dtype).view(-1, *([1] * (t.dim() - 1))).expand(-1, *t.shape[1:])
    return finals
