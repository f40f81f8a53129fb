"""The offload half of the staged transfer: :class:`StagedOffload` (snapshot →
footers → put through the ring, or in place from a source) and its outcome.

``linker/staged.py`` is the transfer's public face and its overview; read it
first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import groupby

import numpy as np

from layerlift.linker.in_place import FIRST_BYTES, Call, PipelinedPuts, grow
from layerlift.linker.integrity import footers
from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.sinks import Snapshot, Source
from layerlift.linker.staged_load import DEFAULT_DEPTH
from layerlift.linker.store_base import Store, StoreError, StoreTimeout
from layerlift.linker.transfer_plan import (
    OffloadChunk,
    OffloadOutcome,
    OffloadPart,
    OffloadSegment,
    pack_runs,
)

__all__ = ["IN_PLACE_PUT_BUFFERS", "IN_PLACE_PUT_BYTES", "OffloadOutcome", "StagedOffload"]

# An in-place offload's put calls grow from ``in_place.FIRST_BYTES`` to at
# most this many bytes and buffers (SGLang's in-place offloads' bounds: the
# per-peer queue of 1024 transfers of Mooncake's TCP transport is shared with
# the same client's loads).
IN_PLACE_PUT_BYTES, IN_PLACE_PUT_BUFFERS = 128 << 20, 512


class StagedOffload:
    """One offload: snapshot → footers → put, chunk by chunk through ``ring``
    (see the module docstring); or, with ``source`` (``snapshot`` None), in
    place: ``put_parts`` calls growing from 8 MiB (`IN_PLACE_PUT_BYTES`,
    `IN_PLACE_PUT_BUFFERS` at most), each page from the source's registered
    memory, its footer computed over those bytes into a region of the ring
    (``overflow``: never waits), the next calls' footers while one runs; it
    waits for a put that timed out (``wait_timed_out``: the source is the
    put's memory until it ended).
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
        self.depth = depth
        if source is not None:  # in place: one put of every object
            segments = tuple(OffloadSegment(p, 0, len(part.keys))
                             for p, part in enumerate(self.parts) if part.keys)
            self.chunks: list[OffloadChunk] = [OffloadChunk(segments)] if segments else []
            return
        # At most two regions of this offload are held at once (one chunk put
        # while the next is staged: see `run`), so each chunk may take half
        # the ring (all of it unpipelined): fewer, larger puts.
        budget = max(1, ring.capacity // self.regions_held())
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

    def regions_held(self) -> int:
        """The most regions of the ring this offload holds at once: 2 when
        pipelined (``depth`` >= 2: a chunk put while the next is staged), else
        1. The chunks are sized to ``capacity // regions_held()``."""
        return 2 if self.depth >= 2 else 1

    def run(self, on_source_free: Callable[[], None] | None = None) -> OffloadOutcome:
        """Worker thread: put every chunk in order; stop at the first failure.
        ``on_source_free`` runs once, when the source is not read any more.

        Staged, with ``depth`` >= 2 and more than one chunk, the put of chunk
        ``k`` runs on a put thread of this call while this thread stages chunk
        ``k + 1`` (region, snapshot, footers): the puts stay one at a time and
        in order, chunk ``k + 1``'s put is issued only once chunk ``k``'s
        succeeded (a failure sends nothing after it), each put's region is
        released by the put thread after its call returned (or handed over
        to a call that timed out), and ``run`` returns (or raises what the
        snapshot raised) only after the put thread has returned."""
        outcome = OffloadOutcome()
        try:
            if self.source is not None:
                return self._in_place(self.chunks[0], self.source) if self.chunks else outcome
            pipelined = self.regions_held() == 2 and len(self.chunks) >= 2
            with (ThreadPoolExecutor(1, thread_name_prefix="layerlift-put") if pipelined
                  else contextlib.nullcontext()) as putter:
                pending: Future[_PutResult] | None = None
                try:
                    for index, chunk in enumerate(self.chunks):
                        free, on_source_free = self._last_read(index, on_source_free)
                        staged = self._stage(chunk, outcome, free)
                        try:
                            go_on = True
                            if pending is not None:
                                done, pending = pending, None
                                go_on = self._account(done.result(), outcome)
                            if go_on and staged is not None:
                                sending, staged = staged, None  # the put releases it now
                                pending = self._submit(putter, sending)
                        finally:
                            if staged is not None:  # staged, never sent
                                staged.region.release()
                        if pending is None:
                            break
                    if pending is not None:
                        done, pending = pending, None
                        self._account(done.result(), outcome)
                finally:
                    if pending is not None:  # something raised: the put still ends first
                        wait([pending])
            return outcome
        finally:
            if on_source_free is not None:
                on_source_free()

    def _in_place(self, chunk: OffloadChunk, source: Source) -> OffloadOutcome:
        """In place: every object of ``chunk`` put from the source's pages in
        ``put_parts`` calls growing from ``FIRST_BYTES`` to `IN_PLACE_PUT_BYTES`
        and `IN_PLACE_PUT_BUFFERS` (``grow``), each object's footer computed
        over its page where it is into a region of the ring, the footers of
        the next calls while one runs (`PipelinedPuts`: calls in order, the
        first failure ends it, a put that timed out is waited for and counted
        ``late`` if it then succeeded; returns once no call reads the pages)."""
        rows: list[tuple[OffloadPart, str, int]] = []
        for seg in chunk.segments:
            part = self.parts[seg.part]
            rows += zip([part] * seg.rows, part.keys[seg.lo : seg.hi],
                        source.pages(seg, part), strict=True)
        shape = [(r[0].layout.object_bytes, 2 if r[0].layout.footer_bytes else 1) for r in rows]
        calls = [rows[r.start : r.stop]
                 for r in grow(shape, IN_PLACE_PUT_BYTES, IN_PLACE_PUT_BUFFERS, FIRST_BYTES)]
        return PipelinedPuts(self.store, self._in_place_call).run(calls)

    def _in_place_call(self, rows: list[tuple[OffloadPart, str, int]],
                       outcome: OffloadOutcome) -> Call | None:
        """One in-place call of ``rows`` (``(part, key, page address)``): the
        footers computed over the pages into a region of the ring
        (``overflow``: never waits; None, the error in ``outcome``, when none
        came), a run of one part's rows at a time."""
        total = sum(part.layout.footer_bytes for part, _, _ in rows)
        try:
            region = self.ring.acquire(max(total, 1), timeout_s=self.timeout_s, overflow=True)
        except StoreError as exc:
            outcome.error = exc
            return None
        try:
            call, at = Call(region), region.ptr
            for _, run in groupby(rows, key=lambda r: id(r[0])):
                same = list(run)
                part = same[0][0]
                keys = [key for _, key, _ in same]
                addrs = [addr for _, _, addr in same]
                layout, n = part.layout, len(same)
                fb = layout.footer_bytes
                if fb:
                    start = at - region.ptr
                    table = region.tensor[start : start + n * fb].view(n, fb)
                    table.numpy()[:] = footers(addrs, layout.slices, keys).view(np.uint8)
                    call.ptrs += [[a, at + i * fb] for i, a in enumerate(addrs)]
                    call.sizes += [[layout.page_bytes, fb]] * n
                    at += n * fb
                else:  # a page no layer reads: no footer
                    call.ptrs += [[a] for a in addrs]
                    call.sizes += [[layout.page_bytes]] * n
                call.keys += keys
        except BaseException:
            region.release()
            raise
        return call

    def _stage(self, chunk: OffloadChunk, outcome: OffloadOutcome,
               snapshotted: Callable[[], None] | None) -> _Staged | None:
        """This thread: a region for the chunk's whole objects, the snapshot's
        page bytes into it, the footers over those bytes (the snapshot's own,
        when it computed them as it copied). None (the error in
        ``outcome``) when no region came free; a snapshot that raises releases
        the region and raises. ``snapshotted`` runs once, when this returns or
        raises (the source is not read any more)."""
        assert self.snapshot is not None  # staged (a source is put in place)
        # Region layout: every segment's whole objects, in order, back to back.
        plan: list[tuple[OffloadSegment, OffloadPart, int]] = []
        total = 0
        for seg in chunk.segments:
            part = self.parts[seg.part]
            plan.append((seg, part, total))
            total += seg.rows * part.layout.object_bytes
        try:
            try:
                region = self.ring.acquire(total, timeout_s=self.timeout_s)
            except StoreError as exc:
                outcome.error = exc
                return None
            try:
                base = region.ptr
                keys: list[str] = []
                ptrs: list[int] = []
                sizes: list[int] = []
                for seg, part, start in plan:
                    layout, n = part.layout, seg.rows
                    ob, pb = layout.object_bytes, layout.page_bytes
                    objects = region.tensor[start : start + n * ob].view(n, ob)
                    table = self.snapshot.read(seg, part, objects[:, :pb])
                    seg_keys = list(part.keys[seg.lo : seg.hi])
                    rows = [base + start + i * ob for i in range(n)]
                    if layout.slices:
                        if table is None:  # not checksummed as it was copied
                            table = footers(rows, layout.slices, seg_keys)
                        elif table.shape != (n, len(layout.slices)) or table.dtype != "<u4":
                            raise ValueError(f"the snapshot's footers are {table.dtype} "
                                            f"{table.shape}; expected <u4 "
                                            f"{(n, len(layout.slices))}")
                        objects.numpy()[:, pb : pb + layout.footer_bytes] = table.view(np.uint8)
                    keys += seg_keys
                    ptrs += rows
                    sizes += [ob] * n
            except BaseException:
                region.release()
                raise
            return _Staged(region, keys, ptrs, sizes)
        finally:
            if snapshotted is not None:
                snapshotted()

    def _last_read(self, index: int, on_source_free: Callable[[], None] | None
                   ) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
        """``(for this chunk's staging, still to run)``: the last chunk's
        staging takes ``on_source_free`` (it runs it, also when it raises)."""
        if index == len(self.chunks) - 1:
            return on_source_free, None
        return None, on_source_free

    def _submit(self, putter: ThreadPoolExecutor | None, staged: _Staged) -> Future[_PutResult]:
        """``staged``'s put on the put thread, or (no put thread: depth 1 or
        one chunk) here and now: done before the next chunk is staged."""
        if putter is not None:
            return putter.submit(self._put, staged)
        done: Future[_PutResult] = Future()
        done.set_result(self._put(staged))
        return done

    def _put(self, staged: _Staged) -> _PutResult:
        """The put thread (or this one): one ``put`` of a staged chunk; its
        region released after the call returned (handed over to a call that
        timed out, without ``wait_timed_out``)."""
        region = staged.region
        try:
            try:
                self.store.put(staged.keys, staged.ptrs, staged.sizes)
            except StoreTimeout as exc:
                if not self.wait_timed_out:
                    region.hand_over(exc, self.on_late_end)
                    return _PutResult(staged, exc)
                if not exc.wait_finished():
                    return _PutResult(staged, exc)
                return _PutResult(staged, None, late=True)
            except StoreError as exc:
                return _PutResult(staged, exc)
            return _PutResult(staged, None)
        finally:
            region.release()

    @staticmethod
    def _account(result: _PutResult, outcome: OffloadOutcome) -> bool:
        """``result`` into ``outcome``; whether the offload goes on."""
        if result.error is not None:
            outcome.error = result.error
            return False
        outcome.late += result.late
        outcome.objects += len(result.staged.keys)
        outcome.bytes += sum(result.staged.sizes)
        return True


@dataclass(slots=True)
class _Staged:
    """A chunk ready to put: its region (whole objects) and the put's lists."""

    region: Region
    keys: list[str]
    ptrs: list[int]
    sizes: list[int]


@dataclass(slots=True)
class _PutResult:
    staged: _Staged
    error: StoreError | None
    late: bool = False
