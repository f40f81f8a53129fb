"""The CRC-32 LayerLift checks with (ISA-L's, `integrity.CRC_IMPLEMENTATION`)
is zlib's CRC-32 exactly: objects written by a process with either verify in
a process with the other, so the object format (``OBJECT_FORMAT``, in every
key) does not depend on which is installed."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from layerlift.linker import integrity

SIZES = [0, 1, 3, 64, 5 * 1024, 5 * 1024 + 1, 64 << 10, (256 << 10) + 7]
SEEDS = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0xDEADBEEF]


def test_isal_is_the_implementation_here() -> None:
    # isal is a dependency (pyproject): a silently slower fallback here would
    # hide a packaging mistake from every benchmark.
    assert integrity.CRC_IMPLEMENTATION == "isal"


@pytest.mark.parametrize("size", SIZES)
def test_checksums_equal_zlibs_crc32(size: int) -> None:
    rng = np.random.default_rng(size)
    rows = rng.integers(0, 256, (len(SEEDS), max(size, 1)), dtype=np.uint8)
    ptrs = [int(rows[i].ctypes.data) for i in range(len(SEEDS))]
    got = integrity.checksums(ptrs, size, SEEDS)
    want = [zlib.crc32(ctypes.string_at(p, size), s) for p, s in zip(ptrs, SEEDS, strict=True)]
    assert got.tolist() == want
    assert integrity.mismatches(ptrs, size, np.asarray(want, dtype="<u4"), SEEDS) == []
    if size:
        rows[2, size // 2] ^= 0x40  # a flipped bit is caught, by either implementation
        assert integrity.mismatches(ptrs, size, np.asarray(want, dtype="<u4"), SEEDS) == [2]


def test_slice_seed_is_zlibs_crc_of_the_name() -> None:
    for key in ("ns/fp.l2/full/0/00ab", "k", ""):
        for j in (0, 1, 47):
            assert integrity.slice_seed(key, j) == zlib.crc32(f"{key}#{j}".encode())


@pytest.mark.parametrize("sizes", [[1], [0, 7], [5 * 1024, 64 << 10, 3], [(128 << 10) + 1] * 2])
def test_copy_checksum_copies_the_pieces_back_to_back_and_checksums_the_copy(
        sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, max(n, 1), dtype=np.uint8) for n in sizes]
    total = sum(sizes)
    dst = np.full(total + 8, 0xA5, dtype=np.uint8)
    for seed in SEEDS:
        dst[:] = 0xA5
        got = integrity.copy_checksum(
            int(dst.ctypes.data), [(int(p.ctypes.data), n) for p, n in zip(pieces, sizes,
                                                                          strict=True)], seed)
        want = b"".join(p[:n].tobytes() for p, n in zip(pieces, sizes, strict=True))
        assert dst[:total].tobytes() == want and bool((dst[total:] == 0xA5).all())
        assert got == zlib.crc32(want, seed)
        assert got == integrity.checksums([int(dst.ctypes.data)], total, [seed])[0]
