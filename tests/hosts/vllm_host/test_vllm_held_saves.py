"""Saves of held blocks (`SaveSpec.job`): the scheduler keeps a reference on
each attention block of a job until the worker reports it (`WorkerReport.saved`),
so the worker copies and puts them after the step, off vLLM's thread.

What may never happen: a job reported before its blocks were read for the
last time (vLLM may then reuse them: another request's bytes under these
keys), a job reported twice or never (a block freed twice, or held for
ever), bytes stored that the blocks did not hold when the save was taken.
Each order is forced with events: a copy held in the middle, a put held, a
put that fails, a cancellation while a copy runs or while the job waits for
the one before it, a step whose restore failed, recurrent state in the same
job, a device cache (copied within the step, reported at once), an
in-place put that times out, a cache the store refuses to register. The
round trips run on a real Mooncake master; the orders on the in-memory
store. No vLLM is imported: they run in the main suite too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

import layerlift.hosts.vllm.worker_held as worker_held
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.hosts.vllm.worker_base import SAVE_RING_FACTOR
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import ForwardingStore, Store, StoreIOError
from layerlift.testing.simdevice import SimDevice

pytestmark = [pytest.mark.vllm]

ATTN = ("model.layers.0.attn", "model.layers.1.attn")
STATE = "model.layers.2.mamba"
ROW = 4096  # bytes of one block of one layer
BLOCKS = 8
HASHES = [bytes([i]) * 16 for i in range(BLOCKS)]
WAIT_S = 30.0


def _layout(recurrent: bool = False) -> Layout:
    groups = [GroupLayout(0, GroupKind.FULL, ATTN)]
    sizes = dict.fromkeys(ATTN, ROW)
    if recurrent:
        groups.append(GroupLayout(1, GroupKind.MAMBA, (STATE,)))
        sizes[STATE] = ROW
    return Layout(tuple(groups), 16, sizes, "held", "uint8")


def _kv(layout: Layout, seed: int | None) -> dict[str, torch.Tensor]:
    names = [n for g in layout.groups for n in g.layer_names]
    if seed is None:
        return {n: torch.zeros(BLOCKS, ROW, dtype=torch.uint8) for n in names}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (BLOCKS, ROW), dtype=torch.uint8, generator=gen)
            for n in names}


def _worker(store: Store, layout: Layout, kv: dict[str, torch.Tensor], ns: str = "held",
            staging: int = 1 << 20, device: object = None) -> BlockWorker:
    return BlockWorker(store, layout, kv, schema=layout.schema(ns), staging_bytes=staging,
                       max_in_flight=2, load_timeout_s=WAIT_S, device=device)  # type: ignore[arg-type]


def _items(pages: Sequence[int], group: int = 0) -> list[tuple[int, bytes, int]]:
    return [(group, HASHES[p], p) for p in pages]


def _restored(store: Store, layout: Layout, ns: str, items: list[tuple[int, bytes, int]]
              ) -> dict[str, torch.Tensor]:
    """A fresh worker's whole-request restore of ``items`` into zeroed blocks."""
    kv = _kv(layout, None)
    worker = _worker(store, layout, kv, ns)
    try:
        worker.start_loads([LoadSpec("r", items)])
        assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
    finally:
        worker.close()
    return kv


def _saved(worker: BlockWorker) -> dict[int, int]:
    report = worker.report()
    return {} if report is None else dict(report.saved)


