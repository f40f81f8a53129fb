"""LayerLift inside vLLM 0.33.0's real `Scheduler`, unit level, on this CPU machine.

vLLM's scheduler (or `LayerLiftScheduler`) is built for real with
`LayerLiftConnector` over the in-memory store (`vllm033_sched`); requests
go through 0.33's own ``schedule`` and ``update_from_output`` with the
worker's output made from each `SchedulerOutput`. Checked: a restore
planned from 0.33's request data (its block ids, in every group), its
connector metadata across the process boundary (pickled, as vLLM's
message queue ships it) into a worker-side connector; offloads that follow
0.33's block tables through a preemption, as 0.33's ``yield_req_data``
(``is_full_table``) reads them; a failed synchronous restore of a hybrid
recomputed (or failed, with ``kv_load_failure_policy="fail"``) by
`LayerLiftScheduler` as 0.33 calls ``update_from_output``; the Mamba
checkpoint split as 0.33 calls ``_mamba_block_aligned_split`` (from its
waiting and its running loop); a deferred ``update_state_after_alloc``
(0.33 only) and an abort before it."""

from __future__ import annotations

import pickle
import time
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm033_sched import BLOCK, Built, build, output_of, request, steps

from layerlift.hosts.vllm.connector import KVConnectorRole, LayerLiftConnector, LayerLiftMetadata
from layerlift.hosts.vllm.layout import prompt_hashes
from layerlift.hosts.vllm.meta import StepMeta
from layerlift.hosts.vllm.scheduler import LayerLiftScheduler

pytestmark = pytest.mark.vllm033

PROMPT = list(range(3, 3 + 5 * BLOCK + 3))  # 5 whole pages and 3 tokens
OTHER = list(range(300, 300 + 3 * BLOCK + 5))


def _meta(out: Any) -> StepMeta:
    meta = out.kv_connector_metadata
    assert isinstance(meta, LayerLiftMetadata), type(meta)
    return meta.step


def _restore(built: Built, tokens: list[int], req_id: str = "r1") -> Any:
    """Store ``tokens``' 5 pages, add the request, and return the step that
    scheduled it (the one after its held lookup)."""
    built.put_pages(tokens, 5)
    built.scheduler.add_request(request(tokens, req_id))
    first = built.schedule()
    assert req_id not in first.num_scheduled_tokens, "scheduled before its lookup answered"
    assert not _meta(first).loads
    second = built.schedule()
    assert req_id in second.num_scheduled_tokens
    return second


