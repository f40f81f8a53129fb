"""The connector's scheduler side (`BlockPlanner`) on the in-memory store: which
boundary a hybrid layout can restore, the load and offload plans, and the
rules after a failure (never offered again) and for an aborted restore (its
blocks are held until the restore is reported)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout, prompt_hashes
from layerlift.hosts.vllm.planner import BlockPlanner
from layerlift.linker.memory_store import MemoryStore

pytestmark = pytest.mark.vllm

PAGE = 16
GROUPS = (GroupLayout(0, GroupKind.FULL, ("f",)), GroupLayout(1, GroupKind.SWA, ("s",), 32),
          GroupLayout(2, GroupKind.MAMBA, ("m",)))
TOKENS = list(range(3, 3 + 5 * PAGE + 3))  # 5 whole pages and 3 tokens


class _Store(MemoryStore):
    """The in-memory store with one registered 8-byte source for `put_keys`."""

    def __init__(self) -> None:
        super().__init__()
        self.source = torch.zeros(8, dtype=torch.uint8)
        self.source_ptr = self.register(self.source)

    def put_keys(self, keys: list[str]) -> None:
        self.put(keys, [self.source_ptr] * len(keys), [8] * len(keys))


def _planner() -> tuple[BlockPlanner, _Store, Any]:
    layout = Layout(GROUPS, PAGE, {"f": 64, "s": 64, "m": 32}, "unit", "float32")
    store = _Store()
    schema = layout.schema("ns")
    return BlockPlanner(store, layout, schema, offload=True), store, schema


def _put(store: _Store, keys: list[str]) -> None:
    store.put_keys(keys)


def _keys(schema: Any, component: str, pages: list[int]) -> list[str]:
    hashes = prompt_hashes(TOKENS, PAGE)
    return [schema.key(component, hashes[p]) for p in pages]


def _request(rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS)


def test_nothing_stored_is_a_miss() -> None:
    planner, _, _ = _planner()
    assert planner.matched_tokens(_request(), 0) == 0


def test_boundary_needs_every_group_and_only_the_window() -> None:
    planner, store, schema = _planner()
    _put(store, _keys(schema, "full0", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "swa1", [2, 3]))  # the window of boundary 4 only
    _put(store, _keys(schema, "mamba2", [1, 3]))  # checkpoints at boundaries 2 and 4
    # 5 is out (no checkpoint at 5, no window there); 4 has all three
    assert planner.matched_tokens(_request(), 0) == 4 * PAGE
    planner.after_alloc(_request(), ([11, 12, 13, 14, 15], [0, 0, 23, 24, 25], [31]), 4 * PAGE)
    (load,) = planner.step_meta(SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                                                scheduled_cached_reqs=_no_cached())).loads
    blocks = {(g, b) for g, _, b in load.items}
    assert blocks == {(0, 11), (0, 12), (0, 13), (0, 14), (1, 23), (1, 24), (2, 31)}
    assert not load.refused and not load.sync


def test_missing_checkpoint_lowers_the_boundary() -> None:
    planner, store, schema = _planner()
    _put(store, _keys(schema, "full0", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "swa1", [0, 1, 2, 3, 4]))
    _put(store, _keys(schema, "mamba2", [1]))
    assert planner.matched_tokens(_request(), 0) == 2 * PAGE


def test_a_null_block_in_the_window_refuses_the_load() -> None:
    planner, store, schema = _planner()
    for component in ("full0", "swa1", "mamba2"):
        _put(store, _keys(schema, component, [0, 1]))
    assert planner.matched_tokens(_request(), 0) == 2 * PAGE
    planner.after_alloc(_request(), ([11, 12, 13], [0, 22, 23], [31]), 2 * PAGE)
    (load,) = planner.step_meta(SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                                                scheduled_cached_reqs=_no_cached())).loads
    assert load.refused


def test_failed_restore_is_never_offered_again_and_abort_holds_blocks() -> None:
    planner, store, schema = _planner()
    for component in ("full0", "swa1", "mamba2"):
        _put(store, _keys(schema, component, [0, 1]))
    request = _request()
    assert planner.matched_tokens(request, 0) == 2 * PAGE
    planner.after_alloc(request, ([11, 12, 13], [21, 22, 23], [31]), 2 * PAGE)
    planner.loads_reported({"r"}, {"r"})
    assert planner.matched_tokens(request, 0) == 0
    other = _request("q")
    assert planner.matched_tokens(other, 0) == 2 * PAGE
    planner.after_alloc(other, ([11, 12, 13], [21, 22, 23], [31]), 2 * PAGE)
    assert planner.finished(other)  # aborted mid-restore: vLLM keeps the blocks
    assert not planner.finished(request)


def test_a_prefill_offloads_its_pages_and_the_checkpoint_at_its_end() -> None:
    planner, _, schema = _planner()
    request = _request()
    assert planner.matched_tokens(request, 0) == 0
    planner.after_alloc(request, ([11, 12, 13], [21, 22, 23], [31]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([11, 12, 13], [0, 22, 23], [31]),
                          num_computed_tokens=0)
    meta = planner.step_meta(SimpleNamespace(num_scheduled_tokens={"r": 3 * PAGE},
                                             scheduled_new_reqs=[new],
                                             scheduled_cached_reqs=_no_cached()))
    (save,) = meta.saves
    got = {(g, k, b) for g, k, b in save.items}
    want = {(0, k, b) for k, b in zip(_keys(schema, "full0", [0, 1, 2]), [11, 12, 13],
                                      strict=True)}
    want |= {(1, k, b) for k, b in zip(_keys(schema, "swa1", [1, 2]), [22, 23], strict=True)}
    want |= {(2, _keys(schema, "mamba2", [2])[0], 31)}  # the step ended on a page boundary
    assert got == want


def _no_cached() -> SimpleNamespace:
    return SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                           resumed_req_ids=set())
