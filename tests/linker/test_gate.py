"""The `Gate` of a load: copies only while it is open, and the reads in
flight of an in-place load (``reading``, ``keep_until``, ``wait_reads``,
``when_quiet``), each ordered by events, never by sleeps."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from layerlift.linker.staged import Gate
from layerlift.linker.store_base import StoreTimeout


def test_a_read_counts_from_its_look_at_the_gate_until_it_exits() -> None:
    gate = Gate()
    with gate.reading() as open_:
        assert open_ and gate.reads == 1 and not gate.wait_reads(0.0)
        gate.close()  # a read issued is not revoked
        assert gate.reads == 1
    assert gate.reads == 0 and gate.wait_reads(0.0)
    with gate.reading() as open_:  # closed: no read starts, none counted
        assert not open_ and gate.reads == 0


def test_a_read_that_raised_is_no_longer_counted() -> None:
    gate = Gate()
    try:
        with gate.reading():
            raise RuntimeError("the read failed")
    except RuntimeError:
        pass
    assert gate.reads == 0


def test_a_timed_out_call_counts_until_it_ended_and_quiet_callbacks_run_once() -> None:
    gate = Gate()
    call: Future[None] = Future()
    exc = StoreTimeout("late", call)
    calls: list[str] = []
    with gate.reading():
        gate.keep_until(exc)
    assert exc.owned and gate.reads == 1
    gate.when_quiet(lambda: calls.append("first"))
    gate.when_quiet(lambda: calls.append("second"))
    assert calls == []
    ended = threading.Event()
    waiter = threading.Thread(target=lambda: ended.set() if gate.wait_reads(10) else None)
    waiter.start()
    assert not ended.is_set()
    call.set_result(None)  # the call ends: its thread runs the callbacks, in order
    waiter.join(10)
    assert ended.is_set() and gate.reads == 0 and calls == ["first", "second"]
    gate.when_quiet(lambda: calls.append("now"))  # quiet: runs at once
    assert calls == ["first", "second", "now"]


def test_a_call_that_never_ran_is_not_waited_for() -> None:
    gate = Gate()
    exc = StoreTimeout("cancelled before it started")  # no future: nothing runs on
    gate.keep_until(exc)
    assert gate.reads == 0 and not exc.owned


def test_a_call_lent_no_memory_is_not_waited_for() -> None:
    """A timed-out session start (``exc.lent`` False: the read itself was
    never issued) runs on but cannot write the destination: not in flight."""
    gate = Gate()
    call: Future[None] = Future()
    call.set_running_or_notify_cancel()
    exc = StoreTimeout("session start", call)
    exc.lent = False
    with gate.reading():
        gate.keep_until(exc)
    assert gate.reads == 0 and gate.wait_reads(0.0) and not exc.owned
    call.set_result(None)
    assert gate.reads == 0
