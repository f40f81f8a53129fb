"""LayerLift as an SGLang ``UnifiedCacheLinker`` (tested against SGLang 0.5.23).

Launch SGLang with::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "LayerLiftLinker",
        "linker_module_path": "layerlift.hosts.sglang",
        "linker_extra_config": {"master_address": "127.0.0.1:50051"}}'

SGLang keeps the radix tree, the device pools, admission and node locks; this
linker owns the store side: LayerLift's object format (layer-major pages with a
CRC-32 footer per layer, ``linker/integrity.py``), format-versioned keys from
SGLang's page hashes, the model's identity and layout and the rank
(``linker/keys.py``), per-layer loads on LayerLift's scheduler and lanes
(``load``), offloads through a staging snapshot (``offload``),
and bounded waits. Its promises (each tested under SGLang's real wrapper):

- ``lookup`` returns the exact sparse set of restorable prefix lengths: every
  FULL page, the SWA window ending at the boundary, the Mamba checkpoint at it.
- A corrupt, foreign, truncated or missing slice fails its layer; no byte of it
  reaches the slots (they are zeroed) and ``finish_layer_wise_loading`` returns
  False, so SGLang aborts the loading requests and inserts none of their KV.
- A stalled or dead master ends a load within ``load_timeout_s`` (False, never
  a hang), and nothing writes into a batch's slots after ``finish`` returned.
- An offload whose put outlives ``timeout_s`` is reported failed; if it lands
  later it lands the offloaded bytes under their own checksums, nothing else.
- ``reset`` and ``close`` quiesce every load and offload before returning
  (each bounded; ``close`` leaves staging held by a call that still runs).

The SGLang vocabulary (``PoolTransfer``, ``PoolName``) stops at this module.
Pools on CPU only in this version (see ``layout``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from layerlift.linker.keys import KeySchema
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeConfig, MooncakeStore
from layerlift.linker.store_base import Store, StoreError
from layerlift.overlap.base import LoadPolicy
from layerlift.overlap.lanes import CpuLane
from layerlift.overlap.scheduler import LoadScheduler

from .layout import PoolLayout, fingerprint, pool_layouts
from .load import BatchLoad, LoadCounter, LoadItem, LoopThread
from .offload import Offloader, OffloadItem
from .settings import LinkerSettings
from .staging import Arena, Region

__all__ = ["LayerLiftLinker", "LinkerSettings"]

_log = logging.getLogger(__name__)


def _hash_bytes(page_hash: str) -> bytes:
    """SGLang's page hash (SHA-256 hex) as the bytes a LayerLift key names."""
    try:
        return bytes.fromhex(page_hash)
    except ValueError:
        return page_hash.encode()


def _rank_and_stage(params: Any) -> tuple[int, str]:
    rank = 0
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank(group=group)
    stage = f"pp{getattr(params, 'pp_rank', 0)}cp{getattr(params, 'attn_cp_rank', 0)}"
    return rank, stage


