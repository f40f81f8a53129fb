"""The vLLM worker's device path (`BlockWorker` with a `Device`) on the simulated device.

vLLM's caches are simulated device memory (``SimDevice``: streams that really
run late). A restore copies each verified chunk from pinned staging into its
blocks on the worker's load stream, with one event per layer;
``wait_layer`` makes the forward's stream (here a non-default simulated
stream, so nothing waits on the host) wait on that event; an offload gathers
the blocks on the save stream after an event recorded on the forward's
stream. Four negative controls, each planted through a seam with
``monkeypatch`` (never a production edit), break one ordering rule and must
give wrong bytes that the same byte check catches: a skipped event wait, an
event recorded on the wrong stream, staging reused before its event, an
offload gather not ordered after the forward. A fifth: a load reported to
vLLM (failed or finished) before the copies issued into its blocks ran.

Orders are set with a blocker queued on a stream, released by the test (or
by a spy at the exact point under test), never with sleeps. Runs without
vLLM (``layerlift.hosts.vllm`` imports vLLM only for the connector): in
``make test-vllm`` (marker ``vllm``) and in the main environment, by path
(``.venv/bin/python -m pytest tests/hosts/vllm_host/test_vllm_device.py``) or
with the suite (``tests/hosts/conftest.py`` collects this file without vLLM),
so also on a GPU machine without vLLM, where the ``gpu`` tests run the same
paths on CUDA tensors. The in-memory store, and one round trip on a real
Mooncake master.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from layerlift.hosts.vllm import objects as vllm_objects
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.objects import BlockSink
from layerlift.hosts.vllm.worker import BlockWorker, device_for
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import Region
from layerlift.linker.staged import StagedLoad
from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.overlap.device import Device, DeviceEvent
from layerlift.testing.simdevice import SimDevice, SimEvent, SimStream, block_stream

pytestmark = [pytest.mark.vllm]

WAIT_S = 30.0
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
SHAPE = (2, 64)  # one block of one layer: K and V, 64 floats each (512 bytes)
BLOCK = 2 * 64 * 4
NUM_BLOCKS = 16
PAGES = 4  # pages restored per load: blocks 8..11
# A chunk is a quarter of the staging: 2 rows of (BLOCK + its CRC) here, so
# each layer of a load is 2 chunks and a load's 4 chunks fit the ring at once.
STAGING = 4 * 1088
HASHES = [bytes([i + 1]) * 16 for i in range(PAGES)]
TARGET = list(range(8, 8 + PAGES))


def _layout() -> Layout:
    group = GroupLayout(0, GroupKind.FULL, LAYERS)
    return Layout((group,), 16, dict.fromkeys(LAYERS, BLOCK), "unit", "float32")


def _kv(fill: bool, seed: int = 3, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(NUM_BLOCKS, *SHAPE, generator=gen) if fill
                else torch.zeros(NUM_BLOCKS, *SHAPE)).to(device) for n in LAYERS}


def _worker(store: Store, kv: dict[str, torch.Tensor], device: Device | None,
            ns: str = "dev", staging: int = STAGING) -> BlockWorker:
    layout = _layout()
    return BlockWorker(store, layout, kv, schema=layout.schema(ns), staging_bytes=staging,
                       max_in_flight=2, load_timeout_s=WAIT_S, device=device)


def _offload(store: Store, ns: str = "dev") -> dict[str, torch.Tensor]:
    """Blocks 0..3 of a filled host cache, offloaded (the host path) as the pages."""
    kv = _kv(fill=True)
    source = _worker(store, kv, None, ns)
    try:
        source.save([SaveSpec("src", [(0, h, p) for p, h in enumerate(HASHES)])])
    finally:
        source.close()
    return kv


def _expected(src: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return src[name][:PAGES]


def _spec(sync: bool) -> LoadSpec:
    return LoadSpec("r", [(0, h, b) for h, b in zip(HASHES, TARGET, strict=True)], sync=sync)


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    device = SimDevice(seed=11, max_delay_s=0.001)
    yield device
    device.close()


def block(sim: SimDevice, stream: Any) -> threading.Event:
    """Hold ``stream`` until the returned event is set (a blocker queued on it)."""
    return block_stream(sim, stream, WAIT_S)


def forward(sim: SimDevice, worker: BlockWorker, kv: dict[str, torch.Tensor],
            fwd: SimStream) -> dict[str, torch.Tensor]:
    """vLLM's step on stream ``fwd``: start the synchronous restore, then per
    layer ``wait_layer`` and a read of the restored blocks queued on ``fwd``
    (the attention kernel). Returns the reads (filled once ``fwd`` ran them)."""
    reads: dict[str, torch.Tensor] = {}
    worker.begin_step()
    with sim.use(fwd):
        worker.start_loads([_spec(sync=True)])
        for name in LAYERS:
            worker.wait_layer(name)  # copies issued: returns while they have not run

            def read(name: str = name) -> None:
                reads[name] = kv[name][TARGET].clone()

            sim.launch(fwd, read)
    return reads


def _restorer(sim: SimDevice) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                       BlockWorker]:
    """The pages offloaded (their source), empty blocks and a device worker over them."""
    store = MemoryStore()
    src = _offload(store)
    kv = _kv(fill=False)
    return src, kv, _worker(store, kv, sim)


def exact(reads: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> bool:
    assert set(reads) == set(LAYERS)
    return all(torch.equal(reads[n], _expected(src, n)) for n in LAYERS)


# ---- restores ----------------------------------------------------------------------


def test_a_restore_lands_on_the_load_stream_and_the_forward_waits_on_its_events(
        sim: SimDevice) -> None:
    src, kv, worker = _restorer(sim)
    fwd = sim.new_stream()
    try:
        go = block(sim, worker.load_stream)  # every copy runs after the forward's waits
        reads = forward(sim, worker, kv, fwd)
        assert not reads, "the forward read a layer before its copies' event"
        assert not worker.staging.idle(), "staging was given back before its copies ran"
        go.set()
        sim.synchronize()
        assert exact(reads, src)
        assert worker.step_errors() == set()
    finally:
        worker.close()
    assert worker.staging.wait_idle(WAIT_S)


def test_control_a_skipped_event_wait_reads_wrong_bytes(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    src, kv, worker = _restorer(sim)
    monkeypatch.setattr(BlockWorker, "_stream_wait", lambda self, load, index: None)
    fwd = sim.new_stream()
    try:
        go = block(sim, worker.load_stream)
        reads = forward(sim, worker, kv, fwd)
        fwd.drain()  # nothing orders the reads after the copies: they ran
        assert not exact(reads, src), "the control did not catch a skipped event wait"
        go.set()
        sim.synchronize()
        assert all(torch.equal(kv[n][TARGET], _expected(src, n)) for n in LAYERS)
    finally:
        go.set()
        worker.close()


def test_control_an_event_on_the_wrong_stream_reads_wrong_bytes(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    src, kv, worker = _restorer(sim)
    other = sim.new_stream()

    def issue(self: BlockSink, work: Callable[[], None]) -> DeviceEvent:
        self.device.launch(self.stream, work)
        event = self.device.event()
        event.record(other)  # the control: not the stream that carries the copies
        return event

    monkeypatch.setattr(BlockSink, "issue", issue)
    fwd = sim.new_stream()
    try:
        go = block(sim, worker.load_stream)
        reads = forward(sim, worker, kv, fwd)
        fwd.drain()
        assert not exact(reads, src), "the control did not catch an event on the wrong stream"
    finally:
        go.set()
        sim.synchronize()
        worker.close()


def test_control_staging_reused_before_its_event_gives_wrong_bytes(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    src, kv, worker = _restorer(sim)
    monkeypatch.setattr(Region, "release_after", lambda self, event: self.release())
    fwd = sim.new_stream()
    try:
        go = block(sim, worker.load_stream)
        reads = forward(sim, worker, kv, fwd)  # later chunks read into earlier ones' staging
        go.set()
        sim.synchronize()
        assert not exact(reads, src), "the control did not catch staging reused early"
    finally:
        go.set()
        worker.close()


class CopyCount:
    """Counts the scatters issued on the load stream and those that ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, expect: int = 0) -> None:
        self.issued = self.ran = 0
        self.lock = threading.Lock()
        # set once ``expect`` scatters were issued / ran
        self.issued_all, self.ran_all = threading.Event(), threading.Event()
        real_write, real_scatter = BlockSink.write, vllm_objects.scatter_rows

        def write(sink: BlockSink, seg: Any, part: Any, rows: torch.Tensor) -> Any:
            event = real_write(sink, seg, part, rows)
            with self.lock:
                self.issued += 1
                if self.issued == expect:
                    self.issued_all.set()
            return event

        def scatter(kv: torch.Tensor, blocks: Any, rows: torch.Tensor) -> None:
            real_scatter(kv, blocks, rows)
            with self.lock:
                self.ran += 1
                if self.ran == expect:
                    self.ran_all.set()

        monkeypatch.setattr(BlockSink, "write", write)
        monkeypatch.setattr(vllm_objects, "scatter_rows", scatter)
        import layerlift.hosts.vllm.worker_load as worker_load

        monkeypatch.setattr(worker_load, "scatter_rows", scatter)

    def pending(self) -> int:
        with self.lock:
            return self.issued - self.ran


