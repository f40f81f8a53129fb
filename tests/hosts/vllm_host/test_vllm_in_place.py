"""The vLLM worker's in-place restores (`BlockPlacement`): at a real block
size a restore reads each layer's slices straight into vLLM's host blocks
and verifies them there. A read already issued cannot be revoked, so vLLM
hears of a load only once no read of it still writes its blocks: a failed
synchronous wait returns at once while `step_errors` waits for the read, an
asynchronous failure is reported only after the read ended, a store timeout
keeps the blocks until the call itself ended, a read that never ends raises
`BlocksStillWritten` instead of handing the blocks back, and vLLM's cache
stays registered while any read runs. The worker reads synchronous restores
in place (asynchronous ones stay staged, faster there); the asynchronous
cases force an in-place read (`forced`): the rule holds for any load. Every wait is ordered by events (a
held read, a stalled store), never by sleeps; the bounds under test are the
worker's own (``load_timeout_s``, ``read_end_s``). No vLLM is imported:
these run in the main suite too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from layerlift.hosts.vllm import worker_in_place
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.hosts.vllm.worker_held import IN_PLACE_BYTES
from layerlift.hosts.vllm.worker_load import BlocksStillWritten, LoadSide
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import ForwardingStore, Store, StoreUnavailable

pytestmark = [pytest.mark.vllm]

NAMES = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")
ROW = IN_PLACE_BYTES  # the smallest block a layer read in place
BLOCKS = 8
HASHES = [bytes([i]) * 16 for i in range(4)]
STAGING = 1 << 20  # a quarter (a staged call's budget) is below one request's objects


def _layout(row: int = ROW) -> Layout:
    return Layout((GroupLayout(0, GroupKind.FULL, NAMES),), 16, dict.fromkeys(NAMES, row),
                  "inplace", "uint8")


def _kv(seed: int | None, row: int = ROW) -> dict[str, torch.Tensor]:
    if seed is None:
        return {n: torch.zeros(BLOCKS, row, dtype=torch.uint8) for n in NAMES}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (BLOCKS, row), dtype=torch.uint8, generator=gen)
            for n in NAMES}


def _worker(store: Store, kv: dict[str, torch.Tensor], *, timeout_s: float = 10.0,
            row: int = ROW, staging: int = STAGING, **kw: object) -> BlockWorker:
    layout = _layout(row)
    return BlockWorker(store, layout, kv, schema=layout.schema("t"), staging_bytes=staging,
                       max_in_flight=2, load_timeout_s=timeout_s, **kw)  # type: ignore[arg-type]


def _offload(store: Store, row: int = ROW) -> dict[str, torch.Tensor]:
    """Blocks 1 and 2 of a random cache, offloaded as pages 1 and 2."""
    src = _kv(seed=11, row=row)
    saver = _worker(store, src, row=row)
    try:
        saver.save([SaveSpec("src", [(0, HASHES[1], 1), (0, HASHES[2], 2)])])
    finally:
        saver.close()
    return src


def _spec(sync: bool) -> LoadSpec:
    return LoadSpec("r", [(0, HASHES[1], 5), (0, HASHES[2], 3)], sync=sync)


def _no_copy(worker: BlockWorker) -> list[int]:
    """Count the staged path's copies into the blocks (none in place)."""
    copies: list[int] = []
    scatter = worker._scatter

    def counted(*args: object) -> None:
        copies.append(1)
        scatter(*args)  # type: ignore[arg-type]

    worker._scatter = counted  # type: ignore[method-assign]
    return copies


def _restore(worker: BlockWorker, sync: bool) -> tuple[set[int], tuple[set[str], set[str]]]:
    worker.begin_step()
    worker.start_loads([_spec(sync)])
    if not sync:
        return set(), worker.results(wait_s=30)
    for name in NAMES:
        worker.wait_layer(name)
    return worker.step_errors(), (set(), set())


def _exact(kv: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(kv[n][5], src[n][1]) and torch.equal(kv[n][3], src[n][2])
               for n in NAMES)


class HeldReads(ForwardingStore):
    """Forwards to ``inner``; the ranged read of layer ``layer``'s slice
    reads at once, then waits for ``release`` before it returns (``started``
    once it waits): a read in flight the worker cannot revoke."""

    def __init__(self, inner: Store, layer: int) -> None:
        super().__init__(inner)
        self.at = layer * ROW
        self.release, self.started = threading.Event(), threading.Event()
        self.registered: set[int] = set()

    def register(self, buffer: object, nbytes: int | None = None) -> int:
        ptr = self.inner.register(buffer, nbytes)  # type: ignore[arg-type]
        self.registered.add(ptr)
        return ptr

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)
        self.registered.discard(ptr)

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        if any(o == self.at for offs in src_offsets for o in offs):
            self.started.set()
            assert self.release.wait(30), "the test never released the held read"