class _HeldCopy:
    """`copy_page` in the save module, its first call held: ``started`` once
    it copied the page (and waits), back when ``release`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.calls = 0
        real = worker_held.copy_page

        def held(*args: object, **kwargs: object) -> object:
            out = real(*args, **kwargs)  # type: ignore[arg-type]
            self.calls += 1
            if self.calls == 1:
                self.started.set()
                assert self.release.wait(WAIT_S), "the test never released the held copy"
            return out

        monkeypatch.setattr(worker_held, "copy_page", held)


class _HeldPuts(ForwardingStore):
    """Puts wait for ``release`` (``entered`` set when one waits); ``fail``:
    they raise StoreIOError instead of storing."""

    def __init__(self, inner: Store, fail: bool = False) -> None:
        super().__init__(inner)
        self.entered, self.release = threading.Event(), threading.Event()
        self.fail = fail
        self.puts = 0

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self.puts += 1
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the held put"
        if self.fail:
            raise StoreIOError("injected: the put failed")
        self.inner.put(keys, ptrs, sizes)


def test_a_held_save_returns_at_once_and_stores_the_bytes_of_the_step(
        mooncake_store: MooncakeStore, mooncake_namespace: str) -> None:
    """Real Mooncake, the worker's staging a fraction of the job (three
    chunks, pipelined): `save` returns before any put; the job is reported
    once, after the last copy; the blocks changed after that (vLLM reused
    them) change nothing stored: the restore is byte-exact to the step's."""
    layout = _layout()
    kv = _kv(layout, seed=5)
    before = {n: t.clone() for n, t in kv.items()}
    object_bytes = layout.object_bytes(layout.groups[0])
    puts = _HeldPuts(mooncake_store)
    # the save ring (SAVE_RING_FACTOR stagings) puts chunks of half of it: two objects
    worker = _worker(puts, layout, kv, mooncake_namespace,
                     staging=(2 * 2 * object_bytes + 4096) // SAVE_RING_FACTOR)
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items(range(6)), job=3)])
        assert puts.entered.wait(WAIT_S)
        assert puts.puts == 1  # save returned while the first put waits
        puts.release.set()
        assert worker.settle(WAIT_S)
        assert _saved(worker) == {3: 1}
        assert _saved(worker) == {}  # reported once
        for t in kv.values():
            t.fill_(0x5A)  # the blocks reused once the job was reported
    finally:
        worker.close()
    assert puts.puts >= 3, "the job was not put in chunks of the staging"
    got = _restored(mooncake_store, layout, mooncake_namespace, _items(range(6)))
    assert all(torch.equal(got[n][:6], before[n][:6]) for n in ATTN)


def test_the_job_is_not_reported_while_its_blocks_are_still_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the job held in the middle: the job is not reported (its
    blocks are still being read); released, it is reported and stored."""
    layout = _layout()
    store = MemoryStore()
    kv = _kv(layout, seed=6)
    copy = _HeldCopy(monkeypatch)
    worker = _worker(store, layout, kv)
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items(range(4)), job=1)])
        assert copy.started.wait(WAIT_S)
        assert _saved(worker) == {}
        copy.release.set()
        assert worker.settle(WAIT_S)
        assert _saved(worker) == {1: 1}
        keys = [k for _, k, _ in worker.keyed(_items(range(4)))]
        assert store.exists(keys) == [True] * 4
    finally:
        copy.release.set()
        worker.close()


def test_a_failed_put_still_reports_the_job_once_and_stores_nothing() -> None:
    """The put fails: the job was copied, so it is reported (its blocks are
    free again), once; nothing is stored; the staging comes back whole."""
    layout = _layout()
    puts = _HeldPuts(MemoryStore(), fail=True)
    worker = _worker(puts, layout, _kv(layout, seed=7))
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items(range(3)), job=4)])
        assert puts.entered.wait(WAIT_S)
        puts.release.set()
        assert worker.settle(WAIT_S)
        assert _saved(worker) == {4: 1}
        keys = [k for _, k, _ in worker.keyed(_items(range(3)))]
        assert puts.exists(keys) == [False] * 3
        ring = worker._save_ring
        assert ring is not None and ring.free_bytes == ring.capacity
    finally:
        puts.release.set()
        worker.close()


def test_jobs_run_one_at_a_time_and_a_cancelled_waiting_job_is_reported_unread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs: the second waits for the first (held in its copy). Cancelled
    while it waits, it read nothing: it is reported at once and stores
    nothing. Then the first is cancelled while its copy runs: it is not
    reported until the copy returned (its thread goes on: a cancellation
    never cuts a thread short), then it is, once."""
    layout = _layout()
    store = MemoryStore()
    copy = _HeldCopy(monkeypatch)
    worker = _worker(store, layout, _kv(layout, seed=8))
    try:
        worker.begin_step()
        worker.save([SaveSpec("a", _items([0, 1]), job=10)])
        assert copy.started.wait(WAIT_S)
        first = set(worker._tasks)
        worker.save([SaveSpec("b", _items([2, 3]), job=11)])
        (second,) = set(worker._tasks) - first
        second.cancel()
        assert worker.wait_saved({11}, WAIT_S)
        assert _saved(worker) == {11: 1}  # and not the first: its copy is held
        (running,) = first
        running.cancel()
        assert not worker.wait_saved({10}, 0.2)  # its copy still runs: bounded, not an order
        copy.release.set()
        assert worker.wait_saved({10}, WAIT_S)
        assert _saved(worker) == {10: 1}
        keyed = worker.keyed(_items([2, 3]))
        assert store.exists([k for _, k, _ in keyed]) == [False, False]
    finally:
        copy.release.set()
        worker.close()