@pytest.mark.parametrize("control", [False, True], ids=["fenced", "control-unfenced"])
def test_a_load_waits_for_what_the_forward_issued_before_it(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch, control: bool) -> None:
    """vLLM frees blocks on the host while the forward that reads them may
    still be queued: a load into them must not overwrite them before that
    read ran. The load stream waits for vLLM's current stream at
    `start_loads`; the control drops that fence and the queued read sees
    the restored bytes instead of the old ones."""
    store = MemoryStore()
    src = _offload(store)
    kv = _kv(fill=False)
    for n in LAYERS:
        kv[n][TARGET] = 7.0  # a finished request's blocks, read by a queued kernel
    count = CopyCount(monkeypatch, expect=2 * len(LAYERS))  # 2 chunks per layer
    worker = _worker(store, kv, sim)
    if control:
        monkeypatch.setattr(BlockSink, "begin", lambda self: None)
    fwd = sim.new_stream()
    reads: dict[str, torch.Tensor] = {}
    try:
        go = block(sim, fwd)
        sim.launch(fwd, lambda: reads.update({n: kv[n][TARGET].clone() for n in LAYERS}))
        log = StreamLog(monkeypatch, sim)  # from here on: after the queued read
        with sim.use(fwd):
            worker.start_loads([_spec(sync=False)])
        assert log.ordered_after(fwd, worker.load_stream) is not control
        if control:
            assert count.ran_all.wait(WAIT_S)  # nothing held the copies back
        else:
            assert count.issued_all.wait(WAIT_S)
            assert count.ran == 0, "a copy ran before the forward's earlier work"
        go.set()
        assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
        sim.synchronize()
    finally:
        go.set()
        worker.close()
    old = all(bool((reads[n] == 7.0).all()) for n in LAYERS)
    assert old is not control, ("a load overwrote blocks the forward still read" if not control
                                else "the control did not catch a load without its fence")
    assert all(torch.equal(kv[n][TARGET], _expected(src, n)) for n in LAYERS)


