"""`LayerLiftConnector`: LayerLift as a vLLM v1 KV connector (vLLM 0.32 and 0.33: ``compat``).

Load it with::

    --kv-transfer-config '{"kv_connector": "LayerLiftConnector",
      "kv_connector_module_path": "layerlift.hosts.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "mooncake://HOST:PORT",
                                    "metadata": "P2PHANDSHAKE"}}'

``kv_connector_extra_config`` takes `EngineConfig`'s field names (``store``,
``metadata``, ``protocol``, ``rdma_devices``, ``namespace``, ``segment_bytes``,
``client_buffer_bytes``, ``store_timeout_s``, ``layer_wait_timeout_s``,
``max_in_flight``, ``offload``); ``store`` must be ``mooncake://HOST:PORT``
(the scheduler and the worker are two processes: they share the store
through the master). ``segment_bytes`` (default 0 here) is memory the worker
contributes to the cluster; data in it leaves with the instance.

What it promises (each is a test in ``tests/hosts/vllm_host``):

* It implements `SupportsHMA`: vLLM keeps its hybrid KV cache manager on.
* A hit is a boundary every group can restore: full-attention groups need
  every page before it, sliding-window groups the pages of their window,
  Mamba groups (``mamba_cache_mode="none"``, prefix caching off) the state
  checkpointed at that boundary. Other groups make the constructor raise
  ValueError with the group named.
* Two load modes, chosen from the model and the scheduler class (one log
  line at start-up says which and why). vLLM (0.32 and 0.33 alike) maps
  block-level load errors (``get_block_ids_with_load_errors``) to requests
  only with ONE KV cache group (``Scheduler._handle_invalid_blocks`` raises
  RuntimeError otherwise) and has no ``wait_for_layer_load`` hook before
  Mamba layers:
  - one group: *synchronous*; the forward runs while LayerLift fetches layer
    by layer, ``wait_for_layer_load(l)`` waits for layer ``l`` only (at most
    ``layer_wait_timeout_s``), failures are reported as block ids at the end
    of the step and vLLM recomputes from the first failed block;
  - several groups (every hybrid) with vLLM's own scheduler:
    *asynchronous*; the request waits in ``WAITING_FOR_REMOTE_KVS`` while
    its layers are fetched in layer order on LayerLift's lane (other
    requests' forwards run), failures are reported per request
    (``failed_recving``) and vLLM recomputes it whole;
  - several groups with ``scheduler_cls="layerlift.hosts.vllm.LayerLiftScheduler"``
    (`LayerLiftScheduler`, vLLM 0.32 and 0.33 only, async scheduling off):
    *synchronous*; Mamba state lands before the forward starts (in
    ``start_load_kv``), each attention layer waits for its own layer, a
    failure is reported per request in the worker metadata and the
    scheduler class recomputes (or fails) the request.
* Every restored slice is checked against its CRC before it is copied into
  vLLM's block. A failed, corrupt or late load is reported; with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes, with ``"fail"``
  (vLLM's default) the request ends with an error. Nothing writes into the
  blocks after the report. A stalled master costs at most ``store_timeout_s``
  per store call; the connector never raises into the forward.
* Nothing computed in a step whose synchronous restore failed is offloaded,
  nor a local prefix-cache hit as the hitting request's own pages (worker
  and planner docstrings).
* Keys cover what vLLM's own block hashes cover (tokens, LoRA adapter,
  ``cache_salt``, multimodal inputs, prompt embeddings), the model identity
  (name, revision, dtype, quantization, KV-cache dtype, ``hf_overrides``)
  and the tensor-parallel size; each worker reads and writes its own TP
  rank's keys. Pipeline parallelism is refused (ValueError).
* The lookup never waits for the store on vLLM's engine-core thread (it
  answers None, "ask again", while its ``exists`` runs on LayerLift's lookup
  thread; `BlockPlanner` states the bound).
* The cache is best effort (``requires_kv_delivery`` is False): a dropped
  offload is a later miss. Sleep mode is not supported (``supports_sleep_mode``
  False: vLLM 0.33 refuses ``enable_sleep_mode`` with this connector).
* With ``segment_bytes=0`` the cluster's memory comes from other processes
  (a ``layerlift store-node``); a cluster with none stores nothing, and the
  worker says so in one log line at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from layerlift.engine.config import EngineConfig
from layerlift.engine.stores import StoreHandle, open_store
from layerlift.hosts.vllm.compat import Release, release
from layerlift.hosts.vllm.layout import GroupKind, Layout, classify_groups
from layerlift.hosts.vllm.meta import StepMeta, WorkerReport
from layerlift.hosts.vllm.planner import BlockPlanner
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.linker.store_base import Store, StoreError, StoreFull, StoreTimeout

if TYPE_CHECKING:
    import torch

__all__ = ["LayerLiftConnector", "LayerLiftMetadata", "LayerLiftWorkerMeta",
           "check_vllm_version", "engine_config", "load_mode", "model_identity", "tp_rank",
           "uses_layerlift_scheduler", "warn_if_no_memory"]

log = logging.getLogger("vllm.layerlift")
_KEYS = {"store", "metadata", "protocol", "rdma_devices", "namespace", "segment_bytes",
         "client_buffer_bytes", "store_timeout_s", "layer_wait_timeout_s", "max_in_flight",
         "offload"}


def engine_config(extra: dict[str, Any]) -> EngineConfig:
    """`EngineConfig` from ``kv_connector_extra_config``. Raises ValueError
    for an unknown key or a store that is not ``mooncake://HOST:PORT``."""
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ValueError(f"LayerLiftConnector: unknown kv_connector_extra_config keys {unknown};"
                         f" accepted: {sorted(_KEYS)}")
    fields = {"segment_bytes": 0, **extra}
    if "store" not in fields:
        raise ValueError("LayerLiftConnector needs kv_connector_extra_config['store'] = "
                         "'mooncake://HOST:PORT' (the Mooncake master's RPC address).")
    cfg = EngineConfig(**fields)
    if cfg.store_target().kind != "mooncake":
        raise ValueError("LayerLiftConnector: the store must be 'mooncake://HOST:PORT' (vLLM's "
                         f"scheduler and worker are separate processes), got {cfg.store!r}.")
    return cfg


class LayerLiftMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's `StepMeta`, as vLLM's connector metadata."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


class LayerLiftWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """A worker's `WorkerReport` for the scheduler (merged across workers)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: Any) -> LayerLiftWorkerMeta:
        if not isinstance(other, LayerLiftWorkerMeta):
            return self
        return LayerLiftWorkerMeta(self.report.merge(other.report))


class LayerLiftConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """vLLM v1 KV connector over LayerLift's store, keys and lanes (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("LayerLiftConnector needs vLLM's kv_cache_config.")
        self.config = engine_config(dict(self._kv_transfer_config.kv_connector_extra_config))
        self.groups, self.page_size = classify_groups(kv_cache_config)
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
            raise ValueError("LayerLiftConnector does not support pipeline parallelism "
                             "(pipeline_parallel_size > 1): its keys do not name the stage.")
        self._model_id = model_identity(vllm_config)
        self._dtype = str(vllm_config.model_config.dtype)
        self._tp_size = int(getattr(parallel, "tensor_parallel_size", 1))
        self._store: StoreHandle | None = None
        self._planner: BlockPlanner | None = None
        self._worker: BlockWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            layer_bytes = _spec_bytes(kv_cache_config)
            layout = self._layout(layer_bytes)
            self._store = open_store(dataclasses.replace(self.config, segment_bytes=0))
            sync_hybrid = uses_layerlift_scheduler(vllm_config)
            self._planner = BlockPlanner(self._store.store, layout, self.config.namespace,
                                         offload=self.config.offload,
                                         lookup_timeout_s=self.config.store_timeout_s,
                                         sync_hybrid=sync_hybrid)
            log.info("LayerLiftConnector: %s", load_mode(len(self.groups), sync_hybrid))
            log.info("LayerLiftConnector: %d KV cache groups (%s), page %d tokens, keys %s",
                     len(self.groups), ", ".join(g.component for g in self.groups),
                     self.page_size, layout.schema(self.config.namespace).prefix)

    def _layout(self, layer_bytes: dict[str, int], rank: int = 0) -> Layout:
        return Layout(tuple(self.groups), self.page_size, layer_bytes, self._model_id,
                      self._dtype, rank, self._tp_size)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped offload is a later miss."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks, and refuses ``enable_sleep_mode`` then; 0.32
        never asks): the worker keeps vLLM's KV tensors and restores into
        them from its own threads, which sleep mode's remap would pull away."""
        return False

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check every restored layer's cache is one tensor of vLLM's blocks
        (one row per KV cache manager block: a backend that splits a block
        into kernel blocks is refused); start the worker with its TP rank's
        keys; log one line when the cluster has no memory to offload into."""
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0))
        layer_bytes = {}
        for group in self.groups:
            for name in group.layer_names:
                kv = kv_caches.get(name)
                if kv is None or not hasattr(kv, "stride") or not kv[0].is_contiguous():
                    raise ValueError(f"LayerLiftConnector: layer {name}'s KV cache is not one "
                                     "tensor with contiguous blocks; cannot restore it.")
                attention = group.kind is not GroupKind.MAMBA
                if attention and num_blocks and int(kv.shape[0]) != num_blocks:
                    raise ValueError(
                        f"LayerLiftConnector: layer {name}'s KV cache has {int(kv.shape[0])} "
                        f"blocks where vLLM's KV cache manager has {num_blocks} (the attention "
                        "backend splits a block into kernel blocks); LayerLift restores whole "
                        "manager blocks only.")
                layer_bytes[name] = kv[0].numel() * kv.element_size()
        layout = self._layout(layer_bytes)
        rank = tp_rank(self._tp_size)
        keys = self._layout(_spec_bytes(self._kv_cache_config), rank).schema(self.config.namespace)
        self._store = open_store(self.config)
        self._worker = BlockWorker(
            self._store.store, layout, kv_caches, schema=keys,
            staging_bytes=self.config.client_buffer_bytes,
            max_in_flight=self.config.max_in_flight,
            load_timeout_s=self.config.layer_wait_timeout_s)
        if rank == 0 and self.config.segment_bytes == 0:
            warn_if_no_memory(self._store.store, self.config.store, keys.prefix)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        self._worker.begin_step()
        meta = self._step()
        if meta is not None and meta.loads:
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer of this step's synchronous restores only
        (bounded by ``layer_wait_timeout_s``; a failure is reported at the
        step's end, never raised into the forward). On CUDA the host waits
        until the layer's copies were issued on LayerLift's load stream, then
        the current stream waits on the layer's event (no host sync)."""
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Offloads are staged once per step, in `wait_for_save`."""
        return None

    def wait_for_save(self) -> None:
        """Stage this step's completed pages (copied before returning: on
        CUDA gathered on LayerLift's save stream after an event recorded on
        the current stream, and waited for) and put them in the background."""
        meta = self._step()
        if meta is not None and self._worker is not None and meta.saves:
            self._worker.save(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.results() if self._worker is not None else (set(), set())
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Successful asynchronous restores only (vLLM 0.32 and 0.33 call
        `get_transfer_results` instead): a failed one is never reported as
        finished here; it stays for `get_transfer_results`."""
        done = self._worker.successes() if self._worker is not None else set()
        return None, done or None

    def build_connector_worker_meta(self) -> LayerLiftWorkerMeta | None:
        """Objects this worker found corrupt or replaced (for the lookups)."""
        report = self._worker.report() if self._worker is not None else None
        return LayerLiftWorkerMeta(report) if report is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step's synchronous restores that did not land
        verified (each revoked first: nothing writes into them afterwards).
        Asynchronous restores report failures per request instead."""
        return self._worker.step_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.close()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def _step(self) -> StepMeta | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.step if isinstance(meta, LayerLiftMetadata) else None

    # ---- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Never waits for the store: None (vLLM asks again next step) while
        the lookup runs off this thread (bound: `BlockPlanner`)."""
        assert self._planner is not None
        n = self._planner.matched_tokens(request, num_computed_tokens)
        if n is None:
            return None, False
        return n, n > 0 and not self._planner.sync_loads

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups)

    def build_connector_meta(self, scheduler_output: Any) -> LayerLiftMetadata:
        assert self._planner is not None
        return LayerLiftMetadata(self._planner.step_meta(scheduler_output))

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool (scheduler side): saves hold their attention
        blocks through it until every worker reported them done, so the
        workers put them after the step (`BlockHolds`)."""
        if self._planner is not None:
            self._planner.bind_block_pool(gpu_block_pool)

    def has_pending_push_work(self) -> bool:
        """True while a save still holds blocks: vLLM keeps stepping, and the
        workers' reports that release them arrive with a step's output."""
        return self._planner is not None and self._planner.pending_saves()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._planner is not None:
            self._planner.loads_reported(
                set(connector_output.finished_recving or ()),
                set(connector_output.failed_recving or ()),
                set(getattr(connector_output, "invalid_block_ids", None) or ()))
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, LayerLiftWorkerMeta):
                self._planner.worker_report(meta.report)

    # ---- for LayerLiftScheduler --------------------------------------------------

    @property
    def planner(self) -> BlockPlanner:
        """The scheduler side's planner (scheduler role only)."""
        assert self._planner is not None, "the scheduler side only"
        return self._planner

    def sync_load_failures(self, connector_output: Any) -> set[str]:
        """Requests whose synchronous restore of a multi-group model did not
        land verified in the step of ``connector_output`` (from the workers'
        merged report)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        return set(meta.report.failed) if isinstance(meta, LayerLiftWorkerMeta) else set()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Offloads do not delay the free: their save jobs hold references of
        their own on the blocks (`bind_gpu_block_pool`); a request finished
        (aborted) while its asynchronous restore runs keeps its blocks until
        that restore is reported (vLLM frees them then)."""
        loading = self._planner.finished(request) if self._planner is not None else False
        return loading, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])


