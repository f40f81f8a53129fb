"""The connector's scheduler side (`BlockPlanner`) on the in-memory store: which
boundary a hybrid layout can restore, the load and offload plans, the rules
after a failure (never offered again, its objects left out of lookups) and for
an aborted restore (its blocks are held until the restore is reported); keys
as specific as vLLM's block hashes (LoRA, cache_salt) and every TP rank's; a
lookup that never waits for the store and stays linear in the pages."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import layerlift.hosts.vllm.planner as planner_mod
from layerlift.hosts.vllm.layout import (
    GroupKind,
    GroupLayout,
    Layout,
    needed_pages,
    prompt_hashes,
    restorable_pages,
)
from layerlift.hosts.vllm.meta import WorkerReport
from layerlift.hosts.vllm.planner import BlockPlanner
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import ForwardingStore, Store

pytestmark = pytest.mark.vllm

PAGE = 16
GROUPS = (GroupLayout(0, GroupKind.FULL, ("f",)), GroupLayout(1, GroupKind.SWA, ("s",), 32),
          GroupLayout(2, GroupKind.MAMBA, ("m",)))
TOKENS = list(range(3, 3 + 5 * PAGE + 3))  # 5 whole pages and 3 tokens
NS = "ns"


class _Store(MemoryStore):
    """The in-memory store with one registered 8-byte source for `put_keys`."""

    def __init__(self) -> None:
        super().__init__()
        self.source = torch.zeros(8, dtype=torch.uint8)
        self.source_ptr = self.register(self.source)

    def put_keys(self, keys: list[str]) -> None:
        self.put(keys, [self.source_ptr] * len(keys), [8] * len(keys))


class _CountingStore(ForwardingStore):
    """Counts ``exists`` calls and keys; ``hold`` (when set) makes ``exists``
    wait for ``release`` (``entered`` set once it waits): a stalled master."""

    def __init__(self, inner: Store, hold: bool = False) -> None:
        super().__init__(inner)
        self.calls = 0
        self.keys = 0
        self.hold = hold
        self.entered, self.release = threading.Event(), threading.Event()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls += 1
        self.keys += len(keys)
        if self.hold:
            self.entered.set()
            assert self.release.wait(30), "the test never released the held exists"
        return self.inner.exists(keys)


def _layout(groups: tuple[GroupLayout, ...] = GROUPS, tp_size: int = 1) -> Layout:
    return Layout(groups, PAGE, {"f": 64, "s": 64, "m": 32}, "unit", "float32", 0, tp_size)


def _planner(layout: Layout | None = None, store: Store | None = None
             ) -> tuple[BlockPlanner, _Store, Any]:
    layout = layout or _layout()
    mem = _Store()
    return BlockPlanner(store or mem, layout, NS, offload=True), mem, layout.schema(NS)


def _put(store: _Store, keys: list[str]) -> None:
    store.put_keys(keys)


def _keys(schema: Any, component: str, pages: list[int], tokens: list[int] = TOKENS
          ) -> list[str]:
    hashes = prompt_hashes(tokens, PAGE)
    return [schema.key(component, hashes[p]) for p in pages]


def _request(rid: str = "r", tokens: list[int] = TOKENS, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, **extra)


def _lookup(planner: BlockPlanner, request: Any, computed: int = 0) -> int:
    """`matched_tokens` as vLLM drives it: None (asked again next step) until
    the store answered; waits for the lookup's store call between the asks."""
    for _ in range(3):
        n = planner.matched_tokens(request, computed)
        if n is not None:
            return n
        pending = planner.pending_lookup(request.request_id)
        assert pending is not None, "None without a lookup running"
        pending.result(30)
    raise AssertionError("the lookup never answered")


def _step(planner: BlockPlanner, new: list[Any] | None = None,
          scheduled: dict[str, int] | None = None) -> Any:
    return planner.step_meta(SimpleNamespace(num_scheduled_tokens=scheduled or {},
                                             scheduled_new_reqs=new or [],
                                             scheduled_cached_reqs=_no_cached()))


