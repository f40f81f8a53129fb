"""Negative controls: wrappers that break correctness on purpose.

A test that passes with a control switched on proves nothing; each control
here must make a restore inexact, and the tests check that it does. They
live outside the engine: production code never consults them.

* :class:`SkipLayerWaits` wraps a model so that its forward does not call
  the engine's per-layer wait (the forward may read layers that have not
  landed). Switch it with ``enabled``.
* ``FaultyStore.skip_reads(component)`` (in :mod:`.faults`) makes the ranged
  reads of one component return without writing a byte: the recurrent state
  (or a KV kind) is "restored" from whatever the slots held.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SkipLayerWaits"]


class SkipLayerWaits:
    """A model wrapper whose forward skips the engine's per-layer waits while
    ``enabled``; every other attribute is the wrapped model's."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.enabled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, requests: Any, pool: Any, before_layer: Any, after_layer: Any) -> Any:
        if not self.enabled:
            return self.inner.forward_batch(requests, pool, before_layer, after_layer)
        return self.inner.forward_batch(requests, pool, _no_wait, after_layer)


def _no_wait(layer: int) -> None:
    return None
