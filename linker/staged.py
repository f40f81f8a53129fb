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

The plain data of a transfer (layouts, parts, segments, chunks, the
packing) is in ``linker/transfer_plan.py``; the sinks, snapshots and the
gate in ``linker/sinks.py``. Both are re-exported here: this module is the
staged transfer's public face.

Loads (:class:`StagedLoad`)
===========================

``fetch_layer(layer)`` (a worker thread; :meth:`StagedLoad.job` wraps it as the
``overlap`` scheduler's :class:`~layerlift.overlap.base.LayerJob`) runs the
layer's chunks in order; per chunk:

1. take a region (bounded wait: :class:`~layerlift.linker.ring.StagingTimeout`);
2. one ``get_ranges`` call into the region: each object's slice, and beside
   it, for a part's first slice (``local`` 0) the object's whole footer, for a
   later slice nothing when that first slice's chunk verified the rows'
   footers already (they are kept per row: one range per object, not two),
   else the slice's own footer entry;
3. verify every CRC; on a mismatch raise :class:`CorruptSlices` (``.keys``,
   ``.layer``) *before* anything is copied: a corrupt, foreign or truncated
   slice never reaches the destination (``on_corrupt`` hears the keys first,
   for an adapter that removes them). An object shorter than its layout
   (the store's :class:`~layerlift.linker.store_base.StoreObjectSize`: the
   read of its slice or footer entry lies past its end) is treated the same:
   ``on_corrupt`` hears its keys, then :class:`CorruptSlices`, nothing copied;
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

In place (the engine's loads)
=============================

With a :class:`Placement` instead of a sink, a layer is one chunk (one
``get_ranges`` call, whatever its size: the engine's "one store call per
layer, all requests together") whose slices land straight in the
placement's registered memory (the engine's pool pages, or its pinned
per-batch staging on a device); only the checks of step 2 go through the
ring, in a region that never waits (``overflow``). Step 3 verifies the
slices where they landed: a corrupt slice is in the destination then, and
:class:`CorruptSlices` tells the adapter to treat the layer as not
restored (the engine recomputes it; its pages were never visible). Step 4
has no copy: the gate is looked at before the read and held while
``on_layer`` runs. A ``StoreTimeout`` hands the checks' region over, as
above, and ``placement.timed_out`` takes the destination over (the engine
pins the pages the call may still write). ``verify=False`` reads the slices
alone (the engine's ``verify_restores=False``, a negative control).
:meth:`StagedLoad.fetch_whole` is the barrier's read in place: every object
whole (page and footer) in one call, then every slice verified.

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

In place (the engine's offloads): with a :class:`Source` instead of a
snapshot, every object goes in one ``put_parts`` call, each page from where
it is (the engine's pinned pool pages, or its registered host copy of
device pages), its footer computed over those very bytes into a region of
the ring that never waits (``overflow``); the adapter keeps the pages
unchanged until ``run`` returned, and a put that timed out is always waited
for (``wait_timed_out``). A page no layer reads (an :class:`ObjectLayout`
without slices) is put without a footer.

``StoreTimeout`` of a put: with ``wait_timed_out`` (the engine's rule) the
worker waits until the put really ended; if it succeeded it counts as
``late`` and the offload goes on, else the offload fails. Without it (the
hosts' rule: report at once) the region is handed over to the call, the
offload fails at once with that ``StoreTimeout``, and ``on_late_end`` runs
when the call ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layerlift.linker.integrity import CHECK_BYTES, checksums, mismatches, slice_seed
from layerlift.linker.ring import Region, StagingRing, StagingTimeout
from layerlift.linker.sinks import (
    DeviceSink,
    DeviceSnapshot,
    Gate,
    HostSink,
    HostSnapshot,
    Placement,
    Sink,
    Snapshot,
    Source,
)
from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreIntegrityError,
    StoreObjectSize,
    StoreTimeout,
)
from layerlift.linker.transfer_plan import (
    LoadChunk,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    OffloadChunk,
    OffloadPart,
    OffloadSegment,
    pack_runs,
    require_fit,
)
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import DeviceEvent

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
    "Placement",
    "Sink",
    "Snapshot",
    "Source",
    "StagedLoad",
    "StagedOffload",
    "TransferRevoked",
    "require_fit",
]

DEFAULT_DEPTH = 4
"""Chunks of one load in flight at most; a chunk is at most ``capacity // depth``."""


class CorruptSlices(StoreIntegrityError):
    """Slices of ``keys`` read for ``layer`` failed their CRC, or lie past the
    end of their object (a truncated or shorter foreign object: the store's
    ``StoreObjectSize`` is the ``__cause__``); nothing of the chunk was copied
    into the destination."""

    def __init__(self, layer: int, keys: Sequence[str]) -> None:
        self.layer, self.keys = layer, tuple(keys)
        super().__init__(
            f"layer {layer}: {len(self.keys)} slice(s) read from the store failed their "
            f"checksum (a corrupted, truncated or foreign object), e.g. {self.keys[0]}")


class TransferRevoked(StoreError):
    """The load's gate was closed before this chunk's copy: nothing was written."""


# ---- loads -----------------------------------------------------------------------


def _check_bytes(layout: ObjectLayout, local: int) -> int:
    """Staging bytes a row's check takes when slice ``local`` is read: the
    whole footer for the part's first slice, one CRC otherwise."""
    return layout.footer_bytes if local == 0 else CHECK_BYTES


@dataclass(slots=True)
class _SegmentRead:
    """One segment of a load chunk as read: where its rows start in the
    region, each row's slice size and check bytes, its keys, and the CRCs
    already known for it (None: read with the slices)."""

    seg: LoadSegment
    part: LoadPart
    start: int
    size: int
    check: int
    keys: list[str]
    known: np.ndarray | None


class StagedLoad:
    """One load: per-layer fetches through ``ring`` into ``sink`` (see the
    module docstring), or, with ``placement``, in place (``sink`` None): each
    slice read straight into the placement's registered memory and verified
    there, only the checksums going through the ring ("In place" in the
    module docstring). ``verify=False`` reads the slices alone and checks
    nothing (the in-place negative control). ``ValueError`` when a slice does
    not fit the ring, a ``layers`` entry names no part or slice, ``depth`` <
    1, or neither or both of ``sink`` and ``placement`` are given."""

    def __init__(self, ring: StagingRing, store: Store, parts: Sequence[LoadPart],
                 layers: Sequence[Sequence[tuple[int, int]]], sink: Sink | None, *,
                 depth: int = DEFAULT_DEPTH, gate: Gate | None = None,
                 timeout_s: float | None = None,
                 on_corrupt: Callable[[list[str]], None] | None = None,
                 on_layer: Callable[[int, DeviceEvent | None], None] | None = None,
                 placement: Placement | None = None, verify: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"a staged load needs depth >= 1, got {depth}")
        if (sink is None) == (placement is None):
            raise ValueError("a load goes either through staging into a sink or in place "
                             "into a placement: give exactly one of them")
        if not verify and placement is None:
            raise ValueError("only an in-place load can skip verification: a staged one "
                             "copies verified rows only")
        self.ring, self.store, self.sink = ring, store, sink
        self.placement, self.verify = placement, verify
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
                if placement is not None:  # in place: one call per layer, checksums overflow
                    runs.append((len(runs), len(part.keys), 0))
                    continue
                row = part.layout.slices[local][1] + _check_bytes(part.layout, local)
                if not ring.fits(row):
                    raise ValueError(
                        f"one slice of {row} bytes (with its checksum) does not fit the "
                        f"{ring.capacity}-byte staging ring; give the ring at least "
                        f"{ring.span(row)} bytes")
                runs.append((len(runs), len(part.keys), row))
            if placement is not None:
                self.chunks.append([LoadChunk(layer, tuple(
                    LoadSegment(layer, reads[i][0], reads[i][1], 0, n) for i, n, _ in runs
                    if n))] if any(n for _, n, _ in runs) else [])
                continue
            self.chunks.append([
                LoadChunk(layer, tuple(LoadSegment(layer, reads[i][0], reads[i][1], lo, hi)
                                       for i, lo, hi in pieces))
                for pieces in pack_runs(runs, budget, ring)])
        self.events: list[DeviceEvent | None] = [None] * len(self.chunks)
        self.timed_out: list[StoreTimeout] = []
        self._slots = threading.Semaphore(depth)
        self._lock = threading.Condition()
        self._out = 0  # regions of this load not yet back in the ring
        # Each part's footers (one CRC per row and slice), filled by its first
        # slice's reads (which read whole footers) once they verified: a later
        # slice of those rows is read alone and checked against them. A footer
        # entry read beside every slice is one more tiny transfer per object
        # per layer (+44 % on a 64 x 256 KiB layer over Mooncake loopback,
        # bench/results/integrity.json); rows not in yet read their own entry.
        self._crcs = [np.zeros((len(p.keys), len(p.layout.slices)), dtype="<u4")
                      for p in self.parts]
        self._have = [np.zeros(len(p.keys), dtype=bool) for p in self.parts]
        self._crcs_lock = threading.Lock()

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
            if self.placement is not None:
                self._chunk_in_place(chunk, self.placement)
            else:
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

    def _take(self, nbytes: int, overflow: bool = False) -> Region:
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):
            raise StagingTimeout(f"the load's {self.depth} chunks in flight did not end "
                                 f"within {self.timeout_s:g} s")
        try:
            region = self.ring.acquire(nbytes, timeout_s=max(0.0, deadline - time.monotonic()),
                                       overflow=overflow)
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
        assert self.sink is not None  # staged (a placement reads in place)
        # Region layout, per segment in order: its rows of ``size`` bytes, then
        # their checks (``_check_bytes`` a row: whole footers for a part's
        # first slice, one CRC otherwise; unused where the footers are in);
        # one ranged call reads every segment's slices and checks.
        plan: list[_SegmentRead] = []
        at = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            size = part.layout.slices[seg.local][1]
            check = _check_bytes(part.layout, seg.local)
            plan.append(_SegmentRead(seg, part, at, size, check,
                                     list(part.keys[seg.lo : seg.hi]), self._known(seg)))
            at += seg.rows * (size + check)
        region = self._take(at)
        event: DeviceEvent | None = None
        try:
            base = region.ptr
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            offs: list[list[int]] = []
            for r in plan:
                seg, layout = r.seg, r.part.layout
                slice_at = layout.slices[seg.local][0]
                first = base + r.start  # the segment's first row in the region
                checks = first + seg.rows * r.size
                if r.known is not None:  # the slices alone
                    dst += [[first + i * r.size] for i in range(seg.rows)]
                    lens += [[r.size] for _ in range(seg.rows)]
                    offs += [[slice_at] for _ in range(seg.rows)]
                else:  # beside each slice the whole footer (first slice) or its own entry
                    check_at = layout.page_bytes if seg.local == 0 else layout.footer_at(seg.local)
                    dst += [[first + i * r.size, checks + i * r.check] for i in range(seg.rows)]
                    lens += [[r.size, r.check] for _ in range(seg.rows)]
                    offs += [[slice_at, check_at] for _ in range(seg.rows)]
                keys += r.keys
            try:
                self.store.get_ranges(keys, dst, lens, offs)
            except StoreTimeout as exc:
                region.hand_over(exc)
                self.timed_out.append(exc)
                raise
            except StoreObjectSize as exc:
                # Objects shorter than their layout (truncated, foreign): as
                # corrupt as a checksum mismatch, and nothing was copied.
                asked = set(keys)
                short = [k for k in dict.fromkeys(exc.keys) if k in asked]
                if not short:
                    raise
                if self.on_corrupt is not None:
                    self.on_corrupt(short)
                raise CorruptSlices(chunk.layer, short) from exc
            corrupt: list[str] = []
            footers: list[tuple[_SegmentRead, np.ndarray]] = []
            for r in plan:
                n, start, size = r.seg.rows, r.start, r.size
                if r.known is not None:
                    expected = r.known
                else:
                    raw = region.tensor[start + n * size : start + n * (size + r.check)].numpy()
                    table = raw.view("<u4").reshape(n, r.check // CHECK_BYTES)
                    expected = table[:, 0]  # the whole footers' column 0, or the entry
                    if r.seg.local == 0:
                        footers.append((r, table))
                bad = mismatches([base + start + i * size for i in range(n)], size,
                                 expected, [slice_seed(k, r.seg.local) for k in r.keys])
                corrupt += [r.keys[b] for b in bad]
            if corrupt:
                if self.on_corrupt is not None:
                    self.on_corrupt(corrupt)
                raise CorruptSlices(chunk.layer, corrupt)
            self._keep_footers(footers)
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked(f"layer {chunk.layer}: the load was stopped before "
                                          "its copy; nothing was written")
                for r in plan:
                    rows = region.tensor[r.start : r.start + r.seg.rows * r.size].view(
                        r.seg.rows, r.size)
                    written = self.sink.write(r.seg, r.part, rows)
                    event = written if written is not None else event
                if last:
                    self.events[chunk.layer] = event
                    if self.on_layer is not None:
                        self.on_layer(chunk.layer, event)
        finally:
            region.release_after(event)
        return event

    def adopt_footers(self, other: StagedLoad) -> None:
        """Take the footers ``other`` verified so far for rows of this load
        with the same keys and layout (a load rebuilt over fewer rows: the
        engine's COMMIT trims duplicates). A row not in yet reads its own
        entry, as ever."""
        known: dict[tuple[str, ObjectLayout], np.ndarray] = {}
        with other._crcs_lock:
            for p, part in enumerate(other.parts):
                for i in np.flatnonzero(other._have[p]).tolist():
                    known[(part.keys[i], part.layout)] = other._crcs[p][i].copy()
        with self._crcs_lock:
            for p, part in enumerate(self.parts):
                for i, key in enumerate(part.keys):
                    row = known.get((key, part.layout))
                    if row is not None:
                        self._crcs[p][i] = row
                        self._have[p][i] = True

    def _known(self, seg: LoadSegment) -> np.ndarray | None:
        """The CRCs of the segment's slice when its rows' footers are in (read
        and verified with the part's first slice); None: read them beside it."""
        if seg.local == 0:
            return None
        with self._crcs_lock:
            if self._have[seg.part][seg.lo : seg.hi].all():
                return self._crcs[seg.part][seg.lo : seg.hi, seg.local].copy()
        return None

    def _keep_footers(self, footers: list[tuple[_SegmentRead, np.ndarray]]) -> None:
        """Verified first slices: later slices of these rows use their footers."""
        for r, table in footers:
            with self._crcs_lock:
                self._crcs[r.seg.part][r.seg.lo : r.seg.hi] = table
                self._have[r.seg.part][r.seg.lo : r.seg.hi] = True

    def _chunk_in_place(self, chunk: LoadChunk, placement: Placement) -> None:
        """In place: one ``get_ranges`` of every segment's slices straight into
        the placement's addresses, their checks (as in ``_chunk``) into a region
        of the ring (``overflow``: never waits for it); then every CRC verified
        where the slices landed. The gate is looked at before the read (a read
        in flight cannot be revoked: the placement's memory is the adapter's
        until the load is quiet) and held while the layer is marked landed."""
        if not self.gate.open:
            raise TransferRevoked(f"layer {chunk.layer}: the load was stopped before its read")
        plan: list[tuple[_SegmentRead, list[int]]] = []
        at = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            size = part.layout.slices[seg.local][1]
            known = self._known(seg) if self.verify else None
            check = _check_bytes(part.layout, seg.local) if self.verify and known is None else 0
            plan.append((_SegmentRead(seg, part, at, size, check,
                                      list(part.keys[seg.lo : seg.hi]), known),
                         placement.addresses(seg, part)))
            at += seg.rows * check
        region = self._take(at, overflow=True) if at else None
        try:
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            offs: list[list[int]] = []
            for r, addrs in plan:
                layout, n = r.part.layout, r.seg.rows
                slice_at = layout.slices[r.seg.local][0]
                if r.check:
                    assert region is not None
                    checks = region.ptr + r.start
                    check_at = (layout.page_bytes if r.seg.local == 0
                                else layout.footer_at(r.seg.local))
                    dst += [[a, checks + i * r.check] for i, a in enumerate(addrs)]
                    lens += [[r.size, r.check]] * n
                    offs += [[slice_at, check_at]] * n
                else:
                    dst += [[a] for a in addrs]
                    lens += [[r.size]] * n
                    offs += [[slice_at]] * n
                keys += r.keys
            try:
                self.store.get_ranges(keys, dst, lens, offs)
            except StoreTimeout as exc:
                if region is not None:
                    region.hand_over(exc)
                for r, _ in plan:
                    placement.timed_out(r.part, r.seg.lo, r.seg.hi, exc)
                self.timed_out.append(exc)
                raise
            except StoreObjectSize as exc:
                asked = set(keys)
                short = [k for k in dict.fromkeys(exc.keys) if k in asked]
                if not short:
                    raise
                if self.on_corrupt is not None:
                    self.on_corrupt(short)
                raise CorruptSlices(chunk.layer, short) from exc
            if self.verify:
                self._verify_in_place(chunk.layer, plan, region)
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked(f"layer {chunk.layer}: the load was stopped while "
                                          "it read")
                self.events[chunk.layer] = None
                if self.on_layer is not None:
                    self.on_layer(chunk.layer, None)
        finally:
            if region is not None:
                region.release()

    def fetch_whole(self) -> None:
        """In place only (the engine's barrier): every object of every part
        read whole, page then footer, in one ``get_ranges`` call, each page
        into ``placement.pages(part)`` and the footers into a region of the
        ring (``overflow``); then every slice of every object verified where
        it landed (:class:`CorruptSlices` with ``layer`` 0: the one call
        carries every layer). Then, under the gate, ``on_layer`` for every
        layer in order. ``verify=False`` reads the pages alone. A
        ``StoreTimeout`` is handled as in a per-layer read."""
        placement = self.placement
        if placement is None:
            raise ValueError("only an in-place load reads whole objects")
        if not self.gate.open:
            raise TransferRevoked("the load was stopped before its read")
        plan: list[tuple[LoadPart, list[int], int]] = []
        at = 0
        for part in self.parts:
            if part.keys:
                plan.append((part, placement.pages(part), at))
                at += len(part.keys) * part.layout.footer_bytes if self.verify else 0
        region = self._take(at, overflow=True) if at else None
        try:
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            offs: list[list[int]] = []
            for part, addrs, start in plan:
                pb, fb, n = part.layout.page_bytes, part.layout.footer_bytes, len(part.keys)
                keys += part.keys
                if region is not None:
                    footers = region.ptr + start
                    dst += [[a, footers + i * fb] for i, a in enumerate(addrs)]
                    lens += [[pb, fb]] * n
                    offs += [[0, pb]] * n
                else:
                    dst += [[a] for a in addrs]
                    lens += [[pb]] * n
                    offs += [[0]] * n
            try:
                self.store.get_ranges(keys, dst, lens, offs)
            except StoreTimeout as exc:
                if region is not None:
                    region.hand_over(exc)
                for part, _, _ in plan:
                    placement.timed_out(part, 0, len(part.keys), exc)
                self.timed_out.append(exc)
                raise
            except StoreObjectSize as exc:
                asked = set(keys)
                short = [k for k in dict.fromkeys(exc.keys) if k in asked]
                if not short:
                    raise
                if self.on_corrupt is not None:
                    self.on_corrupt(short)
                raise CorruptSlices(0, short) from exc
            if region is not None:
                corrupt: dict[str, None] = {}
                for part, addrs, start in plan:
                    n, slices = len(part.keys), part.layout.slices
                    raw = region.tensor[start : start + n * part.layout.footer_bytes].numpy()
                    table = raw.view("<u4").reshape(n, len(slices))
                    for j, (offset, size) in enumerate(slices):
                        bad = mismatches([a + offset for a in addrs], size, table[:, j],
                                         [slice_seed(k, j) for k in part.keys])
                        corrupt.update((part.keys[b], None) for b in bad)
                if corrupt:
                    if self.on_corrupt is not None:
                        self.on_corrupt(list(corrupt))
                    raise CorruptSlices(0, list(corrupt))
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked("the load was stopped while it read")
                for layer in range(len(self.chunks)):
                    self.events[layer] = None
                    if self.on_layer is not None:
                        self.on_layer(layer, None)
        finally:
            if region is not None:
                region.release()

    def _verify_in_place(self, layer: int, plan: list[tuple[_SegmentRead, list[int]]],
                         region: Region | None) -> None:
        """Every slice of ``plan`` against its CRC, where it landed; keeps the
        verified first slices' footers; raises :class:`CorruptSlices`."""
        corrupt: list[str] = []
        footers: list[tuple[_SegmentRead, np.ndarray]] = []
        for r, addrs in plan:
            n = r.seg.rows
            if r.known is not None:
                expected = r.known
            else:
                assert region is not None
                raw = region.tensor[r.start : r.start + n * r.check].numpy()
                table = raw.view("<u4").reshape(n, r.check // CHECK_BYTES)
                expected = table[:, 0]
                if r.seg.local == 0:
                    footers.append((r, table))
            bad = mismatches(addrs, r.size, expected, [slice_seed(k, r.seg.local) for k in r.keys])
            corrupt += [r.keys[b] for b in bad]
        if corrupt:
            if self.on_corrupt is not None:
                self.on_corrupt(corrupt)
            raise CorruptSlices(layer, corrupt)
        self._keep_footers(footers)

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
    (see the module docstring); or, with ``source`` (``snapshot`` None), in
    place: one ``put_parts`` of every object, each page from the source's
    registered memory, its footer computed over those bytes into a region
    of the ring (``overflow``: never waits); it waits for a put that timed
    out (``wait_timed_out``: the source is the put's memory until it ended).
    ``ValueError`` when one object does not fit the ring, or neither or both
    of ``snapshot`` and ``source`` are given."""

    def __init__(self, ring: StagingRing, store: Store, parts: Sequence[OffloadPart],
                 snapshot: Snapshot | None, *, depth: int = DEFAULT_DEPTH,
                 timeout_s: float | None = None, wait_timed_out: bool = False,
                 on_late_end: Callable[[], None] | None = None,
                 source: Source | None = None) -> None:
        if depth < 1:
            raise ValueError(f"a staged offload needs depth >= 1, got {depth}")
        if (snapshot is None) == (source is None):
            raise ValueError("an offload goes either through staging from a snapshot or in "
                             "place from a source: give exactly one of them")
        if source is not None and not wait_timed_out:
            raise ValueError("an in-place offload waits for a timed-out put "
                             "(wait_timed_out=True): its pages are the put's memory until it ended")
        self.ring, self.store, self.snapshot, self.source = ring, store, snapshot, source
        self.parts = tuple(parts)
        self.timeout_s = ring.timeout_s if timeout_s is None else timeout_s
        self.wait_timed_out = wait_timed_out
        self.on_late_end = on_late_end
        if source is not None:  # in place: one put of every object
            segments = tuple(OffloadSegment(p, 0, len(part.keys))
                             for p, part in enumerate(self.parts) if part.keys)
            self.chunks: list[OffloadChunk] = [OffloadChunk(segments)] if segments else []
            return
        budget = max(1, ring.capacity // depth)
        runs: list[tuple[int, int, int]] = []
        for p, part in enumerate(self.parts):
            size = part.layout.object_bytes
            if not ring.fits(size):
                raise ValueError(
                    f"one object of {size} bytes does not fit the {ring.capacity}-byte "
                    f"staging ring; give the ring at least {ring.span(size)} bytes")
            runs.append((p, len(part.keys), size))
        self.chunks = [
            OffloadChunk(tuple(OffloadSegment(p, lo, hi) for p, lo, hi in pieces))
            for pieces in pack_runs(runs, budget, ring)]

    def run(self, on_source_free: Callable[[], None] | None = None) -> OffloadOutcome:
        """Worker thread: put every chunk in order; stop at the first failure.
        ``on_source_free`` runs once, when the source is not read any more."""
        outcome = OffloadOutcome()
        try:
            for index, chunk in enumerate(self.chunks):
                last = index == len(self.chunks) - 1
                if self.source is not None:
                    self._chunk_in_place(chunk, outcome, self.source)
                    break
                if not self._chunk(chunk, outcome, on_source_free if last else None):
                    break
                if last:
                    on_source_free = None
        finally:
            if on_source_free is not None:
                on_source_free()
        return outcome

    def _chunk_in_place(self, chunk: OffloadChunk, outcome: OffloadOutcome,
                        source: Source) -> None:
        """In place: the footers of every object computed over its page where
        it is, into one region; one ``put_parts`` of page and footer per
        object; a put that timed out is waited for (counted ``late`` if it
        then succeeded)."""
        plan: list[tuple[OffloadSegment, OffloadPart, int, list[int]]] = []
        total = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            plan.append((seg, part, total, source.pages(seg, part)))
            total += seg.rows * part.layout.footer_bytes
        try:
            region = (self.ring.acquire(total, timeout_s=self.timeout_s, overflow=True)
                      if total else None)
        except StoreError as exc:
            outcome.error = exc
            return
        try:
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for seg, part, start, addrs in plan:
                layout, n = part.layout, seg.rows
                seg_keys = list(part.keys[seg.lo : seg.hi])
                fb = layout.footer_bytes
                if fb:
                    assert region is not None
                    footers = region.tensor[start : start + n * fb].view(n, fb)
                    for j, (offset, size) in enumerate(layout.slices):
                        sums = checksums([a + offset for a in addrs], size,
                                         [slice_seed(k, j) for k in seg_keys])
                        footers[:, j * CHECK_BYTES : (j + 1) * CHECK_BYTES] = torch.from_numpy(
                            np.ascontiguousarray(sums).view(np.uint8).reshape(n, CHECK_BYTES))
                    at = region.ptr + start
                    ptrs += [[a, at + i * fb] for i, a in enumerate(addrs)]
                    sizes += [[layout.page_bytes, fb]] * n
                else:  # a page no layer reads: no footer
                    ptrs += [[a] for a in addrs]
                    sizes += [[layout.page_bytes]] * n
                keys += seg_keys
            try:
                self.store.put_parts(keys, ptrs, sizes)
            except StoreTimeout as exc:
                if not exc.wait_finished():
                    outcome.error = exc
                    return
                outcome.late += 1
            except StoreError as exc:
                outcome.error = exc
                return
            outcome.objects += len(keys)
            outcome.bytes += sum(sum(row) for row in sizes)
        finally:
            if region is not None:
                region.release()

    def _chunk(self, chunk: OffloadChunk, outcome: OffloadOutcome,
               snapshotted: Callable[[], None] | None) -> bool:
        assert self.snapshot is not None  # staged (a source is put in place)
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
