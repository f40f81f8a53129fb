"""The harness forward's copies into kept buffers (``SGLangHost``'s
``reuse_reads``, what ``bench sglang``'s consumer uses): the same bytes as a
copy into new memory, each restore checked exact, the buffers reused from
one restore to the next and only then; and ``take_rows`` into a buffer
refuses a buffer of another shape and a row outside the pool."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from sglang_testkit import exact_or_zero

from layerlift.testing.sglang_harness import SGLangHost, same_bytes, take_rows

pytestmark = [pytest.mark.sglang]


def _pool(rows: int = 96) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(-(1 << 15), 1 << 15, (rows, 4, 16), dtype=torch.int16,
                         generator=gen).view(torch.bfloat16)


def test_take_rows_into_a_buffer_copies_the_same_bytes_as_into_new_memory() -> None:
    pool = _pool()
    rows = torch.from_numpy(np.random.default_rng(3).permutation(96)[:40].astype(np.int64))
    out = torch.full((40, 4, 16), 7.0, dtype=torch.bfloat16)
    got = take_rows(pool, rows, out)
    assert got is out
    assert same_bytes(out, take_rows(pool, rows))
    assert same_bytes(out, pool[rows])
    again = torch.from_numpy(np.arange(39, -1, -1, dtype=np.int64))
    assert same_bytes(take_rows(pool, again, out), pool[again])  # the buffer overwritten whole


def test_take_rows_refuses_a_buffer_of_another_shape_or_a_row_outside_the_pool() -> None:
    pool = _pool()
    rows = torch.arange(8)
    with pytest.raises(ValueError, match="do not fit"):
        take_rows(pool, rows, torch.empty((9, 4, 16), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        take_rows(pool, rows, torch.empty((8, 4, 16), dtype=torch.float16))
    out = torch.zeros((2, 4, 16), dtype=torch.bfloat16)
    for bad in ([0, 96], [-1, 3]):
        with pytest.raises(IndexError, match="outside 96 rows"):
            take_rows(pool, torch.tensor(bad), out)
    assert not out.view(torch.int16).any()  # nothing written by a refused copy


@pytest.mark.mooncake
def test_a_consumer_that_reuses_its_reads_restores_exact_into_the_same_buffers(
        make_host: Callable[..., SGLangHost]) -> None:
    a = make_host()
    b = make_host(host={"reuse_reads": True})
    kept: dict[int, list[int]] = {}
    for seed in (11, 12):
        toks = [seed * 1000 + i for i in range(96)]
        a.compute(toks, [96])
        a.settle_offloads()
        r = b.restore([*toks, 1])
        assert (r.loaded_tokens, r.ok) == (96, True)
        assert all(exact_or_zero(b, r, toks).values())  # every layer exact, none zeroed
        ptrs = {layer: [t.data_ptr() for t in got] for layer, got in r.layers.items()
                if b.shape.kinds[layer] != "M"}
        assert ptrs
        if kept:
            assert ptrs == kept  # the second restore's copies went into the first's buffers
        kept = ptrs
        b.flush_cache()


@pytest.mark.mooncake
def test_without_reuse_each_restore_keeps_its_own_copies(
        make_host: Callable[..., SGLangHost]) -> None:
    a = make_host()
    b = make_host()
    restores = []
    for seed in (21, 22):
        toks = [seed * 1000 + i for i in range(96)]
        a.compute(toks, [96])
        a.settle_offloads()
        restores.append((b.restore([*toks, 1]), toks))
        b.flush_cache()
    for r, toks in restores:  # the first restore's bytes survive the second
        assert all(exact_or_zero(b, r, toks).values())
