"""Asynchronous restores on the host path read straight into vLLM's blocks
(`LOAD_IN_PLACE_BYTES` and `LOAD_CALL_ROWS` lowered here): no staging, no
copy, each slice verified where it landed.

What may never happen: vLLM hears of a restore (done or failed) while a
read may still write its blocks (a failed restore's blocks are recomputed
or, the request aborted, freed and reused: a late read would write into
them), a layer reported landed before its last call verified, bytes that
failed their check taken for restored. Each order is forced with events: a
read held while another layer fails, a read that times out and goes on, the
restore's task cancelled while a read runs, a corrupt object, a cache the
store refuses to register (the restore goes through staging), a synchronous
restore (never in place). The round trip runs on a real Mooncake master;
the orders on the in-memory store. No vLLM is imported: they run in the
main suite too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import layerlift.hosts.vllm.worker_load as worker_load
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import (
    ForwardingStore,
    Store,
    StoreIOError,
    StoreTimeout,
)

pytestmark = [pytest.mark.vllm]

ATTN = tuple(f"model.layers.{i}.attn" for i in range(3))
ROW = 4096  # bytes of one block of one layer
BLOCKS = 8
HASHES = [bytes([i]) * 16 for i in range(BLOCKS)]
WAIT_S = 30.0
HELD_S = 0.3  # how long a report must stay away while a read is held (bounded)


@pytest.fixture(autouse=True)
def _small_blocks_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_load, "LOAD_IN_PLACE_BYTES", ROW)
    monkeypatch.setattr(worker_load, "LOAD_CALL_ROWS", 3)  # 5 blocks: calls of 3 and 2


def _layout() -> Layout:
    return Layout((GroupLayout(0, GroupKind.FULL, ATTN),), 16, dict.fromkeys(ATTN, ROW),
                  "inplace", "uint8")


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {n: torch.zeros(BLOCKS, ROW, dtype=torch.uint8) for n in ATTN}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (BLOCKS, ROW), dtype=torch.uint8, generator=gen)
            for n in ATTN}


def _worker(store: Store, kv: dict[str, torch.Tensor], ns: str = "inplace",
            load_timeout_s: float = WAIT_S) -> BlockWorker:
    return BlockWorker(store, _layout(), kv, schema=_layout().schema(ns), staging_bytes=1 << 20,
                       max_in_flight=4, load_timeout_s=load_timeout_s)


def _items(pages: Sequence[int]) -> list[tuple[int, bytes, int]]:
    return [(0, HASHES[p], p) for p in pages]


def _saved(store: Store, ns: str = "inplace", seed: int = 21) -> dict[str, torch.Tensor]:
    """Blocks 0..4 saved (held, as the connector runs) from a cache of ``seed``."""
    kv = _kv(seed)
    worker = _worker(store, kv, ns)
    try:
        worker.begin_step()
        worker.save([SaveSpec("w", _items(range(5)), job=1)])
        assert worker.wait_saved({1}, WAIT_S) and worker.settle(WAIT_S)
    finally:
        worker.close()
    return kv


def _inside(kv: dict[str, torch.Tensor], ptr: int) -> bool:
    return any(t.data_ptr() <= ptr < t.data_ptr() + t.numel() for t in kv.values())


class _Reads(ForwardingStore):
    """Records each ``get_ranges``' destinations; ``hook(n, keys)`` runs
    before the ``n``-th call (from 0) reaches the inner store."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: list[list[int]] = []
        self.hook: Callable[[int, Sequence[str]], None] | None = None
        self._lock = threading.Lock()

    def get_ranges(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]]) -> None:
        with self._lock:
            n = len(self.calls)
            self.calls.append([p[0] for p in ptrs])
        if self.hook is not None:
            self.hook(n, keys)
        self.inner.get_ranges(keys, ptrs, sizes, offsets)


def _restore_async(worker: BlockWorker, req: str = "r") -> None:
    worker.begin_step()
    worker.start_loads([LoadSpec(req, _items(range(5)))])


