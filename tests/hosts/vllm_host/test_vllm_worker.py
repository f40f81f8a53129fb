"""The connector's worker side (`BlockWorker`) on a real Mooncake master, without
a vLLM process: blocks offloaded by one worker are restored by another; a
layer held at a gate, a corrupt object or a refused load is reported, and
nothing writes into the blocks once it was (the held read is released after
the report and must change no byte); nothing computed in a step whose
synchronous load failed is offloaded; each TP rank has its own objects; a
corrupt object is replaced under `layerlift master`'s 5 s read lease. Every
restore test runs with both schedules of an asynchronous restore: all
layers in one store call on one lane call (`StagedLoad.fetch_all`, for a
restore within one staging chunk) and one job a layer (the schedule of
larger and of synchronous restores, forced here)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch
from vllm_instances import corrupt_object

from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.staged import StagedLoad
from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.overlap.base import LayerJob

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BLOCK = 4096  # bytes of one block of one layer
LAYERS = ("l0", "l1")
HASHES = [bytes([i]) * 16 for i in range(4)]  # page hashes 0..3
class HeldStore(ForwardingStore):
    """Forwards to ``inner``, counting the ranged reads (``reads``); a ranged
    read of the bytes at ``held_offset`` (a slice alone, among other layers'
    slices, or in a whole object) reads, then waits for ``release`` before it
    returns (``started`` set when it waits, ``returned`` once released): a
    layer whose bytes come late. Without ``held_offset`` nothing is held."""

    def __init__(self, inner: Store, held_offset: int | None = None) -> None:
        super().__init__(inner)
        self.held_offset = held_offset
        self.release, self.started, self.returned = (threading.Event(), threading.Event(),
                                                     threading.Event())
        self.error: BaseException | None = None
        self.reads = 0

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.reads += 1
        at = self.held_offset
        held = at is not None and any(
            o <= at < o + n for offs, lens in zip(src_offsets, sizes, strict=True)
            for o, n in zip(offs, lens, strict=True))
        if not held:
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
            return
        try:  # read at once (the master's read lease is short), return late
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.started.set()
            assert self.release.wait(30), "the test never released the held read"
            self.returned.set()


STAGING = {"merged": 1 << 20, "per-layer": 1 << 20, "chunks": 32 << 10}
"""The worker's staging by schedule: ``chunks`` cuts the restore below into
chunks of one block-row (8 KiB at depth 4), so ``fetch_all`` reads several
chunks at once (`StagedLoad._fetch_merged`)."""


@pytest.fixture(params=list(STAGING))
def schedule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test under every schedule of an asynchronous restore
    (`LoadSide._schedule`): one call (``merged``), a job a layer
    (``per-layer``: `fetches_all` off) and several chunks read at once by
    one lane call (``chunks``: a small staging, ``_worker``)."""
    if request.param == "per-layer":
        monkeypatch.setattr(StagedLoad, "fetches_all", lambda self: False)
    monkeypatch.setitem(_STAGING_NOW, "bytes", STAGING[request.param])
    return str(request.param)


_STAGING_NOW = {"bytes": 1 << 20}  # the staging `_worker` gives, set by `schedule`


