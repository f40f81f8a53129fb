"""Helpers of the vLLM 0.33 tests: vLLM 0.33's own `Scheduler` (or
`LayerLiftScheduler`) built on this CPU machine with `LayerLiftConnector`
over LayerLift's in-memory store, its requests, and the model runner's
output of a step as vLLM's worker would return it.

No model runs: vLLM's configs are built from a tiny model's ``config.json``
(no weights), its ``KVCacheConfig`` by hand (one full-attention group, or
full attention plus sliding window, or full attention plus Mamba), and a
step's output is made from the `SchedulerOutput` the scheduler returned.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import layerlift.hosts.vllm.connector as connector_mod
from layerlift.engine.stores import StoreHandle
from layerlift.hosts.vllm.connector import LayerLiftConnector, LayerLiftWorkerMeta
from layerlift.hosts.vllm.meta import WorkerReport
from layerlift.linker.memory_store import MemoryStore

__all__ = ["BLOCK", "Built", "HeldStore", "build", "model_config", "output_of", "request",
           "steps", "tiny_model_dir"]

BLOCK = 16  # tokens per block (vLLM's and LayerLift's page)
NUM_BLOCKS = 64
MAX_LEN = 1024
FULL = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
SWA = ("model.layers.2.self_attn.attn",)
MAMBA = ("model.layers.3.mixer",)


def tiny_model_dir(path: Path) -> str:
    """A llama ``config.json`` (no weights: nothing is loaded)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 16}))
    return str(path)


def model_config(model_dir: str) -> ModelConfig:
    """vLLM 0.33's `ModelConfig` of the tiny model (it inspects the
    architecture: about 10 s; build it once per session)."""
    return ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                       max_model_len=MAX_LEN)


def _kv_cache_config(kind: str) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    groups = [KVCacheGroupSpec(list(FULL), full)]
    if kind == "swa":
        groups.append(KVCacheGroupSpec(list(SWA), SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32,
            sliding_window=2 * BLOCK)))
    elif kind == "mamba":
        groups.append(KVCacheGroupSpec(list(MAMBA), MambaSpec(
            block_size=MAX_LEN, shapes=((4, 8), (2, 8, 4)),
            dtypes=(torch.float32, torch.float32), mamba_cache_mode="none")))
    elif kind != "full":
        raise ValueError(kind)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


@dataclass
class Built:
    """One scheduler, its LayerLift connector and the store behind it."""

    scheduler: Scheduler
    connector: LayerLiftConnector
    store: HeldStore
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    source: torch.Tensor = field(default_factory=lambda: torch.zeros(8, dtype=torch.uint8))

    def put_pages(self, tokens: list[int], pages: int) -> None:
        """Store an (8-byte) object for each group's first ``pages`` pages of
        ``tokens`` under the keys the lookup asks for (it asks ``exists``
        only; no restore reads them here)."""
        planner = self.connector.planner
        layout = planner.layout
        hashes = planner._track(request(tokens, "probe")).hashes
        planner._tracks.pop("probe")
        ptr = self.store.register(self.source)
        keys = [schema.key(g.component, hashes[p]) for g in layout.groups
                for p in range(pages) for schema in planner.schemas]
        self.store.put(keys, [ptr] * len(keys), [8] * len(keys))

    def schedule(self) -> SchedulerOutput:
        """One ``schedule()`` with every lookup it starts held (so a new
        request is never scheduled in the step of its first lookup: vLLM is
        told "ask again"), then those lookups answered and waited for on
        their futures: the next call sees the answers."""
        self.store.gate.clear()
        try:
            out = self.scheduler.schedule()
            pending = [self.connector.planner.pending_lookup(r.request_id)
                       for r in self.scheduler.waiting]
        finally:
            self.store.gate.set()
        for future in pending:
            if future is not None:
                future.result(timeout=30)
        return out


class HeldStore(MemoryStore):
    """The in-memory store whose ``exists`` waits for ``gate`` (set: answers
    at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        assert self.gate.wait(30), "the test never opened the lookup gate"
        return super().exists(keys)


def build(model: ModelConfig, monkeypatch: pytest.MonkeyPatch, *, kind: str = "full",
          cls: type[Any] = Scheduler,
          policy: str = "recompute", max_tokens: int = 512, offload: bool = True,
          async_scheduling: bool = False) -> Built:
    """vLLM 0.33's ``cls`` (its `Scheduler` or `LayerLiftScheduler`) with
    `LayerLiftConnector` on a `HeldStore` (the connector's `open_store`
    replaced through ``monkeypatch``: undone when the test ends)."""
    store = HeldStore()
    monkeypatch.setattr(connector_mod, "open_store", lambda config: StoreHandle(store, None, None))
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=max_tokens, max_model_len=MAX_LEN,
            is_encoder_decoder=False, async_scheduling=async_scheduling,
            enable_chunked_prefill=True, scheduler_cls=cls),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LayerLiftConnector", kv_connector_module_path="layerlift.hosts.vllm",
            kv_role="kv_both", kv_load_failure_policy=policy,
            kv_connector_extra_config={"store": "mooncake://127.0.0.1:1", "namespace": "t033",
                                       "offload": offload}))
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = _kv_cache_config(kind)
    # the block sizes as vLLM's engine core resolves them for its scheduler
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                    structured_output_manager=StructuredOutputManager(vllm_config),
                    block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
    connector = scheduler.connector
    assert isinstance(connector, LayerLiftConnector)
    return Built(scheduler, connector, store, vllm_config, kv_cache_config)


def request(tokens: list[int], req_id: str, max_tokens: int = 4) -> Request:
    """A greedy text request as vLLM's engine core makes one."""
    return Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   None)


def output_of(out: SchedulerOutput, scheduler: Scheduler, *, token: int = 7,
              failed: set[str] | None = None) -> ModelRunnerOutput:
    """What vLLM's worker returns for the step ``out``: one sampled token
    per request whose prefill (or decode) ended in the step, none for a
    partial prefill; ``failed``: the workers' report of synchronous
    restores that did not land (`LayerLiftWorkerMeta`)."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in ids:
        req = scheduler.requests[req_id]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    kv = KVConnectorOutput(kv_connector_worker_meta=(
        LayerLiftWorkerMeta(WorkerReport(failed=set(failed))) if failed else None))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled, kv_connector_output=kv)


def steps(built: Built, limit: int = 20) -> Iterator[SchedulerOutput]:
    """Schedule and finish steps until nothing is left (at most ``limit``)."""
    for _ in range(limit):
        if not built.scheduler.has_requests():
            return
        out = built.schedule()
        if out.total_num_scheduled_tokens:
            built.scheduler.update_from_output(out, output_of(out, built.scheduler))
        yield out
