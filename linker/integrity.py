"""End-to-end integrity of page objects: one checksum per layer slice.

Object layout (format :data:`OBJECT_FORMAT`, named in every key): the page
bytes, layer-major as on the device, then a *footer* of one CRC-32C per
layer slice of the object's component, in layer order, little-endian
``uint32``::

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

Why a CRC (one call per page slice) and not a vectorised torch hash:
measured on this project's CPU machine, even zlib's CRC-32 runs at about
3 GB/s and releases the GIL, while an exact integer dot-product hash in
torch (int16 words times weights, float64 or int64) ran at about 0.3 GB/s;
the Python loop over pages costs ~1 µs per page. See ``layerlift bench
integrity`` (``bench/results/integrity.json``).

Why CRC-32C (Castagnoli; format ``l3``) and not CRC-32 (gzip's polynomial;
format ``l2``, the objects of LayerLift before 2026-12-07): x86 (SSE 4.2,
PCLMULQDQ) and ARMv8 compute it with instructions: 58-67 ms a GiB a thread
on this project's 2-core machine with the ``crc32c`` package's CRC32
instruction against 86-89 ms for ISA-L's folded CRC-32 and 400 ms for
zlib's (``layerlift bench integrity``, ``bench/results/integrity.json``).
Every load verifies each byte once and every offload checksums each byte
once, so this is about a quarter less CPU per byte on both sides. Its width
is CRC-32's: random corruption passes either with a chance of one in 2^32.

Which code computes it (:data:`CRC_IMPLEMENTATION`): AWS's common runtime
(``awscrt``, its ``aws-c-checksums``) where it is installed (a dependency),
else the ``crc32c`` package. The first folds 64 bytes a step with AVX-512
carry-less multiplies (VPCLMULQDQ) where the CPU has them, the SSE 4.2
CRC32 instruction otherwise; the second uses the CRC32 instruction. On
the 2-core AMD EPYC of 2026-12-07: 46 against 65 ms a GiB of cold memory,
62 against 31 GB/s in the cache, 21-24 against 15 GB/s a thread over the
128 KiB to 1 MiB slices of a real layout; both release the GIL (two
threads checksum at about twice one's rate). Both compute the same CRC (the tests
hold each against a bit-by-bit reference and against the other), so
objects verify across machines and packages.

The old and the new objects never mix: the format is in every key
(``linker/keys.py``), so a LayerLift of one format finds no object of the
other (a miss, recomputed, then stored anew).

This module is plain and synchronous; the engine calls it in worker threads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import crc32c as _crc32c
import numpy as np

from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "CHECK_BYTES",
    "CRC_IMPLEMENTATION",
    "OBJECT_FORMAT",
    "checksums",
    "component_slices",
    "crc32c",
    "crc32c_package",
    "encode_object",
    "footer_bytes",
    "footers",
    "mismatches",
    "object_bytes",
    "page_footers",
    "pieced_checksums",
    "slice_seed",
]

# The byte layout of a page object. Part of every store key's fingerprint
# (`KeySchema`): a LayerLift that lays objects out differently never reads
# these as valid. "l3": layer-major page + per-layer CRC-32C footer ("l2",
# before it: the same with CRC-32).
OBJECT_FORMAT = "l3"
CHECK_BYTES = 4  # one little-endian uint32 CRC-32C per layer slice


def crc32c_package() -> tuple[Callable[..., int], str]:
    """The ``crc32c`` package's CRC-32C and its name: "hardware" with the
    CPU's CRC32 instruction, "software" its table code (the same CRC, slower)."""
    return _crc32c.crc32c, "crc32c-hardware" if _crc32c.hardware_based else "crc32c-software"


def _pick_crc32c() -> tuple[Callable[..., int], str]:
    """The fastest CRC-32C installed: ``awscrt``'s, else the ``crc32c`` package's."""
    try:
        from awscrt.checksums import crc32c as aws_crc32c
    except ImportError:
        return crc32c_package()
    return aws_crc32c, "awscrt"


