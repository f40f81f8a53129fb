"""Staged loads as the overlap scheduler's jobs: a layer that times out fails
at once (its staging handed over to the still-running read, so the lane does
not wait for it) and the layers before it are exact."""

from __future__ import annotations

import asyncio

import torch
from crc32c import crc32c

from layerlift.linker.integrity import slice_seed
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import HostSink, LoadPart, LoadSegment, ObjectLayout, StagedLoad
from layerlift.overlap import CpuLane, LayerLoadError, LayerReadiness, LoadPolicy, LoadScheduler

LAYOUT = ObjectLayout(((0, 400), (400, 400), (800, 400)), 1200)


def put(store: MemoryStore, keys: list[str], src: torch.Tensor) -> None:
    for key, page in zip(keys, src, strict=True):
        raw = bytes(page.numpy())
        obj = raw + b"".join(crc32c(raw[o : o + n], slice_seed(key, j)).to_bytes(4, "little")
                             for j, (o, n) in enumerate(LAYOUT.slices))
        buf = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
        ptr = store.register(buf)
        store.put([key], [ptr], [len(obj)])
        store.unregister(ptr)


async def test_a_timed_out_layer_fails_at_once_and_its_staging_stays_owned() -> None:
    store = MemoryStore(timeout_s=0.2)
    ring = StagingRing(store, 8 << 10, timeout_s=10.0)
    keys = [f"s/p{i}" for i in range(20)]
    src = torch.randint(0, 256, (20, LAYOUT.page_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    put(store, keys, src)
    dest = torch.zeros_like(src)

    def scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        offset, size = part.layout.slices[seg.local]
        dest[seg.lo : seg.hi, offset : offset + size] = rows

    landed: list[int] = []

    def on_layer(layer: int, event: object) -> None:
        landed.append(layer)
        if layer == 0:
            store.stall()  # the master stops after layer 0

    load = StagedLoad(ring, store, [LoadPart(LAYOUT, tuple(keys))], [[(0, j)] for j in range(3)],
                      HostSink(scatter), on_layer=on_layer)
    lane = CpuLane(2)
    try:
        sched = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=1)
        readiness = LayerReadiness(3, default_timeout=30.0)
        task = sched.start([load.job(j) for j in range(3)], readiness)
        await asyncio.wait_for(task.done(), 30.0)
        # returns although the timed-out read still runs: it owns its staging
        await asyncio.wait_for(task.wait_quiescent(), 10.0)
        assert landed == [0] and readiness.error(1) is not None
        assert isinstance(readiness.error(1), LayerLoadError)
        assert torch.equal(dest[:, :400], src[:, :400])
        assert load.timed_out and all(e.owned for e in load.timed_out)
        assert not load.quiet  # the read that timed out still holds its staging
        store.resume()
        assert load.wait_quiet(30.0) and ring.wait_idle(30.0)
        assert bool((dest[:, 400:] == 0).all()), "a late read reached the destination"
    finally:
        store.resume()
        lane.close()
