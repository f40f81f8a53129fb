"""A host's own memory registered with the store for in-place puts.

The hosts' in-place offloads (SGLang's pools, vLLM's host cache) put objects
straight from the host's tensors: the store must know those spans first.
A host's tensors are many (one per layer, K and V apart) and may sit back to
back or share one allocation; Mooncake refuses a span that overlaps one
already registered. :func:`register_spans` merges them and registers each
merged span once, all or nothing. Plain and synchronous: the caller owns the
lock and the moment to unregister (never while a call may read the spans).
"""

from __future__ import annotations

from collections.abc import Iterable

from layerlift.linker.store_base import Store

__all__ = ["merge_spans", "register_spans"]


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` byte spans, sorted, with the spans that overlap or
    touch merged into one."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def register_spans(store: Store, spans: Iterable[tuple[int, int]]) -> list[int]:
    """Register the merged ``spans`` with ``store``; return the registered
    addresses (what ``store.unregister`` takes). All or nothing: when one
    registration raises, those before it are unregistered and the error
    propagates."""
    done: list[int] = []
    try:
        for lo, hi in merge_spans(spans):
            done.append(store.register(lo, hi - lo))
    except BaseException:
        for ptr in done:
            store.unregister(ptr)
        raise
    return done