@pytest.fixture
def store(mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    s = MooncakeStore(mooncake_master.config(global_segment_size=64 << 20,
                                             local_buffer_size=16 << 20, timeout_s=5.0))
    try:
        yield s
    finally:
        s.close()


def _layout(rank: int = 0, tp_size: int = 1) -> Layout:
    group = GroupLayout(0, GroupKind.FULL, LAYERS)
    return Layout((group,), 16, dict.fromkeys(LAYERS, BLOCK), "unit", "float32", rank, tp_size)


def _kv(fill: bool, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(8, BLOCK // 4, generator=gen) if fill else torch.zeros(8, BLOCK // 4))
            for n in LAYERS}


def _worker(store: Store, kv: dict[str, torch.Tensor], ns: str, timeout_s: float = 10.0,
            layout: Layout | None = None) -> BlockWorker:
    layout = layout or _layout()
    return BlockWorker(store, layout, kv, schema=layout.schema(ns),
                       staging_bytes=_STAGING_NOW["bytes"], max_in_flight=2,
                       load_timeout_s=timeout_s)


def _key(ns: str, page: int, layout: Layout | None = None) -> str:
    return (layout or _layout()).schema(ns).key("full0", HASHES[page])


def _offload(store: MooncakeStore, ns: str, seed: int = 3,
             layout: Layout | None = None) -> dict[str, torch.Tensor]:
    """Blocks 1 and 2 of a filled cache, offloaded as pages 1 and 2."""
    kv = _kv(fill=True, seed=seed)
    source = _worker(store, kv, ns, layout=layout)
    try:
        source.save([SaveSpec("src", [(0, HASHES[1], 1), (0, HASHES[2], 2)])])
    finally:
        source.close()
    assert store.exists([_key(ns, 1, layout), _key(ns, 2, layout)]) == [True, True]
    return kv


def _spec(sync: bool) -> LoadSpec:
    return LoadSpec("r", [(0, HASHES[1], 5), (0, HASHES[2], 6)], sync=sync)


def _restore(store: Store, ns: str, layout: Layout | None = None
             ) -> tuple[tuple[set[str], set[str]], dict[str, torch.Tensor]]:
    """A fresh worker's asynchronous restore of pages 1 and 2 into blocks 5, 6."""
    kv = _kv(fill=False)
    worker = _worker(store, kv, ns, layout=layout)
    try:
        worker.start_loads([_spec(sync=False)])
        return worker.results(wait_s=30), kv
    finally:
        worker.close()


def test_a_restore_takes_the_schedule_its_size_calls_for(
        store: MooncakeStore, mooncake_namespace: str, schedule: str) -> None:
    """Two layers of 4 KiB a block, restored asynchronously: within one
    staging chunk, so one store call and one lane call for both layers;
    with that path off, a call and a lane call a layer; in chunks of a
    block-row, one lane call reading the four rows' chunks. Every byte
    arrives each way, and a synchronous restore is always a lane call a
    layer (a call a chunk of the layer)."""
    src = _offload(store, mooncake_namespace)
    for sync in (False, True):
        kv = _kv(fill=False)
        calls, reads = _counted_restore(store, mooncake_namespace, kv, sync)
        one_lane_call = schedule != "per-layer" and not sync
        assert calls == ([[0, 1]] if one_lane_call else [[0], [1]])
        if schedule == "chunks":
            assert reads == 4  # a block-row a chunk, either way
        else:
            assert reads == (1 if one_lane_call else 2)
        for name in LAYERS:
            assert torch.equal(kv[name][5], src[name][1])
            assert torch.equal(kv[name][6], src[name][2])


def _counted_restore(store: Store, ns: str, kv: dict[str, torch.Tensor],
                     sync: bool) -> tuple[list[list[int]], int]:
    """A restore of pages 1 and 2 into blocks 5 and 6: the layers of each
    lane call, and the store's ranged reads."""
    counting = HeldStore(store)  # holds nothing: counts the reads
    worker = _worker(counting, kv, ns)
    calls: list[list[int]] = []
    fetch_into = worker._lane.fetch_into

    def counted(jobs: Sequence[LayerJob], *args: object, **kw: object) -> object:
        calls.append([j.layer for j in jobs])
        return fetch_into(jobs, *args, **kw)  # type: ignore[arg-type]

    worker._lane.fetch_into = counted  # type: ignore[method-assign]
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=sync)])
        if sync:
            for name in LAYERS:
                worker.wait_layer(name)
            assert worker.step_errors() == set()
        else:
            assert worker.results(wait_s=30) == ({"r"}, set())
    finally:
        worker.close()
    return calls, counting.reads


