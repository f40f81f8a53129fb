"""The checksum of LayerLift's objects (format ``l3``) is CRC-32C exactly:
checked against a bit-by-bit reference written here from the definition
(reflected polynomial 0x82F63B78, initial and final XOR 0xFFFFFFFF), so an
object verifies wherever it is read, with the CPU's instruction or the
package's software code; and the format is in every key, so objects of the
CRC-32 format before it (``l2``) are never read as this one's."""

from __future__ import annotations

import ctypes
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from layerlift.linker import integrity
from layerlift.linker.keys import KeySchema
from layerlift.pools.spec import Component

SIZES = [0, 1, 3, 64, 5 * 1024, 5 * 1024 + 1, 64 << 10, (256 << 10) + 7]
SEEDS = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0xDEADBEEF]

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def reference_crc32c(data: bytes, value: int = 0) -> int:
    """CRC-32C from its definition, continuing from ``value`` (a finished CRC)."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_the_reference_is_crc32c() -> None:
    # The check value of CRC-32C (iSCSI, RFC 3720): the reference is the right CRC.
    assert reference_crc32c(b"123456789") == 0xE3069283
    assert integrity.crc32c(b"123456789") == 0xE3069283


def test_the_fastest_installed_crc_is_used() -> None:
    # awscrt is a dependency: a silent fall back to the slower package would
    # hide a packaging mistake from every benchmark.
    assert integrity.CRC_IMPLEMENTATION == "awscrt"
    from awscrt.checksums import crc32c as aws_crc32c
    assert integrity.crc32c is aws_crc32c


def test_the_fallback_is_the_crc32c_package_with_the_cpus_instruction() -> None:
    fn, name = integrity.crc32c_package()
    assert fn(b"123456789") == 0xE3069283
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if re.search(r"\b(sse4_2|crc32)\b", flags):
        assert name == "crc32c-hardware"
    else:  # a CPU with no CRC32 instruction: the package's software code, the same CRC
        assert name == "crc32c-software"


def test_without_awscrt_the_package_is_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "awscrt.checksums", None)  # the import fails
    fn, name = integrity._pick_crc32c()
    assert name.startswith("crc32c-") and fn is integrity.crc32c_package()[0]


@pytest.mark.parametrize("size", [*SIZES, (1 << 20) + 5, 8 << 20])
def test_both_implementations_compute_the_same_crc(size: int) -> None:
    # Objects verify across machines whichever code wrote or reads them:
    # awscrt against the crc32c package (two independent codes), from every
    # seed, over whole buffers, an unaligned start and continued CRCs.
    from awscrt.checksums import crc32c as aws  # not the pick: it falls back without awscrt
    pkg, _ = integrity.crc32c_package()
    data = np.random.default_rng(size).integers(0, 256, size + 3, dtype=np.uint8)
    whole, tail = memoryview(data[:size]), memoryview(data[3:])
    for seed in SEEDS:
        assert aws(whole, seed) == pkg(whole, seed)
        assert aws(tail, seed) == pkg(tail, seed)
        half = size // 2
        assert aws(whole[half:], aws(whole[:half], seed)) == pkg(whole, seed)


@pytest.mark.parametrize("size", SIZES)
def test_checksums_equal_the_reference(size: int) -> None:
    rng = np.random.default_rng(size)
    rows = rng.integers(0, 256, (len(SEEDS), max(size, 1)), dtype=np.uint8)
    ptrs = [int(rows[i].ctypes.data) for i in range(len(SEEDS))]
    got = integrity.checksums(ptrs, size, SEEDS)
    small = size <= (64 << 10)  # the reference is a Python loop: the large sizes take the package
    want = [reference_crc32c(ctypes.string_at(p, size), s) if small
            else integrity.crc32c(ctypes.string_at(p, size), s)
            for p, s in zip(ptrs, SEEDS, strict=True)]
    assert got.tolist() == want
    assert integrity.mismatches(ptrs, size, np.asarray(want, dtype="<u4"), SEEDS) == []
    if size:
        rows[2, size // 2] ^= 0x40  # a flipped bit is caught
        assert integrity.mismatches(ptrs, size, np.asarray(want, dtype="<u4"), SEEDS) == [2]


def test_a_crc_continues_as_the_crc_of_the_concatenation() -> None:
    # What the in-place offload of a layer held in several parts relies on
    # (SGLang's K then V rows: one CRC over both).
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(), b"tail"
    for seed in SEEDS:
        whole = integrity.crc32c(a + b, seed)
        assert integrity.crc32c(b, integrity.crc32c(a, seed)) == whole
        assert whole == reference_crc32c(a + b, seed)


def test_slice_seed_is_the_crc_of_the_name() -> None:
    for key in ("ns/fp.l3/full/0/00ab", "k", ""):
        for j in (0, 1, 47):
            assert integrity.slice_seed(key, j) == reference_crc32c(f"{key}#{j}".encode())


def test_the_format_is_named_in_every_key_and_differs_from_the_crc32_one() -> None:
    assert integrity.OBJECT_FORMAT == "l3"
    keys = KeySchema("ns", "fp", 0).keys(Component.FULL, [b"\x01"])
    assert keys[0].startswith("ns/fp.l3/")
    # The same bytes under CRC-32 (format l2) carry another checksum: a
    # reader of one format would reject the other's objects anyway.
    page = bytes(range(256)) * 4
    assert integrity.crc32c(page, 5) != zlib.crc32(page, 5)


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
        assert got == integrity.crc32c(want, seed)
        assert got == integrity.checksums([int(dst.ctypes.data)], total, [seed])[0]
