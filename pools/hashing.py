"""Chained page hashes: a page's hash names its whole prefix.

``h_i = blake2b(h_{i-1} || tokens of page i)``, so two pages with the same
hash have the same tokens *and* the same history. The tree stores these per
node; the linker turns them into store keys (``linker/keys.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["DIGEST_SIZE", "ROOT_HASH", "page_hashes"]

DIGEST_SIZE = 16
ROOT_HASH = b"\x00" * DIGEST_SIZE


def page_hashes(
    tokens: Sequence[int] | np.ndarray, page_size: int, parent: bytes = ROOT_HASH
) -> list[bytes]:
    """Hashes of every *whole* page of ``tokens``, chained from ``parent``.

    A trailing partial page is ignored. Raises ``ValueError`` for a
    non-positive page size or a parent of the wrong length.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent hash must be {DIGEST_SIZE} bytes, got {len(parent)}")
    arr = np.asarray(tokens, dtype=np.int64)
    n_pages = len(arr) // page_size
    raw = arr[: n_pages * page_size].tobytes()
    step = page_size * 8
    out: list[bytes] = []
    h = parent
    for i in range(n_pages):
        h = hashlib.blake2b(h + raw[i * step : (i + 1) * step], digest_size=DIGEST_SIZE).digest()
        out.append(h)
    return out