def test_a_step_whose_restore_failed_reports_its_jobs_and_puts_nothing() -> None:
    """A synchronous restore of this step failed (refused): its jobs are
    reported at once (nothing is saved, nothing holds the blocks)."""
    layout = _layout()
    store = MemoryStore()
    worker = _worker(store, layout, _kv(layout, seed=9))
    try:
        worker.begin_step()
        worker.start_loads([LoadSpec("s", _items([7]), refused=True, sync=True)])
        assert worker.step_failed()
        worker.save([SaveSpec("r", _items([0, 1]), job=2), SaveSpec("q", _items([2]))])
        assert _saved(worker) == {2: 1}
        assert worker.settle(WAIT_S)
        keys = [k for _, k, _ in worker.keyed(_items([0, 1, 2]))]
        assert store.exists(keys) == [False] * 3
    finally:
        worker.close()


def test_recurrent_state_is_copied_within_the_step_and_attention_after(
        mooncake_store: MooncakeStore, mooncake_namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's job: its recurrent state block (rewritten by the next
    step, never held) is copied before `save` returns; its attention blocks
    after (held). The state changed right after `save`, the attention
    blocks only once the job was reported: both restore as the step left them."""
    layout = _layout(recurrent=True)
    kv = _kv(layout, seed=11)
    before = {n: t.clone() for n, t in kv.items()}
    copy = _HeldCopy(monkeypatch)
    worker = _worker(mooncake_store, layout, kv, mooncake_namespace)
    items = [*_items([0, 1]), (1, HASHES[1], 5)]
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", items, job=6)])
        kv[STATE][5].fill_(0x11)  # the next step rewrites the state
        assert copy.started.wait(WAIT_S)
        assert _saved(worker) == {}
        copy.release.set()
        assert worker.settle(WAIT_S)
        assert _saved(worker) == {6: 1}
    finally:
        copy.release.set()
        worker.close()
    got = _restored(mooncake_store, layout, mooncake_namespace,
                    [*_items([0, 1]), (1, HASHES[1], 3)])
    assert all(torch.equal(got[n][:2], before[n][:2]) for n in ATTN)
    assert torch.equal(got[STATE][3], before[STATE][5])


def test_on_a_device_a_job_is_copied_within_the_step_and_reported_at_once() -> None:
    """A device cache (the simulated device): `save` gathers the blocks
    before it returns, as without a job; the job is reported at once."""
    layout = _layout()
    store = MemoryStore()
    kv = _kv(layout, seed=12)
    device = SimDevice(seed=12, max_delay_s=0.001)
    worker = _worker(store, layout, kv, device=device)
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items([0, 1]), job=8)])
        assert _saved(worker) == {8: 1}
        assert worker.settle(WAIT_S)
        keys = [k for _, k, _ in worker.keyed(_items([0, 1]))]
        assert store.exists(keys) == [True, True]
    finally:
        worker.close()
        device.close()


def test_large_blocks_are_put_in_place_and_a_timed_out_put_holds_the_job(
        mooncake_store: MooncakeStore, mooncake_namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of at least `IN_PLACE_BYTES` a layer (lowered here) are put
    from the cache itself, several calls a job (`PUT_BUFFERS` lowered):
    restored byte-exact from real Mooncake, the cache registered once and
    unregistered at close. A put that times out keeps the job unreported
    (the store still reads the blocks) until the call really ended."""
    monkeypatch.setattr(worker_held, "IN_PLACE_BYTES", ROW)
    monkeypatch.setattr(worker_held, "PUT_BUFFERS", 2 * (len(ATTN) + 1))
    layout = _layout()
    kv = _kv(layout, seed=13)
    before = {n: t.clone() for n, t in kv.items()}
    calls: list[int] = []
    real = mooncake_store.put_parts

    def counted(keys: Sequence[str], ptrs: object, sizes: object) -> None:
        calls.append(len(keys))
        real(keys, ptrs, sizes)  # type: ignore[arg-type]

    monkeypatch.setattr(mooncake_store, "put_parts", counted)
    worker = _worker(mooncake_store, layout, kv, mooncake_namespace)
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items(range(5)), job=1)])
        assert worker.wait_saved({1}, WAIT_S) and worker.settle(WAIT_S)
        assert _saved(worker) == {1: 1}
        assert calls == [2, 2, 1]
        assert worker._cache_registered is not None
    finally:
        worker.close()
    assert worker._cache_registered is None
    got = _restored(mooncake_store, layout, mooncake_namespace, _items(range(5)))
    assert all(torch.equal(got[n][:5], before[n][:5]) for n in ATTN)