@pytest.mark.usefixtures("schedule")
def test_sync_restore_lands_each_layer(store: MooncakeStore, mooncake_namespace: str) -> None:
    src = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    worker = _worker(store, kv, mooncake_namespace)
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        for name in LAYERS:
            worker.wait_layer(name)
            assert torch.equal(kv[name][5], src[name][1]) and torch.equal(kv[name][6], src[name][2])
        assert not worker.step_failed()
        # a block a load of this step filled is never offloaded (restored bytes)
        worker.save([SaveSpec("q", [(0, HASHES[3], 5)])])
        assert worker.step_errors() == set()
    finally:
        worker.close()
    assert store.exists([_key(mooncake_namespace, 3)]) == [False]


@pytest.mark.usefixtures("schedule")
def test_late_layer_is_reported_and_never_written(store: MooncakeStore,
                                                  mooncake_namespace: str) -> None:
    src = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    held = HeldStore(store, held_offset=BLOCK)  # layer l1's slice
    worker = _worker(held, kv, mooncake_namespace, timeout_s=3.0)  # l0 lands well within it
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        worker.wait_layer("l0")
        assert torch.equal(kv["l0"][5], src["l0"][1])
        worker.wait_layer("l1")  # bounded: returns after 3 s, does not raise
        assert held.started.is_set()
        assert worker.step_errors() == {5, 6}
        held.release.set()
        assert held.returned.wait(30) and held.error is None, held.error
    finally:
        held.release.set()
        worker.close()
    assert not kv["l1"][5].any() and not kv["l1"][6].any()  # written nowhere after the report


@pytest.mark.usefixtures("schedule")
def test_async_late_load_fails_then_writes_nothing(store: MooncakeStore,
                                                   mooncake_namespace: str) -> None:
    _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    held = HeldStore(store, held_offset=BLOCK)
    worker = _worker(held, kv, mooncake_namespace, timeout_s=0.5)
    try:
        worker.start_loads([_spec(sync=False)])
        assert worker.results(wait_s=30) == ({"r"}, {"r"})
        held.release.set()
        assert held.returned.wait(30)
    finally:
        held.release.set()
        worker.close()
    assert not kv["l1"][5].any() and not kv["l1"][6].any()


@pytest.mark.usefixtures("schedule")
def test_a_step_whose_sync_load_failed_offloads_nothing(
        store: MooncakeStore, mooncake_master: EmbeddedMaster, mooncake_namespace: str) -> None:
    """vLLM runs the forward over the failed blocks and calls wait_for_save
    before it asks for the errors: neither another request's fresh page nor
    the failed blocks (a prefix-cache sharer's "own" pages, under the corrupt
    object's key) may be put; the corrupt object is never "repaired" with
    unrestored bytes. Also in the deferred order (errors first, then save)."""
    ns = mooncake_namespace
    _offload(store, ns)
    corrupt_object(mooncake_master, _key(ns, 2))
    kv = _kv(fill=False)
    kv["l0"][3].fill_(1.0)  # a fresh page another request computed in this step
    worker = _worker(store, kv, ns)
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        for name in LAYERS:
            worker.wait_layer(name)
        assert worker.step_failed()
        worker.save([SaveSpec("fresh", [(0, HASHES[0], 3)]),
                     SaveSpec("sharer", [(0, HASHES[2], 6)])])
        assert worker.step_errors() == {5, 6}
        worker.begin_step()  # the next step: a refused load, reported before the save
        worker.start_loads([LoadSpec("s", [(0, HASHES[1], 7)], refused=True, sync=True)])
        assert worker.step_errors() == {7}
        worker.save([SaveSpec("fresh", [(0, HASHES[0], 3)])])
    finally:
        worker.close()
    assert store.exists([_key(ns, 0)]) == [False]
    (done, failed), _ = _restore(store, ns)
    assert (done, failed) == ({"r"}, {"r"})  # still the corrupt object: fails its check


