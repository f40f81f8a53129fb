"""The linker under what SGLang really does around it, on a real mooncake_master.

- ``reset`` (SGLang's ``flush_cache``, weight updates) quiesces: no offload
  taken before it stores bytes of slots freed after it, and no leftover result
  settles a later offload.
- No exception of any kind reaches SGLang's scheduler or ends the offload thread.
- A corrupt object is removed and offered no more; recomputing repairs the prefix.
- Pool features whose state LayerLift does not move are refused at construction.
- Two TP layouts sharing one store never restore each other's objects.
- A stopped or slow master costs the scheduler a bounded time, not one
  timeout per waiting request.
- The load counter is a prefix barrier over ``num_layers`` layers, as SGLang's.
- ``lookup`` never offers a prefix whose load cannot fit the staging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_testkit import (
    PAGE,
    SHAPE,
    RawStore,
    exact_or_zero,
    full_key,
    hook_store,
    page_hashes,
    reseal,
    scribble,
    tokens,
)

from layerlift.linker.store_base import StoreObjectLeased
from layerlift.testing.faults import ProcessStall
from layerlift.testing.sglang_harness import HybridShape, SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

Make = Callable[..., SGLangHost]


def restored_exact_or_missed(host: SGLangHost, toks: list[int]) -> int:
    """Restore ``toks``: a miss, or a successful load of exactly the bytes
    the model gives them (never a successful load of other bytes). Returns
    the hit in tokens."""
    r = host.restore([*toks, 1])
    if r.hit_tokens:
        assert r.ok, "a hit that failed to load"
        layers = exact_or_zero(host, r, toks)
        assert all(layers.values()), f"a successful load of other bytes: {layers}"
    return r.hit_tokens


def probe(host: SGLangHost, toks: list[int]) -> list[int]:
    """The linker's lookup for ``toks``'s pages, asked as SGLang's components ask."""
    hashes = page_hashes(toks)
    w = -(-SHAPE.window // PAGE)
    return host.linker.lookup("probe", [
        PoolTransfer(name=PoolName.KV, keys=hashes),
        PoolTransfer(name=PoolName.SWA, keys=hashes[-w:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)])


# ---- 1. reset quiesces --------------------------------------------------------------


def test_reset_then_flush_never_stores_freed_slots_nor_settles_later_offloads(
        make_host: Make) -> None:
    """A slow master (each put held): offloads queue up behind the first. SGLang's
    flush_cache resets the cache (the linker first), clears the allocators, and
    the slots get other bytes. No queued offload may store those bytes (a
    second cache would load them as valid), and no offload taken before the
    reset may settle one queued after it."""
    a = make_host(timeout_s=0.5)
    first_put, reset_started, flushed = threading.Event(), threading.Event(), threading.Event()
    puts = 0

    def held_put(keys: list[str]) -> None:
        nonlocal puts
        puts += 1
        if puts == 1:
            first_put.set()
            assert reset_started.wait(30.0)
        else:  # every later put waits until the slots hold other bytes
            assert flushed.wait(30.0)

    hook_store(a, put=held_put)
    inner_reset = a.linker.reset

    def reset() -> None:
        reset_started.set()
        inner_reset()

    a.linker.reset = reset  # type: ignore[method-assign]
    prompts = [tokens(3, seed=40 + i) for i in range(4)]
    for p in prompts:
        a.compute(p, [3 * PAGE])
    assert first_put.wait(30.0), "no offload started"
    started = time.perf_counter()
    a.flush_cache()
    took = time.perf_counter() - started
    assert a.linker._offloader.pending() == 0, "reset returned with offloads queued"
    assert took < 0.5 + 1.0 + 1.0, f"reset took {took:.2f} s"
    scribble(a)
    flushed.set()
    # Nothing taken before the reset settles anything after it.
    assert a.linker.num_completed_offloads() == 0
    later = tokens(3, seed=49)
    a.compute(later, [3 * PAGE])
    assert a.settle_offloads() >= 1
    b = make_host(segment_mib=0)
    assert restored_exact_or_missed(b, later) == 3 * PAGE
    for p in prompts:
        restored_exact_or_missed(b, p)


# ---- 2. no exception reaches SGLang -------------------------------------------------


def test_an_unexpected_offload_error_fails_that_offload_and_the_thread_goes_on(
        make_host: Make) -> None:
    a = make_host()
    faults = [RuntimeError("a client's own error (not a StoreError)")]

    def exists(keys: list[str]) -> None:
        if faults:
            raise faults.pop()

    hook_store(a, exists=exists)
    a.compute(tokens(3, seed=50), [3 * PAGE])
    assert a.settle_offloads(timeout_s=10.0) >= 1
    later = [tokens(3, seed=51 + i) for i in range(3)]
    for p in later:
        a.compute(p, [3 * PAGE])
    assert a.settle_offloads(timeout_s=10.0) >= 3, "the offload thread stopped"
    b = make_host(segment_mib=0)
    assert [restored_exact_or_missed(b, p) for p in later] == [3 * PAGE] * 3


def test_an_unexpected_lookup_error_is_a_miss(make_host: Make) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(3, seed=55)
    a.compute(toks, [3 * PAGE])
    a.settle_offloads()

    def exists(keys: list[str]) -> None:
        raise RuntimeError("a client's own error")

    hook_store(b, exists=exists)
    assert b.restore([*toks, 1]).hit_tokens == 0  # no exception through match_prefix


def test_malformed_transfers_are_refused_never_raised(make_host: Make) -> None:
    a = make_host()
    hashes = ["ab" * 32, "cd" * 32]
    # Two keys but one page of slots; then slots outside the pool.
    short = PoolTransfer(name=PoolName.KV, keys=hashes, device_indices=torch.arange(PAGE))
    outside = PoolTransfer(name=PoolName.KV, keys=hashes[:1],
                           device_indices=torch.arange(PAGE) + 10 ** 7)
    for transfer in (short, outside):
        assert a.linker.load("r-bad", [transfer]) is False
        assert a.linker.offload([transfer]) is False
    assert a.linker.ring.idle() and not a.linker._pending


# ---- 3. a corrupt object is repaired --------------------------------------------------


def test_a_corrupt_object_is_removed_and_recomputing_repairs_the_prefix(
        make_host: Make, raw: RawStore) -> None:
    toks = tokens(4, seed=60)
    a = make_host()
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    layout = a.linker.layouts["kv"]
    key = full_key(a, toks, 1)
    good = raw.get(key, layout.object_bytes)
    bad = bytearray(reseal(good, layout, key))
    bad[layout.slices[1][0] + 3] ^= 0x20  # one byte of layer 5, under its old footer
    deadline = time.monotonic() + 30.0
    while True:  # the raw read's lease holds the object for a while
        try:
            raw.store.remove([key])
            break
        except StoreObjectLeased:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    raw.plant(key, bytes(bad))
    b = make_host(segment_mib=0)
    first = b.restore([*toks, 1])
    assert first.hit_tokens == 4 * PAGE and not first.ok  # found at load time: aborted
    # The next request for that prefix is not offered the corrupt object.
    second = b.restore([*toks, 2])
    assert second.hit_tokens == 0
    # SGLang recomputes it; the offload writes the page again.
    b.compute(toks, [4 * PAGE])
    b.settle_offloads()
    deadline = time.monotonic() + 30.0
    while len(b.linker.quarantine):
        assert time.monotonic() < deadline, "the corrupt object was never removed"
        time.sleep(0.02)
    c = make_host(segment_mib=0)
    assert restored_exact_or_missed(c, toks) == 4 * PAGE, "the prefix was not repaired"


# ---- 4. refusals --------------------------------------------------------------------


def _draft_pool() -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=1,
                            head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("host, message", [
    ({"req_pool_extra": {"short_conv_layer_ids": [2], "short_conv_state_shape": (4, 3)}},
     "short-conv state"),
    ({"req_pool_extra": {"ngram_context_len": 4}}, "n-gram state"),
    ({"params_extra": {"sidecar_draft_device_pools": "draft"}}, "draft KV pools"),
    ({"params_extra": {"mtp_draft_device_pools": "draft"}}, "draft KV pools"),
    ({"server_args_extra": {"enable_int8_mamba_checkpoint": True}}, "int8 Mamba checkpoints"),
], ids=["short-conv", "ngram", "sidecar-draft", "mtp-draft", "int8-mamba"])
def test_state_the_linker_does_not_move_is_refused_at_construction(
        make_host: Make, host: dict[str, Any], message: str) -> None:
    extra = host.get("params_extra")
    if extra:
        host = {"params_extra": {k: (_draft_pool(),) for k in extra}}
    with pytest.raises(ValueError, match=message):
        make_host(host=host)


# ---- 5. TP layout in the keys ---------------------------------------------------------


def _tp(size: int, rank: int) -> dict[str, Any]:
    return {"parallel": {"tp_size": size, "attn_tp_size": size, "moe_tp_size": size,
                         "tp_rank": rank, "attn_tp_rank": rank}}


def test_two_tp_sizes_sharing_a_store_never_restore_each_others_objects(
        make_host: Make) -> None:
    """With replicated KV heads rank 1 holds head 1 at tp=2 and head 0 at
    tp=4, in identical shapes: only the layout in the key tells them apart."""
    toks = tokens(3, seed=70)
    tp2 = make_host(host=_tp(2, 1))
    tp2.compute(toks, [3 * PAGE])
    tp2.settle_offloads()
    tp4 = make_host(segment_mib=0, host=_tp(4, 1))
    assert tp4.linker.key_schema.prefix != tp2.linker.key_schema.prefix
    assert tp4.restore([*toks, 1]).hit_tokens == 0
    tp4_rank0 = make_host(segment_mib=0, host=_tp(4, 0))
    assert tp4_rank0.restore([*toks, 1]).hit_tokens == 0
    # Control: the same layout and rank restores it.
    again = make_host(segment_mib=0, host=_tp(2, 1))
    assert restored_exact_or_missed(again, toks) == 3 * PAGE


# ---- 6. a stalled or slow master ------------------------------------------------------


def test_a_stopped_master_costs_one_bounded_lookup_not_one_per_request(
        make_host: Make, stall: ProcessStall) -> None:
    a = make_host()
    prompts = [tokens(3, seed=80 + i) for i in range(4)]
    for p in prompts:
        a.compute(p, [3 * PAGE])
    a.settle_offloads()
    b = make_host(segment_mib=0, timeout_s=1.0)
    stall.stop()
    started = time.perf_counter()
    hits = [b.restore([*p, 1]).hit_tokens for p in prompts]
    took = time.perf_counter() - started
    stall.resume()
    assert hits == [0, 0, 0, 0]
    assert took < 0.5 + 0.5, f"4 admissions blocked the scheduler {took:.2f} s"


def test_lookups_resume_once_the_breaker_closes(make_host: Make,
                                                stall: ProcessStall) -> None:
    a = make_host()
    toks = tokens(3, seed=85)
    a.compute(toks, [3 * PAGE])
    a.settle_offloads()
    b = make_host(segment_mib=0, lookup_timeout_s=0.2, lookup_breaker_s=0.5)
    stall.stop()
    assert b.restore([*toks, 1]).hit_tokens == 0
    stall.resume()
    assert b.linker.lookups.trips == 1
    deadline = time.monotonic() + 10.0
    while not probe(b, toks):
        assert time.monotonic() < deadline, "lookups never resumed"
        time.sleep(0.05)
    assert restored_exact_or_missed(b, toks) == 3 * PAGE


def test_a_slow_master_costs_the_scheduler_a_bounded_share(make_host: Make) -> None:
    a = make_host()
    prompts = [tokens(3, seed=90 + i) for i in range(6)]
    for p in prompts:
        a.compute(p, [3 * PAGE])
    a.settle_offloads()
    b = make_host(segment_mib=0)

    def slow(keys: list[str]) -> None:  # a master answering each call in 0.3 s
        time.sleep(0.3)

    store = hook_store(b, exists=slow)
    started = time.perf_counter()
    answers = [probe(b, p) for p in prompts]  # one waiting request each, in one round
    took = time.perf_counter() - started
    assert answers[0] == [3], "the first lookup, within budget, was not answered"
    # Budget: 0.5 s at once, refilled at 0.25 s per second (lookup_share): the
    # 0.3 s calls spend it within three (the last one overdraws it); the rest
    # are misses at no cost (each asking would cost 6 x 0.3 s).
    asked = sum(1 for call, _ in store.calls if call == "exists")
    assert asked <= 3, f"{asked} of 6 lookups waited for the slow master"
    assert b.linker.lookups.spent_s <= 2 * 0.5 + 0.25 * took
    assert took < 6 * 0.3, f"6 lookups cost the scheduler {took:.2f} s"


# ---- 8. the load counter --------------------------------------------------------------


def test_wait_until_is_a_prefix_barrier_over_num_layers(make_host: Make) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(3, seed=95)
    a.compute(toks, [3 * PAGE])
    a.settle_offloads()
    counter = b.linker.layer_done_counter
    layer0 = threading.Event()

    def get_ranges(keys: list[str], offsets: Any) -> None:
        if "/full/" in keys[0] and offsets[0][0] == 0:  # layer 0: the first FULL layer
            assert layer0.wait(30.0)

    hook_store(b, get_ranges=get_ranges)
    adm = b.admit([*toks, 1])
    assert adm.restore.loaded_tokens == 3 * PAGE
    b.start_loads()
    (batch,) = counter.batches()
    done = threading.Event()

    def forward_waits() -> None:
        counter.wait_until(1)
        done.set()

    waiter = threading.Thread(target=forward_waits)
    waiter.start()
    batch.readiness.wait(1, timeout=30.0)  # layer 1 (SWA) landed; layer 0 is held
    assert batch.landed[1] and not batch.landed[0]
    assert not done.wait(0.5), "wait_until(1) returned before layer 0 landed"
    layer0.set()
    assert done.wait(30.0)
    waiter.join()
    assert counter.num_layers == len(SHAPE.kinds)  # as SGLang's LayerWiseLoadCounter
    b.forward(adm)
    assert b.finish([adm]) == []
    assert all(exact_or_zero(b, adm.restore, toks).values())


# ---- 7. any request through the bounded staging ---------------------------------------


def test_a_load_larger_than_the_staging_streams_through_it(make_host: Make) -> None:
    """12 FULL pages of 128 KiB, the SWA window and a Mamba state (~1.6 MiB)
    through a 1 MiB staging ring: offered by lookup, loaded exact, in chunks."""
    shape = HybridShape(head_num=8, head_dim=128, kv_tokens=1024)  # 128 KiB per FULL page
    a = make_host(shape=shape)
    toks = tokens(12, seed=97)
    a.compute(toks, [4 * PAGE, 12 * PAGE])
    a.settle_offloads()
    b = make_host(shape=shape, segment_mib=0, staging_mib=1)
    kv, swa = b.linker.layouts["kv"], b.linker.layouts["swa"]
    need = 12 * kv.object_bytes + 2 * swa.object_bytes + b.linker.layouts["mamba"].object_bytes
    assert need > b.linker.ring.capacity, "the test's sizes fit the staging: it proves nothing"
    r = b.restore([*toks, 1])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (12 * PAGE, 12 * PAGE, True)
    assert all(exact_or_zero(b, r, toks).values())
    assert b.linker.ring.idle()
