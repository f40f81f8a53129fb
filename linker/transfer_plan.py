"""What a staged transfer moves, and how it is cut into chunks (``linker/staged.py``).

The staged transfer's plain data: the byte layout of one kind of object,
the parts, segments and chunks a load or an offload is made of, and the
packing of rows into chunks that fit the staging ring. Nothing here does
I/O or holds a lock.

Vocabulary
==========

* :class:`ObjectLayout`: the byte layout of one kind of object (each slice's
  ``(offset, size)`` in footer order, and ``page_bytes``, where the footer
  starts).
* A **part** is a run of objects of one layout with one destination (a
  component of the engine's pool, an SGLang pool, a vLLM KV-cache group):
  :class:`LoadPart` (keys + the adapter's opaque ``target``) or
  :class:`OffloadPart` (keys + the adapter's opaque ``source``). ``keys[i]``
  is row ``i`` of the part: the adapter maps row ``i`` to its slot, block or
  page.
* ``layers``: for a load, per *global* layer (the forward's order), the
  ``(part index, local slice index)`` pairs that layer reads.

Chunking
========

A transfer of any size streams through the ring, whatever the ring's size, as
long as one object's slice (loads) or one whole object (offloads) fits it
(else ``ValueError`` at construction, with a sentence). Each load chunk's
staging is at most ``ring.capacity // depth`` bytes, each offload chunk's
``ring.capacity // 2`` (``// 1`` at depth 1) (or one row, if a row is larger):

* a load chunk is :class:`LoadChunk` ``(layer, segments)``: one store call
  (``get_ranges``) into one region. Each :class:`LoadSegment` ``(layer, part,
  local, lo, hi)`` is slice ``local`` of objects ``keys[lo:hi]`` of one part,
  with their footer entries; a chunk packs the layer's segments of every part
  in order (a batch of many requests is still one call per layer when it fits
  the budget). Staging layout, per segment in order: ``n = hi - lo`` rows of
  ``size`` bytes, then ``n`` little-endian ``uint32`` CRCs. At most ``depth``
  chunks of one load hold
  staging at once (a semaphore per transfer; a chunk whose device copy is still
  pending, or whose read timed out and still runs, counts);
* an offload chunk is :class:`OffloadChunk` ``(segments)``: one ``put`` from
  one region. Each :class:`OffloadSegment` ``(part, lo, hi)`` is whole
  objects ``keys[lo:hi]`` of one part (page then footer, as stored; a put
  cannot append, so an object is never split), segments in the parts' order.
  An offload keeps one chunk in flight: chunks are put
  in order and the next is sent only once the previous put succeeded, so a
  later object (a checkpoint, a deeper page) is never stored without the
  earlier ones. It holds two regions at most (one chunk put while the next
  is staged), hence half the ring a chunk: fewer, larger puts.

So with the default 64 MiB staging and ``depth`` 4, any load streams in
16 MiB chunks and any offload in 32 MiB ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from layerlift.linker.integrity import CHECK_BYTES, component_slices
from layerlift.linker.ring import StagingRing
from layerlift.linker.store_base import StoreError
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "LoadChunk",
    "LoadPart",
    "LoadSegment",
    "ObjectLayout",
    "OffloadChunk",
    "OffloadOutcome",
    "OffloadPart",
    "OffloadSegment",
    "pack_runs",
    "require_fit",
]


@dataclass(slots=True)
class OffloadOutcome:
    """What one offload did: ``objects`` and ``bytes`` put (``late``: puts
    that landed after their timeout, waited for), and the first error (None:
    everything was put)."""

    objects: int = 0
    bytes: int = 0
    late: int = 0
    error: StoreError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ObjectLayout:
    """One kind of store object: slice ``j`` is ``slices[j] = (offset, size)``
    bytes of the page, the footer (one CRC per slice, in that order) starts at
    ``page_bytes``. ``ValueError`` for a slice outside the page."""

    slices: tuple[tuple[int, int], ...]
    page_bytes: int

    def __post_init__(self) -> None:
        # No slices: a page no layer reads (a model without one of the
        # engine's components keeps a placeholder page), stored without footer.
        for offset, size in self.slices:
            if offset < 0 or size <= 0 or offset + size > self.page_bytes:
                raise ValueError(f"slice ({offset}, {size}) lies outside the "
                                 f"{self.page_bytes}-byte page")

    @classmethod
    def of(cls, spec: ModelSpec, component: Component) -> ObjectLayout:
        """The layout of ``component``'s page objects (the engine's pools)."""
        return cls(tuple(component_slices(spec, component)), spec.page_bytes(component))

    @property
    def footer_bytes(self) -> int:
        return CHECK_BYTES * len(self.slices)

    @property
    def object_bytes(self) -> int:
        return self.page_bytes + self.footer_bytes

    def footer_at(self, local: int) -> int:
        """Offset of slice ``local``'s CRC in the object."""
        return self.page_bytes + CHECK_BYTES * local


@dataclass(frozen=True, slots=True)
class LoadPart:
    """Objects ``keys`` of one layout that a load reads; row ``i`` is
    ``keys[i]``. ``target`` is the adapter's (the transfer only passes it on)."""

    layout: ObjectLayout
    keys: tuple[str, ...]
    target: Any = None


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """Slice ``local`` of rows ``[lo, hi)`` of part ``part``, for global
    ``layer``: what one ``Sink.write`` copies."""

    layer: int
    part: int
    local: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class LoadChunk:
    """The segments of one ``layer`` read by one store call into one region."""

    layer: int
    segments: tuple[LoadSegment, ...]


