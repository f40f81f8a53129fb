"""One layer-wise load batch inside SGLang, and the counter SGLang's pools wait on.

A :class:`BatchLoad` is what one ``start_layer_wise_loading`` started: one
:class:`~layerlift.overlap.base.LayerJob` per layer, issued in layer order by
LayerLift's :class:`~layerlift.overlap.scheduler.LoadScheduler` on a
:class:`~layerlift.overlap.lanes.CpuLane`. Each job is the layer of a
:class:`~layerlift.linker.staged.StagedLoad`: every request's slice of that
layer, footer entries included, in chunks through the linker's bounded
staging ring (``linker/ring.py``; a chunk is at most ``capacity // depth``,
so a request of any size streams through the default staging). A chunk is
verified against its CRC-32Cs (the object's key and the layer are in the
seed) and only then copied into SGLang's slots, under the batch's *gate*; a
slice that fails its check quarantines its key (``quarantine.Quarantine``).

Promises (each a test in ``tests/hosts/sglang_host``):

- A layer whose slice is corrupt, foreign, truncated or missing, or whose read
  failed, never reaches the slots: its slots (and those of every layer that
  did not land) are zeroed, and :meth:`BatchLoad.finish` returns False, so
  SGLang aborts the batch's loading requests and inserts nothing of them.
- Bounded: every wait of the forward (``wait_until``) and ``finish`` return
  by ``started + bound_s`` (plus one layer copy in progress), whatever the
  store does; a stalled load ends as failed, never as a hang.
- Once ``finish`` (or a failed wait) closed the gate, nothing writes into the
  batch's slots again: a read that returns later lands in staging only, and
  its region returns to the ring only when that read ended.

Host pools whose units are large enough (``in_place_load_min_kib``) are
read **in place** instead (``load_in_place.py``): each
layer's slices straight into the slots, a range per part, verified where
they landed, in calls of at most ``IN_PLACE_RANGES`` ranges; the batch's
other pools stay staged (each layer reads from one pool). The promises
hold with two changes: a slice that fails its check did reach the slots,
and is zeroed before the forward's wait for its layer returns (once no read
of the batch is in flight; a read still running at the bound: once it
ended, and before ``finish`` returns); and ``finish`` returns only once no
read of the batch may still write the slots (at most ``read_end_s``, else
``SlotsStillWritten``).

Like SGLang's own counter, a failed layer does not raise into the forward
(that would take the scheduler down): the forward goes on over zeroed slots,
and the verdict comes from ``finish``.

Pools on a device (``path``, a :class:`~.device.DevicePath`): the sink is the
staged transfer's :class:`~layerlift.linker.staged.DeviceSink` on the path's
load stream (fenced after the scheduler's current stream and the forward
stream when the batch is built): a chunk's H2D copy and scatter are issued
there and an event is recorded after them; its pinned staging returns to the
ring once that event completed. A layer *lands* when its copies are issued;
``wait_layer`` then makes the forward stream wait on the layer's event (no
host sync). ``stop`` zeroes the layers that did not land on the load stream
(after any copy of theirs) and the forward stream waits on that too. The same
promises hold, with "copied" read as "issued on the load stream, before the
event the forward waits on".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from layerlift.linker.read_order import ReadOrder
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import (
    DeviceSink,
    Gate,
    HostSink,
    LoadPart,
    LoadSegment,
    Sink,
    StagedLoad,
)
from layerlift.linker.store_base import Store, StoreError, StoreUnavailable
from layerlift.overlap.base import LayerJob, LayerLoadError, LayerWaitTimeout
from layerlift.overlap.device import DeviceEvent
from layerlift.overlap.readiness import LayerReadiness

from .device import DevicePath, scatter_units, zero_units
from .layout import PoolLayout
from .load_in_place import (
    IN_PLACE_RANGES,
    READ_END_S,
    SlotPlacement,
    SlotsStillWritten,
    split_reads,
)
from .quarantine import Quarantine

__all__ = ["BatchLoad", "LoadCounter", "LoadItem", "LoopThread"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One pool's part of one request's load: store keys and the first row of each unit."""

    rid: str
    layout: PoolLayout
    keys: tuple[str, ...]
    rows: tuple[int, ...]



