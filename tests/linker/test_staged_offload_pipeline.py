"""The staged offload's pipeline (``StagedOffload.run``, depth >= 2): chunk
``k``'s put runs on the offload's put thread while the calling thread stages
chunk ``k + 1``. Every call order of the new thread against the staging:
the overlap itself, a failed put with the next chunk staged, a put that
times out (hosts' rule), a snapshot that raises while a put is in flight,
the last snapshot raising; after each, the ring is idle (every region
returned, none while its put could still read it), ``on_source_free`` ran
exactly once, nothing after a failure was sent, and what was sent is the
independently encoded object. Ordered by events, never sleeps."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from test_staged import LAYOUT, encode, pages

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import OffloadPart, OffloadSegment, StagedOffload
from layerlift.linker.store_base import ForwardingStore, StoreIOError, StoreTimeout

BOUND_S = 10.0  # how long any step here may wait for another (a hang fails, never passes)


class Snap:
    """A snapshot of ``src`` rows that records its reads and can be told
    to raise at chunk ``fail_at`` (0-based); ``started[k]`` is set once read
    ``k`` copied (or is about to raise)."""

    def __init__(self, src: torch.Tensor, log: list[str], fail_at: int | None = None) -> None:
        self.src, self.log, self.fail_at = src, log, fail_at
        self.reads = 0
        self.started: list[threading.Event] = [threading.Event() for _ in range(16)]

    def read(self, seg: OffloadSegment, part: OffloadPart, pages_: torch.Tensor) -> None:
        k = self.reads
        self.reads += 1
        if k == self.fail_at:
            self.log.append(f"snapshot {k} raised")
            self.started[k].set()
            raise RuntimeError(f"snapshot {k} failed")
        pages_.copy_(self.src[seg.lo : seg.hi])
        self.log.append(f"snapshot {k}")
        self.started[k].set()  # after the log entry: the tests order by it


class PutGate(ForwardingStore):
    """Puts wait for ``release[k]`` (when set up) and record their order."""

    def __init__(self, inner: MemoryStore, log: list[str]) -> None:
        super().__init__(inner)
        self.log = log
        self.puts = 0
        self.release: dict[int, threading.Event] = {}
        self.entered: list[threading.Event] = [threading.Event() for _ in range(16)]

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        k = self.puts
        self.puts += 1
        self.entered[k].set()
        gate = self.release.get(k)
        if gate is not None and not gate.wait(BOUND_S):
            raise AssertionError(f"put {k} was never released")
        try:
            self.inner.put(keys, ptrs, sizes)
        finally:
            self.log.append(f"put {k} returned")


def setup(n: int = 4, fail_at: int | None = None
          ) -> tuple[MemoryStore, PutGate, StagingRing, Snap, StagedOffload, list[str],
                     torch.Tensor, list[str]]:
    inner = MemoryStore()
    log: list[str] = []
    store = PutGate(inner, log)
    ring = StagingRing(inner, 8 << 10)  # one object (3012 bytes) per chunk at depth 2
    keys = [f"pipe/p{i}" for i in range(n)]
    src = pages(n, 21)
    snap = Snap(src, log, fail_at)
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], snap, depth=2)
    assert len(off.chunks) == n
    return inner, store, ring, snap, off, keys, src, log


def stored(inner: MemoryStore, keys: list[str], src: torch.Tensor) -> list[bool]:
    """Which keys hold exactly their independently encoded object (others: absent)."""
    out = []
    for i, key in enumerate(keys):
        if not inner.exists([key])[0]:
            out.append(False)
            continue
        assert inner.object_bytes(key) == encode(key, src[i]), f"{key} holds wrong bytes"
        out.append(True)
    return out


def test_the_next_chunk_is_staged_while_a_put_runs() -> None:
    inner, store, ring, snap, off, keys, src, log = setup()
    # Put 0 may return only once chunk 1 was snapshotted: a run that stages
    # after each put returned would never release it (its put fails the test).
    store.release[0] = snap.started[1]
    freed: list[int] = []
    outcome = off.run(lambda: freed.append(1))
    assert outcome.ok and outcome.objects == 4 and freed == [1]
    assert log.index("snapshot 1") < log.index("put 0 returned")
    assert [e for e in log if e.startswith("put")] == [f"put {k} returned" for k in range(4)]
    assert stored(inner, keys, src) == [True] * 4
    assert ring.idle()


@pytest.mark.parametrize("failing", [0, 1, 3])
def test_a_failed_put_sends_nothing_after_it(failing: int) -> None:
    inner, store, ring, _snap, off, keys, src, _log = setup()
    inner.fail_keys([keys[failing]], StoreIOError("injected"))
    freed: list[int] = []
    outcome = off.run(lambda: freed.append(1))
    assert isinstance(outcome.error, StoreIOError) and outcome.objects == failing
    assert store.puts == failing + 1  # the chunk staged behind it was never put
    assert stored(inner, keys, src) == [i < failing for i in range(4)]
    assert freed == [1] and ring.idle()


def test_a_put_that_times_out_hands_its_region_over_and_stops() -> None:
    inner, store, ring, _snap, off, keys, src, _log = setup()
    inner.timeout_s = 0.2
    store.timeout_s = 0.2
    ended = threading.Event()
    off.on_late_end = ended.set
    inner.stall_when("put")  # the first put's call hangs (a stopped master)
    outcome = off.run()
    assert isinstance(outcome.error, StoreTimeout) and outcome.objects == 0
    assert store.puts == 1
    assert not ring.idle()  # the timed-out call still owns its region
    inner.resume()
    assert ended.wait(BOUND_S) and ring.wait_idle(BOUND_S)
    assert stored(inner, keys, src)[1:] == [False] * 3  # nothing after it was sent


@pytest.mark.parametrize("raising", [1, 2, 3])
def test_a_snapshot_that_raises_waits_for_the_put_in_flight(raising: int) -> None:
    inner, store, ring, snap, off, keys, src, log = setup(fail_at=raising)
    store.release[raising - 1] = threading.Event()  # the put before it hangs
    freed: list[int] = []
    result: list[BaseException] = []

    def run() -> None:
        try:
            off.run(lambda: freed.append(1))
        except RuntimeError as exc:
            result.append(exc)
            log.append("run raised")

    t = threading.Thread(target=run)
    t.start()
    assert store.entered[raising - 1].wait(BOUND_S)
    assert snap.started[raising].wait(BOUND_S)
    t.join(0.5)  # a run that left its put behind would have raised by now
    assert t.is_alive() and "run raised" not in log
    store.release[raising - 1].set()
    t.join(BOUND_S)
    assert not t.is_alive() and len(result) == 1
    assert log.index(f"put {raising - 1} returned") < log.index("run raised")
    assert freed == [1] and ring.idle()
    assert stored(inner, keys, src) == [i < raising for i in range(4)]


def test_the_last_snapshot_raising_frees_the_source_once() -> None:
    inner, _store, ring, _snap, off, keys, src, _log = setup(fail_at=3)
    freed: list[int] = []
    with pytest.raises(RuntimeError, match="snapshot 3"):
        off.run(lambda: freed.append(1))
    assert freed == [1] and ring.idle()
    assert stored(inner, keys, src) == [True, True, True, False]


def test_depth_one_stays_sequential() -> None:
    inner = MemoryStore()
    log: list[str] = []
    store = PutGate(inner, log)
    ring = StagingRing(inner, 8 << 10)
    keys = [f"seq/p{i}" for i in range(3)]
    src = pages(3, 22)
    snap = Snap(src, log)
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], snap, depth=1)
    assert len(off.chunks) == 2  # two objects a chunk at depth 1
    assert off.run().ok
    assert log == ["snapshot 0", "put 0 returned", "snapshot 1", "put 1 returned"]
    assert stored(inner, keys, src) == [True] * 3 and ring.idle()


@pytest.mark.parametrize("depth", [2, 4, 8])
@pytest.mark.parametrize("slack", [0, 63])
def test_half_ring_chunks_never_wait_on_the_offload_itself(depth: int, slack: int) -> None:
    """Chunks take half the ring at any depth >= 2: with a ring of exactly
    two chunks' spans and acquires that never wait (``timeout_s=0``), every
    chunk is staged while the one before it is put (a third region would
    raise ``StagingTimeout`` at once and fail the offload)."""
    inner = MemoryStore()
    log: list[str] = []
    store = PutGate(inner, log)
    ring = StagingRing(inner, 2 * 3072 + slack, timeout_s=0.0)  # 3012-byte objects: span 3072
    keys = [f"half/p{i}" for i in range(5)]
    src = pages(5, 23)
    snap = Snap(src, log)
    off = StagedOffload(ring, store, [OffloadPart(LAYOUT, tuple(keys))], snap, depth=depth)
    assert off.regions_held() == 2 and len(off.chunks) == 5
    for k in range(4):  # put k returns only once chunk k + 1 is staged
        store.release[k] = snap.started[k + 1]
    outcome = off.run()
    assert outcome.ok and outcome.objects == 5, outcome
    assert all(log.index(f"snapshot {k + 1}") < log.index(f"put {k} returned") for k in range(4))
    assert stored(inner, keys, src) == [True] * 5 and ring.idle()