crc32c: Callable[..., int]
"""``crc32c(data, value=0)``: the CRC-32C of ``data`` (any bytes-like
object) continuing from ``value`` (``crc32c(b, crc32c(a)) == crc32c(a + b)``),
as ``zlib.crc32`` continues a CRC-32."""
CRC_IMPLEMENTATION: str
"""Which code :data:`crc32c` is: ``"awscrt"`` (AWS's common runtime),
``"crc32c-hardware"`` or ``"crc32c-software"`` (the ``crc32c`` package)."""
crc32c, CRC_IMPLEMENTATION = _pick_crc32c()


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
    return crc32c(f"{key}#{local_layer}".encode())


def checksums(ptrs: Sequence[int], size: int, seeds: Sequence[int]) -> np.ndarray:
    """CRC-32C of ``size`` bytes at each address, each from its seed (one
    call per address, the GIL released for slices of 32 KiB and more).
    Returns ``uint32[len(ptrs)]``."""
    out = np.empty(len(ptrs), dtype="<u4")
    for i, (ptr, seed) in enumerate(zip(ptrs, seeds, strict=True)):
        view = (ctypes.c_char * size).from_address(ptr)
        out[i] = crc32c(memoryview(view).cast("B"), seed)
    return out


def copy_checksum(dst: int, pieces: Sequence[tuple[int, int]], seed: int) -> int:
    """Copy ``pieces`` (``(address, nbytes)``) back to back to ``dst``, then
    return the CRC-32C from ``seed`` of the bytes just written, read back from
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
    return int(crc32c(memoryview(view).cast("B"), seed))


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


def pieced_checksums(ptrs: Sequence[int], sizes: Sequence[int],
                     seeds: Sequence[int]) -> np.ndarray:
    """CRC-32C of each slice that lies in ``len(sizes)`` pieces: slice ``i``'s
    piece ``j`` is ``sizes[j]`` bytes at ``ptrs[i * len(sizes) + j]``, its
    CRC continued over the pieces in order from ``seeds[i]`` (the CRC of the
    pieces back to back). Returns ``uint32[len(seeds)]``."""
    k = len(sizes)
    if len(ptrs) != k * len(seeds):
        raise ValueError(f"{len(ptrs)} addresses for {len(seeds)} slices of {k} piece(s)")
    out = np.empty(len(seeds), dtype="<u4")
    for i, seed in enumerate(seeds):
        crc = seed
        for j, size in enumerate(sizes):
            view = (ctypes.c_char * size).from_address(ptrs[i * k + j])
            crc = crc32c(memoryview(view).cast("B"), crc)
        out[i] = crc
    return out


def mismatches(ptrs: Sequence[int], size: int, expected: np.ndarray,
               seeds: Sequence[int], pieces: Sequence[int] | None = None) -> list[int]:
    """Indices ``i`` whose ``size`` bytes at ``ptrs[i]`` do not have the CRC
    ``expected[i]`` from seed ``seeds[i]`` (empty: every slice verified).
    ``pieces``: each slice lies in pieces of these sizes (adding up to
    ``size``), addressed as :func:`pieced_checksums` says."""
    if pieces is not None and len(pieces) > 1:
        if sum(pieces) != size:
            raise ValueError(f"pieces of {sum(pieces)} bytes for a slice of {size}")
        got = pieced_checksums(ptrs, pieces, seeds)
    else:
        got = checksums(ptrs, size, seeds)
    return np.flatnonzero(got != expected.astype("<u4", copy=False)).tolist()


def encode_object(spec: ModelSpec, component: Component, page: bytes, key: str) -> bytes:
    """The store object of one page stored under ``key``: its bytes plus the
    checksum footer (for tools and tests that write objects without an
    engine). Raises ValueError if ``page`` is not one page of ``component``."""
    if len(page) != spec.page_bytes(component):
        raise ValueError(f"a {component.value} page is {spec.page_bytes(component)} bytes, "
                         f"got {len(page)}")
    sums = [crc32c(page[o : o + n], slice_seed(key, j))
            for j, (o, n) in enumerate(component_slices(spec, component))]
    return bytes(page) + np.asarray(sums, dtype="<u4").tobytes()
