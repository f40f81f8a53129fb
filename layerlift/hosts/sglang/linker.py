"""LayerLift as an SGLang ``UnifiedCacheLinker`` (tested against SGLang 0.5.23).

Launch SGLang with::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "LayerLiftLinker",
        "linker_module_path": "layerlift.hosts.sglang",
        "linker_extra_config": {"master_address": "127.0.0.1:50051"}}'

SGLang keeps the radix tree, the device pools, admission and node locks; this
linker owns the store side: LayerLift's object format (layer-major pages with a
CRC-32C footer per layer, ``linker/integrity.py``), format-versioned keys from
SGLang's page hashes, the model's identity, its layout, the parallel layout and
the rank (``linker/keys.py``), per-layer loads on LayerLift's scheduler and
lanes (``load``), offloads through a staging snapshot (``offload``), both
streamed through bounded staging rings (``linker/ring.py``, ``linker/staged.py``),
and bounded waits. Its promises (each tested under SGLang's real wrapper):

- ``lookup`` returns the exact sparse set of restorable prefix lengths: every
  FULL page, the SWA window ending at the boundary, the Mamba checkpoint at it;
  never a quarantined (corrupt) object; a load of any size streams through the
  staging, so nothing it offers is refused by ``load``. It costs SGLang's
  scheduler a bounded time (``lookup``: one call bound, a breaker, a budget).
- A corrupt, foreign, truncated or missing slice fails its layer; no byte of it
  stays in the slots (they are zeroed; read in place, after the read that
  wrote them, ``load.py``) and ``finish_layer_wise_loading`` returns
  False, so SGLang aborts the loading requests and inserts none of their KV. A
  slice that failed its checksum quarantines its key until the store no longer
  has it; the next offload of it writes fresh bytes.
- A stalled or dead master ends a load within ``load_timeout_s`` (False, never
  a hang), and nothing writes into a batch's slots after ``finish`` returned.
- An offload whose put outlives ``timeout_s`` is reported failed; if it lands
  later it lands the offloaded bytes under their own checksums, nothing else.
- ``reset`` quiesces (SGLang's ``flush_cache`` frees every slot after it):
  queued offloads are dropped, none snapshots a slot after it returned, no
  result of one taken before it settles a later one; ``close`` as well.
- Nothing raises into SGLang's scheduler: every failure is logged and reported
  in SGLang's terms (a miss, a refused load or offload, a failed batch), but
  one: a store read into the slots (an in-place load) still running
  ``read_end_s`` after its batch failed raises ``SlotsStillWritten`` from
  ``finish_layer_wise_loading`` or ``reset``, rather than let SGLang reuse
  slots that read may still write.
- Pool features whose state it does not move are refused at construction.

The SGLang vocabulary (``PoolTransfer``, ``PoolName``) stops at this module.
Pools on the CPU take the host path (host copies); pools on a CUDA device the
device path (``device``: pinned staging rings, H2D copies and scatters on a load
stream with one event per layer that ``forward_stream`` waits on, offload
gathers on a stream ordered after the forward). ``device=`` injects another
:class:`~layerlift.overlap.device.Device` (tests: a simulated one).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from layerlift.linker.keys import KeySchema
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeConfig, MooncakeStore
from layerlift.linker.read_order import order_pays
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import require_fit
from layerlift.linker.store_base import Store
from layerlift.overlap.base import LoadPolicy
from layerlift.overlap.device import Device
from layerlift.overlap.lanes import CpuLane
from layerlift.overlap.scheduler import LoadScheduler

from .device import DevicePath, pool_device
from .layout import PoolLayout, fingerprint, pool_layouts, refuse_unmoved_state
from .load import BatchLoad, LoadCounter, LoadItem, LoopThread
from .load_in_place import READ_END_S, SlotsStillWritten
from .lookup import LookupGuard
from .offload import Offloader, OffloadItem
from .offload_in_place import in_place_ok
from .quarantine import Quarantine
from .settings import LinkerSettings

__all__ = ["LayerLiftLinker", "LinkerSettings"]

_log = logging.getLogger(__name__)


def _hash_bytes(page_hash: str) -> bytes:
    """SGLang's page hash (SHA-256 hex) as the bytes a LayerLift key names."""
    try:
        return bytes.fromhex(page_hash)
    except ValueError:
        return page_hash.encode()