def _no_cached() -> SimpleNamespace:
    return SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                           resumed_req_ids=set())


def test_nothing_stored_is_a_miss() -> None:
    planner, _, _ = _planner()
    assert _lookup(planner, _request()) == 0


def test_boundary_needs_every_group_and_only_the_window() -> None:
    planner, store, schema = _planner()
    _put(store, _keys(schema, "full0", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "swa1", [2, 3]))  # the window of boundary 4 only
    _put(store, _keys(schema, "mamba2", [1, 3]))  # checkpoints at boundaries 2 and 4
    # 5 is out (no checkpoint at 5, no window there); 4 has all three
    assert _lookup(planner, _request()) == 4 * PAGE
    planner.after_alloc(_request(), ([11, 12, 13, 14, 15], [0, 0, 23, 24, 25], [31]), 4 * PAGE)
    (load,) = _step(planner).loads
    blocks = {(g, b) for g, _, b in load.items}
    assert blocks == {(0, 11), (0, 12), (0, 13), (0, 14), (1, 23), (1, 24), (2, 31)}
    hashes = prompt_hashes(TOKENS, PAGE)
    assert {(g, h) for g, h, _ in load.items} == {
        (0, hashes[p]) for p in range(4)} | {(1, hashes[2]), (1, hashes[3]), (2, hashes[3])}
    assert not load.refused and not load.sync


def test_missing_checkpoint_lowers_the_boundary() -> None:
    planner, store, schema = _planner()
    _put(store, _keys(schema, "full0", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "swa1", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "mamba2", [1]))
    assert _lookup(planner, _request()) == 2 * PAGE


def test_a_null_block_in_the_window_refuses_the_load() -> None:
    planner, store, schema = _planner()
    for component in ("full0", "swa1", "mamba2"):
        _put(store, _keys(schema, component, [0, 1]))
    assert _lookup(planner, _request()) == 2 * PAGE
    planner.after_alloc(_request(), ([11, 12, 13], [0, 22, 23], [31]), 2 * PAGE)
    (load,) = _step(planner).loads
    assert load.refused


def test_failed_restore_is_never_offered_again_and_abort_holds_blocks() -> None:
    planner, store, schema = _planner()
    for component in ("full0", "swa1", "mamba2"):
        _put(store, _keys(schema, component, [0, 1]))
    request = _request()
    assert _lookup(planner, request) == 2 * PAGE
    planner.after_alloc(request, ([11, 12, 13], [21, 22, 23], [31]), 2 * PAGE)
    other = _request("q")
    assert _lookup(planner, other) == 2 * PAGE
    planner.after_alloc(other, ([11, 12, 13], [21, 22, 23], [31]), 2 * PAGE)
    assert planner.finished(other)  # aborted mid-restore: vLLM keeps the blocks
    planner.loads_reported({"r"}, {"r"})
    assert _lookup(planner, request) == 0
    assert not planner.finished(request)


def test_a_corrupt_object_is_out_of_lookups_until_every_rank_replaced_it() -> None:
    """A lookup's exists renews Mooncake's read lease, which keeps a corrupt
    object from being removed: what a worker reports corrupt is left out of
    lookups (never asked) until every TP rank's worker replaced it."""
    layout = _layout(tp_size=2)
    counting = _CountingStore(_Store())
    planner, _, _ = _planner(layout, counting)
    store = counting.inner
    assert isinstance(store, _Store)
    for rank in (0, 1):
        for component in ("full0", "swa1", "mamba2"):
            _put(store, _keys(layout.schema(NS, rank), component, [0, 1, 2]))
    assert _lookup(planner, _request("a")) == 3 * PAGE
    hashes = prompt_hashes(TOKENS, PAGE)
    planner.worker_report(WorkerReport(corrupt={(0, hashes[1])}))
    asked = counting.keys
    assert _lookup(planner, _request("b")) == PAGE  # full0 page 1 is out
    assert counting.keys - asked == 2 * (3 * 5 - 1)  # 2 ranks x (3 groups x 5 pages - 1)
    planner.worker_report(WorkerReport(replaced={(0, 0, hashes[1])}))
    assert _lookup(planner, _request("c")) == PAGE  # rank 1 has not replaced it yet
    planner.worker_report(WorkerReport(replaced={(1, 0, hashes[1])}))
    assert _lookup(planner, _request("d")) == 3 * PAGE


