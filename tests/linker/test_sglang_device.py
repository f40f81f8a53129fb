"""The SGLang linker's device path (``layerlift/hosts/sglang``: ``device``, ``load``,
``offload``) on the simulated device, whose streams really run late, and on CUDA.

Runs in the main environment, without SGLang: the pools are fakes shaped like SGLang's
``MHATokenToKVPool`` (``k_buffer``/``v_buffer`` lists, ``page_size``) and
``HybridReqToTokenPool``'s Mamba pool (``mamba_pool.mamba_cache.temporal``/``conv``,
``mamba_map``), read by the adapter's own layout code (``mha_layers``,
``mamba_layout``); the store is the in-memory one. Objects are stored by the adapter's
host offload path from source pools on the CPU, then loaded into the device pools by
``BatchLoad`` (the batch the linker starts) and read by a forward that waits through
``LoadCounter.wait_until`` and reads on the forward stream.

Each negative control breaks one ordering rule through a monkeypatched seam (production
code is not edited) and must give wrong bytes that the same byte check catches; the real
path passes it: a skipped event wait (``DevicePath.wait``), an event recorded on the
wrong stream (``load.DeviceSink``), staging reused before its event
(``Region.release_after``), an offload gather not ordered after the forward
(``DevicePath.offload_ready``); and a fifth, a load not fenced after earlier forward
work on its slots (``DevicePath.fence_load``). Orders are set with a blocker on a stream (simulation)
or a spin kernel (CUDA), never with sleeps. The ``cuda`` cases are marked ``gpu`` and
skip with a reason where no CUDA device is present.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from layerlift.hosts.sglang import load as load_mod
from layerlift.hosts.sglang.device import DevicePath, gather_units, pool_device, scatter_units
from layerlift.hosts.sglang.layout import PoolLayout, mamba_layout, mha_layers
from layerlift.hosts.sglang.load import BatchLoad, LoadCounter, LoadItem
from layerlift.hosts.sglang.offload import Offloader, OffloadItem
from layerlift.hosts.sglang.quarantine import Quarantine
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.staged import DeviceSink, LoadPart, LoadSegment
from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.overlap.device import Device, DeviceEvent
from layerlift.testing.simdevice import SimDevice, block_stream

WAIT_S = 30.0
PAGE, HEADS, DIM = 4, 2, 8  # fp16 K/V rows of 32 bytes; a KV unit's layer slice: 256 bytes
UNITS = 8  # pages (and Mamba states) per load
SLOTS = 16 * PAGE
STATES = 16
KV_LAYERS = {0: 0, 2: 1}  # stage layer -> index in the KV pool's buffers
MAMBA_MAP = {1: 0, 3: 1}  # stage layer -> index in the Mamba cache
NUM_LAYERS = 4
# A budget of 4 KV units per chunk (4 x 260 bytes): 2 chunks per KV layer, 1 per Mamba
# layer; depth 8 lets every chunk of the load hold staging at once.
DEPTH = 8
RING = DEPTH * (4 * 260 + 64)
FILL = 7.0  # what the destination slots hold before a load


# ---- pools shaped like SGLang's ----------------------------------------------------


def kv_pool(device: torch.device, fill: float | None = None, seed: int = 0) -> SimpleNamespace:
    """Shaped like ``MHATokenToKVPool``: per layer a ``[slots + page, heads, dim]`` buffer."""
    g = torch.Generator().manual_seed(seed)

    def buf() -> torch.Tensor:
        t = torch.randn(SLOTS + PAGE, HEADS, DIM, generator=g).half()
        return (t.fill_(fill) if fill is not None else t).to(device)

    n = len(KV_LAYERS)
    return SimpleNamespace(page_size=PAGE, start_layer=0, k_buffer=[buf() for _ in range(n)],
                           v_buffer=[buf() for _ in range(n)])


def mamba_pool(device: torch.device, fill: float | None = None,
               seed: int = 0) -> SimpleNamespace:
    """Shaped like ``HybridReqToTokenPool``: its ``mamba_pool.mamba_cache`` (temporal and
    conv states, ``[layers, slots, ...]``) and ``mamba_map``."""
    g = torch.Generator().manual_seed(seed + 1)
    states = [torch.randn(len(MAMBA_MAP), STATES, *shape, generator=g)
              for shape in ((4, 4), (3, 4))]
    if fill is not None:
        for s in states:
            s.fill_(fill)
    temporal, conv = (s.to(device) for s in states)
    cache = SimpleNamespace(temporal=temporal, conv=[conv])
    return SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache), mamba_map=MAMBA_MAP,
                           start_layer=0)


@dataclass
class Pools:
    kv: PoolLayout
    mamba: PoolLayout

    @classmethod
    def make(cls, device: torch.device, fill: float | None = None, seed: int = 0) -> Pools:
        kv = kv_pool(device, fill, seed)
        layers = tuple(mha_layers(kv, KV_LAYERS))
        rows = min(int(p.tensor.shape[0]) for lp in layers for p in lp.parts)
        return cls(PoolLayout("kv", "full", PAGE, PAGE, rows, layers),
                   mamba_layout(mamba_pool(device, fill, seed)))

    def layouts(self) -> dict[str, PoolLayout]:
        return {"kv": self.kv, "mamba": self.mamba}


SRC_KV = tuple(range(0, UNITS * PAGE, PAGE))  # the source units' first slots
SRC_STATES = tuple(range(UNITS))
DST_KV = tuple(reversed(range(PAGE, (UNITS + 1) * PAGE, PAGE)))  # other slots, reversed
DST_STATES = tuple(range(STATES - 1, STATES - 1 - UNITS, -1))


def keys(tag: str, pool: str) -> tuple[str, ...]:
    return tuple(f"sgdev/{tag}/{pool}/{i}" for i in range(UNITS))


def layer_bytes(pools: Pools, layer: int, kv_rows: tuple[int, ...],
                states: tuple[int, ...]) -> torch.Tensor:
    """Layer ``layer``'s bytes of the given units (on the host)."""
    for layout, rows in ((pools.kv, kv_rows), (pools.mamba, states)):
        j = layout.position(layer)
        if j is not None:
            return gather_units([layout.layers[j]], rows).cpu()
    raise AssertionError(f"no pool holds layer {layer}")


