"""LayerReadiness and CombinedReadiness without a scheduler: producers are plain threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from overlap_fakes import WAIT_S

from layerlift.overlap import (
    CombinedReadiness,
    LayerLoadCancelled,
    LayerLoadError,
    LayerReadiness,
    LayerWaitTimeout,
    LoadPolicy,
    wait_all,
)

REQS = frozenset({"a", "b"})


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        LayerReadiness(0)
    with pytest.raises(ValueError, match="default_timeout"):
        LayerReadiness(2, default_timeout=0)


def test_wait_returns_after_mark_done_from_other_thread() -> None:
    r = LayerReadiness(3, requests=REQS)
    waiting = threading.Event()
    woke: list[int] = []

    def consumer() -> None:
        waiting.set()
        r.wait(1, WAIT_S)
        woke.append(1)

    t = threading.Thread(target=consumer)
    t.start()
    assert waiting.wait(WAIT_S)
    assert not r.done(1)
    r.mark_done(1)
    t.join(WAIT_S)
    assert woke == [1]
    assert r.done(1) and not r.done(0) and not r.all_done()
    r.mark_done(0)
    r.mark_done(2)
    assert r.all_done() and r.settled()


def test_wait_timeout_and_default_timeout() -> None:
    r = LayerReadiness(2, default_timeout=0.02)
    with pytest.raises(LayerWaitTimeout) as info:
        r.wait(0)  # default timeout from the constructor
    assert info.value.layer == 0
    with pytest.raises(LayerWaitTimeout):
        r.wait(1, 0.01)
    r.mark_done(1)
    r.wait(1, 0.0)  # already done: a zero timeout still succeeds


def test_failure_marks_later_layers_for_affected_requests_only() -> None:
    r = LayerReadiness(5, requests=REQS)
    r.mark_done(0)
    r.mark_done(1)
    cause = OSError("store read failed")
    r.mark_failed(2, cause, {"a"})
    for layer in (2, 3, 4):
        with pytest.raises(LayerLoadError) as info:
            r.wait(layer, 0.01)
        assert info.value.layer == 2
        assert info.value.cause is cause and info.value.__cause__ is cause
        assert info.value.requests == frozenset({"a"})
        with pytest.raises(LayerLoadError):
            r.wait(layer, 0.01, requests=frozenset({"a"}))
    r.wait(1, 0.01)  # earlier layers still fine
    r.mark_done(2)
    r.wait(2, 0.01, requests=frozenset({"b"}))  # unaffected request: done
    assert r.done(2, requests=frozenset({"b"})) and not r.done(2)
    assert r.failed(3) and not r.failed(3, requests=frozenset({"b"}))
    assert r.failed_requests() == frozenset({"a"})
    assert not r.all_done()


def test_unaffected_waiter_keeps_waiting_after_foreign_failure() -> None:
    r = LayerReadiness(2, requests=REQS)
    r.mark_failed(0, RuntimeError("x"), {"a"})
    with pytest.raises(LayerWaitTimeout):
        r.wait(0, 0.02, requests=frozenset({"b"}))


def test_whole_batch_failure_and_cancel() -> None:
    r = LayerReadiness(3, requests=REQS)
    r.mark_done(0)
    r.cancel()
    r.wait(0, 0.01)
    with pytest.raises(LayerLoadCancelled) as info:
        r.wait(1, 0.01, requests=frozenset({"b"}))
    assert info.value.cause is None
    assert r.failed_requests() == REQS
    anonymous = LayerReadiness(2)  # no request ids known: a failure concerns everyone
    anonymous.mark_failed(1, ValueError("boom"))
    with pytest.raises(LayerLoadError):
        anonymous.wait(1, 0.01, requests=frozenset({"z"}))


async def test_ready_resolves_from_other_thread_and_raises_on_failure() -> None:
    r = LayerReadiness(3, requests=REQS)
    waiter = asyncio.create_task(r.ready(1))
    threading.Thread(target=r.mark_done, args=(1,)).start()
    await asyncio.wait_for(waiter, WAIT_S)
    failing = asyncio.create_task(r.ready(2))
    threading.Thread(target=r.mark_failed, args=(2, KeyError("k"))).start()
    with pytest.raises(LayerLoadError):
        await asyncio.wait_for(failing, WAIT_S)


async def test_ready_waits_for_landed_when_an_event_is_given() -> None:
    class FakeEvent:
        waited = 0

        def wait(self, stream: object = None) -> None:
            FakeEvent.waited += 1

        def synchronize(self) -> None: ...

        def query(self) -> bool:
            return True

    r = LayerReadiness(1)
    r.mark_done(0, FakeEvent())
    r.wait(0, 0.01)  # the forward passes once the copy is recorded ...
    assert FakeEvent.waited == 1  # ... after making its stream wait on the event
    pending = asyncio.create_task(r.ready(0))
    done, _ = await asyncio.wait([pending], timeout=0.02)
    assert not done  # ready() means landed: not before mark_landed
    r.mark_landed(0)
    await asyncio.wait_for(pending, WAIT_S)


async def test_cancelled_ready_leaves_no_waiter() -> None:
    r = LayerReadiness(1)
    waiter = asyncio.create_task(r.ready(0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert r._entries[0].waiters == []
    r.mark_done(0)
    await r.ready(0)


def test_combined_waits_for_every_part() -> None:
    own, other = LayerReadiness(2, requests=REQS), LayerReadiness(2, requests=frozenset({"c"}))
    both = CombinedReadiness([own, other])
    own.mark_done(0)
    assert not both.done(0)
    with pytest.raises(LayerWaitTimeout):
        both.wait(0, 0.02)
    other.mark_done(0)
    both.wait(0, 0.01)
    wait_all([own, other], 0, 0.01)
    other.mark_failed(1, OSError("peer load failed"))
    with pytest.raises(LayerLoadError):
        both.wait(1, 0.01)
    assert both.failed_requests() == frozenset({"c"})
    with pytest.raises(ValueError, match="same number of layers"):
        CombinedReadiness([own, LayerReadiness(3)])


async def test_combined_ready() -> None:
    a, b = LayerReadiness(1), LayerReadiness(1)
    waiter = asyncio.create_task(CombinedReadiness([a, b]).ready(0))
    a.mark_done(0)
    b.mark_done(0)
    await asyncio.wait_for(waiter, WAIT_S)


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("barrier", LoadPolicy.BARRIER),
        ("OVERLAP", LoadPolicy.OVERLAP),
        (" groups", LoadPolicy.GROUPS),
    ],
)
def test_policy_parse(text: str, policy: LoadPolicy) -> None:
    assert LoadPolicy.parse(text) is policy


def test_policy_parse_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="barrier, overlap, groups"):
        LoadPolicy.parse("eager")
