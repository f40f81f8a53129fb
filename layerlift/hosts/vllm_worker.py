"""The worker side of `LayerLiftConnector`: restore and offload vLLM blocks.

Threads and ownership:

* vLLM's model-runner thread calls `start_loads`, `save`, `results`; none of
  them waits for the store. Loads and puts run on one owned asyncio loop
  (thread ``layerlift-vllm``) through LayerLift's `LoadScheduler` on a
  `CpuLane` (per-layer jobs, layer order, bounded depth) and `run_owned`.
* Every byte from the store lands in registered *staging* (a `ScratchArena`),
  is verified against its per-layer CRC (``linker/integrity.py``) and only
  then copied into vLLM's block, under the load's lock and only while the
  load is not *revoked*. A load is revoked (under that lock) before vLLM is
  told it failed, so nothing writes into its blocks afterwards.
* Staging lent to a store call that timed out stays held until that call
  really ended (`StoreTimeout.wait_finished`, in a daemon thread): a master
  that resumes late writes into staging nobody else uses.
* A load that has not settled ``layer_wait_timeout_s`` after it started is
  revoked and reported failed, whatever its threads still do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm_layout import GroupLayout, Layout
from layerlift.hosts.vllm_meta import LoadSpec, SaveSpec
from layerlift.linker.integrity import CHECK_BYTES, checksums, mismatches, slice_seed
from layerlift.linker.scratch import Scratch, ScratchArena
from layerlift.linker.store_base import Store, StoreError, StoreIntegrityError, StoreTimeout
from layerlift.overlap import CpuLane, LayerJob, LayerReadiness, LoadPolicy, LoadScheduler

__all__ = ["BlockWorker"]

log = logging.getLogger("vllm.layerlift")


class LoadRevoked(StoreError):
    """The load was reported failed before this layer's copy: nothing was written."""


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    revoked: bool = False
    timed_out: list[StoreTimeout] = field(default_factory=list)


