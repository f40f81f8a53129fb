"""The device copy plan of a batch's per-layer jobs (``LayerJob.h2d``), checked
on CPU tensors: staging row ``i`` of a layer's fetch goes to the ``i``-th page
of the layer's items, also after COMMIT trimmed duplicates and ``refresh``
rebuilt the jobs (issue 16, finding 3: a stale plan scattered rows onto the
wrong pages)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from crc32c import crc32c

from layerlift import Component, ModelSpec
from layerlift.engine.loads import BatchLoad
from layerlift.linker.integrity import component_slices, slice_seed
from layerlift.linker.memory_store import MemoryStore
from layerlift.pools import UnifiedKVPool
from layerlift.testing.simdevice import SimDevice


class PatternStore(MemoryStore):
    """Ranged reads of FULL objects write a byte pattern of the key's number
    (``.../k7`` -> 7) as the slice, and its checksum where the footer entry is
    read beside it (``linker/integrity.py``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.offsets = [o for o, _ in component_slices(spec, Component.FULL)]

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        for key, ptrs, lens, offs in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
            row = bytes([int(key.rsplit("k", 1)[1])]) * lens[0]
            ctypes.memmove(ptrs[0], row, lens[0])
            if len(ptrs) > 1:  # the slice's checksum entry
                seed = slice_seed(key, self.offsets.index(offs[0]))
                ctypes.memmove(ptrs[1], crc32c(row, seed).to_bytes(4, "little"), 4)


def test_refresh_rebuilds_the_copy_plan_after_commit_trims_duplicates() -> None:
    spec = ModelSpec.preset("tiny")
    pool = UnifiedKVPool(spec, 8 << 20)
    sim = SimDevice(seed=0)
    try:
        sim.attach_pool(pool)
        pages = pool.alloc(Component.FULL, 4)
        assert pages is not None
        idx = pages.tolist()
        store = PatternStore(spec)
        load = BatchLoad(pool, store, None, sim.pinned)
        for n, page in enumerate(idx):
            load.items[Component.FULL].add([f"ns/full/k{n + 1}"], [page], n)
        jobs = load.jobs()
        layer = spec.layers_of(Component.FULL)[1]
        _, _, offset, size = spec.layer_slice(layer)
        job = jobs[layer]
        assert job.h2d is not None
        assert job.h2d[0][1].indices.tolist() == idx

        # COMMIT: the tree already held pages 0 and 2 (duplicates, never loaded)
        load.items[Component.FULL].drop_indices({idx[0], idx[2]})
        load.refresh(jobs)
        assert job.requests == frozenset({1, 3})
        assert job.nbytes == 2 * size
        assert job.h2d is not None and len(job.h2d) == 1
        host, scatter = job.h2d[0]
        assert scatter.indices.tolist() == [idx[1], idx[3]]
        assert host.numel() == 2 * size

        job.fetch()  # rows: key 2 then key 4
        for src, dst in job.h2d:
            dst.copy_(src)
        for n, page in enumerate(idx):
            got = pool.page_view(Component.FULL, page)[offset : offset + size]
            want = n + 1 if n in (1, 3) else 0  # the duplicates' slots are left alone
            assert torch.equal(got, torch.full_like(got, want)), f"page {n}"
    finally:
        load.close_staging()
        sim.close()


def test_a_layer_with_nothing_left_has_no_copy_plan() -> None:
    spec = ModelSpec.preset("tiny")
    pool = UnifiedKVPool(spec, 8 << 20)
    sim = SimDevice(seed=0)
    try:
        sim.attach_pool(pool)
        page = pool.alloc(Component.FULL, 1)
        assert page is not None
        load = BatchLoad(pool, PatternStore(spec), None, sim.pinned)
        load.items[Component.FULL].add(["ns/full/k1"], page.tolist(), 0)
        jobs = load.jobs()
        full = spec.layers_of(Component.FULL)
        assert all(jobs[layer].h2d for layer in full)
        load.items[Component.FULL].drop_indices(set(page.tolist()))
        load.refresh(jobs)
        assert all(jobs[layer].h2d is None and jobs[layer].nbytes == 0 for layer in full)
    finally:
        load.close_staging()
        sim.close()