def _prefill_three_pages(planner: BlockPlanner) -> Any:
    """A cold request's first step computes pages 0-2 (blocks 11-13; the
    sliding group's page 0 already out of its window, its block null; the
    state in block 31): the step's one save."""
    request = _request()
    assert _lookup(planner, request) == 0
    planner.after_alloc(request, ([11, 12, 13], [21, 22, 23], [31]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([11, 12, 13], [0, 22, 23], [31]),
                          num_computed_tokens=0)
    (save,) = _step(planner, [new], {"r": 3 * PAGE}).saves
    return save


def test_a_prefill_offloads_its_pages_and_the_checkpoint_at_its_end() -> None:
    planner, _, _ = _planner()
    save = _prefill_three_pages(planner)
    hashes = prompt_hashes(TOKENS, PAGE)
    want = {(0, hashes[p], b) for p, b in zip([0, 1, 2], [11, 12, 13], strict=True)}
    want |= {(1, hashes[p], b) for p, b in zip([1, 2], [22, 23], strict=True)}
    want |= {(2, hashes[2], 31)}  # the step ended on a page boundary
    assert set(save.items) == want


def test_a_local_prefix_hit_is_not_offloaded_as_the_requests_own_pages() -> None:
    """Prefix caching: a request whose first two pages are a local hit (blocks
    another request computed, restored or is restoring: a failed restore
    leaves garbage there) offloads only the pages it computes."""
    layout = _layout((GroupLayout(0, GroupKind.FULL, ("f",)),))
    planner, _, _ = _planner(layout)
    request = _request()
    assert _lookup(planner, request, 2 * PAGE) == 0
    planner.after_alloc(request, ([11, 12, 13, 14],), 0)
    new = SimpleNamespace(req_id="r", block_ids=([11, 12, 13, 14],),
                          num_computed_tokens=2 * PAGE)
    (save,) = _step(planner, [new], {"r": 2 * PAGE}).saves
    hashes = prompt_hashes(TOKENS, PAGE)
    assert set(save.items) == {(0, hashes[2], 13), (0, hashes[3], 14)}


def test_failed_sync_blocks_reoffload_the_recompute() -> None:
    """One group (synchronous restores): vLLM reports the blocks of a failed
    restore; the request recomputes from there, and those pages are offloaded
    again (replacing a corrupt object); it is never offered another restore."""
    layout = _layout((GroupLayout(0, GroupKind.FULL, ("f",)),))
    planner, store, schema = _planner(layout)
    _put(store, _keys(schema, "full0", [0, 1, 2]))
    request = _request()
    assert _lookup(planner, request) == 3 * PAGE
    planner.after_alloc(request, ([11, 12, 13, 14, 15],), 3 * PAGE)
    (load,) = _step(planner).loads
    assert load.sync
    planner.loads_reported(set(), set(), {12})  # page 1 did not land
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[PAGE],
                             resumed_req_ids=set())
    meta = planner.step_meta(SimpleNamespace(num_scheduled_tokens={"r": 4 * PAGE},
                                             scheduled_new_reqs=[],
                                             scheduled_cached_reqs=cached))
    hashes = prompt_hashes(TOKENS, PAGE)
    assert {(h, b) for _, h, b in meta.saves[0].items} == {
        (hashes[p], b) for p, b in zip([1, 2, 3, 4], [12, 13, 14, 15], strict=True)}
    assert _lookup(planner, request, 0) == 0  # preempted and back: no second offer


