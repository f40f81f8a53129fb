"""ReadOrder: one store read at a time, the lowest waiting layer first, every wait bounded.

The unit cases order threads with events (a holder inside its turn until the
test lets it out; waiters counted by ``wait_for_waiters``). The load cases run
an in-place ``StagedLoad`` over the in-memory store behind a spy that holds a
layer's read, counts the reads in flight and may time one out: the reads go
one at a time in layer order, a failed or timed-out read hands the turn on,
and every byte that lands is the stored one.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_staged import LAYOUT, encode, pages, put_raw
from test_staged_in_place import KEYS, N, Pages, _load

from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.read_order import PAYS_MARGIN, ReadOrder, order_pays
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import CorruptSlices, Gate, StagedLoad, TransferRevoked
from layerlift.linker.store_base import ForwardingStore, StoreTimeout

WAIT_S = 10.0  # the bound of every wait here; never reached when correct


class Holder(threading.Thread):
    """Takes ``order``'s turn for ``layer`` and keeps it until ``release`` is set."""

    def __init__(self, order: ReadOrder, layer: int, log: list[int]) -> None:
        super().__init__(daemon=True)
        self.order, self.layer, self.log = order, layer, log
        self.inside = threading.Event()
        self.release = threading.Event()

    def run(self) -> None:
        with self.order.turn(self.layer):
            self.log.append(self.layer)
            self.inside.set()
            assert self.release.wait(WAIT_S)


def test_one_turn_at_a_time_and_the_lowest_waiting_layer_next() -> None:
    order, log = ReadOrder(WAIT_S), []
    first = Holder(order, 5, log)
    first.start()
    assert first.inside.wait(WAIT_S)
    waiters = [Holder(order, layer, log) for layer in (3, 1, 2)]
    for i, w in enumerate(waiters, start=1):
        w.start()
        assert order.wait_for_waiters(i, WAIT_S)
    assert log == [5]  # all three wait while layer 5 reads
    first.release.set()
    by_layer = {w.layer: w for w in waiters}
    for layer in (1, 2, 3):  # each in turn, lowest first
        assert by_layer[layer].inside.wait(WAIT_S)
        assert log[-1] == layer and sum(w.inside.is_set() for w in waiters) == len(log) - 1
        by_layer[layer].release.set()
    for t in [first, *waiters]:
        t.join(WAIT_S)
    assert log == [5, 1, 2, 3] and order.granted == 4 and order.impatient == 0


def test_a_waiter_out_of_patience_reads_beside_and_keeps_the_holder_turn() -> None:
    order, log = ReadOrder(0.05), []
    holder = Holder(order, 0, log)
    holder.start()
    assert holder.inside.wait(WAIT_S)
    with order.turn(1):  # waits 0.05 s, then reads without the turn
        log.append(1)
    assert order.impatient == 1 and order.granted == 1
    # Its exit did not end the holder's turn: a third caller still waits it out.
    with order.turn(2):
        log.append(2)
    assert order.impatient == 2
    holder.release.set()
    holder.join(WAIT_S)
    with order.turn(3):  # the turn is free again: granted at once
        log.append(3)
    assert log == [0, 1, 2, 3] and order.granted == 2 and order.impatient == 2


def test_an_exception_in_a_read_hands_the_turn_on() -> None:
    order = ReadOrder(WAIT_S)
    with pytest.raises(OSError), order.turn(0):
        raise OSError("the read failed")
    with order.turn(1):
        pass
    assert order.granted == 2 and order.impatient == 0


def test_patience_must_be_positive() -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive patience"):
            ReadOrder(bad)


def _asks(gaps: Sequence[float | None], wait_s: float = 0.001
          ) -> list[tuple[float, float] | None]:
    """A forward's asks with these computes between layers (None: a layer it
    never asked for), each wait ``wait_s`` long."""
    asks: list[tuple[float, float] | None] = [(0.0, wait_s)]
    t = wait_s
    for gap in gaps:
        if gap is None:
            asks.append(None)
            continue
        t += gap
        asks.append((t, t + wait_s))
        t += wait_s
    return asks


@pytest.mark.parametrize("gaps, read_s, pays", [
    ([0.040] * 7, 0.017, True),  # 40 ms a layer against a 17 ms read: in turn
    ([0.0093] * 7, 0.017, False),  # the transfer bounds the load: as they come
    ([0.0] * 7, 0.017, False),  # a whole-batch wait computes nothing between layers
    ([0.02] * 7, 0.017, False),  # longer than the read, but within the margin
    ([0.040, 0.001, 0.040, 0.040, 0.002], 0.017, True),  # the median decides
    ([0.040] * 3, 0.0, None),  # nothing landed: no verdict
])
def test_order_pays_where_a_layer_computes_longer_than_its_read(
        gaps: list[float], read_s: float, pays: bool | None) -> None:
    assert order_pays(_asks(gaps), read_s) is pays


