"""The connector's worker side (`BlockWorker`) on a real Mooncake master, without
a vLLM process: blocks offloaded by one worker are restored by another; a
layer held at a gate, a corrupt object or a refused load is reported, and
nothing writes into the blocks once it was (the held read is released after
the report and must change no byte)."""

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
from layerlift.linker.store_base import ForwardingStore, Store

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BLOCK = 4096  # bytes of one block of one layer
LAYERS = ("l0", "l1")


class HeldStore(ForwardingStore):
    """Forwards to ``inner``; the ranged read of slice offset ``held_offset``
    reads, then waits for ``release`` before it returns (``started`` set when
    it waits, ``returned`` once released): a layer whose bytes come late."""

    def __init__(self, inner: Store, held_offset: int | None = None) -> None:
        super().__init__(inner)
        self.held_offset = held_offset
        self.release, self.started, self.returned = (threading.Event(), threading.Event(),
                                                     threading.Event())
        self.error: BaseException | None = None

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        held = src_offsets and src_offsets[0][0] == self.held_offset
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


@pytest.fixture
def store(mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    s = MooncakeStore(mooncake_master.config(global_segment_size=64 << 20,
                                             local_buffer_size=16 << 20, timeout_s=5.0))
    try:
        yield s
    finally:
        s.close()


def _layout() -> Layout:
    group = GroupLayout(0, GroupKind.FULL, LAYERS)
    return Layout((group,), 16, dict.fromkeys(LAYERS, BLOCK), "unit", "float32")


def _kv(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: (torch.randn(8, BLOCK // 4, generator=gen) if fill else torch.zeros(8, BLOCK // 4))
            for n in LAYERS}


def _worker(store: Store, kv: dict[str, torch.Tensor], timeout_s: float = 10.0) -> BlockWorker:
    return BlockWorker(store, _layout(), kv, staging_bytes=1 << 20, max_in_flight=2,
                       load_timeout_s=timeout_s)


def _offload(store: MooncakeStore, ns: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Blocks 1 and 2 of a filled cache, offloaded under two keys."""
    kv = _kv(fill=True)
    keys = [f"{ns}/unit.l2/full0/0/{i:032x}" for i in (1, 2)]
    source = _worker(store, kv)
    try:
        source.save([SaveSpec("src", [(0, keys[0], 1), (0, keys[1], 2)])])
    finally:
        source.close()
    assert store.exists(keys) == [True, True]
    return kv, keys


def _spec(keys: list[str], sync: bool) -> LoadSpec:
    return LoadSpec("r", [(0, keys[0], 5), (0, keys[1], 6)], sync=sync)


def test_sync_restore_lands_each_layer(store: MooncakeStore, mooncake_namespace: str) -> None:
    src, keys = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    worker = _worker(store, kv)
    try:
        worker.start_loads([_spec(keys, sync=True)])
        for name in LAYERS:
            worker.wait_layer(name)
            assert torch.equal(kv[name][5], src[name][1]) and torch.equal(kv[name][6], src[name][2])
        assert worker.step_errors() == set()
    finally:
        worker.close()


def test_late_layer_is_reported_and_never_written(store: MooncakeStore,
                                                  mooncake_namespace: str) -> None:
    src, keys = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    held = HeldStore(store, held_offset=BLOCK)  # layer l1's slice
    worker = _worker(held, kv, timeout_s=3.0)  # the bound; l0 must land well within it
    try:
        worker.start_loads([_spec(keys, sync=True)])
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


def test_async_late_load_fails_then_writes_nothing(store: MooncakeStore,
                                                   mooncake_namespace: str) -> None:
    _, keys = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    held = HeldStore(store, held_offset=BLOCK)
    worker = _worker(held, kv, timeout_s=0.5)
    try:
        worker.start_loads([_spec(keys, sync=False)])
        assert worker.results(wait_s=30) == ({"r"}, {"r"})
        held.release.set()
        assert held.returned.wait(30)
    finally:
        held.release.set()
        worker.close()
    assert not kv["l1"][5].any() and not kv["l1"][6].any()


def test_corrupt_object_fails_then_the_next_offload_replaces_it(
        store: MooncakeStore, mooncake_master: EmbeddedMaster, mooncake_namespace: str) -> None:
    src, keys = _offload(store, mooncake_namespace)
    kv = _kv(fill=False)
    worker = _worker(store, kv)
    try:
        worker.start_loads([_spec(keys, sync=False)])
        assert worker.results(wait_s=30) == ({"r"}, set())
        assert all(torch.equal(kv[n][5], src[n][1]) for n in LAYERS)
        corrupt_object(mooncake_master, keys[1])
        kv["l0"][6].zero_()
        worker.start_loads([_spec(keys, sync=False)])
        assert worker.results(wait_s=30) == ({"r"}, {"r"})
        # the request is recomputed (here: its true blocks put back) and offloaded again
        for name in LAYERS:
            kv[name][6].copy_(src[name][2])
        worker.save([SaveSpec("r", [(0, keys[1], 6)])])
    finally:
        worker.close()
    fresh = _kv(fill=False)
    again = _worker(store, fresh)
    try:
        again.start_loads([_spec(keys, sync=False)])
        assert again.results(wait_s=30) == ({"r"}, set())
        assert all(torch.equal(fresh[n][6], src[n][2]) for n in LAYERS)
    finally:
        again.close()


def test_refused_load_is_reported_without_a_read(store: MooncakeStore) -> None:
    worker = _worker(store, _kv(fill=False))
    try:
        worker.start_loads([LoadSpec("r", [(0, "x/unit.l2/full0/0/00", 0)], refused=True)])
        assert worker.results(wait_s=5) == ({"r"}, {"r"})
        worker.start_loads([LoadSpec("s", [(0, "x/unit.l2/full0/0/00", 0),
                                           (0, "x/unit.l2/full0/0/01", 3)], True, True)])
        worker.wait_layer("l0")  # returns at once: the load failed
        assert worker.step_errors() == {3}  # the null block 0 is never reported
    finally:
        worker.close()
