"""Routing hints: what a prefill of a prompt would cost on this engine, asked
without doing any of it (``Engine.estimate_prefill``).

A fleet's router (SGLang's, llm-d's, Dynamo's) asks each instance: how much
of this prompt do you hold on the device, how much more could you restore
from the shared store, and what time to first token do you expect? The
answer here reads the device tree without touching it (no lock, no pin, no
access-time update: the LRU order is unchanged), asks the store which keys
exist (one ``exists`` call, as LOOKUP does) and prices the rest with the
engine's cost model (:mod:`layerlift.engine.costmodel`: learned with
``restore="auto"``, else its priors).

Threads: runs on the event loop; the store call goes to a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layerlift.engine.costmodel import CostModel, restore_bytes
from layerlift.engine.threads import run_owned
from layerlift.linker.components import ComponentLinker
from layerlift.linker.contract import LinkerTransferPhase, LinkRequest
from layerlift.linker.restorable import choose_boundary, restorable_boundaries
from layerlift.linker.store_base import Store, StoreError
from layerlift.pools.hashing import page_hashes
from layerlift.pools.spec import Component
from layerlift.pools.tree import UnifiedRadixTree

__all__ = ["PrefillEstimate", "device_hit_tokens", "estimate_prefill", "peek_device_pages"]


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """What a prefill of one prompt would do now (seconds are estimates).

    Tokens: ``device_hit_tokens`` on the device, ``restorable_tokens`` more
    from the store (up to the deepest boundary every component can restore),
    ``compute_tokens`` the rest; they add up to ``prompt_tokens``.
    ``restore_bytes`` is what that restore moves; ``load_s`` its time over the
    link, ``compute_s`` the forward over ``compute_tokens``, ``recompute_s``
    the forward over ``restorable_tokens + compute_tokens`` (computing
    instead). ``restore_s`` is the restore path's TTFT under the engine's
    policy (overlap or barrier), ``ttft_s`` the path the engine would take
    (``restore`` says which: with ``restore="auto"`` the cheaper one).
    Queueing in front of the engine is not included: the caller adds its
    own. ``store_available`` is False when the store could not be asked
    (nothing restorable then)."""

    prompt_tokens: int
    device_hit_tokens: int
    restorable_tokens: int
    compute_tokens: int
    restore_bytes: int
    load_s: float
    compute_s: float
    recompute_s: float
    restore_s: float
    ttft_s: float
    restore: bool
    store_available: bool = True


def peek_device_pages(tree: UnifiedRadixTree, tokens: np.ndarray) -> int:
    """The device boundary (pages) ``match_prefix`` would find for ``tokens``
    (page-aligned), without touching access times or anything else: the
    deepest matched node ending on a checkpoint whose SWA window is whole."""
    spec = tree.spec
    path = tree._walk(tree._tokens(tokens, aligned=False))  # read-only: no access-time update
    if not path:
        return 0
    swa_valid = torch.cat([n.pages(Component.SWA).valid[:m] for n, m in path])
    missing = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(~swa_valid, 0)])
    d = 0
    for node, m in path:
        if m == node.num_pages and node.checkpoint is not None:
            e = node.end_page
            if int(missing[e]) == int(missing[max(0, e - spec.window_pages)]):
                d = e
    return d


def device_hit_tokens(tree: UnifiedRadixTree, tokens: Sequence[int] | np.ndarray) -> int:
    """Tokens of ``tokens`` a prefill would find on the device now (the
    pages before the last token, as LOOKUP matches), touching nothing."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    ps = tree.spec.page_size
    usable = max(0, (len(arr) - 1) // ps)
    return peek_device_pages(tree, arr[: usable * ps]) * ps


async def estimate_prefill(tree: UnifiedRadixTree, linkers: Mapping[Component, ComponentLinker],
                           store: Store, tokens: Sequence[int] | np.ndarray, cost: CostModel,
                           *, overlap: bool, auto: bool) -> PrefillEstimate:
    """See :class:`PrefillEstimate` (``overlap``: the engine's load policy
    is not the barrier; ``auto``: it recomputes when that is cheaper).
    ``ValueError`` for a malformed prompt."""
    spec = tree.spec
    arr = np.asarray(tokens)
    if arr.ndim != 1 or len(arr) == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("a prompt must be a non-empty 1-D sequence of integer token ids")
    arr = arr.astype(np.int64, copy=False)
    ps = spec.page_size
    usable = (len(arr) - 1) // ps
    d = peek_device_pages(tree, arr[: usable * ps])
    b, available = d, True
    if usable > d:
        req = LinkRequest(tuple(page_hashes(arr, ps))[:usable], d)
        lookup = {c: lk.build_transfer(LinkerTransferPhase.LOOKUP, request=req)
                  for c, lk in linkers.items()}
        keys = [k for t in lookup.values() if t is not None for k in t.keys]
        if keys:
            try:
                answers = await run_owned(lambda: store.exists(keys))
            except StoreError:
                answers, available = [], False
            if available:
                found: dict[Component, list[bool]] = {}
                pos = 0
                for c, t in lookup.items():
                    n = 0 if t is None else len(t.keys)
                    found[c] = answers[pos : pos + n]
                    pos += n
                b = choose_boundary(restorable_boundaries(spec, d, usable, lookup, found))
    restore_tok, compute_tok = (b - d) * ps, len(arr) - b * ps
    nbytes = restore_bytes(spec, d, b)
    decision = cost.decide(restore_tok, nbytes, compute_tok, overlap=overlap)
    compute_s = cost.compute_s_per_token * compute_tok
    restore = restore_tok > 0 and (decision.restore or not auto)
    return PrefillEstimate(
        prompt_tokens=len(arr), device_hit_tokens=d * ps, restorable_tokens=restore_tok,
        compute_tokens=compute_tok, restore_bytes=nbytes,
        load_s=cost.load_seconds(nbytes) if nbytes else 0.0, compute_s=compute_s,
        recompute_s=decision.est_compute_s, restore_s=decision.est_restore_s,
        ttft_s=decision.est_restore_s if restore else decision.est_compute_s,
        restore=restore, store_available=available)