def test_order_pays_needs_two_consecutive_asks() -> None:
    assert order_pays([], 0.01) is None
    assert order_pays([(0.0, 0.001)], 0.01) is None
    assert order_pays(_asks([None, 0.5, None]), 0.01) is None  # no two in a row
    assert order_pays(_asks([None, 0.5, 0.5]), 0.01) is True
    assert PAYS_MARGIN > 1  # in turn is slower for the transfer: it must pay more than level


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_any_arrival_never_has_two_reads_at_once(layers: list[int], rnd: random.Random) -> None:
    """Threads of any layers, started in any order (duplicates too): never two
    inside at once, each granted once, none impatient."""
    order = ReadOrder(WAIT_S)
    lock, inside, worst, entered = threading.Lock(), [0], [0], []

    def read(layer: int) -> None:
        with order.turn(layer):
            with lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                entered.append(layer)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=read, args=(layer,)) for layer in layers]
    rnd.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert worst[0] == 1 and sorted(entered) == sorted(layers)
    assert order.granted == len(layers) and order.impatient == 0


# ---- an in-place load whose reads take turns --------------------------------------------


def _layer_of(offsets: Sequence[Sequence[int]]) -> int:
    starts = [at for at, _ in LAYOUT.slices]
    return starts.index(offsets[0][0])


class TurnSpy(ForwardingStore):
    """Forwards to ``inner``; records the layer of each ``get_ranges`` and the
    most calls in flight at once; holds a layer's call while its event in
    ``hold`` is clear; times out the layers in ``time_out`` (without reading)."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.layers: list[int] = []
        self.active = self.most = 0
        # One event a layer, made here: a defaultdict's missing key is made by
        # whichever thread asks first, and the test's thread and a reader asking
        # at once could each make (and wait on, or set) their own.
        self.entered = {layer: threading.Event() for layer in range(len(LAYOUT.slices))}
        self.hold: dict[int, threading.Event] = {}
        self.time_out: set[int] = set()

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        layer = _layer_of(src_offsets)
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.layers.append(layer)
        self.entered[layer].set()
        try:
            hold = self.hold.get(layer)
            if hold is not None:
                assert hold.wait(WAIT_S)
            if layer in self.time_out:
                ended: Future[None] = Future()
                ended.set_result(None)
                raise StoreTimeout(f"layer {layer}'s read timed out", ended)
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
        finally:
            with self.lock:
                self.active -= 1


def _setup(objects: dict[str, bytes] | None = None
           ) -> tuple[TurnSpy, torch.Tensor, StagingRing, Pages]:
    mem = MemoryStore()
    src = pages(N, 13)
    put_raw(mem, objects or {k: encode(k, src[i]) for i, k in enumerate(KEYS)})
    spy = TurnSpy(mem)
    return spy, src, StagingRing(spy, 64 << 10), Pages(spy, N)


def _exact(dest: Pages, src: torch.Tensor, layers: Sequence[int]) -> None:
    """Every row's slice of each of ``layers`` landed as stored."""
    for layer in layers:
        at, size = LAYOUT.slices[layer]
        for row in range(N):
            assert torch.equal(dest.page(row)[at : at + size], src[row][at : at + size])


def _ordered(spy: TurnSpy, ring: StagingRing, dest: Pages
             ) -> tuple[ReadOrder, list[int], StagedLoad]:
    """An in-place load whose reads take turns, and the layers it landed."""
    order, landed = ReadOrder(WAIT_S), []
    load = _load(ring, spy, dest, read_order=order,
                 on_layer=lambda layer, event: landed.append(layer))
    return order, landed, load


class LayerThread(threading.Thread):
    def __init__(self, fetch: Callable[[int], object], layer: int) -> None:
        super().__init__(daemon=True)
        self.fetch, self.layer = fetch, layer
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fetch(self.layer)
        except BaseException as exc:  # the test looks at it
            self.error = exc


def _run_layers(spy: TurnSpy, order: ReadOrder, fetch: Callable[[int], object]
                ) -> list[LayerThread]:
    """Layer 0 reads (held by the spy); layers 2 then 1 arrive and wait for the
    turn; then layer 0's read is let go."""
    spy.hold[0] = threading.Event()
    threads = [LayerThread(fetch, 0)]
    threads[0].start()
    assert spy.entered[0].wait(WAIT_S)
    for i, layer in enumerate((2, 1), start=1):
        threads.append(LayerThread(fetch, layer))
        threads[-1].start()
        assert order.wait_for_waiters(i, WAIT_S)
    assert spy.layers == [0]  # layers 1 and 2 wait for the turn, not the store
    spy.hold[0].set()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    return threads


