"""The SGLang linker's in-place offloads (``layerlift/hosts/sglang/offload_in_place.py``)
in every order, on fake pools shaped like SGLang's (``test_sglang_device``'s) and the
in-memory store; the same on SGLang's real cache and a real mooncake_master is in
``tests/hosts/sglang_host/test_sglang_in_place_real.py``.

- In-place objects are byte for byte the staged path's objects, in one call or many.
- A ``quiesce`` that outwaits its bound while a put reads the slots holds that put's
  keys: never offered, never removed, never rewritten while the call runs; removed
  once it ended, whatever bytes it stored. Within its bound, nothing is held.
- A ``quiesce`` between two chunks (after a chunk's footers, or before them) sends
  nothing after it; a failed chunk ends the offload; an error while a put runs
  returns only after that put ended.
- A put that timed out gives its result only once the call ended (the node stays
  locked while the call reads its slots).
- Pools the store refuses to register fail that offload only; the next registers.

Orders are forced with events; every test ends with the checks: no region of the
ring held, no flight in the air, no hold left in the quarantine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from test_sglang_device import SRC_KV, SRC_STATES, UNITS, Pools, keys

from layerlift.hosts.sglang import offload_in_place as oip
from layerlift.hosts.sglang.offload import Offloader, OffloadItem
from layerlift.hosts.sglang.quarantine import Quarantine
from layerlift.hosts.sglang.settings import LinkerSettings
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.store_base import ForwardingStore, StoreError, StoreIOError

WAIT_S = 30.0


class GatedStore(ForwardingStore):
    """Forwards to a store; ``put_parts`` number ``gate_at`` (1 = the first)
    sets ``entered`` and waits for ``gate``; ``fail_at`` raises ``fail``
    instead; ``refuse_register`` refuses that many registrations."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.entered, self.gate = threading.Event(), threading.Event()
        self.gate_at: int | None = None
        self.fail_at: int | None = None
        self.refuse_register = 0
        self.put_keys: list[list[str]] = []
        self._lock = threading.Lock()

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        with self._lock:
            self.put_keys.append(list(keys))
            n = len(self.put_keys)
        if n == self.fail_at:
            raise StoreIOError("injected: the transfer failed")
        if n == self.gate_at:
            self.entered.set()
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.inner.put_parts(keys, ptrs, sizes)

    def register(self, buffer: Any, nbytes: int | None = None) -> int:
        if self.refuse_register:
            self.refuse_register -= 1
            raise StoreError("injected: registration refused")
        return self.inner.register(buffer, nbytes)

    def close(self) -> None:
        pass


class Rig:
    """Source pools, an offloader putting them in place, and its store."""

    def __init__(self, tag: str, *, in_place: bool = True, inner: MemoryStore | None = None,
                 remove_bound_s: float = 1.0) -> None:
        self.tag = tag
        self.inner = inner or MemoryStore(timeout_s=WAIT_S)
        self.store = GatedStore(self.inner)
        self.pools = Pools.make(torch.device("cpu"), seed=5)
        self.ring = StagingRing(self.store, 1 << 20, timeout_s=WAIT_S)
        self.quarantine = Quarantine()
        layouts = [self.pools.kv, self.pools.mamba] if in_place else []
        self.offloader = Offloader(self.store, self.ring, self.quarantine, remove_bound_s,
                                   in_place=layouts)
        self.kv_keys, self.mamba_keys = keys(tag, "kv"), keys(tag, "mamba")

    def items(self) -> list[OffloadItem]:
        return [OffloadItem(self.pools.kv, self.kv_keys, SRC_KV),
                OffloadItem(self.pools.mamba, self.mamba_keys, SRC_STATES)]

    @property
    def all_keys(self) -> list[str]:
        return [*self.kv_keys, *self.mamba_keys]

    def offload(self) -> bool:
        self.offloader.submit(self.items())
        assert self.offloader.wait_completed(1, WAIT_S), "the offload never ended"
        return self.offloader.pop()

    def scribble(self) -> None:
        """Other bytes in every slot (what SGLang's reuse after a flush leaves)."""
        for lp in (*self.pools.kv.layers, *self.pools.mamba.layers):
            for part in lp.parts:
                part.tensor.fill_(3.0)

    def wait_landed(self) -> None:
        off = self.offloader
        with off._cond:
            assert off._cond.wait_for(lambda: not off._flights, WAIT_S), "a flight never landed"

    def check(self) -> None:
        """No region held, no flight, no hold: what every path ends with."""
        self.wait_landed()
        assert self.ring.wait_idle(WAIT_S), f"staging still held: {self.ring.live()}"
        assert not any(self.quarantine.held(self.all_keys)), "a hold outlived its put"

    def close(self) -> None:
        self.store.gate.set()  # a failed test's gate: the put ends
        self.inner.resume()
        self.offloader.stop(WAIT_S)
        self.ring.close()


