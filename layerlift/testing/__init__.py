"""Test support (never imported by production code).

* :mod:`.faults`: :class:`FaultyStore` wraps any store (a real Mooncake
  client included) and injects delays, failures and skipped reads;
* :mod:`.controls`: negative controls (:class:`SkipLayerWaits`);
* :mod:`.kl`: the one KL helper (:func:`kl_divergence`) and its thresholds.
"""

from __future__ import annotations

from layerlift.testing.controls import SkipLayerWaits
from layerlift.testing.faults import FaultyStore, LayerFault
from layerlift.testing.kl import KL_EXACT, KL_WRONG, kl_divergence

__all__ = [
    "KL_EXACT",
    "KL_WRONG",
    "FaultyStore",
    "LayerFault",
    "SkipLayerWaits",
    "kl_divergence",
]
