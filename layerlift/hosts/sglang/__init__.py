"""LayerLift inside SGLang: ``layerlift.hosts.sglang:LayerLiftLinker``.

Tested against SGLang 0.5.23 (its ``UnifiedCacheLinker`` interface, loaded by
the ``dynamic`` external-linker backend). The linker class imports SGLang;
this package imports it only when ``LayerLiftLinker`` is first read (SGLang's
loader does ``getattr(module, "LayerLiftLinker")``), so its SGLang-free modules
(``layout``, ``load``, ``offload``, ``device``) import without SGLang (the
device-path tests and benchmark run so on a GPU machine lacking SGLang).
Modules: ``linker`` (the linker class and its promises), ``settings``
(``linker_extra_config``), ``layout`` (SGLang's pools as LayerLift byte
layouts, the key fingerprint), ``load`` (per-layer loads and the load
counter), ``offload`` (the offload thread and the quarantine of corrupt
objects), ``device`` (the device path: streams, events, gather/scatter),
``lookup`` (the bound, breaker and budget of lookups). Loads and
offloads stream through ``linker/ring.py``'s staging rings (``linker/staged.py``).
SGLang's vocabulary (``PoolTransfer``, ``PoolName``) stops in this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .settings import LinkerSettings

if TYPE_CHECKING:
    from .linker import LayerLiftLinker

__all__ = ["LayerLiftLinker", "LinkerSettings"]


def __getattr__(name: str) -> Any:
    if name == "LayerLiftLinker":
        from .linker import LayerLiftLinker

        return LayerLiftLinker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
