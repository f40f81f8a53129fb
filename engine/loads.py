"""Per-layer fetch jobs for one batch: one store call per layer, all requests together.

A restore of a batch loads, for every component, a list of *items*: (store
key, device page/slot, owning request). Layer ``l`` of kind ``c`` needs slice
``l`` of every item of ``c``: that is one ranged ``get_ranges`` call, whatever
the number of requests. COMMIT may trim the lists (it drops duplicates) and
then ``refresh`` rebuilds the jobs; a job the scheduler already issued keeps
the snapshot the lane took at issue time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from layerlift.linker.ring import ring_for
from layerlift.linker.staged import LoadPart, LoadSegment, ObjectLayout, StagedLoad
from layerlift.linker.store_base import Store, StoreTimeout
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import Device, device_of
from layerlift.overlap.link import EmulatedLink
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component

__all__ = ["BatchLoad", "LoadItems", "PageScatter"]


@dataclass(slots=True)
class LoadItems:
    """The objects of one component that a batch loads."""

    keys: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    owners: list[Hashable] = field(default_factory=list)
    version: int = 0  # bumped by every change (a plan built over older items is stale)

    def add(self, keys: list[str], indices: list[int], owner: Hashable) -> None:
        self.version += 1
        self.keys.extend(keys)
        self.indices.extend(indices)
        self.owners.extend([owner] * len(keys))

    def drop_indices(self, dropped: set[int]) -> None:
        """Remove items whose device index is in ``dropped`` (duplicates)."""
        self.version += 1
        keep = [i for i, idx in enumerate(self.indices) if idx not in dropped]
        self.keys = [self.keys[i] for i in keep]
        self.indices = [self.indices[i] for i in keep]
        self.owners = [self.owners[i] for i in keep]

    def drop_owners(self, owners: frozenset[Hashable]) -> None:
        """Remove the items of requests in ``owners`` (restores dropped
        before their jobs were issued)."""
        self.version += 1
        keep = [i for i, o in enumerate(self.owners) if o not in owners]
        self.keys = [self.keys[i] for i in keep]
        self.indices = [self.indices[i] for i in keep]
        self.owners = [self.owners[i] for i in keep]

    def __len__(self) -> int:
        return len(self.keys)


class BatchLoad:
    """Builds the :class:`LayerJob` of every layer of one batch's restore.

    ``items`` is shared with the engine's COMMIT, which trims it and calls
    ``refresh``; each job's fetch closes over immutable copies of its layer's
    keys and addresses, so a worker never sees a list change under it.
    """

    def __init__(self, pool: KVPool, store: Store, link: EmulatedLink | None,
                 staging_alloc: Callable[[int], torch.Tensor] | None = None,
                 *, whole: bool = False, verify: bool = True) -> None:
        self.whole = whole
        self.verify = verify  # check every slice against its footer CRC
        self.pool = pool
        self.store = store
        self.link = link
        self.items: dict[Component, LoadItems] = {c: LoadItems() for c in Component}
        self._staging_alloc = staging_alloc
        self._staging: torch.Tensor | None = None
        self._staging_ptr = 0
        self._layer_offsets: list[int] = []
        # Reads go through the staged transfer in place (``StagedLoad`` with a
        # placement: the slices, or a whole read's pages, straight into the
        # pool pages or the pinned staging, verified there; their checksums
        # through the store's staging ring, ``ring_for``; each object's
        # footers read once, with its component's first layer).
        # The staged load over the items as they are (their versions): a job
        # built after COMMIT trimmed them gets a new one, keeping the footers
        # the old one verified; jobs issued before keep the old one.
        self._staged: StagedLoad | None = None
        self._staged_versions: tuple[int, ...] = ()
        # Timed-out reads that still run (see ``_hold``): their pool pages
        # stay pinned and the buffers above stay alive until they ended.
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside the loop (tests): a fetch waits instead
            self._loop = None
        self._hold_lock = threading.Lock()
        self._held = 0
        self._close_pending = False

    @property
    def device(self) -> Device | None:
        """The device the pool lives on (``overlap.device``); None on the CPU."""
        return device_of(self.pool.buffer)

    @property
    def on_device(self) -> bool:
        """The pool is device memory: fetches land in pinned host staging and
        an H2D copy on the load stream scatters them into the pages."""
        return self.device is not None

    def open_staging(self) -> None:
        """CUDA: one pinned host arena for the whole batch (one region per
        layer, sized before COMMIT trims), registered with the store once."""
        if not self.on_device or self._staging is not None:
            return
        if self._staging_alloc is None:
            raise ValueError("a device pool needs a staging allocator (the CUDA lane's)")
        spec, offsets, total = self.pool.spec, [], 0
        for layer in range(spec.num_layers):
            component, _, _, size = spec.layer_slice(layer)
            offsets.append(total)
            total += size * len(self.items[component])
        self._layer_offsets = offsets
        self._staging = self._staging_alloc(max(total, 1))
        self._staging_ptr = self.store.register(self._staging)

    def close_staging(self) -> None:
        """Unregister the staging arena and the checksum buffer (call once no
        fetch runs). A read that timed out and still runs may write into
        them: then they are released when the last such read ended."""
        with self._hold_lock:
            if self._held:
                self._close_pending = True
                return
        self._close_now()

    def _close_now(self) -> None:
        if self._staging is not None:
            self.store.unregister(self._staging_ptr)
            self._staging = None

    @property
    def keys(self) -> list[str]:
        return [k for items in self.items.values() for k in items.keys]

    def jobs(self) -> list[LayerJob]:
        """One job per layer (a layer with nothing to load gets a no-op job);
        with ``whole``, one job at layer 0 that reads every object whole."""
        if self.whole:
            return [self._whole_job()]
        return [self._job(layer) for layer in range(self.pool.spec.num_layers)]

    def _whole_job(self) -> LayerJob:
        """The best whole-batch restore (the barrier's): the batch's one
        in-place `StagedLoad` reads every page object whole in one ranged
        call, its page straight into the pool page (on a device into the
        pinned staging, scattered by the lane's H2D copy), its footer beside
        it, and verifies every slice there. Layer 0 carries it, so a failure
        fails every layer."""
        spec = self.pool.spec
        comps = [c for c in Component if len(self.items[c]) and spec.layers_of(c)]
        if not comps:
            return LayerJob(layer=0, fetch=_noop)
        if self.on_device and self._staging is None:
            self._open_whole_staging(comps)
        staged = self._staged_load()
        h2d: list[tuple[torch.Tensor, PageScatter]] = []
        if self.on_device:
            assert self._staging is not None
            for part in staged.parts:
                c, indices, at = part.target
                pb, n = self.pool.page_bytes(c), len(part.keys)
                h2d.append((self._staging[at : at + n * pb],
                            PageScatter(self.pool.buffer, pb, 0, pb, indices.tolist(),
                                        self.device)))

        def fetch() -> None:
            staged.fetch_whole()

        nbytes = sum(len(p.keys) * p.layout.page_bytes for p in staged.parts)
        wrapped = self.link.wrap(fetch, nbytes) if self.link is not None else fetch
        owners = frozenset(o for c in comps for o in self.items[c].owners)
        return LayerJob(layer=0, fetch=wrapped, nbytes=nbytes, requests=owners,
                        h2d=h2d or None)

    def _open_whole_staging(self, comps: list[Component]) -> None:
        if self._staging_alloc is None:
            raise ValueError("a device pool needs a staging allocator (the CUDA lane's)")
        total = sum(len(self.items[c]) * self.pool.page_bytes(c) for c in comps)
        self._staging = self._staging_alloc(max(total, 1))
        self._staging_ptr = self.store.register(self._staging)

    def _staged_load(self) -> StagedLoad:
        """The per-layer reads of the current items as one in-place
        `StagedLoad`: one part per component (row ``i``: its ``i``-th item),
        layer ``l`` reading slice ``local`` of its component's part. Rebuilt
        after COMMIT trimmed the items, keeping the footers verified so far."""
        versions = tuple(self.items[c].version for c in Component)
        previous = self._staged
        if previous is not None and versions == self._staged_versions:
            return previous
        spec = self.pool.spec
        parts: list[LoadPart] = []
        part_of: dict[Component, int] = {}
        whole_at = 0  # a whole read on a device: where the part's pages start in the staging
        for c in Component:
            items = self.items[c]
            if len(items) and spec.layers_of(c):  # a component without layers reads nothing
                part_of[c] = len(parts)
                parts.append(LoadPart(ObjectLayout.of(spec, c), tuple(items.keys),
                                      (c, np.asarray(items.indices, dtype=np.int64), whole_at)))
                whole_at += len(items) * self.pool.page_bytes(c)
        layers = []
        for layer in range(spec.num_layers):
            component, local, _, _ = spec.layer_slice(layer)
            layers.append([(part_of[component], local)] if component in part_of else [])
        staged = StagedLoad(ring_for(self.store), self.store, parts, layers, None,
                            placement=_Placement(self), verify=self.verify)
        if previous is not None:
            staged.adopt_footers(previous)
        self._staged, self._staged_versions = staged, versions
        return staged

    def _job(self, layer: int) -> LayerJob:
        component, _, offset, size = self.pool.spec.layer_slice(layer)
        items = self.items[component]
        n = len(items)
        if not n:
            return LayerJob(layer=layer, fetch=_noop)
        h2d = None
        if self.on_device:
            self.open_staging()
            assert self._staging is not None
            start = self._layer_offsets[layer]
            h2d = [(self._staging[start : start + n * size],
                    PageScatter(self.pool.buffer, self.pool.page_bytes(component),
                                offset, size, items.indices, self.device))]
        staged = self._staged_load()

        def fetch() -> None:
            """Slice ``layer`` of every object, verified where it landed
            (``CorruptSlices``, a StoreIntegrityError); a timed-out read's
            pages are taken over by the placement (``_hold``)."""
            staged.fetch_layer(layer)

        nbytes = size * n
        wrapped = self.link.wrap(fetch, nbytes) if self.link is not None else fetch
        return LayerJob(layer=layer, fetch=wrapped, nbytes=nbytes,
                        requests=frozenset(items.owners), h2d=h2d)

    def refresh(self, jobs: list[LayerJob]) -> None:
        """Rebuild jobs after COMMIT trimmed the items. Jobs already issued
        are unaffected (the lane snapshotted them); the rest load only what
        the tree adopted. The device copy plan (``h2d``) is rebuilt with the
        fetch: staging row ``i`` of the trimmed fetch goes to the ``i``-th
        adopted page, so a stale plan would scatter rows onto wrong pages."""
        for job in jobs:
            fresh = self._whole_job() if self.whole else self._job(job.layer)
            job.fetch, job.nbytes, job.requests = fresh.fetch, fresh.nbytes, fresh.requests
            job.h2d = fresh.h2d


class _Placement:
    """Where a batch's per-layer reads land: the pool pages on the CPU (the
    pool is registered with the store), the layer's rows of the pinned
    per-batch staging on a device (the lane's H2D copy scatters them)."""

    def __init__(self, load: BatchLoad) -> None:
        self.load = load

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return (part.layout.slices[local][1],)  # a slice lands in one run of its page

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        load = self.load
        component, indices, _ = part.target
        _, _, offset, size = load.pool.spec.layer_slice(seg.layer)
        if load.on_device:
            assert load._staging is not None
            start = load._staging_ptr + load._layer_offsets[seg.layer] + seg.lo * size
            return list(range(start, start + seg.rows * size, size))
        base = indices[seg.lo : seg.hi] * load.pool.page_bytes(component)
        addresses: list[int] = (base + (load.pool.buffer.data_ptr() + offset)).tolist()
        return addresses

    def pages(self, part: LoadPart) -> list[int]:
        load = self.load
        component, indices, whole_at = part.target
        pb = load.pool.page_bytes(component)
        if load.on_device:
            assert load._staging is not None
            start = load._staging_ptr + whole_at
            return list(range(start, start + len(part.keys) * pb, pb))
        addresses: list[int] = (indices * pb + load.pool.buffer.data_ptr()).tolist()
        return addresses

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        component, indices, _ = part.target
        pages = [] if self.load.on_device else [(component, indices[lo:hi].tolist())]
        _hold(self.load, exc, pages)


def _noop() -> None:
    return None


def _hold(load: BatchLoad, exc: StoreTimeout, pages: list[tuple[Component, list[int]]]) -> None:
    """Worker thread, inside a fetch that got ``exc``: take over the memory
    the still-running call writes (a timed-out store call goes on). The fetch
    reports its failure at once (the layer recomputes) while the pool pages
    the call writes stay pinned (never moved, freed only deferred) and the
    load's staging and checksum buffers stay alive until the call ended;
    then they are released on the event loop. The pin is queued on the loop before the
    fetch's failure is delivered there, so it runs before anything frees the
    pages. Without a loop (a load driven by hand) the fetch waits instead."""
    future = exc.future
    if future is None:  # cancelled before it started: nothing runs on
        return
    loop = load._loop
    if loop is None:
        exc.wait_finished()
        return
    with load._hold_lock:
        load._held += 1
    try:
        loop.call_soon_threadsafe(_pin_held, load, pages)
    except RuntimeError:  # the loop is gone: nobody frees anything any more
        with load._hold_lock:
            load._held -= 1
        exc.wait_finished()
        return
    exc.owned = True  # the lane need not wait: this load owns the call's memory now

    def ended(_f: object) -> None:
        try:
            loop.call_soon_threadsafe(_release_held, load, pages)
        except RuntimeError:
            return

    future.add_done_callback(ended)


def _pin_held(load: BatchLoad, pages: list[tuple[Component, list[int]]]) -> None:
    for c, idx in pages:
        if idx:
            load.pool.pin(c, torch.tensor(idx, dtype=torch.int64))


def _release_held(load: BatchLoad, pages: list[tuple[Component, list[int]]]) -> None:
    for c, idx in pages:
        if idx:
            load.pool.unpin(c, torch.tensor(idx, dtype=torch.int64))
    load.pool.flush_deferred()
    with load._hold_lock:
        load._held -= 1
        close = load._held == 0 and load._close_pending
    if close:
        load._close_now()


class PageScatter:
    """Device side of one layer's H2D copy: slice ``[offset, offset + size)``
    of every page in ``indices``. The lane calls ``copy_(host)`` on its load
    stream: one H2D copy and one scatter kernel, no host sync. Row ``i`` of
    the host rows goes to page ``indices[i]``."""

    def __init__(self, buffer: torch.Tensor, page_bytes: int, offset: int, size: int,
                 indices: list[int], device: Device | None = None) -> None:
        rows = buffer.numel() // page_bytes
        self.view = buffer.as_strided((rows, size), (page_bytes, 1),
                                      buffer.storage_offset() + offset)
        self.indices = torch.tensor(indices, dtype=torch.int64)
        if device is not None:  # pinned, so the index upload is asynchronous too
            staged = device.pinned(8 * len(indices)).view(torch.int64)
            staged.copy_(self.indices)
            self.indices = staged

    def copy_(self, host: torch.Tensor, non_blocking: bool = True) -> None:
        device = self.view.device
        src = host.view(-1, self.view.shape[1]).to(device, non_blocking=non_blocking)
        idx = self.indices.to(device, non_blocking=non_blocking)
        self.view[idx] = src  # index_put_ on the strided per-layer view