def test_an_asynchronous_restore_reads_into_the_blocks_exact_on_mooncake(
        mooncake_store: MooncakeStore, mooncake_namespace: str) -> None:
    """Every read lands in vLLM's blocks themselves (no staging), a layer in
    two calls (3 + 2 blocks); the bytes are the saved ones; the cache is
    registered once and unregistered at close."""
    src = _saved(mooncake_store, mooncake_namespace)
    reads = _Reads(mooncake_store)
    kv = _kv(None)
    worker = _worker(reads, kv, mooncake_namespace)
    try:
        _restore_async(worker)
        assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
        assert worker._cache_registered is not None
    finally:
        worker.close()
    assert worker._cache_registered is None
    assert len(reads.calls) == 2 * len(ATTN)
    assert sorted(len(c) for c in reads.calls) == [2] * len(ATTN) + [3] * len(ATTN)
    assert all(_inside(kv, p) for c in reads.calls for p in c)
    assert all(torch.equal(kv[n][:5], src[n][:5]) for n in ATTN)
    assert all(not kv[n][5:].any() for n in ATTN)


def test_a_synchronous_restore_goes_through_staging() -> None:
    """The forward waits layer by layer (it could not wait for a read that
    outlived its bound): never in place, the bytes copied from staging."""
    store = MemoryStore()
    src = _saved(store)
    reads = _Reads(store)
    kv = _kv(None)
    worker = _worker(reads, kv)
    try:
        worker.begin_step()
        worker.start_loads([LoadSpec("r", _items(range(5)), sync=True)])
        for name in ATTN:
            worker.wait_layer(name)
        assert worker.step_errors() == set()
    finally:
        worker.close()
    assert reads.calls and not any(_inside(kv, p) for c in reads.calls for p in c)
    assert all(torch.equal(kv[n][:5], src[n][:5]) for n in ATTN)


def test_a_failed_layer_is_reported_only_once_every_read_in_flight_returned() -> None:
    """One call fails while another is held inside the store, writing vLLM's
    blocks: the restore is not reported (done nor failed) until the held
    call returned; then it is reported failed, once."""
    store = MemoryStore()
    _saved(store)
    reads = _Reads(store)
    held, release = threading.Event(), threading.Event()

    def hook(n: int, keys: Sequence[str]) -> None:
        if n == 0:
            held.set()
            assert release.wait(WAIT_S), "the test never released the held read"
        elif n == 1:
            assert held.wait(WAIT_S)
            raise StoreIOError("injected: a read failed")

    reads.hook = hook
    worker = _worker(reads, _kv(None))
    try:
        _restore_async(worker)
        assert held.wait(WAIT_S)
        assert worker.results(wait_s=HELD_S) == (set(), set())  # bounded: the read still runs
        release.set()
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
        assert worker.settle(WAIT_S)
        assert worker.results() == (set(), set())
    finally:
        release.set()
        worker.close()


def test_a_restore_past_its_bound_is_reported_once_the_read_in_flight_returned() -> None:
    """The restore outlives ``load_timeout_s`` while a read is held in the
    store: it is given up (failed), but reported only once that read
    returned, never while it may still write the blocks."""
    store = MemoryStore()
    _saved(store)
    reads = _Reads(store)
    held, release = threading.Event(), threading.Event()

    def hook(n: int, keys: Sequence[str]) -> None:
        if n == 0:
            held.set()
            assert release.wait(WAIT_S), "the test never released the held read"

    reads.hook = hook
    worker = _worker(reads, _kv(None), load_timeout_s=0.1)
    try:
        _restore_async(worker)
        assert held.wait(WAIT_S)
        assert worker.results(wait_s=HELD_S + 0.2) == (set(), set())  # past the 0.1 s bound
        release.set()
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
    finally:
        release.set()
        worker.close()


