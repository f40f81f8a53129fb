"""`LayerLiftScheduler`: vLLM's `Scheduler` (0.32, 0.33) that lets hybrids restore synchronously.

Opt in with ``scheduler_cls="layerlift.hosts.vllm.LayerLiftScheduler"``
(``--scheduler-cls``) and ``async_scheduling=False``
(``--no-async-scheduling``) beside `LayerLiftConnector`. vLLM's own
scheduler maps load failures of *running* requests back only as block ids
of one KV cache group (``Scheduler._handle_invalid_blocks`` raises for
several) and ignores a ``failed_recving`` of a request that is not in
``WAITING_FOR_REMOTE_KVS``, so the connector restores hybrids (sliding +
full attention, Mamba + attention) asynchronously without this class. With
it:

* the connector restores multi-group models *synchronously* (the forward
  runs while LayerLift fetches layer by layer; Mamba state lands in
  ``start_load_kv``, each attention layer waits for its own layer);
* a request whose restore did not land verified in a step (the workers
  report it per request, `WorkerReport.failed`) is handled before vLLM
  reads that step's output, as ``kv_load_failure_policy`` says:
  ``"recompute"``: the blocks from its restore's first block on, in every
  group, are evicted from vLLM's prefix cache, the request is preempted
  with its in-flight output dropped (the token sampled from the failed
  step is never delivered) and recomputed from its valid local prefix;
  ``"fail"``: it ends with an error. Every other request of the step that
  holds one of those blocks (a local prefix-cache hit on blocks being
  restored) is handled the same way. Nothing raises into vLLM's engine
  core;
* a Mamba hybrid's prefill is split so that one step ends on the last
  block boundary before the prompt's end (the rest, under one block, runs
  in the next step): the state there is offloaded as a checkpoint, so
  prompts of any length restore later.

It overrides vLLM's private ``Scheduler._mamba_block_aligned_split`` and
uses ``_preempt_request`` (the same parameters and call sites in 0.32 and
0.33: ``compat``): it refuses another vLLM release, or a build whose hooks
take other parameters (ValueError at start-up, naming the supported
versions), and async scheduling (a failure must reach the scheduler before
it schedules the next step).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import vllm  # type: ignore[import-not-found, unused-ignore]
from vllm.v1.core.sched.scheduler import (  # type: ignore[import-not-found, unused-ignore]
    Scheduler,
)
from vllm.v1.engine import (  # type: ignore[import-not-found, unused-ignore]
    EngineCoreOutput,
    EngineCoreOutputs,
)
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]

from layerlift.hosts.vllm.compat import check_scheduler_hooks
from layerlift.hosts.vllm.connector import LayerLiftConnector, check_vllm_version
from layerlift.hosts.vllm.layout import GroupKind

__all__ = ["LayerLiftScheduler", "checkpoint_split"]

log = logging.getLogger("vllm.layerlift")
_NULL_BLOCK = 0


def checkpoint_split(start: int, num_new: int, prompt_len: int, page: int) -> int:
    """Tokens to schedule from ``start`` (of ``num_new`` offered) so that a
    prefill step ends on the last page boundary before the prompt's end
    (``(prompt_len - 1) // page * page``: the longest prefix a later lookup
    restores) and an earlier chunk ends on a page boundary when it can.
    Decode steps and steps that cross no such point are not changed."""
    end = start + num_new
    if start >= prompt_len or num_new <= 0:
        return num_new
    cut = (prompt_len - 1) // page * page
    if start < cut < end:
        return cut - start
    if end < min(cut, prompt_len) and end % page:
        aligned = end // page * page
        if aligned > start:
            return aligned - start
    return num_new


class LayerLiftScheduler(Scheduler):  # type: ignore[misc, unused-ignore]
    """vLLM's `Scheduler` plus per-request load failures of running requests
    and Mamba checkpoint splits (module docstring)."""

    LAYERLIFT_SCHEDULER = True  # what the connector checks (uses_layerlift_scheduler)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_scheduler_hooks(Scheduler, check_vllm_version(str(vllm.__version__)))
        super().__init__(*args, **kwargs)
        if self.scheduler_config.async_scheduling:
            raise ValueError("LayerLiftScheduler needs async scheduling off (async_scheduling="
                             "False, --no-async-scheduling): a restore's failure must reach the "
                             "scheduler before it schedules the request's next step.")
        conn = self.connector
        self._layerlift: LayerLiftConnector | None = (
            conn if isinstance(conn, LayerLiftConnector) else None)
        self._split_page = 0
        if self._layerlift is None:
            log.warning("LayerLiftScheduler without LayerLiftConnector: it schedules as "
                        "vLLM's Scheduler")
            return
        mamba = any(g.kind is GroupKind.MAMBA for g in self._layerlift.groups)
        aligned = bool(getattr(self, "need_mamba_block_aligned_split", False))  # vLLM's "align"
        if mamba and self._layerlift.config.offload and not aligned:
            self._split_page = int(self._layerlift.page_size)
            self.need_mamba_block_aligned_split = True

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        """vLLM's hook for Mamba chunk ends (0.32 and 0.33 call it with two
        arguments for a running request, four for a waiting one):
        `checkpoint_split` for a LayerLift Mamba hybrid
        (``mamba_cache_mode="none"``), vLLM's own split otherwise."""
        if not self._split_page:
            return int(super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens,
                num_external_computed_tokens))
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        return checkpoint_split(start, num_new_tokens, int(request.num_prompt_tokens),
                                self._split_page)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's `update_from_output`, after the requests whose restore
        failed in this step (and those sharing its blocks) were recomputed
        or failed: their output of this step is never delivered."""
        out = model_runner_output.kv_connector_output
        failing: list[Any] = []
        if self._layerlift is not None and out is not None:
            failed = self._layerlift.sync_load_failures(out)
            if failed:
                failing = self._take_failed(failed, scheduler_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in failing:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
            eco.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), events=request.take_events(),
                trace_headers=request.trace_headers))
        return outputs

    def _take_failed(self, failed: set[str], scheduler_output: Any) -> list[Any]:
        """Evict the failed restores' blocks (and every block computed after
        them) from the prefix cache; recompute (preempt, dropping the
        step's output) or fail (finish with an error; returned) every
        request of the step holding one of them."""
        assert self._layerlift is not None
        bad = self._layerlift.planner.load_blocks(failed)
        affected: set[str] = {r for r in failed if r in self.requests}
        evict: set[int] = set()
        for req_id in list(scheduler_output.num_scheduled_tokens):
            if req_id not in self.requests:
                continue
            try:
                groups = self.kv_cache_manager.get_block_ids(req_id)
            except KeyError:
                continue
            for g, blocks in enumerate(groups):
                first = next((i for i, b in enumerate(blocks) if b in bad.get(g, ())), None)
                if first is not None:
                    affected.add(req_id)
                    evict.update(b for b in blocks[first:] if b != _NULL_BLOCK)
        evict.update(b for blocks in bad.values() for b in blocks)
        if evict:
            self.kv_cache_manager.evict_blocks(evict)
        if not self.recompute_kv_load_failures:
            log.error("LayerLift: failing %d request(s) whose restore failed "
                      "(kv_load_failure_policy=fail): %s", len(affected), sorted(affected))
            return list(self.finish_requests(affected, RequestStatus.FINISHED_ERROR))
        now = time.monotonic()
        for req_id in sorted(affected):
            request = self.requests[req_id]
            if request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._preempt_request(request, now, drop_stale_output=True)
        log.warning("LayerLift: recovered from a failed restore: %d request(s) recomputed from "
                    "their valid prefix (%s)", len(affected), sorted(affected))
        return []