def test_a_restore_is_planned_from_033s_request_data_and_reaches_the_worker(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One group (synchronous): the step after the lookup schedules the 3
    tokens beyond the 5 restorable pages; its metadata loads page ``p``
    into the block 0.33's `NewRequestData` (and its KV cache manager) has
    at ``p``; pickled and bound on a worker-side connector, the worker
    reads the same plan."""
    built = build(tiny_model, monkeypatch)
    out = _restore(built, PROMPT)
    assert out.num_scheduled_tokens["r1"] == 3
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "r1" and new.num_computed_tokens == 5 * BLOCK
    blocks = new.block_ids[0]
    assert tuple(blocks) == tuple(built.scheduler.kv_cache_manager.get_block_ids("r1")[0])
    (load,) = _meta(out).loads
    hashes = prompt_hashes(PROMPT, BLOCK)
    assert load.req_id == "r1" and load.sync and not load.refused
    assert load.items == [(0, hashes[p], blocks[p]) for p in range(5)]

    shipped = pickle.loads(pickle.dumps(out))  # vLLM's message queue pickles it
    worker = LayerLiftConnector(built.vllm_config, KVConnectorRole.WORKER, built.kv_cache_config)
    worker.bind_connector_metadata(shipped.kv_connector_metadata)
    assert worker._step() == _meta(out)
    worker.clear_connector_metadata()
    assert worker._step() is None


def test_offloads_follow_033s_block_tables_through_a_preemption(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss prefilled in chunks of 32 tokens offloads each prompt page
    once, from the block 0.33's manager holds at that page. After vLLM's
    own preemption the request is resumed (``resumed_req_ids``, a whole
    table: ``yield_req_data``'s ``is_full_table``), and the planner's tables
    equal those rebuilt from ``yield_req_data`` and the manager's."""
    built = build(tiny_model, monkeypatch, max_tokens=32)
    sched = built.scheduler
    sched.add_request(request(OTHER, "r2", max_tokens=8))
    tables: dict[str, list[list[int]]] = {}
    saved: dict[int, int] = {}
    resumed = False
    hashes = prompt_hashes(OTHER, BLOCK)
    for n, out in enumerate(steps(built)):
        for req_id, ids, full in yield_req_data(out):
            if ids is not None:
                tables[req_id] = ([list(b) for b in ids] if full
                                  else [t + list(b) for t, b in zip(tables[req_id], ids, strict=True)])
        resumed |= "r2" in out.scheduled_cached_reqs.resumed_req_ids
        for save in _meta(out).saves:
            for g, h, block in save.items:
                page = hashes.index(h)
                assert page not in saved, f"page {page} offloaded twice"
                saved[page] = block
                assert tables["r2"][g][page] == block
        if "r2" in sched.requests and sched.requests["r2"].status == RequestStatus.RUNNING:
            assert built.connector.planner._tracks["r2"].blocks == tables["r2"]
            assert tables["r2"] == [list(b) for b in sched.kv_cache_manager.get_block_ids("r2")]
        if n == 2:  # mid-prefill: vLLM's own preemption of a running request
            req = sched.requests["r2"]
            sched.running.remove(req)
            sched._preempt_request(req, time.monotonic())
    assert resumed, "the preempted request never came back as resumed"
    assert sorted(saved) == [0, 1, 2]


def _two_groups(built: Built) -> None:
    groups = built.connector.groups
    assert len(groups) == 2 and built.connector.planner.sync_loads


def test_a_failed_sync_restore_of_a_hybrid_is_recomputed_as_033_runs_it(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full + sliding window with `LayerLiftScheduler`: the restore runs
    during the step (synchronous, both groups' blocks); the workers report
    it failed; 0.33's ``update_from_output`` then delivers no token of it,
    the request is preempted (waiting, nothing computed) and rescheduled
    from token 0 with no second restore, while a request of the same step
    keeps its token."""
    built = build(tiny_model, monkeypatch, kind="swa", cls=LayerLiftScheduler)
    _two_groups(built)
    sched = built.scheduler
    sched.add_request(request(OTHER, "r2"))
    out = _restore(built, PROMPT)
    assert set(out.num_scheduled_tokens) == {"r1", "r2"}
    (load,) = _meta(out).loads
    assert load.sync and {g for g, _, _ in load.items} == {0, 1}
    result = sched.update_from_output(out, output_of(out, sched, failed={"r1"}))
    delivered = {o.request_id: o.new_token_ids for eco in result.values() for o in eco.outputs}
    assert delivered.get("r2") == [7]
    assert not delivered.get("r1"), "the failed step's token was delivered"
    r1 = sched.requests["r1"]
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert r1 in sched.waiting and r1 not in sched.running
    again = built.schedule()
    assert again.num_scheduled_tokens["r1"] == len(PROMPT)  # recomputed whole
    assert not _meta(again).loads


def test_the_control_without_a_failure_delivers_the_token(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step reported without a failure: the restored request's
    token is delivered and it keeps running."""
    built = build(tiny_model, monkeypatch, kind="swa", cls=LayerLiftScheduler)
    out = _restore(built, PROMPT)
    result = built.scheduler.update_from_output(out, output_of(out, built.scheduler))
    delivered = {o.request_id: o.new_token_ids for eco in result.values() for o in eco.outputs}
    assert delivered == {"r1": [7]}
    assert built.scheduler.requests["r1"].status == RequestStatus.RUNNING


def test_the_fail_policy_ends_the_request_with_an_error(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_load_failure_policy="fail"``: the failed request ends with
    FinishReason.ERROR in 0.33's output (``error`` unset, as vLLM's own
    load-failure path leaves it) and leaves the scheduler."""
    built = build(tiny_model, monkeypatch, kind="swa", cls=LayerLiftScheduler, policy="fail")
    out = _restore(built, PROMPT)
    result = built.scheduler.update_from_output(out, output_of(out, built.scheduler,
                                                               failed={"r1"}))
    (ended,) = [o for eco in result.values() for o in eco.outputs if o.request_id == "r1"]
    assert ended.finish_reason == FinishReason.ERROR and ended.new_token_ids == []
    assert ended.error is None
    assert "r1" not in built.scheduler.requests


def test_the_mamba_split_as_033_calls_the_hook(tiny_model: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Full attention + Mamba (``mamba_cache_mode="none"``), chunks of at
    most 100 tokens, a 337-token prompt: `LayerLiftScheduler` ends chunks on
    block boundaries and one step at 336 (the last boundary before the
    end), whose metadata offloads the Mamba checkpoint; 0.33 called the
    hook with four arguments from its waiting loop, then two. vLLM's own
    scheduler (the control) splits nothing."""
    calls: list[int] = []

    class Spy(LayerLiftScheduler):
        def _mamba_block_aligned_split(self, request: Any, *args: Any) -> int:
            calls.append(1 + len(args))
            return super()._mamba_block_aligned_split(request, *args)

    prompt = list(range(3, 340))
    built = build(tiny_model, monkeypatch, kind="mamba", cls=Spy, max_tokens=100)
    built.scheduler.add_request(request(prompt, "m1", max_tokens=1))
    outs = [o for o in steps(built) if o.total_num_scheduled_tokens]
    assert [o.num_scheduled_tokens["m1"] for o in outs] == [96, 96, 96, 48, 1]
    assert calls[0] == 4 and set(calls[1:]) == {2}, calls
    mamba_saves = [(n, item) for n, o in enumerate(outs) for s in _meta(o).saves
                   for item in s.items if item[0] == 1]
    hashes = prompt_hashes(prompt, BLOCK)
    assert [(n, h) for n, (_, h, _) in mamba_saves] == [
        (0, hashes[5]), (1, hashes[11]), (2, hashes[17]), (3, hashes[20])]

    plain = build(tiny_model, monkeypatch, kind="mamba", cls=Scheduler, max_tokens=100)
    plain.scheduler.add_request(request(prompt, "m1", max_tokens=1))
    sizes = [o.num_scheduled_tokens["m1"] for o in steps(plain) if o.total_num_scheduled_tokens]
    assert sizes == [100, 100, 100, 37]


def test_a_deferred_update_state_after_alloc_and_an_abort_before_it(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 defers ``update_state_after_alloc`` of an asynchronous load
    while an earlier step is in flight (``defer_async_loads``: overlapping
    batches with HiSparse, set here on the real scheduler). A hybrid
    without the scheduler class loads asynchronously: the request waits
    for remote KV, the step's metadata holds no load; the load appears in
    the metadata of the step after the in-flight one was processed, with
    the request's blocks. A second request aborted before its deferred call
    is never loaded and its blocks are not held (the connector says so)."""
    built = build(tiny_model, monkeypatch, kind="swa")
    sched = built.scheduler
    assert not built.connector.planner.sync_loads
    sched.defer_block_free = sched.defer_async_loads = True
    sched.add_request(request(OTHER, "r0"))
    in_flight = built.schedule()  # r0's lookup (a miss) held: nothing scheduled yet
    in_flight = built.schedule()
    assert "r0" in in_flight.num_scheduled_tokens
    built.put_pages(PROMPT, 5)
    sched.add_request(request(PROMPT, "r1"))
    sched.add_request(request([*PROMPT[:-1], 9], "r3"))
    held = built.schedule()  # lookups of r1 and r3, held
    assert not {"r1", "r3"} & set(held.num_scheduled_tokens)
    admitted = built.schedule()  # r1 and r3 admitted, their loads deferred
    assert set(sched.deferred_loads) == {"r1", "r3"}
    assert not _meta(admitted).loads
    assert sched.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    assert "r3" not in sched.requests and "r3" not in sched.deferred_loads
    assert "r3" not in built.connector.planner._tracks
    for out in (in_flight, held, admitted):
        if out.total_num_scheduled_tokens:
            sched.update_from_output(out, output_of(out, sched))
    assert not sched.deferred_loads
    nxt = built.schedule()
    loads = _meta(nxt).loads
    assert [spec.req_id for spec in loads] == ["r1"]
    blocks = sched.kv_cache_manager.get_block_ids("r1")
    hashes = prompt_hashes(PROMPT, BLOCK)
    assert (0, hashes[0], blocks[0][0]) in loads[0].items and not loads[0].sync
