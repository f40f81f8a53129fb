"""Adapters that put LayerLift inside a host serving framework.

One module per host (``layerlift.hosts.sglang``, ``layerlift.hosts.vllm``),
each importing its host only when loaded, so ``import layerlift`` never needs
one. A host's vocabulary stops at its module: inside, LayerLift's own types
(keys, page objects with per-layer checksums, lanes, readiness) carry the data.
"""

from __future__ import annotations

__all__: list[str] = []