def _block_bytes(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a layer's KV tensor as a flat uint8 view."""
    return kv[block_id].view(torch.uint8).view(-1)


class BlockWorker:
    """Restores `LoadSpec`s and offloads `SaveSpec`s for one vLLM worker."""

    def __init__(self, store: Store, layout: Layout, kv_caches: dict[str, torch.Tensor], *,
                 staging_bytes: int, max_in_flight: int, load_timeout_s: float) -> None:
        self.store, self.layout, self.kv = store, layout, kv_caches
        self.load_timeout_s = load_timeout_s
        self._groups = {g.index: g for g in layout.groups}
        self._arena = ScratchArena(store, staging_bytes)
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="layerlift-vllm",
                                        daemon=True)
        self._thread.start()
        self._lane = CpuLane(2, name="vllm")
        self._sched = LoadScheduler(self._lane, LoadPolicy.OVERLAP, max_in_flight=max_in_flight)
        self._tasks: set[Future[None]] = set()

    # ---- called by vLLM's model-runner thread -------------------------------------

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Issue the restores of ``specs`` (never blocks on the store)."""
        for spec in specs:
            if spec.refused or not spec.items:
                self._report(spec.req_id, ok=False)
                continue
            self._submit(self._run_load(_Load(spec)))

    def save(self, specs: Sequence[SaveSpec]) -> None:
        """Copy the blocks of ``specs`` to staging now (vLLM may reuse them
        once this returns) and put them in the background. A save that does
        not fit the staging is dropped (a later miss, never a wrong token)."""
        for spec in specs:
            if not spec.items:
                continue
            sizes = [self.layout.object_bytes(self._groups[g]) for g, _, _ in spec.items]
            try:
                scratch = self._arena.take(sum(sizes))
            except StoreError as exc:
                log.warning("LayerLift: offload of %s skipped: %s", spec.req_id, exc)
                continue
            if scratch._arena is None:  # did not fit the arena: its own registration
                scratch.release()
                log.warning("LayerLift: staging full, offload of %s skipped", spec.req_id)
                continue
            ptrs = self._stage_objects(spec, scratch, sizes)
            keys = [k for _, k, _ in spec.items]
            self._submit(self._put(keys, ptrs, sizes, scratch))

    def results(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` request ids since the last call; ``failed``
        is a subset of ``finished`` (vLLM's contract for failed receives)."""
        with self._lock:
            done, failed = self._done | self._failed, set(self._failed)
            self._done.clear()
            self._failed.clear()
        return done, failed

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

    # ---- on the loop ----------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def _report(self, req_id: str, *, ok: bool) -> None:
        with self._lock:
            (self._done if ok else self._failed).add(req_id)

    async def _run_load(self, load: _Load) -> None:
        """Restore one request: report it (revoked first), then clean up once
        no thread touches its staging any more."""
        keys = [k for _, k, _ in load.spec.items]
        offsets = np.cumsum([0] + [self.layout.object_bytes(self._groups[g])
                                   for g, _, _ in load.spec.items]).tolist()
        try:
            scratch = await run_owned(lambda: self._arena.take(offsets[-1]))
        except StoreError as exc:
            log.warning("LayerLift: restore of %s refused: %s", load.spec.req_id, exc)
            self._report(load.spec.req_id, ok=False)
            return
        session = self.store.open_session(keys)
        try:
            await run_owned(session.__enter__)
        except StoreError as exc:
            log.warning("LayerLift: restore of %s could not start: %s", load.spec.req_id, exc)
            if isinstance(exc, StoreTimeout):
                load.timed_out.append(exc)
            self._settle(load, ok=False)
            self._release_after(load.timed_out, scratch)
            return
        task = None
        try:
            layers = [(g, j) for g in self.layout.groups for j in range(len(g.layer_names))]
            readiness = LayerReadiness(len(layers), default_timeout=self.load_timeout_s)
            jobs = [LayerJob(i, self._layer_fetch(load, g, j, scratch, offsets))
                    for i, (g, j) in enumerate(layers)]
            task = self._sched.start(jobs, readiness)
            self._settle(load, ok=await self._outcome(load, task.done(), readiness, layers))
            await task.wait_quiescent()
        finally:
            self._settle(load, ok=False)  # no-op once settled
            if task is not None:
                await task.wait_quiescent()
            await run_owned(lambda: self._end_session(session))
            self._release_after(load.timed_out, scratch)

    async def _outcome(self, load: _Load, done: Coroutine[Any, Any, None], readiness: LayerReadiness,
                       layers: list[tuple[GroupLayout, int]]) -> bool:
        """True once every layer landed verified; False on a failure or when
        the load is not settled within ``load_timeout_s``."""
        try:
            await asyncio.wait_for(asyncio.shield(done), self.load_timeout_s)
        except TimeoutError:
            log.warning("LayerLift: restore of %s not done after %.1f s: recomputed",
                        load.spec.req_id, self.load_timeout_s)
            return False
        if readiness.all_done():
            return True
        for i, (group, j) in enumerate(layers):
            err = readiness.error(i)
            if err is not None:
                log.warning("LayerLift: restore of %s failed at %s: %s", load.spec.req_id,
                            group.layer_names[j], err.cause or err)
                break
        return False

    def _settle(self, load: _Load, *, ok: bool) -> None:
        """Revoke the load (no copy into vLLM's blocks after this), then
        report it, once."""
        with load.lock:
            if load.revoked:
                return
            load.revoked = True
        self._report(load.spec.req_id, ok=ok)

    @staticmethod
    def _end_session(session: object) -> None:
        try:
            session.__exit__(None, None, None)  # type: ignore[attr-defined]
        except StoreError as exc:
            log.warning("LayerLift: ending a read session failed: %s", exc)

    def _layer_fetch(self, load: _Load, group: GroupLayout, j: int, scratch: Scratch,
                     offsets: list[int]) -> Callable[[], None]:
        """The fetch of layer ``j`` of ``group`` for every item of the load."""
        name = group.layer_names[j]
        slice_off, size = self.layout.slices(group)[j]
        footer = sum(s for _, s in self.layout.slices(group))
        rows = [(i, key, block) for i, (g, key, block) in enumerate(load.spec.items)
                if g == group.index]

        def fetch() -> None:
            dst = [scratch.ptr + offsets[i] + slice_off for i, _, _ in rows]
            crc = [scratch.ptr + offsets[i] + footer + CHECK_BYTES * j for i, _, _ in rows]
            keys = [k for _, k, _ in rows]
            try:
                self.store.get_ranges(keys, [[d, c] for d, c in zip(dst, crc, strict=True)],
                                      [[size, CHECK_BYTES]] * len(rows),
                                      [[slice_off, footer + CHECK_BYTES * j]] * len(rows))
            except StoreTimeout as exc:
                load.timed_out.append(exc)
                raise
            expected = np.array([int.from_bytes(scratch.tensor[c - scratch.ptr:
                                 c - scratch.ptr + CHECK_BYTES].numpy().tobytes(), "little")
                                 for c in crc], dtype="<u4")
            bad = mismatches(dst, size, expected, [slice_seed(k, j) for k in keys])
            if bad:
                self._forget([keys[b] for b in bad])
                raise StoreIntegrityError(f"{len(bad)} object(s) of {name} failed their "
                                          f"checksum, e.g. {keys[bad[0]]}")
            with load.lock:
                if load.revoked:
                    raise LoadRevoked(f"restore of {load.spec.req_id} was already reported")
                for (_, _, block), d in zip(rows, dst, strict=True):
                    start = d - scratch.ptr
                    _block_bytes(self.kv[name], block).copy_(scratch.tensor[start:start + size])

        return fetch

    def _forget(self, keys: list[str]) -> None:
        """Remove objects that failed verification, so a later offload can
        replace them (a put never overwrites). Best effort."""
        try:
            self.store.remove(keys)
        except StoreError as exc:
            log.warning("LayerLift: removing corrupt objects failed: %s", exc)

    def _stage_objects(self, spec: SaveSpec, scratch: Scratch, sizes: list[int]) -> list[int]:
        """Copy each item's layer blocks into staging with its CRC footer."""
        ptrs, at = [], 0
        for (g, key, block), total in zip(spec.items, sizes, strict=True):
            group = self._groups[g]
            slices = self.layout.slices(group)
            footer = sum(s for _, s in slices)
            for j, (name, (off, size)) in enumerate(zip(group.layer_names, slices, strict=True)):
                scratch.tensor[at + off:at + off + size].copy_(_block_bytes(self.kv[name], block))
                crc = checksums([scratch.ptr + at + off], size, [slice_seed(key, j)])
                start = at + footer + CHECK_BYTES * j
                scratch.tensor[start:start + CHECK_BYTES].copy_(
                    torch.from_numpy(crc.view(np.uint8).copy()))
            ptrs.append(scratch.ptr + at)
            at += total
        return ptrs

    async def _put(self, keys: list[str], ptrs: list[int], sizes: list[int],
                   scratch: Scratch) -> None:
        timed_out: list[StoreTimeout] = []
        try:
            await run_owned(lambda: self.store.put(keys, ptrs, sizes))
        except StoreTimeout as exc:
            timed_out.append(exc)
            log.warning("LayerLift: offload of %d objects timed out", len(keys))
        except StoreError as exc:
            log.warning("LayerLift: offload of %d objects failed: %s", len(keys), exc)
        finally:
            self._release_after(timed_out, scratch)

    @staticmethod
    def _release_after(timed_out: list[StoreTimeout], scratch: Scratch) -> None:
        """Release ``scratch`` once every timed-out call lent it has ended."""
        if not timed_out:
            scratch.release()
            return

        def wait() -> None:
            for exc in timed_out:
                exc.wait_finished(None)
            scratch.release()

        threading.Thread(target=wait, name="layerlift-vllm-quarantine", daemon=True).start()
