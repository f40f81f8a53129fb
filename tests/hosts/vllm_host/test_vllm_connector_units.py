"""`LayerLiftConnector`'s own rules, without a vLLM instance: the model
identity in its keys changes with everything that changes the KV bytes; the
worker's TP rank comes from vLLM's TP group (0 without TP, ValueError when
the group is missing); pipeline parallelism is refused at construction; the
cache is best effort (``requires_kv_delivery`` False although the role
produces KV); ``register_kv_caches`` refuses a layer cache split into kernel
blocks and one that is absent or not contiguous per block, before it opens
the store.

The connector is built for real (vLLM's base-class ``__init__`` runs): its
config is a namespace holding vLLM's own `KVTransferConfig`, and a
`KVCacheConfig` of one full-attention group. `open_store` is replaced by a
stand-in that raises, so no Mooncake master is needed and a check that let
a config through to the store shows as ``_StoreOpened``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.distributed
from vllm.config import KVTransferConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import layerlift.hosts.vllm.connector as connector_mod
from layerlift.hosts.vllm.connector import (
    KVConnectorRole,
    LayerLiftConnector,
    model_identity,
    tp_rank,
)

pytestmark = [pytest.mark.vllm]

NUM_BLOCKS = 6
BLOCK = 16  # tokens per block
HEADS, HEAD_SIZE = 2, 4
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


class _StoreOpened(Exception):
    """Raised by the stand-in for `open_store`: the checks before it passed."""


@pytest.fixture(autouse=True)
def no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here reaches a store: opening one raises ``_StoreOpened``."""
    def open_store(config: Any) -> Any:
        raise _StoreOpened

    monkeypatch.setattr(connector_mod, "open_store", open_store)


def _vllm_config(pp: int = 1, tp: int = 1, **model: Any) -> SimpleNamespace:
    """What the connector reads of a `VllmConfig`; ``model`` overrides
    model_config fields, ``cache_dtype`` the cache_config's."""
    cache_dtype = model.pop("cache_dtype", "auto")
    fields: dict[str, Any] = {"model": "org/tiny", "revision": None, "dtype": torch.float32,
                              "quantization": None, "hf_overrides": None, **model}
    return SimpleNamespace(
        model_config=SimpleNamespace(**fields),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        scheduler_config=None,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LayerLiftConnector", kv_role="kv_both",
            kv_connector_module_path="layerlift.hosts.vllm",
            kv_connector_extra_config={"store": "mooncake://127.0.0.1:50051"}),
    )


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def _worker(**config: Any) -> LayerLiftConnector:
    return LayerLiftConnector(_vllm_config(**config), KVConnectorRole.WORKER, _kv_cache_config())


def _layer(blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """One layer's cache as vLLM lays it out: one row (K and V) per block."""
    return torch.zeros(blocks, 2, BLOCK, HEADS, HEAD_SIZE)


# ---- model_identity ----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("revision", "abc123"),
    ("dtype", torch.bfloat16),
    ("quantization", "fp8"),
    ("cache_dtype", "fp8_e4m3"),
    ("hf_overrides", {"num_hidden_layers": 2}),
])
def test_model_identity_changes_with_each_field_that_changes_the_kv_bytes(
        field: str, value: Any) -> None:
    """Revision, dtype, quantization, KV-cache dtype and ``hf_overrides``
    each change the identity (so the keys) on their own."""
    base = model_identity(_vllm_config())
    changed = model_identity(_vllm_config(**{field: value}))
    assert changed != base, f"changing {field} left the model identity unchanged"


def test_model_identity_is_equal_for_equal_inputs_and_ignores_override_order() -> None:
    """Equal configs (built separately) give equal identities, and the order
    of ``hf_overrides``' keys does not matter; different override values do."""
    assert model_identity(_vllm_config()) == model_identity(_vllm_config())
    ab = model_identity(_vllm_config(hf_overrides={"a": 1, "b": {"x": 2, "y": 3}}))
    ba = model_identity(_vllm_config(hf_overrides={"b": {"y": 3, "x": 2}, "a": 1}))
    assert ab == ba, "the order of hf_overrides' keys changed the model identity"
    other = model_identity(_vllm_config(hf_overrides={"a": 1, "b": {"x": 2, "y": 4}}))
    assert other != ab


# ---- tp_rank -------------------------------------------------------------------------

