"""The offload half of the staged transfer: :class:`StagedOffload` (snapshot →
footers → put through the ring, or in place from a source) and its outcome.

``linker/staged.py`` is the transfer's public face and its overview; read it
first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layerlift.linker.integrity import CHECK_BYTES, checksums, slice_seed
from layerlift.linker.ring import StagingRing
from layerlift.linker.sinks import Snapshot, Source
from layerlift.linker.staged_load import DEFAULT_DEPTH
from layerlift.linker.store_base import Store, StoreError, StoreTimeout
from layerlift.linker.transfer_plan import OffloadChunk, OffloadPart, OffloadSegment, pack_runs

__all__ = ["OffloadOutcome", "StagedOffload"]


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
