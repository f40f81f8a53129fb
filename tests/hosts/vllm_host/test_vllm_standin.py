"""``layerlift bench vllm --compute-ms``'s stand-in connectors: vLLM's own
factory resolves both from the ``kv_transfer_config`` the benchmark writes
(LayerLift's and vLLM's ``MooncakeStoreConnector``, each still itself and
still HMA-capable); each layer's wait runs the connector's own wait first,
then the stand-in's sleep, and nothing more without one; the milliseconds
come from the environment, a bad value a ValueError naming it."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)

import layerlift.testing.vllm_standin as standin
from layerlift.hosts.vllm import LayerLiftConnector
from layerlift.testing.vllm_verify import kv_transfer_config

pytestmark = [pytest.mark.vllm]


@pytest.mark.parametrize(("connector", "base"), [("layerlift", LayerLiftConnector),
                                                 ("mooncake", MooncakeStoreConnector)])
def test_vllms_factory_builds_the_stand_in_of_each_connector(connector: str, base: type) -> None:
    kv = kv_transfer_config(connector, {}, standin=True)
    assert kv is not None
    config = KVTransferConfig(**kv)
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls.__name__ == f"StandIn{base.__name__}" and issubclass(cls, base)
    assert cls.wait_for_layer_load is standin._StandIn.wait_for_layer_load
    assert KVConnectorFactory.supports_hma_config(config)  # hybrids run as without it


class _Recorder:
    """A connector base that records its calls."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self.calls: list[tuple[str, Any]] = [("init", (vllm_config, role, kv_cache_config))]

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name))


class _Timed(standin._StandIn, _Recorder):
    pass


def test_each_layer_waits_for_its_load_then_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(standin.COMPUTE_ENV, "2.5")
    conn = _Timed("config", "worker", "kv")
    monkeypatch.setattr(standin.time, "sleep", lambda s: conn.calls.append(("sleep", s)))
    conn.wait_for_layer_load("model.layers.0.self_attn.attn")
    conn.wait_for_layer_load("model.layers.1.self_attn.attn")
    assert conn.calls == [("init", ("config", "worker", "kv")),
                          ("wait", "model.layers.0.self_attn.attn"), ("sleep", 0.0025),
                          ("wait", "model.layers.1.self_attn.attn"), ("sleep", 0.0025)]


def test_without_a_stand_in_the_wait_is_the_connectors_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(standin.COMPUTE_ENV, raising=False)
    conn = _Timed("config", "worker")
    monkeypatch.setattr(standin.time, "sleep", lambda s: conn.calls.append(("sleep", s)))
    conn.wait_for_layer_load("l0")
    assert conn.calls[1:] == [("wait", "l0")]


@pytest.mark.parametrize("bad", ["fast", "-1", "nan"])
def test_a_bad_stand_in_is_a_value_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(standin.COMPUTE_ENV, bad)
    with pytest.raises(ValueError, match=standin.COMPUTE_ENV):
        _Timed("config", "worker")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="StandInNixlConnector"):
        standin.StandInNixlConnector  # noqa: B018