def test_tp_rank_is_zero_without_tp_and_never_asks_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tp_size 1 the rank is 0 and vLLM's TP group is not consulted
    (it does not exist in a single-process engine)."""
    def asked() -> int:
        raise AssertionError("tp_rank(1) asked vLLM's TP group")

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", asked)
    assert tp_rank(1) == 0


def test_tp_rank_is_vllms_tp_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tp_size 2 the rank is what vLLM's TP group says (tp_rank imports
    ``get_tensor_model_parallel_rank`` from ``vllm.distributed`` at each
    call, so the patched attribute is the one it calls)."""
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 1)
    assert tp_rank(2) == 1


@pytest.mark.parametrize("error", [AssertionError, RuntimeError])
def test_tp_rank_without_a_tp_group_is_a_value_error(
        monkeypatch: pytest.MonkeyPatch, error: type[Exception]) -> None:
    """vLLM's "group not initialised" (an AssertionError in 0.32, or a
    RuntimeError) becomes a ValueError naming tensor_parallel_size."""
    def uninitialised() -> int:
        raise error("tensor model parallel group is not initialized")

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", uninitialised)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tp_rank(2)


def test_tp_rank_in_a_process_without_vllms_tp_group_is_a_value_error() -> None:
    """Unpatched: this test process never set up vLLM's TP group, and vLLM's
    own assertion surfaces as the ValueError."""
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tp_rank(2)


# ---- construction --------------------------------------------------------------------

@pytest.mark.parametrize("role", [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER])
def test_pipeline_parallelism_is_refused(role: Any) -> None:
    """pipeline_parallel_size 2 makes the constructor raise ValueError naming
    pipeline parallelism, on both sides (the scheduler side refuses before it
    opens the store)."""
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LayerLiftConnector(_vllm_config(pp=2), role, _kv_cache_config())


def test_without_pipeline_parallelism_the_worker_is_built_best_effort() -> None:
    """The control for the refusal: pipeline_parallel_size 1 constructs. The
    connector is a best-effort cache: ``requires_kv_delivery`` is False,
    where vLLM's base class would say True for this ``kv_both`` role."""
    connector = _worker(pp=1)
    assert connector._kv_transfer_config.is_kv_producer  # the base-class answer: True
    assert connector.requires_kv_delivery is False
    assert connector._model_id == model_identity(_vllm_config())


# ---- register_kv_caches --------------------------------------------------------------

def test_register_kv_caches_with_whole_blocks_reaches_the_store() -> None:
    """The control for the refusals below: caches of one row per manager
    block pass every check, and the worker goes on to open its store (a
    stand-in, `no_store`, that raises ``_StoreOpened``)."""
    with pytest.raises(_StoreOpened):
        _worker().register_kv_caches({name: _layer() for name in LAYERS})


def test_register_kv_caches_refuses_kernel_blocks() -> None:
    """A layer whose tensor has more rows than vLLM's manager has blocks (the
    backend split each block into kernel blocks) is refused with ValueError
    naming the layer and kernel blocks, before any store is opened."""
    caches = {LAYERS[0]: _layer(), LAYERS[1]: _layer(2 * NUM_BLOCKS)}
    with pytest.raises(ValueError, match="kernel blocks") as info:
        _worker().register_kv_caches(caches)
    assert LAYERS[1] in str(info.value)
    assert f"{2 * NUM_BLOCKS} blocks" in str(info.value)


@pytest.mark.parametrize("case", ["absent", "not a tensor", "block not contiguous"])
def test_register_kv_caches_refuses_a_cache_that_is_not_contiguous_blocks(case: str) -> None:
    """A layer with no cache, a cache that is not a tensor, or one whose
    block is not contiguous (K and V of a block lie apart: a tensor laid out
    (2, blocks, ...) seen as (blocks, 2, ...)) is refused with ValueError
    naming the layer, before any store is opened."""
    caches: dict[str, Any] = {name: _layer() for name in LAYERS}
    if case == "absent":
        del caches[LAYERS[1]]
    elif case == "not a tensor":
        caches[LAYERS[1]] = [_layer()[i] for i in range(NUM_BLOCKS)]
    else:
        split = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE).transpose(0, 1)
        assert split.shape == _layer().shape and not split[0].is_contiguous()
        caches[LAYERS[1]] = split
    with pytest.raises(ValueError, match="contiguous blocks") as info:
        _worker().register_kv_caches(caches)
    assert LAYERS[1] in str(info.value)