def test_a_load_reads_one_layer_at_a_time_in_layer_order_byte_exact() -> None:
    spy, src, ring, dest = _setup()
    order = ReadOrder(WAIT_S)
    landed: list[int] = []
    load = _load(ring, spy, dest, read_order=order, depth=3,
                 on_layer=lambda layer, event: landed.append(layer))
    threads = _run_layers(spy, order, load.fetch_layer)
    assert [t.error for t in threads] == [None] * 3
    assert spy.layers == [0, 1, 2] and spy.most == 1  # one at a time, lowest first
    # (each lands once verified: the verifications of layers 1 and 2 may end in
    # either order, so the landings' order is not the reads')
    assert sorted(landed) == [0, 1, 2] and order.granted == 3 and order.impatient == 0
    for row in range(N):
        assert torch.equal(dest.page(row), src[row])
    assert load.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S) and ring.close()
    dest.close()


def test_a_timed_out_read_hands_the_turn_on_and_only_its_layer_fails() -> None:
    spy, src, ring, dest = _setup()
    spy.time_out.add(0)
    order, landed, load = _ordered(spy, ring, dest)
    threads = _run_layers(spy, order, load.fetch_layer)
    assert isinstance(threads[0].error, StoreTimeout)
    assert [t.error for t in threads[1:]] == [None, None]
    assert spy.layers == [0, 1, 2] and spy.most == 1
    assert [rows for rows, _ in dest.timeouts] == [(0, N)]  # its destination handed over
    assert sorted(landed) == [1, 2] and load.timed_out == [threads[0].error]
    # Layers 1 and 2 read their own footer entries (layer 0's never verified)
    # and landed exact; layer 0's slice was never written.
    _exact(dest, src, (1, 2))
    at, size = LAYOUT.slices[0]
    assert all(bool((dest.page(row)[at : at + size] != src[row][at : at + size]).any())
               for row in range(N))
    assert load.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S) and ring.close()
    dest.close()


def test_a_corrupt_layer_in_its_turn_fails_alone_and_the_next_reads() -> None:
    mem_src = pages(N, 13)
    objects = {k: encode(k, mem_src[i]) for i, k in enumerate(KEYS)}
    raw = bytearray(objects[KEYS[2]])
    raw[LAYOUT.slices[0][0] + 7] ^= 0x40  # object 2's slice 0: layer 0 is corrupt
    objects[KEYS[2]] = bytes(raw)
    spy, src, ring, dest = _setup(objects)
    order, landed, load = _ordered(spy, ring, dest)
    threads = _run_layers(spy, order, load.fetch_layer)
    assert isinstance(threads[0].error, CorruptSlices)
    assert [t.error for t in threads[1:]] == [None, None]
    assert spy.layers == [0, 1, 2] and spy.most == 1 and sorted(landed) == [1, 2]
    _exact(dest, src, (1, 2))
    assert load.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S) and ring.close()
    dest.close()


def test_a_load_stopped_while_reads_wait_their_turn_reads_no_more() -> None:
    """The gate closes while layer 0 reads and layers 1 and 2 wait for the
    turn: layer 0's bytes never land (its read ended after the close), and the
    waiting layers give up in their turn without a store call."""
    spy, _, ring, dest = _setup()
    order, gate = ReadOrder(WAIT_S), Gate()
    landed: list[int] = []
    load = _load(ring, spy, dest, read_order=order, gate=gate,
                 on_layer=lambda layer, event: landed.append(layer))
    spy.hold[0] = threading.Event()
    threads = [LayerThread(load.fetch_layer, 0)]
    threads[0].start()
    assert spy.entered[0].wait(WAIT_S)
    for i, layer in enumerate((1, 2), start=1):
        threads.append(LayerThread(load.fetch_layer, layer))
        threads[-1].start()
        assert order.wait_for_waiters(i, WAIT_S)
    gate.close()
    assert gate.reads == 3  # the read and the two waiting in their turn count in flight
    spy.hold[0].set()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive() and isinstance(t.error, TransferRevoked)
    assert spy.layers == [0] and landed == []  # no store call after the close
    assert gate.wait_reads(WAIT_S) and gate.reads == 0
    assert load.wait_quiet(WAIT_S) and ring.wait_idle(WAIT_S) and ring.close()
    dest.close()
