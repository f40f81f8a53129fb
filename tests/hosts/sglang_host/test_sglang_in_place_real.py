"""In-place offloads inside SGLang's real cache, on a real mooncake_master
(``layerlift/hosts/sglang/offload_in_place.py``; every order on fake pools is
``tests/linker/test_sglang_in_place.py``, the real size ``test_sglang_real_size.py``).

- Objects put from SGLang's slots restore byte-exact in another cache, in one
  call or many; SGLang's pools are registered once and unregistered at close.
- ``flush_cache`` while an in-place put reads the slots past the reset's bound:
  the reset returns in its bound, the put's keys are withheld while it runs
  and removed once it ended, though it stored the slots' new bytes; no cache
  ever restores those bytes, and the next offload of the prompt stores it again.
- A put that outlives its timeout on a stopped master keeps the node locked
  (no result) until the call ended, then the prompt restores exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sglang_testkit import PAGE, RawStore, assert_restored, hook_store, scribble, tokens

from layerlift.hosts.sglang import offload_in_place as oip
from layerlift.testing.faults import ProcessStall
from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

Make = Callable[..., SGLangHost]
WAIT_S = 30.0


@pytest.mark.parametrize("calls", ["one call", "one object a call"])
def test_objects_put_from_the_slots_restore_exactly(calls: str, make_host: Make,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if calls != "one call":
        monkeypatch.setattr(oip, "FIRST_BYTES", 1)
        monkeypatch.setattr(oip, "PUT_BYTES", 1)
    a = make_host(in_place_min_kib=0)
    offloader = a.linker._offloader
    assert set(offloader.in_place) == {"kv", "swa", "mamba"}
    seen = hook_store(a)
    toks = tokens(4, seed=61)
    a.compute(toks, [4 * PAGE])
    assert a.settle_offloads() >= 1
    puts = [keys for call, keys in seen.calls if call == "put_parts"]
    assert puts and not [c for c, _ in seen.calls if c == "put"], "not put in place"
    if calls != "one call":
        assert all(len(keys) == 1 for keys in puts)
    assert offloader._registered, "SGLang's pools were never registered"
    b = make_host(segment_mib=0)
    r = b.restore([*toks, 1])
    assert r.ok and r.hit_tokens == 4 * PAGE
    assert_restored(b, r, toks)
    a.close()
    assert offloader._registered is None, "close left SGLang's pools registered"


def test_a_flush_during_an_in_place_put_never_leaves_the_new_bytes_offered(
        make_host: Make, raw: RawStore) -> None:
    a = make_host(timeout_s=0.5, in_place_min_kib=0)
    entered, gate = threading.Event(), threading.Event()
    first: list[list[str]] = []

    def held(keys: list[str]) -> None:
        if not first:
            first.append(keys)
            entered.set()
            assert gate.wait(WAIT_S)

    hook_store(a, put_parts=held)
    toks = tokens(3, seed=62)
    a.compute(toks, [3 * PAGE])
    assert entered.wait(WAIT_S), "no in-place put started"
    started = time.perf_counter()
    a.flush_cache()
    assert time.perf_counter() - started < 0.5 + 1.0 + 1.0, "the reset outwaited its bound"
    offloader, quarantine = a.linker._offloader, a.linker.quarantine
    keys = first[0]
    assert all(quarantine.held(keys)), "the put's keys are offered while it runs"
    scribble(a)  # the freed slots get other bytes; the put still reads them
    gate.set()
    with offloader._cond:
        assert offloader._cond.wait_for(lambda: not offloader._flights, WAIT_S)
    with offloader._cond:  # the repair removes what the late put stored
        assert offloader._cond.wait_for(lambda: not len(quarantine), WAIT_S)
    assert not any(raw.store.exists(keys)), "the reused slots' bytes stayed in the store"
    b = make_host(segment_mib=0)
    r = b.restore([*toks, 1])
    assert r.hit_tokens == 0 or (r.ok and r.loaded_tokens < 3 * PAGE), \
        "a cache restored the prompt from objects of other bytes"
    a.compute(toks, [3 * PAGE])  # recomputed and offloaded again: stored afresh
    assert a.settle_offloads() >= 1
    c = make_host(segment_mib=0)
    again = c.restore([*toks, 1])
    assert again.ok and again.hit_tokens == 3 * PAGE
    assert_restored(c, again, toks)


def test_a_put_that_outlives_its_timeout_keeps_the_node_locked_until_it_ended(
        make_host: Make, stall: ProcessStall) -> None:
    a = make_host(timeout_s=1.0, in_place_min_kib=0)
    stopped: list[bool] = []

    def stop_master(keys: list[str]) -> None:
        if not stopped:
            stopped.append(True)
            stall.stop()

    hook_store(a, put_parts=stop_master)
    toks = tokens(3, seed=63)
    a.compute(toks, [3 * PAGE])
    offloader = a.linker._offloader
    with offloader._cond:
        assert offloader._cond.wait_for(lambda: offloader.timed_out == 1, WAIT_S)
    a.cache.check_hicache_events()
    assert a.linker.num_completed_offloads() == 0, "a result while the put reads the slots"
    assert a.cache.linker.pending_offloads, "SGLang unlocked the node under a running put"
    stall.resume()
    assert a.settle_offloads() >= 1
    assert offloader.timed_out == 0
    b = make_host(segment_mib=0)
    r = b.restore([*toks, 1])
    assert r.ok and r.hit_tokens == 3 * PAGE, "the late put did not land"
    assert_restored(b, r, toks)