def check_vllm_version(version: str) -> Release:
    """The `Release` (``compat.RELEASES``) of ``version``; raises ValueError,
    naming the supported versions (0.32.x and 0.33.x), for any other vLLM:
    `LayerLiftScheduler` overrides private methods of vLLM's ``Scheduler``."""
    return release(version)


def uses_layerlift_scheduler(vllm_config: Any) -> bool:
    """Whether vLLM's ``scheduler_cls`` is `LayerLiftScheduler` (or a
    subclass). Raises ValueError when it is and this vLLM is another version."""
    cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    if cls is None:
        return False
    if isinstance(cls, str):
        import importlib

        module, _, name = cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return False  # vLLM itself reports a scheduler class it cannot import
    # The class says so itself (``LAYERLIFT_SCHEDULER``): importing the
    # scheduler module here would make the package's imports a cycle.
    ours = isinstance(cls, type) and bool(getattr(cls, "LAYERLIFT_SCHEDULER", False))
    if ours:
        import vllm  # type: ignore[import-not-found, unused-ignore]

        check_vllm_version(str(vllm.__version__))
    return ours


def load_mode(groups: int, sync_hybrid: bool) -> str:
    """The start-up line saying which load mode runs and why."""
    if groups == 1:
        return ("synchronous loads (one KV cache group): the forward runs while layers are "
                "fetched, each layer waits for its own")
    if sync_hybrid:
        return (f"synchronous loads ({groups} KV cache groups, LayerLiftScheduler): Mamba state "
                "lands before the forward, each attention layer waits for its own; failures "
                "are recomputed per request by the scheduler class")
    return (f"asynchronous loads ({groups} KV cache groups): vLLM's scheduler cannot map a "
            "running request's load failure back for several groups, so a request waits for "
            "its whole restore; set scheduler_cls='layerlift.hosts.vllm.LayerLiftScheduler' "
            "(and async_scheduling off) for per-layer overlap")