def store_source(store: MemoryStore, tag: str) -> Pools:
    """Random source pools on the CPU, offloaded by the adapter's host path."""
    src = Pools.make(torch.device("cpu"), seed=zlib.crc32(tag.encode()) % 1000)
    ring = StagingRing(store, 1 << 20)
    offloader = Offloader(store, ring, Quarantine(), 5.0)
    try:
        offloader.submit([OffloadItem(src.kv, keys(tag, "kv"), SRC_KV),
                          OffloadItem(src.mamba, keys(tag, "mamba"), SRC_STATES)])
        assert offloader.wait_completed(1, WAIT_S) and offloader.pop()
    finally:
        offloader.stop(WAIT_S)
    return src


# ---- the devices -------------------------------------------------------------------


@dataclass
class Rig:
    device: Device
    late: Callable[[Any], Callable[[], None]]  # hold a stream; returns its release

    @property
    def where(self) -> torch.device:
        return self.device.torch_device


def sim_rig(seed: int = 3) -> Iterator[Rig]:
    sim = SimDevice(seed=seed, max_delay_s=0.001)
    try:
        yield Rig(sim, lambda stream: block_stream(sim, stream, WAIT_S).set)
    finally:
        sim.close()


def cuda_rig() -> Rig:
    from layerlift.overlap.device import CudaDevice

    device = CudaDevice()

    def late(stream: Any) -> Callable[[], None]:
        device.launch(stream, lambda: torch.cuda._sleep(200_000_000))  # type: ignore[no-untyped-call]
        return lambda: None

    return Rig(device, late)


@pytest.fixture
def sim() -> Iterator[Rig]:
    yield from sim_rig()


_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine")


@pytest.fixture(params=[pytest.param("sim", id="sim"),
                        pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, _NO_GPU])])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    if request.param == "sim":
        yield from sim_rig(seed=11)
    else:
        yield cuda_rig()


# ---- the load and the forward ------------------------------------------------------


def start_load(rig: Rig, store: Any, tag: str, path: DevicePath, *, ring_bytes: int = RING,
               depth: int = DEPTH, bound_s: float = WAIT_S,
               dst: Pools | None = None) -> tuple[BatchLoad, LoadCounter, Pools, StagingRing]:
    """Destination pools on the rig's device (``dst``: these) and the batch the linker
    would start."""
    dst = dst if dst is not None else Pools.make(rig.where, fill=FILL)
    ring = StagingRing(store, ring_bytes, alloc=rig.device.pinned, timeout_s=WAIT_S)
    batch = BatchLoad(0, [LoadItem("r", dst.kv, keys(tag, "kv"), DST_KV),
                          LoadItem("r", dst.mamba, keys(tag, "mamba"), DST_STATES)],
                      NUM_LAYERS, store, bound_s, ring, depth=depth, timeout_s=WAIT_S, path=path)
    counter = LoadCounter(NUM_LAYERS)
    counter.add(batch)
    counter.set_consumer(0)
    return batch, counter, dst, ring


