"""The scheduler side of `LayerLiftConnector`: lookups, load plans, offload plans.

Runs in vLLM's scheduler (engine-core) process, on its thread. The only store
call is one ``exists`` per lookup (bounded by ``store_timeout_s``); a store
error there is a miss (logged), never an error for the request, and further
lookups are skipped for ``_BACKOFF_S`` so a stalled master does not stall
every scheduling step.

Per request it keeps one record (`_Track`): the prompt's page hashes, its
block ids per KV cache group, how many pages were restored and how many are
already offloaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from layerlift.hosts.vllm.layout import (
    GroupKind,
    Layout,
    needed_pages,
    prompt_hashes,
    restorable_pages,
)
from layerlift.hosts.vllm.meta import Item, LoadSpec, SaveSpec, StepMeta
from layerlift.linker.keys import KeySchema
from layerlift.linker.store_base import Store, StoreError

__all__ = ["BlockPlanner"]

log = logging.getLogger("vllm.layerlift")
_BACKOFF_S = 5.0
_NULL_BLOCK = 0  # vLLM's null block (a skipped sliding-window block)


@dataclass(slots=True)
class _Track:
    tokens: list[int]
    hashes: list[bytes]
    blocks: list[list[int]] = field(default_factory=list)
    plan: tuple[int, int] | None = None  # (local pages, restored boundary) promised
    restored: int = 0  # pages restored (0: none, or the load failed)
    saved: int = 0  # prompt pages below this are offloaded (or restored)
    refused: bool = False  # a restore failed: vLLM recomputes it, never offer another
    loading: bool = False  # an asynchronous restore was issued and not reported yet


class BlockPlanner:
    """Scheduler-side state of the connector (one per vLLM scheduler)."""

    def __init__(self, store: Store, layout: Layout, schema: KeySchema, *,
                 offload: bool) -> None:
        self.store, self.layout, self.schema = store, layout, schema
        self.offload = offload
        # vLLM 0.32 maps block-level load errors back to requests only with
        # one KV cache group (Scheduler._handle_invalid_blocks raises
        # otherwise): only then may a restore run during the forward.
        self.sync_loads = len(layout.groups) == 1
        self._tracks: dict[str, _Track] = {}
        self._loads: list[LoadSpec] = []
        self._skip_until = 0.0

    # ---- lookups ------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` the store can restore at a boundary
        every group can restore (0 on a miss or a store error)."""
        track = self._track(request)
        page = self.layout.page_size
        local = num_computed // page
        max_pages = (len(track.tokens) - 1) // page  # at least one token is computed
        track.plan = None
        if track.refused or max_pages <= local or time.monotonic() < self._skip_until:
            return 0
        wanted = sorted({(g.index, p) for b in range(local + 1, max_pages + 1)
                         for g in self.layout.groups
                         for p in needed_pages(self.layout, g, local, b)})
        keys = [self._key(g, p, track) for g, p in wanted]
        try:
            found = self.store.exists(keys)
        except StoreError as exc:
            self._skip_until = time.monotonic() + _BACKOFF_S
            log.warning("LayerLift: lookup failed (%s); computing, lookups paused %.0f s",
                        exc, _BACKOFF_S)
            return 0
        boundary = restorable_pages(self.layout, local, max_pages,
                                    dict(zip(wanted, found, strict=True)))
        if boundary <= local:
            return 0
        track.plan = (local, boundary)
        return boundary * page - num_computed

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                    num_external: int) -> None:
        """Record the request's blocks; plan its restore if tokens were promised."""
        track = self._track(request)
        track.blocks = [list(b) for b in block_ids]
        if num_external <= 0 or track.plan is None:
            return
        local, boundary = track.plan
        items: list[Item] = []
        refused = False
        for group in self.layout.groups:
            blocks = track.blocks[group.index]
            for p in needed_pages(self.layout, group, local, boundary):
                at = 0 if group.kind is GroupKind.MAMBA else p
                block = blocks[at] if at < len(blocks) else _NULL_BLOCK
                refused |= block == _NULL_BLOCK
                items.append((group.index, self._key(group.index, p, track), block))
        self._loads.append(LoadSpec(request.request_id, items, refused, self.sync_loads))
        track.loading = not self.sync_loads
        track.restored = boundary
        track.saved = max(track.saved, boundary)

    def loads_reported(self, finished: set[str], failed: set[str]) -> None:
        """The worker reported these asynchronous restores (``failed`` ⊆ ``finished``)."""
        for req_id in finished:
            track = self._tracks.get(req_id)
            if track is not None:
                track.loading = False
        self.load_failed(failed)

    def load_failed(self, req_ids: set[str]) -> None:
        """vLLM recomputes these requests from token 0: offload what they
        compute, and never offer them a restore again (the same objects would
        fail again: a lookup right after the failure still finds a corrupt
        object that a read lease keeps in the store)."""
        for req_id in req_ids:
            track = self._tracks.get(req_id)
            if track is not None:
                track.restored = track.saved = 0
                track.refused = True

    # ---- per step -----------------------------------------------------------------

    def step_meta(self, scheduler_output: Any) -> StepMeta:
        """This step's loads and the offloads of pages it completes."""
        meta = StepMeta(loads=self._loads)
        self._loads = []
        if not self.offload:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.blocks = [list(b) for b in new.block_ids]
                self._plan_save(meta, new.req_id, track,
                                new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    track.blocks = [list(b) for b in new_ids]
                else:
                    for g, ids in enumerate(new_ids):
                        track.blocks[g].extend(ids)
            self._plan_save(meta, req_id, track,
                            cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def finished(self, request: Any) -> bool:
        """Forget a finished request (its pages were staged when computed).
        True while its asynchronous restore may still write into its blocks:
        vLLM must then keep them until the worker reports the restore (it
        frees them on that report)."""
        track = self._tracks.pop(request.request_id, None)
        return track is not None and track.loading

    # ---- helpers ------------------------------------------------------------------

    def _track(self, request: Any) -> _Track:
        track = self._tracks.get(request.request_id)
        if track is None:
            tokens = list(request.prompt_token_ids or [])
            track = _Track(tokens, prompt_hashes(tokens, self.layout.page_size))
            self._tracks[request.request_id] = track
        return track

    def _key(self, group_index: int, page: int, track: _Track) -> str:
        return self.schema.key(self.layout.groups[group_index].component, track.hashes[page])

    def _plan_save(self, meta: StepMeta, req_id: str, track: _Track, end: int) -> None:
        """Offload the prompt pages completed by a step ending at token ``end``;
        a recurrent group's state when the step ends on a page boundary."""
        page = self.layout.page_size
        upto = min(end, len(track.tokens)) // page
        items: list[Item] = []
        for group in self.layout.groups:
            blocks = track.blocks[group.index] if group.index < len(track.blocks) else []
            if group.kind is GroupKind.MAMBA:
                if end % page == 0 and track.saved < end // page <= len(track.hashes) and blocks:
                    items.append((group.index, self._key(group.index, end // page - 1, track),
                                  blocks[0]))
                continue
            for p in range(track.saved, upto):
                if p < len(blocks) and blocks[p] != _NULL_BLOCK:
                    items.append((group.index, self._key(group.index, p, track), blocks[p]))
        track.saved = max(track.saved, upto)
        if items:
            meta.saves.append(SaveSpec(req_id, items))
