"""vLLM connectors with a forward compute stand-in, for ``layerlift bench vllm``.

On this project's CPU machine a layer's forward is the CPU's, far from what
a GPU node spends on it, so per-layer overlap has little to hide behind.
``layerlift bench vllm --compute-ms MS`` gives every connector it times the
same stand-in: each attention layer's ``wait_for_layer_load`` first does
what the connector does (LayerLift's waits for the layer's restore; vLLM's
``MooncakeStoreConnector`` has loaded the request before the step, its wait
returns at once), then sleeps ``MS`` milliseconds, as a layer computing on a
device would take (a sleep: no CPU). vLLM calls the wait before each
attention layer of every step with connector metadata, so the stand-in falls
on that step's forward of every connector alike.

The classes are named in ``kv_transfer_config`` (``kv_connector_module_path``
this module); the stand-in is read from :data:`COMPUTE_ENV` when a connector
is built (in vLLM's worker process, which inherits the serve's environment).
``StandInMooncakeStoreConnector`` is made on first use (vLLM's connector
module is imported only then).
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from layerlift.hosts.vllm import LayerLiftConnector

__all__ = ["COMPUTE_ENV", "StandInLayerLiftConnector", "compute_s"]

COMPUTE_ENV = "LAYERLIFT_BENCH_COMPUTE_MS"
_MSC_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"


def compute_s() -> float:
    """The stand-in per attention layer, in seconds (0 when :data:`COMPUTE_ENV`
    is unset). ``ValueError`` for a value that is not a number >= 0."""
    text = os.environ.get(COMPUTE_ENV, "").strip()
    if not text:
        return 0.0
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"{COMPUTE_ENV} must be milliseconds per layer, got {text!r}") from None
    if not ms >= 0:  # also refuses nan
        raise ValueError(f"{COMPUTE_ENV} must be >= 0 ms, got {text!r}")
    return ms / 1e3


class _StandIn:
    """The connector's own per-layer wait, then the stand-in's sleep."""

    _standin_s: float

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # vLLM's factory wants ``kv_cache_config`` by name in an external
        # connector's signature (its three-argument constructor).
        self._standin_s = compute_s()
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)  # type: ignore[misc]
        if self._standin_s > 0:
            time.sleep(self._standin_s)


class StandInLayerLiftConnector(_StandIn, LayerLiftConnector):
    """LayerLift's connector with the stand-in after each layer's wait."""


def __getattr__(name: str) -> Any:
    """``StandInMooncakeStoreConnector``, made from vLLM's connector on first use."""
    if name != "StandInMooncakeStoreConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = importlib.import_module(_MSC_MODULE).MooncakeStoreConnector
    cls = type(name, (_StandIn, base), {
        "__doc__": "vLLM's MooncakeStoreConnector with the stand-in after each layer's wait.",
        "__module__": __name__})
    globals()[name] = cls
    return cls