@pytest.fixture
def small_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """One object a call: an offload of 16 objects is 16 puts."""
    monkeypatch.setattr(oip, "FIRST_BYTES", 1)
    monkeypatch.setattr(oip, "PUT_BYTES", 1)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig("ip")
    yield r
    r.close()


def stored(store: MemoryStore, key: str) -> bytes:
    return store._objects[key]


# ---- the objects --------------------------------------------------------------------


@pytest.mark.parametrize("calls", ["one call", "one object a call"])
def test_in_place_objects_are_the_staged_objects(calls: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if calls != "one call":
        monkeypatch.setattr(oip, "FIRST_BYTES", 1)
        monkeypatch.setattr(oip, "PUT_BYTES", 1)
    placed, staged = Rig("same"), Rig("same", in_place=False)
    try:
        assert placed.offload() and staged.offload()
        for r in (placed, staged):
            r.check()
        assert placed.offloader._registered, "the pools were never registered"
        n_calls = len(placed.store.put_keys)
        assert n_calls == (1 if calls == "one call" else 2 * UNITS)
        assert not staged.store.put_keys, "the staged path put in place"
        for key in placed.all_keys:
            assert stored(placed.inner, key) == stored(staged.inner, key), key
    finally:
        placed.close()
        staged.close()
    assert placed.offloader._registered is None, "stop left the pools registered"
    assert not placed.inner._registered, "memory still registered after close"


def test_a_device_path_is_never_put_in_place() -> None:
    store = MemoryStore()
    pools = Pools.make(torch.device("cpu"))
    with pytest.raises(ValueError, match="never in place"):
        Offloader(store, StagingRing(store, 1 << 20), Quarantine(), 1.0,
                  path=object(), in_place=[pools.kv])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="never in place"):
        Offloader(store, StagingRing(store, 1 << 20), Quarantine(), 1.0,
                  path=object(), register_too=[pools.kv])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["in_place_min_kib", "in_place_load_min_kib"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "128"])
