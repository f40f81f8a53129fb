"""A staged load reads each object's footer once, with the part's first slice.

The first slice of a part (``local`` 0) is read with the objects' whole
footers; once those rows verified, a later slice of them is read alone and
checked against the footers read then (one ranged read per object instead
of two: the per-object footer entry is a transfer of its own). A slice read
before the footers are in, or after the first slice failed, reads its own
entry, as before. Every case checks the bytes that landed, and the store
calls made (a spy), on the in-memory store.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_staged import LAYOUT, SENTINEL, Rows, encode, one_part_load, pages, put_raw

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import CorruptSlices
from layerlift.linker.store_base import ForwardingStore

N = 6
KEYS = [f"foot/p{i}" for i in range(N)]


class RangeSpy(ForwardingStore):
    """Forwards to ``inner``; records per ``get_ranges`` call, per key, the
    ``(offset, size)`` ranges it read."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.calls: list[list[list[tuple[int, int]]]] = []

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.calls.append([list(zip(offs, lens, strict=True))
                           for offs, lens in zip(src_offsets, sizes, strict=True)])
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)


def _stored(objects: dict[str, bytes] | None = None) -> tuple[RangeSpy, torch.Tensor]:
    mem = MemoryStore()
    src = pages(N, 5)
    put_raw(mem, objects or {k: encode(k, src[i]) for i, k in enumerate(KEYS)})
    return RangeSpy(mem), src


def _entry(j: int) -> tuple[int, int]:
    return LAYOUT.footer_at(j), 4


def test_later_layers_read_their_slices_alone_against_the_first_slices_footers() -> None:
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Rows(N)
    load = one_part_load(ring, spy, KEYS, dest)
    for layer in range(len(LAYOUT.slices)):
        load.fetch_layer(layer)
    assert torch.equal(dest.rows, src)
    whole = (LAYOUT.page_bytes, LAYOUT.footer_bytes)
    assert spy.calls[0] == [[LAYOUT.slices[0], whole]] * N
    for layer, call in enumerate(spy.calls[1:], start=1):
        assert call == [[LAYOUT.slices[layer]]] * N, f"layer {layer} read more than its slices"
    assert load.wait_quiet(5.0) and ring.close()


def test_a_corrupt_footer_entry_fails_its_layer_though_read_with_the_first_slice() -> None:
    """Entry 2 of object 4's footer is flipped: layers 0 and 1 land, layer 2
    (whose slice is intact) fails against the footer read with layer 0, and
    nothing of its chunk is copied."""
    src = pages(N, 5)
    objects = {k: encode(k, src[i]) for i, k in enumerate(KEYS)}
    spoiled = bytearray(objects[KEYS[4]])
    spoiled[LAYOUT.footer_at(2)] ^= 0x01
    objects[KEYS[4]] = bytes(spoiled)
    spy, _ = _stored(objects)
    ring = StagingRing(spy, 64 << 10)
    dest = Rows(N)
    reported: list[str] = []
    load = one_part_load(ring, spy, KEYS, dest, on_corrupt=reported.extend)
    load.fetch_layer(0)
    load.fetch_layer(1)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(2)
    assert info.value.keys == (KEYS[4],) and info.value.layer == 2
    assert reported == [KEYS[4]]
    assert spy.calls[2] == [[LAYOUT.slices[2]]] * N  # checked against the table
    offset, size = LAYOUT.slices[2]
    assert bool((dest.rows[:, offset : offset + size] == SENTINEL).all())
    assert torch.equal(dest.rows[:, : LAYOUT.slices[2][0]], src[:, : LAYOUT.slices[2][0]])
    assert load.wait_quiet(5.0) and ring.close()


def test_a_corrupt_later_slice_is_caught_by_the_footer_read_with_the_first() -> None:
    src = pages(N, 5)
    objects = {k: encode(k, src[i]) for i, k in enumerate(KEYS)}
    spoiled = bytearray(objects[KEYS[1]])
    spoiled[LAYOUT.slices[1][0] + 17] ^= 0x80
    objects[KEYS[1]] = bytes(spoiled)
    spy, _ = _stored(objects)
    ring = StagingRing(spy, 64 << 10)
    dest = Rows(N)
    load = one_part_load(ring, spy, KEYS, dest)
    load.fetch_layer(0)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(1)
    assert info.value.keys == (KEYS[1],)
    assert spy.calls[1] == [[LAYOUT.slices[1]]] * N
    assert load.wait_quiet(5.0) and ring.close()


def test_a_layer_read_before_the_footers_are_in_reads_its_own_entries() -> None:
    spy, src = _stored()
    ring = StagingRing(spy, 64 << 10)
    dest = Rows(N)
    load = one_part_load(ring, spy, KEYS, dest)
    load.fetch_layer(2)  # before layer 0: no footers yet
    load.fetch_layer(0)
    load.fetch_layer(1)
    assert torch.equal(dest.rows, src)
    assert spy.calls[0] == [[LAYOUT.slices[2], _entry(2)]] * N
    assert spy.calls[2] == [[LAYOUT.slices[1]]] * N
    assert load.wait_quiet(5.0) and ring.close()


def test_footers_of_a_failed_first_slice_are_never_used() -> None:
    """Object 0's slice 0 is corrupt: layer 0 fails and records no footer,
    so layer 1 reads (and checks) its own entries and lands exact."""
    src = pages(N, 5)
    objects = {k: encode(k, src[i]) for i, k in enumerate(KEYS)}
    spoiled = bytearray(objects[KEYS[0]])
    spoiled[3] ^= 0x10
    objects[KEYS[0]] = bytes(spoiled)
    spy, _ = _stored(objects)
    ring = StagingRing(spy, 64 << 10)
    dest = Rows(N)
    load = one_part_load(ring, spy, KEYS, dest)
    with pytest.raises(CorruptSlices):
        load.fetch_layer(0)
    load.fetch_layer(1)
    assert spy.calls[1] == [[LAYOUT.slices[1], _entry(1)]] * N
    offset, size = LAYOUT.slices[1]
    assert torch.equal(dest.rows[:, offset : offset + size], src[:, offset : offset + size])
    assert load.wait_quiet(5.0) and ring.close()


def test_rows_split_across_chunks_use_the_footers_of_their_own_rows() -> None:
    """A ring small enough that a layer takes several chunks: each chunk's
    rows use the footers their own first-slice chunk read."""
    spy, src = _stored()
    row = LAYOUT.slices[0][1] + LAYOUT.footer_bytes
    ring = StagingRing(spy, 2 * 4 * row)  # depth 4: a chunk holds 2 rows
    dest = Rows(N)
    load = one_part_load(ring, spy, KEYS, dest)
    assert len(load.chunks[0]) == N // 2
    for layer in range(len(LAYOUT.slices)):
        load.fetch_layer(layer)
    assert torch.equal(dest.rows, src)
    later = [call for call in spy.calls[N // 2 :]]
    assert later and all(ranges == [LAYOUT.slices[1]] or ranges == [LAYOUT.slices[2]]
                         for call in later for ranges in call)
    assert load.wait_quiet(5.0) and ring.close()
