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
* On the host path a synchronous restore of blocks of at least
  ``IN_PLACE_BYTES`` a layer (at most ``IN_PLACE_ROWS`` a group; asynchronous
  ones stay staged; ``worker_in_place``) reads in place instead: vLLM's
  cache is registered with the store once, each layer is one store call of
  its blocks' slices straight into the blocks (`BlockPlacement`), verified
  there, only the checksums through the ring; no staging, no copy. A read
  already issued cannot be revoked, so the gate also counts reads in flight
  (`Gate.reading`, and `Gate.keep_until` for a call that timed out): vLLM
  hears of such a load (`results`, `step_errors`) only once none is (its
  blocks are held until then: an asynchronous load's by vLLM until it is
  reported, a synchronous one's until the step's errors are asked for),
  waited for at most ``read_end_s`` on vLLM's thread (then
  `BlocksStillWritten`, never blocks handed back while written). A corrupt
  slice is in the block then, which is reported failed as any failed
  layer's blocks are (vLLM recomputes them).
* Offloads whose blocks the scheduler holds (a `SaveSpec` with a ``job``:
  vLLM's block pool keeps one reference of the job on each attention block
  until every worker reported the job, ``planner.BlockHolds``) run after the
  step on the host path: `save` hands the job to the loop and returns; the
  jobs run one at a time, each a pipelined `StagedOffload` through a save
  ring of its own (a chunk's pages copied from the blocks and checksummed as
  copied while the chunk before is put); the job is reported done
  (`report`'s ``saved``) once its last page was copied, or at once when
  nothing of it was left to read (a failed step, a cancellation before it
  started). Everything else (no job, caches on a device, recurrent state
  blocks, which the next step rewrites) is copied from vLLM's blocks into
  ring regions on vLLM's thread, before `save` returns (vLLM may reuse the
  blocks then), one chunk of at most a quarter of the ring at a time, each
  put in the background. When the ring is full, `save` waits for earlier
  puts to give staging back, at most ``save_wait_s`` (the store's call
  bound) per chunk; then the rest of that request's offload is skipped (a
  later miss).
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
* On a device (vLLM's caches on CUDA, or a `Device` given to the
  constructor: the tests' simulated one) the same transfers run through the
  device seam (``overlap/device.py``); host caches keep the host path above.
  The ring is pinned (``Device.pinned``). A load's verified chunks are copied
  by `BlockSink` (``DeviceSink``): an H2D copy of the rows and an index copy
  into the blocks, issued on the worker's one load stream, then an event
  recorded there; a region returns to the ring once its event completed. The
  load stream first waits for vLLM's current stream (a fence per load, in
  `start_loads`: a freed block's last reader or gather ran). `wait_layer`
  waits on the host until the layer's copies were *issued*, then makes
  vLLM's current stream wait on the layer's event (no host sync). A failed
  or late layer issues no copy and is reported as on the host; before any
  load is reported to vLLM (failed or, asynchronously, finished) the worker
  waits on the host for every copy issued on the load stream so far
  (``BlockSink.drain``): vLLM may recompute into or free the blocks then.
  `save` records an event on vLLM's current stream (after the step's
  forward) and gathers each run of blocks on the save stream after it
  (``DeviceSnapshot``) into pinned staging; it returns once the gathers ran,
  so vLLM may free the blocks.
* Keys are this worker's own: an item names a page hash, the worker's
  `KeySchema` (its tensor-parallel rank) makes the key.
* An object that failed its check is replaced by the next offload of its key
  (bytes computed, never restored): the worker removes it first, retrying
  for up to ``replace_wait_s`` while a read lease keeps it (the scheduler
  leaves such objects out of its lookups, so only reads already under way
  renew the lease); until then the key is skipped and stays marked.

Modules: ``worker_base`` (`WorkerBase`: the state, the device and its
streams, `device_for`, the ring and the loop), ``worker_in_place``
(`InPlaceRestores`: which restores read in place, the waits for their
reads), ``worker_load`` (`LoadSide`: the restores, `wait_layer`, the
reports), ``worker_held`` (`HeldSaves`: saves
of held blocks after the step, replacing corrupt objects), ``worker_save``
(`SaveSide`: `save`, the saves copied within the step); `BlockWorker` is both
sides.
"""

from __future__ import annotations

import time

from layerlift.hosts.vllm.worker_base import REPLACE_WAIT_S, device_for, log
from layerlift.hosts.vllm.worker_load import LoadSide
from layerlift.hosts.vllm.worker_save import SaveSide
from layerlift.linker.store_base import StoreError

__all__ = ["REPLACE_WAIT_S", "BlockWorker", "device_for"]


class BlockWorker(LoadSide, SaveSide):
    """Restores `LoadSpec`s and offloads `SaveSpec`s for one vLLM worker.

    The state and what both sides share: `WorkerBase` (``worker_base.py``);
    the loads: `LoadSide` (``worker_load.py``); the saves: `SaveSide`
    (``worker_save.py``)."""

    def settle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` in all) for the loads and puts in
        flight now to end; True when none is left. A transfer that failed
        has ended (it logged why); what it was is not reported here."""
        deadline = time.monotonic() + timeout_s
        for fut in list(self._tasks):
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                continue
        return all(fut.done() for fut in list(self._tasks))

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for loads and puts in flight, then stop the loop."""
        deadline = time.monotonic() + timeout_s
        self.settle(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._lane.close()
        self._unregister_staging()

    def _unregister_staging(self) -> None:
        """Unregister the rings (and vLLM's cache, where in-place saves or
        restores registered it) from the store (the store outlives this worker): a
        later buffer at the same address must be registrable."""
        if self._tasks:
            return  # a call may still use them (the store's close frees them)
        for ring in (self._ring, self._save_ring):
            if ring is None or not ring.registered:
                continue
            try:
                ring.close()  # with a timed-out call's region still out: once it returned
            except StoreError as exc:
                log.warning("LayerLift: unregistering staging failed: %s", exc)
        if self._reading:  # an in-place restore's read still runs into vLLM's cache
            log.warning("LayerLift: a store read into vLLM's cache still runs; the cache "
                        "stays registered with the store")
            return
        spans, self._cache_registered = self._cache_registered or [], None
        for ptr in spans:  # in-place saves' registration of vLLM's cache
            try:
                self.store.unregister(ptr)
            except StoreError as exc:
                log.warning("LayerLift: unregistering vLLM's cache failed: %s", exc)
