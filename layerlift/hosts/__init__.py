"""Adapters that put LayerLift inside a host serving framework.

One package per host (``layerlift.hosts.sglang``, ``layerlift.hosts.vllm``),
each importing its host only when loaded, so ``import layerlift`` never needs
one; the two never import each other. A host's vocabulary stops at its
package: inside, LayerLift's own types (keys, page objects with per-layer
checksums, lanes, readiness) carry the data.
"""

from __future__ import annotations

__all__: list[str] = []
