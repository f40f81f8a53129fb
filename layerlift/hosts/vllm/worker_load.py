"""`BlockWorker`'s load side: `start_loads`, each restore as a `StagedLoad`
on the owned loop (its `BlockSink` on a device; in place into vLLM's host
blocks, `BlockPlacement`, synchronous at a real block size), `wait_layer`, the outcome
reported by `results` / `successes` (asynchronous) or `step_errors`
(synchronous, with the per-layer record ``layerlift bench vllm`` reads), and
objects found corrupt. The overview is ``worker.py``'s docstring.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import torch

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm.meta import LoadSpec
from layerlift.hosts.vllm.objects import BlockPlacement, BlockSink, block_bytes, scatter_rows
from layerlift.hosts.vllm.worker_base import _Load, log
from layerlift.hosts.vllm.worker_in_place import IN_PLACE_ROWS, BlocksStillWritten, InPlaceRestores
from layerlift.linker.staged import HostSink, LoadPart, LoadSegment, Sink, StagedLoad
from layerlift.linker.store_base import StoreError, StoreObjectLeased
from layerlift.overlap import LayerLoadError, LayerReadiness, LayerWaitTimeout, LoadScheduler
from layerlift.overlap.base import LayerJob
from layerlift.overlap.device import DeviceEvent

__all__ = ["IN_PLACE_ROWS", "BlocksStillWritten", "LoadSide"]


class LoadSide(InPlaceRestores):
    """Restores `LoadSpec`s into vLLM's blocks (the host or the device path)."""

    # ---- called by vLLM's model-runner thread -------------------------------------

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Issue the restores of ``specs`` (never blocks on the store)."""
        n = len(self._layers)
        for spec in specs:
            load = _Load(spec, self.keyed(spec.items),
                         LayerReadiness(n, default_timeout=self.load_timeout_s),
                         ready=[0.0] * n, reached=[0.0] * n, waited=[0.0] * n)
            self._remember(spec.items, load.items)
            if spec.sync:
                self._sync.append(load)
                self._step_loaded.update((g, b) for g, _, b in spec.items)
            if spec.refused or not spec.items:
                load.readiness.cancel("refused by the scheduler")
                self._settle(load, ok=False)
                self._forget(load)
                continue
            if self.device is not None:
                # The load stream waits for what vLLM's current stream issued
                # so far (a freed block's last reader, an offload's gather).
                load.sink = BlockSink(self.device, self.load_stream, self._scatter_rows)
                load.sink.begin()
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
            load.reached[index] = load.reached[index] or began
            try:
                load.readiness.wait(index, self.load_timeout_s)
                self._stream_wait(load, index)
                took = time.monotonic() - began
                load.waited_s += took
                load.waited[index] += took
            except (LayerLoadError, LayerWaitTimeout) as exc:
                log.warning("LayerLift: restore of %s failed at %s: %s; vLLM recomputes it",
                            load.spec.req_id, what, getattr(exc, "cause", None) or exc)
                load.bad = True
                self._step_failed = True
                self._settle(load, ok=False)
                return

    def _stream_wait(self, load: _Load, index: int) -> None:
        """The device path: the calling thread's current stream (vLLM's
        forward) waits on layer ``index``'s event, recorded on the load stream
        after its copies (no host sync: the copies are issued already)."""
        staged = load.staged
        if self.device is None or staged is None:
            return
        event = staged.events[index]
        if event is not None:
            with self.device.use():
                event.wait(self.device.current_stream())

    def wait_layer(self, layer_name: str) -> None:
        """Block until ``layer_name`` of this step's synchronous loads landed
        (at most ``load_timeout_s`` each); on a device, until its copies were
        issued, then vLLM's current stream waits on the layer's event. A
        failed or late layer marks its load bad and revokes it: never raises
        into vLLM's forward."""
        index = self._index.get(layer_name)
        if index is None:
            return
        for load in self._sync:
            if not load.bad:
                self._wait(load, (index,), layer_name)

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
            else:
                if load.landed:
                    took = max(load.landed - load.started, 1e-9)
                    log.info("LayerLift: synchronous restore of %s: load %.1f ms, the forward "
                             "waited %.1f ms (%.0f%% hidden)", load.spec.req_id, took * 1e3,
                             load.waited_s * 1e3, 100.0 * max(0.0, 1.0 - load.waited_s / took))
                log.info("LayerLift: per-layer restore of %s: %s", load.spec.req_id,
                         json.dumps(self._per_layer(load), separators=(",", ":")))
        for load in self._sync:
            self._hand_back(load)  # every load, revoked or landed (its last read ending)
        self._sync = []
        return bad

    def _per_layer(self, load: _Load) -> dict[str, Any]:
        """The per-layer record of a synchronous restore (the log line read
        by ``layerlift bench vllm``): per layer in load order, milliseconds
        since `start_loads` when its copies were issued (``ready_ms``: on the
        host path the copy is done then; on a device it runs on the load
        stream afterwards) and when the forward reached its wait
        (``reached_ms``; None: never waited for), and how long vLLM's thread
        waited there (``waited_ms``; a device wait is on the stream, not in
        it); ``device``: ``host`` or the `Device` class (``CudaDevice``)."""
        def ms(t: float) -> float | None:
            return round((t - load.started) * 1e3, 3) if t else None

        return {"layers": [g.layer_names[j] for g, j in self._layers],
                "device": "host" if self.device is None else type(self.device).__name__,
                "ready_ms": [ms(t) for t in load.ready],
                "reached_ms": [ms(t) for t in load.reached],
                "waited_ms": [round(w * 1e3, 3) for w in load.waited]}

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

    # ---- on the loop ----------------------------------------------------------------

    def _settle(self, load: _Load, *, ok: bool) -> None:
        """Revoke the load (no copy into vLLM's blocks after this, no read
        starts), then report an asynchronous one, once, when no read of it is
        in flight (an in-place load's read that was issued cannot be revoked:
        `Gate.when_quiet` reports it on the thread that ends the last one;
        vLLM keeps the blocks until then). Every caller returns only once
        no copy runs: a caller that finds another thread settling it
        (the loop's outcome against the forward's failed wait) waits for
        that settle to end, or it would report the load while copies issued
        into its blocks still run."""
        with self._lock:
            first = not load.settled
            load.settled = True
        if not first:
            load.quiet.wait()  # bounded: closing the gate and draining the sink end
            return
        try:
            self._quiesce(load)
        finally:
            load.quiet.set()
        if ok:
            load.landed = time.monotonic()
            log.info("LayerLift: restored %s (%d objects, verified)", load.spec.req_id,
                     len(load.spec.items))
        if not load.spec.sync:
            def report() -> None:
                with self._lock:
                    (self._done if ok else self._failed).add(load.spec.req_id)
                    self._reported.notify_all()

            load.gate.when_quiet(report)

    @staticmethod
    def _quiesce(load: _Load) -> None:
        load.gate.close()  # returns once no copy runs; none starts afterwards
        if load.sink is not None:
            load.sink.drain()  # vLLM hears of it once every copy issued into its blocks ran

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

        def landed(layer: int, event: DeviceEvent | None) -> None:
            load.ready[layer] = time.monotonic()

        if load.in_place:
            placement = BlockPlacement(
                self._host_blocks, {g: self._groups[g].layer_names for g in rows}, parts,
                self.layout.layer_bytes, load.gate)
            return StagedLoad(self._ring, self.store, parts, layers, None, placement=placement,
                              gate=load.gate, timeout_s=self.load_timeout_s,
                              on_corrupt=lambda keys: self._mark_corrupt(load, keys),
                              on_layer=landed)
        sink: Sink = load.sink if load.sink is not None else HostSink(self._scatter)
        return StagedLoad(self._ring, self.store, parts, layers, sink,
                          gate=load.gate, timeout_s=self.load_timeout_s,
                          on_corrupt=lambda keys: self._mark_corrupt(load, keys),
                          on_layer=landed)

    def _scatter(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        """Lane thread, under the load's gate: verified rows into vLLM's
        blocks, one ``memmove`` a block (`HostBlocks`; torch's copy where the
        blocks are not plain rows)."""
        g, blocks = part.target
        name = self._groups[g].layer_names[seg.local]
        host = self._host_blocks.get(name)
        if host is not None:
            size = int(rows.shape[1])
            src, stride = int(rows.data_ptr()), int(rows.stride(0))
            for i, block in enumerate(blocks[seg.lo:seg.hi]):
                ctypes.memmove(host.address(block, size), src + i * stride, size)
            return
        kv = self.kv[name]
        with torch.inference_mode():  # vLLM's caches may be inference tensors
            for i, block in enumerate(blocks[seg.lo:seg.hi]):
                block_bytes(kv, block).copy_(rows[i])

    def _scatter_rows(self, seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
        """The device path, on the load stream (``BlockSink``): verified rows,
        already copied to the device, into vLLM's blocks."""
        g, blocks = part.target
        scatter_rows(self.kv[self._groups[g].layer_names[seg.local]], blocks[seg.lo:seg.hi], rows)

    async def _run_load(self, load: _Load) -> None:
        """One request's restore: a session, one staged job per layer, the
        outcome; its staging returns to the ring once no thread or store call
        touches it (the ring's regions see to it). An in-place load's task
        ends once no read of it is in flight (at most ``read_end_s``): the
        worker's `settle` and `close` wait for it, and vLLM's cache stays
        registered until then."""
        load.in_place = self._reads_in_place(load) and await self._cache_ready()
        try:
            staged = load.staged = self._staged(load)
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
            sched, jobs = self._schedule(load, staged)
            task = sched.start(jobs, load.readiness)
            ok = await self._outcome(load, task.done())
            if load.sink is None:
                self._settle(load, ok=ok)
            else:  # off the loop: settling waits for the device copies to end
                await run_owned(lambda: self._settle(load, ok=ok))
        finally:
            self._settle(load, ok=False)  # no-op once settled
            if task is not None:
                await task.wait_quiescent()
            if load.in_place:
                await self._reads_ended(load)
            await run_owned(lambda: _end_session(session))
            if load.corrupt:
                await run_owned(lambda: self._remove_corrupt(sorted(load.corrupt)))
            self._forget(load)

    def _schedule(self, load: _Load, staged: StagedLoad) -> tuple[LoadScheduler, list[LayerJob]]:
        """How a restore runs. Asynchronous (the request waits for all of it):
        `StagedLoad.fetch_all` on the streamed scheduler (`fetches_all`):
        within one chunk of the staging one store call for every layer
        (whole objects, one range each; on a small model a call a layer
        costs more than the layer's bytes: gemma3's tiny model, 8 calls of
        ~1.5 ms for 4 MiB, a restore 7-9 ms instead of 9-15); larger, its
        layers packed into full chunks, ``depth`` of them in flight, on the
        host path and on a device alike (a hybrid's window
        layers are one object each: a call a layer would be 31 calls of one
        object for gemma3's real layout). When the forward waits layer by
        layer (synchronous), one job a layer, up to ``max_in_flight`` on the
        lane's threads."""
        if not load.spec.sync and staged.fetches_all():
            return self._streamed, staged.all_jobs()
        return self._sched, [staged.job(i) for i in range(len(self._layers))]

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

    def _mark_corrupt(self, load: _Load, keys: list[str]) -> None:
        """Lane thread: remember the objects of ``load`` that failed their
        check. They are removed once the load's session ended
        (`_remove_corrupt`): a remove now would turn the load's own pending
        reads of the key's other layers into misses; and the next offload of
        a key still held removes it first (`_put_replacing`)."""
        with self._lock:
            self._corrupt.update(keys)
            load.corrupt.update(keys)
            self._report.corrupt.update(self._pages[k] for k in keys if k in self._pages)

    def _remove_corrupt(self, keys: list[str]) -> None:
        """Worker thread, after the session: try to remove corrupt objects (a
        lease another reader holds keeps one; the next put replaces it)."""
        try:
            self.store.remove(keys)
        except StoreObjectLeased:
            pass  # expected: removed before the next put of the key
        except StoreError as exc:
            log.warning("LayerLift: removing %d corrupt objects failed: %s", len(keys), exc)


def _end_session(session: Any) -> None:
    try:
        session.__exit__(None, None, None)
    except StoreError as exc:
        log.warning("LayerLift: ending a read session failed: %s", exc)

