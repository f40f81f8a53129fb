"""The load half of the staged transfer: :class:`StagedLoad` (staged through the
ring into a sink, or in place into a placement) and its two errors.

``linker/staged.py`` is the transfer's public face and its overview (what a
chunk does, in place, timeouts, cancellation); read it first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from layerlift.linker.integrity import CHECK_BYTES, mismatches, slice_seed
from layerlift.linker.ring import Region, StagingRing, StagingTimeout
from layerlift.linker.sinks import Gate, Placement, Sink
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
    check_bytes,
    merge_chunks,
    pack_runs,
    reads_every_slice_once,
)
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import DeviceEvent

__all__ = ["DEFAULT_DEPTH", "CorruptSlices", "StagedLoad", "TransferRevoked"]

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


def _object_mismatches(part: LoadPart, pages: Sequence[int],
                       table: np.ndarray) -> list[tuple[int, int]]:
    """``(row, slice)`` of every slice of ``part``'s objects (row ``i``'s page
    at ``pages[i]``) whose CRC is not its footer's entry in ``table``
    (``uint32[rows, slices]``), slice by slice."""
    bad: list[tuple[int, int]] = []
    for j, (offset, size) in enumerate(part.layout.slices):
        bad += [(i, j) for i in mismatches([a + offset for a in pages], size, table[:, j],
                                           [slice_seed(k, j) for k in part.keys])]
    return bad


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


class _Halt:
    """The first failure among a load's chunks run at once
    (:meth:`StagedLoad._fetch_merged`); once there is one, no chunk begins
    or copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cause: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.cause is None:
                self.cause = exc

    def is_set(self) -> bool:
        return self.cause is not None


