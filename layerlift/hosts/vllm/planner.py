"""The scheduler side of `LayerLiftConnector`: lookups, load plans, offload plans.

Runs in vLLM's scheduler (engine-core) process, on its thread, and never
waits for the store there. A lookup (`matched_tokens`) hashes the prompt
(once per request: O(prompt pages)), hands the store's ``exists`` call to the
planner's own lookup thread and answers None ("ask again next step", vLLM's
non-blocking lookup contract) until that call answered; then it computes the
boundary in one pass over the pages (O(groups x pages)). So one call blocks
the engine core for O(prompt pages) of hashing and bookkeeping, never for a
store call; a request waits for its lookup at most ``lookup_timeout_s``
(``store_timeout_s`` by default) plus one step, after which it is a miss and
computed. A store error is a miss (logged) and further lookups are skipped
for ``_BACKOFF_S``.

Per request it keeps one record (`_Track`): the page hashes (tokens plus
what vLLM's own block hashes cover beyond them: LoRA adapter, ``cache_salt``,
multimodal inputs, prompt embeddings, from vLLM's
``generate_block_hash_extra_keys``), its block ids per KV cache group, how
many pages were restored and how many are already offloaded. A request never
offloads the pages of its local prefix-cache hit (another request computed,
restored or is restoring them). An object a worker found corrupt is
*suspect* until every TP rank's worker reported it replaced, or for
``_SUSPECT_S`` at most: lookups treat it as missing and do not touch it (a
lookup's ``exists`` renews Mooncake's read lease, which would keep the
corrupt object from being removed and replaced).

Offloads hold their blocks (`BlockHolds`): once vLLM bound its block pool
(``bind_gpu_block_pool``), each step's `SaveSpec` is a job that takes one
reference on each of its attention blocks (a recurrent state block changes
with the next step: the worker copies it within the step) (``BlockPool.touch``) when the step's
metadata is built, and drops it (``BlockPool.free_blocks``) once every
TP rank's worker reported the job done (`WorkerReport.saved`): a finished,
aborted or preempted request's blocks stay out of vLLM's free queue while a
worker may still read them, so the worker puts them after the step, off
vLLM's thread. Without a bound pool (a planner outside vLLM's scheduler)
saves carry no job and the worker copies them within the step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from layerlift.hosts.vllm.layout import (
    GroupKind,
    Layout,
    lookup_pages,
    needed_pages,
    request_hashes,
    restorable_pages,
)
from layerlift.hosts.vllm.meta import Item, LoadSpec, SaveSpec, StepMeta, WorkerReport
from layerlift.linker.store_base import Store

__all__ = ["BlockHolds", "BlockPlanner", "page_extras"]

log = logging.getLogger("vllm.layerlift")
_BACKOFF_S = 5.0
_SUSPECT_S = 30.0  # > Mooncake's read lease (5 s with `layerlift master`) + a replacement
_REUSE_S = 1.0  # a lookup answered this recently is reused (the request was not admitted)
_NULL_BLOCK = 0  # vLLM's null block (a skipped sliding-window block)


@dataclass(slots=True)
class _Lookup:
    local: int
    max_pages: int
    pages: list[tuple[int, int]]  # (group index, page) asked, in `future`'s order
    future: Future[list[bool]]
    started: float
    answered: float = 0.0
    left_out: int = -1  # the suspects' epoch when it left some out (-1: none left out)


@dataclass(slots=True)
class _Track:
    tokens: list[int]
    hashes: list[bytes]
    blocks: list[list[int]] = field(default_factory=list)
    plan: tuple[int, int] | None = None  # (local pages, restored boundary) promised
    restored: int = 0  # pages restored (0: none, or the load failed)
    saved: int = 0  # prompt pages below this are offloaded, restored or a local hit
    refused: bool = False  # a restore failed: vLLM recomputes it, never offer another
    loading: bool = False  # an asynchronous restore was issued and not reported yet
    load: list[Item] = field(default_factory=list)  # the items of its restore
    lookup: _Lookup | None = None


def page_extras(request: Any, pages: int, page_size: int) -> dict[int, str]:
    """What page ``p``'s KV depends on beyond its tokens, for the pages that
    have any: vLLM's own block-hash extra keys (LoRA name and path, the
    multimodal inputs in the page, ``cache_salt`` on page 0, the page's
    prompt embeddings), from ``vllm.v1.core.kv_cache_utils``. Empty for a
    plain text request (no call into vLLM then)."""
    if not (getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None)
            or getattr(request, "prompt_embeds", None) is not None):
        return {}
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
        generate_block_hash_extra_keys,
    )

    out: dict[int, str] = {}
    mm = 0
    for p in range(pages):
        keys, mm = generate_block_hash_extra_keys(request, p * page_size, (p + 1) * page_size, mm)
        if keys:
            out[p] = repr(keys)
    return out


class BlockHolds:
    """References on vLLM blocks that save jobs hold (scheduler thread only).

    ``pool``: vLLM's ``BlockPool`` (``touch`` and ``free_blocks`` over
    ``pool.blocks[i]``); ``workers``: how many workers report each job.
    Every `take` is matched by exactly one drop of the same references, when
    the job's reports from ``workers`` workers have arrived; a report of a
    job this object does not hold (or a count beyond what it waits for) is
    logged and ignored, never a second drop."""

    def __init__(self, pool: Any, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a block hold waits for at least one worker, got {workers}")
        self.pool, self.workers = pool, workers
        self._held: dict[int, tuple[list[int], int]] = {}  # job -> (blocks, reports to come)
        self._next = 0

    def take(self, blocks: list[int]) -> int:
        """A new job holding ``blocks`` (each once; never the null block)."""
        job, self._next = self._next, self._next + 1
        blocks = list(dict.fromkeys(b for b in blocks if b != _NULL_BLOCK))
        if blocks:
            self.pool.touch([self.pool.blocks[b] for b in blocks])
        self._held[job] = (blocks, self.workers)
        return job

    def reported(self, saved: dict[int, int]) -> None:
        """Workers reported ``saved`` (job -> workers); drop the references of
        each job every worker has now reported."""
        for job, count in saved.items():
            held = self._held.get(job)
            if held is None:
                log.error("LayerLift: a worker reported save job %d, which holds no blocks "
                          "(ignored)", job)
                continue
            blocks, left = held
            if count > left:
                log.error("LayerLift: save job %d reported by %d workers, %d expected "
                          "(its blocks are released once)", job, count, left)
            left -= count
            if left > 0:
                self._held[job] = (blocks, left)
                continue
            del self._held[job]
            if blocks:
                # Tail first: the freed blocks' prefix is evicted last (vLLM's order).
                self.pool.free_blocks(self.pool.blocks[b] for b in reversed(blocks))

    def __len__(self) -> int:
        """Jobs still holding blocks."""
        return len(self._held)

    def blocks(self) -> int:
        """Block references held now."""
        return sum(len(b) for b, _ in self._held.values())


class BlockPlanner:
    """Scheduler-side state of the connector (one per vLLM scheduler)."""

    def __init__(self, store: Store, layout: Layout, namespace: str, *, offload: bool,
                 lookup_timeout_s: float | None = None, sync_hybrid: bool = False) -> None:
        self.store, self.layout = store, layout
        self.schemas = layout.schemas(namespace)  # one per TP rank: a restore needs them all
        self.offload = offload
        self.lookup_timeout_s = store.timeout_s if lookup_timeout_s is None else lookup_timeout_s
        # vLLM 0.32 maps block-level load errors back to requests only with
        # one KV cache group (Scheduler._handle_invalid_blocks raises
        # otherwise): only then, or with `LayerLiftScheduler` (``sync_hybrid``:
        # it takes per-request failures of running requests), may a restore
        # run during the forward.
        self.sync_loads = len(layout.groups) == 1 or sync_hybrid
        self._tracks: dict[str, _Track] = {}
        self._loads: list[LoadSpec] = []
        self._skip_until = 0.0
        self._suspect: dict[tuple[int, bytes], float] = {}  # (group, page hash) -> until
        self._replaced: dict[tuple[int, bytes], set[int]] = {}  # suspect -> ranks replaced
        self._epoch = 0  # bumped whenever a suspect is cleared
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="layerlift-lookup")
        self.holds: BlockHolds | None = None  # set by `bind_block_pool`
        self._recurrent = {g.index for g in layout.groups if g.kind is GroupKind.MAMBA}

    def bind_block_pool(self, pool: Any) -> None:
        """vLLM's block pool: from now on each save is a job holding its
        blocks until every TP rank's worker reported it (`BlockHolds`)."""
        self.holds = BlockHolds(pool, len(self.schemas))

    def pending_saves(self) -> bool:
        """Whether a save job still holds blocks (vLLM keeps stepping then:
        the workers' reports arrive with a step's output)."""
        return bool(self.holds)

    def close(self) -> None:
        """Stop the lookup thread (a call in it ends within the store's bound)."""
        self._lookups.shutdown(wait=False, cancel_futures=True)

    # ---- lookups ------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` the store can restore at a boundary
        every group can restore; 0 on a miss, a store error or a lookup not
        answered within ``lookup_timeout_s``; None while the lookup runs
        (vLLM asks again next step). Never waits for the store."""
        track = self._track(request)
        page = self.layout.page_size
        local = num_computed // page
        max_pages = (len(track.tokens) - 1) // page  # at least one token is computed
        track.saved = max(track.saved, local)  # the local hit is not this request's to offload
        track.plan = None
        now = time.monotonic()
        if track.refused or max_pages <= local or now < self._skip_until:
            self._drop_lookup(track)
            return 0
        self._expire_suspects(now)
        lk = track.lookup
        stale = lk is not None and (lk.local > local or lk.max_pages != max_pages or (
            lk.answered and now - lk.answered > _REUSE_S) or (
            0 <= lk.left_out != self._epoch))  # a page it left out is back
        if lk is None or stale:
            self._drop_lookup(track)
            lk = track.lookup = self._start_lookup(track, local, max_pages, now)
        if not lk.future.done():
            if now - lk.started <= self.lookup_timeout_s:
                return None
            log.warning("LayerLift: lookup of %s not answered in %.1f s; computing",
                        request.request_id, self.lookup_timeout_s)
            self._drop_lookup(track)
            return 0
        try:
            found = lk.future.result()
        except Exception as exc:  # a store error, or anything else: a miss, never vLLM's
            self._drop_lookup(track)
            self._skip_until = time.monotonic() + _BACKOFF_S
            log.warning("LayerLift: lookup failed (%s); computing, lookups paused %.0f s",
                        exc, _BACKOFF_S)
            return 0
        lk.answered = lk.answered or now
        ranks = len(self.schemas)
        present: dict[tuple[int, int], bool] = {}
        for i, gp in enumerate(lk.pages):
            present[gp] = all(found[i * ranks:(i + 1) * ranks])
        boundary = restorable_pages(self.layout, local, max_pages, present)
        if boundary <= local:
            return 0
        track.plan = (local, boundary)
        return boundary * page - num_computed

    def pending_lookup(self, req_id: str) -> Future[list[bool]] | None:
        """The store call of ``req_id``'s lookup while it runs (None otherwise)."""
        track = self._tracks.get(req_id)
        return track.lookup.future if track is not None and track.lookup is not None else None

    def _start_lookup(self, track: _Track, local: int, max_pages: int, now: float) -> _Lookup:
        """Submit the ``exists`` of every rank's object of every page a
        boundary in ``(local, max_pages]`` may need (suspect ones left out)."""
        groups = self.layout.groups
        pages = [(g.index, p) for p in lookup_pages(local, max_pages) for g in groups
                 if not self._suspect or (g.index, track.hashes[p]) not in self._suspect]
        left_out = len(pages) < len(groups) * len(lookup_pages(local, max_pages))
        hashes = track.hashes

        def ask() -> list[bool]:
            keys = [schema.key(groups[g].component, hashes[p])
                    for g, p in pages for schema in self.schemas]
            return self.store.exists(keys)

        return _Lookup(local, max_pages, pages, self._lookups.submit(ask), now,
                       left_out=self._epoch if left_out else -1)

    def _drop_lookup(self, track: _Track) -> None:
        if track.lookup is not None:
            track.lookup.future.cancel()  # a call still queued never runs
            track.lookup = None

    def _expire_suspects(self, now: float) -> None:
        if self._suspect:
            kept = {k: t for k, t in self._suspect.items() if t > now}
            if len(kept) < len(self._suspect):
                self._epoch += 1
            self._suspect = kept
            self._replaced = {k: r for k, r in self._replaced.items() if k in kept}

    def worker_report(self, report: WorkerReport) -> None:
        """Objects the workers found corrupt become suspect; one every rank
        replaced is looked up again; save jobs every worker ended release
        their blocks."""
        if report.saved:
            if self.holds is None:
                log.error("LayerLift: workers reported save jobs, but no block pool is bound")
            else:
                self.holds.reported(report.saved)
        self.load_failed(report.failed)
        until = time.monotonic() + _SUSPECT_S
        for page in report.corrupt:
            self._suspect[page] = until
            self._replaced[page] = set()
        for rank, g, h in report.replaced:
            ranks = self._replaced.get((g, h))
            if ranks is None:
                continue
            ranks.add(rank)
            if len(ranks) >= len(self.schemas):
                del self._replaced[(g, h)]
                if self._suspect.pop((g, h), None) is not None:
                    self._epoch += 1

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                    num_external: int) -> None:
        """Record the request's blocks; plan its restore if tokens were promised."""
        track = self._track(request)
        track.blocks = [list(b) for b in block_ids]
        track.lookup = None
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
                items.append((group.index, track.hashes[p], block))
        self._loads.append(LoadSpec(request.request_id, items, refused, self.sync_loads))
        track.load = items
        track.loading = not self.sync_loads
        track.restored = boundary
        track.saved = max(track.saved, boundary)

    def loads_reported(self, finished: set[str], failed: set[str],
                       invalid_blocks: set[int] | None = None) -> None:
        """The worker reported these asynchronous restores (``failed`` ⊆
        ``finished``) and these blocks of synchronous restores that did not
        land verified (vLLM recomputes from the first such block)."""
        for req_id in finished:
            track = self._tracks.get(req_id)
            if track is not None:
                track.loading = False
        self.load_failed(failed)
        if invalid_blocks:
            self.blocks_failed(invalid_blocks)

    def load_blocks(self, req_ids: set[str]) -> dict[int, set[int]]:
        """The blocks (per KV cache group, vLLM's null block left out) that
        the restores of ``req_ids`` filled or were to fill."""
        out: dict[int, set[int]] = {}
        for req_id in req_ids:
            track = self._tracks.get(req_id)
            for g, _, block in track.load if track is not None else ():
                if block != _NULL_BLOCK:
                    out.setdefault(g, set()).add(block)
        return out

    def load_failed(self, req_ids: set[str]) -> None:
        """vLLM recomputes these requests from token 0: offload what they
        compute (replacing an object found corrupt) and never offer them a
        restore again (the same objects may fail again)."""
        for req_id in req_ids:
            track = self._tracks.get(req_id)
            if track is not None:
                track.restored = track.saved = 0
                track.refused = True
                track.load = []

    def blocks_failed(self, blocks: set[int]) -> None:
        """Single-group models: vLLM recomputes every running request that
        holds one of ``blocks`` from the first one. Its pages from there on
        are offloaded again once recomputed (replacing an object found
        corrupt); the request that restored them is never offered another."""
        for track in self._tracks.values():
            own = track.blocks[0] if track.blocks else []
            first = next((p for p, b in enumerate(own[:track.saved]) if b in blocks), None)
            if track.load and any(b in blocks for _, _, b in track.load):
                track.refused = True
                track.restored = 0
            if first is not None:
                track.saved = min(track.saved, first)

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
        if track is not None:
            self._drop_lookup(track)
        return track is not None and track.loading

    # ---- helpers ------------------------------------------------------------------

    def _track(self, request: Any) -> _Track:
        track = self._tracks.get(request.request_id)
        if track is None:
            tokens = list(request.prompt_token_ids or [])
            page = self.layout.page_size
            extras = page_extras(request, len(tokens) // page, page)
            track = _Track(tokens, request_hashes(tokens, page, extras))
            self._tracks[request.request_id] = track
        return track

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
                    items.append((group.index, track.hashes[end // page - 1], blocks[0]))
                continue
            for p in range(track.saved, upto):
                if p < len(blocks) and blocks[p] != _NULL_BLOCK:
                    items.append((group.index, track.hashes[p], blocks[p]))
        track.saved = max(track.saved, upto)
        if items:
            # Attention blocks only: a full page's bytes never change while it
            # is held; a recurrent state block is rewritten by the next step
            # (and a second reference would make vLLM copy it instead), so the
            # worker copies those within the step.
            job = None if self.holds is None else self.holds.take(
                [b for g, _, b in items if g not in self._recurrent])
            meta.saves.append(SaveSpec(req_id, items, job))
