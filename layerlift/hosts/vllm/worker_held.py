"""`BlockWorker`'s saves of held blocks: a `SaveSpec` with a ``job`` (the
scheduler holds a reference on each of its attention blocks until every
worker reported the job, ``planner.BlockHolds``) on host caches is put
after the step, off vLLM's thread, one job at a time: blocks of at least
`IN_PLACE_BYTES` a layer straight from vLLM's cache (registered once, the
footers computed over those bytes into the save ring), smaller ones copied
and checksummed into the save ring as a pipelined `StagedOffload`. A job is
reported done (`WorkerReport.saved`) exactly once, when no call reads its
blocks any more. Also here: removing and marking replaced the corrupt
objects a put overwrites, for both kinds of saves. The saves copied within
the step are `SaveSide` (``worker_save.py``); the overview is
``worker.py``'s docstring.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm.objects import KeyedItem, copy_page, group_runs
from layerlift.hosts.vllm.worker_base import WorkerBase, log
from layerlift.linker.in_place import Call, PipelinedPuts, grow
from layerlift.linker.integrity import CHECK_BYTES, checksums, slice_seed
from layerlift.linker.staged import OffloadOutcome, OffloadPart, OffloadSegment, StagedOffload
from layerlift.linker.store_base import StoreError, StoreObjectLeased

__all__ = ["IN_PLACE_BYTES", "PUT_BUFFERS", "PUT_BYTES", "HeldSaves"]

# A held save whose every layer's block is at least this large is put from
# vLLM's cache itself (the footers alone in the save ring): one pass over the
# bytes (the CRC) instead of a copy and a pass. Below it the store's per-buffer
# cost outweighs the copy: at block 16 (64 KiB a layer) in-place puts ran at
# 1.0-1.2 GB/s against 1.3-1.4 staged; at block 128 (512 KiB) 2.0-2.3 against
# 1.6-1.7 (32 layers, 8 KV heads x 128, bf16, loopback, docs/guide/vllm.md).
IN_PLACE_BYTES = 256 << 10
# One in-place put call: at most this many bytes and buffers (Mooncake's TCP
# transport queues at most 1024 transfers per peer by default,
# MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER; a call beyond it fails TRANSFER_FAIL).
PUT_BYTES, PUT_BUFFERS = 64 << 20, 256


class HeldSaves(WorkerBase):
    """Held saves and the bookkeeping of every save (jobs, corrupt keys)."""

    def _job_done(self, job: int) -> None:
        """This worker reads the blocks of save job ``job`` no more (for the
        scheduler: `report`)."""
        with self._lock:
            self._report.saved[job] = self._report.saved.get(job, 0) + 1
            self._reported.notify_all()

    def wait_saved(self, jobs: set[int], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every save job of ``jobs`` is
        in the report `report` hands out next; True when they all are."""
        with self._lock:
            return self._reported.wait_for(lambda: jobs <= self._report.saved.keys(), timeout_s)

    def _chunks(self, items: list[KeyedItem], budget: int) -> list[list[KeyedItem]]:
        """Consecutive runs of ``items`` of at most ``budget`` bytes; one object at least."""
        out: list[list[KeyedItem]] = []
        nbytes = 0
        for item in items:
            size = self.layout.object_bytes(self._groups[item[0]])
            if out and nbytes + size <= budget:
                out[-1].append(item)
                nbytes += size
            else:
                out.append([item])
                nbytes = size
        return out

    def _remove_stale(self, keys: list[str]) -> set[str]:
        """Worker thread: remove the corrupt objects among ``keys`` (retrying
        for up to ``replace_wait_s`` while a read lease keeps one: it ends
        ``--default_kv_lease_ttl`` after the last read); return those still
        there (skipped by this put, marked for the next offload)."""
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
        return set(stale)

    def _replaced(self, keys: list[str], stale: set[str]) -> None:
        """``keys`` were put (but ``stale``): the corrupt ones among them are
        replaced (for the scheduler: `report`)."""
        with self._lock:
            replaced = [k for k in keys if k in self._corrupt and k not in stale]
            self._corrupt.difference_update(replaced)
            rank = self.schema.rank
            for key in replaced:
                page = self._pages.pop(key, None)
                if page is not None:
                    self._report.replaced.add((rank, *page))
        if replaced:
            log.info("LayerLift: replaced %d corrupt object(s) with computed ones", len(replaced))

    async def _put_held(self, req_id: str, job: int, items: list[KeyedItem]) -> None:
        """On the loop: put ``items`` from their held blocks, after the save
        jobs before this one (one at a time: one large put at a time moves
        more than several small ones, `_save_turn`). The job is reported
        done once its blocks are read no more: by the offload's thread (in
        place: after its last put; staged: after its last copy, when
        `StagedOffload.run` calls ``on_source_free``), at the latest when
        that thread returns; by this coroutine when it ends (a failure, a
        cancellation) before that thread was started: nothing read the
        blocks then."""
        reported = False

        def release() -> None:  # the offload's thread, or the loop; reports once
            nonlocal reported
            if not reported:
                reported = True
                self._job_done(job)

        handed = False  # set by the offload's thread: from then on it reports the job

        def put_thread(todo: list[KeyedItem]) -> OffloadOutcome:
            """In place (reported after the last put, a timed-out one once it
            ended) or staged (reported after the last copy); at the latest
            when this returns."""
            nonlocal handed
            handed = True
            try:
                if self._in_place(todo):
                    return self._put_in_place(todo)
                assert self._save_ring is not None  # the host path's
                return StagedOffload(self._save_ring, self.store, self._parts(todo),
                                     _HeldBlocks(self), timeout_s=self.save_wait_s
                                     ).run(on_source_free=release)
            finally:
                release()

        try:
            async with self._save_turn:
                keys = [k for _, k, _ in items]
                stale = await run_owned(lambda: self._remove_stale(keys))
                todo = [it for it in items if it[1] not in stale]
                if todo:
                    outcome = await run_owned(lambda: put_thread(todo))
                    if outcome.error is not None:
                        log.warning("LayerLift: offload of %s: %d of %d objects put; %s",
                                    req_id, outcome.objects, len(todo), outcome.error)
                        return
                self._replaced(keys, stale)
        except Exception as exc:  # every thread it started has returned: a failed offload
            log.warning("LayerLift: offload of %s failed: %s", req_id, exc)
        finally:
            if not handed:
                release()

    def _in_place(self, items: list[KeyedItem]) -> bool:
        """Whether ``items`` are put from the cache itself: each layer's block
        at least `IN_PLACE_BYTES`, in a host cache of evenly strided blocks."""
        for g in {g for g, _, _ in items}:
            for name in self._groups[g].layer_names:
                if self._host_blocks.get(name) is None or \
                        self.layout.layer_bytes[name] < IN_PLACE_BYTES:
                    return False
        return True

    def _put_in_place(self, items: list[KeyedItem]) -> OffloadOutcome:
        """Worker thread: put ``items`` from vLLM's blocks where they are
        (registered with the store once, `_register_cache`): each object its
        layers' blocks and its footer, computed over those very bytes into
        the save ring. Calls of at most `PUT_BYTES` and `PUT_BUFFERS`
        (``linker/in_place.py``), the footers of the next computed while one
        runs; in order, the first failure ends it; a put that timed out is
        waited for until it ended (the store reads the blocks until then);
        returns once no call reads them."""
        self._register_cache()
        shape = [(self.layout.object_bytes(self._groups[g]), len(self._groups[g].layer_names) + 1)
                 for g, _, _ in items]
        chunks = [items[r.start : r.stop]
                  for r in grow(shape, PUT_BYTES, PUT_BUFFERS, first=PUT_BYTES)]
        return PipelinedPuts(self.store, self._in_place_call).run(chunks)

    def _in_place_call(self, chunk: list[KeyedItem], outcome: OffloadOutcome) -> Call | None:
        """One in-place call of ``chunk``: the footers computed over the
        blocks into a region of the save ring (None, the error in
        ``outcome``, when none came)."""
        assert self._save_ring is not None
        layers = [self._groups[g].layer_names for g, _, _ in chunk]
        table = sum(CHECK_BYTES * len(names) for names in layers)
        try:
            region = self._save_ring.acquire(table, timeout_s=self.save_wait_s, overflow=True)
        except StoreError as exc:
            outcome.error = exc
            return None
        try:
            call, at = Call(region), region.ptr
            for (_, key, block), names in zip(chunk, layers, strict=True):
                row = [self._block_span(n, block) for n in names]
                crcs = np.empty(len(row), dtype="<u4")
                for j, (ptr, size) in enumerate(row):
                    crcs[j] = checksums([ptr], size, [slice_seed(key, j)])[0]
                ctypes.memmove(at, crcs.ctypes.data, crcs.nbytes)  # the footer
                call.keys.append(key)
                call.ptrs.append([ptr for ptr, _ in row] + [at])
                call.sizes.append([size for _, size in row] + [crcs.nbytes])
                at += crcs.nbytes
        except BaseException:
            region.release()
            raise
        return call

    def _block_span(self, name: str, block: int) -> tuple[int, int]:
        """``(address, bytes)`` of block ``block`` of layer ``name``'s host cache."""
        host = self._host_blocks.get(name)
        assert host is not None  # `_in_place` checked
        size = self.layout.layer_bytes[name]
        return host.address(block, size), size

    def _parts(self, items: list[KeyedItem]) -> list[OffloadPart]:
        """``items`` as offload parts, one per run of one group (source:
        ``(group, blocks)``)."""
        return [OffloadPart(self._objects[g], tuple(k for _, k, _ in run),
                            (g, [b for _, _, b in run])) for g, run in group_runs(items)]


class _HeldBlocks:
    """The held-save snapshot (``linker/staged.py``'s `Snapshot`): each row's
    layer blocks copied from vLLM's host cache into staging, each slice
    checksummed right after its copy (`copy_page`): the footers come back
    with the bytes."""

    def __init__(self, side: HeldSaves) -> None:
        self.side = side

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> np.ndarray:
        side = self.side
        group_index, blocks = part.source
        group = side._groups[group_index]
        table = np.empty((seg.rows, len(group.layer_names)), dtype="<u4")
        for i in range(seg.rows):
            table[i] = copy_page(side.layout, group, side.kv, part.keys[seg.lo + i],
                                 blocks[seg.lo + i], pages[i], side._host_blocks)
        return table
