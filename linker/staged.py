"""The staged transfer: fetch → verify CRC → gated copy (loads); snapshot → put (offloads).

One mechanism for the engine, the SGLang linker and the vLLM worker. It moves
store objects in the format of ``linker/integrity.py`` (a page's layer slices,
layer-major, then one CRC-32 per slice, seeded with the key and the slice's
index) between the store and a host's memory, always through a
:class:`~layerlift.linker.ring.StagingRing`. What the host's memory *is*
(SGLang's slots, vLLM's blocks, the engine's pool pages, device tensors) stays
behind two small seams each adapter supplies: a **sink** (where verified rows
go) and a **snapshot** (where an offload's page bytes come from). Nothing in
here knows a host's vocabulary.

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
(else ``ValueError`` at construction, with a sentence). Each chunk's staging
is at most ``ring.capacity // depth`` bytes (or one row, if a row is larger):

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
  earlier ones.

So with the default 64 MiB staging and ``depth`` 4, any request streams in
16 MiB chunks.

Loads (:class:`StagedLoad`)
===========================

``fetch_layer(layer)`` (a worker thread; :meth:`StagedLoad.job` wraps it as the
``overlap`` scheduler's :class:`~layerlift.overlap.base.LayerJob`) runs the
layer's chunks in order; per chunk:

1. take a region (bounded wait: :class:`~layerlift.linker.ring.StagingTimeout`);
2. one ``get_ranges`` call: each object's slice and its footer entry into the
   region;
3. verify every CRC; on a mismatch raise :class:`CorruptSlices` (``.keys``,
   ``.layer``) *before* anything is copied: a corrupt, foreign or truncated
   slice never reaches the destination (``on_corrupt`` hears the keys first,
   for an adapter that removes them);
4. under the :class:`Gate`: if it is closed raise :class:`TransferRevoked` (no
   copy); else, per segment, ``sink.write(segment, part, rows)`` with
   ``rows`` the verified ``uint8[n, size]`` view of the region;
   After the layer's last chunk was written, still under the gate,
   ``on_layer(layer, event)`` runs: an adapter marks the layer landed there,
   so a ``gate.close()`` that returned sees every layer either landed (all
   its copies issued) or never to land (its slots may be zeroed safely);
5. give the region back: at once when the sink returned None (the copy is
   done), or once the event the sink returned completed
   (:meth:`Region.release_after`): staging is reused only after the device
   copy that reads it ran.

It returns the layer's event (the last chunk's; None on the host path) and
stores it in ``events[layer]``. A failure raises out of ``fetch_layer`` (the
scheduler then fails the layer and later ones); chunks of the layer already
copied stay copied: the adapter zeroes or reports the layer as failed, as it
does today.

``StoreTimeout`` of a read: the region is handed over to the still-running
call (:meth:`Region.hand_over`: it returns to the ring only when the call
ended, so a late landing writes staging that is still owned, never the
destination and never a region lent to someone else), the exception is
marked owned and appended to ``timed_out``, and it is raised. Cancellation:
a load is stopped by closing its gate (``gate.close()``, e.g. when the load is
reported failed or the request aborted); from then on nothing is written into
the destination; reads in flight finish into staging and their regions
return. The adapter frees the destination only after ``gate.close()``
returned, and the staging's memory (the ring) only once ``wait_quiet`` is
true. The transfer opens no read session: the adapter opens one over the
load's keys around it (``Store.open_session``), as it does today.

Offloads (:class:`StagedOffload`)
=================================

``run()`` (a worker thread) per chunk, in order: take a region, let the
snapshot copy each segment's page bytes into it (``snapshot.read(segment,
part, pages)``, ``pages`` the ``uint8[n, page_bytes]`` strided view of the
region's rows), compute the footers over *those* bytes, then one ``put``. The bytes a
put sends are the snapshot's, under checksums of the same bytes: a put that
lands late (after its timeout) sends what the source held at snapshot time,
never what it holds later. ``on_source_free`` runs once the transfer will not
read the source again (after the last snapshot, or at the first failure): the
adapter keeps its source (locked slots, pinned pages, blocks not freed) until
then. The outcome is an :class:`OffloadOutcome` (objects and bytes put, late
landings, the first error); a failure stops the offload (later chunks are not
sent).

``StoreTimeout`` of a put: with ``wait_timed_out`` (the engine's rule) the
worker waits until the put really ended; if it succeeded it counts as
``late`` and the offload goes on, else the offload fails. Without it (the
hosts' rule: report at once) the region is handed over to the call, the
offload fails at once with that ``StoreTimeout``, and ``on_late_end`` runs
when the call ended.

Device path
===========

:class:`DeviceSink` is the sink for device memory, written once for every
adapter: after the host CRC check, ``write`` issues the H2D copy of the
chunk's rows and the adapter's ``scatter`` (gather/scatter into its slot or
block indices) on its load stream through the device seam
(``overlap/device.py``: ``Device.launch``), then records an event on that same
stream after the copies and returns it. The region is released only once that
event completed; the layer's event (the last chunk's) is what the forward's
stream waits on before it reads the layer (``event.wait(forward stream)``).
``begin()`` orders the load stream after the caller's current stream (a fence,
no host sync), as ``CudaLane.begin_load`` does. :class:`DeviceSnapshot` is the
offload side: the gather of device slots into pinned staging runs on a stream
ordered after an event the adapter recorded after the forward that wrote them,
and ``read`` returns once that copy finished. The ring of a device path is
pinned: ``StagingRing(store, alloc=device.pinned)``. :class:`HostSink` and
:class:`HostSnapshot` are the CPU forms (the copy is done when they return).

Threads
=======

``fetch_layer`` of different layers may run at once on different threads (the
lane's workers); ``write`` of one sink is serialised only where it says so
(``DeviceSink``: launch and record under one lock, so events are recorded in
issue order). The gate's lock is held during a sink's ``write``: ``close()``
returns only once no write is in progress, and none starts afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from layerlift.linker.integrity import (
    CHECK_BYTES,
    checksums,
    component_slices,
    mismatches,
    slice_seed,
)
from layerlift.linker.ring import Region, StagingRing, StagingTimeout
from layerlift.linker.store_base import Store, StoreError, StoreIntegrityError, StoreTimeout
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import Device, DeviceEvent
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "DEFAULT_DEPTH",
    "CorruptSlices",
    "DeviceSink",
    "DeviceSnapshot",
    "Gate",
    "HostSink",
    "HostSnapshot",
    "LoadChunk",
    "LoadPart",
    "LoadSegment",
    "ObjectLayout",
    "OffloadChunk",
    "OffloadOutcome",
    "OffloadPart",
    "OffloadSegment",
    "Sink",
    "Snapshot",
    "StagedLoad",
    "StagedOffload",
    "TransferRevoked",
    "require_fit",
]

DEFAULT_DEPTH = 4
"""Chunks of one load in flight at most; a chunk is at most ``capacity // depth``."""