class LoopThread:
    """An asyncio loop on its own daemon thread (LayerLift's scheduler runs there)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        async def run() -> Any:
            return await fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)


class BatchLoad:
    """One batch of loads (see the module docstring). Built on the scheduler
    thread; its jobs run on lane threads; ``wait_layer`` on the forward's
    thread; ``finish`` on the scheduler thread."""

    def __init__(self, index: int, items: Sequence[LoadItem], num_layers: int, store: Store,
                 bound_s: float, ring: StagingRing, *, depth: int, timeout_s: float,
                 quarantine: Quarantine | None = None, path: DevicePath | None = None,
                 in_place: frozenset[str] = frozenset(), read_end_s: float = READ_END_S,
                 ordered: bool = False) -> None:
        self.index = index
        self.path = path
        self.quarantine = quarantine
        self.items = tuple(items)
        self.store = store
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + bound_s
        self.readiness = LayerReadiness(num_layers, default_timeout=bound_s)
        reads: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
        for p, item in enumerate(self.items):
            for j, lp in enumerate(item.layout.layers):
                reads[lp.layer].append((p, j))
        self.gate = Gate()
        self.sink: DeviceSink | None = None
        sink: Sink = HostSink(self._scatter)
        if path is not None:
            self.sink = DeviceSink(path.device, self._device_scatter, stream=path.load_stream)
            path.fence_load()  # no copy overtakes earlier work on the slots
            sink = self.sink
        placed = split_reads([item.layout.name for item in self.items], reads, in_place) \
            if path is None else None
        # Both loads' reads take turns, the lowest layer first (``read_order.py``).
        order = self.read_order = ReadOrder(timeout_s) if ordered else None
        self.read_end_s = read_end_s
        self.placed: StagedLoad | None = None  # the items read in place (``load_in_place.py``)
        staged = [p for p in range(len(self.items)) if not (placed and placed[p])]
        if placed is not None:
            mine = [p for p in range(len(self.items)) if placed[p]]
            self.placed = StagedLoad(
                ring, store, self._parts(mine), self._local(reads, mine), None,
                depth=depth, gate=self.gate, timeout_s=timeout_s, on_corrupt=self._quarantine,
                on_layer=self._on_layer, placement=SlotPlacement(self.gate),
                in_place_ranges=IN_PLACE_RANGES, read_order=order)
        self.staged = StagedLoad(
            ring, store, self._parts(staged), self._local(reads, staged), sink, depth=depth,
            gate=self.gate, timeout_s=timeout_s, on_corrupt=self._quarantine,
            on_layer=self._on_layer, read_order=order)
        # Each layer reads from one of the two (``split_reads``).
        self._load_of = [self.placed if self.placed is not None and placed and r and placed[r[0][0]]
                         else self.staged for r in reads]
        self.reads = reads
        self.landed = [not r for r in reads]
        # When the forward first asked for each layer and when that wait
        # returned (None: not asked, or nothing to read): ``read_order.order_pays``.
        self.asks: list[tuple[float, float] | None] = [None] * num_layers
        self.ready_at: list[float | None] = [self.started if not r else None for r in reads]
        self.error: BaseException | None = None
        self.quiet = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._zeroed = False
        self._zero_lock = threading.Lock()
        self._unzeroed: list[tuple[LoadItem, int]] = []  # host path: the slots still to zero
        self._zero_event: DeviceEvent | None = None  # the device path's zeroing of unlanded layers
        self._waited: set[int] = set()  # layers the forward stream already waits on
        self._session = contextlib.ExitStack()
        self._session_lock = threading.Lock()
        self._session_tried = False
        self._session_open = False

    def _parts(self, which: Sequence[int]) -> list[LoadPart]:
        return [LoadPart(self.items[p].layout.objects, self.items[p].keys, self.items[p])
                for p in which]

    @staticmethod
    def _local(reads: Sequence[Sequence[tuple[int, int]]],
               which: Sequence[int]) -> list[list[tuple[int, int]]]:
        """``reads`` of the items ``which`` only, renumbered as their parts."""
        at = {p: i for i, p in enumerate(which)}
        return [[(at[p], j) for p, j in r if p in at] for r in reads]

    @property
    def in_place(self) -> bool:
        """Whether some of the batch's layers are read straight into the slots."""
        return self.placed is not None

    def jobs(self) -> list[LayerJob]:
        return [LayerJob(layer, self._fetcher(layer), self._load_of[layer].nbytes(layer))
                for layer, r in enumerate(self.reads) if r]

    def _fetcher(self, layer: int) -> Callable[[], None]:
        load = self._load_of[layer]

        def fetch() -> None:
            if not self._open_session() and load is self.placed:
                # In place, a read counts in flight from its call on (``finish``
                # waits for it): one that would open its own session first may
                # wait that long on the master without writing a byte.
                raise StoreUnavailable(f"layer {layer}: the batch's read session did not "
                                       "open; nothing is read into the slots")
            load.fetch_layer(layer)

        return fetch

    def _open_session(self) -> bool:
        """One read session over the batch's keys for its per-layer reads (the
        first job opens it; the others wait for that). Returns whether it is
        open: if not, a staged job reads in a session of its own, which the
        store opens, and an in-place job reads nothing."""
        with self._session_lock:
            if self._session_tried:
                return self._session_open
            self._session_tried = True
            keys = list(dict.fromkeys(k for item in self.items for k in item.keys))
            try:
                self._session.enter_context(self.store.open_session(keys))
                self._session_open = True
            except StoreError as exc:  # the reads then fail (or open their own sessions)
                _log.debug("LayerLift: the batch's read session did not open: %s", exc)
            return self._session_open

    @staticmethod
    def _scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        """Verified rows from staging into SGLang's slots (under the gate)."""
        item: LoadItem = part.target
        spans = item.layout.layers[seg.local].spans()  # read off the tensors once
        src = int(rows.data_ptr())
        stride = int(rows.stride(0))
        for i in range(seg.rows):
            at = src + i * stride
            row = item.rows[seg.lo + i]
            for ptr, row_bytes, n in spans:
                ctypes.memmove(ptr + row * row_bytes, at, n)
                at += n

    @staticmethod
    def _device_scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        """Device path, on the load stream: ``rows`` (already on the slots' device)
        into the segment's units."""
        item: LoadItem = part.target
        scatter_units(item.layout.layers[seg.local], item.rows[seg.lo : seg.hi], rows)

    def _on_layer(self, layer: int, event: object) -> None:
        """Under the gate, after the layer's last copy: it landed."""
        self.landed[layer] = True
        self.ready_at[layer] = time.perf_counter()

    def _quarantine(self, keys: list[str]) -> None:
        if self.quarantine is not None:
            self.quarantine.add(keys)

    def wait_layer(self, layer: int) -> None:
        """Forward thread: return once ``layer`` landed, or (failed, or past the
        bound) once the batch is stopped and its unlanded slots zeroed. On a
        device "landed" means its copies were issued: the forward stream then
        waits on their event (or on the zeroing), with no host sync."""
        asked = time.perf_counter() if self.asks[layer] is None and self.reads[layer] else None
        self._wait_layer(layer)
        if asked is not None:
            self.asks[layer] = (asked, time.perf_counter())

    def read_s(self) -> float:
        """The load's time a layer so far: its last landing after its start,
        over the layers that read (0.0 before one landed)."""
        times = [t for t, r in zip(self.ready_at, self.reads, strict=True) if r and t is not None]
        return (max(times) - self.started) / len(times) if times else 0.0

    def _wait_layer(self, layer: int) -> None:
        if not self.landed[layer]:
            if not self._stopped:
                remaining = self.deadline - time.monotonic()
                try:
                    self.readiness.wait(layer, timeout=max(remaining, 1e-3))
                except (LayerLoadError, LayerWaitTimeout) as exc:
                    self.error = self.error or exc
            if not self.landed[layer]:
                self.stop()  # idempotent: the unlanded slots zeroed (issued; or after a stalled read)
        self._order_forward(layer)

    def _order_forward(self, layer: int) -> None:
        """Device path: the forward stream waits on the event after ``layer``'s
        copies (a landed layer) or after the zeroing of the unlanded ones."""
        path = self.path
        if path is None or layer in self._waited:
            return
        event = self.staged.events[layer] if self.landed[layer] else self._zero_event
        if event is not None:
            path.wait(event)
        if path.forward_stream is not None:  # one stream: once ordered, ordered for good
            self._waited.add(layer)

    def stop(self) -> None:
        """Close the gate (no copy into the slots from now on) and zero the
        slots of every layer that did not land: at once, or (an in-place read
        still in flight) once no read is (``load_in_place.py``; ``finish``
        waits for that). Idempotent."""
        with self._stop_lock:
            self._stopped = True
            self.gate.close()  # returns once no copy runs; ``landed`` is final now
            if self._zeroed:
                return
            self._zeroed = True
            unlanded = [(self.items[p], j) for layer, r in enumerate(self.reads)
                        if not self.landed[layer] for p, j in r]
            if self.sink is not None:
                if unlanded:  # on the load stream: after any copy of these layers
                    def zero() -> None:
                        for item, j in unlanded:
                            zero_units([item.layout.layers[j]], item.rows)

                    self._zero_event = self.sink.issue(zero)
                return
            with self._zero_lock:
                self._unzeroed = unlanded
        if self.gate.reads:  # in place: reads end soon unless stalled (the forward's bound)
            self.gate.wait_reads(max(0.0, self.deadline - time.monotonic()))
        self.gate.when_quiet(self._zero_host)  # now, or on the thread that ends the last read

    def _zero_host(self) -> None:
        """Host path: zero the unlanded layers' slots, once (whichever thread
        comes first: ``stop``, the end of the last read in flight, ``finish``)."""
        with self._zero_lock:
            unlanded, self._unzeroed = self._unzeroed, []
            for item, j in unlanded:
                for part in item.layout.layers[j].parts:
                    for row in item.rows:
                        ctypes.memset(part.ptr(row), 0, part.nbytes)

    def finish(self) -> bool:
        """Scheduler thread: wait (at most until the bound) for the batch to
        settle, close the gate, and return True only when every layer landed
        verified. With layers read in place, it returns only once no read is
        in flight and the unlanded slots are zeroed: at most ``read_end_s``
        more, else :class:`~.load_in_place.SlotsStillWritten`."""
        self.quiet.wait(max(0.0, self.deadline - time.monotonic()))
        self.stop()
        if self.placed is not None:  # SGLang frees the slots once told: no read may still write
            if not self.gate.wait_reads(self.read_end_s):
                raise SlotsStillWritten(
                    f"LayerLift: a store read into SGLang's slots for load batch {self.index} "
                    f"did not end within {self.read_end_s:g} s; the slots cannot be handed "
                    "back while it may still write them (is the storage node reachable?)")
            self._zero_host()
        for layer in range(len(self.landed)):  # device: later work on the slots follows the copies
            self._order_forward(layer)
        failed = self.readiness.failed_requests()
        if self.error is None and failed:
            self.error = LayerLoadError(-1, None, failed, "a layer failed")
        return all(self.landed) and self.error is None and not failed

    def on_quiet(self) -> None:
        """Every job returned: end the read session (a read that timed out
        keeps its own staging until it ends: the ring's hand-over)."""
        self.quiet.set()
        threading.Thread(target=self._session.close, name="layerlift-session-end",
                         daemon=True).start()


