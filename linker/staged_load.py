"""The load half of the staged transfer: :class:`StagedLoad` (staged through the
ring into a sink, or in place into a placement) and its two errors.

``linker/staged.py`` is the transfer's public face and its overview (what a
chunk does, in place, timeouts, cancellation); read it first. This module
holds the per-layer staged read (:meth:`StagedLoad.fetch_layer`, one chunk
at a time); what every reader shares is in ``load_core.py``, the whole-load
reads in ``load_whole.py``, the in-place reads in ``load_in_place.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from layerlift.linker.integrity import CHECK_BYTES, mismatches, slice_seed
from layerlift.linker.load_core import (
    DEFAULT_DEPTH,
    CorruptSlices,
    TransferRevoked,
    _Halt,
    _SegmentRead,
)
from layerlift.linker.load_in_place import InPlaceReads
from layerlift.linker.load_whole import WholeReads
from layerlift.linker.transfer_plan import LoadChunk, check_bytes
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import DeviceEvent

__all__ = ["DEFAULT_DEPTH", "CorruptSlices", "StagedLoad", "TransferRevoked"]


class StagedLoad(WholeReads, InPlaceReads):
    """One load: per-layer fetches through ``ring`` into ``sink`` (see the
    module docstring), or, with ``placement``, in place (``sink`` None): each
    slice read straight into the placement's registered memory and verified
    there, only the checksums going through the ring ("In place" in the
    module docstring; ``depth`` bounds staged chunks only, as an in-place
    load holds no staging). ``verify=False`` reads the slices alone and checks
    nothing (the in-place negative control). ``ValueError`` when a slice does
    not fit the ring, a ``layers`` entry names no part or slice, ``depth`` <
    1, or neither or both of ``sink`` and ``placement`` are given.
    ``in_place_ranges`` (in place only): a layer's read is cut into calls of
    at most this many ranges (a row's pieces and its check; Mooncake's TCP
    transport queues 1024 transfers a peer, and ``depth`` layers read at
    once); None: one call a layer. ``read_order`` (``read_order.py``): the
    load's store reads one at a time, the lowest layer waiting first (loads
    may share one); None: as they come."""


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
                self._chunk_in_place(chunk, self.placement, i == len(chunks) - 1)
            else:
                event = self._chunk(chunk, (layer,) if i == len(chunks) - 1 else ())
        if not chunks:
            self._landed(layer, None)
        return event

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
