"""`BlockWorker`'s saves within the step: everything a held save does not
cover (no job, caches on a device, recurrent state blocks) is copied into
staging chunks before `save` returns (on a device: gathered on the save
stream after the forward), each chunk put in the background; held saves go
to `HeldSaves` (``worker_held.py``). A key found corrupt is removed before
its put replaces it. The overview is ``worker.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm.meta import SaveSpec
from layerlift.hosts.vllm.objects import KeyedItem, gather_pages, stage_objects, stage_pages
from layerlift.hosts.vllm.worker_base import _Read, log
from layerlift.hosts.vllm.worker_held import HeldSaves
from layerlift.linker.ring import Region
from layerlift.linker.staged import DeviceSnapshot, OffloadPart, OffloadSegment
from layerlift.linker.store_base import StoreError, StoreTimeout
from layerlift.overlap.device import DeviceEvent

__all__ = ["SaveSide"]


class SaveSide(HeldSaves):
    """Offloads `SaveSpec`s from vLLM's blocks through the staging ring."""

    # ---- called by vLLM's model-runner thread -------------------------------------

    def save(self, specs: Sequence[SaveSpec]) -> None:
        """Offload ``specs``. A spec with a ``job`` (the scheduler holds its
        attention blocks until this worker reports the job, `report`) is put
        after the step on the host path (`_put_held`); everything else is
        copied to staging now (vLLM may reuse those blocks once this returns)
        and put in the background. A save that does not fit the staging is
        dropped (a later miss, never a wrong token). Nothing is saved in a
        step whose synchronous load failed (vLLM calls this before
        `step_errors`, and may call it after), nor from a block a load of
        this step filled. Every job is reported done exactly once: here when
        nothing of it is left to read, else by its put once the blocks are
        read no more."""
        if not specs:
            return
        done = [spec.job for spec in specs if spec.job is not None]  # reported by the finally
        try:
            if self.step_failed():
                log.warning("LayerLift: a restore of this step failed; its %d offloads are "
                            "skipped (computed over blocks that never got their bytes)",
                            len(specs))
                return
            budget = max(1, self._ring.capacity // 4)
            # On a device the gathers run on the save stream, ordered after an
            # event recorded on vLLM's current stream after the step's forward.
            read = None if self.device is None else self._reader(self._after_forward())
            staged: set[str] = set()  # a page two requests share (a prefix hit) is put once
            for spec in specs:
                keyed = self.keyed(spec.items)
                items = [it for it in keyed
                         if (it[0], it[2]) not in self._step_loaded and it[1] not in staged]
                staged.update(k for _, k, _ in items)
                self._remember(spec.items, keyed, only_corrupt=True)
                now = items
                if spec.job is not None and self.device is None:
                    later = [it for it in items if it[0] not in self._recurrent]
                    now = [it for it in items if it[0] in self._recurrent]
                    if later:
                        self._submit(self._put_held(spec.req_id, spec.job, later))
                        done.remove(spec.job)  # `_put_held` reports it
                for chunk in self._chunks(now, budget):
                    if not self._save_chunk(spec.req_id, chunk, read):
                        break
        finally:
            for job in done:
                self._job_done(job)

    def _save_chunk(self, req_id: str, items: list[KeyedItem], read: _Read | None) -> bool:
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
            if read is None:
                ptrs, sizes = stage_objects(self.layout, self.kv, items, region, self._host_blocks)
            else:
                ptrs, sizes = stage_pages(self.layout, items, region, read)
        except BaseException:
            region.release()
            raise
        self._submit(self._put([k for _, k, _ in items], ptrs, sizes, region))
        return True

    def _after_forward(self) -> DeviceEvent:
        """The save's order: an event recorded now on the calling thread's
        current stream (vLLM's, after the step's forward)."""
        assert self.device is not None
        with self.device.use():
            event: DeviceEvent = self.device.event()
            event.record(self.device.current_stream())
        return event

    def _reader(self, forward: DeviceEvent) -> _Read:
        """The device path's ``read`` of `stage_pages`: a run's blocks into
        pinned staging on the save stream, ordered after ``forward``; each
        read returns once its copy ran (vLLM may free the blocks once `save`
        returned)."""
        assert self.device is not None
        snapshot = DeviceSnapshot(self.device, self._gather, self.save_stream,
                                  after=lambda: forward)

        def read(group: int, blocks: list[int], objects: torch.Tensor) -> None:
            part = OffloadPart(self._objects[group], (), (group, blocks))
            snapshot.read(OffloadSegment(0, 0, len(blocks)), part, objects)

        return read

    def _gather(self, seg: OffloadSegment, part: OffloadPart) -> torch.Tensor:
        """On the save stream: the segment's blocks as whole objects (pages,
        footers zero: `stage_pages` writes them)."""
        group, blocks = part.source
        return gather_pages(self.layout, self.kv, group, blocks[seg.lo:seg.hi],
                            pad=part.layout.footer_bytes)

    # ---- on the loop ----------------------------------------------------------------

    def _put_replacing(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
        """Worker thread: remove the corrupt objects among ``keys``, then put
        the rest (`_remove_stale`)."""
        stale = self._remove_stale(keys)
        keep = [i for i, k in enumerate(keys) if k not in stale]
        if keep:
            self.store.put([keys[i] for i in keep], [ptrs[i] for i in keep],
                           [sizes[i] for i in keep])
        self._replaced(keys, stale)

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
