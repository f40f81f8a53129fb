"""LayerLift inside SGLang: ``layerlift.hosts.sglang:LayerLiftLinker``.

Tested against SGLang 0.5.23 (its ``UnifiedCacheLinker`` interface, loaded by
the ``dynamic`` external-linker backend). Importing this package imports
SGLang. Modules: ``linker`` (the linker class and its promises), ``settings``
(``linker_extra_config``), ``layout`` (SGLang's pools as LayerLift byte
layouts, the key fingerprint), ``load`` (per-layer loads and the load
counter), ``offload`` (the offload thread and the quarantine of corrupt
objects), ``lookup`` (the bound, breaker and budget of lookups). Loads and
offloads stream through ``linker/ring.py``'s staging rings (``linker/staged.py``).
SGLang's vocabulary (``PoolTransfer``, ``PoolName``) stops in this package.
"""

from __future__ import annotations

from .linker import LayerLiftLinker
from .settings import LinkerSettings

__all__ = ["LayerLiftLinker", "LinkerSettings"]
