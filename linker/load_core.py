"""What every reader of a :class:`~layerlift.linker.staged_load.StagedLoad`
shares: its two errors, the plan of its chunks (cut once, at construction),
the regions it takes from the ring and gives back, the ranged read with its
timeout and short-object handling, and the footers verified so far.

The readers are split by what they read: one staged chunk a layer
(``staged_load.py``), every layer of a load in as few chunks as the budget
allows (``load_whole.py``), in place into a placement (``load_in_place.py``).
``linker/staged.py`` is the transfer's overview; read it first.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from layerlift.linker.integrity import mismatches, slice_seed
from layerlift.linker.read_order import ReadOrder
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
    pack_runs,
)
from layerlift.overlap.device import DeviceEvent

__all__ = ["DEFAULT_DEPTH", "CorruptSlices", "LoadCore", "TransferRevoked"]

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


class LoadCore(ABC):
    """The state and bookkeeping :class:`StagedLoad`'s readers share (its
    constructor's contract is :class:`StagedLoad`'s): the chunks, each
    layer's event, the read timeouts seen, the regions out, the footers
    verified so far. Abstract, as are the readers over it: the class built
    is :class:`StagedLoad`, which supplies the staged chunk."""

    def __init__(self, ring: StagingRing, store: Store, parts: Sequence[LoadPart],
                 layers: Sequence[Sequence[tuple[int, int]]], sink: Sink | None, *,
                 depth: int = DEFAULT_DEPTH, gate: Gate | None = None,
                 timeout_s: float | None = None,
                 on_corrupt: Callable[[list[str]], None] | None = None,
                 on_layer: Callable[[int, DeviceEvent | None], None] | None = None,
                 placement: Placement | None = None, verify: bool = True,
                 in_place_ranges: int | None = None,
                 read_order: ReadOrder | None = None) -> None:
        if depth < 1:
            raise ValueError(f"a staged load needs depth >= 1, got {depth}")
        if in_place_ranges is not None and (placement is None or in_place_ranges < 2):
            raise ValueError("in_place_ranges cuts an in-place load's calls and must be at "
                             f"least 2 (a row's piece and its check); got {in_place_ranges}")
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
        self.read_order = read_order
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
                self.chunks.append(self._in_place_chunks(layer, reads, placement,
                                                         in_place_ranges))
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

    def _in_place_chunks(self, layer: int, reads: Sequence[tuple[int, int]],
                         placement: Placement, max_ranges: int | None) -> list[LoadChunk]:
        """An in-place layer's calls: one (``max_ranges`` None), or as few as
        keep each within ``max_ranges`` ranges, counting a row's pieces and
        its check (read beside it until the footers are in), rows in order."""
        segments = [LoadSegment(layer, p, local, 0, len(self.parts[p].keys))
                    for p, local in reads if self.parts[p].keys]
        if max_ranges is None:
            return [LoadChunk(layer, tuple(segments))] if segments else []
        chunks: list[LoadChunk] = []
        cur: list[LoadSegment] = []
        used = 0
        for seg in segments:
            per_row = len(placement.pieces(self.parts[seg.part], seg.local)) + 1
            if per_row > max_ranges:
                raise ValueError(f"a row of {per_row} ranges does not fit calls of "
                                 f"{max_ranges}")
            lo = seg.lo
            while lo < seg.hi:
                room = (max_ranges - used) // per_row
                if room == 0:
                    chunks.append(LoadChunk(layer, tuple(cur)))
                    cur, used = [], 0
                    continue
                hi = min(seg.hi, lo + room)
                cur.append(LoadSegment(layer, seg.part, seg.local, lo, hi))
                used += (hi - lo) * per_row
                lo = hi
        if cur:
            chunks.append(LoadChunk(layer, tuple(cur)))
        return chunks

    def nbytes(self, layer: int) -> int:
        """Payload bytes layer ``layer`` moves (without checksums)."""
        return sum(self.parts[g.part].layout.slices[g.local][1] * g.rows
                   for c in self.chunks[layer] for g in c.segments)

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

    @abstractmethod
    def _chunk(self, chunk: LoadChunk, landing: Sequence[int],
               halt: _Halt | None = None) -> DeviceEvent | None:
        """One staged chunk (:class:`StagedLoad`'s; the whole-load reads run
        it too)."""

    def adopt_footers(self, other: LoadCore) -> None:
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
        """One ranged read of ``layer``'s chunk (in its turn of ``read_order``, if
        the load has one: :class:`TransferRevoked`, nothing read, when the gate
        closed while it waited). ``StoreTimeout``: the call
        may still write, so ``hand_over(exc)`` gives its memory to it first
        (the exception is kept in ``timed_out``). Objects shorter than their
        layout (truncated, foreign) are as corrupt as a checksum mismatch:
        ``on_corrupt`` hears them, then :class:`CorruptSlices`."""
        try:
            if self.read_order is None:
                self.store.get_ranges(keys, dst, lens, offs)
            else:
                with self.read_order.turn(layer):
                    if not self.gate.open:  # stopped while this read waited its turn
                        raise TransferRevoked(f"layer {layer}: the load was stopped before "
                                              "its read")
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