@dataclass(frozen=True, slots=True)
class OffloadPart:
    """Objects ``keys`` of one layout that an offload puts; row ``i`` is
    ``keys[i]``. ``source`` is the adapter's (passed to the snapshot)."""

    layout: ObjectLayout
    keys: tuple[str, ...]
    source: Any = None


@dataclass(frozen=True, slots=True)
class OffloadSegment:
    """Whole objects ``[lo, hi)`` of part ``part``: what one ``Snapshot.read``
    copies."""

    part: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class OffloadChunk:
    """The segments put by one store call from one region, in order."""

    segments: tuple[OffloadSegment, ...]


def require_fit(ring: StagingRing, layout: ObjectLayout) -> None:
    """Raise ``ValueError`` (a sentence naming the size needed) unless every
    transfer of ``layout``'s objects streams through ``ring``: one slice with
    its checksum (loads) and one whole object (offloads) must fit. This is the
    only size a staged transfer refuses, so an adapter that checks it once at
    start-up never advertises a hit (``lookup``) that its load then refuses."""
    need = max(layout.object_bytes, max(size for _, size in layout.slices) + CHECK_BYTES)
    if not ring.fits(need):
        raise ValueError(
            f"objects of {layout.object_bytes} bytes do not fit the {ring.capacity}-byte "
            f"staging ring; give the ring at least {ring.span(need)} bytes")


def pack_runs(runs: Sequence[tuple[int, int, int]], budget: int,
              ring: StagingRing) -> list[list[tuple[int, int, int]]]:
    """Cut ``runs`` (``(index, rows, row_bytes)``, in order) into chunks of
    ``(index, lo, hi)`` pieces: a chunk holds at most ``budget`` bytes (or one
    row, if a row is larger) and always fits the ring; order is kept.

    As few chunks as a greedy fill of ``budget`` makes, but evened out: the
    smallest budget that still needs no more chunks cuts them (a binary
    search; the fewest chunks of a sequence cut in order never grows with
    the budget). Filled greedily, a layer one row over two chunks' budget
    was two full chunks and one of a row, a store call whose round trip
    carried almost nothing (64 rows of 512 KiB at a 16 MiB budget: 31, 31
    and 2 rows; evened: 22, 22, 20)."""
    greedy = _fill(runs, budget, ring)
    if len(greedy) <= 1:
        return greedy
    total = sum(rows * row for _, rows, row in runs)
    lo, hi = max(1, -(-total // len(greedy))) - 1, budget  # hi needs no more chunks
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(_fill(runs, mid, ring)) <= len(greedy):
            hi = mid
        else:
            lo = mid
    return _fill(runs, hi, ring)


def _fill(runs: Sequence[tuple[int, int, int]], budget: int,
          ring: StagingRing) -> list[list[tuple[int, int, int]]]:
    """:func:`pack_runs`' greedy cut: each chunk filled up to ``budget``."""
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for index, rows, row in runs:
        lo = 0
        while lo < rows:
            room = (budget - used) // row
            while room > 0 and not ring.fits(used + room * row):
                room -= 1
            if room <= 0:
                if cur:
                    chunks.append(cur)
                    cur, used = [], 0
                    continue
                room = 1  # a row larger than the budget travels alone
            hi = min(rows, lo + room)
            cur.append((index, lo, hi))
            used += (hi - lo) * row
            lo = hi
    if cur:
        chunks.append(cur)
    return chunks


def check_bytes(layout: ObjectLayout, local: int) -> int:
    """Staging bytes a row's check takes when slice ``local`` is read: the
    whole footer for the part's first slice, one CRC otherwise."""
    return layout.footer_bytes if local == 0 else CHECK_BYTES


def merge_chunks(chunks: Sequence[Sequence[LoadChunk]], parts: Sequence[LoadPart], budget: int,
                 ring: StagingRing) -> list[tuple[LoadChunk, tuple[int, ...]]]:
    """A load's per-layer ``chunks`` (one list a layer) repacked as one
    load: every layer's segments, in layer order, in chunks of ``budget``
    bytes (`pack_runs`), each with the layers that land with it (those whose
    last slice it holds; a layer without reads with the layer before it, or
    with the first chunk), so the layers land in order."""
    flat = [seg for layer in chunks for c in layer for seg in c.segments]
    runs = [(i, seg.rows, parts[seg.part].layout.slices[seg.local][1]
             + check_bytes(parts[seg.part].layout, seg.local)) for i, seg in enumerate(flat)]
    packed = pack_runs(runs, budget, ring)
    last_at: dict[int, int] = {}  # layer -> the chunk holding its last slice
    for k, pieces in enumerate(packed):
        for i, _, _ in pieces:
            last_at[flat[i].layer] = k
    at = 0
    for layer in range(len(chunks)):
        at = last_at.setdefault(layer, at)
    plan: list[tuple[LoadChunk, tuple[int, ...]]] = []
    for k, pieces in enumerate(packed):
        segs = tuple(LoadSegment(flat[i].layer, flat[i].part, flat[i].local,
                                 flat[i].lo + lo, flat[i].lo + hi) for i, lo, hi in pieces)
        landing = tuple(sorted(layer for layer, c in last_at.items() if c == k))
        plan.append((LoadChunk(segs[0].layer, segs), landing))
    return plan


def reads_every_slice_once(chunks: Sequence[Sequence[LoadChunk]],
                           parts: Sequence[LoadPart]) -> bool:
    """Whether the load's segments read every slice of every row of every
    part that has rows, each once (so the load is its objects, whole)."""
    segs = [seg for layer in chunks for c in layer for seg in c.segments]
    wanted = sorted((p, j) for p, part in enumerate(parts) if part.keys
                    for j in range(len(part.layout.slices)))
    return (all(seg.rows == len(parts[seg.part].keys) for seg in segs)
            and sorted((seg.part, seg.local) for seg in segs) == wanted)
