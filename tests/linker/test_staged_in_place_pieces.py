"""In-place loads into a destination that keeps a slice in pieces (SGLang's
pools: a layer's K rows in one tensor, its V rows in another), and in-place
layers cut into several calls (``in_place_ranges``).

Each case checks the bytes that landed in both tensors, the ranges of every
store call (a spy), that the CRC runs over the pieces in order (a flipped
byte in either piece fails the slice), and that a layer cut into calls lands
once, after its last call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_staged import LAYOUT, encode, pages, put_raw
from test_staged_footers import RangeSpy

from layerlift.linker.integrity import crc32c, mismatches, pieced_checksums
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import CorruptSlices, LoadPart, LoadSegment, StagedLoad
from layerlift.linker.store_base import Store, StoreTimeout

N = 6
KEYS = [f"pieces/p{i}" for i in range(N)]
SPLIT = 400  # each 1000-byte slice: 400 bytes into ``head``, 600 into ``tail``


class TwoTensors:
    """A destination that keeps each slice in two pieces, each in a tensor of
    its own (one row per slot and layer); row ``i`` of the part goes to slot
    ``N - 1 - i`` (a row mix-up shows)."""

    def __init__(self, store: Store) -> None:
        layers = len(LAYOUT.slices)
        self.head = torch.zeros((layers, N, SPLIT), dtype=torch.uint8)
        self.tail = torch.zeros((layers, N, 1000 - SPLIT), dtype=torch.uint8)
        self.ptrs = [store.register(self.head), store.register(self.tail)]
        self.store = store

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return (SPLIT, part.layout.slices[local][1] - SPLIT)

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        out = []
        for slot in part.target[seg.lo : seg.hi]:
            out.append(int(self.head[seg.local, slot].data_ptr()))
            out.append(int(self.tail[seg.local, slot].data_ptr()))
        return out

    def pages(self, part: LoadPart) -> list[int]:
        raise ValueError("never whole")

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        exc.wait_finished()

    def slice(self, row: int, local: int) -> bytes:
        slot = N - 1 - row
        return bytes(self.head[local, slot].numpy()) + bytes(self.tail[local, slot].numpy())

    def close(self) -> None:
        for ptr in self.ptrs:
            self.store.unregister(ptr)


def _stored(flip: tuple[int, int] | None = None) -> tuple[RangeSpy, torch.Tensor]:
    src = pages(N, 21)
    objects = {k: encode(k, src[i]) for i, k in enumerate(KEYS)}
    if flip is not None:
        row, at = flip
        raw = bytearray(objects[KEYS[row]])
        raw[at] ^= 0x01
        objects[KEYS[row]] = bytes(raw)
    mem = MemoryStore()
    put_raw(mem, objects)
    return RangeSpy(mem), src


def _load(spy: RangeSpy, dest: TwoTensors, landed: list[int] | None = None,
          **kw: object) -> StagedLoad:
    part = LoadPart(LAYOUT, tuple(KEYS), [N - 1 - i for i in range(N)])
    layers = [[(0, j)] for j in range(len(LAYOUT.slices))]
    on_layer = (lambda layer, event: landed.append(layer)) if landed is not None else None
    return StagedLoad(StagingRing(spy, 64 << 10), spy, [part], layers, None,
                      placement=dest, on_layer=on_layer, **kw)  # type: ignore[arg-type]


def _expected(src: torch.Tensor, row: int, local: int) -> bytes:
    offset, size = LAYOUT.slices[local]
    return bytes(src[row][offset : offset + size].numpy())


def test_pieced_checksums_are_the_crc_of_the_pieces_back_to_back() -> None:
    data = [bytes(range(i, i + 50)) * 3 for i in range(4)]
    bufs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    ptrs = [int(b.data_ptr()) for b in bufs]
    # two slices of two pieces (60 and 90 bytes): slice 0 = data[0]+data[1], slice 1 = data[2]+data[3]
    got = pieced_checksums([ptrs[0], ptrs[1] + 60, ptrs[2], ptrs[3] + 60], (60, 90), [7, 9])
    assert got.tolist() == [crc32c(data[0][:60] + data[1][60:], 7),
                            crc32c(data[2][:60] + data[3][60:], 9)]
    assert mismatches([ptrs[0], ptrs[1] + 60], 150, np.asarray([got[0]]), [7], (60, 90)) == []
    assert mismatches([ptrs[0], ptrs[1] + 60], 150, np.asarray([got[0] ^ 1]), [7],
                      (60, 90)) == [0]
    with pytest.raises(ValueError, match="addresses"):
        pieced_checksums(ptrs[:3], (60, 90), [7, 9])
    with pytest.raises(ValueError, match="pieces of"):
        mismatches(ptrs[:2], 151, np.asarray([0]), [7], (60, 90))


def test_each_slice_lands_in_both_pieces_in_one_call_a_layer() -> None:
    spy, src = _stored()
    dest = TwoTensors(spy)
    landed: list[int] = []
    load = _load(spy, dest, landed)
    for layer in range(len(LAYOUT.slices)):
        load.fetch_layer(layer)
    for row in range(N):
        for local in range(len(LAYOUT.slices)):
            assert dest.slice(row, local) == _expected(src, row, local)
    assert landed == [0, 1, 2]
    assert len(spy.calls) == 3
    first = [(0, SPLIT), (SPLIT, 1000 - SPLIT), (LAYOUT.page_bytes, LAYOUT.footer_bytes)]
    assert spy.calls[0] == [first] * N  # both pieces, then the whole footer
    for layer, call in enumerate(spy.calls[1:], start=1):
        at = LAYOUT.slices[layer][0]
        assert call == [[(at, SPLIT), (at + SPLIT, 1000 - SPLIT)]] * N
    assert load.wait_quiet(5.0)
    dest.close()


@pytest.mark.parametrize("piece", ["head", "tail"])
def test_a_flipped_byte_in_either_piece_fails_the_slice(piece: str) -> None:
    at = LAYOUT.slices[1][0] + (5 if piece == "head" else SPLIT + 5)
    spy, _ = _stored(flip=(2, at))
    dest = TwoTensors(spy)
    landed: list[int] = []
    reported: list[str] = []
    load = _load(spy, dest, landed, on_corrupt=reported.extend)
    load.fetch_layer(0)
    with pytest.raises(CorruptSlices) as info:
        load.fetch_layer(1)
    assert info.value.keys == (KEYS[2],) and reported == [KEYS[2]]
    assert landed == [0]
    dest.close()


def test_a_placement_whose_pieces_do_not_add_up_is_refused() -> None:
    spy, _ = _stored()
    dest = TwoTensors(spy)
    dest.pieces = lambda part, local: (SPLIT, 100)  # type: ignore[method-assign]
    load = _load(spy, dest)
    with pytest.raises(ValueError, match="into pieces"):
        load.fetch_layer(0)
    assert spy.calls == []  # refused before any read
    dest.close()


@pytest.mark.parametrize(("max_ranges", "rows_per_call"), [(3, 1), (7, 2), (9, 3), (18, 6)])
def test_a_layer_cut_into_calls_lands_once_after_its_last(max_ranges: int,
                                                          rows_per_call: int) -> None:
    """A row is two pieces and a check (three ranges): calls of ``max_ranges``
    hold ``rows_per_call`` rows; every row lands exactly; the layer is
    reported landed once, after its last call."""
    spy, src = _stored()
    dest = TwoTensors(spy)
    landed: list[int] = []
    load = _load(spy, dest, landed, in_place_ranges=max_ranges)
    calls_per_layer = -(-N // rows_per_call)
    assert [len(c) for c in load.chunks] == [calls_per_layer] * 3
    load.fetch_layer(0)
    assert landed == [0]
    assert [len(call) for call in spy.calls] == \
        [min(rows_per_call, N - i * rows_per_call) for i in range(calls_per_layer)]
    assert all(sum(len(ranges) for ranges in call) <= max_ranges for call in spy.calls)
    load.fetch_layer(1)
    load.fetch_layer(2)
    assert landed == [0, 1, 2]
    for row in range(N):
        for local in range(len(LAYOUT.slices)):
            assert dest.slice(row, local) == _expected(src, row, local)
    dest.close()


def test_a_corrupt_row_in_a_later_call_fails_the_layer_after_earlier_calls_landed_bytes() -> None:
    """Calls of two rows; row 5 (third call) is corrupt: the layer raises and
    is never reported landed, although rows 0-3 were verified in place."""
    spy, _ = _stored(flip=(5, LAYOUT.slices[0][0] + 700))
    dest = TwoTensors(spy)
    landed: list[int] = []
    load = _load(spy, dest, landed, in_place_ranges=7)
    with pytest.raises(CorruptSlices):
        load.fetch_layer(0)
    assert len(spy.calls) == 3 and landed == []
    dest.close()


@pytest.mark.parametrize("bad", [1, 0])
def test_in_place_ranges_is_checked(bad: int) -> None:
    spy, _ = _stored()
    dest = TwoTensors(spy)
    with pytest.raises(ValueError, match="in_place_ranges"):
        _load(spy, dest, in_place_ranges=bad)
    with pytest.raises(ValueError, match="does not fit calls"):
        _load(spy, dest, in_place_ranges=2)  # a row is three ranges
    dest.close()


def test_in_place_ranges_needs_a_placement() -> None:
    from layerlift.linker.staged import HostSink

    mem = MemoryStore()
    part = LoadPart(LAYOUT, tuple(KEYS), list(range(N)))
    with pytest.raises(ValueError, match="in_place_ranges"):
        StagedLoad(StagingRing(mem, 64 << 10), mem, [part], [[(0, 0)]],
                   HostSink(lambda seg, part, rows: None), in_place_ranges=8)