def model_identity(vllm_config: Any) -> str:
    """Everything besides the layout that changes a model's KV bytes: name,
    revision, dtype, quantization, KV-cache dtype, ``hf_overrides`` (JSON)."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    overrides = getattr(model, "hf_overrides", None)
    desc = {
        "model": str(model.model), "revision": str(getattr(model, "revision", None)),
        "dtype": str(model.dtype), "quantization": str(getattr(model, "quantization", None)),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "hf_overrides": (json.dumps(overrides, sort_keys=True, default=repr)
                         if isinstance(overrides, dict) else repr(overrides)),
    }
    return json.dumps(desc, sort_keys=True)


def tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank (vLLM's TP group; 0 without TP).
    Raises ValueError when TP > 1 and vLLM's TP group is not set up."""
    if tp_size <= 1:
        return 0
    try:
        from vllm.distributed import (  # type: ignore[import-not-found, unused-ignore]
            get_tensor_model_parallel_rank,
        )

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError) as exc:
        raise ValueError("LayerLiftConnector: tensor_parallel_size > 1 but vLLM's TP group is "
                         "not initialised; cannot tell this worker's rank.") from exc


def warn_if_no_memory(store: Store, url: str, prefix: str) -> bool:
    """Put (and remove) one 64-byte probe object; log one line and return
    False when the cluster has no memory to put into (no store-node, no
    instance contributing ``segment_bytes``). True when it took the put, or
    when the probe could not tell (another store error: logged by the
    first real put)."""
    from layerlift.linker.ring import StagingRing

    ring = StagingRing(store, 64, timeout_s=0.0)
    key = f"{prefix}probe/0/{uuid.uuid4().hex}"
    ok = True
    try:
        region = ring.acquire(64, zero=True)
    except StoreError as exc:
        log.debug("LayerLift: the start-up memory probe could not register: %s", exc)
        return True
    try:
        store.put([key], [region.ptr], [64])
    except StoreFull:
        log.warning("LayerLift: the Mooncake cluster at %s has no memory (segment_bytes=0 here "
                    "and no store-node): nothing will be offloaded or restored. Start one: "
                    "layerlift store-node --master HOST:PORT --metadata P2PHANDSHAKE "
                    "--bytes 512M", url)
        ok = False
    except StoreTimeout as exc:
        region.hand_over(exc)  # the put may still read it: back once it ended
        log.debug("LayerLift: the start-up memory probe timed out: %s", exc)
    except StoreError as exc:
        log.debug("LayerLift: the start-up memory probe failed: %s", exc)
    finally:
        region.release()
    try:
        if ok:
            store.remove([key])
        ring.close()  # a region still lent: unregistered once the call ended
    except StoreError:
        pass
    return ok


def _spec_bytes(kv_cache_config: Any) -> dict[str, int]:
    """Per-layer block bytes as the scheduler sees them (its `KVCacheSpec`s);
    the worker derives the same figures from the tensors."""
    out: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            out[name] = int(group.kv_cache_spec.page_size_bytes)
    return out
