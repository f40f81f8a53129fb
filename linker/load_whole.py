"""Whole-load reads of a staged :class:`~layerlift.linker.staged_load.StagedLoad`:
every layer in as few store calls as the chunk budget allows, for a restore
nobody waits on layer by layer (one call; whole objects into a host sink;
or ``depth`` chunks at once into a host sink, halted at the first failure).
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from layerlift.linker.load_core import (
    CorruptSlices,
    LoadCore,
    TransferRevoked,
    _Halt,
    _object_mismatches,
)
from layerlift.linker.sinks import DeviceSink
from layerlift.linker.transfer_plan import (
    LoadChunk,
    LoadPart,
    merge_chunks,
    reads_every_slice_once,
)
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import DeviceEvent

__all__ = ["WholeReads"]


class WholeReads(LoadCore):
    """A staged load's whole-load reads (:meth:`fetch_all` and its helpers)."""

    def one_call(self) -> bool:
        """Whether :meth:`fetch_all` reads every layer in one store call (the
        load fits one chunk of ``capacity // depth`` bytes). Staged loads only."""
        return self.sink is not None and len(self._merged()) <= 1

    def fetches_all(self) -> bool:
        """Whether :meth:`fetch_all` is the way to run this load when nobody
        waits on it layer by layer: it fits one call (:meth:`one_call`), or
        its sink is the host's (``strided_rows``: its copies are done when
        they return) or a :class:`DeviceSink` (its copies run in issue order
        on one stream, where :meth:`DeviceSink.mark` records an event after
        all of them), so :meth:`fetch_all` reads its chunks ``depth`` at a
        time and lands the layers in order after them. Another sink keeps
        one job a layer (:meth:`job`) for a load of several chunks."""
        return self.one_call() or self._chunks_at_once()

    def fetch_all(self) -> DeviceEvent | None:
        """Worker thread: every layer, in as few store calls as the chunk
        budget allows (one when :meth:`one_call`): each chunk holds the
        slices of several layers, in layer order, and is read, verified and
        copied as one (nothing of a chunk is copied unless all of it
        verified); a layer lands (``on_layer``, ``events``) once the chunk
        holding its last slice was copied (one without reads with the layer
        before it), so layers land in order. Into a host sink, a load of one
        chunk reading every slice of its objects reads them whole instead
        (one range an object, :meth:`_fetch_objects`); into a host or a
        device sink a load of several chunks reads ``depth`` of them at once
        (:meth:`_fetch_merged`). For a load nobody waits on layer by layer
        (a restore the request waits for whole): a store call and a thread's
        turn a layer cost more than the layer's bytes when layers are small.
        Raises as :meth:`fetch_layer`; a failure stops the load (later
        chunks are not read), layers already landed stay landed. Staged
        loads only."""
        if self.sink is None:
            raise ValueError("fetch_all is for staged loads; an in-place load reads "
                             "one call a layer already (fetch_layer)")
        if self._objects_whole():
            return self._fetch_objects()
        event: DeviceEvent | None = None
        merged = self._merged()
        if len(merged) > 1 and self.depth > 1 and self._chunks_at_once():
            return self._fetch_merged(merged)
        for chunk, landing in merged:
            event = self._chunk(chunk, landing)
        if not merged:  # nothing to read: every layer lands at once
            for layer in range(len(self.chunks)):
                self._landed(layer, None)
        return event

    def _fetch_merged(self, merged: list[tuple[LoadChunk, tuple[int, ...]]]
                      ) -> DeviceEvent | None:
        """:meth:`fetch_all` of several chunks into a host or a device sink:
        up to ``depth`` chunks read, verified and copied at once, each on a
        thread of this call (at most ``depth`` regions, as ever: ``_take``);
        the layers land in chunk order, each once every chunk up to the one
        holding its last slice returned. A host copy is done when it returns;
        a device sink's copies of those chunks were issued on its stream
        when they returned, in whatever order the threads reached it, so the
        layers landing then get an event :meth:`DeviceSink.mark` records
        after everything issued so far (a chunk's own event would not follow
        the copies of an earlier chunk issued after it); each chunk's region
        is given back after its own event. Returns the last landing's event
        (None into a host sink). At the first failure no chunk not yet
        begun is read and a chunk still reading copies nothing once it
        verified; every thread returns before this does (a timed-out
        read keeps its region until its call ends, as in :meth:`_chunk`);
        then the first failure is raised, the layers of the chunks before
        the first that failed landed."""
        halt = _Halt()
        event: DeviceEvent | None = None

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
                    if not landing:
                        continue
                    event = self._after_copies()
                    for layer in landing:
                        self._landed(layer, event)
            except BaseException as exc:  # a chunk's, or a landing's (the gate closed)
                halt.fail(exc)
        # The first failure, not what it made of the chunks in flight (they
        # copy nothing once it happened: their TransferRevoked is its echo).
        if halt.cause is not None:
            raise halt.cause
        return event

    def _after_copies(self) -> DeviceEvent | None:
        """An event after every copy the sink issued so far (a
        :class:`DeviceSink`'s :meth:`~DeviceSink.mark`); None into a host
        sink, whose copies are done when ``write`` returns."""
        return self.sink.mark() if isinstance(self.sink, DeviceSink) else None

    def _chunks_at_once(self) -> bool:
        """Whether the sink lets chunks copy from several threads and land
        in order after them (:meth:`_fetch_merged`): a host sink, or a
        :class:`DeviceSink` (:meth:`_after_copies`)."""
        return self._strided_sink() or isinstance(self.sink, DeviceSink)

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