def _force(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore at a real block size in place, asynchronous ones too."""
    monkeypatch.setattr(LoadSide, "_reads_in_place",
                        lambda self, load: self._in_place_restores)


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch)


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    s = MemoryStore(timeout_s=10.0)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("sync", [True, False], ids=["per-layer", "whole-request-forced"])
def test_a_restore_at_a_real_block_size_reads_in_place_and_is_exact(
        store: MemoryStore, monkeypatch: pytest.MonkeyPatch, sync: bool) -> None:
    """One store call a layer straight into the blocks (5 and 3, out of
    order), no copy out of staging, every byte exact, the staging all back."""
    if not sync:
        _force(monkeypatch)
    src = _offload(store)
    kv = _kv(seed=None)
    worker = _worker(store, kv)
    copies = _no_copy(worker)
    before = sum(1 for c in store.calls if c.method == "get_ranges")
    try:
        errors, reported = _restore(worker, sync)
        assert errors == set() and reported == (({"r"}, set()) if not sync else (set(), set()))
        assert worker.settle(10)
    finally:
        worker.close()
    assert _exact(kv, src) and copies == []
    assert sum(1 for c in store.calls if c.method == "get_ranges") - before == len(NAMES)
    assert worker.staging.free_bytes == STAGING
    assert not kv[NAMES[0]][[0, 1, 2, 4, 6, 7]].any()  # no other block touched


@pytest.mark.parametrize("case", ["small blocks", "many blocks", "asynchronous",
                                  "switched off", "registration fails",
                                  "registration raises"])
def test_restores_that_should_not_read_in_place_go_through_staging(
        store: MemoryStore, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Blocks under `IN_PLACE_BYTES` a layer, more than `IN_PLACE_ROWS`
    blocks, an asynchronous restore, the worker's
    switch off, or a cache the store cannot register: the staged path,
    exact (and, after a failed registration, never in place again)."""
    row = ROW // 4 if case == "small blocks" else ROW
    src = _offload(store, row=row)
    kv = _kv(seed=None, row=row)
    target: Store = store
    kw: dict[str, object] = {}
    if case == "many blocks":
        monkeypatch.setattr(worker_in_place, "IN_PLACE_ROWS", 1)
    if case == "switched off":
        kw["in_place_restores"] = False
    if case.startswith("registration"):
        refusal: Exception = StoreUnavailable("injected: no registration") \
            if case == "registration fails" else ValueError("injected: not a buffer")

        class NoRegister(ForwardingStore):
            """Registers the worker's staging ring (its first), refuses vLLM's cache."""

            ring_done = False

            def register(self, buffer: object, nbytes: int | None = None) -> int:
                if self.ring_done:
                    raise refusal
                self.ring_done = True
                return self.inner.register(buffer, nbytes)  # type: ignore[arg-type]

        target = NoRegister(store)
    worker = _worker(target, kv, row=row, **kw)  # type: ignore[arg-type]
    copies = _no_copy(worker)
    sync = case != "asynchronous"
    try:
        errors, reported = _restore(worker, sync)
        assert errors == set() and reported in ((set(), set()), ({"r"}, set()))
        assert copies, "the restore did not go through staging"
        if case.startswith("registration"):
            assert not worker._in_place_restores
    finally:
        worker.close()
    assert _exact(kv, src)


def test_a_failed_per_layer_wait_returns_but_step_errors_waits_for_the_read(
        store: MemoryStore) -> None:
    """Layer 1's read is in flight when the forward's wait for it runs out:
    `wait_layer` returns (vLLM's forward goes on), `step_errors` does not
    return while the read still writes the blocks; once it ended, the blocks
    are reported and nothing reads any more."""
    _offload(store)
    held = HeldReads(store, layer=1)
    kv = _kv(seed=None)
    worker = _worker(held, kv, timeout_s=0.5)
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        for name in NAMES:
            worker.wait_layer(name)  # bounded by load_timeout_s; layers 1, 2 fail
        assert held.started.is_set() and not held.release.is_set()
        errors: list[set[int]] = []
        done = threading.Event()

        def ask() -> None:
            errors.append(worker.step_errors())
            done.set()

        asker = threading.Thread(target=ask)
        asker.start()
        assert not done.wait(1.0), "step_errors returned while a read wrote vLLM's blocks"
        held.release.set()
        assert done.wait(10)
        asker.join()
        assert errors == [{5, 3}]
        assert worker.settle(10)
    finally:
        held.release.set()
        worker.close()
    assert worker.staging.free_bytes == STAGING


@pytest.mark.usefixtures("forced")
def test_an_async_failure_is_reported_only_after_its_read_ended(store: MemoryStore) -> None:
    """An asynchronous restore not done within ``load_timeout_s`` is revoked
    at once, but vLLM hears it failed (and may free the blocks) only once
    the read in flight returned."""
    _offload(store)
    held = HeldReads(store, layer=1)
    kv = _kv(seed=None)
    worker = _worker(held, kv, timeout_s=0.3)
    try:
        worker.start_loads([_spec(sync=False)])
        assert held.started.wait(10)
        assert worker.results(wait_s=1.5) == (set(), set())  # revoked by now, not reported
        held.release.set()
        assert worker.results(wait_s=10) == ({"r"}, {"r"})
        assert worker.settle(10)
    finally:
        held.release.set()
        worker.close()


@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize("sync", [True, False], ids=["per-layer", "whole-request"])
def test_a_store_timeout_mid_read_keeps_the_blocks_until_the_call_ended(sync: bool) -> None:
    """The store stalls at the restore's first ranged read: the caller gets
    `StoreTimeout` while the call goes on (it writes the blocks once the
    store resumes). vLLM hears of the load only after that call ended."""
    slow = MemoryStore(timeout_s=0.2)
    try:
        _offload(slow)
        kv = _kv(seed=None)
        worker = _worker(slow, kv, timeout_s=2.0)
        try:
            worker.begin_step()
            slow.stall_when("get_ranges")
            worker.start_loads([_spec(sync)])
            answer: list[object] = []
            done = threading.Event()

            def ask() -> None:
                if sync:
                    for name in NAMES:
                        worker.wait_layer(name)
                    answer.append(worker.step_errors())
                else:
                    answer.append(worker.results(wait_s=30))
                done.set()

            asker = threading.Thread(target=ask)
            asker.start()
            assert slow.timed_out.wait(10)
            assert not done.wait(3.0), "vLLM heard of the load while its read still ran"
            slow.resume()
            assert done.wait(30)
            asker.join()
            assert answer == ([{5, 3}] if sync else [({"r"}, {"r"})])
            assert worker.settle(10)
        finally:
            slow.resume()
            worker.close()
    finally:
        slow.close()


def test_a_read_that_never_ends_stops_the_step_and_keeps_the_cache_registered(
        caplog: pytest.LogCaptureFixture) -> None:
    """A timed-out read whose call still runs after ``read_end_s``:
    `step_errors` raises `BlocksStillWritten` (an error, never blocks handed
    back while written), the load's task ends with the read logged, and
    vLLM's cache stays registered with the store through `close` until the
    call ended."""
    slow = MemoryStore(timeout_s=0.2)
    try:
        _offload(slow)
        kv = _kv(seed=None)
        worker = _worker(slow, kv, timeout_s=2.0, read_end_s=0.5)
        try:
            worker.begin_step()
            slow.stall_when("get_ranges")
            worker.start_loads([_spec(sync=True)])
            for name in NAMES:
                worker.wait_layer(name)
            assert slow.timed_out.is_set()
            load = worker._sync[0]
            with pytest.raises(BlocksStillWritten, match="did not end within"):
                worker.step_errors()
            with caplog.at_level(logging.ERROR, logger="vllm.layerlift"):
                assert worker.settle(10)  # the task ends after read_end_s
            assert "has not ended" in caplog.text and worker._reading
            registered = dict(slow._registered)
            assert registered
            worker.close()
            assert slow._registered == registered, "vLLM's cache unregistered under a read"
            quiet = threading.Event()
            load.gate.when_quiet(quiet.set)  # after the worker's own callback
            slow.resume()
            assert quiet.wait(10)
            assert not worker._reading and load.gate.reads == 0
        finally:
            slow.resume()
            worker.close()
    finally:
        slow.close()


@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize("sync", [True, False], ids=["per-layer", "whole-request"])
def test_a_corrupt_slice_read_in_place_fails_the_load_and_marks_the_object(
        store: MemoryStore, sync: bool) -> None:
    """One flipped byte in page 2's layer-1 slice: it lands in the block and
    fails its check there; the load is reported failed (vLLM recomputes the
    blocks) and the object is reported corrupt."""
    _offload(store)
    layout = _layout()
    key = layout.schema("t").key("full0", HASHES[2])
    data = bytearray(store.object_bytes(key))
    data[ROW + 7] ^= 0x40
    store.replace_object(key, bytes(data))
    kv = _kv(seed=None)
    worker = _worker(store, kv)
    try:
        errors, reported = _restore(worker, sync)
        assert errors == ({5, 3} if sync else set())
        assert reported == ((set(), set()) if sync else ({"r"}, {"r"}))
        assert worker.settle(10)
        report = worker.report()
        assert report is not None and (0, HASHES[2]) in report.corrupt
    finally:
        worker.close()
