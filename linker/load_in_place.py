"""In-place reads of a :class:`~layerlift.linker.staged_load.StagedLoad`:
each layer's slices (or, for the engine's barrier, whole objects) read
straight into a placement's registered memory and verified where they
landed, only the checksums going through the ring ("In place" in
``linker/staged.py``'s overview)."""

from __future__ import annotations

import numpy as np

from layerlift.linker.integrity import CHECK_BYTES, mismatches, slice_seed
from layerlift.linker.load_core import (
    CorruptSlices,
    LoadCore,
    TransferRevoked,
    _object_mismatches,
    _SegmentRead,
)
from layerlift.linker.ring import Region
from layerlift.linker.sinks import Placement
from layerlift.linker.store_base import StoreTimeout
from layerlift.linker.transfer_plan import LoadChunk, LoadPart, check_bytes

__all__ = ["InPlaceReads"]


def _pieces(placement: Placement, part: LoadPart, local: int) -> tuple[int, ...]:
    """``placement.pieces``, checked: positive sizes adding up to the slice's."""
    sizes = tuple(placement.pieces(part, local))
    size = part.layout.slices[local][1]
    if not sizes or min(sizes) <= 0 or sum(sizes) != size:
        raise ValueError(f"the placement splits a slice of {size} bytes into pieces of "
                         f"{list(sizes)} bytes")
    return sizes


class InPlaceReads(LoadCore):
    """A load's in-place reads (a load built with a ``placement``)."""

    def _chunk_in_place(self, chunk: LoadChunk, placement: Placement, lands: bool = True) -> None:
        """In place: one ``get_ranges`` of every segment's slices straight into
        the placement's addresses, their checks (as in ``_chunk``) into a region
        of the ring (``overflow``: never waits for it); then every CRC verified
        where the slices landed. The gate is looked at before the read (a read
        in flight cannot be revoked: the placement's memory is the adapter's
        until the load is quiet) and held while the layer is marked landed;
        from that look until the slices were verified and the layer landed,
        the read counts in the gate's reads in flight (``Gate.reading``).
        ``lands``: the layer's last call (its earlier calls, with
        ``in_place_ranges``, are verified but land nothing)."""
        with self.gate.reading() as open_:
            if not open_:
                raise TransferRevoked(f"layer {chunk.layer}: the load was stopped before "
                                      "its read")
            self._read_in_place(chunk, placement, lands)

    def _read_in_place(self, chunk: LoadChunk, placement: Placement, lands: bool) -> None:
        """The body of :meth:`_chunk_in_place`, the read counted in flight."""
        plan: list[tuple[_SegmentRead, list[int], tuple[int, ...]]] = []
        at = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            size = part.layout.slices[seg.local][1]
            known = self._known(seg) if self.verify else None
            check = check_bytes(part.layout, seg.local) if self.verify and known is None else 0
            sizes = _pieces(placement, part, seg.local)
            addrs = placement.addresses(seg, part)
            if len(addrs) != seg.rows * len(sizes):
                raise ValueError(f"the placement gave {len(addrs)} addresses for {seg.rows} "
                                 f"row(s) of {len(sizes)} piece(s)")
            plan.append((_SegmentRead(seg, part, at, size, check,
                                      list(part.keys[seg.lo : seg.hi]), known), addrs, sizes))
            at += seg.rows * check
        region = self._take_checks(at) if at else None
        try:
            keys: list[str] = []
            dst: list[list[int]] = []
            lens: list[list[int]] = []
            offs: list[list[int]] = []
            for r, addrs, sizes in plan:
                layout, n, k = r.part.layout, r.seg.rows, len(sizes)
                slice_at = layout.slices[r.seg.local][0]
                piece_at = [slice_at + sum(sizes[:j]) for j in range(k)]
                rows = [addrs[i * k : (i + 1) * k] for i in range(n)] if k > 1 else \
                    [[a] for a in addrs]
                if r.check:
                    assert region is not None
                    checks = region.ptr + r.start
                    check_at = (layout.page_bytes if r.seg.local == 0
                                else layout.footer_at(r.seg.local))
                    dst += [[*row, checks + i * r.check] for i, row in enumerate(rows)]
                    lens += [[*sizes, r.check]] * n
                    offs += [[*piece_at, check_at]] * n
                else:
                    dst += rows
                    lens += [list(sizes)] * n
                    offs += [piece_at] * n
                keys += r.keys
            def hand_over(exc: StoreTimeout) -> None:
                if region is not None:
                    region.hand_over(exc)
                for r, _, _ in plan:
                    placement.timed_out(r.part, r.seg.lo, r.seg.hi, exc)

            self._read(chunk.layer, keys, dst, lens, offs, hand_over)
            if self.verify:
                self._verify_in_place(chunk.layer, plan, region)
            with self.gate.held() as open_:
                if not open_:
                    raise TransferRevoked(f"layer {chunk.layer}: the load was stopped while "
                                          "it read")
                if lands:
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
        with self.gate.reading() as open_:
            if not open_:
                raise TransferRevoked("the load was stopped before its read")
            self._read_whole(placement)

    def _read_whole(self, placement: Placement) -> None:
        """The body of :meth:`fetch_whole`, the read counted in flight."""
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

    def _verify_in_place(self, layer: int,
                         plan: list[tuple[_SegmentRead, list[int], tuple[int, ...]]],
                         region: Region | None) -> None:
        """Every slice of ``plan`` against its CRC, where it landed (over its
        pieces in order); keeps the verified first slices' footers; raises
        :class:`CorruptSlices`."""
        corrupt: list[str] = []
        footers: list[tuple[_SegmentRead, np.ndarray]] = []
        for r, addrs, sizes in plan:
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
            bad = mismatches(addrs, r.size, expected, [slice_seed(k, r.seg.local) for k in r.keys],
                             sizes)
            corrupt += [r.keys[b] for b in bad]
        if corrupt:
            if self.on_corrupt is not None:
                self.on_corrupt(corrupt)
            raise CorruptSlices(layer, corrupt)
        self._keep_footers(footers)