def run_jobs(batch: BatchLoad) -> None:
    """What the linker's scheduler does: each layer's fetch, then its readiness."""
    for job in batch.jobs():
        try:
            job.fetch()
        except Exception as exc:
            batch.readiness.mark_failed(job.layer, exc)
        else:
            batch.readiness.mark_done(job.layer)
    batch.on_quiet()


def forward(path: DevicePath, counter: LoadCounter, dst: Pools) -> dict[int, torch.Tensor]:
    """Per layer: ``wait_until(layer)`` on the forward's thread, then the layer's read
    issued on the forward stream. Returns the reads (complete after a device sync)."""
    out: dict[int, torch.Tensor] = {}
    for layer in range(NUM_LAYERS):
        counter.wait_until(layer)

        def read(layer: int = layer) -> None:
            out[layer] = layer_bytes_device(dst, layer)

        path.device.launch(path.forward_stream, read)
    return out


def layer_bytes_device(pools: Pools, layer: int) -> torch.Tensor:
    for layout, rows in ((pools.kv, DST_KV), (pools.mamba, DST_STATES)):
        j = layout.position(layer)
        if j is not None:
            return gather_units([layout.layers[j]], rows).clone()
    raise AssertionError(layer)


def exact_layers(reads: dict[int, torch.Tensor], src: Pools) -> dict[int, bool]:
    return {layer: torch.equal(got.cpu(), layer_bytes(src, layer, SRC_KV, SRC_STATES))
            for layer, got in reads.items()}


def restore(rig: Rig, store: Any, tag: str, src: Pools, path: DevicePath,
            reads_first: bool = False) -> tuple[dict[int, bool], BatchLoad, StagingRing]:
    """Load while the load stream is held (the copies run after the whole forward was
    issued), then read what the forward read. ``reads_first`` (a control whose forward
    waits on nothing): the forward stream's reads all run before the load stream is
    released, so they run before every copy, whatever the streams' delays."""
    batch, counter, dst, ring = start_load(rig, store, tag, path)
    release = rig.late(path.load_stream)
    try:
        run_jobs(batch)
        issued = rig.device.event()
        issued.record(path.load_stream)  # after every copy of the load
        reads = forward(path, counter, dst)
        if isinstance(rig.device, SimDevice):  # the forward was issued, no copy ran yet
            assert not issued.query(), "wait_until waited on the host for the copies"
        if reads_first:
            ran = rig.device.event()
            ran.record(path.forward_stream)
            ran.synchronize()
    finally:
        release()
    rig.device.synchronize()
    return exact_layers(reads, src), batch, ring


def open_path(rig: Rig) -> DevicePath:
    return DevicePath.open(rig.device, rig.device.new_stream())


# ---- the real path -----------------------------------------------------------------


