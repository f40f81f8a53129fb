"""The per-layer fetch plan of a batch, and the device-side scatter of the CUDA
path (its index arithmetic checked here on CPU tensors)."""

from __future__ import annotations

import numpy as np
import torch

from layerlift import Component, ModelSpec
from layerlift.engine.loads import BatchLoad, PageScatter
from layerlift.linker.integrity import encode_object
from layerlift.linker.memory_store import MemoryStore
from layerlift.pools import UnifiedKVPool


def test_page_scatter_writes_one_layer_slice_of_each_page() -> None:
    spec = ModelSpec.preset("tiny")
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    page = spec.page_bytes(Component.FULL)
    _, _, offset, size = spec.layer_slice(spec.layers_of(Component.FULL)[1])
    pages = [7, 2, 11]
    host = torch.arange(len(pages) * size, dtype=torch.int64).remainder(251).to(torch.uint8)
    PageScatter(buffer, page, offset, size, pages).copy_(host, non_blocking=False)
    for i, p in enumerate(pages):
        got = buffer[p * page + offset : p * page + offset + size]
        assert torch.equal(got, host[i * size : (i + 1) * size])
    touched = sum(int(buffer[p * page : (p + 1) * page].count_nonzero() > 0) for p in pages)
    assert touched == len(pages)
    assert int(buffer.count_nonzero()) <= len(pages) * size  # nothing outside the slices


def test_one_job_per_layer_covers_every_request_and_loads_the_bytes() -> None:
    spec = ModelSpec.preset("tiny")
    pool = UnifiedKVPool(spec, 8 << 20)
    store = MemoryStore()
    store.register(pool.buffer)
    idx = {c: pool.alloc(c, 2) for c in Component}
    objects = {c: [f"ns/fp/{c.value}/0/{c.value}{i}" for i in range(2)] for c in Component}
    src = {c: torch.randint(0, 255, (2, spec.page_bytes(c)), dtype=torch.uint8) for c in Component}
    for c in Component:  # each object is its page plus the checksum footer
        obj = torch.stack([torch.frombuffer(bytearray(encode_object(
            spec, c, r.numpy().tobytes(), k)), dtype=torch.uint8)
            for r, k in zip(src[c], objects[c], strict=True)])
        store.register(obj)
        store.put(objects[c], [int(r.data_ptr()) for r in obj], [obj.shape[1]] * 2)
    load = BatchLoad(pool, store, None)
    for c in Component:  # request 0 owns the first object of each kind, request 1 the second
        for r in range(2):
            load.items[c].add([objects[c][r]], [int(idx[c][r])], r)
    jobs = load.jobs()
    assert [j.layer for j in jobs] == list(range(spec.num_layers))
    assert all(j.requests == frozenset({0, 1}) for j in jobs)
    for job in jobs:
        job.fetch()
    for c in Component:
        for r in range(2):
            assert torch.equal(pool.page_view(c, int(idx[c][r])), src[c][r])
    load.items[Component.FULL].drop_indices({int(idx[Component.FULL][1])})
    load.refresh(jobs)
    full_jobs = [j for j in jobs if spec.kinds[j.layer] is Component.FULL]
    assert all(j.requests == frozenset({0}) for j in full_jobs)
    assert np.all([j.nbytes == spec.layer_bytes(Component.FULL) for j in full_jobs])
