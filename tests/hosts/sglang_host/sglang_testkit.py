"""Helpers of the SGLang host tests (tokens, SGLang's page hashes, the byte check)."""

from __future__ import annotations

from array import array
from typing import Any

import torch

from layerlift.testing.sglang_harness import HybridShape, SGLangHost

SHAPE = HybridShape()
PAGE = SHAPE.page_size


def tokens(n_pages: int, seed: int = 1, start: list[int] | None = None) -> list[int]:
    """``start`` then distinct tokens up to ``n_pages`` pages."""
    head = list(start or [])
    return head + [seed * 10_000 + i for i in range(n_pages * PAGE - len(head))]


def page_hashes(toks: list[int]) -> list[str]:
    """SGLang's storage hashes of the pages of ``toks`` (what its transfers carry)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(RadixKey(array("q", toks)), None, page_size=PAGE))


def assert_restored(host: SGLangHost, restore: Any, toks: list[int], start: int = 0) -> None:
    """Every layer the forward read equals the bytes of ``toks[:start + loaded]``."""
    expected = host.expected(toks[: start + restore.loaded_tokens], start)
    for layer, got in restore.layers.items():
        for g, e in zip(got, expected[layer], strict=True):
            assert g.shape == e.shape, (layer, g.shape, e.shape)
            assert torch.equal(_raw(g), _raw(e)), f"layer {layer} restored other bytes"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def is_zero(t: torch.Tensor) -> bool:
    return not bool(_raw(t).any())