def test_pool_device_picks_the_host_path_cuda_or_the_injected_device() -> None:
    cpu = Pools.make(torch.device("cpu")).layouts()
    assert pool_device(cpu) is None  # CPU pools: today's host path
    sim = SimDevice(seed=1)
    try:
        assert pool_device(cpu, sim) is sim
    finally:
        sim.close()
    elsewhere = cast(Device, SimpleNamespace(torch_device=torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="keeps its tensors on cuda:0"):
        pool_device(cpu, elsewhere)
    with pytest.raises(ValueError, match=r"on the CPU .* or on a CUDA device"):
        mha_layers(kv_pool(torch.device("meta")), KV_LAYERS)


@pytest.mark.gpu
@_NO_GPU
def test_cuda_pools_route_to_a_cuda_device_path_that_moves_a_chunk() -> None:
    """The linker's route for pools on CUDA (``LayerLiftLinker.__init__``: ``pool_device``
    then ``DevicePath.open``): the pools' own ``CudaDevice``, a load stream on it, and
    one chunk's bytes scattered from pinned staging on that stream, read by the forward
    stream after a device-side wait."""
    from layerlift.overlap.device import CudaDevice

    dst = Pools.make(torch.device("cuda"), fill=FILL)
    found = pool_device(dst.layouts())
    assert isinstance(found, CudaDevice)
    assert found.torch_device == dst.kv.layers[0].parts[0].tensor.device
    assert pool_device(dst.layouts(), found) is found
    path = DevicePath.open(found, found.new_stream())
    assert isinstance(path.load_stream, torch.cuda.Stream)
    assert path.load_stream.device == found.torch_device
    assert len({path.load_stream, path.offload_stream, path.forward_stream}) == 3

    src = Pools.make(torch.device("cpu"), seed=5)
    starts, rows = DST_KV[:2], SRC_KV[:2]
    chunk = found.pinned(2 * dst.kv.layers[0].nbytes).view(2, -1)
    chunk.copy_(gather_units([src.kv.layers[0]], rows))
    path.fence_load()
    found.launch(path.load_stream, lambda: scatter_units(
        dst.kv.layers[0], starts, chunk.to(found.torch_device, non_blocking=True)))
    landed = found.event()
    landed.record(path.load_stream)
    path.wait(landed)
    out: list[torch.Tensor] = []
    found.launch(path.forward_stream,
                 lambda: out.append(gather_units([dst.kv.layers[0]], starts).clone()))
    found.synchronize()
    assert torch.equal(out[0].cpu(), chunk)


@pytest.mark.gpu
@_NO_GPU
def test_a_load_on_the_path_found_from_cuda_pools_lands_exactly() -> None:
    """The batch the linker starts, on the ``DevicePath`` that ``pool_device`` found for
    CUDA pools (not a device the test made), with its load stream held by a spin kernel
    until the whole forward was issued: every layer lands exactly."""
    store = MemoryStore()
    src = store_source(store, "route")
    dst = Pools.make(torch.device("cuda"), fill=FILL)
    found = pool_device(dst.layouts())
    assert found is not None
    path = DevicePath.open(found, found.new_stream())
    rig = Rig(found, lambda stream: lambda: None)
    batch, counter, dst, ring = start_load(rig, store, "route", path, dst=dst)
    found.launch(path.load_stream, lambda: torch.cuda._sleep(200_000_000))  # type: ignore[no-untyped-call]
    run_jobs(batch)
    reads = forward(path, counter, dst)
    found.synchronize()
    assert exact_layers(reads, src) == dict.fromkeys(range(NUM_LAYERS), True)
    assert batch.finish()
    assert batch.staged.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S)


def test_the_load_lands_every_layer_exactly_on_the_device(rig: Rig) -> None:
    store = MemoryStore()
    src = store_source(store, "exact")
    path = open_path(rig)
    exact, batch, ring = restore(rig, store, "exact", src, path)
    assert exact == dict.fromkeys(range(NUM_LAYERS), True)
    assert [len(c) for c in batch.staged.chunks] == [2, 1, 2, 1]
    assert batch.finish()
    assert batch.staged.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S)


def test_a_load_larger_than_the_ring_reuses_staging_only_after_its_events(rig: Rig) -> None:
    """Two units per chunk through a ring of two chunks, copies running late at random:
    every region is reused many times, each only once its copy's event completed."""
    store = MemoryStore()
    src = store_source(store, "stream")
    path = open_path(rig)
    batch, counter, dst, ring = start_load(rig, store, "stream", path,
                                           ring_bytes=2 * (2 * 260 + 64), depth=2)
    assert sum(len(c) for c in batch.staged.chunks) >= 12
    done = threading.Thread(target=run_jobs, args=(batch,))
    done.start()
    reads = forward(path, counter, dst)
    done.join(WAIT_S)
    rig.device.synchronize()
    assert exact_layers(reads, src) == dict.fromkeys(range(NUM_LAYERS), True)
    assert batch.finish()
    assert ring.wait_idle(WAIT_S)


def test_a_corrupt_layer_is_zeroed_on_the_load_stream_after_its_first_chunk(rig: Rig) -> None:
    """Layer 2's second chunk fails its checksum after its first chunk's copy was issued:
    the zeroing runs on the load stream after that copy, the forward waits on it, and
    the batch fails. The other layers land."""
    store = MemoryStore()
    src = store_source(store, "bad")
    key = keys("bad", "kv")[UNITS - 1]  # in layer 2's second chunk
    obj = bytearray(store.object_bytes(key))
    obj[src.kv.slices[1][0]] ^= 0xFF  # one byte of its layer-2 slice
    store.replace_object(key, bytes(obj))
    path = open_path(rig)
    batch, counter, dst, ring = start_load(rig, store, "bad", path)
    release = rig.late(path.load_stream)
    run_jobs(batch)
    assert batch.landed == [True, True, False, True]
    reads = forward(path, counter, dst)
    release()
    rig.device.synchronize()
    assert exact_layers(reads, src) == {0: True, 1: True, 2: False, 3: True}
    assert not bool(reads[2].any()), "the failed layer's slots are not zeroed"
    assert not batch.finish()
    assert batch.staged.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S)