def test_cache_salt_and_lora_change_every_key() -> None:
    """vLLM's own block hashes cover the LoRA adapter and cache_salt: a prefix
    offloaded under one never matches under another or under none."""
    from vllm.lora.request import LoRARequest

    layout = _layout((GroupLayout(0, GroupKind.FULL, ("f",)),))
    planner, store, _ = _planner(layout)

    def req(rid: str, salt: str | None = None, lora: Any = None) -> SimpleNamespace:
        return _request(rid, cache_salt=salt, lora_request=lora, mm_features=[],
                        prompt_embeds=None)

    alice = req("a", salt="alice")
    assert _lookup(planner, alice) == 0
    planner.after_alloc(alice, ([11, 12, 13, 14, 15, 16],), 0)
    new = SimpleNamespace(req_id="a", block_ids=([11, 12, 13, 14, 15, 16],),
                          num_computed_tokens=0)
    (save,) = _step(planner, [new], {"a": len(TOKENS)}).saves
    plain = set(prompt_hashes(TOKENS, PAGE))
    assert not plain & {h for _, h, _ in save.items}
    schema = layout.schema(NS)
    _put(store, [schema.key("full0", h) for _, h, _ in save.items])
    assert _lookup(planner, req("a2", salt="alice")) == 5 * PAGE
    assert _lookup(planner, req("b", salt="bob")) == 0
    assert _lookup(planner, req("n")) == 0
    lora = LoRARequest("adapter", 1, "/adapters/a")
    assert _lookup(planner, req("l", salt="alice", lora=lora)) == 0
    _put(store, _keys(schema, "full0", [0, 1, 2]))  # plain, no salt: computed without LoRA
    assert _lookup(planner, req("l2", lora=lora)) == 0
    assert _lookup(planner, req("p")) == 3 * PAGE


def test_every_tp_rank_must_hold_the_page() -> None:
    """TP = 2: a restore needs rank 0's and rank 1's objects; rank 1's keys
    differ from rank 0's in the rank segment."""
    layout = _layout((GroupLayout(0, GroupKind.FULL, ("f",)),), tp_size=2)
    planner, store, _ = _planner(layout)
    r0, r1 = layout.schema(NS, 0), layout.schema(NS, 1)
    assert r0.prefix == r1.prefix and _keys(r0, "full0", [0]) != _keys(r1, "full0", [0])
    _put(store, _keys(r0, "full0", [0, 1, 2, 3]))
    _put(store, _keys(r1, "full0", [0, 1]))
    assert _lookup(planner, _request()) == 2 * PAGE


def test_lookup_never_waits_for_a_stalled_store() -> None:
    """The engine core is never blocked by the store: while ``exists`` hangs,
    `matched_tokens` answers None (ask again); a lookup not answered within
    its bound is a miss; after the store answers, the next ask has the hit."""
    mem = _Store()
    held = _CountingStore(mem, hold=True)
    layout = _layout((GroupLayout(0, GroupKind.FULL, ("f",)),))
    planner = BlockPlanner(held, layout, NS, offload=True, lookup_timeout_s=60.0)
    _put(mem, _keys(layout.schema(NS), "full0", [0, 1, 2]))
    answered = threading.Event()
    got: list[int | None] = []

    def ask() -> None:
        got.append(planner.matched_tokens(_request(), 0))
        answered.set()

    threading.Thread(target=ask, daemon=True).start()
    try:
        assert held.entered.wait(30)
        assert answered.wait(10), "matched_tokens waited for the stalled store"
        assert got == [None]
        assert planner.matched_tokens(_request(), 0) is None  # still running: ask again
    finally:
        held.release.set()
    pending = planner.pending_lookup("r")
    assert pending is not None
    pending.result(30)
    assert planner.matched_tokens(_request(), 0) == 3 * PAGE
    # a bound of 0 s: a lookup not answered at once is a miss, never a wait
    held.hold, held.release = True, threading.Event()
    quick = BlockPlanner(held, layout, NS, offload=True, lookup_timeout_s=0.0)
    try:
        assert quick.matched_tokens(_request("q"), 0) is None
        assert held.entered.wait(30)
        assert quick.matched_tokens(_request("q"), 0) == 0
    finally:
        held.release.set()
        quick.close()
        planner.close()


