"""``linker/in_place.py``: how objects are cut into put calls (``grow``),
what a put that timed out then failed reports (``late_failure``), and the
pipeline (``PipelinedPuts``) in every order of its two threads, each
failure in each place, ordered with events. It also runs inside the hosts'
offloads in ``test_sglang_in_place.py`` and in
``tests/hosts/vllm_host/test_vllm_held_saves.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layerlift.linker.in_place import AHEAD, Call, PipelinedPuts, grow, late_failure
from layerlift.linker.store_base import StoreFull, StoreIOError, StoreTimeout
from layerlift.linker.transfer_plan import OffloadOutcome

objects = st.lists(st.tuples(st.integers(1, 64), st.integers(1, 8)), max_size=60)


@given(objects, st.integers(1, 256), st.integers(1, 32), st.integers(1, 64))
def test_calls_cover_every_object_in_order_within_their_bounds(
        shape: list[tuple[int, int]], put_bytes: int, put_buffers: int, first: int) -> None:
    runs = grow(shape, put_bytes, put_buffers, first)
    assert [i for r in runs for i in r] == list(range(len(shape)))
    limit = first
    for r in runs:
        assert len(r) >= 1
        nbytes = sum(shape[i][0] for i in r)
        buffers = sum(shape[i][1] for i in r)
        if len(r) > 1:  # one object alone may exceed any bound
            assert nbytes <= limit and buffers <= put_buffers
        limit = min(2 * limit, put_bytes)


def test_calls_start_small_and_double() -> None:
    runs = grow([(1, 1)] * 15, put_bytes=4, put_buffers=100, first=1)
    assert [len(r) for r in runs] == [1, 2, 4, 4, 4]


def test_a_late_failure_is_the_call_s_own_error_or_an_io_error() -> None:
    failed: Future[None] = Future()
    failed.set_exception(StoreFull("no space"))
    assert isinstance(late_failure(StoreTimeout("late", failed)), StoreFull)
    odd: Future[None] = Future()
    odd.set_exception(RuntimeError("a client's own error"))
    err = late_failure(StoreTimeout("late", odd))
    assert isinstance(err, StoreIOError) and "a client's own error" in str(err)
    assert isinstance(late_failure(StoreTimeout("late")), StoreIOError)


# ---- PipelinedPuts in every order, on a store that records and gates its puts ----

WAIT_S = 30.0


class _Region:
    """A footer region that counts its releases (the ring's contract: once)."""

    def __init__(self, name: int) -> None:
        self.name, self.released, self.ptr = name, 0, 0

    def release(self) -> None:
        self.released += 1


class _Store:
    """``put_parts`` records the call's first key, and for the calls in
    ``gates`` sets ``entered[n]`` and waits for ``gates[n]``; ``fail_at``
    raises instead."""

    def __init__(self, gates: tuple[int, ...] = (), fail_at: int | None = None) -> None:
        self.sent: list[str] = []
        self.entered = {n: threading.Event() for n in gates}
        self.gates = {n: threading.Event() for n in gates}
        self.fail_at = fail_at

    def put_parts(self, keys: Sequence[str], ptrs: object, sizes: object) -> None:
        self.sent.append(keys[0])
        n = len(self.sent)
        if n == self.fail_at:
            raise StoreIOError("injected: the transfer failed")
        if n in self.gates:
            self.entered[n].set()
            assert self.gates[n].wait(WAIT_S), "the test never opened the gate"


class _Rig:
    """Chunks 1..n, each prepared into a call of one key and a counted region."""

    def __init__(self, store: _Store, n: int = 6) -> None:
        self.store, self.chunks = store, list(range(1, n + 1))
        self.regions: list[_Region] = []
        self.prepared: list[int] = []
        self.launched: list[int] = []
        self.ended: list[int] = []
        self.lock = threading.Condition()
        self.on_prepare: dict[int, Callable[[], None]] = {}
        self.on_launch: dict[int, Callable[[], None]] = {}
        self.no_region: int | None = None

    def prepare(self, chunk: int, outcome: OffloadOutcome) -> Call | None:
        if chunk in self.on_prepare:
            self.on_prepare[chunk]()
        if chunk == self.no_region:
            outcome.error = StoreFull("injected: no region")
            return None
        region = _Region(chunk)
        with self.lock:
            self.regions.append(region)
            self.prepared.append(chunk)
            self.lock.notify_all()
        return Call(region, [f"k{chunk}"], [[0]], [[1]])  # type: ignore[arg-type]

    def launch(self, call: Call) -> Callable[[], None]:
        chunk = int(call.keys[0][1:])
        if chunk in self.on_launch:
            self.on_launch[chunk]()
        with self.lock:
            self.launched.append(chunk)

        def ended() -> None:
            with self.lock:
                self.ended.append(chunk)

        return ended

    def wait_prepared(self, n: int) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: len(self.prepared) >= n, WAIT_S)

    def run(self, ahead: int = AHEAD) -> OffloadOutcome:
        puts: PipelinedPuts[int] = PipelinedPuts(self.store, self.prepare,  # type: ignore[arg-type]
                                                 launch=self.launch, ahead=ahead)
        return puts.run(self.chunks)

    def check(self) -> None:
        """Every region released once; every launched call ended; only
        launched calls sent, in order."""
        assert [r.released for r in self.regions] == [1] * len(self.regions)
        assert sorted(self.ended) == sorted(self.launched)
        assert self.store.sent == [f"k{c}" for c in self.launched]
        assert self.launched == sorted(self.launched)


