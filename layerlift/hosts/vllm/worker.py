r"""The worker side of `LayerLiftConnector`: restore and offload vLLM blocks.

Threads and ownership:

* vLLM's model-runner thread calls `start_loads`, `wait_layer`, `save`,
  `results`, `step_errors`. Only `wait_layer` waits, for one layer of this
  step's synchronous loads, at most ``load_timeout_s``. Loads and puts run on
  one owned asyncio loop (thread ``layerlift-vllm``): per-layer jobs through
  LayerLift's `LoadScheduler` on a `CpuLane` (layer order, bounded depth),
  blocking store calls through `run_owned`.
* Every byte moves through one bounded staging ring (``linker/ring.py``,
  ``staging_bytes``, registered once) in chunks, so a transfer of any size
  works with any staging that holds one object. Restores are
  `StagedLoad`\ s (``linker/staged.py``): per layer and chunk, the slices land
  in a region, are verified against their CRCs and only then copied into
  vLLM's blocks, under the load's `Gate`; the gate is closed before vLLM
  hears a load failed, so nothing writes into its blocks afterwards. A region
  lent to a store call that timed out returns to the ring only once that
  call ended (`Region.hand_over`).
* Offloads are copied from vLLM's blocks into ring regions on vLLM's thread,
  before `save` returns (vLLM may reuse the blocks then), one chunk of at
  most a quarter of the ring at a time, each put in the background. When the
  ring is full, `save` waits for earlier puts to give staging back, at most
  ``save_wait_s`` (the store's call bound) per chunk; then the rest of that
  request's offload is skipped (a later miss).
* Asynchronous loads (a request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``)
  are reported by `results`; one not settled ``load_timeout_s`` after it
  started is revoked and reported failed. Synchronous loads (single-group
  models: vLLM runs the forward meanwhile, layer ``l`` waits for layer ``l``)
  are reported by `step_errors` at the end of the step, as block ids.
* Nothing computed in a step whose synchronous load failed (or did not land
  verified) is offloaded: vLLM ran that step's forward over blocks that never
  got their bytes (every request of the batch may have read them: a local
  prefix-cache hit shares them) and calls `save` before it asks for the
  errors. Blocks a load of this step filled are never offloaded either.
* Keys are this worker's own: an item names a page hash, the worker's
  `KeySchema` (its tensor-parallel rank) makes the key.
* An object that failed its check is replaced by the next offload of its key
  (bytes computed, never restored): the worker removes it first, retrying
  for up to ``replace_wait_s`` while a read lease keeps it (the scheduler
  leaves such objects out of its lookups, so only reads already under way
  renew the lease); until then the key is skipped and stays marked.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import Item, LoadSpec, SaveSpec, WorkerReport
from layerlift.hosts.vllm.objects import KeyedItem, block_bytes, stage_objects
from layerlift.linker.keys import KeySchema
from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.staged import Gate, HostSink, LoadPart, LoadSegment, ObjectLayout, StagedLoad
from layerlift.linker.store_base import Store, StoreError, StoreObjectLeased, StoreTimeout
from layerlift.overlap import (
    CpuLane,
    LayerLoadError,
    LayerReadiness,
    LayerWaitTimeout,
    LoadPolicy,
    LoadScheduler,
)

__all__ = ["BlockWorker"]

log = logging.getLogger("vllm.layerlift")
REPLACE_WAIT_S = 15.0  # > the 5 s read lease of `layerlift master`, with margin


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    items: list[KeyedItem]
    readiness: LayerReadiness
    gate: Gate = field(default_factory=Gate)
    settled: bool = False
    bad: bool = False  # a synchronous wait failed or timed out
    started: float = field(default_factory=time.monotonic)
    landed: float = 0.0  # when it settled verified (monotonic)
    waited_s: float = 0.0  # how long vLLM's thread waited for it (synchronous)


class BlockWorker:
    """Restores `LoadSpec`s and offloads `SaveSpec`s for one vLLM worker."""

    def __init__(self, store: Store, layout: Layout, kv_caches: dict[str, torch.Tensor], *,
                 schema: KeySchema, staging_bytes: int, max_in_flight: int,
                 load_timeout_s: float, replace_wait_s: float = REPLACE_WAIT_S,
                 save_wait_s: float | None = None) -> None:
        self.store, self.layout, self.kv, self.schema = store, layout, kv_caches, schema
        self.load_timeout_s = load_timeout_s
        self.replace_wait_s = replace_wait_s
        self.save_wait_s = store.timeout_s if save_wait_s is None else save_wait_s
        # Load order: recurrent (Mamba) state first (the forward needs it
        # before its first layer: `start_loads` waits for it), then the
        # attention layers in the model's order (the forward's waits).
        self._layers = sorted(((g, j) for g in layout.groups for j in range(len(g.layer_names))),
                              key=_load_order)
        self._mamba = [i for i, (g, _) in enumerate(self._layers) if g.kind is GroupKind.MAMBA]
        # Several groups: a failed synchronous load is reported per request
        # (`WorkerReport.failed`); vLLM maps block ids of one group only.
        self._per_request = len(layout.groups) > 1
        self._index = {g.layer_names[j]: i for i, (g, j) in enumerate(self._layers)}
        self._groups = {g.index: g for g in layout.groups}
        self._objects = {g.index: ObjectLayout(tuple(layout.slices(g)),
                                               sum(size for _, size in layout.slices(g)))
                         for g in layout.groups}
        self._ring = StagingRing(store, staging_bytes, timeout_s=load_timeout_s)
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._sync: list[_Load] = []  # this step's synchronous loads
        self._step_failed = False  # a synchronous load of this step failed
        self._step_loaded: set[tuple[int, int]] = set()  # (group, block) this step's loads fill
        # Objects that failed their check: removed before the next put of
        # the key (a put never overwrites; a fresh read lease may keep the
        # object through an immediate remove).
        self._corrupt: set[str] = set()
        self._report = WorkerReport()  # for the scheduler, drained by `report`
        self._pages: dict[str, tuple[int, bytes]] = {}  # key -> (group, page hash)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="layerlift-vllm",
                                        daemon=True)
        self._thread.start()
        self._lane = CpuLane(2, name="vllm")
        self._sched = LoadScheduler(self._lane, LoadPolicy.OVERLAP, max_in_flight=max_in_flight)
        self._tasks: set[Future[None]] = set()
        # vLLM calls save() under torch.inference_mode: staging made there
        # would be an inference tensor that the lane's threads cannot write.
        with torch.inference_mode(False):
            self._ring.open()

    # ---- called by vLLM's model-runner thread -------------------------------------

    def keyed(self, items: Sequence[Item]) -> list[KeyedItem]:
        """``items`` with this worker's keys (its rank's shard)."""
        groups = self._groups
        return [(g, self.schema.key(groups[g].component, h), b) for g, h, b in items]

    @property
    def staging(self) -> StagingRing:
        """The worker's staging ring (every transfer's bytes pass through it)."""
        return self._ring

    def report(self) -> WorkerReport | None:
        """Objects found corrupt and objects replaced since the last call
        (for the scheduler: it leaves corrupt ones out of lookups until every
        rank replaced them); None when there is nothing to say."""
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return out or None

    def begin_step(self) -> None:
        """A new step starts (vLLM's ``start_load_kv``, called every step)."""
        self._sync = []
        self._step_loaded.clear()
        self._step_failed = False

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Issue the restores of ``specs`` (never blocks on the store)."""
        for spec in specs:
            load = _Load(spec, self.keyed(spec.items),
                         LayerReadiness(len(self._layers), default_timeout=self.load_timeout_s))
            self._remember(spec.items, load.items)
            if spec.sync:
                self._sync.append(load)
                self._step_loaded.update((g, b) for g, _, b in spec.items)
            if spec.refused or not spec.items:
                load.readiness.cancel("refused by the scheduler")
                self._settle(load, ok=False)
                self._forget(load)
                continue
            self._submit(self._run_load(load))
        for load in self._sync:
            if self._mamba and not load.bad and not load.settled:
                self._wait(load, self._mamba, "the recurrent state")

    def _wait(self, load: _Load, indices: Sequence[int], what: str) -> None:
        """Wait (at most ``load_timeout_s`` each) for ``indices`` of a
        synchronous load; a failed or late one marks the load bad and revokes
        it (never raises into vLLM's forward)."""
        for index in indices:
            began = time.monotonic()
            try:
                load.readiness.wait(index, self.load_timeout_s)
                load.waited_s += time.monotonic() - began
            except (LayerLoadError, LayerWaitTimeout) as exc:
                log.warning("LayerLift: restore of %s failed at %s: %s; vLLM recomputes it",
                            load.spec.req_id, what, getattr(exc, "cause", None) or exc)
                load.bad = True
                self._step_failed = True
                self._settle(load, ok=False)
                return

    def wait_layer(self, layer_name: str) -> None:
        """Block until ``layer_name`` of this step's synchronous loads landed
        (at most ``load_timeout_s`` each). A failed or late layer marks its
        load bad and revokes it: never raises into vLLM's forward."""
        index = self._index.get(layer_name)
        if index is None:
            return
        for load in self._sync:
            if not load.bad:
                self._wait(load, (index,), layer_name)

    def step_failed(self) -> bool:
        """Whether a synchronous load of this step failed or has not landed
        verified (then nothing this step computed may be offloaded)."""
        return self._step_failed or any(
            load.bad or not load.readiness.all_done() for load in self._sync)

    def step_errors(self) -> set[int]:
        """Block ids of this step's synchronous loads that did not land
        verified; each such load is revoked first. Resets the step. With
        several KV cache groups they are reported per request instead
        (`report`'s ``failed``: block ids do not name their group)."""
        bad: set[int] = set()
        for load in self._sync:
            if load.bad or not load.readiness.all_done():
                self._step_failed = True
                self._settle(load, ok=False)
                if self._per_request:
                    with self._lock:
                        self._report.failed.add(load.spec.req_id)
                else:
                    bad.update(block for _, _, block in load.spec.items if block != 0)
            elif load.landed:
                took = max(load.landed - load.started, 1e-9)
                log.info("LayerLift: synchronous restore of %s: load %.1f ms, the forward "
                         "waited %.1f ms (%.0f%% hidden)", load.spec.req_id, took * 1e3,
                         load.waited_s * 1e3, 100.0 * max(0.0, 1.0 - load.waited_s / took))
        self._sync = []
        return bad

    def save(self, specs: Sequence[SaveSpec]) -> None:
        """Copy the blocks of ``specs`` to staging now (vLLM may reuse them
        once this returns) and put them in the background. A save that does
        not fit the staging is dropped (a later miss, never a wrong token).
        Nothing is saved in a step whose synchronous load failed (vLLM
        calls this before `step_errors`, and may call it after), nor from a
        block a load of this step filled."""
        if not specs:
            return
        if self.step_failed():
            log.warning("LayerLift: a restore of this step failed; its %d offloads are skipped "
                        "(computed over blocks that never got their bytes)", len(specs))
            return
        budget = max(1, self._ring.capacity // 4)
        staged: set[str] = set()  # a page two requests share (a prefix hit) is put once
        for spec in specs:
            keyed = self.keyed(spec.items)
            items = [it for it in keyed
                     if (it[0], it[2]) not in self._step_loaded and it[1] not in staged]
            staged.update(k for _, k, _ in items)
            self._remember(spec.items, keyed, only_corrupt=True)
            for chunk in self._chunks(items, budget):
                if not self._save_chunk(spec.req_id, chunk):
                    break

    def _chunks(self, items: list[KeyedItem], budget: int) -> list[list[KeyedItem]]:
        """Consecutive runs of ``items`` of at most ``budget`` bytes (one
        object at least)."""
        out: list[list[KeyedItem]] = []
        total = 0
        for item in items:
            size = self.layout.object_bytes(self._groups[item[0]])
            if out and total + size <= budget:
                out[-1].append(item)
                total += size
            else:
                out.append([item])
                total = size
        return out

    def _save_chunk(self, req_id: str, items: list[KeyedItem]) -> bool:
        """Stage ``items`` (copied now) and put them in the background; False
        when staging did not come free in time (the rest is skipped)."""
        total = sum(self.layout.object_bytes(self._groups[g]) for g, _, _ in items)
        if not self._ring.fits(total):
            log.warning("LayerLift: one object of %s (%d bytes) does not fit the %d-byte "
                        "staging; not offloaded", req_id, total, self._ring.capacity)
            return False
        try:
            region = self._ring.acquire(total, timeout_s=self.save_wait_s)
        except StoreError as exc:
            log.warning("LayerLift: offload of %s cut short: %s", req_id, exc)
            return False
        try:
            ptrs, sizes = stage_objects(self.layout, self.kv, items, region)
        except BaseException:
            region.release()
            raise
        self._submit(self._put([k for _, k, _ in items], ptrs, sizes, region))
        return True

    def results(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` asynchronous loads since the last call;
        ``failed`` is a subset of ``finished`` (vLLM's contract). With
        ``wait_s``, first wait up to that long for one to be reported."""
        with self._lock:
            self._reported.wait_for(lambda: bool(self._done or self._failed), wait_s)
            done, failed = self._done | self._failed, set(self._failed)
            self._done.clear()
            self._failed.clear()
        return done, failed

    def successes(self) -> set[str]:
        """The asynchronous loads that succeeded since the last call; failed
        ones stay for `results` (a caller that can report successes only,
        like vLLM's ``get_finished``, never reports a failure as one)."""
        with self._lock:
            done = set(self._done)
            self._done.clear()
        return done

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for loads and puts in flight, then stop the loop."""
        deadline = time.monotonic() + timeout_s
        for fut in list(self._tasks):
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                continue
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._lane.close()
        self._unregister_staging()

    def _unregister_staging(self) -> None:
        """Unregister the ring from the store (the store outlives this
        worker): a later buffer at the same address must be registrable."""
        ring = self._ring
        if not ring.registered or self._tasks:
            return  # never registered, or a call may still use it (the store's close frees it)
        try:
            ring.close()  # with a timed-out call's region still out: once it returned
        except StoreError as exc:
            log.warning("LayerLift: unregistering staging failed: %s", exc)

    def _remember(self, items: Sequence[Item], keyed: Sequence[KeyedItem],
                  only_corrupt: bool = False) -> None:
        """Map keys back to pages for `report` (loads: every key, dropped when
        the load ends; saves: keys marked corrupt only)."""
        with self._lock:
            for (g, h, _), (_, key, _) in zip(items, keyed, strict=True):
                if not only_corrupt or key in self._corrupt:
                    self._pages[key] = (g, h)

    def _forget(self, load: _Load) -> None:
        """A load ended: keep the page of its keys that were found corrupt only."""
        with self._lock:
            for _, key, _ in load.items:
                if key not in self._corrupt:
                    self._pages.pop(key, None)

    # ---- on the loop ----------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._tasks.add(fut)
        fut.add_done_callback(self._finished)

    def _finished(self, fut: Future[None]) -> None:
        self._tasks.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("LayerLift: a transfer task failed", exc_info=fut.exception())

    def _settle(self, load: _Load, *, ok: bool) -> None:
        """Revoke the load (no copy into vLLM's blocks after this), then
        report an asynchronous one, once."""
        with self._lock:
            if load.settled:
                return
            load.settled = True
        load.gate.close()  # returns once no copy runs; none starts afterwards
        if ok:
            load.landed = time.monotonic()
            log.info("LayerLift: restored %s (%d objects, verified)", load.spec.req_id,
                     len(load.spec.items))
        if not load.spec.sync:
            with self._lock:
                (self._done if ok else self._failed).add(load.spec.req_id)
                self._reported.notify_all()

    def _staged(self, load: _Load) -> StagedLoad:
        """The load as a `StagedLoad`: one part per KV cache group (row ``i``:
        the group's ``i``-th item, its block the target), global layer ``i``
        reads its slice of its group's part. ValueError when one slice does
        not fit the staging ring."""
        rows: dict[int, list[tuple[str, int]]] = {}
        for g, key, block in load.items:
            rows.setdefault(g, []).append((key, block))
        parts: list[LoadPart] = []
        part_of: dict[int, int] = {}
        for g, group_rows in rows.items():
            part_of[g] = len(parts)
            parts.append(LoadPart(self._objects[g], tuple(k for k, _ in group_rows),
                                  (g, [b for _, b in group_rows])))
        layers = [[(part_of[g.index], j)] if g.index in part_of else []
                  for g, j in self._layers]
        return StagedLoad(self._ring, self.store, parts, layers, HostSink(self._scatter),
                          gate=load.gate, timeout_s=self.load_timeout_s,
                          on_corrupt=self._mark_corrupt)

    def _scatter(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        """Lane thread, under the load's gate: verified rows into vLLM's blocks."""
        g, blocks = part.target
        kv = self.kv[self._groups[g].layer_names[seg.local]]
        with torch.inference_mode():  # vLLM's caches may be inference tensors
            for i, block in enumerate(blocks[seg.lo:seg.hi]):
                block_bytes(kv, block).copy_(rows[i])

    async def _run_load(self, load: _Load) -> None:
        """One request's restore: a session, one staged job per layer, the
        outcome; its staging returns to the ring once no thread or store call
        touches it (the ring's regions see to it)."""
        try:
            staged = self._staged(load)
        except ValueError as exc:
            log.warning("LayerLift: restore of %s refused: %s", load.spec.req_id, exc)
            load.readiness.cancel(str(exc))
            self._settle(load, ok=False)
            self._forget(load)
            return
        session = self.store.open_session([k for _, k, _ in load.items])
        try:
            await run_owned(session.__enter__)
        except StoreError as exc:
            log.warning("LayerLift: restore of %s could not start: %s", load.spec.req_id, exc)
            load.readiness.mark_failed(0, exc)
            self._settle(load, ok=False)
            self._forget(load)
            return
        task = None
        try:
            jobs = [staged.job(i) for i in range(len(self._layers))]
            task = self._sched.start(jobs, load.readiness)
            self._settle(load, ok=await self._outcome(load, task.done()))
        finally:
            self._settle(load, ok=False)  # no-op once settled
            if task is not None:
                await task.wait_quiescent()
            await run_owned(lambda: _end_session(session))
            self._forget(load)

    async def _outcome(self, load: _Load, done: Coroutine[Any, Any, None]) -> bool:
        """True once every layer landed verified; False on a failure or when
        the load is not settled within ``load_timeout_s``."""
        try:
            await asyncio.wait_for(asyncio.shield(done), self.load_timeout_s)
        except TimeoutError:
            log.warning("LayerLift: restore of %s not done after %.1f s: recomputed",
                        load.spec.req_id, self.load_timeout_s)
            return False
        if load.readiness.all_done():
            return True
        for i, (group, j) in enumerate(self._layers):
            err = load.readiness.error(i)
            if err is not None:
                log.warning("LayerLift: restore of %s failed at %s: %s", load.spec.req_id,
                            group.layer_names[j], err.cause or err)
                break
        return False

    def _mark_corrupt(self, keys: list[str]) -> None:
        """Lane thread: remember (and try to remove) objects that failed; the
        read that found them holds a lease, so the next offload of the key
        usually removes it (`_put_replacing`)."""
        with self._lock:
            self._corrupt.update(keys)
            self._report.corrupt.update(self._pages[k] for k in keys if k in self._pages)
        try:
            self.store.remove(keys)
        except StoreObjectLeased:
            pass  # expected: removed before the next put of the key
        except StoreError as exc:
            log.warning("LayerLift: removing %d corrupt objects failed: %s", len(keys), exc)

    def _put_replacing(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
        """Worker thread: remove the corrupt objects among ``keys`` (retrying
        for up to ``replace_wait_s`` while a read lease keeps one: it ends
        ``--default_kv_lease_ttl`` after the last read), then put. An object
        still leased then is skipped and stays marked for the next offload."""
        with self._lock:
            stale = [k for k in keys if k in self._corrupt]
        deadline = time.monotonic() + self.replace_wait_s
        pause = 0.05
        while stale:
            try:
                self.store.remove(stale)
                stale = []
            except StoreObjectLeased as exc:
                stale = [k for k in stale if k in set(exc.keys)]
            if not stale or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)  # only time ends a read lease
            pause = min(2 * pause, 1.0)
        if stale:
            log.warning("LayerLift: %d corrupt objects still leased after %.0f s; replaced by a "
                        "later offload", len(stale), self.replace_wait_s)
        with self._lock:
            replaced = [k for k in keys if k in self._corrupt and k not in stale]
        keep = [i for i, k in enumerate(keys) if k not in stale]
        if keep:
            self.store.put([keys[i] for i in keep], [ptrs[i] for i in keep],
                           [sizes[i] for i in keep])
        with self._lock:
            self._corrupt.difference_update(replaced)
            rank = self.schema.rank
            for key in replaced:
                page = self._pages.pop(key, None)
                if page is not None:
                    self._report.replaced.add((rank, *page))
        if replaced:
            log.info("LayerLift: replaced %d corrupt object(s) with computed ones", len(replaced))

    async def _put(self, keys: list[str], ptrs: list[int], sizes: list[int],
                   region: Region) -> None:
        try:
            await run_owned(lambda: self._put_replacing(keys, ptrs, sizes))
        except StoreTimeout as exc:
            region.hand_over(exc)  # the put may still read it: back once it ended
            log.warning("LayerLift: offload of %d objects timed out", len(keys))
        except StoreError as exc:
            log.warning("LayerLift: offload of %d objects failed: %s", len(keys), exc)
        finally:
            region.release()


def _load_order(layer: tuple[GroupLayout, int]) -> tuple[int, int, int, int]:
    """Recurrent groups first, then the model's layer order (the first number
    in vLLM's layer name, e.g. ``model.layers.3.self_attn.attn``)."""
    group, j = layer
    match = re.search(r"\d+", group.layer_names[j])
    return (0 if group.kind is GroupKind.MAMBA else 1, int(match.group()) if match else j,
            group.index, j)


def _end_session(session: Any) -> None:
    try:
        session.__exit__(None, None, None)
    except StoreError as exc:
        log.warning("LayerLift: ending a read session failed: %s", exc)