def test_long_prompt_lookup_is_linear_in_pages(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A 128k-token prompt at block size 16 (8192 pages), half of it stored:
    one store call over at most groups x pages keys, and the boundary search
    touches each (group, page) a bounded number of times (it was quadratic:
    5.9-7.5 s per lookup on the engine core)."""
    layout = _layout()
    counting = _CountingStore(_Store())
    planner, _, schema = _planner(layout, counting)
    store = counting.inner
    assert isinstance(store, _Store)
    tokens = [random.Random(5).randrange(3, 500) for _ in range(128 * 1024)]
    pages = len(tokens) // PAGE
    half = pages // 2
    for component in ("full0", "swa1", "mamba2"):
        _put(store, _keys(schema, component, list(range(half)), tokens))
    probes = 0
    real = planner_mod.restorable_pages

    class Counting(dict[tuple[int, int], bool]):
        def get(self, key: Any, default: Any = None) -> Any:
            nonlocal probes
            probes += 1
            return super().get(key, default)

        def __getitem__(self, key: Any) -> bool:
            nonlocal probes
            probes += 1
            return super().__getitem__(key)

    monkeypatch.setattr(planner_mod, "restorable_pages",
                        lambda lay, lo, hi, present: real(lay, lo, hi, Counting(present)))
    monkeypatch.setattr(planner_mod, "needed_pages", _counted_needed_pages)
    started = time.perf_counter()
    n = _lookup(planner, _request("long", tokens))
    took = time.perf_counter() - started
    assert n == half * PAGE
    assert counting.calls == 1 and counting.keys <= 3 * pages
    assert probes <= 3 * 3 * pages  # linear: was ~pages^2 / 2 per group
    assert _NEEDED[0] <= 3 * pages
    with capsys.disabled():
        print(f"\n128k-token lookup (8192 pages, 3 groups, in-memory store): {took * 1e3:.1f} ms"
              f", {counting.calls} exists call over {counting.keys} keys, {probes} probes")


_NEEDED = [0]


def _counted_needed_pages(layout: Layout, group: GroupLayout, local: int,
                          boundary: int) -> list[int]:
    out = needed_pages(layout, group, local, boundary)
    _NEEDED[0] += len(out)
    return out


def test_linear_boundary_search_matches_the_definition() -> None:
    """`restorable_pages` (one pass) against its definition (the largest
    boundary where every needed page of every group is present) on random
    presence patterns, windows and local hits."""
    rng = random.Random(11)
    for trial in range(300):
        groups = (GroupLayout(0, GroupKind.FULL, ("f",)),
                  GroupLayout(1, GroupKind.SWA, ("s",), rng.choice([1, 16, 17, 32, 50])),
                  GroupLayout(2, GroupKind.MAMBA, ("m",)))
        chosen = tuple(g for g in groups if rng.random() < 0.7) or groups[:1]
        layout = Layout(chosen, PAGE, {"f": 8, "s": 8, "m": 8}, "unit", "float32")
        max_pages = rng.randrange(1, 14)
        local = rng.randrange(0, max_pages)
        density = rng.random()
        present = {(g.index, p): rng.random() < density
                   for g in chosen for p in range(max_pages)}
        want = next((b for b in range(max_pages, local, -1)
                     if all(present.get((g.index, p), False) for g in chosen
                            for p in needed_pages(layout, g, local, b))), local)
        assert restorable_pages(layout, local, max_pages, present) == want, trial


def _pool(blocks: int = 64) -> Any:
    """vLLM's own block pool, its first ``blocks`` - 1 blocks handed out as a
    running request's (reference count 1 each; block 0 is vLLM's null block)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(blocks, enable_caching=True, hash_block_size=PAGE)
    pool.get_new_blocks(blocks - 1)
    return pool