class _LateReads(_Reads):
    """The first read times out at once (StoreTimeout with the call's future)
    while the call goes on until ``release``; ``ended`` once it returned."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.release, self.ended = threading.Event(), threading.Event()

    def get_ranges(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]]) -> None:
        with self._lock:
            first = not self.calls
            self.calls.append([p[0] for p in ptrs])
        if not first:
            self.inner.get_ranges(keys, ptrs, sizes, offsets)
            return

        def call() -> None:
            assert self.release.wait(WAIT_S), "the test never released the late read"
            self.inner.get_ranges(keys, ptrs, sizes, offsets)
            self.ended.set()

        pool = ThreadPoolExecutor(1)
        future = pool.submit(call)
        pool.shutdown(wait=False)
        raise StoreTimeout("injected: the read outlived its bound", future)


def test_a_read_that_timed_out_holds_the_report_until_the_call_ended() -> None:
    """The read times out but the call goes on writing the blocks: the
    restore is reported failed only once the call ended."""
    store = MemoryStore()
    _saved(store)
    late = _LateReads(store)
    worker = _worker(late, _kv(None))
    try:
        _restore_async(worker)
        assert worker.results(wait_s=HELD_S) == (set(), set())  # bounded: the call still runs
        assert not late.ended.is_set()
        late.release.set()
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
        assert late.ended.is_set()
        assert worker.settle(WAIT_S)
    finally:
        late.release.set()
        worker.close()


def test_a_restore_cancelled_while_a_read_runs_is_reported_once_the_read_returned() -> None:
    """The restore's task is cancelled (as a loop shutting down cancels it)
    while a read is held: nothing is reported until the read returned; then
    the restore is reported failed."""
    store = MemoryStore()
    _saved(store)
    reads = _Reads(store)
    held, release = threading.Event(), threading.Event()

    def hook(n: int, keys: Sequence[str]) -> None:
        if n == 0:
            held.set()
            assert release.wait(WAIT_S), "the test never released the held read"

    reads.hook = hook
    worker = _worker(reads, _kv(None))
    try:
        _restore_async(worker)
        assert held.wait(WAIT_S)
        (task,) = list(worker._tasks)
        task.cancel()
        assert worker.results(wait_s=HELD_S) == (set(), set())
        release.set()
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
    finally:
        release.set()
        worker.close()


def test_a_corrupt_object_fails_the_restore_and_is_reported_corrupt() -> None:
    """A byte flipped in one stored object: its slice fails its check where
    it landed; the restore is reported failed, the page corrupt, and the
    object removed once the restore's session ended."""
    store = MemoryStore()
    _saved(store)
    probe = _worker(store, _kv(None))
    try:
        key = probe.keyed(_items([3]))[0][1]
    finally:
        probe.close()
    with store._lock:  # one byte of the second layer's slice of block 3, flipped
        spoiled = bytearray(store._objects[key])
        spoiled[ROW + 7] ^= 0xFF
        store._objects[key] = bytes(spoiled)
    worker = _worker(store, _kv(None))
    try:
        _restore_async(worker)
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
        assert worker.settle(WAIT_S)
        report = worker.report()
        assert report is not None and (0, HASHES[3]) in report.corrupt
        assert store.exists([key]) == [False]
    finally:
        worker.close()


class _RefusingRegister(ForwardingStore):
    """``register`` of anything but the worker's staging raises StoreIOError."""

    def __init__(self, inner: Store, kv: dict[str, torch.Tensor]) -> None:
        super().__init__(inner)
        self.kv = kv

    def register(self, buffer: object, nbytes: int | None = None) -> int:
        if isinstance(buffer, int) and _inside(self.kv, buffer):
            raise StoreIOError("injected: the store refused to register the buffer")
        return self.inner.register(buffer, nbytes)  # type: ignore[arg-type]


def test_a_cache_the_store_cannot_register_is_restored_through_staging() -> None:
    store = MemoryStore()
    src = _saved(store)
    kv = _kv(None)
    refusing = _RefusingRegister(store, kv)
    reads = _Reads(refusing)
    worker = _worker(reads, kv)
    try:
        _restore_async(worker)
        assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
        assert worker._cache_registered is None
    finally:
        worker.close()
    assert not any(_inside(kv, p) for c in reads.calls for p in c)
    assert all(torch.equal(kv[n][:5], src[n][:5]) for n in ATTN)