def test_in_place_min_kib_is_checked(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        LinkerSettings.parse({"embedded_master": True, name: value})
    assert LinkerSettings.parse({"embedded_master": True, name: None})


def test_only_pools_whose_every_part_reaches_the_bound_go_in_place() -> None:
    pools = Pools.make(torch.device("cpu"))
    smallest = min(p.nbytes for lp in pools.kv.layers for p in lp.parts)
    assert oip.in_place_ok(pools.kv, smallest)
    assert not oip.in_place_ok(pools.kv, smallest + 1)
    assert not oip.in_place_ok(pools.kv, None)


# ---- quiesce --------------------------------------------------------------------------


def test_a_quiesce_past_its_bound_holds_the_put_keys_until_it_ended(rig: Rig) -> None:
    """The put reads the slots when the quiesce's bound passes: its keys are held
    (unoffered, never removed nor rewritten) while it runs; the slots then get
    other bytes, the put stores them under footers of the old bytes, and once it
    ended the keys are removed from the store."""
    rig.store.gate_at = 1
    rig.offloader.submit(rig.items())
    assert rig.store.entered.wait(WAIT_S)
    assert not rig.offloader.quiesce(0.05), "quiesce saw an idle thread"
    keys = rig.store.put_keys[0]
    assert all(rig.quarantine.held(keys)) and all(rig.quarantine.holds(keys))
    assert not set(keys) & set(rig.quarantine.keys()), "a held key is up for removal"
    assert set(rig.offloader._remove(list(keys))) == set(keys), "a held key was removed"
    rig.quarantine.discard(keys)
    assert all(rig.quarantine.holds(keys)), "a held key was discarded"
    rig.scribble()  # SGLang frees the slots after reset; they get other bytes
    rig.store.gate.set()
    rig.check()
    assert all(rig.inner.exists(keys)), "the late put did not land: the test proved nothing"
    with rig.offloader._cond:  # the offload thread's repair removes them
        assert rig.offloader._cond.wait_for(lambda: not len(rig.quarantine), WAIT_S)
    assert not any(rig.inner.exists(keys)), "an object of other bytes stayed in the store"
    assert rig.offloader.completed() == 0, "a result from before the reset was given"


def test_a_quiesce_within_its_bound_holds_nothing(rig: Rig) -> None:
    rig.store.gate_at = 1
    rig.offloader.submit(rig.items())
    assert rig.store.entered.wait(WAIT_S)
    epoch = rig.offloader._epoch
    quiet: list[bool] = []
    t = threading.Thread(target=lambda: quiet.append(rig.offloader.quiesce(WAIT_S)))
    t.start()
    with rig.offloader._cond:  # the epoch moves before quiesce waits for the thread
        assert rig.offloader._cond.wait_for(lambda: rig.offloader._epoch != epoch, WAIT_S)
    rig.store.gate.set()
    t.join(WAIT_S)
    assert quiet == [True]
    rig.check()
    assert not len(rig.quarantine)
    assert all(rig.inner.exists(rig.store.put_keys[0]))
    assert rig.offloader.completed() == 0


@pytest.mark.parametrize("where", ["at launch", "before the footers"])
def test_a_quiesce_between_chunks_sends_nothing_after_it(
        where: str, rig: Rig, small_calls: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 1's put is in the air when quiesce bumps the epoch: chunk 2 (its
    footers already computed, or not yet) is never sent."""
    rig.store.gate_at = 1
    footers = oip.InPlaceOffload._footers
    bumped, second_done = threading.Event(), threading.Event()
    calls = 0

    def late_footers(self: oip.InPlaceOffload, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2 and where == "before the footers":
            assert bumped.wait(WAIT_S)
        try:
            return footers(self, *args)
        finally:
            if calls == 2:
                second_done.set()

    monkeypatch.setattr(oip.InPlaceOffload, "_footers", late_footers)
    rig.offloader.submit(rig.items())
    assert rig.store.entered.wait(WAIT_S)
    if where == "at launch":  # chunk 2's footers computed before the reset
        assert second_done.wait(WAIT_S)
    epoch = rig.offloader._epoch
    quiet: list[bool] = []
    t = threading.Thread(target=lambda: quiet.append(rig.offloader.quiesce(WAIT_S)))
    t.start()
    with rig.offloader._cond:
        assert rig.offloader._cond.wait_for(lambda: rig.offloader._epoch != epoch, WAIT_S)
    bumped.set()
    rig.store.gate.set()
    t.join(WAIT_S)
    assert quiet == [True]
    rig.check()
    assert len(rig.store.put_keys) == 1, f"sent after the reset: {rig.store.put_keys[1:]}"
    assert sum(rig.inner.exists(rig.all_keys)) == 1
    assert rig.offloader.completed() == 0


# ---- failures -----------------------------------------------------------------------


def test_a_failed_chunk_ends_the_offload(rig: Rig, small_calls: None) -> None:
    rig.store.fail_at = 2
    assert not rig.offload()
    rig.check()
    assert len(rig.store.put_keys) == 2, "a chunk was sent after a failed one"
    assert sum(rig.inner.exists(rig.all_keys)) == 1
    assert rig.offload(), "the next offload failed"
    assert all(rig.inner.exists(rig.all_keys))
    rig.check()


def test_an_error_while_a_put_runs_returns_only_after_that_put(
        rig: Rig, small_calls: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 2's footers raise while chunk 1 is put: the offload's result (a
    failure) comes only after chunk 1's call ended."""
    rig.store.gate_at = 1
    footers = oip.InPlaceOffload._footers
    calls = 0

    def failing(self: oip.InPlaceOffload, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            assert rig.store.entered.wait(WAIT_S)  # chunk 1's put is in the air
            raise RuntimeError("injected: a bug in the footers")
        return footers(self, *args)

    monkeypatch.setattr(oip.InPlaceOffload, "_footers", failing)
    rig.offloader.submit(rig.items())
    assert rig.store.entered.wait(WAIT_S)
    assert not rig.offloader.wait_completed(1, 0.05), "a result while the put reads the slots"
    assert rig.offloader.pending() == 1
    rig.store.gate.set()
    assert rig.offloader.wait_completed(1, WAIT_S) and not rig.offloader.pop()
    assert rig.offloader.errors == 1
    rig.check()


def test_an_error_before_the_first_put_was_taken_sends_nothing(
        rig: Rig, small_calls: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 2's footers raise before the put thread took chunk 1 (its
    launch held back until then): chunk 1 is sent or released unsent, never
    half; nothing after it is sent; no region, flight or hold is left."""
    footers = oip.InPlaceOffload._footers
    launch = oip.InPlaceOffload._launch
    raised = threading.Event()
    calls = 0

    def failing(self: oip.InPlaceOffload, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raised.set()
            raise RuntimeError("injected: a bug in the footers")
        return footers(self, *args)

    def late_launch(self: oip.InPlaceOffload, call: Any) -> Any:
        assert raised.wait(WAIT_S)
        return launch(self, call)

    monkeypatch.setattr(oip.InPlaceOffload, "_footers", failing)
    monkeypatch.setattr(oip.InPlaceOffload, "_launch", late_launch)
    rig.offloader.submit(rig.items())
    assert rig.offloader.wait_completed(1, WAIT_S) and not rig.offloader.pop()
    assert rig.offloader.errors == 1
    rig.check()
    assert len(rig.store.put_keys) <= 1, f"sent after the failure: {rig.store.put_keys[1:]}"
    assert rig.offload(), "the next offload failed"
    assert all(rig.inner.exists(rig.all_keys))
    rig.check()


@pytest.mark.parametrize("lands", [True, False], ids=["late put lands", "late put fails"])
def test_a_timed_out_put_gives_its_result_only_once_it_ended(lands: bool) -> None:
    """The master stops during the put: the call times out but still reads the
    slots; the result (so SGLang's unlock of the node) waits for its end."""
    inner = MemoryStore(timeout_s=0.05)
    r = Rig("late", inner=inner)
    try:
        if not lands:
            inner.fail_keys(r.kv_keys[:1])
        inner.stall_when("put_parts")
        r.offloader.submit(r.items())
        assert inner.timed_out.wait(WAIT_S) and inner.held.wait(WAIT_S)
        with r.offloader._cond:
            assert r.offloader._cond.wait_for(lambda: r.offloader.timed_out == 1, WAIT_S)
        assert not r.offloader.wait_completed(1, 0.05), "a result while the call reads the slots"
        inner.resume()
        assert r.offloader.wait_completed(1, WAIT_S)
        assert r.offloader.pop() is lands
        assert r.offloader.timed_out == 0
        r.check()
        assert all(inner.exists(r.all_keys)) is lands
    finally:
        r.close()


def test_pools_the_store_refuses_fail_that_offload_and_the_next_registers(rig: Rig) -> None:
    rig.store.refuse_register = 1
    assert not rig.offload()
    rig.check()
    assert not any(rig.inner.exists(rig.all_keys)) and not rig.store.put_keys
    assert rig.offloader._registered is None
    assert rig.offload()
    assert all(rig.inner.exists(rig.all_keys))
    rig.check()


# ---- the quarantine's holds -------------------------------------------------------


def test_a_held_key_stays_quarantined_until_every_hold_is_released() -> None:
    q = Quarantine()
    woken: list[int] = []

    class Listener:
        def wake(self) -> None:
            woken.append(1)

    listener = Listener()
    q.subscribe(listener.wake)
    q.hold(["a", "b"])
    q.hold(["a"])
    assert q.holds(["a", "b", "c"]) == [True, True, False]
    assert q.held(["a", "b"]) == [True, True] and q.keys() == []
    q.discard(["a", "b"])
    assert q.holds(["a", "b"]) == [True, True]
    q.release(["a", "b"])
    assert q.held(["a", "b"]) == [True, False] and q.keys() == ["b"]
    q.release(["a"])
    assert q.keys() == ["a", "b"] and len(q) == 2
    q.discard(["a", "b"])
    assert not len(q) and not woken, "a hold or release woke the repair"


def test_a_load_and_an_offload_registering_at_once_register_the_pools_once() -> None:
    """The scheduler thread (an in-place load) and the offload thread both
    call ``register_pools``; the first holds the store's ``register``: the
    second waits for it and registers nothing again. ``register_too`` pools
    (loads only) are registered with the offloads' and unregistered at stop."""
    inner = MemoryStore(timeout_s=WAIT_S)
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    class HeldRegister(ForwardingStore):
        def register(self, buffer: Any, nbytes: int | None = None) -> int:
            calls.append(1)
            if len(calls) == 1:
                entered.set()
                assert release.wait(WAIT_S)
            return self.inner.register(buffer, nbytes)

        def close(self) -> None:
            pass

    store = HeldRegister(inner)
    pools = Pools.make(torch.device("cpu"), seed=6)
    ring = StagingRing(store, 1 << 20, timeout_s=WAIT_S)
    offloader = Offloader(store, ring, Quarantine(), 1.0, in_place=[pools.kv],
                          register_too=[pools.mamba])
    try:
        first = threading.Thread(target=offloader.register_pools)
        first.start()
        assert entered.wait(WAIT_S)
        second = threading.Thread(target=offloader.register_pools)
        second.start()
        assert len(calls) == 1, "the second registration did not wait for the first"
        release.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
        registered = offloader._registered
        assert registered and len(calls) == len(registered), "registered more than once"
        held = inner._registered.items()
        for pool in (pools.kv, pools.mamba):
            start = int(pool.layers[0].parts[0].tensor.data_ptr())
            assert any(base <= start < base + n for base, n in held), \
                f"the {pool.name} pool was not registered"
    finally:
        release.set()
        offloader.stop(WAIT_S)
        ring.close()
    assert offloader._registered is None and not inner._registered