class LayerLiftLinker(UnifiedCacheLinker):  # type: ignore[misc,unused-ignore]
    """The linker SGLang's dynamic backend constructs (see the module docstring).

    Thread model: SGLang's scheduler thread calls every method; the forward
    calls ``layer_done_counter.wait_until``; loads run on LayerLift's lane
    threads under an event loop of the linker's own, offloads on one thread.
    """

    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None,
                 forward_stream: Any = None) -> None:
        self.settings = s = LinkerSettings.parse(extra_config)
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        names = sorted(getattr(c, "name", str(c)) for c in components)
        self.layouts: dict[str, PoolLayout] = pool_layouts(
            kvcache, params.req_to_token_pool, int(params.page_size), names)
        self.pools: dict[PoolName, object] = {PoolName(n): p for n, p in self.layouts.items()}
        self.num_layers = 1 + max(lp.layer for p in self.layouts.values() for lp in p.layers)
        rank, stage = _rank_and_stage(params)
        model = s.model or getattr(server_args, "model_path", None) or "model"
        self.key_schema = KeySchema(s.namespace, fingerprint(str(model), self.layouts, stage), rank)
        self._master = EmbeddedMaster(http_metadata=False, lease_ttl_ms=5000).start() \
            if s.embedded_master else None
        address = self._master.master_address if self._master else s.master_address
        assert address is not None
        try:
            self.store: Store = MooncakeStore(MooncakeConfig(
                master_address=address, metadata_server=s.metadata_server, protocol=s.protocol,
                local_hostname=s.local_hostname, global_segment_size=s.segment_mib << 20,
                local_buffer_size=s.local_buffer_mib << 20, timeout_s=s.timeout_s))
        except BaseException:
            if self._master is not None:
                self._master.stop()
            raise
        try:
            self.arena = Arena(self.store, s.staging_mib << 20)
        except BaseException:
            self.store.close()
            if self._master is not None:
                self._master.stop()
            raise
        self.layer_done_counter = LoadCounter()
        if "mamba" in self.layouts:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self._loop = LoopThread("layerlift-sglang-loop")
        self._lane = CpuLane(max_workers=s.depth, name="sglang")
        self._scheduler = LoadScheduler(self._lane, LoadPolicy.OVERLAP, max_in_flight=s.depth)
        self._pending: dict[str, tuple[list[LoadItem], Region]] = {}
        self._next_index = 0
        self._offloader = Offloader(self.store, self.arena)
        self.finished: deque[BatchLoad] = deque(maxlen=256)  # recent batches (timings, verdict)
        self._closed = False

    # ---- helpers -------------------------------------------------------------

    def _items(self, transfers: list[Any]) -> list[tuple[PoolLayout, list[str], list[int]]]:
        """(layout, store keys, first rows) per transfer with keys; ValueError
        for a pool this linker does not hold or slots that do not fit it."""
        out = []
        for t in transfers:
            if not t.keys:
                continue
            layout = self.layouts.get(PoolName(t.name).value)
            if layout is None:
                raise ValueError(f"LayerLiftLinker holds no {PoolName(t.name).value} pool")
            rows = layout.unit_rows(t.device_indices, len(t.keys))
            keys = self.key_schema.keys(layout.component, [_hash_bytes(h) for h in t.keys])
            out.append((layout, keys, rows))
        return out

    # ---- UnifiedCacheLinker ------------------------------------------------------

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """Every boundary ``b`` (pages of the tail) at which each pool of the
        lookup restores: FULL pages ``[0, b)``, the SWA window ending at ``b``
        (as many pages as the SWA transfer carries), the Mamba checkpoint of
        page ``b - 1``. A store failure is logged and reads as no hit."""
        by_name = {PoolName(t.name).value: t for t in transfers}
        kv = by_name.get("kv")
        if kv is None or not kv.keys:
            return []
        hashes = [_hash_bytes(h) for h in kv.keys]
        n = len(hashes)
        pools = [p for p in ("kv", "swa", "mamba") if p in by_name and p in self.layouts]
        keys = [k for p in pools for k in self.key_schema.keys(self.layouts[p].component, hashes)]
        try:
            flags = self.store.exists(keys)
        except StoreError as exc:
            _log.warning("LayerLift lookup for %s failed (%s); treated as a miss", rid, exc)
            return []
        have = {p: flags[i * n:(i + 1) * n] for i, p in enumerate(pools)}
        window = len(by_name["swa"].keys or ()) if "swa" in have else 0
        out = []
        for b in range(1, n + 1):
            if not have["kv"][b - 1]:
                break
            if "swa" in have and not all(have["swa"][max(0, b - window):b]):
                continue
            if "mamba" in have and not have["mamba"][b - 1]:
                continue
            out.append(b)
        return out

    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue ``rid``'s load and reserve its staging; False (SGLang then
        recomputes) when staging has no room. ValueError for a malformed transfer."""
        if rid in self._pending:
            raise ValueError(f"LayerLiftLinker: a load for {rid} is already queued")
        items = [LoadItem(rid, layout, tuple(keys), tuple(rows))
                 for layout, keys, rows in self._items(transfers)]
        if not items:
            return False
        region = self.arena.allocate(sum(item.nbytes for item in items))
        if region is None:
            _log.warning("LayerLift: no staging room for %s's load; it is recomputed", rid)
            return False
        self._pending[rid] = (items, region)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return False
        entry[1].release()
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        pending, self._pending = list(self._pending.values()), {}
        index, self._next_index = self._next_index, self._next_index + 1
        batch = BatchLoad(index, pending, self.num_layers, self.store, self.settings.load_timeout_s)
        self.layer_done_counter.add(batch)
        jobs = batch.jobs()

        async def run() -> None:
            try:
                task = self._scheduler.start(jobs, batch.readiness)
                await task.wait_quiescent()
            except Exception as exc:  # the scheduler refused the batch: fail it whole
                batch.readiness.mark_failed(0, exc)
            finally:
                batch.on_quiet()

        self._loop.submit(run)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        batch = self.layer_done_counter.take(counter_index)
        if batch is None:
            return True
        ok = batch.finish()
        self.finished.append(batch)
        if not ok:
            _log.error("LayerLift: load batch %d failed: %s", counter_index, batch.error)
        return ok

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        items = [OffloadItem(layout, tuple(keys), tuple(rows))
                 for layout, keys, rows in self._items(transfers)]
        if not items:
            return False
        self._offloader.submit(items)
        return True

    def num_completed_offloads(self) -> int:
        return self._offloader.completed()

    def pop_completed_offload(self) -> bool:
        return self._offloader.pop()

    def reset(self) -> None:
        """Quiesce: drop queued loads, finish batches in flight (bounded by
        ``load_timeout_s``), run queued offloads (bounded by ``timeout_s`` each),
        then forget every result."""
        for _, region in self._pending.values():
            region.release()
        self._pending.clear()
        for batch in self.layer_done_counter.batches():
            batch.finish()
            if not batch.quiet.wait(self.settings.timeout_s + 1.0):
                _log.warning("LayerLift reset: load batch %d still has a read running "
                             "(it writes into staging only)", batch.index)
        queued = self._offloader.pending()
        if not self._offloader.drain(self.settings.timeout_s * (queued + 2)):
            _log.warning("LayerLift reset: offloads still running after their bound")
        self._offloader.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._offloader.stop(self.settings.timeout_s + 1.0)
        self._loop.stop()
        self._lane.close()
        deadline = time.monotonic() + self.settings.timeout_s
        while not self.arena.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.arena.idle():
            self.store.unregister(self.arena.base)
        else:  # a timed-out call still holds staging: keep the memory alive
            _KEPT.append(self.arena)
            _log.warning("LayerLift close: a store call still holds staging; kept registered")
        self.store.close()
        if self._master is not None:
            self._master.stop()


_KEPT: list[Arena] = []