class StagedLoad:
    """One load: per-layer fetches through ``ring`` into ``sink`` (see the
    module docstring), or, with ``placement``, in place (``sink`` None): each
    slice read straight into the placement's registered memory and verified
    there, only the checksums going through the ring ("In place" in the
    module docstring; ``depth`` bounds staged chunks only, as an in-place
    load holds no staging). ``verify=False`` reads the slices alone and checks
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
        # Layers usually read the same rows of the same sizes: each distinct
        # shape is cut once (`pack_runs` searches its cut).
        cuts: dict[tuple[tuple[int, int, int], ...], list[list[tuple[int, int, int]]]] = {}
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
                if placement is not None:  # in place: one call per layer (below)
                    continue
                row = part.layout.slices[local][1] + check_bytes(part.layout, local)
                if not ring.fits(row):
                    raise ValueError(
                        f"one slice of {row} bytes (with its checksum) does not fit the "
                        f"{ring.capacity}-byte staging ring; give the ring at least "
                        f"{ring.span(row)} bytes")
                runs.append((len(runs), len(part.keys), row))
            if placement is not None:
                segments = tuple(LoadSegment(layer, p, local, 0, len(self.parts[p].keys))
                                 for p, local in reads if self.parts[p].keys)
                self.chunks.append([LoadChunk(layer, segments)] if segments else [])
                continue
            shape = tuple(runs)
            if shape not in cuts:
                cuts[shape] = pack_runs(runs, budget, ring)
            self.chunks.append([
                LoadChunk(layer, tuple(LoadSegment(layer, reads[i][0], reads[i][1], lo, hi)
                                       for i, lo, hi in pieces))
                for pieces in cuts[shape]])
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
        self._merged_plan: list[tuple[LoadChunk, tuple[int, ...]]] | None = None

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
                event = self._chunk(chunk, (layer,) if i == len(chunks) - 1 else ())
        if not chunks:
            self._landed(layer, None)
        return event

    def one_call(self) -> bool:
        """Whether :meth:`fetch_all` reads every layer in one store call (the
        load fits one chunk of ``capacity // depth`` bytes). Staged loads only."""
        return self.sink is not None and len(self._merged()) <= 1

    def fetches_all(self) -> bool:
        """Whether :meth:`fetch_all` is the way to run this load when nobody
        waits on it layer by layer: it fits one call (:meth:`one_call`), or
        its sink is the host's (``strided_rows``), whose copies are done when
        they return, so :meth:`fetch_all` reads its chunks ``depth`` at a
        time and lands the layers in order after them. A device sink's
        layer event must follow every copy of the layer on its stream: such
        a load of several chunks keeps one job a layer (:meth:`job`)."""
        return self.one_call() or self._strided_sink()

    def fetch_all(self) -> DeviceEvent | None:
        """Worker thread: every layer, in as few store calls as the chunk
        budget allows (one when :meth:`one_call`): each chunk holds the
        slices of several layers, in layer order, and is read, verified and
        copied as one (nothing of a chunk is copied unless all of it
        verified); a layer lands (``on_layer``, ``events``) once the chunk
        holding its last slice was copied (one without reads with the layer
        before it), so layers land in order. Into a host sink, a load of one
        chunk reading every slice of its objects reads them whole instead
        (one range an object, :meth:`_fetch_objects`), and a load of several
        chunks reads ``depth`` of them at once (:meth:`_fetch_merged`). For a load nobody
        waits on layer by layer (a restore the request waits for whole): a
        store call and a thread's turn a layer cost more than the layer's
        bytes when layers are small. Raises as
        :meth:`fetch_layer`; a failure stops the load (later chunks are not
        read), layers already landed stay landed. Staged loads only."""
        if self.sink is None:
            raise ValueError("fetch_all is for staged loads; an in-place load reads "
                             "one call a layer already (fetch_layer)")
        if self._objects_whole():
            return self._fetch_objects()
        event: DeviceEvent | None = None
        merged = self._merged()
        if len(merged) > 1 and self.depth > 1 and self._strided_sink():
            self._fetch_merged(merged)
            return None
        for chunk, landing in merged:
            event = self._chunk(chunk, landing)
        if not merged:  # nothing to read: every layer lands at once
            for layer in range(len(self.chunks)):
                self._landed(layer, None)
        return event

    def _fetch_merged(self, merged: list[tuple[LoadChunk, tuple[int, ...]]]) -> None:
        """:meth:`fetch_all` of several chunks into a host sink: up to
        ``depth`` chunks read, verified and copied at once, each on a thread
        of this call (at most ``depth`` regions, as ever: ``_take``); the
        layers land in chunk order, each once every chunk up to the one
        holding its last slice returned (a host copy is done when it
        returns: no event to order). At the first failure no chunk not yet
        begun is read and a chunk still reading copies nothing once it
        verified; every thread returns before this does (a timed-out
        read keeps its region until its call ends, as in :meth:`_chunk`);
        then the first failure is raised, the layers of the chunks before
        the first that failed landed."""
        halt = _Halt()

        def run(chunk: LoadChunk) -> bool:
            if halt.is_set():
                return False
            try:
                self._chunk(chunk, (), halt)
            except BaseException as exc:
                halt.fail(exc)
                raise
            return True

        # The pool's exit waits for every chunk, begun or skipped.
        with ThreadPoolExecutor(max_workers=min(self.depth, len(merged)),
                                thread_name_prefix="layerlift-merged") as pool:
            futures = [pool.submit(run, chunk) for chunk, _ in merged]
            try:
                for future, (_, landing) in zip(futures, merged, strict=True):
                    if not future.result():  # skipped: a failure came first
                        break
                    for layer in landing:
                        self._landed(layer, None)
            except BaseException as exc:  # a chunk's, or a landing's (the gate closed)
                halt.fail(exc)
        # The first failure, not what it made of the chunks in flight (they
        # copy nothing once it happened: their TransferRevoked is its echo).
        if halt.cause is not None:
            raise halt.cause

    def _strided_sink(self) -> bool:
        """Whether the sink takes strided rows (``strided_rows``: a host
        sink, whose copies are done when ``write`` returns)."""
        return bool(getattr(self.sink, "strided_rows", False))

    def _objects_whole(self) -> bool:
        """Whether :meth:`fetch_all` reads whole objects: the load is one
        chunk, reads every slice of every row of its parts once, and its sink
        takes rows strided by an object (``strided_rows``: a host sink; a
        device sink's H2D copy wants contiguous rows). One range an object
        instead of two a slice: on Mooncake a range costs ~40 us, more than a
        small slice's bytes."""
        return (self._strided_sink() and len(self._merged()) == 1
                and reads_every_slice_once(self.chunks, self.parts))

    def _fetch_objects(self) -> DeviceEvent | None:
        """:meth:`fetch_all` of whole objects: every object of every part,
        page then footer, back to back in one region, in one ranged call;
        every slice verified against its footer there (any mismatch:
        nothing is copied, :class:`CorruptSlices` with the first layer that
        reads a corrupt slice); then, under the gate, layer by layer, each
        segment's rows (strided views of the objects) to the sink and the
        layer landed. Timeouts and short objects as in a per-layer read."""
        plan: list[tuple[int, LoadPart, int]] = []
        at = 0
        for p, part in enumerate(self.parts):
            if part.keys:
                plan.append((p, part, at))
                at += len(part.keys) * part.layout.object_bytes
        reader = {(seg.part, seg.local): seg.layer for chunks in self.chunks for c in chunks
                  for seg in c.segments}
        first = min(reader.values(), default=0)
        region = self._take(at)
        event: DeviceEvent | None = None
        try:
            base = region.ptr
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            for _, part, start in plan:
                ob, n = part.layout.object_bytes, len(part.keys)
                keys += part.keys
                dst += [[base + start + i * ob] for i in range(n)]
                lens += [[ob]] * n
            self._read(first, keys, dst, lens, [[0]] * len(keys), region.hand_over)
            objects: dict[int, torch.Tensor] = {}
            tables: dict[int, np.ndarray] = {}
            corrupt: dict[str, None] = {}
            bad_layer = len(self.chunks)  # the first layer reading a corrupt slice
            for p, part, start in plan:
                n, layout = len(part.keys), part.layout
                ob, pb, fb = layout.object_bytes, layout.page_bytes, layout.footer_bytes
                rows = objects[p] = region.tensor[start : start + n * ob].view(n, ob)
                table = np.ascontiguousarray(rows[:, pb : pb + fb].numpy()).view("<u4")
                for i, j in _object_mismatches(part, [base + start + i * ob for i in range(n)],
                                               table):
                    corrupt[part.keys[i]] = None
                    bad_layer = min(bad_layer, reader[(p, j)])
                tables[p] = table
            if corrupt:
                if self.on_corrupt is not None:
                    self.on_corrupt(list(corrupt))
                raise CorruptSlices(bad_layer, list(corrupt))
            with self._crcs_lock:  # verified: later reads of these rows may use them
                for p, table in tables.items():
                    self._crcs[p][:] = table
                    self._have[p][:] = True
            assert self.sink is not None
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked("the load was stopped before its copies; "
                                          "nothing was written")
                for layer, chunks in enumerate(self.chunks):
                    for chunk in chunks:
                        for seg in chunk.segments:
                            part = self.parts[seg.part]
                            offset, size = part.layout.slices[seg.local]
                            view = objects[seg.part][seg.lo : seg.hi, offset : offset + size]
                            written = self.sink.write(seg, part, view)
                            event = written if written is not None else event
                    self.events[layer] = event
                    if self.on_layer is not None:
                        self.on_layer(layer, event)
        finally:
            region.release_after(event)
        return event

    def all_jobs(self, requests: frozenset[Hashable] = frozenset()) -> list[LayerJob]:
        """:meth:`fetch_all` as one job a layer for a *streamed* scheduler
        unit (``LoadScheduler(stream_size >= layers)``: one thread runs the
        unit's jobs in order): the first layer's job reads every layer, the
        others find their layer landed and return, so the scheduler releases
        each layer after its bytes are in (and stops at a failure as for any
        job). Under a scheduler that runs jobs of one load on several threads
        the later jobs could return first: use :meth:`job` there."""
        def fetch() -> None:
            self.fetch_all()

        jobs = [LayerJob(layer, lambda: None, self.nbytes(layer), requests)
                for layer in range(len(self.chunks))]
        if jobs:
            jobs[0] = LayerJob(0, fetch, self.nbytes(0), requests)
        return jobs

    def _merged(self) -> list[tuple[LoadChunk, tuple[int, ...]]]:
        """The whole load's chunks (`merge_chunks`), planned once."""
        if self._merged_plan is None:
            self._merged_plan = merge_chunks(self.chunks, self.parts,
                                             max(1, self.ring.capacity // self.depth), self.ring)
        return self._merged_plan

    def _landed(self, layer: int, event: DeviceEvent | None) -> None:
        """A layer with nothing to read lands at once (under the gate, too)."""
        with self.gate.held() as open_:
            if not open_:
                raise TransferRevoked(f"layer {layer}: the load was stopped before it landed")
            self.events[layer] = event
            if self.on_layer is not None:
                self.on_layer(layer, event)

    def _take(self, nbytes: int) -> Region:
        """A staged chunk's region: one of ``depth`` slots, then a region
        (both waits bounded by ``timeout_s``)."""
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

    def _take_checks(self, nbytes: int) -> Region:
        """An in-place chunk's region (its checksums only): never waits
        (``overflow``) and takes no slot (``depth`` bounds staging, which an
        in-place load does not use)."""
        region = self.ring.acquire(nbytes, timeout_s=0.0, overflow=True)
        with self._lock:
            self._out += 1
        region.on_free(self._checks_returned)
        return region

    def _returned(self) -> None:
        self._slots.release()
        self._checks_returned()

    def _checks_returned(self) -> None:
        with self._lock:
            self._out -= 1
            self._lock.notify_all()

    def _chunk(self, chunk: LoadChunk, landing: Sequence[int],
               halt: _Halt | None = None) -> DeviceEvent | None:
        """One staged chunk; ``landing``: the layers whose last segment it
        holds (they land, under the gate, after its copies). ``halt`` (the
        chunks of :meth:`_fetch_merged`): checked with the gate, once another
        chunk failed nothing of this one is copied (:class:`TransferRevoked`);
        a corrupt chunk halts it before ``on_corrupt`` hears of it."""
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
            check = check_bytes(part.layout, seg.local)
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
            self._read(chunk.layer, keys, dst, lens, offs, region.hand_over)
            corrupt: list[str] = []
            bad_layer = chunk.layer
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
                if bad and not corrupt:
                    bad_layer = r.seg.layer  # segments are in layer order
                corrupt += [r.keys[b] for b in bad]
            if corrupt:
                exc = CorruptSlices(bad_layer, corrupt)
                if halt is not None:
                    halt.fail(exc)
                if self.on_corrupt is not None:
                    self.on_corrupt(corrupt)
                raise exc
            self._keep_footers(footers)
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked(f"layer {chunk.layer}: the load was stopped before "
                                          "its copy; nothing was written")
                if halt is not None and halt.is_set():
                    raise TransferRevoked(f"layer {chunk.layer}: another chunk of the load "
                                          "failed first; nothing was written")
                for r in plan:
                    rows = region.tensor[r.start : r.start + r.seg.rows * r.size].view(
                        r.seg.rows, r.size)
                    written = self.sink.write(r.seg, r.part, rows)
                    event = written if written is not None else event
                for layer in landing:
                    self.events[layer] = event
                    if self.on_layer is not None:
                        self.on_layer(layer, event)
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

    def _read(self, layer: int, keys: list[str], dst: list[list[int]], lens: list[list[int]],
              offs: list[list[int]], hand_over: Callable[[StoreTimeout], None]) -> None:
        """One ranged read of ``layer``'s chunk. ``StoreTimeout``: the call
        may still write, so ``hand_over(exc)`` gives its memory to it first
        (the exception is kept in ``timed_out``). Objects shorter than their
        layout (truncated, foreign) are as corrupt as a checksum mismatch:
        ``on_corrupt`` hears them, then :class:`CorruptSlices`."""
        try:
            self.store.get_ranges(keys, dst, lens, offs)
        except StoreTimeout as exc:
            hand_over(exc)
            self.timed_out.append(exc)
            raise
        except StoreObjectSize as exc:
            asked = set(keys)
            short = [k for k in dict.fromkeys(exc.keys) if k in asked]
            if not short:
                raise
            if self.on_corrupt is not None:
                self.on_corrupt(short)
            raise CorruptSlices(layer, short) from exc

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
            check = check_bytes(part.layout, seg.local) if self.verify and known is None else 0
            plan.append((_SegmentRead(seg, part, at, size, check,
                                      list(part.keys[seg.lo : seg.hi]), known),
                         placement.addresses(seg, part)))
            at += seg.rows * check
        region = self._take_checks(at) if at else None
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
            def hand_over(exc: StoreTimeout) -> None:
                if region is not None:
                    region.hand_over(exc)
                for r, _ in plan:
                    placement.timed_out(r.part, r.seg.lo, r.seg.hi, exc)

            self._read(chunk.layer, keys, dst, lens, offs, hand_over)
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
                if self.verify:
                    at += len(part.keys) * part.layout.footer_bytes
        region = self._take_checks(at) if at else None
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
            def hand_over(exc: StoreTimeout) -> None:
                if region is not None:
                    region.hand_over(exc)
                for part, _, _ in plan:
                    placement.timed_out(part, 0, len(part.keys), exc)

            self._read(0, keys, dst, lens, offs, hand_over)
            if region is not None:
                corrupt: dict[str, None] = {}
                for part, addrs, start in plan:
                    n, slices = len(part.keys), part.layout.slices
                    raw = region.tensor[start : start + n * part.layout.footer_bytes].numpy()
                    table = raw.view("<u4").reshape(n, len(slices))
                    corrupt.update((part.keys[i], None)
                                   for i, _ in _object_mismatches(part, addrs, table))
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
