"""The Mooncake conversation trace (FAST'25), sampled and scaled for a replay.

Each line of the trace is one request: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per 512-token block; two requests
share a prefix exactly as long as their common leading ids. A replay keeps
that structure and scales the rest:

* **sampling**: ``families`` groups requests by their first two block ids and
  takes random families of at least ``min_family`` requests until about N
  requests (seeded); ``window`` takes N consecutive requests from a start.
  Reuse builds up over the hour, so a window of early requests shows almost
  none; families keep the trace's reuse at a small size.
* **blocks**: each 512-token block becomes ``block_tokens`` tokens; each hash
  id maps to a deterministic block drawn from a seeded RNG, so prompts share
  tokens exactly where the trace says. ``input_length`` is scaled by
  ``block_tokens / 512`` and the last block is partial, as in the trace.
* **time**: arrivals are replayed ``time_scale`` times faster.

The ideal hit fraction counts every token of a block seen before as a hit
(an unbounded cache with no boundaries).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_TRACE", "TRACE_BLOCK_TOKENS", "ScaledRequest", "TraceRequest", "default_trace_path",
    "ideal_hit_fraction", "load_trace", "sample_families", "sample_window", "scale",
]

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of the trace; ``index`` is its line number (0-based)."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """A request ready to replay: its tokens, its arrival on the scaled clock
    (seconds from the first sampled arrival) and its blocks' token counts."""

    source: TraceRequest
    arrival_s: float
    tokens: np.ndarray
    block_ids: tuple[int, ...]
    block_sizes: tuple[int, ...]


DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "conversation_trace.jsonl.gz"


def default_trace_path() -> Path:
    """The trace that ships with the project (``bench/data/``, see its README)."""
    return DEFAULT_TRACE


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Parse a trace jsonl (gzip-compressed when its name ends in ``.gz``).
    ``FileNotFoundError`` for a missing file; ``ValueError`` names the line
    of a malformed record."""
    out: list[TraceRequest] = []
    p = Path(path)
    raw = p.read_bytes()
    text = (gzip.decompress(raw) if p.suffix == ".gz" else raw).decode()
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            req = TraceRequest(i, float(rec["timestamp"]), int(rec["input_length"]),
                               int(rec.get("output_length", 0)),
                               tuple(int(h) for h in rec["hash_ids"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{i + 1}: not a trace record ({exc})") from None
        if not req.hash_ids or req.input_length < 1:
            raise ValueError(f"{path}:{i + 1}: a request needs hash_ids and input_length > 0")
        out.append(req)
    return out


def sample_window(requests: Sequence[TraceRequest], n: int, start: int = 0) -> list[TraceRequest]:
    """``n`` consecutive requests from index ``start``."""
    if n < 1 or not 0 <= start < len(requests):
        raise ValueError(f"need n >= 1 and 0 <= start < {len(requests)}, got n={n}, start={start}")
    return list(requests[start : start + n])


def family_key(req: TraceRequest) -> tuple[int, ...]:
    return req.hash_ids[:2]


def sample_families(requests: Sequence[TraceRequest], n: int, seed: int,
                    min_family: int = 3) -> list[TraceRequest]:
    """Random whole prefix families (same first two block ids) of at least
    ``min_family`` requests, until at least ``n`` requests; in trace order."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    groups: dict[tuple[int, ...], list[TraceRequest]] = {}
    for r in requests:
        groups.setdefault(family_key(r), []).append(r)
    fams = sorted((g for g in groups.values() if len(g) >= min_family), key=lambda g: g[0].index)
    if not fams:
        raise ValueError(f"the trace has no family of {min_family} or more requests")
    order = np.random.default_rng(seed).permutation(len(fams))
    picked: list[TraceRequest] = []
    for i in order:
        if len(picked) >= n:
            break
        picked.extend(fams[int(i)])
    return sorted(picked, key=lambda r: (r.timestamp_ms, r.index))


def block_sizes(req: TraceRequest, block_tokens: int) -> tuple[int, ...]:
    """Tokens of each block after scaling: whole blocks of ``block_tokens``
    and a partial last one, ``input_length * block_tokens / 512`` in all
    (clamped so every block holds at least one token)."""
    n = len(req.hash_ids)
    total = math.ceil(req.input_length * block_tokens / TRACE_BLOCK_TOKENS)
    total = min(max(total, (n - 1) * block_tokens + 1), n * block_tokens)
    return (block_tokens,) * (n - 1) + (total - (n - 1) * block_tokens,)


def block_tokens_of(hash_id: int, block_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """The deterministic tokens of one block (same id, same tokens)."""
    return np.random.default_rng([seed, hash_id]).integers(0, vocab_size, block_tokens,
                                                           dtype=np.int64)


def scale(requests: Sequence[TraceRequest], *, block_tokens: int, vocab_size: int,
          time_scale: float = 1.0, seed: int = 0) -> list[ScaledRequest]:
    """Token prompts and scaled arrivals for ``requests`` (in their order)."""
    if block_tokens < 1 or time_scale <= 0:
        raise ValueError("block_tokens must be >= 1 and time_scale > 0")
    if not requests:
        return []
    t0 = min(r.timestamp_ms for r in requests)
    cache: dict[int, np.ndarray] = {}
    out = []
    for r in requests:
        sizes = block_sizes(r, block_tokens)
        parts = []
        for h, size in zip(r.hash_ids, sizes, strict=True):
            if h not in cache:
                cache[h] = block_tokens_of(h, block_tokens, vocab_size, seed)
            parts.append(cache[h][:size])
        out.append(ScaledRequest(r, (r.timestamp_ms - t0) / 1e3 / time_scale,
                                 np.concatenate(parts), r.hash_ids, sizes))
    return out


def ideal_hit_fraction(requests: Iterable[ScaledRequest]) -> float:
    """Tokens of blocks seen earlier in the replay over all prompt tokens.
    A partial block is a hit only if an earlier request had at least as many
    of its tokens (its tokens are a prefix of the same block)."""
    seen: dict[int, int] = {}
    hit = total = 0
    for r in requests:
        for h, size in zip(r.block_ids, r.block_sizes, strict=True):
            total += size
            if seen.get(h, 0) >= size:
                hit += size
            seen[h] = max(seen.get(h, 0), size)
    return hit / total if total else 0.0


def block_hit_fraction(requests: Iterable[TraceRequest]) -> float:
    """The trace's own measure: blocks that repeat an earlier block."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        for h in r.hash_ids:
            total += 1
            hit += h in seen
            seen.add(h)
    return hit / total if total else 0.0
