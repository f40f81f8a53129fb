"""The linker's promises under faults, inside SGLang's real wrapper, on a real mooncake_master.

- A corrupt, foreign or truncated object (planted in the real store) fails its
  layer: SGLang's ``finish_external_linker_loads`` reports the request failed,
  the forward never reads a wrong byte (a layer is exact or zero), and the
  failed tail never enters the tree.
- A stopped master (SIGSTOP) ends the load within the stated bound, and
  nothing writes into the slots after ``finish`` returned, also once the
  master resumes and the timed-out reads end.
- Both for loads through staging and loads read straight into the slots
  (``load_in_place.py``): there a read whose session never started was
  lent no slot, so ``finish`` need not wait for it.
- An offload whose put outlives its timeout, while SGLang reuses the slots,
  lands the offloaded bytes or nothing, never the reused slots' bytes.
- ``reset`` through SGLang's cache quiesces offloads stuck on a stopped master.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_testkit import (
    PAGE,
    SHAPE,
    RawStore,
    exact_or_zero,
    full_key,
    is_zero,
    on_device,
    reseal,
    tokens,
)

from layerlift.linker.store_base import Store, StoreTimeout
from layerlift.testing.faults import ProcessStall
from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]


def _corrupt(scratch: list[bytes], layout: Any, key: str, other_key: str) -> bytes:
    bad = bytearray(reseal(scratch[1], layout, key))
    offset, _ = layout.slices[1]  # the second FULL layer: model layer 5
    bad[offset + 7] ^= 0x40
    return bytes(bad)


def _foreign(scratch: list[bytes], layout: Any, key: str, other_key: str) -> bytes:
    return reseal(scratch[2], layout, other_key)  # page 2's object, self-consistent


def _truncated(scratch: list[bytes], layout: Any, key: str, other_key: str) -> bytes:
    return reseal(scratch[1], layout, key)[: layout.page_bytes // 2]


# The loads of each test go through staging (the default for these small
# units) or straight into the slots (``load_in_place.py``); the third mode's
# in-place reads take turns, lowest layer first (``ordered_reads``,
# ``linker/read_order.py``).
MODES = {"staged": {}, "in place": {"in_place_load_min_kib": 0},
         "in place, reads in turn": {"in_place_load_min_kib": 0, "ordered_reads": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("spoil, bad_layer", [(_corrupt, 5), (_foreign, 0), (_truncated, 0)],
                         ids=["corrupt", "foreign", "truncated"])
def test_a_bad_object_fails_its_layer_and_no_wrong_byte_is_used(
        make_host: Callable[..., SGLangHost], raw: RawStore, mooncake_namespace: str,
        spoil: Callable[..., bytes], bad_layer: int, mode: str) -> None:
    toks = tokens(4, seed=20)
    scratch = make_host(namespace=f"{mooncake_namespace}-scratch")
    scratch.compute(toks, [4 * PAGE])
    scratch.settle_offloads()
    layout = scratch.linker.layouts["kv"]
    objects = [raw.get(full_key(scratch, toks, i), layout.object_bytes) for i in range(4)]
    a, b = make_host(), make_host(segment_mib=0, **MODES[mode])
    raw.plant(full_key(a, toks, 1), spoil(objects, layout, full_key(a, toks, 1),
                                          full_key(a, toks, 2)))
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    r = b.restore([*toks, 1])
    assert r.hit_tokens == 4 * PAGE and not r.ok  # SGLang aborts the loading request
    assert b.linker.finished[-1].in_place == mode.startswith("in place")
    assert (b.linker.finished[-1].read_order is not None) == mode.endswith("reads in turn")
    layers = exact_or_zero(b, r, toks)
    assert not layers[bad_layer]
    assert all(layers[layer] for layer in range(bad_layer))  # earlier layers landed
    assert on_device(b, toks) == 0  # nothing of the failed load entered the tree
    # Control: the same restore from the untouched objects lands exact.
    control = make_host(namespace=f"{mooncake_namespace}-scratch", segment_mib=0)
    good = control.restore([*toks, 1])
    assert good.ok and all(exact_or_zero(control, good, toks).values())


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stopped_master_ends_the_load_in_bound_and_nothing_writes_after_finish(
        make_host: Callable[..., SGLangHost], stall: ProcessStall, mode: str) -> None:
    a = make_host()
    b = make_host(segment_mib=0, timeout_s=1.0, load_timeout_s=2.0, **MODES[mode])
    toks = tokens(4, seed=21)
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    r = b.restore([*toks, 1], before_start=stall.stop)
    assert r.hit_tokens == 4 * PAGE and not r.ok
    assert r.settled_s < 2.0 + 0.5, f"the load took {r.settled_s:.2f} s past its 2 s bound"
    # The forward really waited through SGLang's pool accessor (not a read of
    # whatever was there): staged, until the load's bound; in place, until the
    # batch's session start timed out (1 s), which fails every layer at once.
    least = 1.5 if mode == "staged" else 0.9
    assert r.wait_s[0] >= least, f"layer 0's wait returned after {r.wait_s[0]:.2f} s"
    assert not any(exact_or_zero(b, r, toks).values())  # nothing landed: all zero
    assert r.tail is not None
    k0 = b.kv.full_kv_pool.k_buffer[0]
    assert is_zero(k0[r.tail])
    stall.resume()
    batch = b.linker.finished[-1]
    assert batch.in_place == mode.startswith("in place")
    assert batch.quiet.wait(30.0), "the timed-out reads never ended after the master resumed"
    deadline = time.monotonic() + 30.0
    while not b.linker.ring.idle():
        assert time.monotonic() < deadline, "staging still held after the reads ended"
        time.sleep(0.01)
    assert is_zero(k0[r.tail]), "a read wrote into the slots after finish returned"
    again = b.restore([*toks, 2])  # the store serves again
    assert again.ok and again.hit_tokens == 4 * PAGE


class _StallingPut:
    """Forwards to a store; its first put stops the master, and once that put
    timed out, ``reuse(keys)`` overwrites the slots it read (SGLang frees a
    node's slots once its offload failed) and the master resumes, so the
    timed-out put lands while those slots hold other bytes."""

    def __init__(self, inner: Store, stall: ProcessStall,
                 reuse: Callable[[list[str]], None]) -> None:
        self.inner, self.stall, self.reuse = inner, stall, reuse
        self.fired: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, keys: Any, ptrs: Any, sizes: Any) -> None:
        if self.fired:
            return self.inner.put(keys, ptrs, sizes)
        self.fired = list(keys)
        self.stall.stop()
        try:
            return self.inner.put(keys, ptrs, sizes)
        except StoreTimeout:
            self.reuse(self.fired)
            self.stall.resume()
            raise


def test_a_put_that_outlives_its_timeout_never_lands_other_bytes(
        make_host: Callable[..., SGLangHost], stall: ProcessStall) -> None:
    a = make_host(timeout_s=1.0)
    toks = tokens(3, seed=22)
    pages = {full_key(a, toks, i): i for i in range(3)}

    def reuse(keys: list[str]) -> None:  # another request's bytes in the failed node's slots
        slots = a.cache.tree_core.collect_full_device_indices(
            a.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks)))).last_device_node,
            a.cache.root_node_handle())
        for page in {pages[k] for k in keys if k in pages}:
            rows = slots[page * PAGE:(page + 1) * PAGE]
            swa_rows = a.alloc.translate_loc_from_full_to_swa(rows)
            for pool, at in ((a.kv.full_kv_pool, rows), (a.kv.swa_kv_pool, swa_rows)):
                for t in (*pool.k_buffer, *pool.v_buffer):
                    t[at] = 3.0

    offloader = a.linker._offloader
    wrapped = _StallingPut(a.linker.store, stall, reuse)
    offloader._store = wrapped
    a.compute(toks, [3 * PAGE])
    a.settle_offloads()
    assert any(k in pages for k in wrapped.fired), "the stalled put carried no FULL page"
    deadline = time.monotonic() + 30.0
    while offloader.timed_out:
        assert time.monotonic() < deadline, "the timed-out put never ended"
        time.sleep(0.01)
    b = make_host(segment_mib=0)
    r = b.restore([*toks, 1])
    assert r.hit_tokens == 3 * PAGE, "the late put did not land: the test proved nothing"
    assert r.ok
    layers = exact_or_zero(b, r, toks)
    assert all(layers.values())


def test_reset_through_sglang_quiesces_offloads_stuck_on_a_stopped_master(
        make_host: Callable[..., SGLangHost], stall: ProcessStall) -> None:
    a = make_host(timeout_s=1.0)
    stall.stop()
    a.compute(tokens(3, seed=23), [3 * PAGE])
    assert a.cache.linker.pending_offloads
    started = time.perf_counter()
    a.cache.reset()  # SGLang's reset: the linker first, then the node locks
    took = time.perf_counter() - started
    assert a.linker._offloader.pending() == 0
    assert not a.cache.linker.pending_offloads
    assert took < 1.0 * (2 + 2) + 1.0
    stall.resume()
    assert SHAPE.page_size == PAGE