class StreamLog:
    """Spy: every event recorded or waited on and every launch, in issue
    order, with its stream (the events are kept, so identities stay
    unique). Shows the structure of an ordering where the bytes cannot: a
    correct order would also hold if the late stream happened to run first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sim: SimDevice) -> None:
        self.ops: list[tuple[str, Any, Any]] = []
        self.lock = threading.Lock()
        real_record, real_wait, real_launch = SimEvent.record, SimEvent.wait, SimDevice.launch

        def log(op: str, item: Any, stream: Any) -> None:
            with self.lock:
                self.ops.append((op, item, sim.current_stream() if stream is None else stream))

        def record(event: SimEvent, stream: Any = None) -> None:
            log("record", event, stream)
            real_record(event, stream)

        def wait(event: SimEvent, stream: Any = None) -> None:
            log("wait", event, stream)
            real_wait(event, stream)

        def launch(device: SimDevice, stream: Any, work: Callable[[], None]) -> None:
            log("launch", work, stream)
            real_launch(device, stream, work)

        monkeypatch.setattr(SimEvent, "record", record)
        monkeypatch.setattr(SimEvent, "wait", wait)
        monkeypatch.setattr(SimDevice, "launch", launch)

    def ordered_after(self, first: Any, then: Any) -> bool:
        """Whether stream ``then`` waited on an event recorded on ``first``
        (both logged) before its first launch."""
        recorded: list[Any] = []
        with self.lock:
            ops = list(self.ops)
        for op, item, stream in ops:
            if op == "record" and stream is first:
                recorded.append(item)
            elif op == "wait" and stream is then and any(item is e for e in recorded):
                return True
            elif op == "launch" and stream is then:
                return False
        return False


def _spoil_layer1(store: MemoryStore, key: str) -> None:
    """Replace ``key``'s object with one whose layer-1 slice fails its CRC."""
    raw = bytearray(store.object_bytes(key))
    raw[BLOCK + 7] ^= 0xFF
    store.remove([key])
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    ptr = store.register(buf)
    store.put([key], [ptr], [len(raw)])
    store.unregister(ptr)


