"""A store call owns the caller's memory until it really ended.

A call that times out goes on running (Mooncake's worker keeps it; a stopped
master resumes). The `StoreTimeout` carries it: `wait_finished()` blocks until
it ended and says whether it succeeded. Both backends: `MemoryStore.stall()`
models the stopped master; for Mooncake the test stops a real
`mooncake_master` with SIGSTOP and resumes it with SIGCONT.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch

from layerlift.linker.daemon_pool import DaemonPool
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store, StoreTimeout, call_bounded
from layerlift.testing.faults import ProcessStall

SIZE = 4096


class Stall:
    """Stops and resumes a store's server side."""

    def __init__(self, stop: Callable[[], None], resume: Callable[[], None]) -> None:
        self.stop, self.resume = stop, resume


@pytest.fixture(scope="module")
def stoppable_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master of this module's own (stopping the session's would stall other tests)."""
    log = tmp_path_factory.mktemp("stall") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def stalled(request: pytest.FixtureRequest) -> Iterator[tuple[Store, Stall, str]]:
    if request.param == "memory":
        mem = MemoryStore(timeout_s=0.3)
        yield mem, Stall(mem.stall, mem.resume), "mem"
        mem.close()
        return
    master: EmbeddedMaster = request.getfixturevalue("stoppable_master")
    store = MooncakeStore(master.config(global_segment_size=32 << 20,
                                        local_buffer_size=16 << 20, timeout_s=0.5))
    assert master.pid is not None
    stall = ProcessStall(master.pid)
    try:
        yield store, Stall(stall.stop, stall.resume), f"stall-{uuid.uuid4().hex[:8]}"
    finally:
        stall.release()
        store.close()


def test_a_timed_out_put_lands_later_with_the_bytes_of_its_memory(
        stalled: tuple[Store, Stall, str]) -> None:
    """The put keeps reading the caller's buffer after its timeout: the
    caller must keep the buffer until `wait_finished()` returned. Here the
    buffer is kept (and unchanged), so the object that lands is exact."""
    store, stall, ns = stalled
    src = torch.arange(SIZE, dtype=torch.int32).to(torch.uint8)
    store.register(src)
    stall.stop()
    try:
        with pytest.raises(StoreTimeout) as info:
            store.put([f"{ns}/a"], [src.data_ptr()], [SIZE])
    finally:
        stall.resume()
    assert info.value.future is not None, "a running call must travel with its StoreTimeout"
    assert info.value.wait_finished(30.0), "the put should succeed once the master resumed"
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    store.register(dst)
    assert store.get([f"{ns}/a"], [dst.data_ptr()], [SIZE]) == [True]
    assert torch.equal(dst, src)


def test_memory_store_applies_a_stalled_put_at_resume_reading_the_memory_then() -> None:
    """Negative control of the rule: a caller that reuses the buffer right
    after the timeout gets its *new* bytes stored under the old key (the
    bug this project had), which is why callers wait."""
    store = MemoryStore(timeout_s=0.2)
    src = torch.full((SIZE,), 1, dtype=torch.uint8)
    store.register(src)
    store.stall()
    with pytest.raises(StoreTimeout) as info:
        store.put(["k"], [src.data_ptr()], [SIZE])
    assert store.timed_out.is_set()
    src.fill_(2)  # reused too early
    store.resume()
    assert info.value.wait_finished(30.0)
    assert store.object_bytes("k") == bytes([2]) * SIZE


def test_a_queued_call_is_cancelled_at_its_timeout() -> None:
    """A call that never started is cancelled: nothing runs on, the
    StoreTimeout carries no future, and the pool drains."""
    pool = DaemonPool(1, "test")
    gate, ran = threading.Event(), threading.Event()
    blocker: Future[None] = pool.submit(gate.wait)  # occupies the only worker
    with pytest.raises(StoreTimeout) as info:
        call_bounded(pool.submit, ran.set, 0.05, "queued")
    assert info.value.future is None
    assert not info.value.wait_finished(0)
    gate.set()
    blocker.result(10)
    assert pool.wait_idle(10), "a cancelled call must not count as pending forever"
    assert not ran.is_set()
    pool.stop()


@pytest.mark.mooncake
def test_a_timed_out_session_start_that_succeeds_is_ended(
        stoppable_master: EmbeddedMaster) -> None:
    """The session start runs on after its timeout and succeeds once the
    master resumes; the store ends that session itself (nobody holds it), so
    a later session over the same keys opens and reads normally."""
    store = MooncakeStore(stoppable_master.config(global_segment_size=32 << 20,
                                                  local_buffer_size=16 << 20, timeout_s=0.5))
    ns = f"sess-{uuid.uuid4().hex[:8]}"
    pid = stoppable_master.pid
    assert pid is not None
    try:
        src = torch.arange(SIZE, dtype=torch.int32).to(torch.uint8)
        store.register(src)
        stall = ProcessStall(pid)
        timed_out: StoreTimeout | None = None
        # The precondition is a session start that times out. On a loaded
        # machine a start was once answered with the master just stopped
        # (not understood; see the vLLM stopped-master test): such an
        # attempt proves nothing, so it is ended and tried on a new key.
        for attempt in range(3):
            key = f"{ns}/a{attempt}"
            store.put([key], [src.data_ptr()], [SIZE])
            stall.stop()
            try:
                with store.open_session([key]):
                    pass
            except StoreTimeout as exc:
                timed_out = exc
                break
            finally:
                stall.release()
        assert timed_out is not None, "no session start timed out with the master stopped"
        assert timed_out.future is not None
        assert not timed_out.lent, "a session start was lent memory (in-place loads wait on it)"
        timed_out.future.exception(30.0)  # the orphan's end runs in its done callback
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        store.register(dst)
        with store.open_session([key]):
            store.get_ranges([key], [[dst.data_ptr()]], [[SIZE]], [[0]])
        assert torch.equal(dst, src)
    finally:
        store.close()


@pytest.mark.parametrize("size", [1, 1 << 20, 8 << 20, (16 << 20) - 1])
def test_a_segment_below_the_minimum_is_refused_up_front(size: int) -> None:
    """Mooncake 0.3.13 cannot mount a segment under 16 MiB and its setup error
    blames the master; the config says what is wrong instead."""
    from layerlift.linker.mooncake_config import MooncakeConfig

    with pytest.raises(ValueError, match="at least 16 MiB"):
        MooncakeConfig(master_address="127.0.0.1:5000", global_segment_size=size)
    MooncakeConfig(master_address="127.0.0.1:5000", global_segment_size=0)
    MooncakeConfig(master_address="127.0.0.1:5000", global_segment_size=16 << 20)
