"""LayerLiftLinker inside SGLang 0.5.23's real cache code, on CPU, over a real mooncake_master.

Each test builds real SGLang pools for a FULL + SWA + MAMBA model (layers
F S M S M F, 16-token pages, a 32-token window), a real UnifiedRadixCache and
a linker made by SGLang's own dynamic loader, then makes the scheduler's calls
(``layerlift.testing.sglang_harness``). Two caches share one store: what the
second restores must be byte-identical to what the first computed and offloaded.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_testkit import PAGE, SHAPE, assert_restored, page_hashes, tokens

from layerlift.hosts.sglang import LayerLiftLinker
from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]


def lookup(host: SGLangHost, toks: list[int]) -> list[int]:
    """The linker's restorable set for ``toks``'s pages, asked as SGLang's
    components ask (KV: every page; SWA: the trailing window; MAMBA: the last page)."""
    hashes = page_hashes(toks)
    w = -(-SHAPE.window // PAGE)
    return host.linker.lookup("probe", [
        PoolTransfer(name=PoolName.KV, keys=hashes),
        PoolTransfer(name=PoolName.SWA, keys=hashes[-w:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)])


def test_the_dynamic_loader_builds_a_layerlift_linker(make_host: Any) -> None:
    host = make_host()
    assert isinstance(host.linker, LayerLiftLinker)
    assert not inspect.isabstract(LayerLiftLinker)
    assert set(host.linker.pools) == {PoolName.KV, PoolName.SWA, PoolName.MAMBA}
    assert host.cache.linker.layer_done_counter is host.linker.layer_done_counter
    # The fingerprint names the model and its layout; the object format is in every key.
    assert host.linker.key_schema.prefix.startswith("test-")
    assert ".l3/" in host.linker.key_schema.prefix


@pytest.mark.parametrize("extra, message", [
    ({"colour": "blue"}, "unknown linker_extra_config fields"),
    ({"master_address": None}, "exactly one of master_address"),
    ({"load_timeout_s": 0}, "load_timeout_s must be a positive"),
    ({"lookup_timeout_s": "1"}, "lookup_timeout_s must be a positive"),
    ({"staging_mib": "64"}, "staging_mib must be an integer"),
    ({"offload_staging_mib": 0}, "offload_staging_mib must be an integer >= 1"),
    ({"offload_staging_mib": 1.5}, "offload_staging_mib must be an integer >= 1"),
    ({"lookup_share": 2}, "lookup_share .* must be a number in"),
    ({"ordered_reads": "yes"}, "ordered_reads must be true, false or \"auto\""),
    ({"ordered_reads": 1}, "ordered_reads must be true, false or \"auto\""),
])
def test_a_bad_linker_config_is_refused_with_a_sentence(make_host: Any, extra: dict[str, Any],
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_host(**extra)


@pytest.mark.parametrize("ordered", [True, False])
def test_a_batch_reads_take_turns_unless_told_otherwise(make_host: Any, ordered: bool) -> None:
    """With ``ordered_reads`` a load batch's store reads take turns, lowest
    layer first (``linker/read_order.py``); by default they go as they come."""
    a, b = make_host(), make_host(segment_mib=0, ordered_reads=ordered)
    toks = tokens(4, seed=31)
    a.compute(toks, [4 * PAGE])
    assert a.settle_offloads() >= 1
    r = b.restore([*toks, 9])
    assert r.ok and r.loaded_tokens == 4 * PAGE
    assert_restored(b, r, toks)
    order = b.linker.finished[-1].read_order
    if ordered:
        assert order is not None and order.granted >= b.linker.num_layers
        assert order.impatient == 0
    else:
        assert order is None
    assert b.linker.reads_in_turn == ordered  # not "auto": the setting decides alone


def test_auto_order_follows_the_last_batch_forward(make_host: Any) -> None:
    """``ordered_reads: "auto"`` (the default): the first batch's reads go as
    they come; a forward whose layers compute longer than a layer's read
    turns the next batch's reads in turn; a forward that asks for every layer
    at once (SGLang's whole-batch wait) computes nothing between them and
    turns them back. Every restore exact."""
    a, b = make_host(), make_host(segment_mib=0)
    assert b.linker.settings.ordered_reads == "auto" and not b.linker.reads_in_turn
    prompts = [tokens(4, seed=40 + i) for i in range(3)]
    for toks in prompts:
        a.compute(toks, [4 * PAGE])
    assert a.settle_offloads() >= 3
    # 1: as they come; a forward computing 50 ms a layer, far longer than a
    # small layer's read over loopback.
    r = b.restore([*prompts[0], 9], compute_s=0.05)
    assert r.ok and r.loaded_tokens == 4 * PAGE
    assert_restored(b, r, prompts[0])
    first = b.linker.finished[-1]
    assert first.read_order is None
    assert all(ask is not None for ask, reads in zip(first.asks, first.reads, strict=True)
               if reads)
    assert 0 < first.read_s() < 0.05 / 1.25 and b.linker.reads_in_turn
    # 2: in turn; the forward waits for the whole batch before its layers.
    adm = b.admit([*prompts[1], 9])
    b.start_loads()
    b.linker.layer_done_counter.wait_until(b.linker.num_layers - 1)
    b.forward(adm)
    assert b.finish([adm]) == [] and adm.restore.ok
    assert_restored(b, adm.restore, prompts[1])
    second = b.linker.finished[-1]
    assert second.read_order is not None and second.read_order.granted >= b.linker.num_layers
    assert not b.linker.reads_in_turn
    # 3: as they come again.
    r = b.restore([*prompts[2], 9])
    assert r.ok and b.linker.finished[-1].read_order is None
    assert_restored(b, r, prompts[2])


def test_a_second_cache_restores_what_the_first_offloaded_byte_for_byte(make_host: Any) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(6)
    a.compute(toks, [3 * PAGE, 6 * PAGE])
    assert a.settle_offloads() >= 2
    assert b.restore(toks[:PAGE]).hit_tokens == 0  # a 1-page prompt matches nothing (len - 1)
    r = b.restore([*toks, 7])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (6 * PAGE, 6 * PAGE, True)
    assert_restored(b, r, toks)
    # The restored prefix is in b's tree now: the next request hits the device.
    again = b.restore([*toks, 8])
    assert again.hit_tokens == 0 and again.loaded_tokens == 0


def test_lookup_is_the_exact_sparse_set_of_checkpointed_boundaries(make_host: Any) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(8, seed=2)
    a.compute(toks, [2 * PAGE, 5 * PAGE, 8 * PAGE])
    a.settle_offloads()
    # Mamba state exists only at the checkpoints: the FULL pages alone would allow 1..8.
    assert lookup(b, toks) == [2, 5, 8]
    assert lookup(b, toks[: 7 * PAGE]) == [2, 5]
    assert lookup(b, tokens(8, seed=3)) == []


@pytest.mark.parametrize("pages, hit", [(4, 2), (5, 5), (6, 5), (8, 8)])
def test_a_restore_converges_to_the_largest_checkpoint_at_or_below_it(
        make_host: Any, pages: int, hit: int) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(8, seed=4)
    a.compute(toks, [2 * PAGE, 5 * PAGE, 8 * PAGE])
    a.settle_offloads()
    r = b.restore([*toks[:pages * PAGE], 9])
    assert (r.hit_tokens, r.ok) == (hit * PAGE, True)
    assert_restored(b, r, toks[: pages * PAGE])


def test_branches_restore_their_own_bytes_and_the_branch_point(make_host: Any) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    shared = tokens(3, seed=5)
    left, right = tokens(6, seed=6, start=shared), tokens(6, seed=7, start=shared)
    a.compute(left, [3 * PAGE, 6 * PAGE])
    a.compute(right, [6 * PAGE])  # shares the first 3 pages on a's device
    a.settle_offloads()
    r = b.restore([*right, 1])
    assert (r.hit_tokens, r.ok) == (6 * PAGE, True)
    assert_restored(b, r, right)
    # A third branch only shares the branch point, where the checkpoint is.
    other = tokens(5, seed=8, start=shared)
    c = make_host(segment_mib=0)
    r = c.restore([*other, 1])
    assert (r.hit_tokens, r.ok) == (3 * PAGE, True)
    assert_restored(c, r, other[: 3 * PAGE])


def test_a_restore_on_top_of_a_device_prefix_loads_only_the_tail(make_host: Any) -> None:
    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(6, seed=9)
    a.compute(toks, [2 * PAGE, 6 * PAGE])
    a.settle_offloads()
    first = b.restore([*toks[:2 * PAGE], 1])
    assert (first.hit_tokens, first.ok) == (2 * PAGE, True)
    r = b.restore([*toks, 1])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (4 * PAGE, 4 * PAGE, True)
    assert_restored(b, r, toks, start=2 * PAGE)


def test_another_model_or_layout_never_matches(make_host: Any) -> None:
    a = make_host()
    toks = tokens(4, seed=10)
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    other = make_host(segment_mib=0, model="another-model")
    r = other.restore([*toks, 1])
    assert r.hit_tokens == 0


@pytest.mark.parametrize("waits", [True, False], ids=["per-layer-wait", "control-no-wait"])
def test_the_forward_reads_a_layer_only_after_it_landed(make_host: Any, waits: bool) -> None:
    """Layer 3's read is held until the forward reaches layer 3. With the
    counter's wait, the forward reads its bytes exact; the negative control
    (the wait skipped) reads the slots before they landed and must fail."""
    import threading

    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(4, seed=11)
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    store, counter = b.linker.store, b.linker.layer_done_counter
    gate, inner_read, inner_wait = threading.Event(), store.get_ranges, counter.wait_until
    offset3 = b.linker.layouts["swa"].slices[1][0]  # layer 3 is the second SWA layer

    def held_read(keys: Any, dst: Any, sizes: Any, offsets: Any) -> None:
        if "/swa/" in keys[0] and offsets[0][0] == offset3:
            assert gate.wait(10.0), "the forward never reached layer 3"
        inner_read(keys, dst, sizes, offsets)

    def wait_until(layer: int) -> None:
        if layer >= 3:
            gate.set()
        if waits:
            inner_wait(layer)

    store.get_ranges = held_read
    counter.wait_until = wait_until
    r = b.restore([*toks, 1])
    assert r.ok and r.hit_tokens == 4 * PAGE
    if waits:
        assert_restored(b, r, toks)
    else:
        with pytest.raises(AssertionError, match="restored other bytes"):
            assert_restored(b, r, toks)


def test_a_request_released_before_its_load_started_is_never_loaded(make_host: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    a, b = make_host(), make_host(segment_mib=0)
    toks = tokens(4, seed=12)
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    req = b._req([*toks, 1])
    b.req_pool.alloc([req])
    req.init_next_round_input(b.cache)
    loaded, _ = b.cache.init_load_back(InitLoadBackParams(
        best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
    assert loaded == 4 * PAGE and req.rid in b.linker._pending  # queued
    b.cache.linker.release_request(req.rid)  # SGLang's path for an aborted request
    assert req.rid not in b.cache.linker.inflight_load_rids
    assert req.rid not in b.linker._pending and b.linker.ring.idle()
    assert b.linker.start_layer_wise_loading() == -1  # nothing left to load