class HeldReads(ForwardingStore):
    """Forwards to ``inner``; from the ``after``-th ranged read on, each waits for
    ``go`` (a read that outlives the load's bound)."""

    def __init__(self, inner: Store, after: int) -> None:
        super().__init__(inner)
        self.after, self.calls, self.go = after, 0, threading.Event()

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self.calls += 1
        if self.calls > self.after:
            assert self.go.wait(WAIT_S)
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

    def close(self) -> None:
        pass


def test_layers_past_the_bound_are_zeroed_and_a_late_read_never_lands(rig: Rig) -> None:
    """Layers 2 and 3's reads outlive the batch's bound: the forward's wait returns at
    the bound, their slots are zeroed on the load stream (after layers 0 and 1's
    copies) and the forward waits on that; the reads that end later find the gate
    shut and issue no copy."""
    store = MemoryStore()
    src = store_source(store, "late")
    held = HeldReads(store, after=3)  # layer 0: two chunks, layer 1: one
    path = open_path(rig)
    batch, counter, dst, ring = start_load(rig, held, "late", path, bound_s=1.0)
    release = rig.late(path.load_stream)
    jobs = threading.Thread(target=run_jobs, args=(batch,))
    jobs.start()
    try:
        reads = forward(path, counter, dst)  # returns by the bound
    finally:
        release()
        held.go.set()
    jobs.join(WAIT_S)
    assert batch.staged.wait_quiet(WAIT_S)
    rig.device.synchronize()
    assert batch.landed == [True, True, False, False]
    assert exact_layers(reads, src) == {0: True, 1: True, 2: False, 3: False}
    assert not bool(reads[2].any()) and not bool(reads[3].any())
    assert not batch.finish()
    rig.device.synchronize()
    after = {layer: layer_bytes_device(dst, layer).cpu() for layer in (2, 3)}
    assert not any(bool(t.any()) for t in after.values()), "a late read reached the slots"
    assert ring.wait_idle(WAIT_S)


def offload_written(rig: Rig, path: DevicePath, ready: Callable[[], list[DeviceEvent]], *,
                    ordered: bool = True) -> tuple[bytes, bytes, bytes]:
    """The forward writes new bytes into the units on the forward stream, late; the
    offload (with the events ``ready`` records) gathers them into pinned staging.
    ``ordered``: the forward is released while the offload waits (the events order
    them); else only after the offload ended (a control's gather did not wait).
    Returns (stored page bytes, the bytes the forward wrote, the bytes before)."""
    store = MemoryStore()
    pools = Pools.make(rig.where, seed=5)
    before = gather_units(pools.kv.layers, DST_KV).cpu().numpy().tobytes()
    release = rig.late(path.forward_stream)
    fresh = [p.tensor for lp in pools.kv.layers for p in lp.parts]

    def write() -> None:  # the forward's write of the slots
        for t in fresh:
            t.fill_(3.0)

    rig.device.launch(path.forward_stream, write)
    ring = StagingRing(store, 1 << 20, alloc=rig.device.pinned, timeout_s=WAIT_S)
    offloader = Offloader(store, ring, Quarantine(), 5.0, path=path)
    try:
        offloader.submit([OffloadItem(pools.kv, keys("off", "kv"), DST_KV)], ready())
        if ordered:  # the forward runs while the offload waits on its event
            threading.Thread(target=release).start()
        assert offloader.wait_completed(1, WAIT_S) and offloader.pop()
    finally:
        release()
        offloader.stop(WAIT_S)
    rig.device.synchronize()
    written = gather_units(pools.kv.layers, DST_KV).cpu().numpy().tobytes()
    page = pools.kv.page_bytes
    stored = b"".join(store.object_bytes(k)[:page] for k in keys("off", "kv"))
    return stored, written, before


def test_an_offload_gathers_after_the_forward_that_wrote_the_slots(rig: Rig) -> None:
    path = open_path(rig)
    stored, written, before = offload_written(rig, path, path.offload_ready)
    assert written != before
    assert stored == written


