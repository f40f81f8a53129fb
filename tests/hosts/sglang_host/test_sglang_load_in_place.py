"""In-place loads inside SGLang's real cache, on a real mooncake_master
(``layerlift/hosts/sglang/load_in_place.py``; the reads themselves and their
pieces on the in-memory store in ``tests/linker/test_staged_in_place_pieces.py``;
bad objects and a stopped master read in place in
``test_sglang_linker_faults.py``).

- Slots read in place restore byte-exact, a layer in one call or one unit
  a call; each unit's K and V rows are two ranges of the call, and nothing
  of the payload goes through staging.
- A read that timed out but still runs (it writes the slots later): the
  forward's waits end in their bound, ``finish`` returns only once the read
  ended and the slots it wrote are zeroed after it, so SGLang never gets the
  slots back while the read may still write them; past ``read_end_s`` the
  linker raises ``SlotsStillWritten`` into SGLang's scheduler instead, and
  close keeps the pools registered while that read runs.
- A store that refuses to register the pools: the batch is staged (exact),
  and the next batch registers them and reads in place.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from sglang_testkit import (
    PAGE,
    assert_restored,
    exact_or_zero,
    full_key,
    hook_store,
    is_zero,
    tokens,
)

from layerlift.hosts.sglang import load as sglang_load
from layerlift.hosts.sglang.load_in_place import SlotsStillWritten
from layerlift.linker.sinks import Gate
from layerlift.linker.store_base import ForwardingStore, StoreError, StoreTimeout
from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

Make = Callable[..., SGLangHost]
WAIT_S = 30.0


def _produced(make_host: Make, seed: int, pages: int = 4) -> list[int]:
    a = make_host()
    toks = tokens(pages, seed=seed)
    a.compute(toks, [pages * PAGE])
    assert a.settle_offloads() >= 1
    return toks


@pytest.mark.parametrize("calls", ["one call a layer", "one unit a call"])
def test_slots_read_in_place_restore_exactly(calls: str, make_host: Make,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if calls != "one call a layer":
        monkeypatch.setattr(sglang_load, "IN_PLACE_RANGES", 3)  # two pieces and a check
    toks = _produced(make_host, seed=81)
    b = make_host(segment_mib=0, in_place_load_min_kib=0)
    seen: list[tuple[list[str], list[list[int]]]] = []
    hook_store(b, get_ranges=lambda keys, offsets: seen.append((keys, offsets)))
    r = b.restore([*toks, 1])
    assert r.ok and r.hit_tokens == 4 * PAGE
    assert_restored(b, r, toks)
    batch = b.linker.finished[-1]
    assert batch.in_place and batch.placed is not None
    assert all(not chunks for chunks in batch.staged.chunks), "payload went through staging"
    kv_keys = {full_key(b, toks, i) for i in range(4)}
    k_bytes = b.linker.layouts["kv"].layers[0].parts[0].nbytes
    read = [offs for keys, offsets in seen for key, offs in zip(keys, offsets, strict=True)
            if key in kv_keys]
    assert read and all(offs[1] - offs[0] == k_bytes for offs in read), \
        "a unit's K and V rows are not two ranges"
    if calls != "one call a layer":
        assert max(len(keys) for keys, _ in seen) == 1
    assert b.linker._offloader._registered, "the pools were never registered"


class _LateRead(ForwardingStore):
    """The first ``get_ranges`` of the store times out at once but goes on:
    once ``release`` is set it writes ``0x77`` into every destination range
    (what a late read may leave) and then ends its future. Later calls pass."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.issued = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()
        self._first = True

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        if not self._first:
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
            return
        self._first = False
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        ranges = [(p, n) for ptrs, lens in zip(dst_ptrs, sizes, strict=True)
                  for p, n in zip(ptrs, lens, strict=True)]

        def late() -> None:
            assert self.release.wait(WAIT_S)
            for ptr, n in ranges:
                ctypes.memset(ptr, 0x77, n)
            future.set_result(None)
            self.ended.set()

        threading.Thread(target=late, daemon=True).start()
        self.issued.set()
        raise StoreTimeout("the test's read timed out and goes on", future)

    def close(self) -> None:
        pass


def _late_host(make_host: Make, **extra: Any) -> tuple[SGLangHost, _LateRead]:
    b = make_host(segment_mib=0, in_place_load_min_kib=0, depth=1, load_timeout_s=1.0, **extra)
    late = _LateRead(b.linker.store)
    b.linker.use_store(late)
    return b, late


def test_a_read_still_running_is_waited_for_and_its_slots_zeroed_after_it(
        make_host: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Order: the read times out and runs on; the forward's waits end in
    their bound; ``finish`` waits for the read (it cannot return: the read
    has not ended); the read writes 0x77 and ends; ``finish`` then zeroes the
    unlanded slots and returns False: no 0x77 survives."""
    toks = _produced(make_host, seed=82)
    b, late = _late_host(make_host)
    waiting = threading.Event()
    result: list[Any] = []
    original = Gate.wait_reads

    def wait_reads(gate: Gate, timeout_s: float | None) -> bool:
        waiting.set()
        return original(gate, timeout_s)

    monkeypatch.setattr(Gate, "wait_reads", wait_reads)

    def run() -> None:
        result.append(b.restore([*toks, 1]))

    runner = threading.Thread(target=run)
    runner.start()
    assert late.issued.wait(WAIT_S), "no read was issued"
    assert waiting.wait(WAIT_S), "finish never waited for the read in flight"
    assert runner.is_alive() and not result, "finish returned while a read may still write"
    late.release.set()
    runner.join(WAIT_S)
    assert not runner.is_alive()
    r = result[0]
    assert late.ended.is_set() and not r.ok and r.hit_tokens == 4 * PAGE
    assert not exact_or_zero(b, r, toks)[0]  # zero, not 0x77 (every layer exact or zero)
    k0 = b.kv.full_kv_pool.k_buffer[0]
    assert r.tail is not None and is_zero(k0[r.tail])
    again = b.restore([*toks, 2])  # the next load reads in place again, exactly
    assert again.ok and b.linker.finished[-1].in_place
    assert_restored(b, again, toks)


def test_a_read_past_read_end_s_raises_into_sglang_and_keeps_the_pools_registered(
        make_host: Make) -> None:
    toks = _produced(make_host, seed=83)
    b, late = _late_host(make_host)
    b.linker.read_end_s = 0.2
    with pytest.raises(SlotsStillWritten, match=r"did not end within 0\.2 s"):
        b.restore([*toks, 1])
    offloader = b.linker._offloader
    b.linker.close()
    assert offloader._registered, "close unregistered the pools under a running read"
    late.release.set()
    assert late.ended.wait(WAIT_S)


def test_pools_the_store_refuses_stage_that_batch_and_the_next_registers(
        make_host: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    toks = _produced(make_host, seed=84)
    other = _produced(make_host, seed=85)
    b = make_host(segment_mib=0, in_place_load_min_kib=0)
    offloader = b.linker._offloader
    real = offloader.register_pools
    refusals = [StoreError("the test's store refuses the pools")]

    def register() -> None:
        if refusals:
            raise refusals.pop()
        real()

    monkeypatch.setattr(offloader, "register_pools", register)
    r = b.restore([*toks, 1])
    assert r.ok and not b.linker.finished[-1].in_place
    assert_restored(b, r, toks)
    r2 = b.restore([*other, 1])
    assert r2.ok and b.linker.finished[-1].in_place
    assert_restored(b, r2, other)