def test_every_call_is_sent_in_order_and_every_region_released() -> None:
    rig = _Rig(_Store())
    out = rig.run()
    assert out.error is None and out.objects == 6 and out.bytes == 6
    assert rig.launched == rig.chunks
    rig.check()


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_at_most_ahead_calls_wait_for_the_put_thread(ahead: int) -> None:
    """Put 1 held: the calling thread prepares ``ahead`` calls beyond the
    one taken, no more, until the put thread takes the next."""
    store = _Store(gates=(1,))
    rig = _Rig(store, n=8)
    seen: list[int] = []

    def too_far() -> None:
        seen.append(len(rig.prepared))

    rig.on_prepare[ahead + 2] = too_far
    done: list[OffloadOutcome] = []
    t = threading.Thread(target=lambda: done.append(rig.run(ahead)))
    t.start()
    assert store.entered[1].wait(WAIT_S)
    assert not seen, "a call prepared past the bound while put 1 ran"
    store.gates[1].set()
    t.join(WAIT_S)
    assert done and done[0].error is None and done[0].objects == 8
    assert seen == [ahead + 1]
    rig.check()


def test_a_failed_put_sends_nothing_after_it_and_releases_the_calls_waiting() -> None:
    """Put 2 fails while calls 3.. are prepared: none of them is launched or
    sent; their regions released; the outcome is the put's error."""
    store = _Store(gates=(1,), fail_at=2)
    rig = _Rig(store)
    done: list[OffloadOutcome] = []
    t = threading.Thread(target=lambda: done.append(rig.run()))
    t.start()
    assert store.entered[1].wait(WAIT_S)
    assert rig.wait_prepared(1 + AHEAD)  # calls waiting behind put 1
    store.gates[1].set()
    t.join(WAIT_S)
    assert isinstance(done[0].error, StoreIOError) and done[0].objects == 1
    assert rig.launched == [1, 2]
    rig.check()


@pytest.mark.parametrize("when", ["while put 1 runs", "before put 1 is taken"])
def test_a_prepare_that_raises_returns_only_after_the_put_in_the_air(when: str) -> None:
    """Chunk 3's prepare raises: ``run`` raises it only once every call sent
    ended; nothing after the failure is launched; every region released."""
    store = _Store(gates=(1,))
    rig = _Rig(store)
    raised = threading.Event()

    def boom() -> None:
        if when == "while put 1 runs":
            assert store.entered[1].wait(WAIT_S)
        raised.set()
        raise RuntimeError("injected: a bug in the footers")

    rig.on_prepare[3] = boom
    if when == "before put 1 is taken":
        rig.on_launch[1] = lambda: (raised.wait(WAIT_S), None)[1]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            rig.run()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert raised.wait(WAIT_S)
    if when == "while put 1 runs":
        t.join(0.05)
        assert t.is_alive() and not errors, "run returned while put 1 reads the memory"
    store.gates[1].set()
    t.join(WAIT_S)
    assert errors and "injected" in str(errors[0])
    assert 3 not in rig.launched and rig.launched in ([1], [1, 2], [])
    rig.check()


def test_a_launch_that_raises_sends_nothing_from_there() -> None:
    """Launch 3 raises (a host's quiesce, say): call 3 is never sent, nothing
    after it either, ``run`` raises it after put 2 ended."""
    rig = _Rig(_Store())

    def revoked() -> None:
        raise LookupError("injected: revoked")

    rig.on_launch[3] = revoked
    with pytest.raises(LookupError, match="revoked"):
        rig.run()
    assert rig.launched == [1, 2]
    rig.check()


def test_no_region_ends_the_puts_with_its_error() -> None:
    rig = _Rig(_Store())
    rig.no_region = 4
    out = rig.run()
    assert isinstance(out.error, StoreFull)
    assert 4 not in rig.prepared and max(rig.launched) <= 3
    rig.check()


@pytest.mark.parametrize("n", [0, 1])
def test_zero_or_one_call_runs_on_the_calling_thread(n: int) -> None:
    rig = _Rig(_Store(), n=n)
    caller = threading.get_ident()
    threads: list[int] = []
    rig.on_launch[1] = lambda: threads.append(threading.get_ident())
    out = rig.run()
    assert out.error is None and out.objects == n
    assert threads == ([caller] if n else [])
    rig.check()


def test_ahead_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="ahead >= 1"):
        PipelinedPuts(_Store(), lambda chunk, outcome: None, ahead=0)  # type: ignore[arg-type]