# ---- the four negative controls (simulated device) ---------------------------------


def test_control_a_skipped_event_wait_reads_wrong_bytes(
        sim: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    src = store_source(store, "skip")
    monkeypatch.setattr(DevicePath, "wait", lambda self, event: None)
    exact, _, _ = restore(sim, store, "skip", src, open_path(sim), reads_first=True)
    assert not any(exact.values()), \
        f"the control did not catch a forward that skipped its event waits: {exact}"


class WrongStreamSink(DeviceSink):
    """Control: each chunk's event is recorded on another stream than its copies'."""

    def __init__(self, device: Device, scatter: Callable[[LoadSegment, LoadPart, torch.Tensor],
                                                          None], stream: Any = None) -> None:
        super().__init__(device, scatter, stream)
        self.other = device.new_stream()

    def issue(self, work: Callable[[], None]) -> DeviceEvent:
        self.device.launch(self.stream, work)
        event = self.device.event()
        event.record(self.other)
        return event


def test_control_an_event_on_the_wrong_stream_reads_wrong_bytes(
        sim: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    src = store_source(store, "wrong")
    monkeypatch.setattr(load_mod, "DeviceSink", WrongStreamSink)
    # The forward's reads run before the load stream is let go: the events it
    # waits on complete on the other stream, so nothing holds the reads back
    # (without reads_first, a slow forward stream could run them after the
    # copies on a busy machine and read the right bytes by luck).
    exact, _, _ = restore(sim, store, "wrong", src, open_path(sim), reads_first=True)
    assert not any(exact.values()), \
        f"the control did not catch events recorded on the wrong stream: {exact}"


def test_control_staging_reused_before_its_event_gives_wrong_bytes(
        sim: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The regions return at once: a KV layer's second chunk reads into its first
    chunk's region before that chunk's copy ran, which then copies the second's rows."""
    store = MemoryStore()
    src = store_source(store, "reuse")
    monkeypatch.setattr(Region, "release_after", lambda self, event: self.release())
    exact, _, _ = restore(sim, store, "reuse", src, open_path(sim))
    assert not exact[0] and not exact[2], \
        f"the control did not catch staging reused before its copy's event: {exact}"


def test_control_an_offload_gather_not_ordered_after_the_forward_stores_old_bytes(
        sim: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The events are recorded on the offload caller's stream only (not the forward's):
    the gather runs before the forward's late write and stores the old bytes."""
    path = open_path(sim)

    def current_only(self: DevicePath) -> list[DeviceEvent]:
        event = self.device.event()
        event.record(self.device.current_stream())
        return [event]

    monkeypatch.setattr(DevicePath, "offload_ready", current_only)
    stored, written, before = offload_written(sim, path, path.offload_ready, ordered=False)
    assert stored != written, "the control did not catch a gather before the forward's write"
    assert stored == before



@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-unfenced"])
def test_a_load_is_ordered_after_earlier_forward_work_on_its_slots(
        sim: Rig, monkeypatch: pytest.MonkeyPatch, fenced: bool) -> None:
    """The slots' previous forward still writes them, late, on the forward stream when
    the batch starts: the load stream's fence (``DevicePath.fence_load``) makes the
    copies land after that write. Its control (no fence) lets the copies run first,
    and the late write then leaves other bytes than the stored ones."""
    store = MemoryStore()
    tag = f"fence-{fenced}"
    src = store_source(store, tag)
    path = open_path(sim)
    if not fenced:
        monkeypatch.setattr(DevicePath, "fence_load", lambda self: None)
    dst = Pools.make(sim.where, fill=FILL)
    slots = [p.tensor for layout in (dst.kv, dst.mamba) for lp in layout.layers
             for p in lp.parts]
    release = sim.late(path.forward_stream)

    def earlier_forward() -> None:  # the previous owner's forward writes the slots
        for t in slots:
            t.fill_(-1.0)

    sim.device.launch(path.forward_stream, earlier_forward)
    batch, counter, dst, _ = start_load(sim, store, tag, path, dst=dst)
    try:
        run_jobs(batch)
        if not fenced:  # the copies run at once; the late write comes after them
            for event in batch.staged.events:
                assert event is not None
                event.synchronize()
    finally:
        release()
    reads = forward(path, counter, dst)
    sim.device.synchronize()
    exact = exact_layers(reads, src)
    assert all(exact.values()) is fenced, exact
    if not fenced:
        assert not any(exact.values()), f"the control did not catch an unfenced load: {exact}"