# ---- what moves ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectLayout:
    """One kind of store object: slice ``j`` is ``slices[j] = (offset, size)``
    bytes of the page, the footer (one CRC per slice, in that order) starts at
    ``page_bytes``. ``ValueError`` for a slice outside the page."""

    slices: tuple[tuple[int, int], ...]
    page_bytes: int

    def __post_init__(self) -> None:
        if not self.slices:
            raise ValueError("an object layout needs at least one slice")
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


class CorruptSlices(StoreIntegrityError):
    """Slices of ``keys`` read for ``layer`` failed their CRC; nothing of the
    chunk was copied into the destination."""

    def __init__(self, layer: int, keys: Sequence[str]) -> None:
        self.layer, self.keys = layer, tuple(keys)
        super().__init__(
            f"layer {layer}: {len(self.keys)} slice(s) read from the store failed their "
            f"checksum (a corrupted, truncated or foreign object), e.g. {self.keys[0]}")


class TransferRevoked(StoreError):
    """The load's gate was closed before this chunk's copy: nothing was written."""


class Gate:
    """Opens once, closes once: copies into a load's destination happen only
    while it is open, holding its lock (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    @contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the gate; yields whether it is open (copy only if True)."""
        with self._lock:
            yield self._open

    def close(self) -> None:
        """Close it: returns once no copy runs; none starts afterwards. Idempotent."""
        with self._lock:
            self._open = False

    @property
    def open(self) -> bool:
        return self._open


