"""``linker/in_place.py``: how objects are cut into put calls (``grow``), and
what a put that timed out then failed reports (``late_failure``). The
pipeline itself runs in every order in ``test_sglang_in_place.py`` and in
``tests/hosts/vllm_host/test_vllm_held_saves.py``."""

from __future__ import annotations

from concurrent.futures import Future

from hypothesis import given
from hypothesis import strategies as st

from layerlift.linker.in_place import grow, late_failure
from layerlift.linker.store_base import StoreFull, StoreIOError, StoreTimeout

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
