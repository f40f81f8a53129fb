"""The two seams of a staged transfer (``linker/staged.py``), and its gate.

A load's verified rows go to a **sink**; an offload's page bytes come from a
**snapshot**. Each adapter supplies its own scatter or gather; the host
forms (:class:`HostSink`, :class:`HostSnapshot`) are done when they return,
the device forms are written once here for every adapter. The
:class:`Gate` is what a load's copies hold: once ``close()`` returned, no
copy into the destination runs and none starts.

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
A load whose chunks run on several threads at once (``fetch_all``) lands
its layers with :meth:`DeviceSink.mark` instead: an event after every copy
issued on the stream so far, whichever thread issued it.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from layerlift.linker.store_base import StoreTimeout
from layerlift.linker.transfer_plan import LoadPart, LoadSegment, OffloadPart, OffloadSegment
from layerlift.overlap.device import Device, DeviceEvent

__all__ = [
    "DeviceSink",
    "DeviceSnapshot",
    "Gate",
    "Gather",
    "HostSink",
    "HostSnapshot",
    "Placement",
    "Scatter",
    "Sink",
    "Snapshot",
    "Source",
]


class Gate:
    """Opens once, closes once: copies into a load's destination happen only
    while it is open, holding its lock (see the module docstring).

    It also counts an in-place load's **reads in flight** (:meth:`reading`:
    a store call writing straight into the destination, and the check of
    what it wrote; :meth:`keep_until`: a call that timed out and still
    runs). Closing does not stop a read already issued (a store call cannot
    be revoked): an adapter whose destination it cannot keep (vLLM's
    blocks, which vLLM reuses once told) hands it back only once
    :meth:`wait_reads` returned True, or from :meth:`when_quiet`."""

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._open = True
        self._reads = 0
        self._quiet: list[Callable[[], None]] = []

    @contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the gate; yields whether it is open (copy only if True)."""
        with self._lock:
            yield self._open

    def close(self) -> None:
        """Close it: returns once no copy runs; none starts afterwards (reads
        in flight go on: :meth:`wait_reads`). Idempotent."""
        with self._lock:
            self._open = False

    @property
    def open(self) -> bool:
        return self._open

    @contextmanager
    def reading(self) -> Iterator[bool]:
        """A read into the destination: yields whether the gate is open
        (read only if True), counted in flight from that same look at the
        gate until the block exits (so a :meth:`close` either comes first
        and no read starts, or :meth:`wait_reads` waits for this one)."""
        with self._lock:
            open_ = self._open
            if open_:
                self._reads += 1
        try:
            yield open_
        finally:
            if open_:
                self._ended()

    def keep_until(self, exc: StoreTimeout) -> None:
        """A read that timed out may still write the destination: count it
        in flight until its call ended (``exc.future``; nothing when no call
        runs on, or the one that does was lent no memory: ``exc.lent``, a
        session start), and mark ``exc.owned``. Call it inside :meth:`reading`."""
        future = exc.future
        if future is None or not exc.lent:  # nothing runs on that may write the destination
            return
        with self._lock:
            self._reads += 1
        exc.owned = True
        future.add_done_callback(lambda _f: self._ended())

    def _ended(self) -> None:
        with self._lock:
            self._reads -= 1
            if self._reads:
                return
            self._lock.notify_all()
            quiet, self._quiet = self._quiet, []
        for fn in quiet:
            fn()

    @property
    def reads(self) -> int:
        """Reads in flight now (:meth:`reading`, :meth:`keep_until`): a
        snapshot, read without the lock (so a copy under :meth:`held` may
        look at it)."""
        return self._reads

    def wait_reads(self, timeout_s: float | None) -> bool:
        """Block until no read is in flight (at most ``timeout_s``); True
        when none is."""
        with self._lock:
            return self._lock.wait_for(lambda: self._reads == 0, timeout_s)

    def when_quiet(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no read is in flight: now, on this thread, if none
        is; else on the thread that ends the last one (a store call's
        completion for a read that timed out)."""
        with self._lock:
            if self._reads:
                self._quiet.append(fn)
                return
        fn()


class Sink(Protocol):
    """Where a load's verified rows go (the adapter's destination). A sink
    with a true ``strided_rows`` attribute (:class:`HostSink`) also takes
    rows whose stride exceeds their size (each row contiguous): a whole
    load can then be read as whole objects (``StagedLoad.fetch_all``)."""

    def write(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> DeviceEvent | None:
        """Copy ``rows`` (``uint8[seg.rows, size]``, host staging, verified)
        into slice ``seg.local`` of rows ``seg.lo..seg.hi`` of ``part``'s
        destination. Called under the load's gate, on a worker thread. Return
        None once the copy is done, or an event recorded after copies that
        still read ``rows`` (the region is reused only once it completed)."""


class Placement(Protocol):
    """An in-place load's destination (the engine's registered pool pages or
    its pinned per-batch staging): the store reads each slice straight into
    it, and the transfer verifies it there. Nothing is copied, so there is no
    sink; the checksums alone go through the ring."""

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        """The sizes of the pieces slice ``local`` of ``part``'s objects
        lands in, in object order (they add up to the slice's size):
        ``(size,)`` where a row's slice lands in one run of memory, more
        where the destination keeps them apart (SGLang's pools: a layer's K
        rows and its V rows in two tensors). Each piece is one range of the
        store call, and the slice's CRC runs over the pieces in order."""

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        """Where slice ``seg.local`` of rows ``seg.lo..seg.hi`` of ``part``
        lands: one address per row and piece (:meth:`pieces`), row by row
        (row ``i``'s piece ``j`` at ``i * len(pieces) + j``), in memory
        registered with the store."""

    def pages(self, part: LoadPart) -> list[int]:
        """For a whole read (:meth:`StagedLoad.fetch_whole`): where each
        object's page lands, one address per row of ``part``, in memory
        registered with the store."""

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        """A read into rows ``lo..hi`` of ``part`` timed out and may still
        run: take that memory over (keep it alive and unreused until the call
        ended; mark ``exc.owned``; an adapter that hands the memory back only
        once the load's gate has no read in flight calls ``gate.keep_until``),
        or wait for the call (``exc.wait_finished``) before returning. The
        worker thread that read calls it, inside the read's
        ``gate.reading()``, before the failure is raised."""


Scatter = Callable[[LoadSegment, LoadPart, torch.Tensor], None]
"""``scatter(seg, part, rows)``: write ``rows`` (on the destination's device)
into the destination of the segment's rows (e.g. ``view.index_copy_(0, idx, rows)``)."""


class HostSink:
    """The host path: ``scatter`` copies from staging; done when it returns.
    Its rows may be strided (``strided_rows``: a row's stride can exceed its
    size, as in slices of whole objects); each row is contiguous."""

    strided_rows = True

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

    def mark(self) -> DeviceEvent:
        """An event recorded on the load stream after everything issued on it
        so far (every ``write`` and ``issue`` that returned): it completes
        once all of those ran. No host sync."""
        with self._lock:
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

    def read(self, seg: OffloadSegment, part: OffloadPart,
             pages: torch.Tensor) -> np.ndarray | None:
        """Copy the page bytes of rows ``seg.lo..seg.hi`` of ``part``
        (layer-major, ``layout.page_bytes`` each) into ``pages``
        (``uint8[seg.rows, page_bytes]``, a strided view of staging).
        Returns once the bytes are in ``pages``: None, and the transfer
        computes the footers over ``pages``; or those footers already
        (``uint32[seg.rows, slices]``, what ``integrity.footers`` gives for
        ``pages`` and the rows' keys), computed over the bytes in ``pages``
        as each slice was copied (``integrity.copy_checksum``), never over
        the source."""


class Source(Protocol):
    """An in-place offload's source (the engine's pinned pool pages, or its
    registered host copy of device pages): each object's page is put from
    where it is, its footer computed over those very bytes into the ring.
    The adapter keeps the pages unchanged (pinned) until ``run`` returned."""

    def pages(self, seg: OffloadSegment, part: OffloadPart) -> list[int]:
        """Where the page of each of rows ``seg.lo..seg.hi`` of ``part`` is:
        one address per row, in memory registered with the store."""


Gather = Callable[[OffloadSegment, OffloadPart], torch.Tensor]
"""``gather(seg, part)``: the segment's pages as ``uint8[rows, page_bytes]``
(on the source's device)."""


class HostSnapshot:
    """The host path: ``pages.copy_(gather(seg, part))``."""

    def __init__(self, gather: Gather) -> None:
        self.gather = gather

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> None:
        pages.copy_(self.gather(seg, part))
        return None


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
        return None