@pytest.mark.usefixtures("schedule")
def test_each_tp_rank_offloads_and_restores_its_own_shard(store: MooncakeStore,
                                                          mooncake_namespace: str) -> None:
    """TP = 2: the same plan (page hashes) on two workers of different ranks
    puts two objects; each rank restores its own bytes."""
    ranks = [_layout(r, 2) for r in (0, 1)]
    src = [_offload(store, mooncake_namespace, seed=10 + r, layout=lay)
           for r, lay in enumerate(ranks)]
    assert _key(mooncake_namespace, 1, ranks[0]) != _key(mooncake_namespace, 1, ranks[1])
    for r, lay in enumerate(ranks):
        (done, failed), kv = _restore(store, mooncake_namespace, lay)
        assert (done, failed) == ({"r"}, set())
        assert all(torch.equal(kv[n][5], src[r][n][1]) and torch.equal(kv[n][6], src[r][n][2])
                   for n in LAYERS), f"rank {r} restored another rank's shard"


@pytest.fixture(scope="module")
def lease_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master with `layerlift master`'s 5 s read lease."""
    log = tmp_path_factory.mktemp("lease5") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.mark.usefixtures("schedule")
def test_corrupt_object_is_replaced_under_a_5s_lease(lease_master: EmbeddedMaster,
                                                     mooncake_namespace: str) -> None:
    """The read that finds a corrupt object leases it for 5 s (Mooncake
    refuses remove then); the recompute's offload waits the lease out,
    removes and puts; a new worker then restores the true bytes."""
    ns = mooncake_namespace
    store = MooncakeStore(lease_master.config(global_segment_size=64 << 20,
                                              local_buffer_size=16 << 20, timeout_s=5.0))
    try:
        src = _offload(store, ns)
        corrupt_object(lease_master, _key(ns, 2))
        kv = _kv(fill=False)
        worker = _worker(store, kv, ns)
        try:
            worker.start_loads([_spec(sync=False)])
            assert worker.results(wait_s=30) == ({"r"}, {"r"})
            found = worker.report()  # for the scheduler: leave it out of lookups
            assert found is not None and found.corrupt == {(0, HASHES[2])}
            for name in LAYERS:  # the request is recomputed (here: its true blocks) ...
                kv[name][6].copy_(src[name][2])
            worker.begin_step()
            worker.save([SaveSpec("r", [(0, HASHES[2], 6)])])  # ... and offloaded again
        finally:
            worker.close(timeout_s=60)
        replaced = worker.report()  # every rank's report puts it back into lookups
        assert replaced is not None and replaced.replaced == {(0, 0, HASHES[2])}
        (done, failed), got = _restore(store, ns)
        assert (done, failed) == ({"r"}, set()), "the corrupt object was not replaced"
        assert all(torch.equal(got[n][6], src[n][2]) for n in LAYERS)
    finally:
        store.close()


def test_refused_load_is_reported_without_a_read(store: MooncakeStore,
                                                 mooncake_namespace: str) -> None:
    worker = _worker(store, _kv(fill=False), mooncake_namespace)
    try:
        worker.start_loads([LoadSpec("r", [(0, HASHES[0], 0)], refused=True)])
        # vLLM's get_finished can report successes only: a failure is never one
        assert worker.successes() == set()
        assert worker.results(wait_s=5) == ({"r"}, {"r"})
        worker.begin_step()
        worker.start_loads([LoadSpec("s", [(0, HASHES[0], 0), (0, HASHES[1], 3)], True, True)])
        worker.wait_layer("l0")  # returns at once: the load failed
        assert worker.step_errors() == {3}  # the null block 0 is never reported
    finally:
        worker.close()