def _parallel(name: str, default: int) -> int:
    """A width or rank from SGLang's published parallel context (``default``
    where it is not published or not written in this process)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        value = getattr(get_parallel(), name)
    except Exception:  # not published (a bare construction): the default
        return default
    return default if value is None else int(value)


def _topology(params: Any) -> tuple[int, str]:
    """This rank's index in its attention-TP cache group (the key's rank) and
    the parallel layout every key fingerprints: TP size, attention TP size,
    attention DP size, attention CP rank/size, decode CP size, pipeline
    rank/size. The rank and the attention TP size fix which KV heads and
    which Mamba shard this rank holds (with replicated KV heads, rank 1 holds
    head 1 at tp=2 but head 0 at tp=4, in identical shapes)."""
    tp_size = _parallel("tp_size", 1)
    attn_tp_size = _parallel("attn_tp_size", tp_size)
    rank = _parallel("attn_tp_rank", _parallel("tp_rank", 0))
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank(group=group)
        attn_tp_size = torch.distributed.get_world_size(group=group)
    layout = (f"tp{tp_size}.atp{attn_tp_size}.adp{_parallel('attn_dp_size', 1)}"
              f".cp{getattr(params, 'attn_cp_rank', 0)}of{getattr(params, 'attn_cp_size', 1)}"
              f".dcp{_parallel('attn_dcp_size', 1)}"
              f".pp{getattr(params, 'pp_rank', 0)}of{getattr(params, 'pp_size', 1)}")
    return rank, layout


class LayerLiftLinker(UnifiedCacheLinker):  # type: ignore[misc,unused-ignore]
    """The linker SGLang's dynamic backend constructs (see the module docstring).

    Thread model: SGLang's scheduler thread calls every method; the forward
    calls ``layer_done_counter.wait_until``; loads run on LayerLift's lane
    threads under an event loop of the linker's own, offloads on one thread,
    lookups' store calls on one more (``lookup.LookupGuard``).

    ``device``: the :class:`~layerlift.overlap.device.Device` the pools live on
    (default: found from the pools' tensors; None for CPU pools, the host path).
    """

    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None,
                 forward_stream: Any = None, device: Device | None = None) -> None:
        self.settings = s = LinkerSettings.parse(extra_config)
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        names = sorted(getattr(c, "name", str(c)) for c in components)
        refuse_unmoved_state(params, names)
        self.layouts: dict[str, PoolLayout] = pool_layouts(
            kvcache, params.req_to_token_pool, int(params.page_size), names)
        self.pools: dict[PoolName, object] = {PoolName(n): p for n, p in self.layouts.items()}
        found = pool_device(self.layouts, device)
        self.path = DevicePath.open(found, forward_stream) if found is not None else None
        self.num_layers = 1 + max(lp.layer for p in self.layouts.values() for lp in p.layers)
        rank, layout = _topology(params)
        model = s.model or getattr(server_args, "model_path", None) or "model"
        self.key_schema = KeySchema(s.namespace, fingerprint(str(model), self.layouts, layout),
                                    rank)
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
        self._own_store = self.store  # closed by close(), whatever wraps self.store later
        rings: list[StagingRing] = []
        try:
            # Loads and offloads stream through bounded staging rings (``linker/ring.py``):
            # a request of any size passes through, in chunks of capacity // depth
            # (loads) or capacity // 2 (offloads).
            # On a device both are pinned (the H2D and D2H copies read and write them).
            alloc = self.path.device.pinned if self.path is not None else None
            self.ring = StagingRing(self.store, s.staging_mib << 20, alloc=alloc,
                                    timeout_s=s.timeout_s)
            self.offload_ring = StagingRing(self.store, s.offload_ring_mib << 20, alloc=alloc,
                                            timeout_s=s.timeout_s)
            for pool in self.layouts.values():  # the only size a staged transfer refuses
                require_fit(self.ring, pool.objects)
                require_fit(self.offload_ring, pool.objects)
            for ring in (self.ring, self.offload_ring):
                ring.open()
                rings.append(ring)
        except BaseException:
            for ring in rings:
                ring.close()
            self.store.close()
            if self._master is not None:
                self._master.stop()
            raise
        self.layer_done_counter = LoadCounter(self.num_layers)
        if "mamba" in self.layouts:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self._loop = LoopThread("layerlift-sglang-loop")
        self._lane = CpuLane(max_workers=s.depth, name="sglang")
        self._scheduler = LoadScheduler(self._lane, LoadPolicy.OVERLAP, max_in_flight=s.depth)
        self._pending: dict[str, list[LoadItem]] = {}
        self._failed_starts: set[int] = set()  # counter indices whose start failed
        self._next_index = 0
        # The next batch's reads in turn (``ordered_reads``; "auto": decided by
        # the last batch that landed whole, ``read_order.order_pays``).
        self.reads_in_turn = s.ordered_reads is True
        self.quarantine = Quarantine()
        def in_place(kib: int | None) -> list[PoolLayout]:
            """The host pools whose every part reaches ``kib`` (None: none)."""
            least = None if kib is None else kib << 10
            return [] if self.path is not None else \
                [p for p in self.layouts.values() if in_place_ok(p, least)]

        load_pools = in_place(s.in_place_load_min_kib)
        self._load_in_place_pools = frozenset(p.name for p in load_pools)
        self._offloader = Offloader(self.store, self.offload_ring, self.quarantine, s.timeout_s,
                                    path=self.path, in_place=in_place(s.in_place_min_kib),
                                    register_too=load_pools)
        self.lookups = LookupGuard(s.lookup_timeout_s, s.lookup_breaker_s, s.lookup_share)
        self.finished: deque[BatchLoad] = deque(maxlen=256)  # recent batches (timings, verdict)
        self.errors = 0  # calls that failed by an unexpected error (logged; SGLang went on)
        self.read_end_s = READ_END_S  # how long a failed in-place load's reads may still run
        self._unended: list[BatchLoad] = []  # batches whose finish found a read still running
        self._closed = False

    # ---- helpers -------------------------------------------------------------

    def use_store(self, store: Store) -> None:
        """Route every later store call (lookups, loads, offloads) through
        ``store``: a wrapper of :attr:`store` (tests inject faults this way)."""
        self.store = store
        self._offloader._store = store

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

    def _load_in_place(self, pending: list[list[LoadItem]]) -> frozenset[str]:
        """The pools a batch reads straight into the slots (``load_in_place.py``):
        host pools whose every part reaches ``in_place_load_min_kib``, once
        they are registered with the store (the first such batch registers
        them; if the store refuses, this batch is staged and the next one
        tries again)."""
        names = {item.layout.name for items in pending for item in items}
        if not names & self._load_in_place_pools:
            return frozenset()
        try:
            self._offloader.register_pools()
        except Exception as exc:  # the staged path needs no registration
            _log.warning("LayerLift: registering SGLang's pools for in-place loads failed (%s); "
                         "this batch goes through staging", exc)
            return frozenset()
        return self._load_in_place_pools

    def _unexpected(self, what: str) -> None:
        self.errors += 1
        _log.exception("LayerLift %s failed by an unexpected error; SGLang goes on without it",
                       what)

    # ---- UnifiedCacheLinker ------------------------------------------------------

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """Every boundary ``b`` (pages of the tail) at which each pool of the
        lookup restores: FULL pages ``[0, b)``, the SWA window ending at ``b``
        (as many pages as the SWA transfer carries), the Mamba checkpoint of
        page ``b - 1``; none with a quarantined (corrupt) object. Every size
        loads through the staging ring (a single object too large for it is
        refused at construction), so no offered boundary is refused by ``load``. Bounded (``lookup.LookupGuard``); any
        failure is logged and reads as no hit."""
        try:
            return self._lookup(rid, transfers)
        except Exception:
            self._unexpected(f"lookup for {rid}")
            return []

    def _lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        by_name = {PoolName(t.name).value: t for t in transfers}
        kv = by_name.get("kv")
        if kv is None or not kv.keys:
            return []
        hashes = [_hash_bytes(h) for h in kv.keys]
        n = len(hashes)
        pools = [p for p in ("kv", "swa", "mamba") if p in by_name and p in self.layouts]
        keys = [k for p in pools for k in self.key_schema.keys(self.layouts[p].component, hashes)]
        answer = self.lookups.exists(self.store, keys)
        if answer is None:
            return []
        flags = [f and not q for f, q in zip(answer, self.quarantine.holds(keys), strict=True)]
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
        """Queue ``rid``'s load (its chunks take staging as they run); False
        (SGLang then recomputes) for a malformed transfer (logged). Never
        raises into SGLang's scheduler."""
        try:
            if rid in self._pending:
                _log.error("LayerLift: a load for %s is already queued; this one is recomputed",
                           rid)
                return False
            items = [LoadItem(rid, layout, tuple(keys), tuple(rows))
                     for layout, keys, rows in self._items(transfers)]
            if not items:
                return False
            self._pending[rid] = items
            return True
        except ValueError as exc:
            _log.error("LayerLift: %s's load is refused (%s); it is recomputed", rid, exc)
            return False
        except Exception:
            self._unexpected(f"load for {rid}")
            return False

    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        pending, self._pending = list(self._pending.values()), {}
        index, self._next_index = self._next_index, self._next_index + 1
        try:
            batch = BatchLoad(index, [item for items in pending for item in items],
                              self.num_layers, self.store, self.settings.load_timeout_s,
                              self.ring, depth=self.settings.depth,
                              timeout_s=self.settings.timeout_s, quarantine=self.quarantine,
                              path=self.path, in_place=self._load_in_place(pending),
                              read_end_s=self.read_end_s,
                              ordered=self.reads_in_turn)
            jobs = batch.jobs()
        except Exception:  # nothing was read: the verdict is False, SGLang aborts them
            self._unexpected(f"start of load batch {index}")
            self._failed_starts.add(index)
            return index
        self.layer_done_counter.add(batch)

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
        if counter_index in self._failed_starts:
            self._failed_starts.discard(counter_index)
            return False
        batch = self.layer_done_counter.take(counter_index)
        if batch is None:
            return True
        try:
            ok = batch.finish()
        except SlotsStillWritten:  # SGLang would reuse slots a read may still write
            self._unended.append(batch)
            raise
        except Exception:
            self._unexpected(f"finish of load batch {counter_index}")
            batch.stop()
            return False
        self.finished.append(batch)
        if ok and self.settings.ordered_reads == "auto":
            pays = order_pays(batch.asks, batch.read_s())
            if pays is not None:
                self.reads_in_turn = pays
        if not ok:
            _log.error("LayerLift: load batch %d failed: %s", counter_index, batch.error)
        return ok

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Queue one node's offload; False (SGLang unlocks the node at once)
        for a malformed transfer or any failure. Never raises."""
        try:
            items = [OffloadItem(layout, tuple(keys), tuple(rows))
                     for layout, keys, rows in self._items(transfers)]
            if not items:
                return False
            # Device path: the gather runs after what wrote the slots (SGLang's
            # record_offload_ready: the current stream and the forward stream).
            ready = self.path.offload_ready() if self.path is not None else []
            self._offloader.submit(items, ready)
            return True
        except ValueError as exc:
            _log.error("LayerLift: an offload is refused (%s)", exc)
            return False
        except Exception:
            self._unexpected("offload")
            return False

    def num_completed_offloads(self) -> int:
        return self._offloader.completed()

    def pop_completed_offload(self) -> bool:
        try:
            return self._offloader.pop()
        except IndexError:  # SGLang pops only what it counted; read as failed if not
            return False

    def reset(self) -> None:
        """Quiesce, as SGLang's contract asks before ``flush_cache`` frees every
        slot: drop queued loads, finish batches in flight (bounded by
        ``load_timeout_s``), drop queued offloads (they never start) and wait
        for the one running (bounded by ``timeout_s + 1``), forget every
        result. From its return no transfer taken before it touches a slot: a
        put still running sends the bytes it snapshotted before."""
        try:
            self._pending.clear()
            self._failed_starts.clear()
            for batch in self.layer_done_counter.batches():
                try:
                    batch.finish()
                except SlotsStillWritten:
                    self._unended.append(batch)
                    raise
                if not batch.quiet.wait(self.settings.timeout_s + 1.0):
                    _log.warning("LayerLift reset: load batch %d still has a read running "
                                 "(it writes into staging only)", batch.index)
            if not self._offloader.quiesce(self.settings.timeout_s + 1.0):
                _log.warning("LayerLift reset: an offload's put still runs past its bound; it "
                             "sends the bytes it snapshotted before the reset")
            self.layer_done_counter.reset()
        except SlotsStillWritten:  # flush_cache would free slots a read may still write
            raise
        except Exception:
            self._unexpected("reset")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.reset()
        except SlotsStillWritten as exc:
            _log.error("%s", exc)
        reading = any(b.gate.reads for b in self._unended)  # keeps the pools registered
        self._offloader.stop(self.settings.timeout_s + 1.0, keep_registered=reading)
        self.lookups.close()
        self._loop.stop()
        self._lane.close()
        for ring in (self.ring, self.offload_ring):
            if not ring.wait_idle(self.settings.timeout_s) or not ring.close():
                _KEPT.append(ring)  # a timed-out call still holds staging: keep it alive
                _log.warning("LayerLift close: a store call still holds staging; kept registered")
        self._own_store.close()
        if self._master is not None:
            self._master.stop()


_KEPT: list[StagingRing] = []
