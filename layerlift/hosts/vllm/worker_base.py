"""`BlockWorker`'s state and the parts both sides use: the device and its
streams, the staging ring, the owned loop, the step's synchronous loads, the
corrupt keys and the report for the scheduler.

The overview (threads, ownership, the host and the device path) is
``worker.py``'s docstring; the load side is `LoadSide` (``worker_load.py``),
the save side `SaveSide` (``worker_save.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import Item, LoadSpec, WorkerReport
from layerlift.hosts.vllm.objects import BlockSink, KeyedItem, host_blocks
from layerlift.linker.keys import KeySchema
from layerlift.linker.registered import register_spans
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import Gate, ObjectLayout, StagedLoad
from layerlift.linker.store_base import Store
from layerlift.overlap import CpuLane, LayerReadiness, LoadPolicy, LoadScheduler
from layerlift.overlap.device import CudaDevice, Device

__all__ = ["READ_END_S", "REPLACE_WAIT_S", "WorkerBase", "device_for"]

log = logging.getLogger("vllm.layerlift")
_Read = Callable[[int, list[int], torch.Tensor], None]  # `stage_pages`'s read
REPLACE_WAIT_S = 15.0  # > the 5 s read lease of `layerlift master`, with margin
SAVE_RING_FACTOR = 4  # the held saves' ring, in staging sizes (host path)
# How long a store read still running into vLLM's blocks (an in-place restore
# that failed or timed out) is waited for before vLLM hears of the load: the
# call ends within Mooncake's transfer timeout (``MC_TRANSFER_TIMEOUT``, 30 s
# by default) after the store's own bound; beyond this the worker raises
# rather than hand back blocks a read may still write.
READ_END_S = 90.0


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    items: list[KeyedItem]
    readiness: LayerReadiness
    gate: Gate = field(default_factory=Gate)
    settled: bool = False  # a settle has started (`quiet`: it has ended)
    quiet: threading.Event = field(default_factory=threading.Event)
    bad: bool = False  # a synchronous wait failed or timed out
    started: float = field(default_factory=time.monotonic)
    landed: float = 0.0  # when it settled verified (monotonic)
    waited_s: float = 0.0  # how long vLLM's thread waited for it (synchronous)
    sink: BlockSink | None = None  # the device path's sink (None: the host path)
    # Read straight into vLLM's blocks (`BlockPlacement`): its blocks go back
    # to vLLM only once the gate has no read in flight (`Gate.wait_reads`).
    in_place: bool = False
    staged: StagedLoad | None = None  # set on the loop before its first job runs
    # Keys of this load's objects that failed their check: removed from the
    # store once the load's session has ended (never while its reads run).
    corrupt: set[str] = field(default_factory=set)
    # Per global layer (load order), monotonic: when its copies were issued
    # (the host path: done), when the forward reached it, how long it waited.
    ready: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)


class WorkerBase:
    """The state of one vLLM worker's `BlockWorker` (see ``worker.py``)."""

    def __init__(self, store: Store, layout: Layout, kv_caches: dict[str, torch.Tensor], *,
                 schema: KeySchema, staging_bytes: int, max_in_flight: int,
                 load_timeout_s: float, replace_wait_s: float = REPLACE_WAIT_S,
                 save_wait_s: float | None = None, device: Device | None = None,
                 in_place_restores: bool = True, read_end_s: float = READ_END_S) -> None:
        self.store, self.layout, self.kv, self.schema = store, layout, kv_caches, schema
        # The device path (`device`, else the caches' own: CUDA tensors get a
        # CudaDevice; host tensors the host path): pinned staging, copies on
        # a load stream with an event per layer, gathers on a save stream.
        self.device = device if device is not None else device_for(kv_caches)
        self.load_stream: Any = None
        self.save_stream: Any = None
        if self.device is not None:
            with self.device.use():
                self.load_stream = self.device.new_stream()
                self.save_stream = self.device.new_stream()
        self.load_timeout_s = load_timeout_s
        self.replace_wait_s = replace_wait_s
        self.save_wait_s = store.timeout_s if save_wait_s is None else save_wait_s
        # Load order: recurrent (Mamba) state first (the forward needs it
        # before its first layer: `start_loads` waits for it), then the
        # attention layers in the model's order (the forward's waits).
        self._layers = sorted(((g, j) for g in layout.groups for j in range(len(g.layer_names))),
                              key=_load_order)
        self._mamba = [i for i, (g, _) in enumerate(self._layers) if g.kind is GroupKind.MAMBA]
        self._recurrent = {g.index for g in layout.groups if g.kind is GroupKind.MAMBA}
        # Several groups: a failed synchronous load is reported per request
        # (`WorkerReport.failed`); vLLM maps block ids of one group only.
        self._per_request = len(layout.groups) > 1
        self._index = {g.layer_names[j]: i for i, (g, j) in enumerate(self._layers)}
        self._groups = {g.index: g for g in layout.groups}
        self._objects = {g.index: ObjectLayout(tuple(layout.slices(g)),
                                               sum(size for _, size in layout.slices(g)))
                         for g in layout.groups}
        # The host path's blocks as addresses (memmove copies; `HostBlocks`).
        self._host_blocks = {} if self.device is not None else {
            name: host_blocks(kv_caches[name])
            for g in layout.groups for name in g.layer_names if name in kv_caches}
        self._ring = StagingRing(store, staging_bytes, timeout_s=load_timeout_s,
                                 alloc=None if self.device is None else self.device.pinned)
        # Saves of held blocks (host path) stage through a ring of their own,
        # one job at a time (`_save_turn`): a long offload never takes the
        # staging a restore waits for. Four times the staging: its chunks (half
        # of it) are puts of 128 MiB, which moved 8192 tokens at block 16 at
        # 0.77-0.83 of a raw put against 0.65-0.66 with the staging's size.
        self._save_ring = StagingRing(store, SAVE_RING_FACTOR * staging_bytes,
                                      timeout_s=self.save_wait_s) \
            if self.device is None else None
        self._save_turn = asyncio.Lock()
        self._cache_registered: list[int] | None = None  # in-place saves: the cache's spans
        # Restores read straight into vLLM's host blocks where they are large
        # enough (`InPlaceRestores._reads_in_place`); off after a failed registration.
        self._in_place_restores = in_place_restores and self.device is None
        self.read_end_s = read_end_s
        self._reading: set[int] = set()  # id() of in-place loads with reads in flight
        self._register_lock = threading.Lock()  # held across the registration's store calls
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._sync: list[_Load] = []  # this step's synchronous loads
        self._step_failed = False  # a synchronous load of this step failed
        self._step_loaded: set[tuple[int, int]] = set()  # (group, block) this step's loads fill
        # Objects that failed their check: removed before the next put of
        # the key (a put never overwrites; a fresh read lease may keep the
        # object through an immediate remove).
        self._corrupt: set[str] = set()
        self._report = WorkerReport()  # for the scheduler, drained by `report`
        self._pages: dict[str, tuple[int, bytes]] = {}  # key -> (group, page hash)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="layerlift-vllm",
                                        daemon=True)
        self._thread.start()
        # The lane's threads are the store calls in flight: up to four (a
        # per-layer restore of 8192 tokens at block 128 ran at 0.59-0.62 of
        # the raw ranged read at depth 4 with two, 0.67-0.71 with four).
        self._lane = CpuLane(max(1, min(max_in_flight, 4)), name="vllm")
        self._sched = LoadScheduler(self._lane, LoadPolicy.OVERLAP, max_in_flight=max_in_flight)
        # One unit of every layer, run in order by one lane call: an
        # asynchronous restore, read by `StagedLoad.fetch_all` (`LoadSide._schedule`).
        self._streamed = LoadScheduler(self._lane, LoadPolicy.OVERLAP,
                                       max_in_flight=max_in_flight,
                                       stream_size=max(1, len(self._layers)))
        self._tasks: set[Future[None]] = set()
        # vLLM calls save() under torch.inference_mode: staging made there
        # would be an inference tensor that the lane's threads cannot write.
        with torch.inference_mode(False):
            self._ring.open()  # the save ring opens at its first use, on a worker thread

    # ---- shared by both sides ----------------------------------------------------

    def keyed(self, items: Sequence[Item]) -> list[KeyedItem]:
        """``items`` with this worker's keys (its rank's shard)."""
        groups = self._groups
        return [(g, self.schema.key(groups[g].component, h), b) for g, h, b in items]

    @property
    def staging(self) -> StagingRing:
        """The worker's staging ring (every transfer's bytes pass through it)."""
        return self._ring

    def report(self) -> WorkerReport | None:
        """Objects found corrupt and objects replaced since the last call
        (for the scheduler: it leaves corrupt ones out of lookups until every
        rank replaced them); None when there is nothing to say."""
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return out or None

    def begin_step(self) -> None:
        """A new step starts (vLLM's ``start_load_kv``, called every step)."""
        self._sync = []
        self._step_loaded.clear()
        self._step_failed = False

    def step_failed(self) -> bool:
        """Whether a synchronous load of this step failed or has not landed
        verified (then nothing this step computed may be offloaded)."""
        return self._step_failed or any(
            load.bad or not load.readiness.all_done() for load in self._sync)

    def _remember(self, items: Sequence[Item], keyed: Sequence[KeyedItem],
                  only_corrupt: bool = False) -> None:
        """Map keys back to pages for `report` (loads: every key, dropped when
        the load ends; saves: keys marked corrupt only)."""
        with self._lock:
            for (g, h, _), (_, key, _) in zip(items, keyed, strict=True):
                if not only_corrupt or key in self._corrupt:
                    self._pages[key] = (g, h)

    def _forget(self, load: _Load) -> None:
        """A load ended: keep the page of its keys that were found corrupt only."""
        with self._lock:
            for _, key, _ in load.items:
                if key not in self._corrupt:
                    self._pages.pop(key, None)

    def _register_cache(self) -> None:
        """Worker thread: register vLLM's host cache with the store, once
        (each layer's span of blocks; spans that touch are registered as
        one), for in-place saves and restores. Under a lock of its own:
        vLLM's thread never waits for this store call."""
        with self._register_lock:
            if self._cache_registered is not None:
                return
            self._cache_registered = register_spans(
                self.store, ((h.base, h.base + (h.count - 1) * h.stride + h.nbytes)
                             for h in self._host_blocks.values() if h is not None))

    # ---- on the loop ----------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._tasks.add(fut)
        fut.add_done_callback(self._finished)

    def _finished(self, fut: Future[None]) -> None:
        self._tasks.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("LayerLift: a transfer task failed", exc_info=fut.exception())


def _load_order(layer: tuple[GroupLayout, int]) -> tuple[int, int, int, int]:
    """Recurrent groups first, then the model's layer order (the first number
    in vLLM's layer name, e.g. ``model.layers.3.self_attn.attn``)."""
    group, j = layer
    match = re.search(r"\d+", group.layer_names[j])
    return (0 if group.kind is GroupKind.MAMBA else 1, int(match.group()) if match else j,
            group.index, j)


def device_for(kv_caches: dict[str, torch.Tensor]) -> Device | None:
    """The device of vLLM's caches: None for host tensors (the host path),
    a `CudaDevice` for CUDA ones; ValueError for caches on several devices or
    another kind of device."""
    devices = {t.device for t in kv_caches.values()}
    if len(devices) > 1:
        raise ValueError(f"LayerLift: vLLM's KV caches lie on several devices "
                         f"({sorted(map(str, devices))}); one worker restores into one.")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return CudaDevice(device)
    raise ValueError(f"LayerLift restores into CPU or CUDA KV caches, not {device.type} "
                     f"({device}).")