def _layer1_spoiled(sim: SimDevice, monkeypatch: pytest.MonkeyPatch,
                    ) -> tuple[CopyCount, BlockWorker, threading.Event]:
    """The pages offloaded with page 1's layer-1 slice spoiled; a device
    worker over empty blocks whose load stream is held (released by the
    returned event); the copies counted."""
    store = MemoryStore()
    _offload(store)
    _spoil_layer1(store, _layout().schema("dev").key("full0", HASHES[1]))
    count = CopyCount(monkeypatch)
    worker = _worker(store, _kv(fill=False), sim)
    return count, worker, block(sim, worker.load_stream)


@pytest.mark.parametrize("control", [False, True], ids=["drained", "control-undrained"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_load_is_reported_only_once_its_copies_ran(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch, sync: bool, control: bool) -> None:
    """Layer 0 lands (its copies held on the load stream), layer 1 is corrupt.
    The failure is reported to vLLM (a synchronous load's wait and
    `step_errors`; an asynchronous one's `results`) only once every copy
    issued into its blocks ran: vLLM may recompute into them or free them
    then. The spy releases the load stream when the worker starts to wait
    for it; the control skips that wait and reports with copies pending."""
    count, worker, go = _layer1_spoiled(sim, monkeypatch)
    real_drain = BlockSink.drain

    def drain(sink: BlockSink) -> None:
        if control:
            return
        go.set()  # the worker waits for the copies now: let them run
        real_drain(sink)

    monkeypatch.setattr(BlockSink, "drain", drain)
    fwd = sim.new_stream()
    try:
        if sync:
            worker.begin_step()
            with sim.use(fwd):
                worker.start_loads([_spec(sync=True)])
                for name in LAYERS:
                    worker.wait_layer(name)
            assert worker.step_errors() == set(TARGET)
        else:
            worker.start_loads([_spec(sync=False)])
            assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
        assert count.issued > 0
        assert (count.pending() == 0) is not control, \
            "a load was reported while its copies still ran" if not control else \
            "the control did not catch a load reported before its copies ran"
    finally:
        go.set()
        sim.synchronize()
        worker.close()


def test_a_failed_wait_during_the_loops_settle_waits_for_its_drain(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's order of the test above, forced: the loop settles the failed
    synchronous load first (it sits in the sink's drain, the load stream
    still held), then the forward's wait of layer 1 fails too and
    `step_errors` reports. That report must come only once the loop's drain
    has ended; a second settler that returned at once (``settled`` meaning
    "started") reported with layer 0's copies still pending."""
    count, worker, go = _layer1_spoiled(sim, monkeypatch)
    real_drain = BlockSink.drain
    in_drain, reported, drained = threading.Event(), threading.Event(), threading.Event()

    def drain(sink: BlockSink) -> None:
        in_drain.set()
        # Give the forward's report its chance to overtake the drain: bounded,
        # since with the fix the report waits for this drain to end.
        reported.wait(1.0)
        go.set()
        real_drain(sink)
        drained.set()

    monkeypatch.setattr(BlockSink, "drain", drain)
    fwd = sim.new_stream()
    try:
        worker.begin_step()
        with sim.use(fwd):
            worker.start_loads([_spec(sync=True)])
            assert in_drain.wait(WAIT_S), "the loop never settled the failed load"
            for name in LAYERS:
                worker.wait_layer(name)
        errors = worker.step_errors()
        drained_before_report = drained.is_set()
        reported.set()
        assert errors == set(TARGET)
        assert drained_before_report, "step_errors reported while the loop's drain still ran"
        assert count.issued > 0 and count.pending() == 0
    finally:
        reported.set()
        go.set()
        sim.synchronize()
        worker.close()


def test_an_asynchronous_restore_is_finished_only_once_its_copies_ran(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    src = _offload(store)
    kv = _kv(fill=False)
    count = CopyCount(monkeypatch)
    worker = _worker(store, kv, sim)
    go = block(sim, worker.load_stream)
    real_drain = BlockSink.drain

    def drain(sink: BlockSink) -> None:
        go.set()
        real_drain(sink)

    monkeypatch.setattr(BlockSink, "drain", drain)
    try:
        worker.start_loads([_spec(sync=False)])
        assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
        assert count.pending() == 0
        # vLLM's forward may read the blocks now, with no wait of its own
        assert all(torch.equal(kv[n][TARGET], _expected(src, n)) for n in LAYERS)
    finally:
        go.set()
        worker.close()


@pytest.mark.parametrize("sync", [False, True], ids=["asynchronous", "synchronous"])
def test_a_device_restore_of_several_chunks_is_read_whole_only_when_asynchronous(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch, sync: bool) -> None:
    """An asynchronous restore on a device (the request waits for all of it)
    of several chunks reads them whole, ``depth`` at once
    (`StagedLoad.fetch_all`, every layer with an event); a synchronous one
    keeps one job a layer (the forward waits layer by layer). Both exact."""
    whole: list[int] = []
    real = StagedLoad.fetch_all

    def fetch_all(self: StagedLoad) -> DeviceEvent | None:
        whole.append(len(self._merged()))
        return real(self)

    monkeypatch.setattr(StagedLoad, "fetch_all", fetch_all)
    src, kv, worker = _restorer(sim)
    try:
        if sync:
            reads = forward(sim, worker, kv, sim.new_stream())
            assert worker.step_errors() == set()
            sim.synchronize()
            assert exact(reads, src)
        else:
            worker.start_loads([_spec(sync=False)])
            assert worker.results(wait_s=WAIT_S) == ({"r"}, set())
            assert all(torch.equal(kv[n][TARGET], _expected(src, n)) for n in LAYERS)
    finally:
        sim.synchronize()
        worker.close()
    assert whole == ([] if sync else [whole[0]]) and (sync or whole[0] > 1)


class HeldStore(ForwardingStore):
    """Forwards to ``inner``; the ranged read of slice offset ``held_offset``
    reads, then waits for ``release`` before it returns (``returned`` set
    then): a layer whose bytes come late."""

    def __init__(self, inner: Store, held_offset: int) -> None:
        super().__init__(inner)
        self.held_offset = held_offset
        self.release, self.returned = threading.Event(), threading.Event()

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        if src_offsets and src_offsets[0][0] == self.held_offset:
            try:
                assert self.release.wait(WAIT_S), "the test never released the held read"
            finally:
                self.returned.set()


def test_a_late_layer_issues_no_copy_and_is_reported(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 1's read returns after the wait's bound: its blocks are
    reported, and once the read returned nothing was copied into them."""
    store = MemoryStore()
    src = _offload(store)
    held = HeldStore(store, held_offset=BLOCK)  # layer 1's slice
    kv = _kv(fill=False)
    count = CopyCount(monkeypatch)
    layout = _layout()
    worker = BlockWorker(held, layout, kv, schema=layout.schema("dev"), staging_bytes=STAGING,
                         max_in_flight=2, load_timeout_s=1.0, device=sim)
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        worker.wait_layer(LAYERS[0])
        assert torch.equal(kv[LAYERS[0]][TARGET], _expected(src, LAYERS[0]))
        worker.wait_layer(LAYERS[1])  # bounded: returns after 1 s, does not raise
        assert worker.step_errors() == set(TARGET)
        assert count.pending() == 0
        issued = count.issued
        held.release.set()
        assert held.returned.wait(WAIT_S)
    finally:
        held.release.set()
        worker.close()
    sim.synchronize()
    assert count.issued == issued, "a copy was issued after the load was reported"
    assert not kv[LAYERS[1]][TARGET].any(), "the late layer was written after its report"


class AfterCorruptStore(ForwardingStore):
    """Forwards to ``inner``; layer 0's ranged read of ``key`` starts only
    once ``corrupt_seen`` is set (layer 1's check failed first), at most
    ``WAIT_S`` later. Records the keys removed, setting ``removed``."""

    def __init__(self, inner: Store, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.corrupt_seen, self.removed = threading.Event(), threading.Event()
        self.removed_keys: list[str] = []

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        if self.key in keys and src_offsets[keys.index(self.key)][0] == 0:
            assert self.corrupt_seen.wait(WAIT_S), "layer 1's check never failed"
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

    def remove(self, keys: Sequence[str]) -> None:
        self.inner.remove(keys)
        self.removed_keys.extend(keys)
        self.removed.set()


@pytest.mark.parametrize("schedule", ["per-layer", "chunks"])
def test_a_corrupt_object_is_removed_only_after_its_loads_reads(
        monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """Layer 1's slice of one object fails its check while layer 0's read of
    the same object has not started (CI found this order under load: the
    object was removed at once and layer 0 then failed as a miss, so its
    verified bytes never landed). The failure is layer 1's; the object
    leaves the store once the load's session ended. A job a layer (as a
    restore the forward waits for layer by layer runs): layer 0 lands.
    The chunks read at once (`StagedLoad.fetch_all`):
    the chunk of the corrupt object's layer-0 slice, verified after the
    failure halted the load, copies nothing; chunks done before it copied
    their own bytes (the request is recomputed whole either way)."""
    if schedule == "per-layer":
        monkeypatch.setattr(StagedLoad, "fetches_all", lambda self: False)
    store = MemoryStore()
    src = _offload(store)
    key = _layout().schema("dev").key("full0", HASHES[1])
    _spoil_layer1(store, key)
    wrapped = AfterCorruptStore(store, key)
    real_mark = BlockWorker._mark_corrupt

    def mark(self: BlockWorker, *args: Any) -> None:
        real_mark(self, *args)
        wrapped.corrupt_seen.set()

    monkeypatch.setattr(BlockWorker, "_mark_corrupt", mark)
    kv = _kv(fill=False)
    worker = _worker(wrapped, kv, None)
    try:
        worker.start_loads([_spec(sync=False)])
        assert worker.results(wait_s=WAIT_S) == ({"r"}, {"r"})
        if schedule == "per-layer":
            assert torch.equal(kv[LAYERS[0]][TARGET], _expected(src, LAYERS[0])), \
                "layer 0 was verified but did not land"
        else:  # what chunks copied before the failure is the source's; the rest untouched
            got, want = kv[LAYERS[0]][TARGET], _expected(src, LAYERS[0])
            for block in range(PAGES):
                assert (torch.equal(got[block], want[block]) or not got[block].any()), \
                    f"block {block} of layer 0 holds bytes that are neither its own nor zero"
            assert not got[1].any(), "the corrupt object's layer-0 chunk copied after the failure"
        assert wrapped.removed.wait(WAIT_S), "the corrupt object was never removed"
        assert wrapped.removed_keys == [key]
        assert store.exists([key]) == [False]
        assert store.exists([k for k in (_layout().schema("dev").key("full0", h)
                                         for h in HASHES) if k != key]) == [True] * 3
    finally:
        wrapped.corrupt_seen.set()
        worker.close()


# ---- offloads ------------------------------------------------------------------------


def _restored(store: Store, ns: str = "dev") -> dict[str, torch.Tensor]:
    """What a host-path worker restores of the pages (checks every CRC)."""
    kv = _kv(fill=False)
    target = _worker(store, kv, None, ns)
    try:
        target.start_loads([_spec(sync=False)])
        assert target.results(wait_s=WAIT_S) == ({"r"}, set()), "the offload's objects failed"
    finally:
        target.close()
    return {n: kv[n][TARGET] for n in LAYERS}


@pytest.mark.parametrize("control", [False, True], ids=["ordered", "control-unordered"])
def test_an_offload_gathers_after_the_forward_that_wrote_the_blocks(
        sim: SimDevice, monkeypatch: pytest.MonkeyPatch, control: bool) -> None:
    """The step's forward writes blocks 0..3 late (held on its stream);
    `save` gathers them on the save stream after an event recorded on the
    forward's stream, and returns once the gather ran. The control's gather
    is ordered after nothing (an event never recorded) and stores the blocks
    as they were before the forward."""
    store = MemoryStore()
    src = _kv(fill=True, seed=5)
    kv = _kv(fill=False)
    worker = _worker(store, kv, sim)
    if control:
        monkeypatch.setattr(BlockWorker, "_after_forward", lambda self: self.device.event())
    fwd = sim.new_stream()
    try:
        go = block(sim, fwd)

        def attention() -> None:  # the forward writes the step's new pages
            for n in LAYERS:
                kv[n][:PAGES].copy_(src[n][:PAGES])

        sim.launch(fwd, attention)
        log = StreamLog(monkeypatch, sim)  # from here on: after the forward's write
        with sim.use(fwd):
            if not control:  # the forward goes on while save waits: the event orders them
                threading.Thread(target=go.set).start()
            worker.begin_step()
            worker.save([SaveSpec("s", [(0, h, p) for p, h in enumerate(HASHES)])])
        go.set()
        assert log.ordered_after(fwd, worker.save_stream) is not control
    finally:
        go.set()
        worker.close()
    got = _restored(store)
    same = all(torch.equal(got[n], src[n][:PAGES]) for n in LAYERS)
    assert same is not control, ("the offload did not store the forward's bytes" if not control
                                 else "the control did not catch a gather before the forward")


def test_a_device_round_trip_through_a_small_ring(sim: SimDevice) -> None:
    """Offload from and restore into simulated device blocks, one object per
    offload chunk and two rows per load chunk; the forward on the default
    stream (the host's: ``wait_layer`` waits for the event on the host)."""
    store = MemoryStore()
    src = _kv(fill=True, seed=8)
    source = _worker(store, src, sim)
    try:
        source.begin_step()
        source.save([SaveSpec("s", [(0, h, p) for p, h in enumerate(HASHES)])])
    finally:
        source.close()
    kv = _kv(fill=False)
    worker = _worker(store, kv, sim)
    try:
        worker.begin_step()
        worker.start_loads([_spec(sync=True)])
        for name in LAYERS:
            worker.wait_layer(name)  # the default stream: the host waits on the event
            assert torch.equal(kv[name][TARGET], src[name][:PAGES]), name
        assert worker.step_errors() == set()
    finally:
        worker.close()


# ---- the device seam -------------------------------------------------------------------


def test_the_worker_picks_its_device_from_the_caches() -> None:
    assert device_for(_kv(fill=False)) is None  # host tensors: today's host path
    with pytest.raises(ValueError, match="CPU or CUDA"):
        device_for({n: torch.empty(NUM_BLOCKS, *SHAPE, device="meta") for n in LAYERS})
    if torch.cuda.is_available():
        from layerlift.overlap.device import CudaDevice

        assert isinstance(device_for(_kv(fill=False, device="cuda")), CudaDevice)


def test_the_per_layer_record_of_a_synchronous_restore_is_logged(
        sim: SimDevice, caplog: pytest.LogCaptureFixture) -> None:
    import json

    store = MemoryStore()
    _offload(store)
    kv = _kv(fill=False)
    worker = _worker(store, kv, sim)
    try:
        with caplog.at_level("INFO", logger="vllm.layerlift"):
            worker.begin_step()
            worker.start_loads([_spec(sync=True)])
            for name in LAYERS:
                worker.wait_layer(name)
            assert worker.step_errors() == set()
    finally:
        worker.close()
    lines = [r.getMessage() for r in caplog.records if "per-layer restore of r: " in r.getMessage()]
    assert len(lines) == 1
    record = json.loads(lines[0].split("per-layer restore of r: ", 1)[1])
    assert record["layers"] == list(LAYERS) and record["device"] == "SimDevice"
    assert all(r is not None and r >= 0 for r in record["ready_ms"])
    assert all(r is not None and r >= 0 for r in record["reached_ms"])
    assert all(w >= 0 for w in record["waited_ms"])


# ---- the same paths on CUDA ----------------------------------------------------------------

_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.gpu
@_NO_GPU
def test_cuda_restore_waits_on_the_layer_events_of_a_late_load_stream() -> None:
    """vLLM's caches on the GPU: a synchronous restore's copies run on the
    load stream held back by a spin kernel; the forward (the current
    stream) waits on each layer's event, then reads exact bytes."""
    store = MemoryStore()
    src = _offload(store)
    kv = _kv(fill=False, device="cuda")
    worker = _worker(store, kv, None)  # the caches' device: a CudaDevice
    assert worker.device is not None and worker.device.torch_device.type == "cuda"
    try:
        worker.begin_step()
        worker.device.launch(worker.load_stream, lambda: torch.cuda._sleep(200_000_000))  # type: ignore[no-untyped-call]
        worker.start_loads([_spec(sync=True)])
        got = {}
        for name in LAYERS:
            worker.wait_layer(name)
            got[name] = kv[name][TARGET].cpu()  # on the current stream, after the wait
        assert all(torch.equal(got[n], _expected(src, n)) for n in LAYERS)
        assert worker.step_errors() == set()
    finally:
        worker.close()


@pytest.mark.gpu
@_NO_GPU
def test_cuda_offload_gathers_after_a_late_forward_and_round_trips() -> None:
    """The forward's write runs late on the current stream (after a spin
    kernel); `save` gathers after it on the save stream; a CUDA restore of
    the objects gives the same bytes."""
    store = MemoryStore()
    src = _kv(fill=True, seed=5, device="cuda")
    kv = _kv(fill=False, device="cuda")
    worker = _worker(store, kv, None)
    try:
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # the forward, late
        for n in LAYERS:
            kv[n][:PAGES].copy_(src[n][:PAGES])
        worker.begin_step()
        worker.save([SaveSpec("s", [(0, h, p) for p, h in enumerate(HASHES)])])
    finally:
        worker.close()
    got = _restored(store)
    assert all(torch.equal(got[n], src[n][:PAGES].cpu()) for n in LAYERS)
    back = _kv(fill=False, device="cuda")
    target = _worker(store, back, None)
    try:
        target.start_loads([_spec(sync=False)])
        assert target.results(wait_s=WAIT_S) == ({"r"}, set())
        assert all(torch.equal(back[n][TARGET], src[n][:PAGES]) for n in LAYERS)
    finally:
        target.close()


# ---- a real Mooncake master ------------------------------------------------------------------


@pytest.mark.mooncake
def test_a_device_round_trip_on_mooncake(sim: SimDevice, mooncake_store: Store,
                                         mooncake_namespace: str) -> None:
    """The simulated device's pinned staging registered with a real Mooncake
    client: offload from device blocks, then a synchronous restore whose
    forward waits on the layer events."""
    ns = mooncake_namespace
    src = _kv(fill=True, seed=9)
    source = _worker(mooncake_store, src, sim, ns)
    try:
        source.begin_step()
        source.save([SaveSpec("s", [(0, h, p) for p, h in enumerate(HASHES)])])
    finally:
        source.close()
    kv = _kv(fill=False)
    worker = _worker(mooncake_store, kv, sim, ns)
    fwd = sim.new_stream()
    try:
        reads = forward(sim, worker, kv, fwd)
        sim.synchronize()
        assert all(torch.equal(reads[n], src[n][:PAGES]) for n in LAYERS)
        assert worker.step_errors() == set()
    finally:
        worker.close()