def _refs(pool: Any, blocks: Sequence[int]) -> list[int]:
    return [pool.blocks[b].ref_cnt for b in blocks]


def test_a_save_holds_its_attention_blocks_until_every_rank_reported_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """With vLLM's block pool bound, a step's save is a job holding one
    reference on each of its attention blocks (not the recurrent state's,
    which the next step rewrites, nor the null block); a freed (finished,
    preempted) request's blocks stay out of the free queue until both TP
    ranks reported the job; then the references drop, once: a third report,
    or one of a job never taken, frees nothing."""
    planner, _, _ = _planner(_layout(tp_size=2))
    pool = _pool()
    planner.bind_block_pool(pool)
    save = _prefill_three_pages(planner)
    assert save.job is not None and planner.pending_saves()
    held = [11, 12, 13, 22, 23]
    assert _refs(pool, held) == [2] * 5 and _refs(pool, [31]) == [1]
    free = pool.get_num_free_blocks()
    pool.free_blocks(pool.blocks[b] for b in [*held, 31])  # vLLM frees the request
    assert pool.get_num_free_blocks() == free + 1  # the state block only
    planner.worker_report(WorkerReport(saved={save.job: 1}))
    assert _refs(pool, held) == [1] * 5 and planner.pending_saves()
    planner.worker_report(WorkerReport(saved={save.job: 1}))
    assert _refs(pool, held) == [0] * 5 and not planner.pending_saves()
    assert pool.get_num_free_blocks() == free + 6
    with caplog.at_level("ERROR", logger="vllm.layerlift"):
        planner.worker_report(WorkerReport(saved={save.job: 1, 99: 2}))
    assert _refs(pool, held) == [0] * 5 and pool.get_num_free_blocks() == free + 6
    assert caplog.text.count("holds no blocks") == 2


def test_merged_reports_add_up_and_an_overcount_frees_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM merges the workers' reports (`WorkerReport.merge`): the counts of
    one job add up; a job reported by more workers than it waits for is
    logged and its references drop exactly once."""
    merged = WorkerReport(saved={1: 1, 2: 1}).merge(WorkerReport(saved={1: 1}))
    assert merged.saved == {1: 2, 2: 1} and merged
    planner, _, _ = _planner(_layout(tp_size=2))
    pool = _pool()
    planner.bind_block_pool(pool)
    assert planner.holds is not None
    job = planner.holds.take([5, 5, 6, 0])
    assert _refs(pool, [5, 6]) == [2, 2] and planner.holds.blocks() == 2
    with caplog.at_level("ERROR", logger="vllm.layerlift"):
        planner.worker_report(WorkerReport(saved={job: 3}))
    assert _refs(pool, [5, 6]) == [1, 1] and "reported by 3 workers" in caplog.text
    assert not planner.pending_saves()


def test_without_a_bound_pool_saves_carry_no_job() -> None:
    """A planner vLLM gave no block pool: saves are copied within the step
    (no job); a stray report is logged, nothing else."""
    planner, _, _ = _planner()
    request = _request()
    assert _lookup(planner, request) == 0
    planner.after_alloc(request, ([11], [21], [31]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([11], [21], [31]), num_computed_tokens=0)
    (save,) = _step(planner, [new], {"r": PAGE}).saves
    assert save.job is None and not planner.pending_saves()
    planner.worker_report(WorkerReport(saved={0: 1}))