class _LatePuts(ForwardingStore):
    """``put_parts`` times out at once (StoreTimeout with the call's future)
    while the call goes on until ``release``; ``ended`` once it returned."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.release, self.ended = threading.Event(), threading.Event()

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from layerlift.linker.store_base import StoreTimeout

        def call() -> None:
            assert self.release.wait(WAIT_S), "the test never released the late put"
            self.inner.put_parts(keys, ptrs, sizes)
            self.ended.set()

        pool = ThreadPoolExecutor(1)
        future = pool.submit(call)
        pool.shutdown(wait=False)
        raise StoreTimeout("injected: the put outlived its bound", future)


def test_an_in_place_put_that_timed_out_reports_its_job_only_once_it_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place put times out but the call goes on reading the blocks:
    the job is not reported until the call ended; then it is, once."""
    monkeypatch.setattr(worker_held, "IN_PLACE_BYTES", ROW)
    layout = _layout()
    store = _LatePuts(MemoryStore())
    worker = _worker(store, layout, _kv(layout, seed=14))
    try:
        worker.begin_step()
        worker.save([SaveSpec("r", _items([0, 1]), job=2)])
        assert not worker.wait_saved({2}, 0.3)  # bounded: the call still runs
        store.release.set()
        assert store.ended.wait(WAIT_S)
        assert worker.wait_saved({2}, WAIT_S) and worker.settle(WAIT_S)
        assert _saved(worker) == {2: 1}
        keys = [k for _, k, _ in worker.keyed(_items([0, 1]))]
        assert store.exists(keys) == [True, True]  # it landed late, as the step left it
    finally:
        store.release.set()
        worker.close()


class _RefusingRegister(ForwardingStore):
    """``register`` raises StoreIOError while ``refuse`` is set (a store
    that cannot map the cache): after the worker's own staging was registered."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.refuse = False

    def register(self, buffer: object, nbytes: int | None = None) -> int:
        if self.refuse:
            raise StoreIOError("injected: the store refused to register the buffer")
        return self.inner.register(buffer, nbytes)  # type: ignore[arg-type]


def test_a_cache_the_store_cannot_register_fails_the_job_and_the_next_retries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place path's registration of vLLM's cache fails: the job is
    reported (nothing read its blocks), nothing is stored, nothing stays
    registered; the next job registers and puts."""
    monkeypatch.setattr(worker_held, "IN_PLACE_BYTES", ROW)
    layout = _layout()
    store = _RefusingRegister(MemoryStore())
    worker = _worker(store, layout, _kv(layout, seed=15))
    try:
        store.refuse = True
        worker.begin_step()
        worker.save([SaveSpec("r", _items([0, 1]), job=1)])
        assert worker.wait_saved({1}, WAIT_S) and worker.settle(WAIT_S)
        assert _saved(worker) == {1: 1} and worker._cache_registered is None
        keys = [k for _, k, _ in worker.keyed(_items([0, 1, 2]))]
        assert store.exists(keys) == [False] * 3
        store.refuse = False
        worker.save([SaveSpec("q", _items([2]), job=2)])
        assert worker.wait_saved({2}, WAIT_S) and worker.settle(WAIT_S)
        assert _saved(worker) == {2: 1} and worker._cache_registered is not None
        assert store.exists(keys) == [False, False, True]
    finally:
        worker.close()