def test_a_cluster_without_memory_is_said_at_start_up(
        lease_master: EmbeddedMaster, caplog: pytest.LogCaptureFixture) -> None:
    """The README's `vllm serve` line with just a master (segment_bytes=0):
    nothing can be stored; the worker says so in one line naming the
    store-node command. With a store-node's memory the line is absent."""
    from layerlift.hosts.vllm.connector import warn_if_no_memory

    bare = MooncakeStore(lease_master.config(global_segment_size=0, local_buffer_size=8 << 20))
    try:
        with caplog.at_level("WARNING", logger="vllm.layerlift"):
            assert not warn_if_no_memory(bare, "mooncake://m", "probe-ns/x.l2/")
        lines = [r.getMessage() for r in caplog.records if "has no memory" in r.getMessage()]
        assert len(lines) == 1 and "layerlift store-node --master" in lines[0]
        caplog.clear()
        node = MooncakeStore(lease_master.config(global_segment_size=16 << 20,
                                                 local_buffer_size=8 << 20))
        try:
            with caplog.at_level("WARNING", logger="vllm.layerlift"):
                assert warn_if_no_memory(bare, "mooncake://m", "probe-ns/x.l2/")
            assert not [r for r in caplog.records if "has no memory" in r.getMessage()]
        finally:
            node.close()
    finally:
        bare.close()


def test_a_real_size_prefix_streams_through_the_default_staging(
        lease_master: EmbeddedMaster, mooncake_namespace: str) -> None:
    """A prompt of 8k tokens at a real model's per-token size (32 layers, 8 KV
    heads x 128, bf16: 128 KiB a token, Llama-3-8B's; vLLM's CPU block of 128
    tokens: 16 MiB a page, 1 GiB in all) through the default 64 MiB staging:
    every page is offloaded and restored layer by layer, byte for byte (the
    random bits compared as integers: some are NaN as bf16); the staging
    stays the ring's 64 MiB and all of it returns."""
    from layerlift.engine.config import EngineConfig

    staging = EngineConfig(store="memory").client_buffer_bytes
    assert staging == 64 << 20
    block = 2 * 128 * 8 * 128 * 2  # K and V of 128 tokens, 8 heads of 128, bf16
    names = tuple(f"l{i}" for i in range(32))
    pages = 8192 // 128
    layout = Layout((GroupLayout(0, GroupKind.FULL, names),), 128, dict.fromkeys(names, block),
                    "real", "bfloat16")
    hashes = [i.to_bytes(16, "little") for i in range(1, pages + 1)]
    total = pages * len(names) * block
    assert total == 1 << 30
    store = MooncakeStore(lease_master.config(global_segment_size=total + (160 << 20),
                                              local_buffer_size=16 << 20, timeout_s=30.0))

    def worker(kv: dict[str, torch.Tensor]) -> BlockWorker:
        return BlockWorker(store, layout, kv, schema=layout.schema(mooncake_namespace),
                           staging_bytes=staging, max_in_flight=2, load_timeout_s=60.0)

    try:
        gen = torch.Generator().manual_seed(7)
        src = {n: torch.randint(-(1 << 15), 1 << 15, (pages, block // 2), dtype=torch.int16,
                                generator=gen).view(torch.bfloat16) for n in names}
        source = worker(src)
        try:
            source.begin_step()
            source.save([SaveSpec("long", [(0, h, p) for p, h in enumerate(hashes)])])
        finally:
            source.close(timeout_s=120)
        keys = [layout.schema(mooncake_namespace).key("full0", h) for h in hashes]
        assert all(store.exists(keys)), "not every page was offloaded"
        dst = {n: torch.zeros(pages, block // 2, dtype=torch.bfloat16) for n in names}
        target = worker(dst)
        try:
            target.begin_step()
            target.start_loads([LoadSpec("long", [(0, h, p) for p, h in enumerate(hashes)],
                                         sync=True)])
            for name in names:
                target.wait_layer(name)
            assert target.step_errors() == set()
            ring = target.staging
            assert ring.capacity == staging
        finally:
            target.close(timeout_s=120)
        assert ring.free_bytes == staging  # every region came back
        assert all(torch.equal(dst[n].view(torch.int16), src[n].view(torch.int16))
                   for n in names)
    finally:
        store.close()