# ---- the seams -------------------------------------------------------------------


class Sink(Protocol):
    """Where a load's verified rows go (the adapter's destination)."""

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> DeviceEvent | None:
        """Copy ``rows`` (``uint8[seg.rows, size]``, host staging, verified)
        into slice ``seg.local`` of rows ``seg.lo..seg.hi`` of ``part``'s
        destination. Called under the load's gate, on a worker thread. Return
        None once the copy is done, or an event recorded after copies that
        still read ``rows`` (the region is reused only once it completed)."""


Scatter = Callable[[LoadSegment, LoadPart, torch.Tensor], None]
"""``scatter(seg, part, rows)``: write ``rows`` (on the destination's device)
into the destination of the segment's rows (e.g. ``view.index_copy_(0, idx, rows)``)."""


class HostSink:
    """The host path: ``scatter`` copies from staging; done when it returns."""

    def __init__(self, scatter: Scatter) -> None:
        self.scatter = scatter

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> DeviceEvent | None:
        self.scatter(seg, part, rows)
        return None


class DeviceSink:
    """The device path (see the module docstring): per segment, an H2D copy of
    the rows plus ``scatter`` issued on ``stream`` (a new load stream of
    ``device`` by default), then an event recorded on that stream, returned."""

    def __init__(self, device: Device, scatter: Scatter, stream: Any = None) -> None:
        self.device, self.scatter = device, scatter
        self.stream = device.new_stream() if stream is None else stream
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Order the load stream after everything the calling thread's current
        stream issued so far (relocations, a previous forward): one event, no
        host sync. Call once per load, before its first write."""
        with self.device.use():
            fence = self.device.event()
            fence.record(self.device.current_stream())
            fence.wait(self.stream)

    def issue(self, work: Callable[[], None]) -> DeviceEvent:
        """Issue ``work`` on the load stream (e.g. zeroing a failed layer's
        slots after its copies) and return an event recorded after it."""
        with self._lock:
            self.device.launch(self.stream, work)
            event = self.device.event()
            event.record(self.stream)
        return event

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> DeviceEvent | None:
        target = self.device.torch_device
        scatter = self.scatter

        def work() -> None:
            scatter(seg, part, rows.to(target, non_blocking=True))

        return self.issue(work)


class Snapshot(Protocol):
    """Where an offload's page bytes come from (the adapter's source)."""

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        """Copy the page bytes of rows ``seg.lo..seg.hi`` of ``part``
        (layer-major, ``layout.page_bytes`` each) into ``pages``
        (``uint8[seg.rows, page_bytes]``, a strided view of staging).
        Returns once the bytes are in ``pages``."""


Gather = Callable[[OffloadSegment, OffloadPart], torch.Tensor]
"""``gather(seg, part)``: the segment's pages as ``uint8[rows, page_bytes]``
(on the source's device)."""


class HostSnapshot:
    """The host path: ``pages.copy_(gather(seg, part))``."""

    def __init__(self, gather: Gather) -> None:
        self.gather = gather

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        pages.copy_(self.gather(seg, part))


class DeviceSnapshot:
    """The device path: the gather and its D2H copy into pinned staging run on
    ``stream``, ordered after ``after()`` (an event the adapter recorded on the
    forward's stream after the forward that wrote the slots; None: a fence on
    the calling thread's current stream); ``read`` returns once the copy ran."""

    def __init__(self, device: Device, gather: Gather, stream: Any = None,
                 after: Callable[[], DeviceEvent | None] | None = None) -> None:
        self.device, self.gather, self.after = device, gather, after
        self.stream = device.new_stream() if stream is None else stream

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        device, gather = self.device, self.gather
        ready = self.after() if self.after is not None else None
        if ready is None:
            with device.use():
                ready = device.event()
                ready.record(device.current_stream())
        ready.wait(self.stream)

        def work() -> None:
            pages.copy_(gather(seg, part), non_blocking=True)

        device.launch(self.stream, work)
        done = device.event()
        done.record(self.stream)
        done.synchronize()


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


def _pack(runs: Sequence[tuple[int, int, int]], budget: int,
          ring: StagingRing) -> list[list[tuple[int, int, int]]]:
    """Cut ``runs`` (``(index, rows, row_bytes)``, in order) into chunks of
    ``(index, lo, hi)`` pieces: a chunk holds at most ``budget`` bytes (or one
    row, if a row is larger) and always fits the ring; order is kept."""
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


# ---- loads -----------------------------------------------------------------------


class StagedLoad:
    """One load: per-layer fetches through ``ring`` into ``sink`` (see the
    module docstring). ``ValueError`` when a slice does not fit the ring, a
    ``layers`` entry names no part or slice, or ``depth`` < 1."""

    def __init__(self, ring: StagingRing, store: Store, parts: Sequence[LoadPart],
                 layers: Sequence[Sequence[tuple[int, int]]], sink: Sink, *,
                 depth: int = DEFAULT_DEPTH, gate: Gate | None = None,
                 timeout_s: float | None = None,
                 on_corrupt: Callable[[list[str]], None] | None = None,
                 on_layer: Callable[[int, DeviceEvent | None], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"a staged load needs depth >= 1, got {depth}")
        self.ring, self.store, self.sink = ring, store, sink
        self.parts = tuple(parts)
        self.depth = depth
        self.gate = gate if gate is not None else Gate()
        self.timeout_s = ring.timeout_s if timeout_s is None else timeout_s
        self.on_corrupt = on_corrupt
        self.on_layer = on_layer
        budget = max(1, ring.capacity // depth)
        self.chunks: list[list[LoadChunk]] = []
        for layer, reads in enumerate(layers):
            runs: list[tuple[int, int, int]] = []
            for p, local in reads:
                if not 0 <= p < len(self.parts):
                    raise ValueError(f"layer {layer} reads part {p}; the load has "
                                     f"{len(self.parts)} part(s)")
                part = self.parts[p]
                if not 0 <= local < len(part.layout.slices):
                    raise ValueError(f"layer {layer} reads slice {local} of part {p}, whose "
                                     f"objects have {len(part.layout.slices)} slice(s)")
                row = part.layout.slices[local][1] + CHECK_BYTES
                if not ring.fits(row):
                    raise ValueError(
                        f"one slice of {row} bytes (with its checksum) does not fit the "
                        f"{ring.capacity}-byte staging ring; give the ring at least "
                        f"{ring.span(row)} bytes")
                runs.append((len(runs), len(part.keys), row))
            self.chunks.append([
                LoadChunk(layer, tuple(LoadSegment(layer, reads[i][0], reads[i][1], lo, hi)
                                       for i, lo, hi in pieces))
                for pieces in _pack(runs, budget, ring)])
        self.events: list[DeviceEvent | None] = [None] * len(self.chunks)
        self.timed_out: list[StoreTimeout] = []
        self._slots = threading.Semaphore(depth)
        self._lock = threading.Condition()
        self._out = 0  # regions of this load not yet back in the ring

    def nbytes(self, layer: int) -> int:
        """Payload bytes layer ``layer`` moves (without checksums)."""
        return sum(self.parts[g.part].layout.slices[g.local][1] * g.rows
                   for c in self.chunks[layer] for g in c.segments)

    def job(self, layer: int, requests: frozenset[Hashable] = frozenset()) -> LayerJob:
        """``fetch_layer(layer)`` as the overlap scheduler's job."""
        def fetch() -> None:
            self.fetch_layer(layer)

        return LayerJob(layer, fetch, self.nbytes(layer), requests)

    def fetch_layer(self, layer: int) -> DeviceEvent | None:
        """Worker thread: every chunk of ``layer`` (see the module docstring).
        Returns (and stores in ``events``) the layer's event, None on the host
        path. Raises ``StoreError`` (``StoreTimeout``, ``StagingTimeout``,
        :class:`CorruptSlices`, :class:`TransferRevoked`, ...)."""
        chunks = self.chunks[layer]
        event: DeviceEvent | None = None
        for i, chunk in enumerate(chunks):
            event = self._chunk(chunk, last=i == len(chunks) - 1)
        if not chunks:
            self._landed(layer, None)
        return event

    def _landed(self, layer: int, event: DeviceEvent | None) -> None:
        """A layer with nothing to read lands at once (under the gate, too)."""
        with self.gate.held() as open_:
            if not open_:
                raise TransferRevoked(f"layer {layer}: the load was stopped before it landed")
            self.events[layer] = event
            if self.on_layer is not None:
                self.on_layer(layer, event)

    def _take(self, nbytes: int) -> Region:
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):
            raise StagingTimeout(f"the load's {self.depth} chunks in flight did not end "
                                 f"within {self.timeout_s:g} s")
        try:
            region = self.ring.acquire(nbytes, timeout_s=max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._out += 1
        region.on_free(self._returned)
        return region

    def _returned(self) -> None:
        self._slots.release()
        with self._lock:
            self._out -= 1
            self._lock.notify_all()

    def _chunk(self, chunk: LoadChunk, last: bool) -> DeviceEvent | None:
        # Region layout, per segment in order: its rows of ``size`` bytes, then
        # their CRCs; one ranged call reads every segment's slices and CRCs.
        plan: list[tuple[LoadSegment, LoadPart, int, int, list[str]]] = []
        at = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            size = part.layout.slices[seg.local][1]
            plan.append((seg, part, at, size, list(part.keys[seg.lo : seg.hi])))
            at += seg.rows * (size + CHECK_BYTES)
        region = self._take(at)
        event: DeviceEvent | None = None
        try:
            base = region.ptr
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            offs: list[list[int]] = []
            for seg, part, start, size, seg_keys in plan:
                crcs = base + start + seg.rows * size
                slice_at = part.layout.slices[seg.local][0]
                footer_at = part.layout.footer_at(seg.local)
                for i in range(seg.rows):
                    dst.append([base + start + i * size, crcs + i * CHECK_BYTES])
                    lens.append([size, CHECK_BYTES])
                    offs.append([slice_at, footer_at])
                keys += seg_keys
            try:
                self.store.get_ranges(keys, dst, lens, offs)
            except StoreTimeout as exc:
                region.hand_over(exc)
                self.timed_out.append(exc)
                raise
            corrupt: list[str] = []
            for seg, _, start, size, seg_keys in plan:
                n = seg.rows
                raw = region.tensor[start + n * size : start + n * (size + CHECK_BYTES)].numpy()
                bad = mismatches([base + start + i * size for i in range(n)], size,
                                 raw.view("<u4"), [slice_seed(k, seg.local) for k in seg_keys])
                corrupt += [seg_keys[b] for b in bad]
            if corrupt:
                if self.on_corrupt is not None:
                    self.on_corrupt(corrupt)
                raise CorruptSlices(chunk.layer, corrupt)
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked(f"layer {chunk.layer}: the load was stopped before "
                                          "its copy; nothing was written")
                for seg, part, start, size, _ in plan:
                    rows = region.tensor[start : start + seg.rows * size].view(seg.rows, size)
                    written = self.sink.write(seg, part, rows)
                    event = written if written is not None else event
                if last:
                    self.events[chunk.layer] = event
                    if self.on_layer is not None:
                        self.on_layer(chunk.layer, event)
        finally:
            region.release_after(event)
        return event

    @property
    def quiet(self) -> bool:
        """True once every region of this load returned to the ring (no read,
        timed-out call or device copy still uses its staging)."""
        with self._lock:
            return self._out == 0

    def wait_quiet(self, timeout_s: float | None = None) -> bool:
        """Block until ``quiet`` (at most ``timeout_s``); returns ``quiet``."""
        with self._lock:
            return self._lock.wait_for(lambda: self._out == 0, timeout_s)


# ---- offloads --------------------------------------------------------------------


@dataclass(slots=True)
class OffloadOutcome:
    """What one :meth:`StagedOffload.run` did: ``objects`` and ``bytes`` put
    (``late``: puts that landed after their timeout, waited for), and the first
    error (None: everything was put)."""

    objects: int = 0
    bytes: int = 0
    late: int = 0
    error: StoreError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class StagedOffload:
    """One offload: snapshot → footers → put, chunk by chunk through ``ring``
    (see the module docstring). ``ValueError`` when one object does not fit
    the ring."""

    def __init__(self, ring: StagingRing, store: Store, parts: Sequence[OffloadPart],
                 snapshot: Snapshot, *, depth: int = DEFAULT_DEPTH,
                 timeout_s: float | None = None, wait_timed_out: bool = False,
                 on_late_end: Callable[[], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"a staged offload needs depth >= 1, got {depth}")
        self.ring, self.store, self.snapshot = ring, store, snapshot
        self.parts = tuple(parts)
        self.timeout_s = ring.timeout_s if timeout_s is None else timeout_s
        self.wait_timed_out = wait_timed_out
        self.on_late_end = on_late_end
        budget = max(1, ring.capacity // depth)
        runs: list[tuple[int, int, int]] = []
        for p, part in enumerate(self.parts):
            size = part.layout.object_bytes
            if not ring.fits(size):
                raise ValueError(
                    f"one object of {size} bytes does not fit the {ring.capacity}-byte "
                    f"staging ring; give the ring at least {ring.span(size)} bytes")
            runs.append((p, len(part.keys), size))
        self.chunks: list[OffloadChunk] = [
            OffloadChunk(tuple(OffloadSegment(p, lo, hi) for p, lo, hi in pieces))
            for pieces in _pack(runs, budget, ring)]

    def run(self, on_source_free: Callable[[], None] | None = None) -> OffloadOutcome:
        """Worker thread: put every chunk in order; stop at the first failure.
        ``on_source_free`` runs once, when the source is not read any more."""
        outcome = OffloadOutcome()
        try:
            for index, chunk in enumerate(self.chunks):
                last = index == len(self.chunks) - 1
                if not self._chunk(chunk, outcome, on_source_free if last else None):
                    break
                if last:
                    on_source_free = None
        finally:
            if on_source_free is not None:
                on_source_free()
        return outcome

    def _chunk(self, chunk: OffloadChunk, outcome: OffloadOutcome,
               snapshotted: Callable[[], None] | None) -> bool:
        # Region layout: every segment's whole objects, in order, back to back.
        plan: list[tuple[OffloadSegment, OffloadPart, int]] = []
        total = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            plan.append((seg, part, total))
            total += seg.rows * part.layout.object_bytes
        try:
            region = self.ring.acquire(total, timeout_s=self.timeout_s)
        except StoreError as exc:
            outcome.error = exc
            return False
        try:
            base = region.ptr
            keys: list[str] = []
            ptrs: list[int] = []
            sizes: list[int] = []
            try:
                for seg, part, start in plan:
                    layout, n = part.layout, seg.rows
                    ob, pb = layout.object_bytes, layout.page_bytes
                    objects = region.tensor[start : start + n * ob].view(n, ob)
                    self.snapshot.read(seg, part, objects[:, :pb])
                    seg_keys = list(part.keys[seg.lo : seg.hi])
                    for j, (offset, size) in enumerate(layout.slices):
                        sums = checksums([base + start + i * ob + offset for i in range(n)],
                                         size, [slice_seed(k, j) for k in seg_keys])
                        at = layout.footer_at(j)
                        objects[:, at : at + CHECK_BYTES] = torch.from_numpy(
                            np.ascontiguousarray(sums).view(np.uint8).reshape(n, CHECK_BYTES))
                    keys += seg_keys
                    ptrs += [base + start + i * ob for i in range(n)]
                    sizes += [ob] * n
            finally:
                if snapshotted is not None:
                    snapshotted()
            try:
                self.store.put(keys, ptrs, sizes)
            except StoreTimeout as exc:
                if not self.wait_timed_out:
                    region.hand_over(exc, self.on_late_end)
                    outcome.error = exc
                    return False
                if not exc.wait_finished():
                    outcome.error = exc
                    return False
                outcome.late += 1
            except StoreError as exc:
                outcome.error = exc
                return False
            outcome.objects += len(keys)
            outcome.bytes += sum(sizes)
            return True
        finally:
            region.release()