class LoadCounter:
    """The ``layer_done_counter`` of :class:`LayerLiftLinker`: what SGLang's KV
    pools and Mamba pool call before reading layer ``l`` (``wait_until``), and
    what the model runner points at the batch in flight (``set_consumer``).

    As SGLang's own ``LayerWiseLoadCounter``: ``num_layers`` layers, and
    ``wait_until(L)`` is a prefix barrier (layers ``0..L`` have landed or the
    batch was stopped): SGLang waits on ``num_layers - 1`` for a whole batch
    (``prefill_cuda_graph_runner``) and on the last Mamba layer only before
    copying Mamba states."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.consumer_index = -1
        self._batches: dict[int, BatchLoad] = {}
        self._lock = threading.Lock()

    def add(self, batch: BatchLoad) -> None:
        with self._lock:
            self._batches[batch.index] = batch

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        """Block until layers ``0..threshold`` of the consumer batch landed or
        the batch was stopped (bounded; see :class:`BatchLoad`). Never raises."""
        batch = self._batches.get(self.consumer_index)
        if batch is None:
            return
        for layer in range(min(threshold, len(batch.landed) - 1) + 1):
            batch.wait_layer(layer)

    def take(self, index: int) -> BatchLoad | None:
        with self._lock:
            return self._batches.pop(index, None)

    def batches(self) -> list[BatchLoad]:
        with self._lock:
            return list(self._batches.values())

    def reset(self) -> None:
        with self._lock:
            self._batches.clear()
        self.consumer_index = -1
