"""End-to-end integrity of page objects: one checksum per layer slice.

Object layout (format :data:`OBJECT_FORMAT`, named in every key): the page
bytes, layer-major as on the device, then a *footer* of one CRC-32 per layer
slice of the object's component, in layer order, little-endian ``uint32``::

    [layer0 slice][layer1 slice]...[crc(layer0)][crc(layer1)]...

Each CRC is seeded with the object's key and the layer's index
(:func:`slice_seed`), so it names what the bytes are, not only what they
hold: another object's bytes (with its own, self-consistent footer) under a
key, or one layer's slice in another's place, fail the check.

Why a footer and not a sidecar object: a per-layer load reads slice ``l`` of
every page object *and* footer entry ``l`` in the same ranged call (two
ranges per key), so verification costs no extra round trip, no extra object
per page in the master and no separate lookup; the page itself is still put
zero-copy from the pool (a multi-buffer put: the page, then its footer) and
read straight into its pool page. A truncated object fails the footer read;
another object's bytes, a flipped byte or a stale object fail the CRC.

Why CRC-32 (one call per page slice) and not a vectorised torch hash:
measured on this project's CPU machine, zlib's CRC runs at about 3 GB/s and
releases the GIL, while an exact integer dot-product hash in torch (int16
words times weights, float64 or int64) ran at about 0.3 GB/s; the Python loop
over pages costs ~1 µs per page. See ``layerlift bench integrity``
(``bench/results/integrity.json``).

Which CRC-32: ISA-L's (the ``isal`` package, :data:`CRC_IMPLEMENTATION`
``"isal"``) where it is installed, else zlib's. Both compute the same
CRC-32 (the gzip/zlib polynomial, reflected; the test suite checks them
against each other), so the object format does not depend on which one a
process uses and objects written by either verify under the other; ISA-L's
folds with carry-less multiplies and ran 3x zlib's speed on this
project's CPU machine (11-12 against 3.9 GB/s a thread over 64 MiB of
256 KiB-1 MiB slices: ``layerlift bench integrity``), and it too releases
the GIL for buffers over 5 KiB (every page slice of a real model).
A hardware CRC32C would be another checksum, hence another object format.

This module is plain and synchronous; the engine calls it in worker threads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "CHECK_BYTES",
    "CRC_IMPLEMENTATION",
    "OBJECT_FORMAT",
    "checksums",
    "component_slices",
    "encode_object",
    "footer_bytes",
    "footers",
    "mismatches",
    "object_bytes",
    "page_footers",
    "slice_seed",
]

# The byte layout of a page object. Part of every store key's fingerprint
# (`KeySchema`): a LayerLift that lays objects out differently never reads
# these as valid. "l2": layer-major page + per-layer CRC-32 footer.
OBJECT_FORMAT = "l2"
CHECK_BYTES = 4  # one little-endian uint32 CRC-32 per layer slice

crc32: Callable[..., int]
try:  # the same function as zlib.crc32, several times faster (module docstring)
    from isal.isal_zlib import crc32

    CRC_IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel
    from zlib import crc32

    CRC_IMPLEMENTATION = "zlib"


def component_slices(spec: ModelSpec, component: Component) -> list[tuple[int, int]]:
    """``(offset, size)`` of every layer slice of ``component``'s page object,
    in local layer order (the footer's order)."""
    out = []
    for layer in spec.layers_of(component):
        _, _, offset, size = spec.layer_slice(layer)
        out.append((offset, size))
    return out


def footer_bytes(spec: ModelSpec, component: Component) -> int:
    """Bytes of the footer of one page object of ``component``."""
    return CHECK_BYTES * len(spec.layers_of(component))


def object_bytes(spec: ModelSpec, component: Component) -> int:
    """Bytes of one whole page object (page plus footer)."""
    return spec.page_bytes(component) + footer_bytes(spec, component)


def slice_seed(key: str, local_layer: int) -> int:
    """The CRC seed of slice ``local_layer`` of object ``key``."""
    return crc32(f"{key}#{local_layer}".encode())


def checksums(ptrs: Sequence[int], size: int, seeds: Sequence[int]) -> np.ndarray:
    """CRC-32 of ``size`` bytes at each address, each from its seed (one call
    per address; both implementations release the GIL for large buffers). Returns
    ``uint32[len(ptrs)]``."""
    out = np.empty(len(ptrs), dtype="<u4")
    for i, (ptr, seed) in enumerate(zip(ptrs, seeds, strict=True)):
        view = (ctypes.c_char * size).from_address(ptr)
        out[i] = crc32(memoryview(view).cast("B"), seed)
    return out


def copy_checksum(dst: int, pieces: Sequence[tuple[int, int]], seed: int) -> int:
    """Copy ``pieces`` (``(address, nbytes)``) back to back to ``dst``, then
    return the CRC-32 from ``seed`` of the bytes just written, read back from
    ``dst``: one slice of an object copied and checksummed while it is still
    in the cache. A snapshot that checksums each slice so (its footers over
    the copy, as :func:`footers` would compute them over it afterwards) reads
    the staging once instead of twice: one pass over memory less per
    offload (1 GiB at page 64 on the 2-core box: 133 ms -> 100 ms)."""
    at = dst
    for ptr, nbytes in pieces:
        ctypes.memmove(at, ptr, nbytes)
        at += nbytes
    view = (ctypes.c_char * (at - dst)).from_address(dst)
    return int(crc32(memoryview(view).cast("B"), seed))


def footers(pages: Sequence[int], slices: Sequence[tuple[int, int]],
            keys: Sequence[str]) -> np.ndarray:
    """The footers of the pages at ``pages`` stored under ``keys``, each
    page's ``slices`` (``(offset, size)``, local layer order) at their
    offsets: ``uint32[n, layers]`` (C order, so row ``i`` viewed as bytes is
    page ``i``'s footer)."""
    out = np.empty((len(pages), len(slices)), dtype="<u4")
    for j, (offset, size) in enumerate(slices):
        out[:, j] = checksums([p + offset for p in pages], size, [slice_seed(k, j) for k in keys])
    return out


def page_footers(spec: ModelSpec, component: Component, page_ptrs: Sequence[int],
                 keys: Sequence[str]) -> np.ndarray:
    """:func:`footers` of ``component``'s pages (the engine's pools)."""
    return footers(page_ptrs, component_slices(spec, component), keys)


def mismatches(ptrs: Sequence[int], size: int, expected: np.ndarray,
               seeds: Sequence[int]) -> list[int]:
    """Indices ``i`` whose ``size`` bytes at ``ptrs[i]`` do not have the CRC
    ``expected[i]`` from seed ``seeds[i]`` (empty: every slice verified)."""
    got = checksums(ptrs, size, seeds)
    return np.flatnonzero(got != expected.astype("<u4", copy=False)).tolist()


def encode_object(spec: ModelSpec, component: Component, page: bytes, key: str) -> bytes:
    """The store object of one page stored under ``key``: its bytes plus the
    checksum footer (for tools and tests that write objects without an
    engine). Raises ValueError if ``page`` is not one page of ``component``."""
    if len(page) != spec.page_bytes(component):
        raise ValueError(f"a {component.value} page is {spec.page_bytes(component)} bytes, "
                         f"got {len(page)}")
    sums = [crc32(page[o : o + n], slice_seed(key, j))
            for j, (o, n) in enumerate(component_slices(spec, component))]
    return bytes(page) + np.asarray(sums, dtype="<u4").tobytes()
