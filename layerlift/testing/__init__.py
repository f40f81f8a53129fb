"""Test support (never imported by production code).

* :mod:`.faults`: :class:`FaultyStore` wraps any store (a real Mooncake
  client included) and injects delays, failures and skipped reads;
* :mod:`.controls`: negative controls (:class:`SkipLayerWaits`);
* :mod:`.kl`: the one KL helper (:func:`kl_divergence`) and its thresholds;
* :mod:`.netns`: hosts as network namespaces (:class:`NetnsHosts`) for
  multi-host tests and benchmarks.
"""

from __future__ import annotations

from layerlift.testing.controls import SkipLayerWaits
from layerlift.testing.faults import FaultyStore, LayerFault
from layerlift.testing.kl import KL_EXACT, KL_WRONG, kl_divergence
from layerlift.testing.netns import NetnsHosts, netns_available

__all__ = [
    "KL_EXACT",
    "KL_WRONG",
    "FaultyStore",
    "LayerFault",
    "NetnsHosts",
    "SkipLayerWaits",
    "kl_divergence",
    "netns_available",
]
